"""Hyper-parameters of a decoder, independent of the file format; what differs between families
in structure is declared in common/model/family.py, keyed by `architecture` (the `model_type`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from common.model.family import FAMILIES


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token runs `top_k` of `num_experts` gated MLPs of
    `intermediate_size`, weighted as the family's routing says (common/model/family.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool = True  # softmax_topk routing: rescale the chosen k weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP of the model's intermediate_size
    swiglu_alpha: float = 1.702  # gpt-oss's clamped SwiGLU
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # Hugging Face style rope scaling: {"rope_type": "linear"|"llama3"|"yarn"|"longrope", "factor": ..., ...}, or
    # {"rope_type": "frequency_factors", "factors": [...]}: a GGUF's `rope_freqs` tensor, one divisor per frequency.
    rope_scaling: dict | None = field(default=None, hash=False)
    # Sliding-window attention (see common/engine/attention_window.py): a query at position i attends
    # keys in (i - sliding_window, i]; None = full causal attention.
    sliding_window: int | None = None
    # Leading positions every query attends besides its window (StreamingLLM sinks); needs a window.
    attention_sinks: int = 0
    # Hybrid models (Gemma 2/3, gpt-oss): each layer's window, None for a full-attention layer.
    # `sliding_window` is then None: the pages the full layers read are kept for every layer.
    layer_windows: tuple[int | None, ...] | None = None
    # The rope of the sliding layers of a hybrid model when it differs (Gemma 3's local base).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0  # the leading share of each head's dimensions that rope rotates
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # attention's and the MLP's outputs, before the residual add
    logits_divisor: float = 1.0
    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or null for full attention); got {self.sliding_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention sinks must be >= 0; got {self.attention_sinks}")
        if self.attention_sinks and self.sliding_window is None:
            raise ValueError("attention sinks need a sliding-window model whose every layer slides (sliding_window "
                             "in its config.json); this model attends every position already")
        if self.layer_windows is not None and (len(self.layer_windows) != self.num_layers or self.sliding_window):
            raise ValueError("layer_windows needs one entry per layer and no model-wide sliding_window")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1]; got {self.partial_rotary_factor}")
        self.rope(sliding=True, long=True)  # an unsupported rope fails at load, not at the first forward

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, None when it attends the whole context."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope_from(self) -> int | None:
        """Longrope (Phi-3 128k, Phi-3.5): a sequence of more tokens than this computes every
        position with the long factors, a shorter one with the short factors, as transformers
        does (`rope(long=True)`); None when the model's rope has one set of frequencies."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) != "longrope":
            return None
        return int(scaling["original_max_position_embeddings"])

    def rope(self, sliding: bool = False, long: bool = False) -> tuple[torch.Tensor, float]:
        """Inverse RoPE frequencies `[rotary_dim // 2]` with the configured scaling applied, and
        the factor cos and sin are multiplied by (YaRN's and longrope's attention factor, else 1),
        of the full layers or, with `sliding`, of the sliding layers; `long`: longrope's long factors."""
        theta, scaling = self.rope_theta, self.rope_scaling or {}
        if sliding and self.sliding_rope_theta is not None:
            theta, scaling = self.sliding_rope_theta, self.sliding_rope_scaling or {}
        dim = self.rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return inv_freq.float(), 1.0
        if kind == "linear":
            return (inv_freq / scaling["factor"]).float(), 1.0
        if kind == "llama3":
            return _llama3_scaled(inv_freq, scaling).float(), 1.0
        if kind == "yarn":
            return _yarn_scaled(theta, dim, scaling)
        if kind == "longrope":
            return _longrope_scaled(inv_freq, scaling, self.max_position_embeddings, long)
        if kind == "frequency_factors":  # what llama.cpp's converter made of Llama 3.1's `llama3` scaling
            return _divided(inv_freq, scaling["factors"], "frequency_factors").float(), 1.0
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, "
                         "longrope, frequency_factors)")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short kept,
    the band between interpolated smoothly."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, blended, scaled)


def _yarn_scaled(theta: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies that turn fewer than
    `beta_slow` times over the original context are interpolated by `factor`, those turning more
    than `beta_fast` times kept, a linear ramp between; cos and sin scaled by the attention factor."""
    factor, original = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    return inv_freq, float(attention_factor)


def _longrope_scaled(inv_freq: torch.Tensor, s: dict, max_positions: int, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3) as transformers computes it: each frequency divided by its own short or
    long factor; cos and sin scaled by sqrt(1 + ln(factor) / ln(original context)), the factor
    being the context's growth (`max_position_embeddings` over the original) unless given."""
    original = s["original_max_position_embeddings"]
    key = "long_factor" if long else "short_factor"
    inv_freq = _divided(inv_freq, s[key], f"longrope's {key}")
    factor = s.get("factor") or max_positions / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq.float(), float(attention_factor)


def _divided(inv_freq: torch.Tensor, factors: list[float], kind: str) -> torch.Tensor:
    """Each inverse frequency divided by its own factor (longrope's; a GGUF's `rope_freqs`, which
    llama.cpp's rope divides each frequency by)."""
    if len(factors) != len(inv_freq):
        raise ValueError(f"{kind} needs {len(inv_freq)} rope factors (rotary_dim / 2); got {len(factors)}")
    return inv_freq / torch.tensor(factors, dtype=torch.float64)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
