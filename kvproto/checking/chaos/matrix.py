"""Running the fault matrix: each cell's traffic and faults, quiescence, and the verdict.

One :class:`Matrix` owns a cluster (:mod:`kvproto.checking.chaos.cluster`) and
runs cells on it one after another. A cell run:

1. starts its writers and readers (separate processes, journals in the
   cell's folder) and waits until each has connected;
2. for ``seconds``, arms the cell's faults (:mod:`kvproto.checking.chaos.cells`)
   and replaces every process a fault killed;
3. stops the workers, heals the network (the proxy delivers what it held,
   resumes what it stopped), replaces dead servers;
4. waits for *quiescence*: an open master with no put attempt pending, and
   every storage node holding exactly the regions of the objects the master
   lists on it (count and bytes), each published; after every timer had time
   to run out (:meth:`~kvproto.checking.chaos.cluster.Settings.quiet_after`)
   whatever still differs is a leak;
5. reads back every key of the cell and judges the journals against it
   (:func:`~kvproto.checking.chaos.verdict.judge`), then removes the cell's keys.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, TextIO

from kvproto.checking.chaos.cells import CELLS, Cell, Context
from kvproto.checking.chaos.cluster import Cluster, Proc, Settings
from kvproto.checking.chaos.verdict import History, Report, judge
from kvproto.checking.chaos.workers import read_journal, verify


class Matrix:
    def __init__(self, workdir: Optional[Path] = None, seed: int = 0,
                 settings: Optional[Settings] = None, log: Optional[TextIO] = None,
                 keep: bool = False) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvproto-chaos-"))
        self.seed = seed
        self.rng = random.Random(seed)
        self.settings = settings or Settings()
        self.cluster = Cluster(self.workdir, self.settings, seed)
        self.log = log
        self.keep = keep
        self.runs = 0

    def say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    def __enter__(self) -> "Matrix":
        self.cluster.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.cluster.stop()
        if self._own_dir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ one cell

    def run(self, cell: "Cell | str", seconds: float) -> Report:
        cell = CELLS[cell] if isinstance(cell, str) else cell
        self.runs += 1
        tag = f"{cell.name}.{self.runs}"
        folder = self.workdir / "cells" / tag
        folder.mkdir(parents=True)
        report = Report(cell.name)
        started = time.monotonic()
        run = _CellRun(self, cell, tag, folder, report)
        try:
            run.traffic(seconds)
        finally:
            run.stop_workers()
        run.quiesce()
        report.seconds = time.monotonic() - started
        self.say(format_row(report))
        return report

    def soak(self, minutes: float, cells: Iterable[str], seconds: float = 30.0) -> dict[str, Report]:
        """Run ``cells`` in turn, ``seconds`` each, until ``minutes`` have passed."""
        totals: dict[str, Report] = {}
        names = list(cells)
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            for name in names:
                if time.monotonic() >= end:
                    break
                totals.setdefault(name, Report(name)).add(self.run(name, seconds))
        return totals


class _CellRun:
    def __init__(self, matrix: Matrix, cell: Cell, tag: str, folder: Path, report: Report) -> None:
        self.m = matrix
        self.cluster = matrix.cluster
        self.s = matrix.settings
        self.cell = cell
        self.tag = tag
        self.folder = folder
        self.report = report
        self.rng = random.Random(matrix.rng.randrange(1 << 30))
        self.ctx = Context(self.cluster, self.rng)
        self.workers: list[Proc] = []
        self.incarnations = 0
        self.rule_ids: list[int] = []
        self.armed_at = -1e9
        self.stop_file = folder / "stop"

    # ------------------------------------------------------------------ workers

    def spawn(self, role: str, index: int) -> Proc:
        self.incarnations += 1
        name = f"{role}{index}.{self.incarnations}"
        config = {"master": self.cluster.coordinator, "stop": str(self.stop_file),
                  "journal": str(self.folder / f"{name}.jsonl"),
                  "seed": self.rng.randrange(1 << 30), "prefix": f"{self.tag}/{name}",
                  "client": {"timeout": self.s.client_timeout, "lookup_timeout": self.s.lookup_timeout,
                             "switch_window": self.s.switch_window}}
        if role == "writer":
            config.update(replicas=2, live=48, min_size=256, max_size=8192)
        else:
            config.update(journals=str(self.folder), batch=8)
            config["client"]["local_reads"] = index % 2 == 0
        proc = Proc(role, name, [sys.executable, "-m", "kvproto.checking.chaos.workers", role,
                                 json.dumps(config)], self.folder / f"{name}.log")
        proc.index = index  # type: ignore[attr-defined]
        self.cluster.proxy.call("allow", pids=[proc.pid])
        self.workers.append(proc)
        return proc

    def started(self, proc: Proc) -> bool:
        records, _ = read_journal(str(self.folder / f"{proc.name}.jsonl"))
        return bool(records) or not proc.alive()

    def traffic(self, seconds: float) -> None:
        for i in range(self.cell.writers):
            self.spawn("writer", i)
        for i in range(self.cell.readers):
            self.spawn("reader", i)
        Cluster.wait(lambda: all(self.started(p) for p in self.workers), 60, "the workers to start")
        end = time.monotonic() + seconds
        next_look = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 0.2
                self.replace_workers()
                replaced = self.cluster.heal()
                if replaced:
                    self.m.say(f"  {self.tag}: replaced {', '.join(replaced)}")
                self.arm(now)
            time.sleep(0.05)

    def replace_workers(self) -> None:
        for proc in [p for p in self.workers if not p.alive() and not p.killed_by_us]:
            proc.killed_by_us = True    # seen; replaced once
            proc.close()
            if proc.popen.returncode == 0:
                continue
            self.spawn(proc.role, proc.index)  # type: ignore[attr-defined]

    def arm(self, now: float) -> None:
        cell = self.cell
        if self.rule_ids and (cell.once or not self._spent()):
            return
        if now - self.armed_at < cell.period or (cell.whole and not self.ctx.whole()):
            return
        rules = cell.rules(self.ctx)
        if not rules:
            return
        self.ctx.armed += 1
        self.armed_at = now
        self.rule_ids = []
        for n, spec in enumerate(rules):
            spec = dict(spec)
            spec.setdefault("name", f"{cell.name}:{spec['action']}:{spec.get('ops', 'any')}")
            if not cell.once:
                spec.setdefault("for_ms", int(cell.window * 1000))
            self.rule_ids.append(self.cluster.proxy.rule(**spec))

    def _spent(self) -> bool:
        stats = self.cluster.proxy.call("stats")
        live = {r["id"] for r in stats["rules"]}
        mine = [r for r in stats["rules"] if r["id"] in self.rule_ids]
        now_alive = [r for r in mine if r["id"] in live]
        # a rule is spent once it fired (count 1) or lapsed; lapsed ones stay listed
        return all(r["fired"] >= 1 for r in now_alive) or self._lapsed()

    def _lapsed(self) -> bool:
        return time.monotonic() - self.armed_at > self.cell.window

    def stop_workers(self) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + self.s.client_timeout * 2 + 5
        for proc in self.workers:
            proc.signal(signal.SIGCONT)
        for proc in self.workers:
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.1))
            except Exception:
                proc.signal(signal.SIGKILL)
                proc.popen.wait(5)
            proc.close()

    # ------------------------------------------------------------------ after

    def quiesce(self) -> None:
        proxy = self.cluster.proxy
        stats = proxy.call("stats")
        for name, n in stats["fired"].items():
            if name.startswith(self.cell.name + ":"):
                self.report.faults_by[name.split(":", 1)[1]] += n
        self.report.faults = sum(self.report.faults_by.values())
        proxy.call("clear")
        proxy.call("events")
        healed_until = time.monotonic() + self.s.quiet_after() + 30
        while True:
            replaced = self.cluster.heal()
            if replaced:
                self.m.say(f"  {self.tag}: replaced {', '.join(replaced)}")
            leaks = self.leaks() if self.cluster.open_leader() is not None and self.whole() else None
            if leaks is not None and not any(leaks.values()):
                break
            if time.monotonic() > healed_until:
                self.report.leaks = leaks or {"no open master with every node": 1}
                self.report.leaked = sum((leaks or {"x": 1}).values())
                self.report.note(f"not quiescent: {self.report.leaks}")
                break
            time.sleep(0.25)
        self.read_back()

    def whole(self) -> bool:
        c = self.cluster
        return len([m for m in c.masters if m.alive()]) >= 1 and all(s.alive() for s in c.storage)

    def client(self):
        import kvproto
        return kvproto.Client(self.cluster.coordinator, timeout=10.0, lookup_timeout=5.0,
                              switch_window=30.0)

    def leaks(self) -> Optional[dict[str, int]]:
        """What the master and the nodes disagree on (all zero when quiescent),
        or None if a server does not answer."""
        from kvproto.errors import KvError
        stats = self.cluster.master_stats(self.cluster.open_leader())
        if stats is None:
            return None
        nodes = {}
        for proc in self.cluster.storage:
            st = self.cluster.node_stats(proc)
            if st is None:
                return None
            nodes[st["segment"]] = st
        expected: dict[str, list[int]] = {}
        try:
            with self.client() as c:
                keys = c.keys()
                for at in range(0, len(keys), 1024):
                    leases = [l for l in c.read_begin(keys[at:at + 1024]) if l is not None]
                    for lease in leases:
                        for seg, _, length in lease.replicas:
                            e = expected.setdefault(seg, [0, 0])
                            e[0] += 1
                            e[1] += length
                    c.release(leases)
        except KvError:
            return None
        live = {seg for seg, s in stats.get("segments", {}).items() if s.get("live")}
        out = {"pending attempts": stats.get("pending", 0),
               "segments live at the master without a node": len(live - set(nodes)),
               "nodes whose segment the master does not list": len(set(nodes) - live)}
        regions = unpublished = nbytes = 0
        for seg, st in nodes.items():
            count, length = expected.get(seg, [0, 0])
            regions += abs(st.get("regions", 0) - count)
            nbytes += abs(st.get("used", 0) - length)
            unpublished += abs(st.get("regions", 0) - st.get("published", st.get("regions", 0)))
            if seg in live:
                nbytes += abs(stats["segments"][seg].get("used", length) - length)
        out.update({"regions the directory does not list": regions,
                    "bytes the directory does not account for": nbytes,
                    "unpublished regions": unpublished})
        return out

    def read_back(self) -> None:
        """Read every key of the cell, judge, then remove them."""
        final: dict[str, object] = {}
        history = History.load(str(self.folder))
        prefix = self.tag + "/"
        with self.client() as c:
            keys = c.keys(prefix=prefix)
            for at in range(0, len(keys), 256):
                chunk = keys[at:at + 256]
                for key, data in zip(chunk, c.get_many(chunk)):
                    if data is None:
                        continue
                    gen, why = verify(key, data)
                    final[key.decode()] = gen if gen is not None else f"wrong: {why}"
            placements = {k.decode(errors="replace"): v for k, v in
                          self.cluster.proxy.call("placements")["placements"].items()
                          if k.startswith(prefix.encode())}
            stats = self.cluster.master_stats() or {}
            live = {seg for seg, s in stats.get("segments", {}).items() if s.get("live")}
            judge(self.report, history, final, placements, live, prefix)
            for key in keys:
                try:
                    c.remove(key, force=True)
                except Exception:
                    pass


# ---------------------------------------------------------------------- report

COLUMNS = [("cell", "cell", "<"), ("s", "seconds", ">"), ("ops", "operations", ">"),
           ("faults", "faults", ">"), ("verified", "verified", ">"), ("wrong", "wrong_bytes", ">"),
           ("acked lost", "acked_lost", ">"), ("with nodes", "lost_with_nodes", ">"),
           ("unexpl.", "unexplained", ">"), ("exc.", "exceptions", ">"), ("leaked", "leaked", ">"),
           ("result", None, "<")]


def _cells(report: Report) -> list[str]:
    out = []
    for _, attr, _ in COLUMNS:
        if attr is None:
            out.append("FAIL" if report.failed else "ok")
        elif attr == "seconds":
            out.append(f"{report.seconds:.0f}")
        elif attr == "cell":
            out.append(report.cell)
        else:
            out.append(f"{getattr(report, attr):,}")
    return out


def format_row(report: Report) -> str:
    return "  ".join(_cells(report))


def format_table(reports: Iterable[Report]) -> str:
    rows = [[h for h, _, _ in COLUMNS]] + [_cells(r) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if a == "<" else c.rjust(w)
                       for c, w, (_, _, a) in zip(row, widths, COLUMNS)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
