"""Load a GGUF file (llama.cpp's format) of an architecture in common/model/gguf_arch.py: the
metadata read into the config.json its Hugging Face checkpoint would have, which becomes a
ModelConfig the way common/model/hf_loader.py makes one; the tensors dequantized to fp32, what
llama.cpp's converter changed undone, and named as the family's Hugging Face checkpoint names them."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import Keys

from common.model.checkpoint import Checkpoint, hash_files
from common.model.family import canonical_tensors, family_of
from common.model.gguf_arch import ROPE_FACTOR_TENSORS, GgufArch, Metadata, architecture_of
from common.model.gguf_dequant import dequantize
from common.model.gguf_file import GgufFile, GgufTensor
from common.model.gguf_weight import NATIVE, GgufWeight
from common.model.hf_loader import FULL, SLIDING, model_config

_SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K,
                     Q.MXFP4}
# GGUF metadata keys read as they are into config.json's keys of the same meaning.
_KEYS = {
    Keys.LLM.BLOCK_COUNT: "num_hidden_layers", Keys.LLM.EMBEDDING_LENGTH: "hidden_size",
    Keys.LLM.FEED_FORWARD_LENGTH: "intermediate_size", Keys.LLM.CONTEXT_LENGTH: "max_position_embeddings",
    Keys.Attention.HEAD_COUNT: "num_attention_heads", Keys.Attention.HEAD_COUNT_KV: "num_key_value_heads",
    Keys.Attention.LAYERNORM_RMS_EPS: "rms_norm_eps", Keys.Rope.FREQ_BASE: "rope_theta",
    Keys.Attention.SLIDING_WINDOW: "sliding_window",
    Keys.LLM.ATTN_LOGIT_SOFTCAPPING: "attn_logit_softcapping",
    Keys.LLM.FINAL_LOGIT_SOFTCAPPING: "final_logit_softcapping",
    # Granite's multipliers (the converter renames `*_multiplier` to `*_scale`)
    Keys.Attention.SCALE: "attention_multiplier", Keys.LLM.EMBEDDING_SCALE: "embedding_multiplier",
    Keys.LLM.RESIDUAL_SCALE: "residual_multiplier", Keys.LLM.LOGIT_SCALE: "logits_scaling",
    Keys.LLM.EXPERT_COUNT: "num_local_experts", Keys.LLM.EXPERT_USED_COUNT: "num_experts_per_tok",
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: "moe_intermediate_size", Keys.LLM.EXPERT_WEIGHTS_NORM: "norm_topk_prob",
}


def _rope_scaling(meta: Metadata, factors: dict[str, list[float]]) -> dict | None:
    """config.json's rope scaling from the file's `rope.scaling.*` keys, or from its rope factor
    tensors (`factors`, by name), which the converter writes with no scaling type beside them."""
    kind = meta.get(Keys.Rope.SCALING_TYPE)
    if factors:
        if kind not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope: scaling {kind!r} beside per-frequency factors "
                             f"({', '.join(sorted(factors))})")
        return _factor_scaling(meta, factors)
    if kind in (None, "none"):
        return None
    factor = float(meta.get(Keys.Rope.SCALING_FACTOR))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        yarn = {"beta_fast": Keys.Rope.SCALING_YARN_BETA_FAST, "beta_slow": Keys.Rope.SCALING_YARN_BETA_SLOW,
                "attention_factor": Keys.Rope.SCALING_YARN_ATTN_FACTOR}
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN))} | {
            name: float(meta.get(key)) for name, key in yarn.items() if meta.get(key) is not None}
    raise ValueError(f"unsupported GGUF rope scaling {kind!r}")


def _factor_scaling(meta: Metadata, factors: dict[str, list[float]]) -> dict:
    """The rope of a file with factor tensors. Phi-3's two longrope sets are config.json's
    `short_factor` and `long_factor`; llama.cpp takes the long set past `rope.scaling.original_context_length`
    (else the file's context length), and multiplies cos and sin by `rope.scaling.attn_factor`, which the
    converter computes as transformers does from the two context lengths (absent, transformers' value).
    `rope_freqs` is what remains of Llama 3.1's `llama3` scaling: one divisor per frequency, its
    parameters (factor, low/high frequency factors, original context) written nowhere."""
    if "rope_freqs" in factors and len(factors) == 1:
        return {"rope_type": "frequency_factors", "factors": factors["rope_freqs"]}
    if set(factors) != {"rope_factors_short", "rope_factors_long"}:
        raise ValueError(f"unsupported GGUF rope factors: {', '.join(sorted(factors))} (longrope needs both "
                         "rope_factors_short and rope_factors_long; rope_freqs goes alone)")
    original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN, meta.get(Keys.LLM.CONTEXT_LENGTH))
    scaling = {"rope_type": "longrope", "short_factor": factors["rope_factors_short"],
               "long_factor": factors["rope_factors_long"], "original_max_position_embeddings": int(original)}
    if (attention := meta.get(Keys.Rope.SCALING_ATTN_FACTOR)) is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def hf_config(meta: Metadata, arch: GgufArch, shapes: dict[str, tuple[int, ...]],
              rope_factors: dict[str, list[float]]) -> dict:
    """The config.json of the Hugging Face checkpoint this GGUF file was converted from, as far
    as the model's forward needs it; `shapes`: each tensor's shape by its GGUF name;
    `rope_factors`: the file's rope factor tensors (ROPE_FACTOR_TENSORS) by name."""
    raw = arch.defaults | {name: meta.get(key) for key, name in _KEYS.items() if meta.get(key) is not None}
    layers = raw["num_hidden_layers"]
    experts = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    model_type = arch.moe_model_type if experts and arch.moe_model_type else arch.model_type
    raw |= {
        "model_type": model_type,
        "vocab_size": shapes["token_embd.weight"][0],
        "head_dim": meta.head_dim(),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "rope_scaling": _rope_scaling(meta, rope_factors),
        "sliding_window": raw.get("sliding_window") or None,  # Phi-3's converter writes 0 for none
    }
    raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
    raw.setdefault("rope_theta", 10000.0)
    if (rotary := meta.get(Keys.Rope.DIMENSION_COUNT)) is not None and rotary != raw["head_dim"]:
        raw["partial_rotary_factor"] = rotary / raw["head_dim"]
    if experts:
        raw["mlp_only_layers"] = [i for i in range(layers) if i not in experts]
    if raw["sliding_window"]:
        raw["layer_types"] = [SLIDING if s else FULL for s in _sliding_layers(meta, arch, layers)]
    if arch.config is not None:
        raw |= arch.config(meta, raw)
    return raw


def _sliding_layers(meta: Metadata, arch: GgufArch, layers: int) -> list[bool]:
    """Which layers slide: the file's `sliding_window_pattern`, else llama.cpp's fixed pattern
    for the architecture, else every layer."""
    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if pattern is not None:
        return [bool(s) for s in pattern]
    n = arch.swa_period
    return [n is None or i % n < n - 1 for i in range(layers)]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's interleaving of each head's Q/K rows, so rotate-half RoPE applies."""
    out, inp = w.shape[0], int(np.prod(w.shape[1:]))
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, inp).swapaxes(1, 2).reshape(w.shape)


def _floats(t: GgufTensor) -> np.ndarray:
    return dequantize(t.data, t.tensor_type, t.shape)


def _weights(t: GgufTensor, arch: GgufArch, raw: dict, source: str,
             native: bool = False) -> dict[str, torch.Tensor | GgufWeight]:
    """One GGUF tensor as the Hugging Face tensors it came from (several for stacked experts);
    with `native`, a projection's weight in blocks the kernel computes stays in them."""
    name = arch.hf_name(t.name)
    if name is None:
        raise ValueError(f"{source}: unexpected tensor {t.name!r} for a GGUF of {arch.model_type}")
    if t.tensor_type not in _SUPPORTED_QUANTS:
        raise ValueError(f"{source}: tensor {t.name} has unsupported type {t.tensor_type.name}")
    if native and name.endswith(NATIVE) and (kept := GgufWeight.of(t.data, t.tensor_type, t.shape)):
        if arch.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):  # rows move whole
            heads = raw["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            kept = replace(kept, blocks=torch.from_numpy(_unpermute(kept.blocks.numpy(), heads).copy()))
        return {name: kept}
    w = _floats(t)
    if arch.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = _unpermute(w, raw["num_attention_heads"])
    elif arch.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = _unpermute(w, raw["num_key_value_heads"])
    if arch.norm_shift and name.endswith("norm.weight"):
        w -= arch.norm_shift
    if "{e}" in name:
        return {name.format(e=e): torch.from_numpy(w[e].copy()) for e in range(w.shape[0])}
    return {name: torch.from_numpy(w)}


def load_gguf(path: str | Path, quantization: str = "none") -> Checkpoint:
    """The checkpoint of a GGUF file, as load_hf_dir gives that of the directory it was converted
    from; with `quantization` "gguf", its projections in the blocks the file stores them in
    (common/model/gguf_weight.py), where the family's tensors are the file's own (no unpacking)."""
    path = Path(path)
    reader = GgufFile(path)
    arch_name, arch = architecture_of(reader.fields)  # refuse before reading anything else
    factors = {t.name.split(".")[0]: t for t in reader.tensors if t.name.split(".")[0] in ROPE_FACTOR_TENSORS}
    rope_factors = {name: _floats(t).tolist() for name, t in factors.items()}
    raw = hf_config(Metadata(reader.fields, arch_name), arch, {t.name: t.shape for t in reader.tensors}, rope_factors)
    config = model_config(raw)
    native = quantization == "gguf" and family_of(raw["model_type"]).unpack is None
    tensors: dict[str, torch.Tensor | GgufWeight] = {}
    for t in reader.tensors:
        if t.name.split(".")[0] not in factors:  # the rope factors are the config's, not weights
            tensors |= _weights(t, arch, raw, path.name, native)
    model_hash = hash_files([path])
    if any(isinstance(w, GgufWeight) for w in tensors.values()):  # other sums: KV that is not the float model's
        model_hash += ";quantization=gguf"
    return Checkpoint(config, canonical_tensors(raw["model_type"], tensors, raw), model_hash, path)
