"""What a loader produces: the config plus fp32 weights named as in Hugging Face Llama."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from common.model.config import ModelConfig
from common.model.gguf_weight import AT_LOAD, GgufWeight, quantized_at_load


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor | GgufWeight]  # GgufWeight: a projection kept in its GGUF blocks
    model_hash: str  # sha256 of the weight files, part of the transport compatibility fingerprint
    source: Path


def hash_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def load_checkpoint(path: str | Path, quantization: str = "none") -> Checkpoint:
    """A `.gguf` file or a Hugging Face directory (config.json + *.safetensors). `quantization`
    (`--quantization`, common/model/gguf_weight.py): "gguf" keeps a GGUF's projections in its
    blocks; "int8" and "int4" quantize any checkpoint's projections at load."""
    from common.model.gguf_loader import load_gguf
    from common.model.hf_loader import load_hf_dir

    path = Path(path)
    if path.is_dir():
        ckpt = load_hf_dir(path)
    elif path.suffix == ".gguf":
        ckpt = load_gguf(path, "gguf" if quantization == "gguf" else "none")
    else:
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    return quantized_at_load(ckpt, quantization) if quantization in AT_LOAD else ckpt
