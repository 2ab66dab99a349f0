"""Hypothesis profiles and the ``--soak`` option.

* ``ci`` (the default): 150 examples per Hypothesis test without settings of
  its own; a stateful test's examples take up to 100 steps each.
* ``soak``: 5,000 examples of up to 400 steps, for long local runs.
* ``mutate``: 500 examples of up to 100 steps, and a failure is reported as
  found, not shrunk (``kvproto mutate`` only needs to know that a mutant was
  caught).

``pytest --soak`` selects the ``soak`` profile (unless ``HYPOTHESIS_PROFILE``
names another) and also runs the tests marked ``soak``: the conformance
comparison of the main models, whose graphs take minutes to compare. Without
it those tests are skipped, with that reason.
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci", max_examples=150, stateful_step_count=100, deadline=None,
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
    _slow_first(config, items)
    if config.getoption("soak"):
        return
    skip = pytest.mark.skip(reason="soak: long, runs with --soak")
    for item in items:
        if item.get_closest_marker("soak"):
            item.add_marker(skip)


#: the tests that take ten seconds or more, with their share of a run
#: (seconds on a 2-core machine at load 4 to 8, pytest's ``--durations``;
#: only their ratios matter). A name ending in ``.py`` is a module whose
#: module-scoped fixture serves all its tests (one TLC graph per model, one
#: cluster for every fault cell, one recorded run): its tests run together,
#: on one worker.
SLOW = {
    "tests/test_conformance.py": 790,
    "tests/test_trace_windows.py": 165,
    "tests/faults/test_traced_matrix.py": 150,
    "tests/faults/test_matrix.py": 60,
    "tests/runtime/test_repair_runtime.py": 45,
    "tests/cores/test_differential.py": 40,
    "tests/runtime/test_failover_trace.py": 40,
    "tests/runtime/test_merged_windows.py": 30,
    "tests/runtime/test_takeover_trace.py": 25,
    "tests/runtime/test_timeline.py": 12,
    "tests/test_models.py::test_model_gives_expected_verdict[Publish]": 160,
    "tests/test_models.py::test_model_gives_expected_verdict[Timeout_Liveness]": 37,
    "tests/test_models.py::test_model_gives_expected_verdict[Tenancy]": 33,
    "tests/test_models.py::test_model_gives_expected_verdict[Lease]": 32,
    "tests/test_models.py::test_model_gives_expected_verdict[Failover_ThreeTerms]": 19,
    "tests/stateful/test_publish.py::TestPublishSystem": 76,
    "tests/cores/test_pool.py::TestPool": 38,
    "tests/runtime/test_failover_cores.py::TestFailoverCores": 37,
    "tests/stateful/test_tenancy.py::TestTenancySystem": 36,
    "tests/cores/test_tenancy_core.py::TestTenancy": 36,
    "tests/stateful/test_lease.py::TestLeaseSystem": 30,
    "tests/stateful/test_failover.py::test_python_machine_whose_repair_stamps_its_own_term_breaks_an_invariant": 30,
    "tests/stateful/test_repair.py::TestRepairSystem": 27,
    "tests/stateful/test_timeout.py::TestTimeoutSystem": 25,
    "tests/runtime/test_usability.py::test_kvproto_bench_runs_its_rebuild_sections": 22,
    "tests/runtime/test_usability.py::test_kvproto_bench_runs_its_payload_and_metadata_sections": 22,
    "tests/test_runtime_mutants.py::test_quick_mutants_are_killed": 22,
    "tests/stateful/test_failover.py::TestFailoverSystem": 21,
    "tests/stateful/test_directwrite.py::TestDirectWriteSystem": 15,
    "tests/faults/test_found.py::test_a_node_fenced_out_of_recovery_does_not_rejoin_with_its_old_objects": 13,
    "tests/runtime/test_merged_trace.py::test_a_run_of_separate_processes_with_a_node_killed_is_a_behaviour_of_the_spec": 13,
}


def _slow_name(nodeid: str):
    """The entry of SLOW that ``nodeid`` belongs to, if any."""
    for name in SLOW:
        if nodeid == name or nodeid.startswith(name + "::"):
            return name
    return None


def _shares(count: int, workers: int) -> list[int]:
    """How many tests pytest-xdist's ``worksteal`` hands each worker at the
    start: contiguous shares of the collection, in order."""
    out = []
    for i in range(workers):
        out.append(count // (workers - i))
        count -= out[-1]
    return out


def _slow_first(config, items):
    """Reorder ``items`` so that each worker's share starts with slow tests,
    the slow ones spread so the shares are about even (largest first, each to
    the lightest share). Worksteal steals from the ends of shares, so the slow
    tests stay where they are put and none is left running alone at the end;
    the rest keep their order."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    groups: dict[str, list] = {}
    rest = []
    for item in items:
        name = _slow_name(item.nodeid)
        (groups.setdefault(name, []) if name else rest).append(item)
    shares = _shares(len(items), workers)
    heads: list[list] = [[] for _ in shares]
    load = [0] * len(shares)
    for name in sorted(groups, key=lambda n: -SLOW[n]):
        i = min(range(len(shares)), key=lambda j: (load[j], len(heads[j])))
        heads[i] += groups[name]
        load[i] += SLOW[name]
    if any(len(h) > s for h, s in zip(heads, shares)):
        heads, shares = [sum(heads, [])], [len(items)]
    ordered, start = [], 0
    for head, share in zip(heads, shares):
        ordered += head + rest[start:start + share - len(head)]
        start += share - len(head)
    items[:] = ordered + rest[start:]
