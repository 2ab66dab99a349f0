"""kvproto's Mooncake API (the shim's ``MooncakeDistributedStore``) against the
native kvproto ``Client``, in the same run on the same store, and against the
real Mooncake Store where it is installed.

    PYTHONPATH=. python bench/mooncake_compat.py [--repeat 9] [--count 256]

Each figure is the median over ``--repeat`` runs of ``--count`` puts (new keys)
or gets (of keys just put), one call per object, for 4 KiB and 1 MiB objects;
ratios are to the native kvproto API measured in the same run. kvproto runs a
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


def _rate(fn, count: int, repeat: int) -> float:
    """Median calls per second of ``fn(i)`` over ``repeat`` runs of ``count`` calls."""
    runs = []
    for r in range(repeat + 1):                    # the first run warms up
        t0 = time.perf_counter()
        for i in range(count):
            fn(r * count + i)
        if r:
            runs.append(count / (time.perf_counter() - t0))
    return statistics.median(runs)


def _paths(put, get, get_into, size: int, count: int, repeat: int) -> dict:
    value = bytes(range(256)) * (size // 256)
    tag = uuid.uuid4().hex[:8]
    out = {"put": _rate(lambda i: put(f"{tag}/{i}", value), count, repeat)}
    out["get"] = _rate(lambda i: get(f"{tag}/{i % count}"), count, repeat)
    if get_into is not None:
        out["get_into"] = _rate(lambda i: get_into(f"{tag}/{i % count}"), count, repeat)
    return out


def _store_paths(store, size: int, count: int, repeat: int) -> dict:
    buf = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, size) == 0

    def put(k, v):
        assert store.put(k, v) == 0

    def get_into(k):
        assert store.get_into(k, ptr, size) == size
    try:
        return _paths(put, store.get, get_into, size, count, repeat)
    finally:
        store.unregister_buffer(ptr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--count", type=int, default=256)
    args = parser.parse_args(argv)
    segment = max(SIZES.values()) * args.count * (args.repeat + 2) * 2
    rows: dict = {}
    procs, address = _start_store(str(segment))
    try:
        with Client(address) as client:
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", "", 0, 0, "tcp", "", address) == 0
            for name, size in SIZES.items():
                rows[("native", name)] = _paths(client.put, client.get, None, size, args.count, args.repeat)
                rows[("shim", name)] = _store_paths(store, size, args.count, args.repeat)
            store.close()
    finally:
        _stop(procs)
    module, why = real_store()
    if module is not None:
        with ReferenceMaster() as master:
            store = module.MooncakeDistributedStore()
            if store.setup(master.setup_config(segment, 64 << 20)) == 0:
                for name, size in SIZES.items():
                    rows[("mooncake", name)] = _store_paths(store, size, args.count, args.repeat)
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
