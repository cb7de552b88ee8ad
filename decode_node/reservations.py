"""The decode node's half of the three-call hand-off (`Reservations`): PrepareReceive reserves pages for a
prompt's window and says where its KV goes, StartGeneration claims the filled reservation into
the scheduler; and, for Generate, the same three calls run in process with a prefill node
(common/peers/hand_off.py, the policy the router runs too).

A reservation counts as admitted from PrepareReceive on (decode_node/admission.py), so
StartGeneration never finds the node full after the KV was moved.
"""
from __future__ import annotations

import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from common.daemon_limits import check_request_id
from common.engine.attention_window import layer_skips
from common.engine.core import Engine, Sequence
from common.engine.generation import Continuation, RequestHandle
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Scheduler
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from common.kv.page_allocator import OutOfPages
from common.node_messages import ReceiveWindow
from common.peers.hand_off import KvSource, hand_off
from common.peers.prefill_pool import PrefillPool
from common.serving.kv_tiers import KvTiers
from common.tracing import Tracer
from decode_node.admission import Admission, NotAdmitted
from decode_node.config import DecodeNodeConfig
from decode_node.migration import sample_request_id
from decode_node.request_table import HOLDING_RESERVATION, LiveRequest, RequestTable, Reservation, Status


@dataclass(eq=False)
class Reservations:
    config: DecodeNodeConfig
    engine: Engine
    scheduler: Scheduler
    requests: RequestTable
    admission: Admission
    prefill_pool: PrefillPool
    tiers: KvTiers
    tracer: Tracer
    check_prompt: Callable[[Seq[int]], list[int]]

    @contextmanager
    def admitting(self, request_id: str) -> Iterator[LiveRequest]:
        """A QUEUED entry for `request_id` (ALREADY_EXISTS while one is live) for the body to
        admit; if the body raises, the entry ends ABORTED. Call with the engine lock held, so no
        one else takes the id meanwhile."""
        if self.requests.get(request_id) is not None:
            raise AlreadyExists(f"request {request_id!r} is still live; use a new request_id or Abort it first")
        entry = self.requests.add(request_id)
        try:
            yield entry
        except BaseException:
            self.requests.move(entry, Status.ABORTED)
            raise

    def footprint(self, positions: int) -> int:
        """Pages a sequence of `positions` positions occupies at most (a sliding window caps it)."""
        pages = -(-positions // self.engine.page_size)
        window = self.engine.window
        return pages if window is None else min(pages, window.max_pages(self.engine.page_size))

    def admitted_sequence(self, request_id: str, tokens: list[int], end: int, receiving: bool,
                          use_prefix_cache: bool = True) -> tuple[Sequence, int]:
        """If admission lets it start now: a sequence holding the cached prefix of `tokens` and
        pages for positions up to `end`, and the first position it needs computed elsewhere
        (`receiving`: by a writer) or here. Else NotAdmitted, with nothing held."""
        seq = self.engine.new_sequence(request_id, tokens, use_prefix_cache)
        try:
            begin = self.engine.receive_begin(seq, end) if receiving else seq.num_computed
            self.admission.require_fit(self.engine.pages_needed(seq, end), len(tokens))
            try:  # a writer's window needs its sliding pages now; a local prefill, chunk by chunk
                self.engine.reserve(seq, end, window=receiving)
            except OutOfPages as exc:  # of the sliding group: require_fit counted the full pages
                raise NotAdmitted("pages", f"the KV pool's sliding group cannot hold this request's window now: "
                                           f"{exc} (--kv-sliding-pages)") from None
        except BaseException:
            self.engine.release(seq, cache=False)
            raise
        return seq, begin

    def prepare_receive(self, request_id: str, token_ids: Seq[int], kv_window_end: int | None,
                        cancelled: Callable[[], bool] = lambda: False,
                        deadline: float | None = None, writer: str = "computed") -> ReceiveWindow:
        """Reserve slots for positions [kv_window_begin, end) of the prompt: from the end of the
        cached prefix, or with a sliding window from the first position still attended. With
        --admission queue it waits for room until `cancelled()` or the `deadline` (monotonic).
        `writer`: where the window's KV will come from, as duet_prompt_tokens counts it (once the
        reservation is claimed: a hand-off that fails counts nothing)."""
        check_request_id(request_id)
        tokens = self.check_prompt(token_ids)
        n = len(tokens)
        end = -1 if kv_window_end is None else kv_window_end
        resolved = end + n if end < 0 else end
        if not 0 <= resolved < n:
            raise InvalidArgument(f"kv_window_end {end} resolves to {resolved}, outside [0, {n}) for a "
                                  f"{n}-token prompt (the decode node computes at least the last token)")
        read_back = self.tiers.read_back(request_id, tokens[:resolved], deadline)
        with self.engine.lock:
            with self.admitting(request_id) as entry:
                seq, begin = self.admission.admit(
                    entry, self.footprint(resolved), n,
                    lambda: self.admitted_sequence(request_id, tokens, resolved, receiving=True),
                    cancelled, deadline)
            matched = seq.num_computed
            placement = self.engine.placement(seq, begin, max(begin, resolved))
            lease_deadline = time.time() + self.config.lease_seconds
            entry.reservation = Reservation(seq, matched, resolved, placement, secrets.randbits(63), lease_deadline,
                                            from_disk=read_back.tokens, writer=writer)
            self.requests.move(entry, Status.RESERVED)
            if matched >= resolved:  # the prefix cache holds it all: nothing to send
                self.requests.move(entry, Status.RECEIVED)
        self.tracer.event(request_id, "prefix_matched", matched_tokens=matched, prompt_tokens=n)
        self.tracer.event(request_id, "pages_reserved", pages=len(seq.held_pages), slots=placement.full.num_slots)
        return ReceiveWindow(
            prompt_length=n, prefix_matched_length=matched, kv_window_begin=begin, kv_window_end=resolved,
            kv_append_metadata=placement.to_wire(), lease_deadline_unix=lease_deadline,
            transfer_nonce=entry.reservation.nonce)

    def start_generation(self, request_id: str, kv_window_begin: int, params: SamplingParams,
                         continuation: Continuation | None = None) -> RequestHandle:
        """Claim the received reservation and generate from it; with a `continuation` (a migrated
        request) claim each of its samples' reservations and continue them."""
        if params.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs needs the whole prompt computed on the decode node: send it "
                                  "with Generate (StartGeneration continues a prompt prefilled elsewhere)")
        with self.engine.lock:
            entry = self._received(request_id, kv_window_begin)
            r = entry.reservation
            if continuation is None:
                self._claim(entry)
                return self.requests.run(entry, params, self.scheduler.submit(request_id, r.seq, params))
            samples = [entry] + [self._received(sample_request_id(request_id, s.index, position))
                                 for position, s in enumerate(continuation.samples) if position]
            prompt = len(r.seq.token_ids) - len(continuation.samples[0].generated)
            for e, s in zip(samples, continuation.samples):
                tokens = e.reservation.seq.token_ids
                if prompt <= 0 or tokens[prompt:] != list(s.generated) or tokens[:prompt] != r.seq.token_ids[:prompt]:
                    raise InvalidArgument(f"the reservation {e.request_id!r} does not hold the prompt followed by "
                                          f"sample {s.index}'s generated_token_ids")
            for e in samples:
                self._claim(e)
            for e in samples[1:]:  # its pages now belong to the request's generation
                self.requests.move(e, Status.FINISHED)
            return self.requests.run(entry, params, self.scheduler.submit_continuation(
                request_id, [e.reservation.seq for e in samples], params, continuation))

    def _received(self, request_id: str, kv_window_begin: int | None = None) -> LiveRequest:
        """The reservation `request_id` (ending at `kv_window_begin` when given), if its KV is all here."""
        entry = self.requests.get(request_id)
        if entry is None or entry.status not in HOLDING_RESERVATION:
            raise NotFound(f"no reservation {request_id!r}: call PrepareReceive first (or it expired)")
        if kv_window_begin is not None and kv_window_begin != entry.reservation.end:
            raise InvalidArgument(f"kv_window_begin {kv_window_begin} must equal the reservation's "
                                  f"kv_window_end {entry.reservation.end}")
        if entry.status is not Status.RECEIVED:
            raise FailedPrecondition(f"the KV transfer for {request_id!r} has not completed yet")
        return entry

    def _claim(self, entry: LiveRequest) -> None:
        r = entry.reservation
        skipped = max(layer_skips(self.engine.model.config, r.begin, r.end)) if r.prefix_matched < r.end else 0
        if skipped:  # a writer moved [begin, end), a hybrid model's sliding layers only their window
            r.seq.partial_kv_before = max(r.seq.partial_kv_before, r.begin + skipped)
        r.seq.num_computed = max(r.prefix_matched, r.end)
        self.tiers.served(r.end, min(r.prefix_matched, r.end), r.from_disk, r.writer)
        self.requests.move(entry, Status.RUNNING)

    def generate_remote(self, request_id: str, tokens: list[int], params: SamplingParams,
                        cancelled: Callable[[], bool], deadline: float | None, prefiller: str | None = None, source: KvSource | None = None,
                        end: int | None = None) -> tuple[RequestHandle | None, bool]:
        """The three calls with a prefill node (or another `source`: a decode node holding the
        prefix up to `end`, decode_node/prefix_fetch.py): the handle, or None when the KV did not
        arrive; and whether the request was aborted meanwhile (then Generate must not prefill it here)."""
        steps = _InProcessSteps(self, request_id, tokens, params, cancelled, deadline, end,
                                writer="computed" if source is None else "peer")
        handle = hand_off(request_id, tokens, steps, source or self.prefill_pool, self.tracer, prefiller,
                          span="remote_prefill" if source is None else "prefix_fetch")
        return handle, steps.entry is not None and steps.entry.status is Status.ABORTED


class _InProcessSteps:
    """The hand-off's steps as the decode node runs them on itself."""

    def __init__(self, node: Reservations, request_id: str, tokens: list[int], params: SamplingParams,
                 cancelled: Callable[[], bool], deadline: float | None, end: int | None, writer: str) -> None:
        """`end`: where the received window ends (None: where --pd-balance puts it)."""
        self.decode_address = node.config.advertise_address
        self._node, self._request_id, self._tokens, self._params = node, request_id, tokens, params
        self._cancelled, self._deadline = cancelled, deadline
        self._end, self._writer = end, writer
        self.entry: LiveRequest | None = None

    def prepare(self) -> ReceiveWindow | None:
        n = len(self._tokens)
        end = min(int((1 - self._node.config.pd_balance) * n), n - 1) if self._end is None else self._end
        try:
            p = self._node.prepare_receive(self._request_id, self._tokens, end, self._cancelled, self._deadline,
                                           self._writer)
        except ResourceExhausted:
            return None  # local prefill queues in the scheduler (or admission) instead of refusing
        self.entry = self._node.requests.get(self._request_id)
        return p

    def still_wanted(self) -> bool:
        return self._node.requests.holds_reservation(self.entry) and not self._cancelled()

    def release(self) -> None:
        with self._node.engine.lock:
            if self._node.requests.holds_reservation(self.entry):
                self._node.requests.move(self.entry, Status.FAILED)

    def start(self, kv_window_begin: int) -> RequestHandle | None:
        try:
            return self._node.start_generation(self._request_id, kv_window_begin, self._params)
        except (NotFound, FailedPrecondition):  # expired or aborted meanwhile
            self.release()
            return None
