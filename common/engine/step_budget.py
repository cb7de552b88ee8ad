"""How many prompt tokens one engine step may prefill while requests are decoding, so that the
step, and with it every running stream's inter-token latency, stays within a latency target.

A step's cost is modelled as (the cost of its decode tokens alone) + (prompt tokens) x (cost per
prompt token), both measured from the steps the scheduler runs (exponential moving averages):
decode-only steps give the first term, mixed and prefill-only steps the second. With requests
decoding, a step gets the prompt tokens that fit in `max_step_ms` after the decode part; where
the decode part alone takes (nearly) that long (a slow or busy machine, a large batch), the
prompt part still gets as long as the decode part, and at least `MIN_CHUNK` tokens: prompts keep
progressing at a rate that scales with the machine, at most doubling the step. With none
decoding, nobody waits, and the step takes the whole token budget. Until a cost is measured the model assumes nothing and grants the full
budget, which measures it.
"""
from __future__ import annotations

MIN_CHUNK = 32  # prompt tokens a step carries at least, however slow the decode part is
SMOOTHING = 0.3  # weight of the newest measurement in the moving averages


class StepBudget:
    def __init__(self, max_step_ms: float | None) -> None:
        if max_step_ms is not None and max_step_ms <= 0:
            raise ValueError("--max-step-ms must be > 0")
        self.max_step_ms = max_step_ms
        self.decode_ms: float | None = None  # a decode-only step of the current batch
        self.prefill_token_ms: float | None = None  # one prompt token, on top of the decode part

    def prefill_tokens(self, decoding: int, budget: int) -> int:
        """Prompt tokens the next step may carry next to `decoding` one-token decodes, out of the
        `budget` left by them (the --max-batch-tokens budget)."""
        if self.max_step_ms is None or decoding == 0 or self.prefill_token_ms is None:
            return budget
        decode_ms = self.decode_ms or 0.0
        spare = max(self.max_step_ms - decode_ms, decode_ms)
        return min(budget, max(MIN_CHUNK, int(spare / self.prefill_token_ms)))

    def record(self, decoding: int, prefill: int, elapsed_ms: float) -> None:
        """Learn from a step that ran `decoding` one-token decodes and `prefill` prompt tokens."""
        if prefill == 0:
            self.decode_ms = _mix(self.decode_ms, elapsed_ms)
            return
        decode_part = (self.decode_ms or 0.0) if decoding else 0.0
        self.prefill_token_ms = _mix(self.prefill_token_ms, max(elapsed_ms - decode_part, 0.0) / prefill)


def _mix(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value
