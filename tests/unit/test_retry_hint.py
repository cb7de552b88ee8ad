"""The retry hint of a refused request (common/serving/retry_hint.py): Little's law over the
stays of the requests that left lately, in whole seconds, bounded."""
from __future__ import annotations

from common.serving.retry_hint import MAX_RETRY_SECONDS, MIN_RETRY_SECONDS, RetryHint


def test_with_nothing_to_go_by_the_hint_is_the_least() -> None:
    hint = RetryHint()
    assert hint.seconds(ahead=50, running=10) == MIN_RETRY_SECONDS
    hint.record(10.0)
    assert hint.seconds(ahead=50, running=0) == MIN_RETRY_SECONDS


def test_ahead_requests_leave_at_running_over_the_mean_stay() -> None:
    hint = RetryHint()
    for stay in (8.0, 12.0):  # mean 10 s
        hint.record(stay)
    assert hint.seconds(ahead=44, running=256) == 2  # 44 * 10 / 256 = 1.7 -> 2
    assert hint.seconds(ahead=3, running=1) == 30
    assert hint.seconds(ahead=1, running=256) == MIN_RETRY_SECONDS
    assert hint.seconds(ahead=1000, running=1) == MAX_RETRY_SECONDS
