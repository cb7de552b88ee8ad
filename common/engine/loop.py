"""A thread that runs engine steps while there is work, sleeping on a condition of the
engine's lock otherwise; the base of the decode and prefill schedulers."""
from __future__ import annotations

import threading

from common.engine.core import Engine


class EngineLoop:
    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.lock = engine.lock
        self._wakeup = threading.Condition(self.lock)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping (after the step in progress), then `_on_stop` with the lock held."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        self._thread.join()
        with self.lock:
            self._on_stop()

    def notify(self) -> None:
        """Wake the loop after adding work."""
        with self._wakeup:
            self._wakeup.notify()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._has_work() and not self._stopped:
                    self._wakeup.wait()
                if self._stopped:
                    return
            self._step()

    # ---- for subclasses ----

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _step(self) -> None:
        """One iteration; takes the lock itself where it touches shared state."""
        raise NotImplementedError

    def _on_stop(self) -> None:
        raise NotImplementedError
