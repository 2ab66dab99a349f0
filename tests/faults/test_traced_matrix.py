"""Trace validation on the fault matrix (``kvproto chaos --trace``): a seeded
short run of a cell that kills the active master, every master and storage
node recording its steps, checked by TLC after the cell: each master's
publish and lease steps (the successor's from the directory it recovered),
each master merged with its nodes' steps under its term, the nodes' fence
and index steps across the takeover. A step changed by hand fails the cell,
in the first master's trace and in its successor's (an accepted put_end
or read grant recorded as refused, a step on a key the recovered directory
did not list); a file cut mid-line is checked up to its last whole line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvproto.checking.chaos import tracecheck
from kvproto.checking.chaos.matrix import run_traced
from kvproto.checking.chaos.verdict import Report
from kvproto.checking.tracerun import TraceError
from kvproto.checking.windows import longest_fit

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.faults, pytest.mark.runtime, pytest.mark.tlc]

SEED = 16
SECONDS = 1.5


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Report, Path]:
    workdir = tmp_path_factory.mktemp("traced")
    (report,) = run_traced(workdir, ["master-kill"], SECONDS, seed=SEED)
    return report, workdir / "run-0-master-kill" / "traces"


@needs_java
def test_a_traced_cell_with_a_takeover_passes_every_check(traced):
    report, folder = traced
    detail = f"{report.as_dict()}"
    assert report.faults > 0 and report.verified > 0, detail
    assert not report.failed and report.trace_failures == 0, detail
    assert report.trace_steps > 0, detail
    names = {line.split(":")[0] for line in report.traces if " pass" in line}
    # the killed master's publish and lease steps, its successor's publish
    # steps (from the directory it recovered) and lease table (opened with what
    # it inherited), each merged with its nodes' steps under its term, the
    # nodes across the takeover
    assert {"master-0 publish", "master-0 lease", "master-0 merged", "failover"} <= names, \
        report.traces
    successor = successor_of(folder).stem      # whichever standby won the election
    assert {f"{successor} publish", f"{successor} lease", f"{successor} merged"} <= names, \
        report.traces
    failover = next(l for l in report.traces if l.startswith("failover"))
    assert int(re.search(r"(\d+) term\(s\)", failover).group(1)) >= 2, failover
    assert sorted(p.name for p in folder.glob("storage-*.trace")) == \
        [f"storage-{i}.trace" for i in range(3)]


def successor_of(folder: Path) -> Path:
    """The master file whose publish run opened with a recovered directory."""
    for path in sorted(folder.glob("master-*.trace")):
        lines = path.read_text().splitlines()   # a standby that never opened wrote nothing
        if path.name != "master-0.trace" and lines and json.loads(lines[0])["opened"]["objects"]:
            return path
    raise AssertionError(f"no master in {folder} opened a recovered directory")


def _refused_by_hand(row: dict, kinds=("PutEnd",)) -> bool:
    """A step of one of ``kinds`` the master accepted, recorded as refused:
    the spec allowed it."""
    if row.get("event", {}).get("type") not in kinds or row["effects"][0]["type"] == "Refused":
        return False
    row["effects"] = [{"type": "Refused", "error": {"type": "StaleToken", "message": "changed"}}]
    return True


@needs_java
def test_a_step_changed_by_hand_fails_the_cell(traced, tmp_path):
    _, folder = traced
    master = folder / "master-0.trace"
    rows = [json.loads(line) for line in master.read_text().splitlines()]
    changed = next(r["n"] for r in rows if r.get("machine") == "publish" and _refused_by_hand(r))
    bad = tmp_path / "traces"          # the first master's file alone: its own checks
    bad.mkdir()
    (bad / master.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    checks = tracecheck.check_cell(bad, "master-kill")
    failed = [c for c in checks if c.failed]
    assert failed and failed[0].name == "master-0 publish", [c.line() for c in checks]
    assert failed[0].verdict.failed_step == changed
    report = Report("master-kill")
    tracecheck.judge(report, checks)
    assert report.failed and report.trace_failures >= 1
    assert any("FAIL" in e for e in report.examples), report.examples


def test_a_file_cut_mid_line_is_read_up_to_its_last_whole_line(tmp_path):
    path = tmp_path / "master-0.trace"
    path.write_bytes(b'{"machine":"publish"}\n{"machine":"pub')
    whole = tracecheck.whole_lines(path)
    assert whole != path and whole.read_bytes() == b'{"machine":"publish"}\n'
    path.write_bytes(b'{"machine":"publish"}\n')
    assert tracecheck.whole_lines(path) == path


def test_the_longest_prefix_that_fits():
    def fits(k):
        if k > 37:
            raise TraceError(f"{k} is too many")
    assert longest_fit(100, fits) == (37, "38 is too many")
    assert longest_fit(30, fits) == (30, "")


def _forget_a_recovered_key(rows: list[dict]) -> int:
    """The successor's opened line without the first recovered key a later
    step names (a get, a remove, ...): the ``n`` of that step."""
    header = rows[0]["opened"]
    step = next(r for r in rows if r.get("machine") == "publish" and "n" in r
                and set(r["after"]["objects"]) & set(header["directory"]))
    key = next(k for k in step["after"]["objects"] if k in header["directory"])
    del header["directory"][key]
    header["objects"] -= 1
    return step["n"]


def _refuse_a_grant(rows: list[dict]) -> int:
    """The successor's first accepted put_end or read grant recorded as
    refused (a short cell's successor may have served reads only)."""
    return next(r["n"] for r in rows if r.get("machine") == "publish"
                and _refused_by_hand(r, ("PutEnd", "ReadBegin")))


@needs_java
@pytest.mark.parametrize("change", [_refuse_a_grant, _forget_a_recovered_key])
def test_a_successor_step_changed_by_hand_fails_the_cell(traced, tmp_path, change):
    _, folder = traced
    successor = successor_of(folder)
    rows = [json.loads(line) for line in successor.read_text().splitlines()]
    changed = change(rows)
    bad = tmp_path / "traces"          # the successor's file alone: its own checks
    bad.mkdir()
    (bad / successor.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    checks = tracecheck.check_cell(bad, "master-kill")
    assert [c.name for c in checks if c.failed] == [f"{successor.stem} publish"], \
        [c.line() for c in checks]
    assert checks[0].verdict.failed_step == changed, checks[0].line()


def _put_end(key: str, token: int, replicas: list, ok: bool = True) -> tuple[int, dict]:
    effects = [{"type": "Published", "key": key, "token": token}] if ok else \
        [{"type": "Refused", "error": {"type": "StaleToken", "message": "x"}}]
    return 0, {"machine": "publish", "event": {"type": "PutEnd", "key": key, "token": token},
               "effects": effects,
               "after": {"objects": {key: {"replicas": [{"segment": s, "offset": o}
                                                        for s, o in replicas]}}}}


def _write(segment: str, offset: int, token: int) -> tuple[int, dict]:
    return 0, {"event": {"type": "WriteReplica", "segment": segment, "offset": offset,
                         "token": token}, "effects": [{"type": "Accepted"}]}


def test_only_trailing_put_ends_whose_replicas_no_node_recorded_are_left_unchecked():
    """A master killed between a put_end and its publish marks: a direct
    writer's replica is recorded written only when the mark reaches its node,
    so the run's last put_end may name a replica no node recorded. Only such
    trailing put_ends are left out; one in the middle, or a written one, is
    checked (and fails there if its bytes were never written)."""
    start = (0, {"machine": "publish", "event": {"type": "PutStart"}, "effects": []})
    written = _put_end("a", 1, [("s1", 0), ("s2", 0)])
    unheard = _put_end("b", 2, [("s1", 4096), ("s2", 4096)])
    nodes = [[_write("s1", 0, 1), _write("s1", 4096, 2)], [_write("s2", 0, 1)]]
    assert tracecheck.unheard_tail([start, written, unheard], nodes) == 2
    assert tracecheck.unheard_tail([start, unheard, written], nodes) == 3
    assert tracecheck.unheard_tail([start, written], nodes) == 2
    refused = _put_end("b", 2, [("s1", 4096), ("s2", 4096)], ok=False)
    assert tracecheck.unheard_tail([start, refused], nodes) == 2
    nodes[1].append(_write("s2", 4096, 2))
    assert tracecheck.unheard_tail([start, written, unheard], nodes) == 3
