"""Batches concurrent RemoteSends into chunked prefill steps and pushes K/V layer by layer.

Each step runs one forward over chunks of several jobs within the token budget. As soon as a
layer of that forward has written its K/V into this node's pool, the part of every job's
window `[begin, end)` computed in this step is posted to its transfer session, so the bytes
travel while later layers compute. Positions this node already held in its prefix cache are
posted before the first step, from the cached pages.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from common.engine.core import Engine, Sequence, locked
from common.engine.loop import EngineLoop
from common.errors import Internal, RequestError, ResourceExhausted, Unavailable
from common.kv.page_allocator import OutOfPages
from common.kv.segments import slot_range
from common.tracing import Tracer
from common.transports.connector import Transfer
from common.transports.layer_slots import layer_pieces
from common.transports.pieces import Piece

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    seq: Sequence  # this node's sequence for token_ids[:end]
    begin: int
    dst: list[np.ndarray]  # per layer, the receiving node's slots of what it moves (receiver_layer_slots)
    session: Transfer
    skips: tuple[int, ...]  # per layer, leading positions of [begin, end) it does not move (layer_skips)
    prefilled: threading.Event = field(default_factory=threading.Event)
    error: RequestError | None = None
    cancelled: bool = False
    first_posted: float | None = None  # time.perf_counter() when a first layer went to the session

    @property
    def end(self) -> int:
        return len(self.seq.token_ids)

    def layer_pieces(self, engine: Engine, start: int, stop: int) -> list[list[Piece]]:
        """Per layer, the pieces moving positions `[start, stop) ∩ [begin, end)` of what that
        layer sends."""
        start, stop = max(start, self.begin), min(stop, self.end)
        if start >= stop:
            return [[] for _ in self.skips]
        src = slot_range(self.seq.pages, engine.page_size, start, stop)
        sliding = engine.sliding
        return layer_pieces(src, start - self.begin, self.skips, engine.pool.sliding_layers,
                            None if sliding is None else sliding.slots, self.dst)


class PrefillScheduler(EngineLoop):
    def __init__(self, engine: Engine, max_batch_tokens: int, tracer: Tracer, adaptive_threads: bool = False) -> None:
        super().__init__(engine, name="prefill-scheduler", adaptive_threads=adaptive_threads)
        self.max_batch_tokens = max_batch_tokens
        self.tracer = tracer
        self._jobs: list[PrefillJob] = []  # admitted (pages reserved), in arrival order
        self._waiting: list[PrefillJob] = []  # waiting for pages
        self._in_flight: list[PrefillJob] = []  # in the forward running now

    def _on_stop(self) -> None:
        for job in self._jobs + self._waiting:
            job.error = Unavailable("the prefill node is shutting down")
            job.prefilled.set()
        self._jobs.clear()
        self._waiting.clear()

    def submit(self, job: PrefillJob) -> None:
        with self.lock:
            self._waiting.append(job)
            self.notify()

    def release(self, job: PrefillJob, cache: bool) -> None:
        """Drop the job and its pages. A job inside the running forward is released when that
        forward ends, so its pages are never handed out while the model still writes them."""
        with self.lock:
            for queue in (self._jobs, self._waiting):
                if job in queue:
                    queue.remove(job)
            if job in self._in_flight:
                job.cancelled = True
            else:
                self.engine.release(job.seq, cache=cache)

    @locked
    def num_jobs(self) -> int:
        return len(self._jobs) + len(self._waiting)

    @locked
    def pending_tokens(self) -> int:
        return sum(j.seq.num_pending for j in self._jobs + self._waiting)

    @locked
    def _admit(self) -> None:
        """Reserve pages for waiting jobs in order."""
        while self._waiting:
            job = self._waiting[0]
            try:  # the sliding group's pages are held chunk by chunk (_step)
                self.engine.reserve(job.seq, job.end, window=False)
            except OutOfPages:
                if not self._jobs:  # nothing will free pages: it can never fit
                    self._waiting.pop(0)
                    job.error = ResourceExhausted("the prefill node's KV pool cannot hold this prompt")
                    job.prefilled.set()
                    continue
                return
            self._waiting.pop(0)
            self._jobs.append(job)
            # Positions served by this node's prefix cache travel now, from the cached pages.
            for layer, cached in enumerate(job.layer_pieces(self.engine, 0, job.seq.num_computed)):
                self._trace_posted(job, layer, cached, source="prefix_cache")
                job.session.post_layer(layer, cached)

    def _hold_window(self, job: PrefillJob, n: int, nothing_runs: bool) -> bool:
        """Whether the sliding group (a hybrid model's, common/engine/core.py) holds the pages of
        `job`'s next `n` positions; a job that cannot get them while nothing else runs fails."""
        try:
            self.engine.hold_window(job.seq, job.seq.num_computed + n)
            return True
        except OutOfPages:
            if nothing_runs:
                self._jobs.remove(job)
                job.error = ResourceExhausted("the prefill node's --kv-sliding-pages cannot hold a chunk of "
                                              f"{n} positions beside its sliding window")
                job.prefilled.set()
            return False

    def _has_work(self) -> bool:
        return bool(self._jobs or self._waiting)

    def _step(self) -> int:
        with self.lock:
            self._admit()
            work, budget = [], self.max_batch_tokens
            for job in self._jobs:
                n = min(job.seq.num_pending, budget)
                if n == 0 or not self._hold_window(job, n, nothing_runs=not work):
                    break
                work.append((job, n, job.layer_pieces(self.engine, job.seq.num_computed, job.seq.num_computed + n)))
                budget -= n
            self._in_flight = [job for job, _, _ in work]
        if not work:
            time.sleep(0.001)
            return 0

        def push(layer: int) -> None:
            for job, _, pieces in work:
                if pieces[layer]:
                    self._trace_posted(job, layer, pieces[layer], source="forward")
                    job.session.post_layer(layer, pieces[layer])

        started, started_unix = time.perf_counter(), time.time()
        try:
            self.engine.forward([(job.seq, n) for job, n, _ in work], on_layer_done=push, logits=False)
        except Exception as exc:
            log.exception("prefill forward failed")
            for job, _, _ in work:
                job.error = Internal(f"prefill failed: {exc}")
        elapsed, batch_tokens = time.perf_counter() - started, sum(n for _, n, _ in work)
        for job, n, _ in work:
            self.tracer.record(job.seq.seq_id, "prefill_chunk", started_unix, elapsed, tokens=n,
                               batch_tokens=batch_tokens)
        with self.lock:
            self._in_flight = []
            for job, _, _ in work:
                if job.cancelled:
                    self.engine.release(job.seq, cache=False)
                    continue
                # A sliding window frees the pages no later chunk attends and the transfer never reads.
                self.engine.trim_to_window(job.seq, keep_from=job.begin)
                if job.error or job.session.failed or job.seq.num_pending == 0:
                    if job in self._jobs:
                        self._jobs.remove(job)
                    job.prefilled.set()
        return batch_tokens

    def _trace_posted(self, job: PrefillJob, layer: int, pieces: list[Piece], source: str) -> None:
        """One layer's K/V of `job` about to be handed to its transfer session (traced first: the
        session's sender thread may report the layer done before `post_layer` returns)."""
        if pieces:
            if job.first_posted is None:
                job.first_posted = time.perf_counter()
            slots = sum(p.num_slots for p in pieces)
            self.tracer.event(job.seq.seq_id, "transfer_layer_posted", layer=layer, slots=slots,
                              bytes=2 * slots * self.engine.pool.slot_bytes(), source=source)
