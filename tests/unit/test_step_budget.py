"""The per-step prompt budget next to running decodes (common/engine/step_budget.py), and the
scheduler keeping to it."""
from __future__ import annotations

import pytest

from common.engine.step_budget import MIN_CHUNK, StepBudget, attended_positions


def test_without_a_target_or_decodes_the_whole_budget_goes() -> None:
    unbounded = StepBudget(None)
    unbounded.record(decoding=4, prefill=100, elapsed_ms=500.0)
    assert unbounded.prefill_tokens(decoding=4, budget=508) == 508
    bounded = StepBudget(100.0)
    bounded.record(decoding=0, prefill=100, elapsed_ms=500.0)
    assert bounded.prefill_tokens(decoding=0, budget=512) == 512


def test_unmeasured_cost_grants_the_budget_to_measure_it() -> None:
    assert StepBudget(100.0).prefill_tokens(decoding=3, budget=509) == 509


def test_budget_follows_measured_costs() -> None:
    b = StepBudget(100.0)
    b.record(decoding=4, prefill=0, elapsed_ms=40.0)  # a decode step: 40 ms
    b.record(decoding=4, prefill=200, elapsed_ms=140.0)  # + 200 tokens: 0.5 ms each
    assert b.prefill_tokens(decoding=4, budget=508) == 120  # (100 - 40) / 0.5
    assert b.prefill_tokens(decoding=4, budget=50) == 50
    b.record(decoding=4, prefill=0, elapsed_ms=200.0)  # decodes got slow: the prompt part gets as long
    assert b.prefill_tokens(decoding=4, budget=508) == int(b.decode_ms / 0.5)
    b.record(decoding=4, prefill=10, elapsed_ms=b.decode_ms + 100.0)  # prompt tokens got slow too
    assert b.prefill_tokens(decoding=4, budget=508) == MIN_CHUNK


def test_late_chunks_of_a_prompt_get_fewer_tokens() -> None:
    """Chunks whose cost grows with the positions they attend, as attention's does: the fitted
    model recovers both costs, and the next chunk, costed at its own position, keeps the step
    within the target both early and late in a long prompt (a per-token average fitted to the
    same steps would overrun it late)."""
    token_ms, context_ms = 0.2, 0.0006

    def cost(start: int, n: int) -> float:
        return n * token_ms + attended_positions(start, n) * context_ms

    b = StepBudget(100.0)
    b.record(decoding=4, prefill=0, elapsed_ms=30.0)
    start = 0
    for n in (256, 128, 96, 64, 160, 200):
        b.record(decoding=4, prefill=n, elapsed_ms=30.0 + cost(start, n), attended=attended_positions(start, n))
        start += n
    assert b.prompt.token_ms == pytest.approx(token_ms, rel=1e-6)
    assert b.prompt.context_ms == pytest.approx(context_ms, rel=1e-6)
    early, late = b.prefill_tokens(4, 512, start=0), b.prefill_tokens(4, 512, start=1000)
    assert late < early
    for start, n in ((0, early), (1000, late)):
        assert cost(start, n) <= 70.0 < cost(start, n + 1)


def test_chunks_at_one_position_fall_back_to_a_cost_per_token() -> None:
    b = StepBudget(100.0)
    b.record(decoding=2, prefill=0, elapsed_ms=20.0)
    for _ in range(3):
        b.record(decoding=2, prefill=100, elapsed_ms=70.0, attended=attended_positions(0, 100))
    assert b.prompt.context_ms == 0.0 and b.prompt.token_ms == pytest.approx(0.5)
    assert b.prefill_tokens(decoding=2, budget=512, start=800) == 160  # (100 - 20) / 0.5


def test_costs_are_smoothed() -> None:
    b = StepBudget(100.0)
    b.record(decoding=1, prefill=0, elapsed_ms=20.0)
    b.record(decoding=1, prefill=0, elapsed_ms=40.0)
    assert 20.0 < b.decode_ms < 40.0


def test_rejects_a_non_positive_target() -> None:
    with pytest.raises(ValueError):
        StepBudget(0.0)


def test_scheduler_chunks_prompts_next_to_decodes(model, tokenizer) -> None:
    """With a target no step can meet, a prompt arriving while another request decodes is
    prefilled in chunks that take about as long as the decode part (the step's costs are
    measured: the recording below replays them), and both requests still get the tokens of
    running alone."""
    import random

    from common.engine.core import Engine
    from common.engine.sampling import SamplingParams
    from common.engine.scheduler import Scheduler
    from harness.reference import engine_greedy
    from harness.engine_checks import collect

    engine = Engine(model, num_pages=64, page_size=16)
    steps: list[list[int]] = []
    forward = engine.forward

    def recording(work, *args, **kwargs):
        steps.append([n for _, n in work])
        return forward(work, *args, **kwargs)

    engine.forward = recording
    s = Scheduler(engine, tokenizer, max_batch_tokens=512, max_step_ms=0.001)
    s.start()
    try:
        rng = random.Random(0)
        short, long = rng.choices(range(100, 40000), k=8), rng.choices(range(100, 40000), k=400)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        first = s.submit("short", engine.new_sequence("short", short), params)
        assert first.next_chunk(timeout=120) is not None  # decoding now
        second = s.submit("long", engine.new_sequence("long", long), params)
        got_first, got_second = collect(first)[0], collect(second)[0]
    finally:
        s.stop()
    mixed = [n for step in steps if 1 in step for n in step if n > 1]
    # Unbounded, the 400 prompt tokens would go in one step (max_batch_tokens 512).
    assert len(mixed) >= 2 and max(mixed) < 400, steps
    assert got_first == engine_greedy(model, short, 12)[1:]
    assert got_second == engine_greedy(model, long, 12)
