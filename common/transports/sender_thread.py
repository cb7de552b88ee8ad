"""What every transport's transfer shares: the forward thread queues each finished layer, a
sender thread moves it, so compute and transfer overlap. A failure on the sender thread is kept,
never raised there (a sender thread that died silently would let a transfer be confirmed with
layers never written), and items queued after it are skipped; the transport's `finish` reports it.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from common.kv.pool import KVPool


class SenderThread:
    """A transfer's deadline, its queue and the thread draining it into `_take`, which a
    transport defines; `_stop` ends the thread once what is queued has been taken."""

    def __init__(self, pool: KVPool, timeout_s: float, on_layer_done: Callable[[int], None], name: str) -> None:
        self._pool = pool
        self._on_layer_done = on_layer_done
        self._deadline = time.monotonic() + timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        """A post already failed: the transfer cannot succeed any more."""
        return self._error is not None

    def _take(self, item: object) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                self._take(item)

    def _stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _remaining(self) -> float:
        """Seconds left before the transfer's deadline (a sliver at least, so a timeout fires)."""
        return max(0.001, self._deadline - time.monotonic())
