"""A native kernel library built and loaded at most once per process, shared by cpu/extension.py
and cuda/extension.py: its `torch.ops` namespace, or why there is none (callers then use their
torch fallback)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def loaded_and_checked(namespace: str, what: str, load: Callable[[], None],
                       smoke_test: Callable[[object], None]) -> dict[str, object]:
    """`load` the library (build it if need be), then `smoke_test` its `torch.ops.<namespace>`:
    {"ops": ...}, or {"reason": ...} when any step failed (a compiler, loader or smoke-test
    failure: the caller falls back to torch, and the log says why)."""
    try:
        load()
        ops = getattr(torch.ops, namespace)
        smoke_test(ops)
        return {"ops": ops}
    except Exception as exc:
        reason = f"{what} failed to build or run: {type(exc).__name__}: {exc}"
        log.warning("%s; using the torch fallback", reason)
        return {"reason": reason}


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
