"""loadgen/percentiles.py: numpy's default percentiles (linear between the nearest ranks)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from loadgen.percentiles import percentile, percentiles


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1001])
def test_percentiles_are_numpys(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    qs = [0, 10, 50, 90, 99, 100]
    assert percentiles(values, qs) == pytest.approx(np.percentile(values, qs), rel=0, abs=1e-12)
    assert percentile(values, 50) == pytest.approx(float(np.median(values)), rel=0, abs=1e-12)


def test_no_values_or_a_percentile_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentiles([], [50])
    with pytest.raises(ValueError):
        percentile([1.0], 101)
