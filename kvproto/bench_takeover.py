"""``kvproto bench --only rebuild``: a new master's takeover in process.

:func:`rebuild_bench`: storage nodes fence a new master, which decodes
their indexes, rebuilds its tables and opens. :func:`report`, a takeover
with tenants: the rebuild (four nodes, ``objects`` published 4 KiB objects,
one replica each) run ``repeat`` times without tenants and with a tenants
file (the objects in one tenant's namespace: the new master's registry
takes them as published, ``Tenants.recovered``), interleaved. Reported, medians: objects/s
of each takeover, and the registry's part alone (seconds and objects/s) next
to the raw baseline measured in the same run: a dict of the recovered keys
built from their list (one dict entry per object, what the registry's load
costs at the least).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

TENANT = "bench"
PAGE = 4096


def rebuild_bench(objects: int, nodes: int = 4, replicas: int = 1, tenants: Sequence = ()) -> dict:
    """A new master fenced by ``nodes`` storage nodes holding ``objects``
    published 4 KiB objects, each on ``replicas`` of them: the nodes'
    ``fence`` replies (encoding the index), then the master's decode,
    ``Recover`` (rebuild), allocator and lease tables, and ``Open``. Returns
    seconds per stage and objects/s. With ``tenants`` (tenant configs): a
    master started with them, the objects in the first one's ``default``
    namespace; ``tenants_s``: the registry's part (``Tenants.recovered``)."""
    from kvproto.ops.tenants import object_key
    from kvproto.runtime import wire
    from kvproto.runtime.master import MasterCore
    from kvproto.runtime.shm import SegmentMemory
    from kvproto.runtime.storage import StorageCore
    from kvproto.statemachines import failover as fm

    per = objects * replicas // nodes       # entries per node
    page = 4096
    capacity = per * page
    cores, memories = {}, []
    prefix = object_key((tenants[0].name, "default"), b"") if tenants else b""
    for n in range(nodes):
        memory = SegmentMemory(page, page)   # the bytes are not what is measured
        memories.append(memory)
        segment = f"node{n}"
        core = StorageCore(memory, segment)
        step = core.node.step
        step(fm.Fence(1))
        group = n // replicas                # the nodes of a group hold the same objects
        for i in range(per):
            key = prefix + f"key-{group}-{i:09d}".encode()
            step(fm.StampedAllocate(segment, key, 1, i * page, page, group * per + i + 1))
            step(fm.StampedPublish(segment, key, 1))
        cores[segment] = core
    try:
        master = MasterCore(term=None, fence_timeout=600.0, tenants=tenants)
        loaded = [0.0]
        if tenants:       # the registry's part of the takeover, timed alone
            recovered = master.tenants.recovered

            def timed(*recovery) -> None:
                t = time.perf_counter()
                recovered(*recovery)
                loaded[0] += time.perf_counter() - t
            master.tenants.recovered = timed
        master.take_term(2, {s: f"tcp://127.0.0.1:{9000 + i}" for i, s in enumerate(cores)})
        sent = {body["segment"]: cmd_id for _, op, cmd_id, body in master.outbox if op == "fence"}
        t0 = time.perf_counter()
        replies = []
        for segment, core in cores.items():
            body, frames = core.handle("fence", {"segment": segment, "term": 2}, [])
            body = {**body, "segment": segment, "capacity": capacity, "endpoint": "tcp://127.0.0.1:1",
                    "host": "h", "shm": "s", "gen_shm": "g", "nonce": 1, "page_size": page}
            replies.append((segment, wire.Reply(0, sent[segment], body, [memoryview(f) for f in frames])))
        t1 = time.perf_counter()
        for segment, reply in replies:
            master.storage_reply(segment, reply)
        t2 = time.perf_counter()
        listed = per * nodes // replicas
        if master.failover.phase is not fm.Phase.OPEN or len(master.directory.objects) != listed:
            raise RuntimeError(f"rebuild incomplete: {master.failover.phase}, {len(master.directory.objects)}")
    finally:
        for m in memories:
            m.close()
    return {"objects": listed, "encode_s": t1 - t0, "rebuild_s": t2 - t1,
            "objects_s": listed / (t2 - t0), "tenants_s": loaded[0],
            "held": len(master.tenants.registry.state.objects) if tenants else 0,
            "last": master.last_failover}


def _raw(objects: int) -> float:
    """Seconds to build a dict of ``objects`` directory keys from their list."""
    from kvproto.ops.tenants import object_key
    keys = [object_key((TENANT, "default"), b"key-0-%09d" % i) for i in range(objects)]
    sizes = [PAGE] * objects
    t = time.perf_counter()
    table = dict(zip(keys, sizes))
    took = time.perf_counter() - t
    assert len(table) == objects
    return took


def takeover_bench(objects: int, repeat: int) -> dict:
    """Medians over ``repeat`` interleaved runs (see the module docstring)."""
    from kvproto.ops.tenants import parse_tenants
    configs = parse_tenants({"tenants": {TENANT: {"tokens": ["takeover-bench-token"]}}})
    plain, tenanted, raw = [], [], []
    for _ in range(repeat):
        plain.append(rebuild_bench(objects))
        gc.collect()
        r = rebuild_bench(objects, tenants=configs)
        held = r.pop("held")
        if held != r["objects"]:
            raise RuntimeError(f"the registry holds {held} of {r['objects']} recovered objects")
        tenanted.append(r)
        gc.collect()
        raw.append(_raw(objects))
    med = statistics.median
    listed = plain[0]["objects"]
    return {"objects": listed,
            "plain_s": med(r["encode_s"] + r["rebuild_s"] for r in plain),
            "tenants_total_s": med(r["encode_s"] + r["rebuild_s"] for r in tenanted),
            "tenants_s": med(r["tenants_s"] for r in tenanted),
            "raw_s": med(raw)}


def report(objects: int, repeat: int) -> None:
    r = takeover_bench(objects, repeat)
    n = r["objects"]
    load, raw = n / r["tenants_s"], n / r["raw_s"]
    print(f"  with tenants ({n:,} objects in one tenant's namespace; medians of {repeat} "
          f"interleaved runs): takeover {n / r['tenants_total_s']:,.0f} objects/s "
          f"(without tenants {n / r['plain_s']:,.0f}); the registry's load "
          f"{r['tenants_s'] * 1e3:.0f} ms ({load:,.0f} objects/s; raw dict of the keys "
          f"{raw:,.0f}/s, ratio {load / raw:.2f})")
