"""The fast cores (kvproto/cores) against their reference machines, same run.

    PYTHONPATH=. python bench/cores.py [--objects 1000000] [--memory 1000000,10000000]
                                       [--only steps,memory,rebuild,pool] [--blocks 2048]
                                       [--json out.json]

``steps``: time per step in a tight loop with no I/O, on a master holding
``--objects`` published objects (2 replicas, 24-byte keys): PutStart+PutEnd of
a new key, ReadBegin of a random published key, and the lease table's
Tick+Put (caching an object just published), for the reference machines
(``publish.master_step``, ``lease.master_step`` on frozen values) and for the
cores (``DirectoryCore``/``LeaseCore`` on shared rows); events are built
before the timed loop; median of ``--repeat`` rounds of ``--steps`` steps
(the reference: a tenth as many), with the ratio. A plain dict store/lookup of
the key is the floor.

``memory``: bytes per published object, as the growth of a process's resident
set while it fills a master (directory + lease table + recency, on shared
rows) with N objects, one subprocess per figure; next to a dict of the same
keys to row ints (the floor), and the time of one full garbage collection
with the master filled (no ``gc.freeze``). ``stepped``: through PutStart,
PutEnd and the lease table's Put per object; ``restored``: in bulk.

``rebuild``: objects per second restored from columns (numpy columns and a
keys blob with offsets, as a columnar index frame decodes):
``DirectoryCore.from_columns`` then ``LeaseCore.inherit``, against the
reference ``publish.restored`` + ``lease.restored_table`` fed the same
objects (a tenth as many, scaled), and against the floor: a dict of the keys
sliced from the blob to row ints, nothing else.

``pool``: time per block of a copy unit's life in the client's pool (a
request holding ``--blocks`` of twice as many blocks): ``Acquire``, ``Issue``
(one unit), ``Complete``, ``Consume``, ``Release`` of every block, on
``PoolCore`` (a run of blocks in one ``step_all``; completions one by one, as
the copier observes them) and on the reference (``timeout.pool_step`` per
event, as the runtime stepped it before); median of ``--repeat`` rounds. A
plain dict store per block is the floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.pool import PoolCore
from kvproto.statemachines import lease as L, publish as P, timeout as T

SIZE = 4096
TTL = 5.0
SEGMENTS = ("s0", "s1")
CAPACITIES = {s: 1 << 60 for s in SEGMENTS}


def key_of(i: int) -> bytes:
    return b"prefix/%017d" % i                     # 24 bytes


def columns(n: int, start: int = 0) -> dict:
    """``n`` objects on both segments, as :meth:`DirectoryCore.from_columns` takes them."""
    keys = b"".join(key_of(i) for i in range(start, start + n))
    offsets = np.arange(start, start + n, dtype=np.int64) * SIZE
    return dict(segments=list(SEGMENTS), keys=keys,
                key_offsets=np.arange(n + 1, dtype=np.int64) * 24,
                tokens=np.arange(start + 1, start + n + 1, dtype=np.int64),
                lengths=np.full(n, SIZE, np.int64),
                replica_segments=np.tile(np.array([[0, 1]], np.int64), (n, 1)),
                replica_offsets=np.stack([offsets, offsets], 1))


def objects(n: int):
    """The same objects as ``(key, token, length, replicas)`` for the reference."""
    for i in range(n):
        yield (key_of(i), i + 1, SIZE,
               tuple(P.Replica(s, i * SIZE, SIZE) for s in SEGMENTS))


def core_master(n: int) -> tuple[DirectoryCore, LeaseCore]:
    directory = DirectoryCore.from_columns(CAPACITIES, **columns(n), next_token=n + 1)
    return directory, LeaseCore.inherit(directory, TTL, 0.0, quiet=0.0)


def reference_master(n: int) -> tuple[P.Directory, L.LeaseTable]:
    directory = P.restored(CAPACITIES, objects(n), n + 1)
    table = L.restored_table(TTL, 0.0, ((key_of(i), (key_of(i), i + 1), 2 * SIZE)
                                        for i in range(n)), quiet=0.0)
    return directory, table


# --------------------------------------------------------------------------
# Step times
# --------------------------------------------------------------------------


def _put_events(first: int, count: int, next_token: int) -> list:
    events = []
    for i in range(first, first + count):
        key = key_of(i)
        events.append(P.PutStart(key, SIZE, tuple(P.Replica(s, i * SIZE, SIZE) for s in SEGMENTS)))
        events.append(P.PutEnd(key, next_token + i - first))
    return events


def _lease_events(first: int, count: int, next_token: int, now: float) -> list:
    events = []
    for i in range(first, first + count):
        key = key_of(i)
        events.append(L.Tick(now + (i - first + 1) * 1e-6))
        events.append(L.Put(key, (key, next_token + i - first), 2 * SIZE))
    return events


def _per_step(run, events: list, per: int) -> float:
    """Seconds per ``per`` events of ``events`` run by ``run``."""
    t = time.perf_counter()
    run(events)
    return (time.perf_counter() - t) / (len(events) / per)


def step_bench(n: int, steps: int, repeat: int) -> list[dict]:
    rng = np.random.default_rng(1)
    results: dict = {}

    def record(name: str, side: str, seconds: float) -> None:
        results.setdefault(name, {}).setdefault(side, []).append(seconds)

    for side in ("core", "reference"):
        gc.collect()
        count = steps if side == "core" else max(1, steps // 10)
        if side == "core":
            directory, leases = core_master(n)
            floor: dict = dict.fromkeys((key_of(i) for i in range(n)), 0)
        else:
            ref_dir, ref_leases = reference_master(n)
        first = n
        for _ in range(repeat):
            if side == "core":
                token, now = directory.next_token, leases.now
            else:
                token, now = ref_dir.next_token, ref_leases.now
            puts = _put_events(first, count, token)
            leased = _lease_events(first, count, token, now)
            reads = [P.ReadBegin(key_of(int(i))) for i in rng.integers(0, n, count)]
            if side == "core":
                def put(events, step=directory.step):
                    for ev in events:
                        step(ev)
                def lput(events, step=leases.step):
                    for ev in events:
                        step(ev)
                record("PutStart+PutEnd", side, _per_step(put, puts, 2))
                record("ReadBegin", side, _per_step(put, reads, 1))
                record("lease Tick+Put", side, _per_step(lput, leased, 2))
                keys = [ev.key for ev in reads]
                new = [key_of(i) for i in range(first, first + count)]

                def store(ks):
                    for k in ks:
                        floor[k] = 1

                def lookup(ks, get=floor.get):
                    for k in ks:
                        get(k)
                record("PutStart+PutEnd", "dict", _per_step(store, new, 1))
                record("ReadBegin", "dict", _per_step(lookup, keys, 1))
            else:
                def run(events, state, step):
                    for ev in events:
                        state, _ = step(state, ev)
                    return state
                box = {}

                def put(events):
                    box["d"] = run(events, ref_dir, P.master_step)
                record("PutStart+PutEnd", side, _per_step(put, puts, 2))
                ref_dir = box["d"]

                def read(events):
                    box["d"] = run(events, ref_dir, P.master_step)
                record("ReadBegin", side, _per_step(read, reads, 1))
                ref_dir = box["d"]

                def lput(events):
                    box["l"] = run(events, ref_leases, L.master_step)
                record("lease Tick+Put", side, _per_step(lput, leased, 2))
                ref_leases = box["l"]
            first += count
        if side == "core":
            del directory, leases, floor
        else:
            del ref_dir, ref_leases
    rows = []
    for name, sides in results.items():
        med = {side: statistics.median(v) * 1e6 for side, v in sides.items()}
        rows.append({"step": name, "objects": n, "core_us": med["core"],
                     "reference_us": med["reference"], "dict_us": med.get("dict"),
                     "speedup": med["reference"] / med["core"]})
    return rows


# --------------------------------------------------------------------------
# Memory per object
# --------------------------------------------------------------------------

_MEMORY = r"""
import gc, resource, sys, time
sys.path.insert(0, sys.argv[3])
from bench.cores import CAPACITIES, SEGMENTS, SIZE, TTL, core_master, key_of
from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.pool import PoolCore
from kvproto.statemachines import lease as L, publish as P, timeout as T

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

n, how = int(sys.argv[1]), sys.argv[2]
gc.collect()
before = rss()
if how == "dict":
    held = dict((key_of(i), i) for i in range(n))
elif how == "restored":
    held = core_master(n)
else:
    directory = DirectoryCore()
    leases = LeaseCore(TTL, rows=directory.rows)
    for s in SEGMENTS:
        directory.step(P.AddSegment(s, CAPACITIES[s]))
    step, lstep, Replica = directory.step, leases.step, P.Replica
    for i in range(n):
        key = key_of(i)
        granted = step(P.PutStart(key, SIZE, (Replica("s0", i * SIZE, SIZE),
                                              Replica("s1", i * SIZE, SIZE))))[0]
        step(P.PutEnd(key, granted.token))
        lstep(L.Put(key, (key, granted.token), 2 * SIZE))
    held = directory, leases
grown = rss() - before
t = time.perf_counter()
gc.collect()
print(grown / n, time.perf_counter() - t)
"""


def memory_per_object(n: int, how: str) -> tuple[float, float]:
    """(bytes per object, seconds of one full collection) in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["nice", sys.executable, "-c", _MEMORY, str(n), how, root],
                         check=True, capture_output=True, text=True)
    per, gc_s = out.stdout.split()
    return float(per), float(gc_s)


def memory_bench(sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        floor, floor_gc = memory_per_object(n, "dict")
        for how in ("restored", "stepped"):
            per, gc_s = memory_per_object(n, how)
            rows.append({"objects": n, "how": how, "bytes_per_object": per,
                         "dict_floor": floor, "ratio_to_floor": per / floor,
                         "full_gc_ms": gc_s * 1e3, "floor_full_gc_ms": floor_gc * 1e3})
    return rows


# --------------------------------------------------------------------------
# Rebuild
# --------------------------------------------------------------------------


def rebuild_bench(n: int, repeat: int) -> dict:
    frame = columns(n)
    core_s, floor_s = [], []
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        directory = DirectoryCore.from_columns(CAPACITIES, **frame, next_token=1)
        leases = LeaseCore.inherit(directory, TTL, 0.0)
        core_s.append(time.perf_counter() - t)
        assert directory.count == leases.count == n
        del directory, leases
        gc.collect()
        t = time.perf_counter()
        blob = frame["keys"]
        floor = dict(zip([blob[i:i + 24] for i in range(0, 24 * n, 24)], range(n)))
        floor_s.append(time.perf_counter() - t)
        del floor
    gc.collect()
    ref_n = max(1, n // 10)
    listed = list(objects(ref_n))
    t = time.perf_counter()
    ref = P.restored(CAPACITIES, listed, 1)
    L.restored_table(TTL, 0.0, [(k, (k, r.token), r.length * len(r.replicas))
                                for k, r in ref.objects.items()])
    ref_s = (time.perf_counter() - t) / ref_n * n
    core, floor = statistics.median(core_s), statistics.median(floor_s)
    return {"objects": n, "core_objects_per_s": n / core, "reference_objects_per_s": n / ref_s,
            "dict_objects_per_s": n / floor, "speedup": ref_s / core}


def pool_bench(blocks: int, repeat: int) -> list[dict]:
    """Per block: each phase of a copy unit's life, core against reference."""
    names = [f"blk{i}" for i in range(2 * blocks)]
    mine = names[:blocks]
    phases = {
        "acquire": [T.Acquire("g", b) for b in mine],
        "issue": [T.Issue("g", b) for b in mine],
        "complete": [T.Complete(g, b) for g, b in enumerate(mine, start=1)],
        "consume": [T.Consume("g", b) for b in mine],
        "release": [T.Release("g", b) for b in mine],
    }
    times: dict = {(phase, side): [] for phase in phases for side in ("core", "reference")}
    for _ in range(repeat):
        core = PoolCore(names)
        core.step(T.StartRequest("g"))
        for phase, events in phases.items():
            t0 = time.perf_counter()
            if phase == "complete":
                for ev in events:
                    core.step(ev)
            else:
                core.step_all(events)
            times[(phase, "core")].append(time.perf_counter() - t0)
        ref, _ = T.pool_step(T.new_pool(names), T.StartRequest("g"))
        for phase, events in phases.items():
            t0 = time.perf_counter()
            for ev in events:
                ref, _ = T.pool_step(ref, ev)
            times[(phase, "reference")].append(time.perf_counter() - t0)
        assert core.reference() == ref
    floor: list = []
    for _ in range(repeat):
        d: dict = {}
        t0 = time.perf_counter()
        for b in mine:
            d[b] = 1
        floor.append(time.perf_counter() - t0)
    dict_us = statistics.median(floor) / blocks * 1e6
    rows = []
    for phase in phases:
        core_us = statistics.median(times[(phase, "core")]) / blocks * 1e6
        ref_us = statistics.median(times[(phase, "reference")]) / blocks * 1e6
        rows.append({"phase": phase, "blocks": blocks, "core_us": core_us, "reference_us": ref_us,
                     "speedup": ref_us / core_us, "dict_us": dict_us})
    return rows


# --------------------------------------------------------------------------

SECTIONS = ("steps", "memory", "rebuild", "pool")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--memory", default="1000000,10000000",
                        help="object counts for the memory figures, comma-separated")
    parser.add_argument("--blocks", type=int, default=2048, help="blocks of the pool figures' copy unit")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        print(f"--only takes {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    out: dict = {}
    if "steps" in only:
        out["steps"] = step_bench(args.objects, args.steps, args.repeat)
        print(f"step time at {args.objects:,} objects (median of {args.repeat}):")
        for r in out["steps"]:
            floor = f"  dict {r['dict_us']:.2f} us" if r["dict_us"] else ""
            print(f"  {r['step']:<16} core {r['core_us']:6.2f} us  reference {r['reference_us']:7.1f} us"
                  f"  x{r['speedup']:.0f}{floor}")
    if "rebuild" in only:
        out["rebuild"] = r = rebuild_bench(args.objects, 3)
        print(f"rebuild of {r['objects']:,} objects from columns: core {r['core_objects_per_s']:,.0f}/s"
              f", reference {r['reference_objects_per_s']:,.0f}/s, x{r['speedup']:.0f}"
              f" (a dict of the keys alone from the blob: {r['dict_objects_per_s']:,.0f}/s)")
    if "pool" in only:
        out["pool"] = pool_bench(args.blocks, args.repeat)
        print(f"client pool, per block of a {args.blocks}-block copy unit (median of {args.repeat}):")
        for r in out["pool"]:
            print(f"  {r['phase']:<9} core {r['core_us']:6.2f} us  reference {r['reference_us']:8.1f} us"
                  f"  x{r['speedup']:.0f}  dict store {r['dict_us']:.2f} us")
    if "memory" in only:
        out["memory"] = memory_bench([int(x) for x in args.memory.split(",")])
        print("memory per published object (directory + lease table + recency):")
        for r in out["memory"]:
            print(f"  {r['objects']:>11,} {r['how']:<8} {r['bytes_per_object']:6.1f} B"
                  f"  (dict of the keys: {r['dict_floor']:.1f} B, x{r['ratio_to_floor']:.2f})"
                  f"  full gc {r['full_gc_ms']:.1f} ms (with the dict: {r['floor_full_gc_ms']:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
