"""Trace validation of one matrix cell run (``kvproto chaos --trace``).

With tracing on, every master and storage node of a cell's cluster records its
steps to its own file (:mod:`kvproto.runtime.tracing`): ``master-N.trace``,
``storage-N.trace`` in the run's ``traces/`` folder. A traced cell runs on a
cluster of its own, so each master's file holds one run from an empty
directory (or, a standby's, from the takeover it made), as the checkers need.
After the cell quiesced and its cluster stopped, :func:`check_cell` runs the
checkers that apply:

* **publish** and **lease**, each master's file alone (``kvproto trace
  check``: ``spec/Publish.tla``, ``spec/Lease.tla``), each run in it apart
  (a master paused past its term steps down, and may take over again later,
  opening a second run in its file). Every master's runs are checked: one
  that took over starts from the directory it recovered (its ``opened``
  line lists it: the publish checker's initial state) and from the lease
  table it inherited, so its puts, gets, removes, evictions and repairs
  under the later term are checked as the first master's are.
* **merged**: each master's run merged with its nodes' region steps under
  its term (``kvproto trace merge``, one check per run: ``master-N
  merged``): each node's steps from its fence of that term to its first
  fence of a later one, from the region table it held at that fence
  (replayed from its steps before), so a successor's commands, its nodes'
  purge and the writes and reads under its tokens are checked as the first
  master's are. A run's trailing put_ends whose replicas no node recorded
  written (a master killed before its publish marks went out: a direct
  writer's bytes are recorded at the mark) are left out, and the line says
  so (:func:`unheard_tail`). Only in cells whose faults keep the master's commands to its
  nodes in order on their connection; not where the proxy drops, delays,
  reorders or partitions frames (``net-drop``, ``net-delay``,
  ``net-reorder``, ``net-partition``): a command dropped or overtaken there
  is not a step of the spec's queue of commands in flight, so the merge
  would fail on what the proxy did, not on what the runtime did.
* **failover**: every node's fence, index and purge steps with what each
  master says it recovered (``kvproto trace failover``), in every cell (with
  one master it checks the term fence and the object index of that term).

A killed process leaves its file cut at its last line: the recorded prefix
is checked (a partial last line is left out). The checkers map a run onto a
bounded model (their ``LIMITS``: steps, keys, tokens, slots). The publish
and lease checks walk the whole run, in windows of at most ``max_steps``
steps chained state to state (:mod:`kvproto.checking.windows`; a lease
window ends where no read is in progress; ``max_windows`` caps their number,
and the line says so); so does the merged check, in windows of at most
``max_steps`` master steps that end where no put is pending and no command
is on its way to a node (:func:`kvproto.checking.mergetrace.check_windows`;
a run not quiet again within a window is checked up to there). The result
says how many of the recorded steps were checked. A check that finds
a step the spec does not allow fails the cell, as wrong bytes do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from kvproto.checking import failtrace, leasetrace, mergetrace, nodetrace, traces
from kvproto.checking.traces import runs
from kvproto.checking.tracerun import TraceError, Verdict, accepted

#: cells whose proxy faults drop, delay or reorder the master's commands to its nodes
UNORDERED = ("net-drop", "net-delay", "net-reorder", "net-partition")


class Check:
    """One checker's result on one cell run."""

    def __init__(self, name: str, recorded: int, checked: int = 0,
                 verdict: Optional[Verdict] = None, why: str = "") -> None:
        self.name = name            # "master-0 publish", "master-1 merged", "failover"
        self.recorded = recorded    # steps recorded
        self.checked = checked      # steps TLC walked
        self.verdict = verdict
        self.why = why              # why not checked, or why only a prefix

    @property
    def failed(self) -> bool:
        return self.verdict is not None and not self.verdict.ok

    def line(self) -> str:
        if self.verdict is None:
            return f"{self.name}: not checked ({self.why})"
        if self.failed:
            return f"{self.name}: FAIL: {self.verdict.message}"
        if self.checked < self.recorded:
            return f"{self.name}: {self.checked} steps pass of {self.recorded} recorded " \
                   f"(a prefix: {self.why})"
        return f"{self.name}: {self.checked} steps pass" + (f" ({self.why})" if self.why else "")


def whole_lines(path: Path) -> Path:
    """``path``, or a copy of it without a partial last line (its process was
    killed while writing it) beside it."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return path
    cut = path.with_name(path.name + ".whole")
    cut.write_bytes(data[:data.rfind(b"\n") + 1])
    return cut


def _windowed_check(name: str, check_windows: Callable[..., Verdict], header: dict,
                    steps: list, max_steps: int, max_windows: Optional[int]) -> Check:
    """The publish or lease check of a whole run, in windows of at most
    ``max_steps`` steps (:mod:`kvproto.checking.windows`), at most
    ``max_windows`` of them."""
    if not steps:
        return Check(name, 0, why="no step recorded")
    try:
        verdict = check_windows(header, steps, size=max_steps, max_windows=max_windows)
    except TraceError as e:
        return Check(name, len(steps), why=" ".join(str(e).split()))
    why = verdict.stopped or (f"in {verdict.windows} windows" if verdict.windows > 1 else "")
    return Check(name, len(steps), verdict.steps, verdict, why)


def _master_checks(name: str, path: Path, max_steps: int,
                   max_windows: Optional[int] = None) -> list[Check]:
    out = []
    lines = traces.read(path)
    for machine, read, check_windows in (
            ("publish", traces.publish_run, traces.check_windows),
            ("lease", leasetrace.lease_run, leasetrace.check_windows)):
        split = runs(lines[machine])
        for i, run in enumerate(split, 1):
            label = f"{name} {machine}" + (f" run {i}" if len(split) > 1 else "")
            try:
                header, steps = read(run)
            except TraceError as e:
                out.append(Check(label, len(run) - 1, why=" ".join(str(e).split())))
                continue
            out.append(_windowed_check(label, check_windows, header, steps, max_steps,
                                       max_windows))
    return out


def caused_within(master: list, header: dict, nodes: list[list]) -> list[list]:
    """Each node's region steps up to the first whose cause (the command, or
    the grant of its token: :class:`~kvproto.checking.mergetrace.Causes`) is
    not among ``master``'s steps: the nodes' part of a master prefix."""
    causes = mergetrace.Causes(master, header)
    out = []
    for steps in nodes:
        of = causes.of(steps)
        cut = of.index(None) if None in of else len(steps)
        out.append(steps[:cut])
    return out


def unheard_tail(steps: list, node_steps: list[list]) -> int:
    """Where the run's trailing accepted put_ends start whose replicas the
    nodes never recorded written: a direct writer's bytes are recorded at a
    node when the publish mark reaches it, so a master killed between its
    ``PutEnd`` and that mark leaves them unrecorded (and its writer
    unanswered: the put_end is acknowledged only after the marks). The merged
    check stops before them; every other step must match."""
    written = {(ev["segment"], ev["offset"], ev["token"])
               for run in node_steps for _, obj in run
               for ev in [obj["event"]] if ev.get("type") == "WriteReplica" and accepted(obj)}
    end = len(steps)
    while end:
        row = steps[end - 1][1]
        ev = row.get("event", {})
        if ev.get("type") != "PutEnd" or not accepted(row):
            break
        record = row.get("after", {}).get("objects", {}).get(ev["key"])
        if record is None or all((r["segment"], r["offset"], ev["token"]) in written
                                 for r in record["replicas"]):
            break
        end -= 1
    return end


def _merged_check(label: str, path: Path, header: dict, steps: list, nodes: list[Path],
                  max_steps: int, max_windows: Optional[int] = None) -> Check:
    """The merged check of one master run (``header``, ``steps``) with each
    node's steps under its term, from the region table the node held at its
    fence of that term: whole, in windows of at most ``max_steps`` master
    steps (at most ``max_windows`` of them)."""
    segments, node_steps, tables = nodetrace.read_nodes(nodes, header.get("term", 1))
    files = [path] + nodes
    recorded = len(steps) + sum(map(len, node_steps))
    name = label + " merged"
    end = unheard_tail(steps, node_steps)
    unheard = (f"the last {len(steps) - end} put_end(s) left replicas no node recorded "
               "written (their marks never reached it)") if end < len(steps) else ""
    if end == 0:
        return Check(name, recorded, why=unheard or "no step recorded")
    try:
        verdict = mergetrace.check_windows(header, steps[:end],
                                           caused_within(steps[:end], header, node_steps),
                                           files, segments, tables=tables, size=max_steps,
                                           max_windows=max_windows)
    except TraceError as e:
        return Check(name, recorded, why="; ".join(filter(None, [" ".join(str(e).split()),
                                                                 unheard])))
    why = verdict.stopped or (f"in {verdict.windows} windows" if verdict.windows > 1 else "")
    return Check(name, recorded, verdict.steps, verdict, "; ".join(filter(None, [why, unheard])))


def _merged_checks(name: str, path: Path, nodes: list[Path], max_steps: int,
                   max_windows: Optional[int] = None) -> list[Check]:
    """The merged check of each publish run in a master's file."""
    out = []
    split = runs(traces.read(path)["publish"])
    for i, run in enumerate(split, 1):
        label = name + (f" run {i}" if len(split) > 1 else "")
        try:
            header, steps = traces.publish_run(run)
            out.append(_merged_check(label, path, header, steps, nodes, max_steps, max_windows))
        except TraceError as e:
            out.append(Check(label + " merged", 0, why=" ".join(str(e).split())))
    return out


def judge(report, checks: list[Check]) -> None:
    """Add the checks of a cell run to its :class:`~kvproto.checking.chaos.verdict.Report`."""
    report.traces = [c.line() for c in checks]
    for c in checks:
        if c.failed:
            report.trace_failures += 1
            report.note(f"trace {c.line()}")
        elif c.verdict is not None:
            report.trace_steps += c.checked


def check_cell(folder: Path, cell: str, max_steps: int = 1000,
               max_windows: Optional[int] = None) -> list[Check]:
    """Run the checkers that apply to a cell run whose processes recorded to
    ``folder`` (see the module docstring): the publish and lease checks of
    each master run and the merged one whole, in windows of at most
    ``max_steps`` (master) steps, at most ``max_windows`` of them."""
    folder = Path(folder)
    masters = sorted((p for p in folder.glob("master-*.trace") if p.stat().st_size),
                     key=lambda p: int(p.stem.split("-")[1]))
    nodes = sorted((p for p in folder.glob("storage-*.trace") if p.stat().st_size),
                   key=lambda p: int(p.stem.split("-")[1]))
    masters = [whole_lines(p) for p in masters]
    nodes = [whole_lines(p) for p in nodes]
    checks: list[Check] = []
    for path in masters:
        checks += _master_checks(path.name.split(".")[0], path, max_steps, max_windows)
    if nodes and cell not in UNORDERED:
        for path in masters:
            checks += _merged_checks(path.name.split(".")[0], path, nodes, max_steps,
                                     max_windows)
    if nodes:
        try:
            verdict = failtrace.check(nodes, masters)
            terms = re.search(r"\d+ term\(s\)", verdict.message)
            checks.append(Check("failover", verdict.steps, verdict.steps, verdict,
                                terms.group(0) if terms and verdict.ok else ""))
        except TraceError as e:
            checks.append(Check("failover", 0, why=" ".join(str(e).split())))
    return checks
