"""A GGUF file of every family llama.cpp converts loads to the model of its Hugging Face directory.

Each tiny random checkpoint (harness/tiny_families.py) is written here as llama.cpp's
convert_hf_to_gguf.py writes it: tensor names from the `gguf` package's own map
(`gguf.get_tensor_name_map`), metadata under `gguf.Keys` through GGUFWriter's methods, and the
converter's changes to the weights made as it makes them (Gemma's norms stored as `1 + w`, Q/K
rows interleaved for the llama architecture, experts stacked, Phi-3's fused tensors kept, rope
scaling that llama.cpp takes per frequency written as the factor tensors the converter computes).
None of this reads common/model/gguf_arch.py, so the loader's table is checked, not echoed.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from harness.engine_checks import full_logits
from harness.reference import engine_greedy
from harness.tiny_families import COMMON, FULL, SLIDING, assert_as_transformers, configs, save_model, save_tiny, tiny_prompt

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

# The converter's GGUF architecture of each family, and whether it interleaves Q/K rows (its
# LlamaModel and the classes built on it: Llama, Mistral, Mixtral, Granite).
_ARCH = {"llama": ("LLAMA", True), "qwen3": ("QWEN3", False), "gemma2": ("GEMMA2", False),
         "gemma3_text": ("GEMMA3", False), "phi3": ("PHI3", False), "granite": ("GRANITE", True),
         "olmo2": ("OLMO2", False), "mixtral": ("LLAMA", True), "qwen3_moe": ("QWEN3MOE", False),
         "gpt_oss": ("GPT_OSS", False)}
# Where the tiny checkpoint differs from what llama.cpp can hold, it is made like the published
# models: Gemma's `query_pre_attn_scalar` is the head size (llama.cpp derives it, no key carries it);
# Gemma 3 slides 5 layers in 6 (llama.cpp's fixed pattern); Qwen3-MoE has no dense layer (the
# converter has no name for one's MLP).
_AS_PUBLISHED = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=[SLIDING] * 5 + [FULL]),
    "qwen3_moe": dict(mlp_only_layers=[]),
}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The converter's Q/K row order: within each head, the rows of the first and second half
    interleaved (llama.cpp rotates adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(w, name: str, cfg: dict) -> None:
    """The keys the converter's model class for `name` writes (tokenizer keys aside)."""
    rope = cfg.get("rope_parameters") or {}
    full_rope = rope.get(FULL, rope)
    heads = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if name != "gemma2":  # Gemma 2's class writes no rope base (llama.cpp takes 10000, its config's)
        w.add_rope_freq_base(full_rope["rope_theta"])
    if SLIDING in rope:
        w.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])
    if full_rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full_rope["factor"])
        w.add_rope_scaling_orig_ctx_len(full_rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(full_rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(full_rope["beta_slow"])
    if cfg.get("head_dim") and name != "granite":  # Granite's class drops head_dim
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if name in ("qwen3_moe", "gpt_oss"):
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if name in ("llama", "mixtral", "granite"):  # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    if name == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if name == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if name == "phi3":
        original = cfg["original_max_position_embeddings"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads)
        w.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":  # the attention factor from the context's growth, as transformers'
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if name in ("gemma2", "gemma3_text", "gpt_oss", "phi3"):
        w.add_sliding_window(cfg.get("sliding_window") or 0)  # Phi-3: 0 when it has none


def _rope_factors(cfg: dict) -> dict[str, np.ndarray]:
    """The tensors the converter generates from config.json's rope scaling, by GGUF name: Llama 3.1's
    `llama3` scaling as one factor per frequency (LlamaModel, every step in float32 as its torch
    tensors run), Phi-3's longrope factor sets as they are."""
    rope = cfg.get("rope_parameters") or {}
    name = gguf.TENSOR_NAMES
    if rope.get("rope_type") == "longrope":
        return {name[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight": np.float32(rope["long_factor"]),
                name[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight": np.float32(rope["short_factor"])}
    if rope.get("rope_type") != "llama3":
        return {}
    dim = cfg["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    # The original context as config.json holds it, in the rope parameters (the converter's LlamaModel
    # looks for it at the top level, else takes 8192: every Llama 3.x's value).
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen < original / high, 1.0, torch.where(wavelen > original / low, factor, between))
    return {name[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight": factors.float().numpy()}


def _converted_tensors(name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the converter changes them, under Hugging Face names its map knows."""
    out: dict[str, torch.Tensor] = {}
    permuted = _ARCH[name][1]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in sorted(tensors.items()):
        if name.startswith("gemma") and key.endswith("norm.weight"):
            t = t + 1
        if permuted and key.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute(t, heads)
        if permuted and key.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute(t, kv_heads)
        prefix, dot, rest = key.partition(".experts.")
        if dot and rest.split(".")[0].isdigit():  # one expert's projection: stacked over the experts
            expert, proj = rest.split(".", 1)
            experts.setdefault(f"{prefix}.experts.{proj}", {})[int(expert)] = t
        elif name == "gpt_oss" and dot:  # [experts, in, out], gate and up interleaved
            if rest == "gate_up_proj":
                t = t.transpose(-1, -2)
                out |= {f"{prefix}.experts.gate_proj.weight": t[:, ::2], f"{prefix}.experts.up_proj.weight": t[:, 1::2]}
            elif rest == "gate_up_proj_bias":
                out |= {f"{prefix}.experts.gate_proj.bias": t[..., ::2], f"{prefix}.experts.up_proj.bias": t[..., 1::2]}
            elif rest == "down_proj":
                out[f"{prefix}.experts.down_proj.weight"] = t.transpose(-1, -2)
            else:
                out[f"{prefix}.experts.down_proj.bias"] = t
        else:
            out[key + (".weight" if key.endswith("sinks") else "")] = t
    return out | {k: torch.stack([v[e] for e in sorted(v)]) for k, v in experts.items()}


def _mxfp4_experts(hf, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """gpt-oss's expert weights in MXFP4, as its published GGUFs hold them; the transformers
    model is given the rounded weights, so both run the same numbers."""
    quantized = {}
    for key in [k for k in tensors if ".experts." in k and k.endswith("proj.weight")]:
        q = gguf.quants.quantize(tensors[key].numpy(), gguf.GGMLQuantizationType.MXFP4)
        quantized[key] = q
        tensors[key] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).copy())
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            layer.mlp.experts.gate_up_proj[:, :, ::2] = tensors[f"{p}gate_proj.weight"].transpose(1, 2)
            layer.mlp.experts.gate_up_proj[:, :, 1::2] = tensors[f"{p}up_proj.weight"].transpose(1, 2)
            layer.mlp.experts.down_proj.copy_(tensors[f"{p}down_proj.weight"].transpose(1, 2))
    return quantized


def write_gguf(name: str, hf, directory: Path) -> Path:
    """The Hugging Face checkpoint in `directory` as llama.cpp's converter writes it (float32)."""
    from safetensors.torch import load_file

    cfg = json.loads((directory / "config.json").read_text())
    arch = getattr(gguf.MODEL_ARCH, _ARCH[name][0])
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    tensors = _converted_tensors(name, cfg, load_file(directory / "model.safetensors"))
    quantized = _mxfp4_experts(hf, tensors) if name == "gpt_oss" else {}
    path = directory / f"{name}.gguf"
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, name, cfg)
    for gguf_name, factors in _rope_factors(cfg).items():  # the converter writes them first
        writer.add_tensor(gguf_name, factors)
    for key, t in tensors.items():
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"the converter has no name for {key}"
        if key in quantized:
            writer.add_tensor(gguf_name, quantized[key], raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(gguf_name, t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_config(a, b) -> None:
    """Equal, but for float32 rounding of the numbers GGUF stores as float32; the rope compared by
    what it computes (a GGUF may describe the same frequencies otherwise than config.json)."""
    for f in dataclasses.fields(a):
        if f.name not in ("rope_scaling", "sliding_rope_scaling"):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert x == (pytest.approx(y, rel=1e-6) if isinstance(y, float) else y), f.name
    assert a.long_rope_from == b.long_rope_from
    for sliding in (False, True):
        for long in (False, True):
            (x, x_scale), (y, y_scale) = a.rope(sliding, long), b.rope(sliding, long)
            assert torch.allclose(x, y, rtol=1e-6, atol=0) and x_scale == pytest.approx(y_scale, rel=1e-6)


@pytest.mark.parametrize("name", list(configs()))
def test_gguf_loads_as_its_hugging_face_directory(name, tmp_path):
    """Same config as the directory's, float32 logits within 1e-4 of transformers', the same 12
    greedy tokens after prompts five windows long."""
    hf = save_tiny(name, tmp_path, **_AS_PUBLISHED.get(name, {}))
    assert_as_transformers(_load_gguf(name, hf, tmp_path), hf)


def _load_gguf(name: str, hf, directory: Path) -> DecoderModel:
    """The model of the directory's GGUF, its config checked against the directory's."""
    ckpt, directory_ckpt = load_checkpoint(write_gguf(name, hf, directory)), load_checkpoint(directory)
    _assert_same_config(ckpt.config, directory_ckpt.config)
    assert ckpt.tensors.keys() == directory_ckpt.tensors.keys()  # no rope factors among the weights
    return DecoderModel(ckpt)


# Llama 3.1's rope scaling, its original context small enough that the tiny model's 8 frequencies
# fall in all three bands: kept, slowed by `factor`, and blended between.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_gguf_divides_each_frequency_by_its_factor(tmp_path):
    """A Llama 3.1/3.2/3.3 GGUF holds of the `llama3` scaling only the converter's `rope_freqs`, one
    factor per frequency; dividing each frequency by it is the directory's rope. No config.json
    can say that, so such a file is not exported as a Hugging Face directory."""
    import transformers

    from scripts.export_hf_model import export_hf_model

    hf = save_model(transformers.LlamaConfig(**COMMON, rope_parameters=dict(_LLAMA3_ROPE)), tmp_path)
    model = _load_gguf("llama", hf, tmp_path)
    factors = model.config.rope_scaling["factors"]
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[-1] == 8.0  # the three bands
    assert_as_transformers(model, hf)
    with pytest.raises(ValueError, match="no config.json holds"):
        export_hf_model(tmp_path / "exported", tmp_path / "llama.gguf")


def test_longrope_gguf_takes_the_long_factors_past_the_original_context(tmp_path):
    """A Phi-3 128k / Phi-3.5 GGUF: its `rope_factors_short` / `rope_factors_long`, original context
    and attention factor are the directory's longrope. A sequence longer than the original context
    (24 tokens) computes with the long factors, one that outgrows it while decoding is computed
    again, as transformers' Phi-3 `generate` does."""
    original, half = 24, COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.7 * i for i in range(half)]}
    hf = save_tiny("phi3", tmp_path, rope_parameters=rope, original_max_position_embeddings=original)
    model = _load_gguf("phi3", hf, tmp_path)
    assert model.config.long_rope_from == original
    short, long = tiny_prompt(20, 20), tiny_prompt(21, 30)
    for prompt, past_it in ((short, False), (long, True)):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0]
        assert (full_logits(model, prompt, long_rope=past_it) - reference).abs().max().item() <= 1e-4
    generated = hf.generate(torch.tensor([short]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            pad_token_id=0)[0, len(short):].tolist()
    assert engine_greedy(model, short, 12, page_size=4) == generated


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'; supported: llama, qwen2, qwen3, "
                                         "qwen3moe, gemma2, gemma3, phi3, granite, olmo2, gpt-oss"):
        load_checkpoint(tmp_path / "mamba.gguf")
