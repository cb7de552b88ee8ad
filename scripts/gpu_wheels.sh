#!/usr/bin/env bash
# Download, on a machine with network access, the wheels an offline GPU machine needs to run the
# GPU check (docs/gpu.md) with the torch and transformers it already has:
#
#   bash scripts/gpu_wheels.sh DEST [PYTHON_VERSION] [CUDA_MAJOR]      (defaults: 3.12, 13)
#
# Copy DEST to the GPU machine and run `GPU_CHECK_WHEELS=DEST bash scripts/gpu_check.sh` there.
# DEST gets NIXL built for CUDA_MAJOR (match the GPU machine's torch: `torch.version.cuda`), the
# gRPC and protobuf runtime the generated stubs were made for, and gguf, at the lock file's
# versions, for CPython PYTHON_VERSION on x86-64 Linux. NIXL's wheel carries an expert-parallel
# library for several torch versions (nixl_ep_*) that the node pair never imports; it is dropped,
# which halves what has to be copied.
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${1:?usage: scripts/gpu_wheels.sh DEST [PYTHON_VERSION] [CUDA_MAJOR]}"
python_version="${2:-3.12}"
cuda_major="${3:-13}"

locked() {  # the lock file's version of package $1
    local line
    line="$(grep -i "^$1==" constraints.txt)" || { echo "gpu_wheels: $1 is not in constraints.txt" >&2; exit 2; }
    echo "${line#*==}"
}

mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest" \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "nixl-cu${cuda_major}==$(locked nixl-cu12)" \
    "grpcio==$(locked grpcio)" "grpcio-health-checking==$(locked grpcio-health-checking)" \
    "grpcio-reflection==$(locked grpcio-reflection)" "protobuf==$(locked protobuf)" "gguf==$(locked gguf)"

for wheel in "$dest"/nixl_cu*.whl; do
    python3 - "$wheel" <<'EOF'
import sys, zipfile
from pathlib import Path

path = Path(sys.argv[1])
slim = path.with_suffix(".slim")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
    for item in src.infolist():
        if not item.filename.startswith("nixl_ep_"):
            out.writestr(item, src.read(item))
slim.replace(path)
EOF
done
ls -l "$dest"
du -sh "$dest"
