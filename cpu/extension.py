"""Build of the CPU kernels (cpu/paged_attention.cpp, cpu/bf16_pointwise.cpp, cpu/gguf_linear.cpp;
cpu/bf16_linear.cpp and cpu/prefill_attention.cpp, registered only where the compiler targets
AVX512-BF16; cpu/intra_op_threads.cpp) as one torch operator library, at first use.

The library is compiled once with the system C++ compiler (`$CXX`, default `g++`) against the
running torch's headers and libraries, for this machine's CPU (`-march=native`), into torch's
extension cache (`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) under a name that
hashes the source, the torch version, the flags and the CPU's features, so later processes load
it in milliseconds and a cache shared by different machines never hands one a library built for
another. No ninja and no Python headers are needed (the operators register with the dispatcher,
as cuda/paged_kv_ops.cpp does). A failed build is not an error: :func:`kernels` returns None,
:func:`unavailable_reason` says why, and callers use the torch fallback.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from common.kernel_library import KernelLibrary, loaded_and_checked

SOURCES = tuple(Path(__file__).resolve().parent / name for name in (
    "paged_attention.cpp", "bf16_linear.cpp", "bf16_pointwise.cpp", "prefill_attention.cpp", "intra_op_threads.cpp",
    "gguf_linear.cpp"))
HEADERS = (Path(__file__).resolve().parent / "amx_tiles.h",)  # included by the sources: part of the cache key
LIBRARY = "duet_cpu"
DISABLE_ENV = "DUET_DISABLE_CPU_KERNELS"  # set to 1 to always use the torch fallback
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300

def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile_command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), *map(str, SOURCES), f"-L{torch_lib}",
            f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-o", str(output)]


def library_path(compiler: str) -> Path:
    """Where the library built by `compiler` for these sources, torch and CPU is cached."""
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), torch.__version__.encode(),
                 " ".join(FLAGS).encode(), compiler.encode(), _cpu_features().encode()):
        key.update(part)
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"{LIBRARY}-{key.hexdigest()[:16]}" / f"lib{LIBRARY}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target` and move it in: processes building at once
    each load a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(_compile_command(compiler, Path(tmp)), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or [done.stderr.strip()[-2000:]]
            raise RuntimeError(f"{compiler} exited with {done.returncode}: " + "\n".join(errors)[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _smoke_test(ops: object) -> None:
    """One tiny attention per dtype against torch's: a library that loads but computes wrongly
    here fails now, not in a forward."""
    gen = torch.Generator().manual_seed(0)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, k, v = (torch.randn(3, 2, 8, generator=gen).to(dtype) for _ in range(3))
        out = torch.empty_like(q)
        ops.paged_attention(q, k, v, out, torch.tensor([2, 0, 1]), torch.tensor([[0, 3, 0, 3]]),
                            torch.zeros(0, dtype=torch.bool), torch.tensor([-1]), 8 ** -0.5)
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(0, 1) for t in (q, k[[2, 0, 1]], v[[2, 0, 1]])), is_causal=True)
        if not torch.allclose(out.float(), want.transpose(0, 1), atol=atol):
            raise RuntimeError(f"the paged attention kernel returned wrong values in {dtype}")
    # Q8_0 blocks of scale 0.5 (fp16 0x3800) and integer weights: every product and sum exact.
    q = torch.randint(-8, 8, (64, 32), generator=gen, dtype=torch.int8)
    blocks = torch.cat([torch.tensor([0x00, 0x38], dtype=torch.uint8).expand(64, 2), q.view(torch.uint8)], dim=1)
    x, out = torch.randint(-4, 4, (5, 32), generator=gen).float(), torch.empty(5, 64)
    ops.gguf_linear(x, blocks.contiguous(), 2, torch.empty(0), out)
    if not torch.equal(out, x @ (q.float() * 0.5).T):
        raise RuntimeError("the GGUF linear kernel returned wrong values")
    if has_bf16_linear(ops):
        x, w = torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(64, 32, generator=gen).bfloat16()
        for amx in {False, bool(ops.bf16_linear_amx_available())}:
            out = torch.empty(3, 64, dtype=torch.bfloat16)
            ops.bf16_linear(x, pack_bf16_linear(w), torch.empty(0), out, amx)
            if not torch.allclose(out.float(), x.float() @ w.float().T, atol=5e-2, rtol=1e-2):
                raise RuntimeError(f"the bf16 linear kernel returned wrong values (amx={amx})")
    if has_bf16_prefill_attention(ops):
        q, k, v = (torch.randn(n, heads, 64, generator=gen).bfloat16() for n, heads in ((3, 4), (5, 2), (5, 2)))
        mask = torch.ones(3, 5, dtype=torch.bool).tril(2)
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.float().transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=0.125, enable_gqa=True)
        for amx in {False, bool(ops.bf16_linear_amx_available())}:
            out = torch.empty_like(q)
            ops.bf16_prefill_attention(q, k, v, out, 0.125, amx)
            if not torch.allclose(out.float(), want.transpose(0, 1), atol=3e-2):
                raise RuntimeError(f"the bf16 prefill attention kernel returned wrong values (amx={amx})")


def claim_intra_op_threads(device: torch.device) -> int:
    """Fix the calling thread's intra-op thread count at torch's current one, for torch and, for
    a CPU engine, for these kernels alike (cpu/intra_op_threads.cpp says why both); return it."""
    count = torch.get_num_threads()
    ops = kernels() if device.type == "cpu" else None
    return int(ops.intra_op_threads()) if ops is not None else count


def has_bf16_linear(ops: object) -> bool:
    """Whether the library holds `bf16_linear` (built for a CPU with AVX512-BF16)."""
    return hasattr(ops, "bf16_linear")


def bf16_linear_uses_amx(ops: object, in_features: int) -> bool:
    """Whether `bf16_linear` takes its AMX path for a layer of `in_features` inputs: where the
    library was built for AMX, Linux granted this process the tiles, and the layer's inputs fill
    whole 32-value tile rows. Decided per layer, once: a layer's two paths round differently."""
    return in_features % 32 == 0 and bool(ops.bf16_linear_amx_available())


def has_bf16_prefill_attention(ops: object) -> bool:
    """Whether the library holds `bf16_prefill_attention` (built for a CPU with AVX512-BF16)."""
    return hasattr(ops, "bf16_prefill_attention")


@functools.cache
def bf16_prefill_attention_uses_amx(ops: object) -> bool:
    """Whether `bf16_prefill_attention` takes its AMX path in this process (as for `bf16_linear`:
    built for AMX and granted the tiles); decided once, since the two paths round differently."""
    return bool(ops.bf16_linear_amx_available())


def pack_bf16_linear(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` bf16 weight -> `[N / 64, K / 2, 64, 2]`, the layout `bf16_linear` streams
    (cpu/bf16_linear.cpp). N must be a multiple of 64 and K even."""
    n, k = weight.shape
    return weight.view(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _load() -> dict[str, object]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return {"reason": f"{DISABLE_ENV} is set"}
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return {"reason": f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"}

    def build_and_load() -> None:
        target = library_path(compiler)
        if not target.exists():
            _build(compiler, target)
        torch.ops.load_library(str(target))

    return loaded_and_checked(LIBRARY, "the CPU kernels", build_and_load, _smoke_test)


_library = KernelLibrary(_load)
kernels = _library.kernels  # `torch.ops.duet_cpu` once built and loaded, or None
unavailable_reason = _library.unavailable_reason  # why kernels() is None, or None
