"""Load a Hugging Face model directory: config.json plus *.safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.model.checkpoint import Checkpoint, hash_files
from common.model.config import ModelConfig

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def _config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}")
    # transformers 5 nests rope settings in rope_parameters; 4.x uses rope_theta + rope_scaling.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    heads = raw["num_attention_heads"]
    return ModelConfig(
        architecture=_MODEL_TYPES[model_type],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(theta),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", model_type == "qwen2"),
        rope_scaling=rope or None,
        sliding_window=_sliding_window(raw),
    )


def _sliding_window(raw: dict) -> int | None:
    """The window every layer uses, or None for full attention.

    Mistral: `sliding_window` (null = full). Qwen2: only with `use_sliding_window`, and then only
    layers from `max_window_layers` on slide (or those `layer_types` marks "sliding_attention");
    a model whose layers differ is refused, since a page outside the window would still be read
    by its full-attention layers. A window covering the whole context is full attention.
    """
    window = raw.get("sliding_window")
    if not window or not raw.get("use_sliding_window", raw.get("model_type") == "mistral"):
        return None
    layers = raw["num_hidden_layers"]
    kinds = set(raw.get("layer_types") or [])
    if not kinds:
        first_sliding = raw.get("max_window_layers", 0) if raw.get("model_type") == "qwen2" else 0
        kinds = {"sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)}
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(f"layers mix sliding-window and full attention ({', '.join(sorted(kinds))}); only a "
                         "window shared by every layer is supported")
    return None if window >= raw.get("max_position_embeddings", 2048) else int(window)


def load_hf_dir(path: str | Path) -> Checkpoint:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    config = _config(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k: v.float() for k, v in load_file(f).items()})
    model_hash = hash_files(files)
    if config.sliding_window is not None:  # the KV depends on it: nodes must agree (fingerprint)
        model_hash += f";sliding_window={config.sliding_window}"
    return Checkpoint(config, tensors, model_hash, path)
