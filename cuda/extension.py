"""JIT build of the paged-KV CUDA kernels (paged_kv.cu + paged_kv_ops.cpp) as a torch extension.

Built once per process on first use, with `torch.utils.cpp_extension.load` (needs `nvcc`, `ninja`
and a CUDA build of torch), into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), so later processes only load the cached library. The GPU
architectures come from `TORCH_CUDA_ARCH_LIST` when set (e.g. `9.0` for Hopper: `-arch=sm_90`),
otherwise torch builds for the GPUs it sees. A failed build is not an error: :func:`kernels`
returns None, :func:`unavailable_reason` says why, and callers use the torch fallback.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (SOURCE_DIR / "paged_kv.cu", SOURCE_DIR / "paged_kv_ops.cpp")
KERNEL_SOURCE = SOURCES[0]
LIBRARY = "duet_paged_kv"
DISABLE_ENV = "DUET_DISABLE_CUDA_KERNELS"  # set to 1 to always use the torch fallback

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops" or "reason", once decided


def nvcc_path() -> str | None:
    """The CUDA compiler torch would use: $CUDA_HOME/bin/nvcc, else `nvcc` on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _why_not_buildable() -> str | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"{DISABLE_ENV} is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if nvcc_path() is None:
        return "nvcc is not installed (set CUDA_HOME or put nvcc on PATH)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): torch's JIT build needs it"
    return None


def kernels() -> object | None:
    """`torch.ops.duet_paged_kv` once built and loaded, or None (see :func:`unavailable_reason`)."""
    with _lock:
        if not _state:
            _state.update(_build())
        return _state.get("ops")


def unavailable_reason() -> str | None:
    """Why :func:`kernels` returns None, or None when the kernels are in use."""
    kernels()
    return _state.get("reason")  # type: ignore[return-value]


def _build() -> dict[str, object]:
    reason = _why_not_buildable()
    if reason is None:
        from torch.utils.cpp_extension import load

        try:
            load(name=LIBRARY, sources=[str(s) for s in SOURCES], extra_include_paths=[str(SOURCE_DIR)],
                 extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], is_python_module=False, verbose=False)
            return {"ops": getattr(torch.ops, LIBRARY)}
        except Exception as exc:  # a compiler or loader failure: fall back, but say why
            reason = f"building the paged KV kernels failed: {type(exc).__name__}: {exc}"
            log.warning("%s; using the torch fallback", reason)
    return {"reason": reason}
