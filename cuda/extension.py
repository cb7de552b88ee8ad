"""JIT build of the paged-KV CUDA kernels (paged_kv.cu + paged_kv_ops.cpp) as a torch extension.

Built once per process on first use, with `torch.utils.cpp_extension.load` (needs `nvcc`, `ninja`
and a CUDA build of torch), into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), so later processes only load the cached library. The GPU
architectures come from `TORCH_CUDA_ARCH_LIST` when set (e.g. `9.0` for Hopper: `-arch=sm_90`),
otherwise torch builds for the GPUs it sees. A failed build is not an error: :func:`kernels`
returns None, :func:`unavailable_reason` says why, and callers use the torch fallback.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from common.kernel_library import KernelLibrary, loaded_and_checked

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = (SOURCE_DIR / "paged_kv.cu", SOURCE_DIR / "paged_kv_ops.cpp")
KERNEL_SOURCE = SOURCES[0]
LIBRARY = "duet_paged_kv"
DISABLE_ENV = "DUET_DISABLE_CUDA_KERNELS"  # set to 1 to always use the torch fallback
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")

def cuda_home() -> Path | None:
    """The CUDA toolkit to build with: the first of $CUDA_HOME, $CUDA_PATH, the folder above the
    `nvcc` on PATH (links followed) and /usr/local/cuda that holds bin/nvcc and the CUDA headers.

    torch guesses the folder above `nvcc` without following anything, so an `nvcc` that is a link
    or a wrapper script (/usr/local/bin/nvcc exec-ing the real one, as on some images) sends it to
    /usr/local/include for cuda_runtime.h and the build fails; the build uses this folder instead.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append(str(DEFAULT_CUDA_HOME))
    for candidate in filter(None, candidates):
        home = Path(candidate)
        if (home / "bin" / "nvcc").is_file() and (home / "include" / "cuda_runtime.h").is_file():
            return home
    return None


def nvcc_path() -> str | None:
    """The CUDA compiler the build uses, or None if no CUDA toolkit is found (see :func:`cuda_home`)."""
    home = cuda_home()
    return None if home is None else str(home / "bin" / "nvcc")


def toolkit_mismatch(nvcc: str, torch_cuda: str) -> str | None:
    """Why `nvcc` cannot build for a torch built with CUDA `torch_cuda`, or None.

    The major versions must agree: the extension links the toolkit's CUDA runtime beside torch's.
    torch checks this for setup.py builds only, not for the JIT build used here.
    """
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{nvcc} --version failed: {exc}"
    found = re.search(r"release (\d+)\.(\d+)", out)
    if found is None:
        return f"{nvcc} --version printed no CUDA release"
    if found.group(1) != torch_cuda.split(".")[0]:
        return f"{nvcc} is CUDA {found.group(1)}.{found.group(2)} but torch was built with CUDA {torch_cuda}"
    return None


def _why_not_buildable() -> str | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"{DISABLE_ENV} is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    nvcc = nvcc_path()
    if nvcc is None:
        return "no CUDA toolkit found (set CUDA_HOME to the folder holding bin/nvcc and include/cuda_runtime.h)"
    mismatch = toolkit_mismatch(nvcc, torch.version.cuda)
    if mismatch:
        return mismatch
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): torch's JIT build needs it"
    return None


def _smoke_test(ops: object) -> None:
    """One tiny gather on the GPU: a library that loads but cannot run here (a driver older
    than the toolkit, a GPU the build did not target) fails now, not in a transfer."""
    pool = torch.arange(2 * 3 * 8, dtype=torch.float32, device="cuda").view(2, 3, 1, 8)
    out = torch.empty(2, 1, 1, 8, device="cuda")
    ops.gather_from_slots(pool, torch.tensor([1], device="cuda"), out)
    if not torch.equal(out, pool[:, 1:2]):
        raise RuntimeError("the gather kernel returned wrong data")


def _build() -> dict[str, object]:
    reason = _why_not_buildable()
    if reason is not None:
        return {"reason": reason}
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = str(cuda_home())  # torch fixed its own guess at import (see cuda_home)
    return loaded_and_checked(LIBRARY, "the paged KV kernels", lambda: cpp_extension.load(
        name=LIBRARY, sources=[str(s) for s in SOURCES], extra_include_paths=[str(SOURCE_DIR)],
        extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], is_python_module=False, verbose=False), _smoke_test)


_library = KernelLibrary(_build)
kernels = _library.kernels  # `torch.ops.duet_paged_kv` once built and loaded, or None
unavailable_reason = _library.unavailable_reason  # why kernels() is None, or None
