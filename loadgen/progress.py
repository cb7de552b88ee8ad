"""A one-line progress bar on stderr, redrawn in place."""
from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30
MIN_REDRAW_S = 0.1


class Progress:
    def __init__(self, total: int, label: str, stream: TextIO | None = sys.stderr) -> None:
        """stream=None draws nothing."""
        self.total, self.label, self.stream = total, label, stream
        self.done = self.failed = 0
        self._started = time.perf_counter()
        self._drawn = 0.0

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.done == self.total or now - self._drawn >= MIN_REDRAW_S:
            self._drawn = now
            self._draw(now)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        if self.stream is None:
            return
        filled = WIDTH * self.done // self.total
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
                          f"({self.failed} failed) {now - self._started:.1f}s")
        self.stream.flush()
