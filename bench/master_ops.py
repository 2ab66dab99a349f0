"""The runtime master's own work per key, in process, no sockets.

    PYTHONPATH=. python bench/master_ops.py [--objects 100000] [--batch 128] [--rounds 50]

A :class:`~kvproto.runtime.master.MasterCore` with two registered segments
holding ``--objects`` published 4 KiB objects (2 replicas) handles, per round,
one request of ``--batch`` keys of each kind: put_start, put_end, read_begin
with a lease (answered as columns, as a client's get asks), release, exists
(answered as one byte per key, as a client's exists asks) and remove (the
storage nodes' acknowledgements are fed back at once). Prints microseconds
of CPU time per key per request kind (``time.process_time``, so other work
on a shared machine weighs less): what the master's loop spends, the
sockets and the other processes left out. It uses
only ``handle``, ``outbox`` and ``storage_reply`` (the acknowledgements are
written out here rather than taken from ``kvproto.checking.fuzz``), so the same
script measures an older revision (``git worktree add /tmp/old REV``,
``PYTHONPATH=/tmp/old``).
"""

from __future__ import annotations

import argparse
import time

from kvproto.runtime import wire
from kvproto.runtime.master import MasterCore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    now = [1000.0]
    core = MasterCore(writer_timeout=5.0, storage_timeout=5.0, lease_ttl=2.0, clock=lambda: now[0])
    for n, seg in enumerate(("a", "b")):
        core.handle("register", {"segment": seg, "capacity": 8 << 30, "host": "h",
                                 "endpoint": f"tcp://127.0.0.1:{9000 + n}", "shm": f"shm-{n}",
                                 "gen_shm": f"gen-{n}", "nonce": n, "page_size": 4096})

    def settle() -> None:
        while core.outbox:
            out, core.outbox = core.outbox, []
            for segment, op, cmd_id, body in out:
                results = [[0, None]] * len(body.get("regions", ()))
                core.storage_reply(segment, wire.Reply(0, cmd_id, {"results": results}, []))
        core.ready.clear()

    def put(keys) -> None:
        core.handle("put_start", {"client": "c", "replicas": 2, "items": [[k, 4096] for k in keys]})
        settle()
        tokens = list(core.sessions["c"].tokens)
        core.handle("put_end", {"client": "c", "items": [[k, t] for k, t in zip(keys, tokens)]})
        settle()

    settle()
    for at in range(0, args.objects, 1000):
        put([b"fill/%019d" % i for i in range(at, min(at + 1000, args.objects))])
    spent: dict[str, float] = {}

    def timed(name: str, fn):
        t0 = time.process_time()
        result = fn()
        spent[name] = spent.get(name, 0.0) + time.process_time() - t0
        return result

    for r in range(args.rounds):
        keys = [b"round/%06d/%012d" % (r, i) for i in range(args.batch)]
        timed("put_start", lambda: (core.handle("put_start", {
            "client": "c", "replicas": 2, "items": [[k, 4096] for k in keys]}), settle()))
        tokens = list(core.sessions["c"].tokens)
        timed("put_end", lambda: (core.handle("put_end", {
            "client": "c", "items": [[k, t] for k, t in zip(keys, tokens)]}), settle()))
        _, body = timed("read_begin", lambda: core.handle("read_begin", {
            "client": "c", "keys": keys, "lease": True, "columns": True}))
        leases = body["columns"]["lease"] if "columns" in body \
            else [item[1]["lease"] for item in body["items"]]   # a revision before the columns
        timed("release", lambda: core.handle("release", {"client": "c", "leases": leases}))
        timed("exists", lambda: core.handle("exists", {"keys": keys, "found": True}))
        timed("remove", lambda: (core.handle("remove", {"keys": keys}), settle()))
        now[0] += 0.001
    per = args.rounds * args.batch
    print(f"MasterCore.handle, {args.objects:,} objects held, batch {args.batch}, "
          f"{args.rounds} rounds: microseconds of CPU per key")
    for name, seconds in spent.items():
        print(f"  {name:<10} {seconds / per * 1e6:7.2f}")


if __name__ == "__main__":
    main()
