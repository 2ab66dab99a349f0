"""Hypothesis profiles and the ``--soak`` option.

* ``ci`` (the default): 500 examples per stateful test, up to 100 steps each.
* ``soak``: 5,000 examples of up to 400 steps, for long local runs.
* ``mutate``: as ``ci``, but a failure is reported as found, not shrunk
  (``kvproto mutate`` only needs to know that a mutant was caught).

``pytest --soak`` selects the ``soak`` profile (unless ``HYPOTHESIS_PROFILE``
names another) and also runs the tests marked ``soak``: the conformance
comparison of the main models, whose graphs take minutes to compare. Without
it those tests are skipped, with that reason.
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci", max_examples=500, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile(
    "mutate", max_examples=500, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate))
settings.register_profile(
    "soak", max_examples=5000, stateful_step_count=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true",
                     help="long runs too: the main models' conformance and Hypothesis's soak profile")


def pytest_configure(config):
    soak = config.getoption("soak")
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("soak" if soak else "ci"))


def pytest_collection_modifyitems(config, items):
    if config.getoption("soak"):
        return
    skip = pytest.mark.skip(reason="soak: long, runs with --soak")
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(skip)
