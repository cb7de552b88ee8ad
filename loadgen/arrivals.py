"""When each request is sent: a gamma process (Poisson when the shape is 1)."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start of the run, the first at 0.

    Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``
    (scale ``1/(rate·burstiness)``), so their variance is ``1/(burstiness·rate²)``: burstiness 1 is
    a Poisson process, below 1 is burstier, above 1 is more regular. ``rate = inf`` sends
    everything at once.
    """
    if n < 1:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
