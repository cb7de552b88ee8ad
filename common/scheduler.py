"""Continuous-batching scheduler: the single-node engine loop the decode node runs.

Every step runs one forward that holds one token for each decoding request and, within the
token budget, prefill chunks of requests still prefilling (oldest first), so a long prompt
never stalls the running decodes for more than one chunk. Requests join and leave between
steps. When the pool runs out of pages mid-decode, the newest request is preempted: its
pages go to the prefix cache and it is recomputed later (usually from those cached pages).
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from common.detokenizer import IncrementalDetokenizer
from common.engine import Engine, Sequence
from common.engine_loop import EngineLoop
from common.page_allocator import OutOfPages
from common.sampling import Sampler, SamplingParams
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a generation. The last chunk of a request has `finish_reason`
    set ("stop", "length", "abort" or "error") and carries `usage`."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # With finish_reason "error": a gRPC status name ("RESOURCE_EXHAUSTED", "INTERNAL") and why.
    error_code: str | None = None
    error: str | None = None


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    prompt_len: int
    cached_tokens: int
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    num_generated: int = 0


class RequestHandle:
    def __init__(self, request_id: str, outputs: queue.SimpleQueue) -> None:
        self.request_id = request_id
        self._outputs = outputs

    def next_chunk(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None if none arrived within `timeout` seconds."""
        try:
            return self._outputs.get(timeout=timeout)
        except queue.Empty:
            return None


class Scheduler(EngineLoop):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch_tokens: int = 512) -> None:
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        super().__init__(engine, name="scheduler")
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self._active: list[_Request] = []  # admission order
        self._aborts: set[str] = set()

    # ---- public API (any thread) ----

    def _on_stop(self) -> None:
        """Abort everything still running."""
        for r in list(self._active):
            self._finish(r, [], "", "abort")

    def submit(self, request_id: str, seq: Sequence, params: SamplingParams) -> RequestHandle:
        """Queue `seq` (its first `num_computed` positions already in the pool) for generation."""
        r = _Request(
            request_id, seq, params, Sampler(params),
            IncrementalDetokenizer(self.tokenizer, params.stop),
            prompt_len=len(seq.token_ids), cached_tokens=seq.num_cached,
        )
        with self._wakeup:
            if self._stopped:
                raise RuntimeError("the scheduler is shutting down")
            self._active.append(r)
            self.notify()
        return RequestHandle(request_id, r.outputs)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False if it is not running here."""
        with self._wakeup:
            if not any(r.request_id == request_id for r in self._active):
                return False
            self._aborts.add(request_id)
            self.notify()
            return True

    def is_active(self, request_id: str) -> bool:
        with self.lock:
            return any(r.request_id == request_id for r in self._active)

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens of admitted requests not yet computed."""
        with self.lock:
            return sum(r.seq.num_pending for r in self._active if r.seq.num_pending > 1)

    def num_active(self) -> int:
        with self.lock:
            return len(self._active)

    # ---- the loop ----

    def _has_work(self) -> bool:
        return bool(self._active)

    def _step(self) -> None:
        with self.lock:
            self._apply_aborts()
            work = self._plan_step()
        if not work:
            time.sleep(0.001)
            return
        try:
            logits = self.engine.forward([(r.seq, n) for r, n in work])
        except Exception as exc:  # a bug or a bad model state must not kill the daemon
            log.exception("forward failed")
            with self.lock:
                for r, _ in work:
                    self._fail(r, "INTERNAL", f"internal error in the model forward: {exc}")
            return
        with self.lock:
            for (r, _), row in zip(work, logits):
                if r.seq.num_pending == 0 and r in self._active:
                    try:
                        self._emit_token(r, r.sampler.sample(row))
                    except Exception as exc:  # one request's bad sample must not stop the loop
                        log.exception("sampling failed", extra={"fields": {"request_id": r.request_id}})
                        self._fail(r, "INTERNAL", f"sampling failed: {exc}")

    def _apply_aborts(self) -> None:
        for r in [r for r in self._active if r.request_id in self._aborts]:
            self._finish(r, [], "", "abort")
        self._aborts.clear()

    def _plan_step(self) -> list[tuple[_Request, int]]:
        """Pick this step's work and reserve its pages (called with the lock held)."""
        work: list[tuple[_Request, int]] = []
        budget = self.max_batch_tokens
        decoding = [r for r in self._active if r.seq.num_pending == 1]
        prefilling = [r for r in self._active if r.seq.num_pending > 1]
        for r in decoding:
            if budget == 0 or r not in self._active:  # preempted by an earlier reservation
                continue
            if self._reserve(r, 1):
                work.append((r, 1))
                budget -= 1
        for r in prefilling:
            n = min(r.seq.num_pending, budget)
            if n == 0:
                break
            if r not in self._active:
                continue
            if not r.seq.pages:  # preempted earlier
                self.engine.attach_cached_prefix(r.seq)
                n = min(r.seq.num_pending, budget)
            if self._reserve(r, n, preempt=False):
                work.append((r, n))
                budget -= n
        if not work and self._active:
            # Nothing fits and nothing runs that could free pages: refuse the oldest request.
            self._fail(self._active[0], "RESOURCE_EXHAUSTED",
                       "the KV pool cannot hold this request; send a shorter prompt or fewer max_tokens")
        return work

    def _reserve(self, r: _Request, n: int, preempt: bool = True) -> bool:
        """Reserve pages for `n` more positions of `r`, preempting newer requests if allowed."""
        while True:
            try:
                self.engine.reserve(r.seq, r.seq.num_computed + n)
                return True
            except OutOfPages:
                victims = [v for v in self._active if v is not r and v.seq.pages]
                if not preempt or not victims:
                    return False
                self._preempt(victims[-1])

    def _preempt(self, r: _Request) -> None:
        log.info("preempting %s: KV pool full", r.request_id)
        # Its pages stay in the prefix cache; it re-attaches them when it is scheduled again.
        self.engine.release(r.seq)
        self._active.remove(r)
        self._active.append(r)

    def _emit_token(self, r: _Request, token: int) -> None:
        r.seq.token_ids.append(token)
        r.num_generated += 1
        p = r.params
        eos = not p.ignore_eos and token == self.tokenizer.eos_token_id
        text = "" if eos else r.detok.push(token)
        reason = None
        if eos or token in p.stop_token_ids or r.detok.finished_by_stop is not None:
            reason = "stop"
        elif r.num_generated >= p.max_tokens or len(r.seq.token_ids) >= self.engine.model.config.max_position_embeddings:
            reason = "length"
        if reason is None:
            r.outputs.put(Chunk([token], text))
        else:
            self._finish(r, [token], text + r.detok.flush(), reason)

    def _finish(self, r: _Request, tokens: list[int], text: str, reason: str,
                error_code: str | None = None, error: str | None = None) -> None:
        self.engine.release(r.seq, cache=reason != "error")
        if r in self._active:
            self._active.remove(r)
        usage = Usage(r.prompt_len, r.num_generated, r.cached_tokens)
        r.outputs.put(Chunk(tokens, text, reason, usage, error_code, error))

    def _fail(self, r: _Request, code: str, message: str) -> None:
        self._finish(r, [], "", "error", code, message)

