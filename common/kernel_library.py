"""A native kernel library built and loaded at most once per process, shared by cpu/extension.py
and cuda/extension.py: its `torch.ops` namespace, or why there is none (callers then use their
torch fallback)."""
from __future__ import annotations

import threading
from collections.abc import Callable


class KernelLibrary:
    """`load` runs on the first call only and returns {"ops": ...} or {"reason": ...}."""

    def __init__(self, load: Callable[[], dict[str, object]]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}  # "ops" or "reason", once decided

    def kernels(self) -> object | None:
        """The library's ops once built and loaded, or None (see :meth:`unavailable_reason`)."""
        with self._lock:
            if not self._state:
                self._state.update(self._load())
            return self._state.get("ops")

    def unavailable_reason(self) -> str | None:
        """Why :meth:`kernels` returns None, or None when the kernels are in use."""
        self.kernels()
        return self._state.get("reason")  # type: ignore[return-value]
