"""The retry hint of a request refused for want of room: when to come back.

By Little's law, `running` admitted requests that each stay `D` seconds leave at `running / D`
a second, so the `ahead` requests that must leave before a refused one would be let in have
left after `ahead * D / running` seconds. `D` is the mean stay of the requests that left lately.
A decode node's request table keeps one (its refusals' hint travels as gRPC trailing metadata,
common/serving/grpc_status.py, and becomes the HTTP front's `Retry-After`); an API server keeps
one of its own for the refusals it makes itself.
"""
from __future__ import annotations

import math
from collections import deque

MIN_RETRY_SECONDS = 1
MAX_RETRY_SECONDS = 60
RECENT = 256  # stays averaged


class RetryHint:
    """The stays of the requests that left lately (not thread-safe: the decode node records and
    reads under the engine lock, an API server on its event loop)."""

    def __init__(self) -> None:
        self._stays: deque[float] = deque(maxlen=RECENT)

    def record(self, stay_seconds: float) -> None:
        """An admitted request left after `stay_seconds` (finished, failed, moved elsewhere)."""
        self._stays.append(stay_seconds)

    def seconds(self, ahead: int, running: int) -> int:
        """Whole seconds until `ahead` of `running` admitted requests will have left, from
        MIN_RETRY_SECONDS (also when none left yet: nothing to go by) to MAX_RETRY_SECONDS."""
        if not self._stays or running < 1:
            return MIN_RETRY_SECONDS
        stay = sum(self._stays) / len(self._stays)
        return min(MAX_RETRY_SECONDS, max(MIN_RETRY_SECONDS, math.ceil(max(1, ahead) * stay / running)))
