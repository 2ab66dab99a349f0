"""Hypothesis profiles.

* ``ci`` (the default): 500 examples per stateful test, up to 100 steps each.
* ``soak``: 5,000 examples of up to 400 steps, for long local runs:
  ``HYPOTHESIS_PROFILE=soak python -m pytest tests/stateful``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=500, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile(
    "soak", max_examples=5000, stateful_step_count=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
