"""Load a GGUF file of the llama, qwen2 or qwen3 architecture: metadata to ModelConfig, tensors
dequantized to fp32 and named as the Hugging Face checkpoint of the same family names them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from common.model.checkpoint import Checkpoint, hash_files
from common.model.config import ModelConfig
from common.model.gguf_file import GgufFile

# GGUF architectures we read, and the Hugging Face architecture each corresponds to.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_SUPPORTED_QUANTS = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _config(fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    hidden = int(fields.get(f"{arch}.embedding_length"))
    heads = int(fields.get(f"{arch}.attention.head_count"))
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens"))
    rope_scaling = None
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(fields.get(f"{arch}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with per-frequency rope factors (rope_freqs) are not supported; "
                         "load the Hugging Face directory of this model instead")
    window = fields.get(f"{arch}.attention.sliding_window")  # llama.cpp's key, when it writes one
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(fields.get(f"{arch}.feed_forward_length")),
        num_layers=int(fields.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(fields.get(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        sliding_window=None if window is None else int(window),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so rotate-half RoPE applies."""
    out, inp = w.shape[0], int(np.prod(w.shape[1:]))
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, inp).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def load_gguf(path: str | Path) -> Checkpoint:
    path = Path(path)
    reader = GgufFile(path)
    config = _config(reader.fields, {t.name for t in reader.tensors})
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"{path.name}: unexpected tensor {t.name!r}")
        if t.tensor_type not in _SUPPORTED_QUANTS:
            raise ValueError(f"{path.name}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        # F32 data comes back as a read-only memmap: dequantize() copies it.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if config.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, config.num_heads)
        elif config.architecture == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, config.num_kv_heads)
        tensors[name] = torch.from_numpy(w)
    return Checkpoint(config, tensors, hash_files([path]), path)
