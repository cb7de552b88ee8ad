"""Admission to the decode node: may a request take KV pages now, and, with `--admission
queue`, the bounded FIFO of requests waiting until it may.

The policy follows the reference's (MLC-LLM's `CanPrefill`), with our watermark. A request is
admitted when
  - fewer than `--max-running-requests` requests are admitted (generating, queued in the
    scheduler, or holding a PrepareReceive reservation),
  - the tokens of the admitted requests (prompt plus tokens generated so far) plus its prompt
    stay within `--max-total-tokens` (when set), and
  - the pages it still needs (beyond its cached prefix) fit in the free pages plus the prefix
    cache's evictable ones, less `--admission-watermark` of the pool kept for running decodes
    to grow into. Evictable pages count as available because `Engine.reserve` evicts them
    (LRU first), so a pool full of cold cached pages admits without refusing or queuing.

What does not fit is refused with RESOURCE_EXHAUSTED (`--admission reject`), or waits
(`--admission queue`). Waiting is strict FIFO: only the head of the queue is tried, and a
newcomer queues behind waiters even when it would fit, so a big request at the head is never
starved by small ones behind it (the price is head-of-line blocking, as in the reference's
waiting queue). A request that could not fit even into an empty pool is refused at once.

Waiters sleep on the engine's `room_made` condition, which the engine notifies whenever pages
go back to the free list or turn evictable (common/engine/core.py), and which the head notifies
when it leaves the queue; they also wake every `POLL_SECONDS` to notice client cancellation,
their deadline or an Abort.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn, TypeVar

from common.engine.core import Engine, locked
from common.errors import Aborted, Cancelled, DeadlineExceeded, ResourceExhausted
from decode_node.config import DecodeNodeConfig
from decode_node.metrics import DecodeMetrics
from decode_node.request_table import LiveRequest
from common.serving.retry_hint import RetryHint

T = TypeVar("T")

POLL_SECONDS = 0.1


class NotAdmitted(Exception):
    """The request does not fit now. `reason` labels `duet_admission_refusals`; the message
    says why, for a person."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Admission:
    """`running` counts admitted requests; `admitted_tokens` sums their prompt and generated
    tokens. Guarded by the engine lock, like the pages it hands out."""

    def __init__(self, config: DecodeNodeConfig, engine: Engine, running: Callable[[], int],
                 admitted_tokens: Callable[[], int], metrics: DecodeMetrics,
                 retry_hint: RetryHint | None = None) -> None:
        """`retry_hint`: how long admitted requests stay, which tells a refused request when to come back."""
        self.queueing = config.admission == "queue"
        self.lock = engine.lock
        self._config = config
        self._engine = engine
        self._running = running
        self._admitted_tokens = admitted_tokens
        self._metrics = metrics
        self._retry_hint = retry_hint or RetryHint()
        self._waiters: deque[LiveRequest] = deque()

    def _kept_pages(self) -> int:
        return int(self._config.admission_watermark * self._engine.allocator.num_pages)

    def _refuse(self, reason: str, message: str, ahead: int = 1) -> NoReturn:
        """Refuse with RESOURCE_EXHAUSTED and the seconds until `ahead` admitted requests will
        have left; a request that can never run here gets no hint."""
        self._metrics.admission_refusals.labels(reason).inc()
        hint = None if reason == "too_large" else self._retry_hint.seconds(ahead, self._running())
        raise ResourceExhausted(message, retry_after=hint)

    @locked
    def check_room(self) -> None:
        """The hard cap, checked before anything else: `--max-requests` counts admitted
        requests plus those waiting for admission."""
        limit = self._config.max_requests
        if (held := self._running() + len(self._waiters)) >= limit:
            what = "running, queued or reserved" + (" or waiting for admission" if self.queueing else "")
            self._refuse("max_requests", f"{limit} requests are already {what} here (--max-requests); retry later",
                         ahead=held - limit + 1)

    @locked
    def require_fit(self, pages_needed: int, tokens: int) -> None:
        """Raise NotAdmitted unless a request that adds `pages_needed` pages and `tokens`
        tokens (its prompt) to the admitted ones may start now."""
        cap = self._config.running_cap
        if (running := self._running()) >= cap:
            raise NotAdmitted("running", f"{running} requests are already admitted here (--max-running-requests "
                              f"{cap})")
        token_cap = self._config.max_total_tokens
        if token_cap is not None and (held := self._admitted_tokens()) + tokens > token_cap:
            raise NotAdmitted("tokens", f"admitted requests hold {held} tokens and this prompt's {tokens} would pass "
                              f"--max-total-tokens {token_cap}")
        available = self._engine.allocator.num_free + self._engine.prefix_cache.evictable_pages()
        keep = self._kept_pages()
        if pages_needed > available - keep:
            raise NotAdmitted("pages", f"the KV pool cannot hold this request now: it needs {pages_needed} pages, "
                              f"{available} are available, {keep} kept for running decodes (--admission-watermark)")

    @locked
    def _check_possible(self, window_pages: int, tokens: int) -> None:
        """Refuse at once what an empty pool would not admit either, rather than queue it forever."""
        total = self._engine.allocator.num_pages
        limit = total - self._kept_pages()
        if window_pages > limit:
            self._refuse("too_large", f"this request needs {window_pages} KV pages but this node admits at most "
                         f"{limit} for one request (--kv-pages {total} less the --admission-watermark reserve), "
                         "so it can never run here: send a shorter prompt or use a node with more --kv-pages")
        token_cap = self._config.max_total_tokens
        if token_cap is not None and tokens > token_cap:
            self._refuse("too_large", f"this prompt has {tokens} tokens, more than --max-total-tokens {token_cap} "
                         "allows all admitted requests together, so it can never run here: send a shorter prompt")

    @locked
    def admit(self, entry: LiveRequest, window_pages: int, tokens: int, attempt: Callable[[], T],
              cancelled: Callable[[], bool] = lambda: False, deadline: float | None = None) -> T:
        """Run `attempt` (which takes the request's pages, or raises NotAdmitted after undoing
        what it did) once the request may start, and return its result. `window_pages` is how
        many pages the request occupies in all (its cached prefix included), `tokens` its
        prompt length. Rejecting: a NotAdmitted becomes RESOURCE_EXHAUSTED. Queuing: wait,
        FIFO, until admitted, `cancelled()`, the `deadline` (time.monotonic()) or an Abort of
        `entry` (the request, QUEUED meanwhile)."""
        if self.queueing:
            self._check_possible(window_pages, tokens)
        self.check_room()
        why = "earlier requests were waiting"
        if not self._waiters:
            try:
                return attempt()
            except NotAdmitted as exc:
                if not self.queueing:
                    self._refuse(exc.reason, f"{exc}; retry later")
                why = str(exc)
        if (waiting := len(self._waiters)) >= self._config.max_queued_requests:
            self._refuse("queue_full", f"{waiting} requests already wait for admission here "
                         "(--max-queued-requests); retry later", ahead=waiting - self._config.max_queued_requests + 1)
        return self._wait(entry, attempt, why, cancelled, deadline)

    def _wait(self, me: LiveRequest, attempt: Callable[[], T], why: str, cancelled: Callable[[], bool],
              deadline: float | None) -> T:
        """Queue `me` and wait for its turn; `why` says what kept it out so far."""
        self._waiters.append(me)
        self._metrics.admission_queue_depth.set(len(self._waiters))
        started = time.monotonic()
        try:
            while True:  # `admit` has just tried, or others are ahead: wait first
                left = None if deadline is None else deadline - time.monotonic()
                self._engine.room_made.wait(POLL_SECONDS if left is None else max(0.0, min(POLL_SECONDS, left)))
                if me.abort_requested:
                    raise Aborted(f"request {me.request_id!r} was aborted while waiting for admission")
                if cancelled():
                    raise Cancelled(f"request {me.request_id!r} was cancelled by the client while waiting for "
                                    "admission")
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        f"request {me.request_id!r} waited {time.monotonic() - started:.2f} s for admission and "
                        f"its deadline passed ({why}); retry later, with a longer deadline, or elsewhere")
                if self._waiters[0] is me:
                    try:
                        return attempt()
                    except NotAdmitted as exc:
                        why = str(exc)
        finally:
            self._waiters.remove(me)
            self._metrics.admission_queue_depth.set(len(self._waiters))
            self._metrics.admission_wait.observe(time.monotonic() - started)
            self._engine.room_made.notify_all()  # the next in line may fit now

    @locked
    def abort(self, entry: LiveRequest) -> None:
        """Make `entry`, waiting for admission, give up with ABORTED."""
        entry.abort_requested = True
        self._engine.room_made.notify_all()
