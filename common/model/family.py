"""What each supported model family is, declared as data: the one place where the decoders of
Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Granite, OLMo 2, Mixtral, Qwen3-MoE and gpt-oss differ.

A family is a Hugging Face `model_type`. The loaders read a checkpoint's tensors into one naming
(Hugging Face Llama's, plus `mlp.experts.{e}.*` and `mlp.gate.*` for a mixture of experts) with the
family's `renames` and `unpack`, and the forward (common/model/decoder.py) reads the rest of this
declaration: which norms a layer has and where, how a norm applies its weight, q/k norms, the
activation, the embedding's scale and the experts' routing. Numbers a family's config.json carries
(soft-capping, multipliers, windows, rope) are read into ModelConfig by common/model/hf_loader.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Where a layer's RMSNorms sit: before attention, on attention's output (before the residual
# add), before the MLP, on the MLP's output. Values: the norm's name inside a layer's tensors.
LLAMA_NORMS = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                  "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}
POST_NORMS = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class Family:
    norms: dict[str, str] = field(default_factory=lambda: LLAMA_NORMS)
    # How an RMSNorm applies its weight below float32: Llama rounds the normalised activations to
    # the model dtype and then multiplies; Gemma, OLMo 2 and gpt-oss multiply in float32 and round once.
    norm_weight_in_float32: bool = False
    norm_weight_offset: float = 0.0  # Gemma stores its norms' weights as `w - 1`
    qk_norm: str | None = None  # "head": over each head (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    activation: str = "silu"  # of the gated MLP: "silu", "gelu_tanh" (Gemma), "clamped_swiglu" (gpt-oss)
    embedding_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), the factor in the model dtype
    # Mixture of experts: "softmax_topk" (softmax over every expert, then the top k: Mixtral,
    # Qwen3-MoE) or "topk_softmax" (the top k logits, then a softmax over them: gpt-oss).
    routing: str | None = None
    qkv_bias: bool = False  # the default of config.json's `attention_bias`
    renames: tuple[tuple[str, str], ...] = ()  # substrings of tensor names, replaced in order
    # The family's fused tensors, unpacked into the common naming: (tensors, config) -> tensors.
    unpack: Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]] | None = None
    # Whether layer i slides, for a config.json without `layer_types` (written by transformers 4):
    # (i, config) -> bool; None: every layer does when the config has a sliding window.
    sliding_layer: Callable[[int, dict], bool] | None = None
    # Values the family's config.json may leave out (transformers' config class defaults them).
    config_defaults: dict = field(default_factory=dict)


def _split_phi3(tensors: dict[str, torch.Tensor], raw: dict) -> dict[str, torch.Tensor]:
    """Phi-3's `qkv_proj` and `gate_up_proj` as the separate projections of Llama."""
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    out = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            out |= {name.replace("qkv_proj", p): w for p, w in (("q_proj", q), ("k_proj", k), ("v_proj", v))}
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out |= {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
        else:
            out[name] = t
    return out


# The 16 values of an FP4 (e2m1) nibble, as OCP's microscaling spec defines them.
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights as gpt-oss checkpoints ship them, in float32: `blocks` `[..., groups, 16]`
    bytes of two FP4 values each (low nibble first), `scales` `[..., groups]` a shared power of two
    per 32 values (E8M0: exponent + 127). Returns `[..., groups * 32]`; exact (an FP4 value times
    a power of two fits float32 and bfloat16 alike)."""
    blocks = blocks.to(torch.uint8).long()
    values = torch.stack([_FP4_VALUES[blocks & 0x0F], _FP4_VALUES[blocks >> 4]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _split_gpt_oss_experts(tensors: dict[str, torch.Tensor], raw: dict) -> dict[str, torch.Tensor]:
    """gpt-oss keeps each layer's experts as `[experts, in, out]` tensors (MXFP4-packed `_blocks`
    and `_scales` of `[experts, out, in]` in the published checkpoints), gate and up interleaved
    (gate in even columns): one `[out, in]` weight per expert and projection, as Linear takes them."""
    out, packed = {}, {}
    for name, t in tensors.items():
        if name.endswith(("_blocks", "_scales")):
            packed[name] = t
        else:
            out[name] = t
    for name in [n for n in packed if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        out[base] = dequantize_mxfp4(packed[name], packed[f"{base}_scales"]).transpose(1, 2)
    unpacked = {}
    for name, t in out.items():
        prefix, dot, kind = name.rpartition("mlp.experts.")
        if not dot or kind.partition(".")[0].isdigit():  # not an expert's, or one expert's already (a GGUF's)
            unpacked[name] = t
            continue
        for e in range(t.shape[0]):
            p = f"{prefix}mlp.experts.{e}."
            if kind == "gate_up_proj":
                unpacked |= {f"{p}gate_proj.weight": t[e, :, ::2].T, f"{p}up_proj.weight": t[e, :, 1::2].T}
            elif kind == "gate_up_proj_bias":
                unpacked |= {f"{p}gate_proj.bias": t[e, ::2], f"{p}up_proj.bias": t[e, 1::2]}
            elif kind == "down_proj":
                unpacked[f"{p}down_proj.weight"] = t[e].T
            elif kind == "down_proj_bias":
                unpacked[f"{p}down_proj.bias"] = t[e]
            else:
                raise ValueError(f"unexpected gpt-oss expert tensor {name!r}")
    return {k: v.contiguous() for k, v in unpacked.items()}


def _from_max_window_layers(i: int, raw: dict) -> bool:
    """Qwen: layers slide only with `use_sliding_window`, and then from `max_window_layers` on."""
    return raw.get("use_sliding_window", False) and i >= raw.get("max_window_layers", 0)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True, sliding_layer=_from_max_window_layers),
    "qwen3": Family(qk_norm="head", sliding_layer=_from_max_window_layers),
    "gemma2": Family(norms=SANDWICH_NORMS, norm_weight_in_float32=True, norm_weight_offset=1.0,
                     activation="gelu_tanh", embedding_scale=True, sliding_layer=lambda i, raw: i % 2 == 0),
    "gemma3_text": Family(norms=SANDWICH_NORMS, norm_weight_in_float32=True, norm_weight_offset=1.0,
                          qk_norm="head", activation="gelu_tanh", embedding_scale=True,
                          sliding_layer=lambda i, raw: (i + 1) % raw.get("sliding_window_pattern", 6) != 0,
                          config_defaults={  # Gemma 3's multimodal checkpoints list only what differs
                              "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                              "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                              "max_position_embeddings": 131072, "sliding_window": 4096,
                              "tie_word_embeddings": True}),
    "phi3": Family(unpack=_split_phi3),
    "granite": Family(),
    "olmo2": Family(norms=POST_NORMS, norm_weight_in_float32=True, qk_norm="projection"),
    "mixtral": Family(routing="softmax_topk", renames=(
        ("block_sparse_moe.gate.", "mlp.gate."), ("block_sparse_moe.experts.", "mlp.experts."),
        (".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj."))),
    "qwen3_moe": Family(qk_norm="head", routing="softmax_topk", sliding_layer=_from_max_window_layers),
    "gpt_oss": Family(norm_weight_in_float32=True, activation="clamped_swiglu", routing="topk_softmax",
                      qkv_bias=True, renames=(("mlp.router.", "mlp.gate."),), unpack=_split_gpt_oss_experts),
}


# Multimodal checkpoints whose text model is one of the families: the text config is their
# `text_config`, its tensors those under `language_model.` (the vision tower is not loaded).
MULTIMODAL = {"gemma3": "gemma3_text"}


def family_of(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)} "
                         f"(and the text model of {', '.join(MULTIMODAL)})")
    return FAMILIES[model_type]


def canonical_tensors(model_type: str, tensors: dict[str, torch.Tensor], raw: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the common naming."""
    family = family_of(model_type)
    if family.unpack is not None:
        tensors = family.unpack(tensors, raw)
    out = {}
    for name, t in tensors.items():
        for old, new in family.renames:
            name = name.replace(old, new)
        out[name] = t
    return out
