#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, prepare the Python environment and
# run scripts/gpu_check.py: paged-KV kernels vs the torch fallback, the engine in bf16 vs
# transformers, a disaggregated pair with VRAM pools over NIXL vs a single node, and the KV
# transfer bandwidth. Prints the numbers; exits non-zero when a check fails. About 5 minutes.
#
# Python environment, in this order:
#   GPU_CHECK_PYTHON=/path/to/python  use that interpreter as it is (it must hold a CUDA build of
#                                     torch and this project's dependencies, `pip install -e .[test]`)
#   otherwise .venv, made by `make install`. The lock file pins torch==2.13.0, and the wheel pip
#   picks by default may be the CPU build, so when .venv's torch cannot see the GPU this script
#   first installs torch==2.13.0 from PyTorch's CUDA wheel index, TORCH_INDEX_URL (default below;
#   pick the CUDA version the driver supports: nvidia-smi's "CUDA Version"). That needs network
#   access; on an offline machine point pip at a folder of wheels with PIP_NO_INDEX=1
#   PIP_FIND_LINKS=/path/to/wheels (pip reads both), or use GPU_CHECK_PYTHON.
# The kernels are JIT-built with nvcc and ninja (ninja is pip-installed into .venv when missing);
# TORCH_CUDA_ARCH_LIST=9.0 builds for Hopper (sm_90), unset builds for the GPU present.
# Arguments are passed on to scripts/gpu_check.py (--quick: smaller transfers).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-570}"  # the whole check must fit in 10 minutes

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: nvidia-smi not found: run this on a machine with an NVIDIA GPU and its driver" >&2
    echo "           (python -m scripts.gpu_check --device cpu rehearses the checks without one)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

cuda_torch() {  # does interpreter $1 hold a torch that sees a GPU?
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    PY="$GPU_CHECK_PYTHON"
else
    PY=.venv/bin/python
    if ! cuda_torch "$PY"; then
        test -x "$PY" || python3 -m venv .venv
        echo "gpu_check: installing torch==2.13.0 (CUDA build) from $TORCH_INDEX_URL"
        "$PY" -m pip install --quiet --upgrade pip
        "$PY" -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
    fi
    make install  # the project and its locked dependencies; the CUDA torch satisfies torch==2.13.0
fi
if ! cuda_torch "$PY"; then
    echo "gpu_check: $PY has no torch that sees the GPU:" >&2
    "$PY" -c 'import torch; print("  torch", torch.__version__, "CUDA", torch.version.cuda)' >&2 || true
    exit 2
fi

BIN="$(dirname "$PY")"
export PATH="$BIN:$PATH"  # torch's JIT build runs `ninja` from PATH
if ! command -v ninja >/dev/null 2>&1; then
    "$PY" -m pip install --quiet ninja
fi

export UCX_TLS="${UCX_TLS:-cuda_ipc,cuda_copy,sm,self}"  # one host: GPU to GPU through CUDA IPC
export PYTHONUNBUFFERED=1
timeout "$CHECK_TIMEOUT_S" "$PY" -m scripts.gpu_check "$@"
