"""Judging one matrix cell from its journals and the store's final state.

Each key is written by one writer, one operation at a time, so its history is
a sequence of puts and removes, each acknowledged (``ok``), refused (an error
after which nothing changed: :data:`~kvproto.checking.chaos.workers.PUT_REFUSALS`,
:data:`~kvproto.checking.chaos.workers.REMOVE_REFUSALS`) or of unknown outcome
(any other error, or the writer was killed in the middle). The states the key
may be in afterwards are folded from it: an acknowledged put leaves exactly
its generation, an acknowledged remove leaves nothing, an unknown outcome adds
its result to what was possible before.

What counts against the store:

* **wrong bytes**: a read whose bytes are not a whole value of the key asked
  for (:func:`~kvproto.checking.chaos.workers.verify`), during the run or in
  the final read-back;
* **acknowledged operations lost**: a read that returned a generation whose
  remove had been acknowledged before the read began; at the end, a key
  absent although its last possible state is an acknowledged put, or present
  although an acknowledged remove came after every put that could have left it;
* **unexplained objects**: a generation no writer had started to put when it
  was read, or a key no writer wrote;
* **client exceptions**: a client call that raised anything but a typed
  kvproto error;
* **trace failures** (``kvproto chaos --trace``): a recorded step of a
  master or storage node that its spec does not allow
  (:mod:`kvproto.checking.chaos.tracecheck`).

Leaks: after the cell, the master and the storage nodes must agree region by
region (see :mod:`kvproto.checking.chaos.matrix`), and a loader's buffer pool
must hold no buffer quarantined or loading. Buffers *written off* (their
load's node died, so neither its bytes nor a cancel acknowledgement will
come) are counted apart: the Timeout protocol keeps them on a bounded leak
ledger, and once that is full, quarantined. In a cell that kills storage
nodes or drops frames, quarantined buffers are counted with them.

An acknowledged put that is absent at the end is *lost with its nodes*, not
counted against the store, when every storage segment its replicas were
granted on (the fault proxy saw the grant) is no longer live: its bytes died
with them, as the spec's ``SegmentLost`` says.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterable, Optional

from kvproto.checking.chaos.workers import PUT_REFUSALS, REMOVE_REFUSALS, read_journal

ABSENT = "absent"
OK, REFUSED, UNKNOWN = "ok", "refused", "unknown"


class Op:
    __slots__ = ("kind", "gen", "outcome", "t0", "t1", "error")

    def __init__(self, kind: str, gen: int, outcome: str, t0: float, t1: Optional[float], error: str) -> None:
        self.kind = kind
        self.gen = gen
        self.outcome = outcome
        self.t0 = t0
        self.t1 = t1
        self.error = error


def outcome(kind: str, out: str, duplicates: bool = False) -> str:
    """``ok``, ``refused`` or ``unknown``. Where requests may be delivered
    twice, no refusal is certain: the copy may have come when it could succeed."""
    if out == "ok":
        return OK
    refusals = PUT_REFUSALS if kind == "put" else REMOVE_REFUSALS
    return REFUSED if out in refusals and not duplicates else UNKNOWN


class Report:
    """What one cell did and what went wrong (figures and the first examples)."""

    FIGURES = ("operations", "puts_acked", "removes_acked", "gets", "verified", "misses",
               "wrong_bytes", "acked_lost", "stale_reads", "lost_puts", "lost_removes",
               "lost_with_nodes", "unexplained", "exceptions", "faults", "leaked",
               "buffers_written_off", "trace_steps", "trace_failures")

    def __init__(self, cell: str) -> None:
        self.cell = cell
        self.seconds = 0.0
        for name in self.FIGURES:
            setattr(self, name, 0)
        self.errors: Counter = Counter()
        self.faults_by: Counter = Counter()
        self.leaks: dict[str, int] = {}
        self.examples: list[str] = []
        self.settled = True
        #: seconds spent in each phase of the run (start, traffic, stop, quiesce, read back)
        self.phases: dict[str, float] = {}
        #: with tracing on: a line per trace check of the run
        #: (:mod:`kvproto.checking.chaos.tracecheck`)
        self.traces: list[str] = []

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)

    @property
    def failed(self) -> bool:
        return bool(self.wrong_bytes or self.acked_lost or self.unexplained or self.exceptions
                    or self.leaked or self.trace_failures or not self.settled)

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.FIGURES}
        d.update(cell=self.cell, seconds=round(self.seconds, 1), errors=dict(self.errors),
                 faults_by=dict(self.faults_by), leaks=self.leaks, examples=self.examples,
                 settled=self.settled, failed=self.failed, phases=self.phases,
                 traces=self.traces)
        return d

    def add(self, other: "Report") -> None:
        """Sum ``other`` (another run of the same cell) into this one."""
        self.seconds += other.seconds
        for name in self.FIGURES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.errors.update(other.errors)
        self.faults_by.update(other.faults_by)
        for k, v in other.leaks.items():
            self.leaks[k] = self.leaks.get(k, 0) + v
        self.settled = self.settled and other.settled
        self.traces += other.traces
        for e in other.examples:
            self.note(e)


class History:
    """Every writer's operations per key, and every reader's reads, of one cell."""

    def __init__(self, duplicates: bool = False) -> None:
        self.duplicates = duplicates
        self.ops: dict[str, list[Op]] = {}
        self.gets: list[dict] = []
        self.exceptions: list[dict] = []
        self.engines: list[dict] = []     # a loader's buffer pool counts at the end of the cell

    @classmethod
    def load(cls, folder: str, duplicates: bool = False) -> "History":
        h = cls(duplicates)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".jsonl"):
                continue
            records, _ = read_journal(os.path.join(folder, name))
            h.add(records)
        return h

    def add(self, records: Iterable[dict]) -> None:
        begun: dict = {}        # key -> its operation begun and not ended (a batch: several)
        for r in records:
            op = r.get("op")
            if op in ("put?", "remove?"):
                begun[r["key"]] = r
            elif op in ("put", "remove"):
                begun.pop(r["key"], None)
                self.ops.setdefault(r["key"], []).append(
                    Op(op, r["gen"], outcome(op, r["out"], self.duplicates), r["t0"], r["t1"], r["out"]))
            elif op == "get":
                self.gets.append(r)
            elif op == "exception":
                self.exceptions.append(r)
            elif op == "engine":
                self.engines.append(r)
        for r in begun.values():    # killed in the middle: the outcome is unknown
            self.ops.setdefault(r["key"], []).append(
                Op(r["op"][:-1], r["gen"], UNKNOWN, r["t0"], None, "killed"))

    def possible(self, key: str) -> set:
        """The states ``key`` may be in after its history: generations and/or ABSENT."""
        states: set = {ABSENT}
        for op in self.ops.get(key, ()):
            result = op.gen if op.kind == "put" else ABSENT
            if op.outcome == OK:
                states = {result}
            elif op.outcome == UNKNOWN:
                states = states | {result}
        return states


def judge(report: Report, history: History, final: Optional[dict[str, Any]],
          placements: dict[str, list], live: set[str], prefix: str,
          loads_lost: bool = False) -> Report:
    """Fill ``report`` from the cell's ``history`` and ``final``: key -> the
    generation read back at the end (or a ``"wrong: ..."`` string); keys not
    in it are absent (None: no read-back, only the run is judged).
    ``placements``: key -> segments of its last acknowledged put; ``live``: the
    segments live at the end; ``loads_lost``: a load's reply and cancels could
    be lost for good (a loader's buffers stranded so are written off)."""
    started: dict[tuple[str, int], float] = {}
    removed_at: dict[tuple[str, int], float] = {}
    for key, ops in history.ops.items():
        for op in ops:
            report.operations += 1
            if op.outcome != OK:
                report.errors[f"{op.kind}:{op.error}"] += 1
            if op.kind == "put":
                started.setdefault((key, op.gen), op.t0)
                report.puts_acked += op.outcome == OK
            else:
                report.removes_acked += op.outcome == OK
                if op.outcome == OK:
                    removed_at[(key, op.gen)] = op.t1
    for e in history.engines:
        counts = e["counts"]
        held = counts.get("quarantined", 0) + counts.get("loading", 0)
        report.buffers_written_off += counts.get("leaked", 0) + (held if loads_lost else 0)
        if held and not loads_lost:
            report.leaks["buffers quarantined or loading at the end"] = \
                report.leaks.get("buffers quarantined or loading at the end", 0) + held
            report.leaked += held
            report.note(f"a loader's pool at the end of the cell: {counts}")
    for e in history.exceptions:
        report.exceptions += 1
        report.note(f"client raised {e['error']}: {e.get('trace', '')[-400:]}")
    for g in history.gets:
        report.operations += 1
        if g["out"] != "ok":
            report.errors[f"get:{g['out']}"] += 1
            continue
        for key, res in zip(g["keys"], g["res"]):
            report.gets += 1
            if res == -1:
                report.misses += 1
            elif isinstance(res, str):
                report.wrong_bytes += 1
                report.note(f"read of {key} at {g['t0']:.3f}: {res}")
            else:
                report.verified += 1
                begun = started.get((key, res))
                if begun is None or begun > g["t1"]:
                    report.unexplained += 1
                    report.note(f"read of {key} returned generation {res}, which no writer had begun")
                gone = removed_at.get((key, res))
                if gone is not None and gone < g["t0"]:
                    report.stale_reads += 1
                    report.note(f"read of {key} at {g['t0']:.3f} returned generation {res}, "
                                f"whose remove was acknowledged at {gone:.3f}")
    if final is None:
        report.acked_lost = report.stale_reads
        return report
    for key, value in final.items():
        if isinstance(value, str):
            report.wrong_bytes += 1
            report.note(f"final read of {key}: {value}")
        elif key not in history.ops:
            report.unexplained += 1
            report.note(f"{key} (generation {value}) is stored, but no writer put it")
    for key, ops in history.ops.items():
        states = history.possible(key)
        actual = final.get(key, ABSENT)
        if (isinstance(actual, str) and actual != ABSENT) or actual in states:
            continue
        if actual == ABSENT:
            segments = placements.get(key)
            if segments and not set(segments) & live:
                report.lost_with_nodes += 1
                continue
            report.lost_puts += 1
            report.note(f"{key}: acknowledged put of generation {sorted(s for s in states if s != ABSENT)} "
                        f"is gone (replicas on {segments or 'unknown segments'})")
        elif any(op.kind == "put" and op.gen == actual and op.outcome != REFUSED for op in ops):
            report.lost_removes += 1
            report.note(f"{key}: generation {actual} is stored after its remove was acknowledged")
        else:
            report.unexplained += 1
            report.note(f"{key}: generation {actual} is stored; possible: {sorted(map(str, states))}")
    report.acked_lost = report.stale_reads + report.lost_puts + report.lost_removes
    return report
