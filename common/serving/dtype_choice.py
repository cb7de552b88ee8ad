"""`--dtype auto|float32|bfloat16|float16`: what each means on each device.

`auto` does what vLLM does on the same machine: bfloat16 where the hardware computes it natively
(a CUDA device; a CPU with AVX512-BF16 or AMX, where oneDNN runs bf16 products at twice the
fp32 rate for half the bytes), float32 on other CPUs, where bf16 would be emulated and slower.
float16 runs on CUDA only: on the CPU neither oneDNN's packed products nor the attention kernel
take it, and the torch fallback would be slower than float32.
"""
from __future__ import annotations

DTYPES = ("auto", "float32", "bfloat16", "float16")  # torch dtype names, and auto
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)


def resolve_dtype(device: str, dtype: str) -> str:
    """The concrete dtype `--dtype` means on `device`; ValueError naming the flag when this
    combination cannot run."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if device != "cpu" or native_cpu_bf16() else "float32"
    if device == "cpu" and dtype == "float16":
        raise ValueError("--dtype float16 needs --device cuda: on the CPU use bfloat16 (native with "
                         "AVX512-BF16 or AMX) or float32")
    return dtype


def emulated_bf16(device: str, dtype: str) -> bool:
    """Whether the concrete `dtype` is bfloat16 on a CPU that only emulates it (asked for
    explicitly: `auto` never picks it there): slower than float32 there, several-fold in prefill
    (docs/bench/README.md). The daemons warn at start."""
    return device == "cpu" and dtype == "bfloat16" and not native_cpu_bf16()
