"""The decode node's request logic, independent of gRPC: its parts, Generate (handed to a prefill
node when that is worth it, else prefilled here), its load, and Abort.

The parts: `request_table.py` (every live request and its status), `admission.py` (may a
request take pages now), `reservations.py` (PrepareReceive, StartGeneration, and Generate's
hand-off to a prefill node), `writer_gate.py` (the transport handshake and the writers'
BeginTransfer and CompleteTransfer), `migration.py` (moving a running request to another decode node),
`lease_sweeper.py`, and the engine's continuous-batching scheduler.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq

from common.daemon_limits import check_prompt, check_request_id
from common.engine.core import Engine, Sequence
from common.engine.generation import Continuation, FinishReason, Group, RequestHandle
from common.engine.kv_offload import ReadBack
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Scheduler
from common.errors import Aborted, Cancelled, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from common.model.decoder import DecoderModel
from common.model.tokenizer import Tokenizer
from common.node_messages import MigrateResult, NodeLoad, PrefixHolder, ReceiveWindow, SendRequest, SendResult
from common.peers.hand_off import worth_remote
from common.peers.kv_writer import KvWriter
from common.peers.prefill_pool import PrefillPool
from common.serving.fingerprint import fingerprint_of
from common.serving.incarnation import INCARNATION
from common.serving.kv_tiers import KvTiers
from common.serving.pool_metrics import node_load
from common.tracing import Tracer
from common.transports import open_sender
from common.transports.metrics import TransferFailure
from decode_node.admission import Admission
from decode_node.config import DecodeNodeConfig
from decode_node.drain import Drain
from decode_node.reservations import Reservations
from decode_node.lease_sweeper import LeaseSweeper
from decode_node.metrics import DecodeMetrics
from decode_node.migration import Migrations
from decode_node.prefix_fetch import PrefixFetch
from decode_node.request_table import HOLDING_RESERVATION, LiveRequest, RequestTable, Status
from decode_node.writer_gate import WriterGate

log = logging.getLogger(__name__)
WAITING_STATUSES = (Status.QUEUED, *HOLDING_RESERVATION)  # what vllm:num_requests_waiting counts
# How long a continuation waits for the instance it supersedes to end (it ends at its next step).
SUPERSEDE_WAIT_S = 5.0

class DecodeNode:
    def __init__(self, config: DecodeNodeConfig, model: DecoderModel, tokenizer: Tokenizer,
                 on_draining: Callable[[], None] = lambda: None) -> None:
        """`on_draining()` is called when the node starts refusing new requests (its readiness ends)."""
        self.config = config
        self._on_draining = on_draining
        self.tokenizer = tokenizer
        self.engine = Engine(model, config.kv_pages, config.page_size, config.sliding_pages)
        self.tracer = Tracer(f"decode {config.advertise_address}", config.trace_requests)
        self.requests = RequestTable(self.engine)
        self.scheduler = Scheduler(self.engine, tokenizer, config.max_batch_tokens, tracer=self.tracer,
                                   max_step_ms=config.max_step_ms or None,
                                   speculative=config.speculative_config, on_finished=self._finished,
                                   adaptive_threads=config.threads is None)
        self.metrics = DecodeMetrics(self.engine, self.requests.reserved_pages,
                                     quarantined_pages=lambda: self.writer_gate.fences.quarantined_pages(),
                                     compute_threads=self.scheduler.compute_threads,
                                     running=lambda: self.requests.counts()[Status.RUNNING],
                                     waiting=lambda: sum(self.requests.counts()[s] for s in WAITING_STATUSES))
        self.scheduler.speculator.observers.append(self.metrics.observe_speculation)
        self.tiers = KvTiers(config, self.engine, self.tracer, self.metrics.registry)
        self.admission = Admission(
            config, self.engine, running=self.requests.admitted,
            admitted_tokens=lambda: self.scheduler.total_tokens() + self.requests.reserved_tokens(),
            metrics=self.metrics, retry_hint=self.requests.retry_hint)
        self.prefill_pool = PrefillPool(list(config.prefill), timeout_s=config.lease_seconds, tls=config.tls,
                                        policy=config.routing_policy)
        name = f"decode-{config.host}-{config.port}-{uuid.uuid4().hex[:8]}"
        self.writer_gate = WriterGate(config, self.engine, self.requests, self.metrics, self.tracer, name=name)
        # This node writes KV too: a running request's, into the decode node it migrates to.
        self.kv_writer = KvWriter(self.engine, open_sender(config.transport, self.engine.pool, f"{name}-sender"),
                                  fingerprint_of(model, self.engine.pool), config.advertise_address, config.tls)
        self.prefill_pool.on_load = lambda member: self.writer_gate.seen_run(member.address, member.load.incarnation)
        self.reservations = Reservations(config, self.engine, self.scheduler, self.requests, self.admission,
                                self.prefill_pool, self.tiers, self.tracer, self._check_prompt)
        self.migrations = Migrations(config, self.engine, self.scheduler, self.requests, self.kv_writer,
                                     self.metrics, self.tracer)
        self.prefix_fetch = PrefixFetch(config, self.engine, self.reservations, self.tiers, self.kv_writer, self.tracer)
        self.draining = False  # new requests are refused: the running ones move to --drain-to nodes
        self.scheduler.start()
        self._sweeper = LeaseSweeper(self.requests, self.writer_gate, self.metrics, self.tracer)

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def shutdown(self) -> None:
        self.prefill_pool.close()
        self.prefix_fetch.close()
        self._sweeper.stop()
        self.scheduler.stop()
        self.tiers.close()
        self.requests.end_all()
        self.kv_writer.close()
        self.writer_gate.close()

    def _finished(self, group: Group, reason: FinishReason) -> None:
        """The scheduler ended a request's instance `group` (called with the engine lock held)."""
        entry = self.requests.holding(group)
        if entry is not None:
            self.requests.move(entry, Status.ABORTED if reason is FinishReason.ABORT else Status.FINISHED)

    def _check_prompt(self, token_ids: Seq[int]) -> list[int]:
        config = self.engine.model.config
        return check_prompt(token_ids, config.vocab_size, config.max_position_embeddings)

    def _check_speculation(self, params: SamplingParams) -> None:
        try:
            self.config.speculative_config.check(params)
        except ValueError as exc:
            raise InvalidArgument(f"sampling: {exc}") from None

    # ---- the three-call flow (decode_node/reservations.py, decode_node/writer_gate.py) ----

    def prepare_receive(self, request_id: str, token_ids: Seq[int], kv_window_end: int | None,
                        cancelled: Callable[[], bool] = lambda: False,
                        deadline: float | None = None) -> ReceiveWindow:
        self._check_accepting()
        return self.reservations.prepare_receive(request_id, token_ids, kv_window_end, cancelled, deadline)

    def begin_transfer(self, request_id: str, nonce: int, metadata: list[int], writer: int = 0) -> None:
        self.writer_gate.begin(request_id, nonce, metadata, writer)

    def complete_transfer(self, request_id: str, nonce: int, abandoned: bool = False,
                          checksums: Seq[int] = ()) -> None:
        self.writer_gate.complete(request_id, nonce, abandoned, checksums)

    def start_generation(self, request_id: str, kv_window_begin: int, params: SamplingParams,
                         continuation: Continuation | None = None) -> RequestHandle:
        check_request_id(request_id)
        self._check_speculation(params)
        return self.reservations.start_generation(request_id, kv_window_begin, params, continuation)

    def send_prefix(self, request: SendRequest, timeout_s: float | None) -> SendResult:
        return self.prefix_fetch.send(request, timeout_s)

    def migrate(self, request_id: str, target_address: str) -> MigrateResult:
        return self.migrations.migrate(request_id, target_address)

    def drain(self) -> int:
        """Refuse new requests and migrate the running ones to the --drain-to nodes (decode_node/drain.py);
        returns how many moved."""
        if not self.config.drain_to:
            raise FailedPrecondition("this decode node was started without --drain-to: name the decode nodes its "
                                     "running requests may move to")
        self.draining = True
        self._on_draining()
        return Drain(self.config.drain_to, self.migrations, self.requests).run()

    def drain_before_stop(self) -> None:
        """Shutting down: with --drain-to, move the running requests away and relay their streams to the end."""
        if self.config.drain_to:
            moved = self.drain()
            log.info("drained: relaying the migrated streams to their end", extra={"fields": {
                "requests_migrated": moved, "relaying": self.migrations.in_flight()}})
            self.migrations.wait_idle()

    def _check_accepting(self) -> None:
        if self.draining:
            raise Unavailable("this decode node is draining (shutting down): send the request to another node")

    # ---- Generate ----

    def generate(self, request_id: str, token_ids: Seq[int], params: SamplingParams,
                 cancelled: Callable[[], bool] = lambda: False, deadline: float | None = None,
                 continuation: Continuation | None = None, prefiller: str | None = None,
                 prefix_holder: PrefixHolder | None = None) -> RequestHandle:
        """The one-call form: hand the prompt to a prefill node when that is worth it, else (or
        when no prefill node delivers) prefill locally, reusing the prefix cache either way.
        `cancelled` tells whether the caller gave up (then nothing more is started); with
        --admission queue it waits for room until then or the `deadline` (monotonic).
        A request for prompt logprobs is computed here from its first token (module docstring
        of common/engine/scheduler.py).
        With a `continuation` the prompt's generation continues here from the tokens another node
        generated, their context recomputed (with the prefix cache's help). `prefiller`: the
        prefill node a gateway named (x-prefiller-host-port); used when it is one of --prefill.
        `prefix_holder`: another decode node holding more of the prompt, fetched from first
        (decode_node/prefix_fetch.py)."""
        check_request_id(request_id)
        self._check_accepting()
        self._check_speculation(params)
        tokens = self._check_prompt(token_ids)
        if continuation is not None:
            return self._continue(request_id, tokens, params, continuation)
        scoring = params.prompt_logprobs is not None
        read_back = self.tiers.read_back(request_id, tokens[:-1], deadline) if not scoring else ReadBack()
        with self.engine.lock:
            self.admission.check_room()
            cached = self.engine.cached_length(tokens[:-1], len(tokens))
        if prefix_holder is not None and not scoring:
            handle, aborted = self.prefix_fetch.fetch(request_id, tokens, params, cancelled, deadline,
                                                      prefix_holder, cached)
            if aborted:
                raise Aborted(f"request {request_id!r} was aborted while its prefix was fetched")
            if handle is not None:
                return handle
        if worth_remote(len(tokens), cached, self.config.min_remote_prefill_tokens, scoring, self.prefill_pool):
            handle, aborted = self.reservations.generate_remote(request_id, tokens, params, cancelled, deadline,
                                                            self._named_prefiller(prefiller))
            if aborted:
                raise Aborted(f"request {request_id!r} was aborted during its hand-off to a prefill node")
            if handle is not None:
                return handle
        if cancelled():
            raise Cancelled(f"request {request_id!r} was cancelled by the client")
        with self.engine.lock:
            with self.reservations.admitting(request_id) as entry:
                seq = self._local_sequence(entry, tokens, cancelled, deadline, use_prefix_cache=not scoring)
            self.tracer.event(request_id, "prefix_matched", matched_tokens=seq.num_computed, prompt_tokens=len(tokens))
            self.tiers.served(len(tokens), seq.num_computed, read_back.tokens)
            return self.requests.run(entry, params, self.scheduler.submit(request_id, seq, params))

    def _continue(self, request_id: str, prompt: list[int], params: SamplingParams,
                  continuation: Continuation) -> RequestHandle:
        """Continue each sample of `continuation` from its prompt and output, computed here."""
        contexts = [self._check_prompt(prompt + list(s.generated)) for s in continuation.samples]
        self._supersede(request_id)
        read_backs = [self.tiers.read_back(request_id, tokens[:-1]) for tokens in contexts]
        with self.engine.lock:
            with self.reservations.admitting(request_id) as entry:
                self.admission.check_room()
            seqs = [self.engine.new_sequence(f"{request_id}#{s.index}", tokens)
                    for s, tokens in zip(continuation.samples, contexts)]
            for seq, read_back in zip(seqs, read_backs):
                self.tiers.served(len(seq.token_ids), seq.num_computed, read_back.tokens)
            self.tracer.event(request_id, "continued", samples=len(seqs),
                              context_tokens=len(contexts[0]), matched_tokens=seqs[0].num_computed)
            return self.requests.run(entry, params,
                                     self.scheduler.submit_continuation(request_id, seqs, params, continuation))

    def _supersede(self, request_id: str) -> None:
        """A continuation is the request resumed by a client that lost its stream; an instance
        of it still generating here is the one that stream fed (its cancellation, when the
        client's router died, lands at the next step; or this node took it over by a migration
        whose source then died). It is ended, so the continuation takes the id, instead of
        ALREADY_EXISTS; one in another state keeps the id (the wait is bounded)."""
        entry = self.requests.get(request_id)
        if entry is None:
            return
        if entry.handle is not None:
            self.cancel(entry.handle)
        deadline = time.monotonic() + SUPERSEDE_WAIT_S
        while self.requests.get(request_id) is not None and time.monotonic() < deadline:
            time.sleep(0.01)

    def _local_sequence(self, entry: LiveRequest, tokens: list[int], cancelled: Callable[[], bool],
                        deadline: float | None, use_prefix_cache: bool) -> Sequence:
        """Rejecting, the scheduler queues what the pool cannot hold yet (preempting as needed).
        Queuing, the prompt's pages (a sliding window's worth at most) are admitted and reserved
        up front, so requests wait in the admission queue rather than crowd the scheduler."""
        request_id = entry.request_id
        if not self.admission.queueing:
            self.admission.check_room()
            return self.engine.new_sequence(request_id, tokens, use_prefix_cache)
        n = len(tokens)
        pages = self.reservations.footprint(n)
        end = min(n, pages * self.engine.page_size)
        seq, _ = self.admission.admit(
            entry, pages, n,
            lambda: self.reservations.admitted_sequence(request_id, tokens, end, receiving=False,
                                                    use_prefix_cache=use_prefix_cache),
            cancelled, deadline)
        return seq

    def _named_prefiller(self, address: str | None) -> str | None:
        if address is None:
            return None
        known = address in {m.address for m in self.prefill_pool.members()}
        self.metrics.prefiller_header.labels("used" if known else "ignored").inc()
        return address if known else None

    # ---- load and abort ----

    def load(self) -> NodeLoad:
        with self.engine.lock:
            counts = self.requests.counts()
            return node_load(self.engine, kv_pages_reserved=self.requests.reserved_pages(),
                             kv_pages_quarantined=self.writer_gate.fences.quarantined_pages(),
                             running_requests=counts[Status.RUNNING], queued_requests=counts[Status.QUEUED],
                             queued_prefill_tokens=self.scheduler.pending_prefill_tokens(),
                             incarnation=INCARNATION)

    def abort(self, request_id: str) -> None:
        with self.engine.lock:
            entry = self.requests.get(request_id)
            if entry is None:
                raise NotFound(f"no live request {request_id!r}")
            self._abort(entry)

    def _abort(self, entry: LiveRequest) -> None:
        if entry.status is Status.QUEUED:
            self.admission.abort(entry)  # it gives up waiting, with ABORTED
        elif entry.status is Status.MIGRATING:
            self.migrations.abort(entry)
        elif entry.status in HOLDING_RESERVATION:
            if entry.status is Status.RECEIVING:
                self.metrics.transfers.failed(TransferFailure.ABORTED)
            self.requests.move(entry, Status.ABORTED)
            self.tracer.event(entry.request_id, "aborted", held="reservation")
        else:
            self.scheduler.abort(entry.handle)

    def cancel(self, handle: RequestHandle) -> None:
        """The client of `handle`'s stream went away: stop generating it, here or where it
        migrated. Only that instance: its request id may name a newer one by now."""
        if not self.scheduler.abort(handle):
            with self.engine.lock:
                entry = self.requests.holding(handle.group)
            if entry is not None:
                self.migrations.abort(entry)
