"""The runtime mutants (``kvproto mutate``, :mod:`kvproto.checking.mutants`):
every mutant still applies to the current source, the command's mistakes are
one line and status 2, a few mutants are killed here and all of them with
``--soak``, and a harmless edit is reported as a survivor (the run can fail).

A failure of :func:`test_every_mutant_applies_to_the_current_source` after a
refactor means a mutant's snippet no longer matches: re-anchor it in
``kvproto/checking/mutants.py`` on the code that now does the same thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvproto
from kvproto.checking import mutants

ROOT = Path(kvproto.__file__).resolve().parent.parent

#: killed in every CI run (fast; one on the same-host path, one in the master)
QUICK = ("same-host-read-no-recheck", "put-end-record-token")


def kvproto_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvproto", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_every_mutant_applies_to_the_current_source():
    assert mutants.source_root() == ROOT
    assert mutants.problems(ROOT) == []


def test_mutants_are_named_once_and_change_something():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
    for m in mutants.MUTANTS:
        assert m.edits and m.tests and m.what, m.name
        assert all(e.original != e.replacement for e in m.edits), m.name
        assert not m.twin or (ROOT / "spec" / f"{m.twin}.cfg").is_file(), m.name


def test_a_snippet_that_moved_is_named():
    moved = mutants.Mutant("moved", "x", (mutants.Edit(mutants.SHM, "no such line\n", "x\n"),),
                           ("tests/runtime/test_same_host_reads.py::no_such_test",))
    found = mutants.problems(ROOT, (moved,))
    assert len(found) == 2
    assert "has 0 copies of 'no such line'" in found[0] and "no_such_test" in found[1]


@pytest.mark.parametrize("args, says", [
    (["mutate", "--only", "no-such-mutant"], "no mutant named 'no-such-mutant'"),
    (["mutate", "--timeout", "0"], "--timeout"),
])
def test_a_mistake_is_one_line_and_status_2(args, says):
    done = kvproto_cli(*args)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_list_names_every_mutant_and_its_tests():
    done = kvproto_cli("mutate", "--list")
    assert done.returncode == 0, done.stderr
    for m in mutants.MUTANTS:
        assert f"{m.name}: " in done.stdout
        assert all(f"killed by {t}" in done.stdout for t in m.tests)


def test_quick_mutants_are_killed():
    args = [a for name in QUICK for a in ("--only", name)]
    done = kvproto_cli("mutate", *args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "baseline: " in done.stdout and " passed in " in done.stdout
    for name in QUICK:
        assert any(line.startswith("killed") and f" {name} " in line
                   for line in done.stdout.splitlines()), done.stdout
    assert f"score: {len(QUICK)}/{len(QUICK)} mutants killed (100%)" in done.stdout


def test_a_harmless_edit_survives_and_the_run_says_so():
    same = mutants.Mutant(
        "same-behaviour", "the generation word computed another way",
        (mutants.Edit(mutants.SHM, "    return (token << 1) | int(done)\n",
                      "    return (token << 1) | (1 if done else 0)\n"),),
        ("tests/runtime/test_same_host_reads.py::test_a_descriptor_of_a_segment_that_started_over_is_not_read",))
    lines: list[str] = []
    (result,) = mutants.run((same,), ROOT, timeout=120, baseline=False, report=lines.append)
    assert result.status == "survived" and not result.killed and result.by == []
    assert lines[0].startswith("survived same-behaviour")
    assert mutants.score([result]) == "score: 0/1 mutants killed (0%)"


@pytest.mark.soak
def test_every_mutant_is_killed():
    done = kvproto_cli("mutate", timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    n = len(mutants.MUTANTS)
    assert f"score: {n}/{n} mutants killed (100%)" in done.stdout
