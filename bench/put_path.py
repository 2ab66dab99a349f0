"""A batched put's CPU per key by stage, master and storage node in process, no sockets.

    PYTHONPATH=. python bench/put_path.py [--batch 128] [--rounds 300]

A :class:`~kvproto.runtime.master.MasterCore` and the
:class:`~kvproto.runtime.storage.StorageCore` of its one segment (on the
client's host, so each put is a direct write) serve, per round, one
``put_start`` of ``--batch`` 4 KiB keys and its ``put_end``, each message
encoded and decoded with :mod:`kvproto.runtime.wire` as the processes do:
the request decoded and handled by the master, the commands it sends the
node (``assign``, ``publish``) encoded, decoded and handled by the node, the
node's replies decoded and taken by the master, the reply to the client
encoded. The direct writer's copy is left out (its report is set in the
generation words); the client's decoding of the grant (``grants_of``) is
timed too. Prints the median microseconds per key of each stage
(``time.perf_counter`` around each, so ZeroMQ and the loops are left out) and
the sums for the master and the node. The cyclic collector runs as in the
server processes (``kvproto.cli``: what was imported frozen, the youngest
generation collected every 50,000 allocations): at the default 700 its
collections fall in a stage every round, and which stage depends on how
much the stages before it allocated.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvproto.runtime import wire
from kvproto.runtime.client_puts import grants_of
from kvproto.runtime.master import MasterCore
from kvproto.runtime.shm import SegmentMemory, gen_word
from kvproto.runtime.storage import StorageCore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    now = [1000.0]
    master = MasterCore(writer_timeout=5.0, storage_timeout=5.0, lease_ttl=2.0,
                        clock=lambda: now[0])
    mem = SegmentMemory(1 << 30, 4096)
    node = StorageCore(mem, "a")
    master.handle("register", {"segment": "a", "capacity": mem.capacity, "host": "h",
                               "endpoint": "tcp://127.0.0.1:9000", "shm": "shm-0",
                               "gen_shm": "gen-0", "nonce": 0, "page_size": mem.page_size,
                               "columns": True})   # as the node registers
    spent: dict[str, list[float]] = {}
    view = memoryview(bytes(4096))

    def timed(stage: str, fn):
        t0 = time.perf_counter()
        result = fn()
        spent.setdefault(stage, []).append(time.perf_counter() - t0)
        return result

    def serve(op: str, body: dict) -> list:
        frame = wire.encode_request(op, 7, body)
        req = timed(f"master decode {op}", lambda: wire.decode_request(
            [frame], wire.MASTER_MAX_HEADER, 0, wire.MASTER_OPS))
        result = timed(f"master handle {op}", lambda: master.handle(req.op, req.body, b"c", 7))
        while master.outbox:
            out, master.outbox = master.outbox, []
            for segment, cmd, cmd_id, cmd_body in out:
                sent = timed(f"master encode {cmd}", lambda: wire.encode_request(cmd, cmd_id, cmd_body))
                got = timed(f"node decode {cmd}", lambda: wire.decode_request(
                    [sent], wire.STORAGE_MAX_HEADER, mem.capacity, wire.STORAGE_OPS))
                reply, _ = timed(f"node handle {cmd}", lambda: node.handle(got.op, got.body, []))
                frame = timed(f"node encode {cmd}", lambda: wire.encode_reply(cmd_id, 0, reply))
                timed(f"master reply {cmd}", lambda: master.storage_reply(
                    segment, wire.decode_reply([frame])))
        if result is None:
            result = master.ready.pop()[2:]
        master.ready.clear()
        frame = timed(f"master encode {op} reply", lambda: wire.encode_reply(7, *result))
        return frame if op == "put_start" else result[1]

    try:
        for r in range(args.rounds):
            keys = [b"put/%06d/%012d" % (r, i) for i in range(args.batch)]
            frame = serve("put_start", {"client": "c", "replicas": 1, "writer": "w", "host": "h",
                                        "columns": True, "items": [[k, 4096] for k in keys]})
            todo, results = [(i, k, view) for i, k in enumerate(keys)], [None] * len(keys)
            grants = timed("client decode put_start reply",   # as the client takes the grants
                           lambda: grants_of(wire.decode_reply([frame]), todo, 1, results))
            if len(grants) != len(keys) or any(results):
                raise AssertionError(f"put_start refused: {[r for r in results if r][:3]}")
            tokens = [grant[2] for grant in grants.values()]
            for grant in grants.values():              # the direct writer's reports
                for _, offset, _ in grant[3]:
                    mem.set_word(offset, gen_word(grant[2], True))
            ended = serve("put_end", {"client": "c", "columns": True,   # as the client asks
                                      "items": [[k, t, 12345] for k, t in zip(keys, tokens)]})
            if ended["errors"]:
                raise AssertionError(f"put_end refused: {ended['errors'][:3]}")
            now[0] += 0.001
    finally:
        mem.close()
    per = {stage: statistics.median(times) / args.batch * 1e6 for stage, times in spent.items()}
    print(f"put path, batch {args.batch}, {args.rounds} rounds: median microseconds per key")
    for stage, us in per.items():
        print(f"  {stage:<32} {us:6.2f}")
    for side in ("master", "node", "client"):
        print(f"  {side + ' total':<32} {sum(us for s, us in per.items() if s.startswith(side)):6.2f}")


if __name__ == "__main__":
    main()
