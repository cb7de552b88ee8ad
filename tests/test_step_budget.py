"""The per-step prompt budget next to running decodes (common/step_budget.py), and the
scheduler keeping to it."""
from __future__ import annotations

import pytest

from common.step_budget import MIN_CHUNK, StepBudget


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
    b.record(decoding=4, prefill=0, elapsed_ms=200.0)  # decodes got slow: no room left
    assert b.prefill_tokens(decoding=4, budget=508) == MIN_CHUNK


def test_costs_are_smoothed() -> None:
    b = StepBudget(100.0)
    b.record(decoding=1, prefill=0, elapsed_ms=20.0)
    b.record(decoding=1, prefill=0, elapsed_ms=40.0)
    assert 20.0 < b.decode_ms < 40.0


def test_rejects_a_non_positive_target() -> None:
    with pytest.raises(ValueError):
        StepBudget(0.0)
