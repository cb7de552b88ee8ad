"""Architecture hyper-parameters of a Llama-family decoder, independent of the file format."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


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
    # Hugging Face style rope scaling: {"rope_type": "linear"|"llama3", "factor": ..., ...}.
    rope_scaling: dict | None = field(default=None, hash=False)
    # Sliding-window attention (see common/engine/attention_window.py): a query at position i attends
    # keys in (i - sliding_window, i]; None = full causal attention.
    sliding_window: int | None = None
    # Leading positions every query attends besides its window (StreamingLLM sinks); needs a window.
    attention_sinks: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or null for full attention); got {self.sliding_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention sinks must be >= 0; got {self.attention_sinks}")
        if self.attention_sinks and self.sliding_window is None:
            raise ValueError("attention sinks need a sliding-window model (sliding_window in its config.json); "
                             "this model attends every position already")

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse RoPE frequencies `[head_dim // 2]`, with the configured scaling applied."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return inv_freq.float()
        if kind == "linear":
            return (inv_freq / scaling["factor"]).float()
        if kind == "llama3":
            return _llama3_scaled(inv_freq, scaling).float()
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


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
