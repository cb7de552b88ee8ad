"""Percentiles as every report of this project states them: linear interpolation between the two
nearest ranks, numpy's default and what `vllm bench serve` prints, so that a p99 means one thing
in loadgen's tables and in the scripts' (which import it from here)."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """The `qs`-th percentiles (each in [0, 100]) of `values`, which must not be empty."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentiles of no values")
    out = []
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} is not in [0, 100]")
        rank = (len(ordered) - 1) * q / 100
        below, above = ordered[math.floor(rank)], ordered[math.ceil(rank)]
        out.append(below + (above - below) * (rank - math.floor(rank)))
    return out


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile (in [0, 100]) of `values`, which must not be empty."""
    return percentiles(values, [q])[0]
