"""kvproto's Mooncake API (the shim's ``MooncakeDistributedStore``) against the
native kvproto ``Client``, in the same run on the same store, and against the
real Mooncake Store where it is installed.

    PYTHONPATH=. python bench/mooncake_compat.py [--repeat 9] [--count 256]

Each figure is the median over ``--repeat`` runs of ``--count`` puts (new keys)
or gets (of keys just put), one call per object, for 4 KiB and 1 MiB objects;
the native and shim runs take turns, and ratios are to the native kvproto API
measured in the same run (``get_into`` to native ``get``). kvproto runs a
master and one storage node as processes on loopback (as ``kvproto bench``);
Mooncake runs its master with its HTTP metadata server, and its store client
contributes its segment in this process (Mooncake's usual deployment, and
with TCP its only same-host one). ``get_into`` is the zero-copy form, into a
registered buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
import uuid

from kvproto.bench import _start_store, _stop
from kvproto.engines.mooncake import MooncakeDistributedStore
from kvproto.engines.mooncake_reference import ReferenceMaster, real_store
from kvproto.runtime.client import Client

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20}


def _rates(paths: dict, count: int, repeat: int, after=None) -> dict:
    """Median calls per second of each ``fn(i)`` in ``paths`` over ``repeat``
    runs of ``count`` calls; the paths take turns run by run, so load from
    elsewhere falls on all of them alike. ``after(name, r)`` runs, untimed,
    after run ``r`` of ``name``."""
    runs: dict = {name: [] for name in paths}
    for r in range(repeat + 1):                    # the first round warms up
        for name, fn in paths.items():
            t0 = time.perf_counter()
            for i in range(count):
                fn(r * count + i)
            if r:
                runs[name].append(count / (time.perf_counter() - t0))
            if after is not None:
                after(name, r)
    return {name: statistics.median(v) for name, v in runs.items()}


def _impl_paths(impl: str, api, size: int, count: int, repeat: int, ptr: int) -> dict:
    """put (new keys), get and, for a Mooncake API, get_into, of ``size`` bytes;
    reads go to the keys of the last put run (older runs' keys are dropped)."""
    value = bytes(range(256)) * (size // 256)
    tag = f"{impl}/{uuid.uuid4().hex[:8]}"

    def key(i):
        return f"{tag}/{repeat * count + i % count}"
    def drop(r):              # an earlier put run's keys (untimed), so no run fills the store
        for i in range(r * count, (r + 1) * count) if r < repeat else ():
            api.remove(f"{tag}/{i}")
    if impl == "native":
        return {"put": lambda i: api.put(f"{tag}/{i}", value), "get": lambda i: api.get(key(i)),
                "drop": drop}

    def put(i):
        assert api.put(f"{tag}/{i}", value) == 0

    def get_into(i):
        assert api.get_into(key(i), ptr, size) == size
    return {"put": put, "get": lambda i: api.get(key(i)), "get_into": get_into, "drop": drop}


def _measure(impls: dict, size: int, count: int, repeat: int) -> dict:
    """``{impl: {op: calls/s}}``: puts of all impls in turn, then their reads."""
    buf = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buf)
    paths = {impl: _impl_paths(impl, api, size, count, repeat, ptr) for impl, api in impls.items()}
    for impl, api in impls.items():
        if impl != "native":
            assert api.register_buffer(ptr, size) == 0
    try:
        puts = _rates({impl: p["put"] for impl, p in paths.items()}, count, repeat,
                      after=lambda impl, r: paths[impl]["drop"](r))
        reads = _rates({(impl, op): fn for impl, p in paths.items() for op, fn in p.items()
                        if op not in ("put", "drop")}, count, repeat)
    finally:
        for impl, api in impls.items():
            if impl != "native":
                api.unregister_buffer(ptr)
    out = {impl: {"put": puts[impl]} for impl in impls}
    for (impl, op), rate in reads.items():
        out[impl][op] = rate
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--count", type=int, default=256)
    args = parser.parse_args(argv)
    segment = 1 << 30                # each put run's keys are removed after the next run
    rows: dict = {}
    procs, address = _start_store(str(segment))
    try:
        with Client(address) as client:
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", "", 0, 0, "tcp", "", address) == 0
            for name, size in SIZES.items():
                for impl, r in _measure({"native": client, "shim": store}, size, args.count,
                                        args.repeat).items():
                    rows[(impl, name)] = r
            store.close()
    finally:
        _stop(procs)
    module, why = real_store()
    if module is not None:
        with ReferenceMaster() as master:
            store = module.MooncakeDistributedStore()
            if store.setup(master.setup_config(segment, 64 << 20)) == 0:
                for name, size in SIZES.items():
                    rows[("mooncake", name)] = _measure({"mooncake": store}, size, args.count,
                                                        args.repeat)["mooncake"]
                store.close()
            else:
                why = "its store did not set up"
    print(f"Mooncake API on kvproto vs native kvproto (medians of {args.repeat} runs of "
          f"{args.count} calls; calls/s; ratio to native in the same run)")
    for name in SIZES:
        native = rows[("native", name)]
        for impl in ("native", "shim", "mooncake"):
            r = rows.get((impl, name))
            if r is None:
                continue
            cells = "   ".join(f"{op} {r[op]:9,.0f} ({r[op] / native[op if op != 'get_into' else 'get']:4.2f})"
                               for op in r)
            print(f"  {name:>6} {impl:>8}: {cells}")
    if module is None:
        print(f"  (no Mooncake row: {why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
