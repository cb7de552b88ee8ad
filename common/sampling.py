"""Sampling parameters and the per-request next-token sampler."""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch


MIN_TEMPERATURE = 1e-5
MAX_N = 16  # parallel samples per request; each one decodes as a sequence of its own


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # parallel samples sharing the prompt's KV

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message a caller can act on."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # dividing the logits by it would overflow
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N} parallel samples, got {self.n}")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of parallel sample `index`. With a seed, sample i draws exactly the
        tokens an n=1 request with `seed + i` would draw (so sample 0 is the n=1 request)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


@dataclass
class Sampler:
    """Draws the next token of one request; seeded requests are reproducible."""

    params: SamplingParams
    seed: int = field(init=False)
    # Made at the first random draw, on the logits' device (a CUDA draw needs a CUDA generator).
    generator: torch.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator

    def sample(self, logits: torch.Tensor) -> int:
        """`logits` is `[vocab]` fp32."""
        p = self.params
        if p.temperature == 0.0:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(probs.device)))
