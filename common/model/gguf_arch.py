"""What each GGUF architecture we read is, declared as data: the family (common/model/family.py)
a file of that architecture loads as, its tensor names, and what llama.cpp's converter
(convert_hf_to_gguf.py) did to the Hugging Face checkpoint that common/model/gguf_loader.py undoes.

The facts are llama.cpp's: tensor names as `gguf.constants.TENSOR_NAMES` spells them, metadata keys
as `gguf.Keys` does, and what its converter and its C++ loader (llama-model.cpp) fix per architecture
instead of writing a key for it (sliding-layer patterns, Gemma's attention scale, defaults).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf import Keys


class Metadata:
    """A GGUF file's metadata of one architecture: `get(gguf.Keys.LLM.BLOCK_COUNT)` reads
    `<arch>.block_count`."""

    def __init__(self, fields: dict[str, Any], arch: str) -> None:
        self.fields, self.arch = fields, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key.format(arch=self.arch), default)

    def head_dim(self) -> int:
        hidden, heads = self.get(Keys.LLM.EMBEDDING_LENGTH), self.get(Keys.Attention.HEAD_COUNT)
        return int(self.get(Keys.Attention.KEY_LENGTH, hidden // heads))


# A layer's GGUF tensor names (`blk.{i}.<name>.weight`/`.bias`) and the Hugging Face names under
# `model.layers.{i}.`; `{e}`: one tensor per expert, stacked along the first dimension in the GGUF.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",  # on attention's output (Gemma, OLMo 2; gpt-oss: before the MLP)
    "ffn_norm": "post_attention_layernorm",  # before the MLP (Llama's name for that norm)
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
BARE_PARAMETERS = {"attn_sinks"}  # a parameter, not a module's: no `.weight` in its Hugging Face name
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Per-frequency rope factors, which the converter computes from config.json's rope scaling and
# writes as tensors: the loader reads them into the config's rope, never among the weights.
# `rope_freqs` (Llama 3.1's `llama3` scaling, one divisor per frequency for every sequence);
# `rope_factors_short` / `rope_factors_long` (Phi-3's longrope: its `short_factor` and `long_factor`).
ROPE_FACTOR_TENSORS = {"rope_freqs", "rope_factors_short", "rope_factors_long"}


def _gemma_query_scalar(layers_of_27b: int) -> Callable[[Metadata, dict], dict]:
    """Gemma's `query_pre_attn_scalar`, which the converter does not write: llama.cpp takes the
    head size, or hidden / heads for the 27B model (known by its layer count)."""
    def config(meta: Metadata, raw: dict) -> dict:
        big = raw["num_hidden_layers"] == layers_of_27b
        return {"query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"]}
    return config


def _gemma3(meta: Metadata, raw: dict) -> dict:
    """Gemma 3's sliding layers turn rope at their own base: the converter writes it as
    `rope.freq_base_swa`, which llama.cpp defaults to 10000."""
    return _gemma_query_scalar(62)(meta, raw) | {"rope_local_base_freq": float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10000.0))}


def _gpt_oss(meta: Metadata, raw: dict) -> dict:
    """gpt-oss's YaRN keeps the correction range unrounded (config.json's `truncate: false`),
    which no GGUF key says."""
    return {"rope_scaling": {**raw["rope_scaling"], "truncate": False}} if raw.get("rope_scaling") else {}


@dataclass(frozen=True)
class GgufArch:
    model_type: str  # the family a file of this architecture loads as
    moe_model_type: str | None = None  # the family when the file has experts (Mixtral is written as `llama`)
    names: dict[str, str] = field(default_factory=dict)  # layer names that differ from LAYER_NAMES
    # The converter interleaved each head's Q and K rows (its LlamaModel.permute) for llama.cpp's
    # rope, which pairs adjacent dimensions where Hugging Face rotates the two halves.
    permuted_qk: bool = False
    norm_shift: float = 0.0  # the converter stored every RMSNorm weight plus this (Gemma's `1 + w`)
    # llama.cpp's sliding-layer pattern when the file has a window and no `sliding_window_pattern`
    # key: layer i slides when i % n < n - 1 (set_swa_pattern(n)); None: every layer slides.
    swa_period: int | None = None
    defaults: dict = field(default_factory=dict)  # config.json values llama.cpp assumes when a key is missing
    config: Callable[[Metadata, dict], dict] | None = None  # config.json values derived otherwise

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor (`{e}` in it for stacked experts), or None."""
        base, _, kind = gguf_name.rpartition(".")
        if base in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[base]}.{kind}"
        parts, names = base.split("."), LAYER_NAMES | self.names
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in names:
            return None
        name = f"model.layers.{parts[1]}.{names[parts[2]]}"
        return name if parts[2] in BARE_PARAMETERS else f"{name}.{kind}"


_GEMMA = dict(names={"ffn_norm": "pre_feedforward_layernorm"}, norm_shift=1.0)

ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("llama", moe_model_type="mixtral", permuted_qk=True),
    "qwen2": GgufArch("qwen2"),
    "qwen3": GgufArch("qwen3"),
    "qwen3moe": GgufArch("qwen3_moe"),
    "gemma2": GgufArch("gemma2", **_GEMMA, swa_period=2, config=_gemma_query_scalar(46),
                       defaults={"sliding_window": 4096, "attn_logit_softcapping": 50.0,
                                 "final_logit_softcapping": 30.0}),
    "gemma3": GgufArch("gemma3_text", **_GEMMA, swa_period=6, config=_gemma3),
    "phi3": GgufArch("phi3", names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    "granite": GgufArch("granite", permuted_qk=True),
    "olmo2": GgufArch("olmo2"),
    "gpt-oss": GgufArch("gpt_oss", swa_period=2, config=_gpt_oss),
}


def architecture_of(fields: dict[str, Any]) -> tuple[str, GgufArch]:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return arch, ARCHITECTURES[arch]
