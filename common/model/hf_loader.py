"""Load a Hugging Face model directory: config.json plus *.safetensors, of any family in
common/model/family.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.model.checkpoint import Checkpoint, hash_files
from common.model.config import ModelConfig, MoeConfig
from common.model.family import MULTIMODAL, canonical_tensors, family_of

SLIDING, FULL = "sliding_attention", "full_attention"
# The most a config.json may declare of each size: beyond any released model, so that a
# malformed or hostile file is refused before anything is sized by it.
SIZE_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
               "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096, "vocab_size": 1 << 23,
               "max_position_embeddings": 1 << 26, "num_local_experts": 4096, "num_experts": 4096,
               "moe_intermediate_size": 1 << 20, "num_experts_per_tok": 4096, "decoder_sparse_step": 1024}


def _rope(params: dict, fallback_theta: float) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one rope description, transformers 5's `rope_parameters` or 4.x's."""
    rope = dict(params)
    theta = float(rope.pop("rope_theta", fallback_theta))
    rope.pop("partial_rotary_factor", None)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    return theta, rope or None


def _ropes(raw: dict) -> dict:
    """The full layers' rope and, where Gemma 3 gives them another, the sliding layers'."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta", 10000.0)
    if FULL in params or SLIDING in params:  # transformers 5: one description per layer kind
        full_theta, full_scaling = _rope(params.get(FULL, {}), theta)
        local_theta, local_scaling = _rope(params.get(SLIDING, {}), theta)
    else:
        full_theta, full_scaling = _rope(params, theta)
        local_theta, local_scaling = raw.get("rope_local_base_freq"), None  # transformers 4.x Gemma 3
    if full_scaling is not None and "original_max_position_embeddings" in raw:  # Phi-3 keeps it beside the rope
        full_scaling.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    out = {"rope_theta": full_theta, "rope_scaling": full_scaling}
    if local_theta is not None and (local_theta, local_scaling) != (full_theta, full_scaling):
        out |= {"sliding_rope_theta": float(local_theta), "sliding_rope_scaling": local_scaling}
    partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    return out | ({} if partial is None else {"partial_rotary_factor": float(partial)})


def _moe(raw: dict) -> MoeConfig | None:
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    if not experts:
        return None
    layers = raw["num_hidden_layers"]
    step = raw.get("decoder_sparse_step", 1)  # Qwen3-MoE: every `step`-th layer is sparse, bar mlp_only_layers
    dense = sorted(set(raw.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step})
    return MoeConfig(
        num_experts=experts, top_k=raw["num_experts_per_tok"],
        intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        normalize_top_k=raw.get("norm_topk_prob", True), dense_layers=tuple(dense),
        swiglu_alpha=raw.get("swiglu_alpha", 1.702), swiglu_limit=raw.get("swiglu_limit", 7.0))


def _text_model(raw: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The text model of a multimodal checkpoint (MULTIMODAL): its config and its tensors, named
    as the text family's own checkpoint names them (transformers 4 writes `language_model.model.*`,
    5 `model.language_model.*`); the checkpoint itself when it is not multimodal."""
    if raw.get("model_type") not in MULTIMODAL:
        return raw, tensors
    text = {**raw.get("text_config", {}), "model_type": MULTIMODAL[raw["model_type"]]}
    renamed = {}
    for name, t in tensors.items():
        for prefix, replacement in (("language_model.", ""), ("model.language_model.", "model.")):
            if name.startswith(prefix):
                renamed[replacement + name.removeprefix(prefix)] = t
    return text, renamed


def config_from_json(text: str) -> ModelConfig:
    """The ModelConfig of a config.json's text; ValueError says what is wrong with it."""
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep to read") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError("a config must be a JSON object with a model_type string")
    if not isinstance(raw.get("text_config", {}), dict):
        raise ValueError("text_config must be an object")
    return model_config(_text_model(raw, {})[0])


def model_config(raw: dict) -> ModelConfig:
    """The ModelConfig of a config.json (of a text model; see _text_model); ValueError says what
    a malformed one lacks or holds wrong."""
    if not isinstance(raw, dict):
        raise ValueError("a config must be a JSON object")
    for key, limit in SIZE_LIMITS.items():
        value = raw.get(key)
        if value is not None and (type(value) is not int or not 1 <= value <= limit):
            raise ValueError(f"{key} must be an integer from 1 to {limit}, got {value!r}")
    try:
        return _model_config(raw)
    except KeyError as exc:
        raise ValueError(f"the config lacks {exc}") from None
    except (TypeError, ArithmeticError, IndexError, AttributeError, RuntimeError) as exc:  # wrong kinds, sizes that disagree
        raise ValueError(f"the config holds a value of the wrong kind ({type(exc).__name__}: {exc})") from None


def _model_config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    family = family_of(model_type)
    raw = family.config_defaults | raw
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    scalar = raw.get("query_pre_attn_scalar")  # Gemma
    embedding_multiplier = raw["hidden_size"] ** 0.5 if family.embedding_scale else raw.get("embedding_multiplier", 1.0)
    windows = _layer_windows(raw)
    uniform = None if windows is None or len(set(windows)) > 1 else windows[0]
    return ModelConfig(
        architecture=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=raw["rms_norm_eps"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", family.qkv_bias),
        sliding_window=uniform,
        layer_windows=windows if windows is not None and uniform is None else None,
        attention_scale=raw.get("attention_multiplier") or (None if scalar is None else scalar**-0.5),
        attention_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
        embedding_multiplier=embedding_multiplier,
        residual_multiplier=raw.get("residual_multiplier", 1.0),
        logits_divisor=raw.get("logits_scaling", 1.0),
        moe=_moe(raw),
        **_ropes(raw),
    )


def _layer_windows(raw: dict) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: full attention), or None when no layer slides: the
    layers `layer_types` marks "sliding_attention", else those the family's `sliding_layer` says
    (every layer, as Mistral's, by default). A window covering the whole context is full attention.
    """
    window = raw.get("sliding_window")
    if not window or window >= raw.get("max_position_embeddings", 2048):
        return None
    family = family_of(raw.get("model_type"))
    sliding = [kind == SLIDING for kind in raw.get("layer_types") or []]
    if family.sliding_layer is not None and (not sliding or not raw.get("use_sliding_window", True)):
        sliding = [family.sliding_layer(i, raw) for i in range(raw["num_hidden_layers"])]
    elif not sliding:
        sliding = [True] * raw["num_hidden_layers"]
    return tuple(int(window) if s else None for s in sliding) if any(sliding) else None


def load_hf_dir(path: str | Path) -> Checkpoint:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    text = config_file.read_text()
    try:  # refused before the weights are read
        config = config_from_json(text)
    except ValueError as exc:
        raise ValueError(f"{config_file}: {exc}") from None
    raw = json.loads(text)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        # Integer tensors (gpt-oss's MXFP4 blocks and scales) stay as they are, for the family to decode.
        tensors.update({k: v.float() if v.is_floating_point() else v for k, v in load_file(f).items()})
    raw, tensors = _text_model(raw, tensors)
    model_hash = hash_files(files)
    # The KV depends on the windows: nodes must agree (the compatibility fingerprint compares the hash).
    if config.sliding_window is not None:
        model_hash += f";sliding_window={config.sliding_window}"
    if config.layer_windows is not None:
        model_hash += f";layer_windows={','.join(str(w or 0) for w in config.layer_windows)}"
    return Checkpoint(config, canonical_tensors(raw["model_type"], tensors, raw), model_hash, path)
