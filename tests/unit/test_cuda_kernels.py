"""cuda/: the paged-KV scatter/gather (torch fallback against a naive reference on every machine,
the CUDA kernels against the fallback where a GPU is), that the kernel source compiles where
nvcc is, the `--device`/`--dtype` startup checks, and the GPU check script's syntax."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.kv.pool import KVPool
from common.kv.segments import slot_range
from common.serving.daemon_config import check_device
from cuda import extension
from cuda.paged_kv import (DTYPES, gather_from_slots, scatter_to_slots, torch_gather_from_slots,
                           torch_scatter_to_slots)
from decode_node.config import DecodeNodeConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4
# Positions 3..21 of a sequence whose pages are scattered: starts mid-page, crosses 5 page
# boundaries, and the slots are not one ascending run.
PAGE_TABLE = [6, 2, 9, 0, 5, 11]
START, END = 3, 22


def _pool(dtype: torch.dtype, heads: int = 3, head_dim: int = 8, device: str = "cpu") -> KVPool:
    pool = KVPool(num_layers=3, num_kv_heads=heads, head_dim=head_dim, num_pages=12, page_size=PAGE_SIZE,
                  dtype=dtype, device=device)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(1)))
    return pool


def _slot_cases(pool: KVPool) -> dict[str, torch.Tensor]:
    return {
        "page-crossing run": slot_range(PAGE_TABLE, pool.page_size, START, END),
        "random distinct": torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(2))[:17],
        "empty": torch.zeros(0, dtype=torch.long),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fallback_scatter_and_gather_match_a_naive_reference(dtype):
    pool = _pool(dtype)
    for name, slots in _slot_cases(pool).items():
        before = pool.data.clone()
        src = torch.randn(2, slots.numel(), 3, 8).to(dtype)
        scatter_to_slots(pool.data[1], src, slots)
        expected = before.clone()
        for i, slot in enumerate(slots.tolist()):
            for kv in (0, 1):
                expected[1, kv, slot] = src[kv, i]
        assert torch.equal(pool.data, expected), name  # the slots hold src, nothing else moved
        gathered = gather_from_slots(pool.data[1], slots)
        assert gathered.is_contiguous() and torch.equal(gathered, src), name
        out = torch.empty_like(src)
        assert gather_from_slots(pool.data[1], slots, out) is out and torch.equal(out, src), name
        naive = torch.stack([torch.stack([pool.data[1, kv, s] for s in slots.tolist()]) if len(slots) else
                             torch.empty(0, 3, 8, dtype=dtype) for kv in (0, 1)])
        assert torch.equal(gather_from_slots(pool.data[1], slots), naive), name


@pytest.mark.parametrize("bad, message", [
    (lambda pool, src, slots: (pool, src, slots + 1000), "slots must lie in"),
    (lambda pool, src, slots: (pool, src, slots - 100), "slots must lie in"),
    (lambda pool, src, slots: (pool, src[:, :-1], slots), "src must be"),
    (lambda pool, src, slots: (pool, src.to(torch.float16), slots), "src is torch.float16"),
    (lambda pool, src, slots: (pool, src.transpose(2, 3).contiguous().transpose(2, 3), slots), "contiguous"),
    (lambda pool, src, slots: (pool.to(torch.float64), src.to(torch.float64), slots), "dtype torch.float64"),
    (lambda pool, src, slots: (pool[:, :, :1], src[:, :, :1], slots), "rows must be contiguous"),
    (lambda pool, src, slots: (pool, src, slots.float()), "integer tensor"),
])
def test_bad_operands_are_refused_before_any_write(bad, message):
    pool = _pool(torch.float32)
    slots = slot_range(PAGE_TABLE, pool.page_size, START, END)
    layer, src, slots = bad(pool.data[1], torch.randn(2, slots.numel(), 3, 8), slots)
    before = layer.clone()
    with pytest.raises(ValueError, match=message):
        scatter_to_slots(layer, src, slots)
    assert torch.equal(layer, before)


def test_kernel_source_compiles_for_hopper(tmp_path):
    nvcc = extension.nvcc_path()
    if nvcc is None:
        pytest.skip("no CUDA toolkit here (set CUDA_HOME or put nvcc on PATH): the CUDA source "
                    "cannot be compiled; scripts/gpu_check.sh builds and runs it on a GPU machine")
    out = subprocess.run([nvcc, "-arch=sm_90", "-O3", "-c", str(extension.KERNEL_SOURCE), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k.o").stat().st_size > 0


def _toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "include" / "cuda_runtime.h").write_text("")
    return root


def test_cuda_home_sees_through_links_and_wrapper_scripts(tmp_path, monkeypatch):
    """torch guesses the folder above `nvcc` as it appears on PATH; ours must find the toolkit."""
    real = _toolkit(tmp_path / "cuda-13.0")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(extension, "DEFAULT_CUDA_HOME", tmp_path / "absent")
    links = tmp_path / "links" / "bin"
    links.mkdir(parents=True)
    (links / "nvcc").symlink_to(real / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(links))
    assert extension.cuda_home() == real and extension.nvcc_path() == str(real / "bin" / "nvcc")

    wrappers = tmp_path / "wrappers" / "bin"  # /usr/local/bin/nvcc exec-ing the real one
    wrappers.mkdir(parents=True)
    (wrappers / "nvcc").write_text(f"#!/bin/sh\nexec {real}/bin/nvcc \"$@\"\n")
    (wrappers / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(wrappers))
    assert extension.cuda_home() is None  # nothing names the toolkit...
    monkeypatch.setattr(extension, "DEFAULT_CUDA_HOME", real)
    assert extension.cuda_home() == real  # ...but the conventional folder holds it
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "stale"))  # a CUDA_HOME without a toolkit is passed over
    assert extension.cuda_home() == real
    other = _toolkit(tmp_path / "cuda-12.8")
    monkeypatch.setenv("CUDA_HOME", str(other))
    assert extension.cuda_home() == other


def test_toolkit_and_torch_must_share_the_cuda_major_version(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    assert extension.toolkit_mismatch(str(nvcc), "13.0") is None
    assert extension.toolkit_mismatch(str(nvcc), "13.2") is None
    assert extension.toolkit_mismatch(str(nvcc), "12.8") == f"{nvcc} is CUDA 13.0 but torch was built with CUDA 12.8"
    nvcc.write_text("#!/bin/sh\necho 'something else'\n")
    assert "printed no CUDA release" in extension.toolkit_mismatch(str(nvcc), "13.0")
    assert "--version failed" in extension.toolkit_mismatch(str(tmp_path / "absent"), "13.0")


def test_cuda_kernels_equal_the_fallback():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): the kernels run "
                    "only on a GPU; scripts/gpu_check.sh checks them there")
    ops = extension.kernels()
    assert ops is not None, extension.unavailable_reason()
    for dtype in DTYPES:
        for heads, head_dim in ((3, 64), (3, 5)):  # 16-byte and 2-byte row copies
            pool = _pool(dtype, heads, head_dim, device="cuda")
            for name, slots in _slot_cases(pool).items():
                slots = slots.cuda()
                src = torch.randn(2, slots.numel(), heads, head_dim, device="cuda").to(dtype)
                ours, theirs = pool.data[2].clone(), pool.data[2].clone()
                scatter_to_slots(ours, src, slots)  # the kernel: the pool is on CUDA
                torch_scatter_to_slots(theirs, src, slots)
                assert torch.equal(ours, theirs), (dtype, name)
                want = torch.empty_like(src)
                torch_gather_from_slots(theirs, slots, want)
                assert torch.equal(gather_from_slots(ours, slots), want), (dtype, name)


def test_device_flags_are_checked_at_startup():
    with pytest.raises(ValueError, match="--dtype float16 needs --device cuda"):
        check_device("cpu", "float16")
    with pytest.raises(ValueError, match="--device must be one of cpu, cuda"):
        check_device("tpu", "float32")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        check_device("cpu", "float64")
    check_device("cpu", "float32")
    check_device("cpu", "bfloat16")
    if torch.cuda.is_available():
        DecodeNodeConfig(device="cuda", dtype="bfloat16", transport="tcp")  # staged through host memory
    else:
        with pytest.raises(ValueError, match="--device cuda: .*(built without CUDA|no CUDA device)"):
            DecodeNodeConfig(device="cuda", dtype="bfloat16")


def test_device_flag_error_reaches_the_command_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device, so --device cuda is accepted")
    out = subprocess.run([sys.executable, "-c", "from decode_node.config import parse_args; "
                          "parse_args(['--device', 'cuda'])"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "error: --device cuda:" in out.stderr, out.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_gpu_scripts_are_valid_bash(script):
    bash = shutil.which("bash")
    assert bash is not None
    out = subprocess.run([bash, "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_other_cuda_packages_stay_importable(tmp_path):
    """Our `cuda` package must not hide NVIDIA's `cuda.*` namespace packages (cuda-python)."""
    (tmp_path / "cuda" / "bindings").mkdir(parents=True)
    (tmp_path / "cuda" / "bindings" / "__init__.py").write_text("WHO = 'cuda-python'\n")
    code = "import cuda.bindings, cuda.extension; print(cuda.bindings.WHO)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "cuda-python", out.stderr
