"""``kvproto bench --only rebuild``, its second part: a takeover with tenants.

The failover rebuild of :func:`kvproto.bench.rebuild_bench` (four storage
nodes fence a new master; ``objects`` published 4 KiB objects, one replica
each), run ``repeat`` times without tenants and with a tenants file (the
objects in one tenant's namespace: the new master's registry takes them as
published, ``Tenants.recovered``), interleaved. Reported, medians: objects/s
of each takeover, and the registry's part alone (seconds and objects/s) next
to the raw baseline measured in the same run: a dict of the recovered keys
built from their list (one dict entry per object, what the registry's load
costs at the least).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

TENANT = "bench"
PAGE = 4096


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


def takeover_bench(objects: int, repeat: int, rebuild: Callable[..., dict]) -> dict:
    """Medians over ``repeat`` interleaved runs (see the module docstring);
    ``rebuild``: :func:`kvproto.bench.rebuild_bench`."""
    from kvproto.ops.tenants import parse_tenants
    configs = parse_tenants({"tenants": {TENANT: {"tokens": ["takeover-bench-token"]}}})
    plain, tenanted, raw = [], [], []
    for _ in range(repeat):
        plain.append(rebuild(objects))
        gc.collect()
        r = rebuild(objects, tenants=configs)
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


def report(objects: int, repeat: int, rebuild: Callable[..., dict]) -> None:
    r = takeover_bench(objects, repeat, rebuild)
    n = r["objects"]
    load, raw = n / r["tenants_s"], n / r["raw_s"]
    print(f"  with tenants ({n:,} objects in one tenant's namespace; medians of {repeat} "
          f"interleaved runs): takeover {n / r['tenants_total_s']:,.0f} objects/s "
          f"(without tenants {n / r['plain_s']:,.0f}); the registry's load "
          f"{r['tenants_s'] * 1e3:.0f} ms ({load:,.0f} objects/s; raw dict of the keys "
          f"{raw:,.0f}/s, ratio {load / raw:.2f})")
