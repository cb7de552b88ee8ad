"""A thread that runs engine steps while there is work, sleeping on a condition of the
engine's lock otherwise; the base of the decode and prefill schedulers.

The thread fixes its intra-op thread count at torch's count as it stands when the loop starts
(torch reads it once per thread, at its first parallel work): a daemon then lowers the count to
one for every other thread (common/serving/placement.py), and the engine keeps its cores. With
`adaptive_threads` the count then follows the cores the engine gets while neighbours come and go
(common/engine/compute_threads.py)."""
from __future__ import annotations

import threading
import time

from common.engine.compute_threads import ComputeThreads
from common.engine.core import Engine
from cpu import extension as cpu_extension


class EngineLoop:
    def __init__(self, engine: Engine, name: str, adaptive_threads: bool = False) -> None:
        self.engine = engine
        self.adaptive_threads = adaptive_threads
        self.threads: ComputeThreads | None = None  # set once the thread started
        self.lock = engine.lock
        self._wakeup = threading.Condition(self.lock)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._threads_fixed = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._threads_fixed.wait()

    def stop(self) -> None:
        """Stop stepping (after the step in progress), then `_on_stop` with the lock held."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join()
        with self.lock:
            self._on_stop()

    def compute_threads(self) -> int:
        """The threads the engine computes with now (0 before the loop started)."""
        return 0 if self.threads is None else self.threads.current

    def notify(self) -> None:
        """Wake the loop after adding work."""
        with self._wakeup:
            self._wakeup.notify()

    def _run(self) -> None:
        try:
            threads = ComputeThreads(cpu_extension.claim_intra_op_threads(self.engine.model.device),
                                     adaptive=self.adaptive_threads)
            threads.start()
            self.threads = threads
        finally:
            self._threads_fixed.set()
        while True:
            with self._wakeup:
                while not self._has_work() and not self._stopped:
                    self._wakeup.wait()
                if self._stopped:
                    return
            began = time.perf_counter()
            tokens = self._step()
            threads.after_step(time.perf_counter() - began, tokens)

    # ---- for subclasses ----

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _step(self) -> int:
        """One iteration; takes the lock itself where it touches shared state. Returns the tokens
        its forward computed (0 for none): steps of the same size take the same time."""
        raise NotImplementedError

    def _on_stop(self) -> None:
        raise NotImplementedError
