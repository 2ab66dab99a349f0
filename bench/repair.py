"""Foreground read latency while replica repair runs, against the same reads without it.

    PYTHONPATH=. python bench/repair.py [--objects 96] [--size 1MiB] [--rates 16MiB,64GiB]

For each repair rate in ``--rates`` (bytes a second per source node, the
master's ``--repair-rate``): a master and three storage nodes as processes;
``--objects`` objects of ``--size`` bytes with two replicas. A reader (a
network client, so its gets are served by the same storage node loops the
repair copies read from) gets random objects, one at a time:

* ``before``: for ``--seconds``, all three nodes up;
* ``repair``: one node is killed (SIGKILL); once the master has declared it
  lost, the gets measured while the master has repair copies in flight;
* ``after``: for ``--seconds`` once every object is back at two replicas,
  on the two nodes left (the same nodes the repair ran on).

Prints, per rate and phase, the number of gets, their median and p99
latency in milliseconds, the ratio of the repair phase's median and p99 to
the ``after`` phase's (same nodes, same run), how long the repair took, and
the repair throughput. Only loopback is used; every figure is from one run.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from kvproto.runtime.client import Client
from kvproto.runtime.units import parse_size


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvproto", *args], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _gets(client: Client, keys: list, until) -> list[float]:
    """Latencies (s) of gets of random keys while ``until()`` is false."""
    out, rng = [], random.Random(1)
    while not until():
        key = rng.choice(keys)
        t0 = time.perf_counter()
        client.get(key)
        out.append(time.perf_counter() - t0)
    return out


def _summary(lat: list[float]) -> dict:
    a = np.array(lat) * 1e3
    return {"gets": len(a), "median_ms": float(np.median(a)) if len(a) else float("nan"),
            "p99_ms": float(np.percentile(a, 99)) if len(a) else float("nan")}


def run(rate: int, objects: int, size: int, seconds: float) -> dict:
    # after the loss two nodes hold every replica: keep them below the
    # master's eviction watermark (90% used), or eviction removes objects
    segment = max(64 << 20, objects * size * 5 // 4 + (16 << 20))
    master = _spawn(["master", "--listen", "tcp://127.0.0.1:*", "--storage-timeout", "1",
                     "--repair-rate", str(rate)])
    address = master.stdout.readline().split()[-1]
    nodes = [_spawn(["storage", "--master", address, "--size", str(segment)]) for _ in range(3)]
    for n in nodes:
        n.stdout.readline()
    client = Client(address, timeout=30.0, local_reads=False)
    try:
        _wait(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 3, 20,
              "three storage nodes")
        keys = [b"bench-repair/%06d" % i for i in range(objects)]
        data = os.urandom(size)
        for key in keys:
            client.put(key, data, replicas=2)
        t_end = time.monotonic() + seconds
        before = _gets(client, keys, lambda: time.monotonic() > t_end)
        victim = nodes[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        _wait(lambda: client.stats()["counters"]["segments_lost"] >= 1, 30, "the loss noticed")
        started = time.monotonic()
        state = {"checked": 0.0, "busy": True}

        def repaired() -> bool:
            now = time.monotonic()
            if now - state["checked"] > 0.05:
                state["checked"] = now
                stats = client.stats()
                state["busy"] = bool(stats["repairs"]["in_flight"] or stats["repairs"]["queued"])
            return not state["busy"]
        during = _gets(client, keys, repaired)
        took = time.monotonic() - started
        counters = client.stats()["counters"]
        if counters["evictions"]:
            raise RuntimeError(f"{counters['evictions']} objects evicted: segments too small")
        t_end = time.monotonic() + seconds
        after = _gets(client, keys, lambda: time.monotonic() > t_end)
        phases = {"before": _summary(before), "repair": _summary(during),
                  "after": _summary(after)}
        return {"rate": rate, "phases": phases, "repair_s": took,
                "repaired_bytes": counters["bytes_repaired"],
                "repairs_listed": counters["repairs_listed"],
                "median_ratio": phases["repair"]["median_ms"] / phases["after"]["median_ms"],
                "p99_ratio": phases["repair"]["p99_ms"] / phases["after"]["p99_ms"]}
    finally:
        client.close()
        for p in nodes[1:] + [master]:
            p.terminate()
            p.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=96)
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--rates", default="16MiB,64GiB",
                        help="comma-separated repair rates per source node (bytes a second)")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    size = parse_size(args.size)
    print(f"{args.objects} objects of {size} bytes, 2 replicas, 3 storage nodes, one killed; "
          f"network gets, one at a time")
    for text in args.rates.split(","):
        r = run(parse_size(text), args.objects, size, args.seconds)
        print(f"repair rate {text}/s per source: {r['repairs_listed']} replicas "
              f"({r['repaired_bytes'] / 2**20:.0f} MiB) repaired in {r['repair_s']:.2f} s "
              f"({r['repaired_bytes'] / 2**20 / r['repair_s']:.0f} MiB/s)")
        for phase, s in r["phases"].items():
            print(f"  {phase:7s} {s['gets']:6d} gets  median {s['median_ms']:7.2f} ms  "
                  f"p99 {s['p99_ms']:7.2f} ms")
        print(f"  repair / after: median x{r['median_ratio']:.2f}, p99 x{r['p99_ratio']:.2f}")


if __name__ == "__main__":
    main()
