"""Sampling parameters, the per-request next-token sampler and logprobs.

Logprobs are of the distribution a token was drawn from: the model's log-softmax after the
guided-decoding mask and the temperature (greedy: none), before the top-k and top-p cuts (as
vLLM documents). Prompt logprobs are of the raw model (no mask, no temperature).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from common.engine.sampling_limits import MAX_N, MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from common.engine.guided import Grammar, GrammarMatcher

MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token, which has no context


@dataclass(frozen=True)
class PositionLogprobs:
    """A position's token and the `top` most likely tokens there, most likely first."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


def position_logprobs(logprobs: torch.Tensor, tokens: list[int], top_n: int) -> list[PositionLogprobs]:
    """`logprobs` `[T, vocab]` (log-softmaxed) -> each row's entry for `tokens[row]` and its
    `top_n` most likely tokens (fewer where fewer are possible: masked tokens are left out)."""
    picked = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    top_values, top_ids = (logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], logprobs[:, :0]))
    out = []
    for token, lp, values, ids in zip(tokens, picked, top_values.tolist(), top_ids.long().tolist()):
        top = tuple(TokenLogprob(i, v) for i, v in zip(ids, values) if v != float("-inf"))
        out.append(PositionLogprobs(TokenLogprob(token, lp), top))
    return out


class PromptLogprobs:
    """A prompt's logprobs, gathered as its chunks are computed (its first token has none)."""

    def __init__(self, prompt: list[int], top_n: int) -> None:
        self.prompt = prompt
        self.top_n = top_n
        self.entries = [PositionLogprobs(TokenLogprob(prompt[0], None))]

    @property
    def done(self) -> bool:
        return len(self.entries) == len(self.prompt)

    def add(self, logits: torch.Tensor, start: int) -> None:
        """`logits` `[n, vocab]` computed at positions `[start, start + n)`: row j predicts the
        token at `start + 1 + j`. Positions scored before (a recomputed chunk) are skipped."""
        first = len(self.entries)
        if start >= first:
            raise RuntimeError(f"prompt positions {first}..{start} were never computed here")
        lo, hi = first - 1 - start, min(len(self.prompt) - 1 - start, logits.shape[0])
        if lo < hi:
            rows = logits[lo:hi].float().log_softmax(-1)
            self.entries.extend(position_logprobs(rows, self.prompt[first : first + hi - lo], self.top_n))


@dataclass(frozen=True)
class Draw:
    """A drawn token, with its logprobs when the request asked for them."""

    token: int
    logprobs: PositionLogprobs | None = None


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
    logprobs: bool = False  # each drawn token's logprob
    top_logprobs: int = 0  # with logprobs: this many most likely tokens too
    prompt_logprobs: int | None = None  # set: the prompt's logprobs, with this many most likely tokens
    guided: Grammar | None = None  # structured output: each sample walks it with its own matcher
    num_speculative_tokens: int | None = None  # draft length (0 = none); None = the node's --num-speculative-tokens

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError with a message a caller can act on."""
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = only compute the prompt), got {self.max_tokens}")
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
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be set")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0 = no drafts), got {self.num_speculative_tokens}")
        if self.guided is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with guided decoding: EOS ends a completed grammar")

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
    matcher: GrammarMatcher | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        if self.params.guided is not None:
            self.matcher = self.params.guided.matcher()

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
        return self.generator

    def draw(self, logits: torch.Tensor) -> Draw:
        """The next token from `logits` (`[vocab]` fp32), within the grammar if there is one."""
        p = self.params
        if self.matcher is not None:
            allowed = self.matcher.allowed(logits.numel()).to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        if p.temperature != 0.0:
            logits = logits / p.temperature
        token = int(logits.argmax()) if p.temperature == 0.0 else self._sample(logits)
        if self.matcher is not None:
            self.matcher.accept(token)
        if not p.logprobs:
            return Draw(token)
        return Draw(token, position_logprobs(logits.log_softmax(-1)[None], [token], p.top_logprobs)[0])

    def random_state(self) -> torch.Tensor | None:
        """The random stream's state, once it was drawn from (None before: the seed says it all)."""
        return None if self.generator is None else self.generator.get_state()

    def replay(self, tokens: list[int], vocab_size: int, device: torch.device,
               random_state: torch.Tensor | None = None) -> None:
        """Advance as if `tokens` had been drawn here: the grammar accepts them, and the random
        stream is set to `random_state`, or else skips one draw per token (every draw takes one
        uniform number per vocabulary entry, whatever the probabilities), so the next draw is the
        one that would follow."""
        if self.matcher is not None:
            for token in tokens:
                self.matcher.accept(token)
        if random_state is not None:
            self._generator(device).set_state(random_state)
        elif self.params.temperature != 0.0 and tokens:
            generator = self._generator(device)
            for _ in tokens:
                torch.empty(vocab_size, device=device).uniform_(generator=generator)

    def _sample(self, logits: torch.Tensor) -> int:
        """A random draw from temperature-scaled `logits` after the top-k and top-p cuts."""
        p = self.params
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
        return draw_from(probs, self._generator(probs.device))


def draw_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from `probs` (`[vocab]`) by an exponential race: every token gets a number
    q = -log(u) of its own (u uniform, so q ~ Exp(1)), and the largest p / q wins, which is
    Categorical(p) exactly (torch.multinomial draws one sample the same way). Each token's chance
    rests on its own probability only, so the float noise by which two nodes' logits may differ
    (a context recomputed on another node) moves no other token's: a continued seeded stream
    draws what the first would have, where an inverse-CDF draw, which reads the running sum of
    every probability, flips on noise among tail tokens. The numbers come from uniform_ rather
    than exponential_, the same race at a fraction of the cost on a CPU (docs/bench/README.md,
    "Figures behind the code")."""
    q = torch.empty_like(probs).uniform_(generator=generator).log_().neg_()
    return int((probs / q).argmax())
