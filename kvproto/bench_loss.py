"""``kvproto bench --only segment-loss``: what losing a large segment costs the master.

A :class:`~kvproto.runtime.master.MasterCore` (no sockets) holds ``objects``
published 4 KiB objects (24-byte keys) on three segments, as a takeover
builds its tables (``DirectoryCore.from_columns``, ``LeaseCore.inherit``,
past the quiet period), with read leases held on a thousand of them; each
object has one replica on ``seg-0``, or two replicas (``seg-0`` and
``seg-1``). Then ``seg-0`` is lost (``segment_lost``: the directory's
``SegmentLost`` and everything the master does with its effects, the lease
table's drops included) and the master's next ``tick`` runs (it rescans the
objects below their replica count and starts repairs). Reported: objects on
the lost segment per second, and the longest of the two calls, which is the
longest the serving loop cannot turn; next to the raw baseline measured in
the same run: deleting the same keys from a plain dict of all keys (what
forgetting them costs at the least).

With tenants (a third line): the same with a master started with a tenants
file, its objects in one tenant's namespace and known to the tenancy
machine as a takeover leaves them (``Tenants.recovered``), a thousand of them
read; after the loss the master's loop turns (``tick``) until the tenants'
accounting of the lost objects is carried out. Reported: how long until it
is, in how many turns, and the longest single call.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np

PAGE = 4096
SEGMENTS = ("seg-0", "seg-1", "seg-2")
LEASED = 1000


TENANT = "bench"
NAMESPACE = (TENANT, "default")


def _master(objects: int, replicas: int, clock, tenants: bool = False):
    """A master holding ``objects`` published objects, each with ``replicas``
    replicas (on ``seg-0``, then ``seg-1``), and read leases on some;
    ``tenants``: in the namespace of a tenant, with reads of the tenant."""
    from kvproto.cores.directory import DirectoryCore
    from kvproto.cores.leases import LeaseCore
    from kvproto.ops.tenants import object_key, parse_tenants
    from kvproto.runtime.master import MasterCore
    from kvproto.statemachines import lease as L, tenancy as tm

    configs = parse_tenants({"tenants": {TENANT: {"tokens": ["segment-loss-bench-token"]}}}) \
        if tenants else ()
    master = MasterCore(writer_timeout=60.0, storage_timeout=60.0, clock=clock, tenants=configs)
    capacity = objects * PAGE
    for segment in SEGMENTS:
        status, _ = master.handle("register", {
            "segment": segment, "capacity": capacity, "endpoint": "tcp://127.0.0.1:1",
            "host": "bench", "shm": "s", "gen_shm": "g", "nonce": 1, "page_size": PAGE})
        assert status == 0
    prefix = object_key(NAMESPACE, b"") if tenants else b""
    keys = b"".join(prefix + b"segloss-%016d" % i for i in range(objects))
    offsets = np.arange(objects + 1, dtype=np.int64) * (24 + len(prefix))
    rsegs = np.broadcast_to(np.arange(replicas, dtype=np.int64), (objects, replicas))
    roffs = np.broadcast_to((np.arange(objects, dtype=np.int64) * PAGE)[:, None],
                            (objects, replicas))
    master.directory = DirectoryCore.from_columns(
        {s: capacity for s in SEGMENTS}, list(SEGMENTS), keys, offsets,
        np.arange(1, objects + 1, dtype=np.int64), np.full(objects, PAGE, np.int64),
        rsegs, roffs, next_token=1)
    master.leases = LeaseCore.inherit(master.directory, master.leases.ttl, clock(), quiet=0)
    if tenants:
        master.tenants.recovered(*master.directory.requested_bytes())
    for i in range(0, objects, max(1, objects // LEASED)):
        err, _ = master._lstep(L.Grant(("bench", i), prefix + b"segloss-%016d" % i))
        assert err is None, err
        if tenants:
            master.tenants.commit(tm.Begin(("bench", i), TENANT, NAMESPACE, b"segloss-%016d" % i))
    master.tick()
    return master


def _once(objects: int, replicas: int, tenants: bool = False) -> dict:
    now = [1000.0]
    master = _master(objects, replicas, lambda: now[0], tenants)
    t0 = time.perf_counter()
    master.segment_lost("seg-0", "deregistered")
    t1 = time.perf_counter()
    now[0] += 10.0
    master.tick()
    t2 = time.perf_counter()
    turns, longest = 1, max(t1 - t0, t2 - t1)
    while getattr(master, "_tenant_drops", None):   # the tenants' accounting, a slice a turn
        t = time.perf_counter()
        master.tick()
        turns, longest = turns + 1, max(longest, time.perf_counter() - t)
    settled = time.perf_counter() - t0
    left = 0 if replicas == 1 else objects
    if len(master.directory.objects) != left or len(master.leases.objects) != left:
        raise RuntimeError(f"after the loss: {len(master.directory.objects)} objects, "
                           f"{len(master.leases.objects)} cached; expected {left}")
    if tenants and len(master.tenants.registry.state.objects) != left:
        raise RuntimeError(f"after the loss: the tenants hold "
                           f"{len(master.tenants.registry.state.objects)} objects; "
                           f"expected {left}")
    lost = [b"segloss-%016d" % i for i in range(objects)]
    index = dict(zip(lost, range(objects)))
    t3 = time.perf_counter()
    deque(map(index.pop, lost), 0)
    t4 = time.perf_counter()
    return {"lost_s": t1 - t0, "tick_s": t2 - t1, "raw_s": t4 - t3, "settled_s": settled,
            "turns": turns, "longest_s": longest}


def segment_loss_bench(objects: int, replicas: int, repeat: int = 3,
                       tenants: bool = False) -> dict:
    """Medians over ``repeat`` fresh masters (see the module docstring)."""
    runs = [_once(objects, replicas, tenants) for _ in range(repeat)]
    lost = statistics.median(r["lost_s"] for r in runs)
    pause = statistics.median(max(r["lost_s"], r["tick_s"]) for r in runs)
    raw = statistics.median(r["raw_s"] for r in runs)
    return {"objects": objects, "replicas": replicas, "lost_s": lost,
            "tick_s": statistics.median(r["tick_s"] for r in runs), "pause_s": pause,
            "objects_s": objects / lost, "raw_objects_s": objects / raw,
            "settled_s": statistics.median(r["settled_s"] for r in runs),
            "turns": statistics.median(r["turns"] for r in runs),
            "longest_s": statistics.median(r["longest_s"] for r in runs)}


def report(objects: int, repeat: int) -> None:
    print(f"\nsegment loss: {objects:,} objects (4 KiB, 24-byte keys, {LEASED} of them leased) "
          f"with a replica on the lost segment; medians of {repeat} fresh masters")
    for replicas in (1, 2):
        r = segment_loss_bench(objects, replicas, repeat)
        what = "its only replica" if replicas == 1 else "one of 2 replicas"
        ratio = r["objects_s"] / r["raw_objects_s"]
        print(f"  {what:>17}: segment_lost {r['lost_s'] * 1e3:8.1f} ms "
              f"({r['objects_s']:12,.0f} objects/s; raw dict deletes "
              f"{r['raw_objects_s']:12,.0f}/s, ratio {ratio:.2f})   "
              f"next tick {r['tick_s'] * 1e3:7.1f} ms   longest pause {r['pause_s'] * 1e3:8.1f} ms")
    r = segment_loss_bench(objects, 1, repeat, tenants=True)
    print(f"  {'with tenants':>17}: segment_lost {r['lost_s'] * 1e3:8.1f} ms "
          f"({r['objects_s']:12,.0f} objects/s); the tenants' accounting settled after "
          f"{r['settled_s'] * 1e3:8.1f} ms in {r['turns']:g} turn(s) of the loop "
          f"({objects / r['settled_s']:12,.0f} objects/s; raw dict deletes "
          f"{r['raw_objects_s']:12,.0f}/s, ratio {objects / r['settled_s'] / r['raw_objects_s']:.2f})"
          f"   longest pause {r['longest_s'] * 1e3:8.1f} ms")
