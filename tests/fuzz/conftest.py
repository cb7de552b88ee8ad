"""Hypothesis budgets: `make test` runs the default profile (a smoke); `make fuzz` passes
`--hypothesis-profile fuzz` (DUET_FUZZ_EXAMPLES examples per test, default 200000)."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=int(os.environ.get("DUET_FUZZ_EXAMPLES", "200000")), deadline=None,
                          suppress_health_check=list(HealthCheck))
