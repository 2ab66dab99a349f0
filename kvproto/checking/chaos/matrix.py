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

With tracing on (:func:`run_traced`, ``kvproto chaos --trace``) each cell
runs on a cluster of its own whose servers record their steps, and TLC checks
them after the cell (:mod:`kvproto.checking.chaos.tracecheck`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, TextIO

from kvproto.checking.chaos.cells import CELLS, Cell, Context
from kvproto.checking.chaos.cluster import Cluster, Proc, Settings
from kvproto.checking.chaos.verdict import History, Report, judge
from kvproto.checking.chaos.workers import read_journal, verify


def tidy_writer_locks() -> int:
    """Remove the lock files of dead direct writers (a writer killed before any
    node asked about it leaves its file in /dev/shm): what a node does when it
    finds one (:func:`~kvproto.runtime.shm.writer_alive`). Returns how many."""
    from kvproto.runtime.shm import SHM_DIR, WRITER_PREFIX, writer_alive
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(WRITER_PREFIX)]
    except OSError:
        return 0
    return sum(1 for n in names if not writer_alive(n))


class Matrix:
    #: worker processes: (role, how many); they serve cell after cell. Writer
    #: 0 and reader 0 use this host's shared memory (direct writes, local
    #: reads), the others the network
    WORKERS = (("writer", 2), ("reader", 2), ("loader", 1))
    #: with tracing on, a lighter workload over fewer keys, so that more of a
    #: cell's run fits the trace checkers' bounds (keys, tokens, steps):
    #: writers keep few objects and mostly put removed keys again, readers
    #: ask for few never-written keys, everyone pauses between operations
    TRACED = {"writer": dict(live=3, reput=0.8, pause=0.02, put_many=0.0),
              "reader": dict(never=2, pause=0.05), "loader": dict(never=2, pause=0.05)}

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
        self.control = self.workdir / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        #: (role, index) -> the worker process serving that slot now
        self.workers: dict[tuple[str, int], Proc] = {}
        self.worker_deaths = 0

    def say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    def __enter__(self) -> "Matrix":
        try:
            self.cluster.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        (self.control / "quit").touch()
        for proc in self.workers.values():
            proc.stop(grace=2.0)
        self.cluster.stop()
        tidy_writer_locks()
        if self._own_dir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ workers

    def spawn_worker(self, role: str, index: int, first: int) -> Proc:
        s = self.settings
        config = {"role": role, "index": index, "first": first, "control": str(self.control),
                  "master": self.cluster.coordinator,
                  "client": {"timeout": s.client_timeout, "lookup_timeout": s.lookup_timeout,
                             "switch_window": s.switch_window}}
        if role == "writer":
            config.update(replicas=2, live=48, min_size=256, max_size=8192)
            # one writer copies into same-host segments itself (direct writes),
            # one sends its bytes over the network
            config["client"]["local_writes"] = index % 2 == 0
            # a fifth of the steps put four new keys in one put_many of two
            # chunks: a chunk's put_end is answered while the next is written
            config.update(put_many=0.2)
            config["client"].update(batch=2, window=2)
        else:
            config.update(batch=8)
            config["client"]["local_reads"] = role == "reader" and index % 2 == 0   # one over shared memory
        if s.trace:
            config.update(self.TRACED[role])
        proc = Proc(role, f"{role}{index}", [sys.executable, "-m", "kvproto.checking.chaos.workers",
                                             json.dumps(config)],
                    self.workdir / "logs" / f"{role}{index}.log")
        self.cluster.proxy.call("allow", pids=[proc.pid])
        self.workers[(role, index)] = proc
        return proc

    def replace_workers(self, k: int) -> int:
        """Start a worker in every slot whose process died, from cell ``k`` on."""
        n = 0
        for (role, index), proc in list(self.workers.items()):
            if not proc.alive():
                proc.close()
                self.spawn_worker(role, index, k)
                n += 1
        self.worker_deaths += n
        return n

    # ------------------------------------------------------------------ cells

    def run(self, cell: "Cell | str", seconds: float) -> Report:
        return self.run_all([cell], seconds)[0]

    def run_all(self, cells: "Iterable[Cell | str]", seconds: float,
                until: Optional[float] = None) -> list[Report]:
        """Run ``cells`` one after another, ``seconds`` of traffic each (none
        is started after the monotonic time ``until``). The workers move on to
        the next cell (and wait for it) while the last one settles."""
        cells = [CELLS[c] if isinstance(c, str) else c for c in cells]
        reports: list[Report] = []
        upcoming = self._prepare(cells[0]) if cells else None
        for i in range(len(cells)):
            run = upcoming
            if run is None:
                break
            try:
                run.traffic(seconds)
                run.mark("traffic")
            finally:
                run.heal_network()
                run.stop_workers()
                run.mark("stop")
            more = i + 1 < len(cells) and (until is None or time.monotonic() < until)
            upcoming = self._prepare(cells[i + 1]) if more else None
            run.quiesce()
            run.report.seconds = time.monotonic() - run.began
            self.say(format_row(run.report))
            reports.append(run.report)
        return reports

    def _prepare(self, cell: Cell) -> "_CellRun":
        k = self.runs
        self.runs += 1
        tag = f"{cell.name}.{k}"
        folder = self.workdir / "cells" / tag
        folder.mkdir(parents=True)
        assignment = {"folder": str(folder), "tag": tag, "seed": self.rng.randrange(1 << 30)}
        path = self.control / f"cell-{k}.json"
        path.with_suffix(".tmp").write_text(json.dumps(assignment))
        path.with_suffix(".tmp").rename(path)
        if not self.workers:
            for role, n in self.WORKERS:
                for index in range(n):
                    self.spawn_worker(role, index, k)
        self.replace_workers(k)
        return _CellRun(self, cell, k, tag, folder, Report(cell.name))

    def soak(self, minutes: float, cells: Iterable[str], seconds: float = 30.0) -> dict[str, Report]:
        """Run ``cells`` in turn, ``seconds`` each, until ``minutes`` have passed."""
        totals: dict[str, Report] = {}
        names = list(cells)
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            for report in self.run_all(names, seconds, until=end):
                totals.setdefault(report.cell, Report(report.cell)).add(report)
        return totals


def run_traced(workdir: Path, cells: "Iterable[Cell | str]", seconds: float, seed: int = 0,
               log: Optional[TextIO] = None, until: Optional[float] = None, first: int = 0,
               max_steps: int = 1000, max_windows: Optional[int] = None,
               **settings) -> list[Report]:
    """Run ``cells`` with tracing on, each on a cluster of its own (in
    ``workdir/run-N-CELL``, ``N`` counting from ``first``), so that each
    master's trace is one run from an empty directory or from its takeover;
    then check its traces (:func:`kvproto.checking.chaos.tracecheck.check_cell`,
    windows of at most ``max_steps`` steps, at most ``max_windows`` windows). None is started after the
    monotonic time ``until``."""
    from kvproto.checking.chaos import tracecheck
    reports = []
    for i, cell in enumerate(cells, first):
        if until is not None and reports and time.monotonic() >= until:
            break
        cell = CELLS[cell] if isinstance(cell, str) else cell
        folder = Path(workdir) / f"run-{i}-{cell.name}"
        matrix = Matrix(folder, seed=seed + i, settings=Settings(trace=True, **settings), log=log)
        with matrix:
            report = matrix.run(cell, seconds)
        began = time.monotonic()
        tracecheck.judge(report, tracecheck.check_cell(matrix.cluster.traces, cell.name, max_steps,
                                                     max_windows))
        report.phases["trace check"] = round(time.monotonic() - began, 2)
        for line in report.traces:
            matrix.say(f"  {cell.name}: trace: {line}")
        reports.append(report)
    return reports


class _CellRun:
    def __init__(self, matrix: Matrix, cell: Cell, k: int, tag: str, folder: Path,
                 report: Report) -> None:
        self.m = matrix
        self.cluster = matrix.cluster
        self.s = matrix.settings
        self.cell = cell
        self.k = k
        self.tag = tag
        self.folder = folder
        self.report = report
        self.rng = random.Random(matrix.rng.randrange(1 << 30))
        self.ctx = Context(self.cluster, self.rng, str(folder))
        self.rule_ids: list[int] = []
        self._any_fired = False
        self.armed_at = -1e9
        #: why the cluster was last found not whole, when the cell needs it whole
        self.not_whole = ""
        self.began = time.monotonic()
        self._mark = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.report.phases[phase] = round(now - self._mark, 2)
        self._mark = now

    # ------------------------------------------------------------------ workers

    def _journal(self, proc: Proc) -> list[dict]:
        records, _ = read_journal(str(self.folder / f"{proc.name}-{proc.pid}.jsonl"))
        return records

    def _all(self, op: str) -> bool:
        """Every live worker has journalled ``op`` in this cell (dead ones are replaced)."""
        self.m.replace_workers(self.k)
        return all(any(r.get("op") == op for r in self._journal(p))
                   for p in self.m.workers.values() if p.alive())

    def traffic(self, seconds: float) -> None:
        waited = time.monotonic()
        Cluster.wait(lambda: self._all("start"), 60, "the workers to start", interval=0.02)
        self.began = self._mark = self.ctx.started = time.monotonic()
        self.report.phases["ready"] = round(self.began - waited, 2)
        (self.folder / "go").touch()
        end = time.monotonic() + seconds
        next_look = 0.0
        # a cell that has not injected a fault yet runs on (up to EXTRA_S more)
        while time.monotonic() < end or (self.cell.injects and not self._fired()
                                          and time.monotonic() < end + self.EXTRA_S):
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 0.2
                self.m.replace_workers(self.k)
                replaced = self.cluster.heal()
                if replaced:
                    self.m.say(f"  {self.tag}: replaced {', '.join(replaced)}")
                self.arm(now)
            time.sleep(0.05)

    #: how long a cell may run past its time while none of its faults fired
    EXTRA_S = 8.0

    def _fired(self) -> bool:
        if self._any_fired or not self.rule_ids:
            return self._any_fired
        mine = [r for r in self.cluster.proxy.call("stats")["rules"] if r["id"] in self.rule_ids]
        self._any_fired = any(r["fired"] for r in mine)
        return self._any_fired

    def arm(self, now: float) -> None:
        cell = self.cell
        if self.rule_ids and (cell.once or not self._spent()):
            return
        if now - self.began < cell.first_after or now - self.armed_at < cell.period:
            return
        if cell.whole:
            self.not_whole = self.ctx.broken()
            if self.not_whole:
                return
        rules = cell.rules(self.ctx)
        if os.environ.get("KVPROTO_CHAOS_DEBUG"):
            self.m.say(f"  {self.tag}: arming {rules}")
        if not rules:
            return
        self.ctx.armed += 1
        self.armed_at = now
        self.rule_ids = []
        for n, spec in enumerate(rules):
            spec = dict(spec)
            ops = spec.get("ops", "any")
            ops = ops if isinstance(ops, str) else "+".join(ops)
            spec.setdefault("name", f"{cell.name}:{spec['action']}:{ops}")
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

    #: how long a worker may take to finish its call once told to stop (a
    #: loader also waits up to 3 s for its pool to settle); then it is
    #: killed (its operation's outcome is unknown, as with any kill)
    STOP_GRACE = 4.0

    def stop_workers(self) -> None:
        (self.folder / "stop").touch()
        for proc in self.m.workers.values():
            proc.signal(signal.SIGCONT)
        deadline = time.monotonic() + self.STOP_GRACE
        while time.monotonic() < deadline:
            if all(any(r.get("op") == "end" for r in self._journal(p))
                   for p in self.m.workers.values() if p.alive()):
                return
            time.sleep(0.02)
        for proc in self.m.workers.values():
            if not any(r.get("op") == "end" for r in self._journal(proc)):
                proc.signal(signal.SIGKILL)
                try:
                    proc.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass

    # ------------------------------------------------------------------ after

    def heal_network(self) -> None:
        """Count the faults injected, then heal: no more rules; the proxy
        delivers what it holds and resumes what it stopped."""
        proxy = self.cluster.proxy
        for name, n in proxy.call("clear")["fired"].items():
            self.report.faults_by[name.split(":", 1)[1]] += n
        self.report.faults = sum(self.report.faults_by.values())
        if self.cell.injects and not self.report.faults:
            self.report.note(f"no fault fired: armed {self.ctx.armed} time(s)"
                             + (f"; last found not whole: {self.not_whole}" if self.not_whole else ""))
        proxy.call("events")

    def quiesce(self) -> None:
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
                # the figure counts regions, attempts and segments, not bytes
                self.report.leaked = sum(v for k, v in self.report.leaks.items() if "bytes" not in k) or 1
                self.report.note(f"not quiescent: {self.report.leaks}")
                break
            time.sleep(0.1)
        self.mark("quiesce")
        self.read_back()
        self.mark("read back")

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

    #: past this fraction of the live capacity used, the keys of the cells
    #: already judged are removed (far below the master's eviction watermark)
    ROOM = 0.25

    def _final(self, c, prefix: str) -> Optional[dict]:
        """Every key of the cell read back and verified: key -> generation
        (or ``"wrong: ..."``); None if a master switch came in between (its
        misses would look like losses)."""
        before = self.cluster.master_stats(self.cluster.open_leader())
        switch_misses = c.failover_counters["switch_misses"]
        final: dict[str, object] = {}
        keys = c.keys(prefix=prefix)
        for at in range(0, len(keys), 256):
            chunk = keys[at:at + 256]
            for key, data in zip(chunk, c.get_many(chunk)):
                if data is not None:
                    gen, why = verify(key, data)
                    final[key.decode()] = gen if gen is not None else f"wrong: {why}"
        after = self.cluster.master_stats(self.cluster.open_leader())
        if before is None or after is None or c.failover_counters["switch_misses"] != switch_misses \
                or before["failover"]["term"] != after["failover"]["term"]:
            return None
        return final

    def read_back(self) -> None:
        """Read every key of the cell and judge; make room if the store fills."""
        from kvproto.errors import KvError
        history = History.load(str(self.folder), self.cell.duplicates)
        prefix = self.tag + "/"
        with self.client() as c:
            final: Optional[dict] = None
            deadline = time.monotonic() + 60
            while final is None and time.monotonic() < deadline:
                try:
                    final = self._final(c, prefix)
                except KvError:
                    final = None
                if final is None:
                    time.sleep(0.2)
            if final is None:
                self.report.settled = False
                self.report.note("the cell's keys could not be read back under one open master")
            placements = {k.decode(errors="replace"): v for k, v in
                          self.cluster.proxy.call("placements")["placements"].items()
                          if k.startswith(prefix.encode())}
            stats = self.cluster.master_stats() or {}
            live = {seg for seg, s in stats.get("segments", {}).items() if s.get("live")}
            judge(self.report, history, final, placements, live, prefix, self.cell.loses_loads)
            used, capacity = (sum(s.get(f, 0) for s in stats.get("segments", {}).values() if s.get("live"))
                              for f in ("used", "capacity"))
            if used > self.ROOM * capacity:
                # every key was judged: make room for the next cells
                try:
                    keys = c.keys()
                except KvError:
                    keys = []
                for key in keys:
                    try:
                        c.remove(key, force=True)
                    except KvError:
                        pass


# ---------------------------------------------------------------------- report

COLUMNS = [("cell", "cell", "<"), ("s", "seconds", ">"), ("ops", "operations", ">"),
           ("faults", "faults", ">"), ("verified", "verified", ">"), ("wrong", "wrong_bytes", ">"),
           ("acked lost", "acked_lost", ">"), ("with nodes", "lost_with_nodes", ">"),
           ("unexpl.", "unexplained", ">"), ("exc.", "exceptions", ">"), ("leaked", "leaked", ">"),
           ("written off", "buffers_written_off", ">"), ("trace steps", "trace_steps", ">"),
           ("trace fail", "trace_failures", ">"), ("result", None, "<")]


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


def total(reports: Iterable[Report]) -> Report:
    out = Report("total")
    for r in reports:
        out.add(r)
    return out


# ---------------------------------------------------------------------- command line

def add_arguments(parser) -> None:
    from kvproto.cli import _checked, _number
    parser.description = (
        "Run the fault matrix: writers, readers, storage nodes and two masters as separate "
        "processes behind a fault-injecting proxy; each cell injects one kind of fault at a "
        "chosen protocol phase. Every read is checked against what was acknowledged; after "
        "each cell the store must settle with nothing leaked. Prints a row per cell run and "
        "a table per cell at the end; exits 1 if any cell found wrong bytes, lost an "
        "acknowledged operation, leaked or (with --trace) recorded a step its spec does "
        "not allow.\n\n"
        "Cells: " + ", ".join(f"{c.name} ({c.about})" for c in CELLS.values()) + ".")

    def cells(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in CELLS]
        if unknown or not names:
            raise ValueError(f"unknown cell(s) {', '.join(map(repr, unknown)) or repr(text)}; "
                             f"known: {', '.join(CELLS)}")
        return names
    cells.__name__ = "cells"
    minutes = _checked(lambda text: _number(text))
    minutes.__name__ = "minutes"
    parser.add_argument("--minutes", type=minutes, default=1.0,
                        help="how long to run, cell after cell (a cell under way finishes)")
    parser.add_argument("--seconds", type=minutes, default=30.0,
                        help="seconds of traffic and faults per cell run")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--cells", type=_checked(cells), default=list(CELLS),
                        help="comma-separated cells to run (default: all)")
    parser.add_argument("--coordinator", default=None, metavar="URL",
                        help="etcd://host:port/prefix for the masters' election (default: an "
                             "embedded file:// coordinator in the work folder)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="folder for journals and logs (default: a temporary one, removed "
                             "unless --keep or a cell fails)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--trace", action="store_true",
                        help="record every master's and storage node's steps (each cell run on "
                             "a cluster of its own) and check them with TLC after the cell: "
                             "publish and lease per master, the first master merged with its "
                             "nodes where commands stay in order, failover on the nodes; a "
                             "trace the specs do not allow fails the cell")
    steps = _checked(lambda text: _number(text, int))
    steps.__name__ = "steps"
    parser.add_argument("--trace-steps", type=steps, default=1000, metavar="N",
                        help="with --trace: at most N steps per TLC run (the publish, lease "
                             "and merged checks walk a longer run in windows of N (master) "
                             "steps; default 1000)")
    parser.add_argument("--trace-windows", type=steps, default=None, metavar="N",
                        help="with --trace: at most N windows per publish, lease and merged check "
                             "(the line says where checking stopped; default: the whole run)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every figure per cell as JSON to PATH (default: none)")


def soak_traced(workdir: Path, minutes: float, cells: list[str], seconds: float, seed: int,
                log: Optional[TextIO], max_steps: int, max_windows: Optional[int] = None,
                **settings) -> dict[str, Report]:
    """:meth:`Matrix.soak` with tracing on (:func:`run_traced`)."""
    totals: dict[str, Report] = {}
    end = time.monotonic() + minutes * 60
    runs = 0
    while time.monotonic() < end:
        for report in run_traced(workdir, cells, seconds, seed, log, until=end, first=runs,
                                 max_steps=max_steps, max_windows=max_windows, **settings):
            totals.setdefault(report.cell, Report(report.cell)).add(report)
            runs += 1
    return totals


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(args) -> int:
    out = sys.stdout
    started = time.monotonic()
    # SIGTERM, and SIGINT even when started in the background (where it is
    # ignored), stop the run through the cleanup: every process it started ends
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    if args.coordinator is not None and not args.coordinator.startswith("etcd://"):
        print(f"kvproto chaos: --coordinator {args.coordinator!r}: give an etcd://host:port/prefix "
              "URL (the default is an embedded file:// coordinator)", file=sys.stderr)
        return 2
    matrix = Matrix(args.workdir, seed=args.seed, log=out, keep=True,
                    settings=Settings(coordinator=args.coordinator))
    print(f"kvproto chaos: {args.minutes:g} min, {args.seconds:g} s per cell, seed {args.seed}, "
          f"work folder {matrix.workdir}", file=out, flush=True)
    print("  ".join(h for h, _, _ in COLUMNS), file=out, flush=True)
    failed = False
    try:
        if args.trace:
            totals = soak_traced(matrix.workdir, args.minutes, args.cells, args.seconds, args.seed,
                                 out, args.trace_steps, args.trace_windows,
                                 coordinator=args.coordinator)
        else:
            with matrix:
                totals = matrix.soak(args.minutes, args.cells, args.seconds)
        reports = list(totals.values())
        failed = any(r.failed for r in reports)
        print(file=out)
        print(format_table(reports + [total(reports)]), file=out)
        for r in reports:
            for example in r.examples:
                print(f"  {r.cell}: {example}", file=out)
        print(f"{time.monotonic() - started:.0f} s" + ("; a cluster per cell run (--trace)" if args.trace
              else f"; workers replaced {matrix.worker_deaths}, servers replaced "
                   f"{matrix.cluster.replaced}"), file=out)
        if args.json is not None:
            args.json.write_text(json.dumps({r.cell: r.as_dict() for r in reports}, indent=1))
    finally:
        if args.workdir is None and not args.keep and not failed:
            shutil.rmtree(matrix.workdir, ignore_errors=True)
        elif failed:
            print(f"journals and logs kept in {matrix.workdir}", file=out)
    return 1 if failed else 0
