"""Hypothesis profiles: `ci` (the default; few, reproducible examples, so the suite stays fast) and
`thorough` (many; run locally with HYPOTHESIS_PROFILE=thorough, e.g. before a release)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# No example database: nothing is written into the checkout; a failure prints its reproducing example.
settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
