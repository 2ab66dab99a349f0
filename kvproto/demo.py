"""``kvproto demo``: an embedded cluster, writers that die mid-put, readers that
check every byte.

Writers are separate processes putting 8 MiB objects (one rank's share of a
256-token chunk of a 128 KiB/token model). Some of them are killed with SIGKILL
while they put; the master's writer timeout reclaims what they allocated, and
their half-written objects never become readable. Readers run alongside and
afterwards, comparing every object's checksum with the checksum of the bytes its
writer generated.

Then a failover: two ``kvproto master --coordinator`` processes (one active,
one standby, elected through the embedded coordinator) and two storage
processes; objects are put, the active master is killed with SIGKILL, and the
standby takes a higher term, fences the storage nodes, rebuilds the directory
from their indexes and opens; every object is read back through it.

The demo exits non-zero on any wrong byte.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

OBJECT_SIZE = 8 << 20

_WRITER = r"""
import sys
from kvproto.demo import payload
from kvproto.runtime.client import Client
master, writer, count, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Client(master, timeout=30.0) as client:
    for i in range(count):
        key = f"demo/{writer}/{i}".encode()
        data = payload(key)
        print("putting", key.decode(), flush=True)
        client.put(key, data, replicas=replicas)
        print(key.decode(), flush=True)
"""


def payload(key: bytes, size: int = OBJECT_SIZE) -> np.ndarray:
    """The bytes a writer puts under ``key``: pseudo-random, reproducible from the key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def checksum(data) -> bytes:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).digest()


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets = self.misses = self.wrong = 0
        self.bytes_read = 0
        self.read_seconds = 0.0

    def read(self, client, key: bytes, expected: bytes) -> None:
        from kvproto import errors
        t0 = time.perf_counter()
        try:
            data = client.get(key)
        except errors.KeyNotFound:
            with self.lock:
                self.misses += 1
            return
        elapsed = time.perf_counter() - t0
        ok = checksum(data) == expected
        with self.lock:
            self.gets += 1
            self.bytes_read += len(data)
            self.read_seconds += elapsed
            if not ok:
                self.wrong += 1
                print(f"WRONG BYTES for {key.decode()}", file=sys.stderr, flush=True)


def main(writers: int = 4, killed: int = 2, objects: int = 8, replicas: int = 2,
         storage_nodes: int = 2, segment_size: str = "384MiB", writer_timeout: float = 2.0) -> int:
    import kvproto

    print(f"kvproto demo: {storage_nodes} storage nodes x {segment_size}, {writers} writers "
          f"(+{killed} killed mid-put), {objects} objects of 8 MiB each, {replicas} replicas")
    with kvproto.embedded(storage_nodes=storage_nodes, segment_size=segment_size,
                          writer_timeout=writer_timeout) as cluster:
        client = cluster.client()
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def spawn(name: str) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-c", _WRITER, cluster.master_address, name, str(objects), str(replicas)],
                stdout=subprocess.PIPE, text=True, env=env)

        t_start = time.perf_counter()
        procs = {f"w{i}": spawn(f"w{i}") for i in range(writers)}
        victims = {f"k{i}": spawn(f"k{i}") for i in range(killed)}

        # Kill each victim in the middle of a put: its first object is
        # published, and it has just started putting the second.
        for name, proc in victims.items():
            lines = iter(proc.stdout.readline, "")
            started = 0
            for line in lines:
                started += line.startswith("putting")
                if started == 2:
                    break
            time.sleep(0.003)
            proc.send_signal(signal.SIGKILL)
            proc.wait()

        tally = _Tally()
        done: list[bytes] = []
        done_lock = threading.Lock()

        def collect(proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                if not line.startswith("putting"):
                    with done_lock:
                        done.append(line.strip().encode())

        collectors = [threading.Thread(target=collect, args=(p,)) for p in procs.values()]
        for t in collectors:
            t.start()

        # A reader runs while writers write, reading what has been published so far.
        stop_reader = threading.Event()

        def concurrent_reader() -> None:
            reader = cluster.client()
            seen = 0
            while not stop_reader.is_set():
                with done_lock:
                    batch = done[seen:]
                if not batch:
                    time.sleep(0.01)
                    continue
                for key in batch:
                    tally.read(reader, key, checksum(payload(key)))
                seen += len(batch)

        reader = threading.Thread(target=concurrent_reader)
        reader.start()
        failed_writers = [n for n, p in procs.items() if p.wait() != 0]
        for t in collectors:
            t.join()
        stop_reader.set()
        reader.join()
        write_seconds = time.perf_counter() - t_start

        # Readers again, over every key any writer could have put, victims included:
        # a victim's in-flight object must be a miss, never half-visible.
        all_keys = [f"demo/{w}/{i}".encode() for w in list(procs) + list(victims) for i in range(objects)]
        for key in all_keys:
            tally.read(client, key, checksum(payload(key)))

        # The writer timeout reclaims what the victims allocated.
        deadline = time.monotonic() + writer_timeout * 5
        stats = client.stats()
        while stats["counters"].get("reclaimed", 0) < killed and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = client.stats()
        counters = stats["counters"]

        puts = len(done)
        put_bytes = puts * OBJECT_SIZE * replicas
        print(f"puts published:        {puts} ({counters.get('puts_published', '?')} by the master's count)")
        print(f"gets verified:         {tally.gets}")
        print(f"misses:                {tally.misses}")
        print(f"reclaimed allocations: {counters.get('reclaimed', 0)}")
        print(f"bytes moved:           {put_bytes / 2**20:.0f} MiB written (all replicas), "
              f"{tally.bytes_read / 2**20:.0f} MiB read")
        print(f"write GB/s:            {put_bytes / write_seconds / 1e9:.2f} "
              f"(all writers together, {write_seconds:.1f} s wall clock incl. start-up and payload generation)")
        if tally.read_seconds:
            print(f"read GB/s:             {tally.bytes_read / tally.read_seconds / 1e9:.2f} (per reader)")
        print(f"wrong bytes:           {tally.wrong}")
        if failed_writers:
            print(f"writers that failed:   {', '.join(failed_writers)}", file=sys.stderr)
        expected_puts = writers * objects
        ok = tally.wrong == 0 and not failed_writers and puts == expected_puts
    ok = failover() and ok
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def failover(objects: int = 16, size: int = 1 << 20) -> bool:
    """Kill the active master; the standby takes over; every object is read back."""
    import tempfile
    from kvproto.runtime.client import Client, put_retrying
    from kvproto.runtime.coordinator import connect

    print(f"\nfailover: 2 masters (embedded coordinator), 2 storage nodes, {objects} objects of "
          f"{size >> 20} MiB, then SIGKILL of the active master")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> str:
        p = subprocess.Popen([sys.executable, "-m", "kvproto", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(p)
        return p.stdout.readline().split()[-1]

    with tempfile.TemporaryDirectory(prefix="kvproto-demo-") as tmp:
        url = f"file://{tmp}"
        coordinator = connect(url, ttl=1.0)
        masters = {}
        try:
            for _ in range(2):
                address = start("master", "--coordinator", url, "--standby", "--ttl", "1",
                                "--listen", "tcp://127.0.0.1:*")
                masters[address] = procs[-1]
            for _ in range(2):
                start("storage", "--master", url, "--size", "64MiB")
            with Client(url, timeout=5.0) as client:
                keys = [f"failover/{i}".encode() for i in range(objects)]
                put_retrying(client, keys[0], payload(keys[0], size), 30, replicas=2, pause=0.1)
                for key in keys[1:]:
                    client.put(key, payload(key, size), replicas=2)
                term, active = coordinator.leader()
                masters[active].send_signal(signal.SIGKILL)
                masters[active].wait()
                took = put_retrying(client, b"failover/after", payload(b"failover/after", size), 30)
                stats = client.stats()["failover"]
                wrong = misses = 0
                for key in keys:
                    got = client.get_many([key])[0]
                    if got is None:
                        misses += 1
                    elif checksum(got) != checksum(payload(key, size)):
                        wrong += 1
                last = stats["last"]
                print(f"term:                  {term} -> {stats['term']}")
                print(f"first put after kill:  {took:.2f} s (lease TTL 1 s; fence {last['fence_s'] * 1000:.1f} ms, "
                      f"recovery {last['recover_s'] * 1000:.1f} ms)")
                print(f"objects recovered:     {last['recovered']} from {last['nodes_fenced']} storage nodes "
                      f"({last['nodes_lost']} lost)")
                print(f"read back:             {objects - misses - wrong} of {objects}, "
                      f"{misses} misses, {wrong} wrong")
                return wrong == 0 and misses == 0 and stats["term"] > term
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            coordinator.close()
