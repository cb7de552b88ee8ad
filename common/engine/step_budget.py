"""How many prompt tokens one engine step may prefill while requests are decoding, so that the
step, and with it every running stream's inter-token latency, stays within a latency target.

A step's cost is modelled as (the cost of its decode tokens alone) + (the cost of its prompt
tokens), both learned from the steps the scheduler runs (exponential moving averages):
decode-only steps give the first term, mixed and prefill-only steps the second. A prompt token costs
`token_ms` (its share of the linear layers) plus `context_ms` per position it attends, so a chunk
of `n` tokens starting at position `p` costs `n * token_ms + (n*p + n*(n+1)/2) * context_ms`:
the last chunk of a 1000-token prompt costs 2.2x its first in bf16 on AMX (attention is most
of a late chunk), and a per-token average, which lags behind the growing cost,
let those chunks overrun the target. The two costs are a linear fit over the recent steps;
where their chunks' positions are too alike to tell the costs apart, the model falls back to
the average cost per token.

With requests decoding, a step gets the prompt tokens that fit in `max_step_ms` after the decode
part, costed at the first prefilling request's position; where the decode part alone takes
(nearly) that long (a slow or busy machine, a large batch), the prompt part still gets as long
as the decode part, and at least `MIN_CHUNK` tokens: prompts keep progressing at a rate that
scales with the machine, at most doubling the step. With none decoding, nobody waits, and the
step takes the whole token budget. Until a cost is measured the model assumes nothing and grants
the full budget, which measures it.
"""
from __future__ import annotations

import math

MIN_CHUNK = 32  # prompt tokens a step carries at least, however slow the decode part is
SMOOTHING = 0.3  # weight of the newest measurement in the moving averages


def attended_positions(start: int, tokens: int) -> int:
    """Context positions the prompt tokens [start, start + tokens) attend, summed."""
    return tokens * start + tokens * (tokens + 1) // 2


class PromptCost:
    """A prompt token's cost, `token_ms + context_ms * x` for a token attending x positions: a
    linear regression of each step's cost per prompt token on its tokens' mean attended
    positions, over moments that are exponential moving averages (every step weighs alike)."""

    def __init__(self) -> None:
        self._moments: tuple[float, float, float, float] | None = None  # means of x, x^2, y, x*y
        self.token_ms: float | None = None
        self.context_ms = 0.0

    def record(self, tokens: int, attended: int, ms: float) -> None:
        x, y = attended / tokens, ms / tokens
        new = (x, x * x, y, x * y)
        self._moments = new if self._moments is None else tuple(_mix(m, v) for m, v in zip(self._moments, new))
        mx, mxx, my, mxy = self._moments
        var = mxx - mx * mx
        slope = (mxy - mx * my) / var if var > 1e-6 * mxx else 0.0
        intercept = my - slope * mx
        if slope <= 0.0 or intercept < 0.0:  # positions too alike to tell the costs apart, or noise
            slope, intercept = 0.0, my
        self.token_ms, self.context_ms = intercept, slope

    def tokens_within(self, ms: float, start: int) -> int:
        """The most prompt tokens from position `start` that cost at most `ms` (the model known):
        the positive root of `context_ms/2 * n^2 + (token_ms + context_ms*(start + 1/2)) * n = ms`."""
        assert self.token_ms is not None
        linear = self.token_ms + self.context_ms * (start + 0.5)
        if self.context_ms == 0.0:
            return int(ms / linear) if linear > 0 else 1 << 30
        half = self.context_ms / 2
        return int((-linear + math.sqrt(linear * linear + 4 * half * ms)) / (2 * half))


class StepBudget:
    def __init__(self, max_step_ms: float | None) -> None:
        if max_step_ms is not None and max_step_ms <= 0:
            raise ValueError("--max-step-ms must be > 0")
        self.max_step_ms = max_step_ms
        self.decode_ms: float | None = None  # a decode-only step of the current batch
        self.prompt = PromptCost()

    def prefill_tokens(self, decoding: int, budget: int, start: int = 0) -> int:
        """Prompt tokens the next step may carry next to `decoding` one-token decodes, out of the
        `budget` left by them (the --max-batch-tokens budget), the first of them at context
        position `start`."""
        if self.max_step_ms is None or decoding == 0 or self.prompt.token_ms is None:
            return budget
        decode_ms = self.decode_ms or 0.0
        spare = max(self.max_step_ms - decode_ms, decode_ms)
        return min(budget, max(MIN_CHUNK, self.prompt.tokens_within(spare, start)))

    def record(self, decoding: int, prefill: int, elapsed_ms: float, attended: int = 0) -> None:
        """Learn from a step that ran `decoding` one-token decodes and `prefill` prompt tokens
        attending `attended` context positions in all (`attended_positions` of each chunk)."""
        if prefill == 0:
            self.decode_ms = _mix(self.decode_ms, elapsed_ms)
            return
        decode_part = (self.decode_ms or 0.0) if decoding else 0.0
        self.prompt.record(prefill, attended, max(elapsed_ms - decode_part, 0.0))


def _mix(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value
