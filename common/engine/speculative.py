"""Speculative decoding on the decode node: prompt-lookup drafts verified by the target model.

A decoding sequence with a draft of `k` tokens computes `1 + k` positions in the step's one
batched forward (its pending token and the draft), with logits at each. Verification walks
those rows in order, drawing the target's token at each exactly as a plain decode step would
(same sampler, same grammar matcher, same random stream), and goes on while the drawn token
equals the draft's: the accepted draft tokens plus the first token that differs (or the one
after the whole draft) are emitted. Because the draft is deterministic this is exact: greedy
output is token-identical, and a seeded sample draws the same numbers in the same order as
without speculation, so it yields the same tokens too (up to the float differences of
computing a position in a chunk rather than alone). The rejected positions' K/V are dropped
by rolling `num_computed` back and giving back the pages past it (`Engine.truncate`).

A sequence whose draft was wholly rejected skips drafting for a while (1, 2, 4, ... up to
`MAX_BACKOFF` steps, reset by the next accepted token): on text that quotes nothing, n-gram
matches are mostly chance, and each rejected draft costs its positions' compute and moves the
sequence off the batched single-token attention path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.engine.core import Sequence
from common.engine.ngram_proposer import propose_ngram
from common.engine.sampling import Draw, Sampler, SamplingParams

METHODS = ("ngram",)
MAX_BACKOFF = 16  # steps without drafts after repeated wholly rejected drafts


@dataclass(frozen=True)
class SpeculativeConfig:
    """The node's speculation settings (`--speculative`, `--num-speculative-tokens`,
    `--ngram-min`, `--ngram-max`); `method` None = off."""

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"--speculative must be one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("--num-speculative-tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("--ngram-min and --ngram-max must satisfy 1 <= min <= max")

    @property
    def max_draft(self) -> int:
        """The most draft tokens a request may ask for here (0: speculation is off)."""
        return 0 if self.method is None else self.num_speculative_tokens

    def check(self, params: SamplingParams) -> None:
        """Refuse (ValueError) a per-request draft length above this node's maximum."""
        asked = params.num_speculative_tokens
        if asked is not None and asked > self.max_draft:
            raise ValueError(f"num_speculative_tokens {asked} is above this node's maximum of {self.max_draft} "
                             "(--speculative ngram --num-speculative-tokens)")


@dataclass
class DraftState:
    """One sequence's speculation: this step's draft and its back-off after rejections."""

    tokens: list[int] = field(default_factory=list)  # this step's draft, appended to the sequence
    backoff: int = 0  # steps to skip after the next wholly rejected draft (doubled each time)
    skip: int = 0  # steps left without drafting

    def record(self, accepted: int) -> None:
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff or 1)
            self.skip = self.backoff


# (draft tokens, accepted tokens) of one verified step.
SpeculationObserver = Callable[[int, int], None]


class Speculator:
    """Proposes drafts and verifies them; tells `observers` (metrics) what each verified draft
    held and how much of it was accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.observers: list[SpeculationObserver] = []

    def propose(self, tokens: list[int], params: SamplingParams, limit: int, state: DraftState) -> list[int]:
        """A draft of at most `limit` tokens (the caller's bound: tokens left before max_tokens
        and the context end, step budget) continuing `tokens`."""
        asked = params.num_speculative_tokens
        k = min(limit, self.config.max_draft if asked is None else asked)
        if k < 1:
            return []
        if state.skip:
            state.skip -= 1
            return []
        return propose_ngram(tokens, k, self.config.ngram_min, self.config.ngram_max)

    def verify(self, seq: Sequence, sampler: Sampler, rows: torch.Tensor, state: DraftState,
               emit: Callable[[Draw], bool]) -> int:
        """After a forward computed `seq`'s pending token and its draft `state.tokens` (`rows`:
        their `1 + k` logits): draw and `emit` the target's tokens in order while they agree with the draft;
        `emit` returns False once the sequence finished (stop, length, EOS). Leaves `seq` with
        only the accepted positions computed; returns how many draft tokens were accepted."""
        draft, state.tokens = state.tokens, []
        del seq.token_ids[len(seq.token_ids) - len(draft):]
        seq.num_computed = len(seq.token_ids)
        accepted = 0
        for j, row in enumerate(rows):
            if j:  # draft[j - 1] was drawn and emitted: its K/V, computed this step, is valid
                seq.num_computed += 1
            draw = sampler.draw(row)
            agreed = j < len(draft) and draw.token == draft[j]
            accepted += agreed  # counted even when this token ends the request
            if not emit(draw) or not agreed:
                break
        state.record(accepted)
        for observe in self.observers:
            observe(len(draft), accepted)
        return accepted
