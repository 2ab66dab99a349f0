"""The runtime storage node's own work per key, in process, no sockets.

    PYTHONPATH=. python bench/storage_ops.py [--batch 128] [--rounds 300] [--network]

A :class:`~kvproto.runtime.storage.StorageCore` over a 256 MiB segment
handles, per round, one request of ``--batch`` regions of each kind the put
path sends it: the master's ``assign`` (to a direct writer, or with
``--network`` to the client that sends the bytes), the writes (the direct
writer's copy and report into the generation words, left out of the timing; or
one ``writes`` message carrying every payload), the master's ``publish``, and
then a ``free`` of them all. Prints microseconds per key per request kind: the
node's own work, the decoding of the request and the sockets left out. It uses
only ``handle`` and ``start``, so the same script measures an older revision
(``git worktree add /tmp/old REV``, ``PYTHONPATH=/tmp/old``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from kvproto.runtime.shm import SegmentMemory, WriterLock, gen_word
from kvproto.runtime.storage import StorageCore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--network", action="store_true",
                        help="writes over the network (a writes message) instead of direct writes")
    args = parser.parse_args()
    gc.freeze()                     # the collector as a server process runs it
    gc.set_threshold(50_000, 20, 100)
    mem = SegmentMemory(256 << 20, 4096)
    writer = WriterLock()           # a live direct writer: free looks at its lock
    core = StorageCore(mem, "seg")
    pages, size = mem.capacity // mem.page_size, 4096
    payload = memoryview(bytes(size))
    spent: dict[str, list[float]] = {"assign": [], "writes": [], "publish": [], "free": []}

    def timed(kind: str, op: str, body: dict, payloads: list = ()) -> None:
        t0 = time.perf_counter()
        reply, _ = core.handle(op, body, list(payloads))
        spent[kind].append(time.perf_counter() - t0)
        if any(item[0] for item in reply["results"]):
            raise AssertionError(f"{op} refused: {reply['results'][:3]}")

    try:
        for r in range(args.rounds):
            base = r * args.batch
            regions = [((base + i) % pages * mem.page_size, size, b"bench/%017d" % (base + i),
                        base + i + 1) for i in range(args.batch)]
            assign = {"segment": "seg", "term": 1, "regions": regions}
            if not args.network:
                assign["direct"] = [[offset, writer.name] for offset, *_ in regions]
            timed("assign", "assign", assign)
            if args.network:
                writes = {"segment": "seg", "term": 1, "owner": "client",
                          "regions": [(offset, token, base + i)
                                      for i, (offset, _, _, token) in enumerate(regions)]}
                core.start("writes", writes)
                timed("writes", "writes", writes, [payload] * args.batch)
            else:
                for offset, _, _, token in regions:      # the direct writer's copy and report
                    mem.set_word(offset, gen_word(token, True))
            timed("publish", "publish", {"segment": "seg", "term": 1, "regions": [
                (offset, key, token, 12345, 1) for offset, _, key, token in regions]})
            timed("free", "free", {"segment": "seg", "term": 1, "regions": [
                (offset, token, size) for offset, _, _, token in regions]})
    finally:
        mem.close()
        writer.close()
    for kind, times in spent.items():
        if times:
            print(f"{kind:8s} {statistics.median(times) / args.batch * 1e6:7.2f} µs per key "
                  f"(median of {len(times)} requests of {args.batch})")


if __name__ == "__main__":
    main()
