"""GPU support: paged-KV copy kernels with a torch fallback (cuda/paged_kv.py, built by
cuda/extension.py); docs/gpu.md covers running on CUDA devices and the CUDA-IPC data path.

The package is named `cuda`, as NVIDIA's cuda-python namespace (`cuda.bindings`, ...) is. So
that shadowing it does not break code importing those, this package's path also spans every
other `cuda` folder on sys.path.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
