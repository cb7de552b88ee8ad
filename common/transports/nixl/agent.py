"""NIXL itself: importing it (lazily, from whichever wheel is installed), making a UCX agent,
registering memory, and the descriptor arrays NIXL takes."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.transports import TransferError

log = logging.getLogger(__name__)

_BACKEND = "UCX"
# "none": shared-memory transports have no peer failure handler; with "peer" UCX refuses them.
_UCX_PARAMS = {"ucx_error_handling_mode": "none"}
# The wheels, built for CUDA 12 (the lock's, and the driver-agnostic choice on CPU machines) or
# CUDA 13 (hosts whose torch is a CUDA 13 build); `nixl` is the meta package that re-exports one.
_NIXL_MODULES = (("nixl_cu12", "nixl_cu12._bindings"), ("nixl_cu13", "nixl_cu13._bindings"),
                 ("nixl._api", "nixl._bindings"))
_INSTALL_HINT = (
    "install it with `pip install -c constraints.txt nixl-cu12` (torch stays pinned), "
    "or run with the TCP transport"
)


class NixlUnavailableError(ImportError):
    """NIXL (or its UCX backend) cannot be used on this machine; use the TCP transport."""


class PeerDisconnectedError(TransferError):
    """The target went away (process died, connection reset). The initiator has dropped the peer;
    ``connect`` again with the (new) metadata of the restarted target."""


_nixl: dict[str, Any] | None = None
_nixl_error: str | None = None
_import_lock = threading.Lock()


def load_nixl() -> dict[str, Any]:
    """Import NIXL once; returns its agent classes and its error types, or raises."""
    global _nixl, _nixl_error
    with _import_lock:
        if _nixl is not None:
            return _nixl
        if _nixl_error is None:
            errors = []
            for api, bindings in _NIXL_MODULES:
                try:
                    mod = __import__(api, fromlist=["nixl_agent"])
                    bind = __import__(bindings, fromlist=["nixlBackendError"])
                except (ImportError, OSError) as exc:  # OSError: a shared library failed to load
                    errors.append(f"{api}: {exc}")
                    continue
                _quiet_nixl_logger()
                _nixl = {
                    "agent": mod.nixl_agent,
                    "config": mod.nixl_agent_config,
                    "errors": tuple(getattr(bind, n) for n in dir(bind)
                                    if n.startswith("nixl") and n.endswith("Error")),
                    "disconnect": getattr(bind, "nixlRemoteDisconnectError", ()),
                    "not_found": getattr(bind, "nixlNotFoundError", ()),
                    "invalid": getattr(bind, "nixlInvalidParamError", ()),
                    "module": api,
                }
                return _nixl
            _nixl_error = "; ".join(errors)
    raise NixlUnavailableError(f"NIXL cannot be imported ({_nixl_error}); {_INSTALL_HINT}")


def _quiet_nixl_logger() -> None:
    # NIXL's Python layer logs every agent/backend creation at INFO to stdout; keep warnings only
    # unless the user asked for a level with NIXL_LOG_LEVEL.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def nixl_available() -> bool:
    """True if NIXL imports here (it does not check that UCX finds a usable transport)."""
    try:
        load_nixl()
    except NixlUnavailableError:
        return False
    return True


def nixl_unavailable_reason() -> str | None:
    """Why NIXL cannot be imported, or None if it can."""
    try:
        load_nixl()
    except NixlUnavailableError as exc:
        return str(exc)
    return None


def make_agent(name: str) -> Any:
    nx = load_nixl()
    try:
        agent = nx["agent"](name, nx["config"](enable_prog_thread=False, backends=[]))
        agent.create_backend(_BACKEND, dict(_UCX_PARAMS))
    except nx["errors"] + (RuntimeError,) as exc:
        raise NixlUnavailableError(
            f"NIXL loaded ({nx['module']}) but its UCX backend could not start: "
            f"{type(exc).__name__}: {exc} (UCX_TLS={os.environ.get('UCX_TLS', '<unset>')}); "
            f"use the TCP transport") from exc
    return agent


def check_tensor(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be in host memory or on a CUDA device, not on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous: it is registered as one byte range")
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")


def memory_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ("VRAM", GPU index) or ("DRAM", 0)."""
    if t.device.type != "cuda":
        return "DRAM", 0
    return "VRAM", t.device.index if t.device.index is not None else torch.cuda.current_device()


def register(agent: Any, t: torch.Tensor) -> Any:
    mem, dev = memory_of(t)
    return agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem)


def as_ranges(ranges: Sequence[tuple[int, int]] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(ranges, dtype=np.int64) if len(ranges) else np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what} must be a sequence of (address, nbytes) pairs")
    if len(arr) and (arr[:, 0].min() <= 0 or arr[:, 1].min() <= 0):
        raise ValueError(f"{what}: addresses and sizes must be positive")
    return arr


def descriptors(ranges: np.ndarray, device: int) -> np.ndarray:
    """NIXL's ``(N, 3)`` descriptor array: address, nbytes, device id."""
    descs = np.empty((len(ranges), 3), dtype=np.uint64)
    descs[:, :2], descs[:, 2] = ranges, device
    return descs


def agent_name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
