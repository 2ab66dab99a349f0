"""``kvproto bench``: the store measured against raw baselines in the same run.

Payload: put and get of 1, 8 and 32 MiB objects through a master and a storage
node running as separate processes on loopback TCP, next to

* raw pyzmq moving the same bytes over the same transport (a DEALER sending one
  zero-copy frame to a ROUTER in another process that acknowledges it, and the
  reverse for reads), and
* a plain memcpy (``numpy.copyto``) of the same size.

Gets are measured twice: over the network (``local_reads=False``) and through
the storage node's shared memory (one memcpy, the same-host path), the latter
both as ``get`` and as ``get_into`` the caller's buffer; with the put (a direct
write into the node's segment on this host) they are also shown against the
memcpy.

Metadata: batched puts (start + write + end), gets and exists of 4 KiB
objects, batch sizes 1 and 128, and 128 with four requests of one call in
flight (the client's ``window``), in keys/s, next to raw pyzmq moving the same
bytes in the same round trips (as many in flight); and the master's memory per stored object, measured
as the growth of a process holding the master's directory and lease table (the
fast cores on shared rows, filled by the steps the master takes: PutStart,
PutEnd, the lease table's Put) with one million published objects.

Transfers: small (64 KiB) gets per second through the client's transfer engine
(``client.transfer_engine``: read_begin, a tracked ``load`` with its generation
into a pool buffer, the pool machine's Issue/Complete/Consume/Release steps,
read_end from the engine's I/O thread), next to the same gets through the
plain ``get`` over the network and a raw pyzmq request/reply of 64 KiB, in the
same run, with the ratios.

Leases: 4 KiB gets in keys/s with a read lease per key (grant, the reader's
acceptance check, release) and without (the publish pin), batch 1 and 128, on
one store in the same run, with the ratios.

Failover: the time from ``kill -9`` of the active master to the first
successful put through the new one (two ``kvproto master --coordinator``
processes, one storage node; a client putting in a loop with short timeouts;
the killed master is restarted as a standby for the next trial), with the
embedded coordinator and with etcd (a loopback etcd this benchmark starts),
median and worst; and the rebuild rate: a new master fenced by storage nodes
whose indexes hold one million published objects (the nodes' ``fence``
answers, i.e. the index encoded as each node sends it, decoded, rebuilt and
opened by the master), in objects per second, and with tenants next to
without (:mod:`kvproto.bench_takeover`); and the same end to end
(``rebuild-e2e``): storage processes whose nodes published one million
100-byte objects in their own indexes (through the node's command handlers,
not through puts: filling a store through puts would take minutes), the
active master killed, and the standby's takeover over TCP as its own
failover metrics report it.

Checksums: per size, the object checksum (XXH3-64, what a writer sends with
``put_end`` and ``verify=True`` recomputes) next to a memcpy of the same
bytes; and same-host and network gets with ``verify=True`` next to the same
gets without, and puts with the writer's checksum next to puts without, on
one store in the same run, with the ratios.

Segment loss: what losing a segment of a million objects costs the master's
loop (:mod:`kvproto.bench_loss`).

``--only failover,rebuild`` (any of :data:`SECTIONS`) runs some sections alone.

Every figure is a median over repetitions and is printed with its ratio to the
baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

import numpy as np

MiB = 1 << 20

_RAW_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
blobs = {}
while True:
    frames = s.recv_multipart(copy=False)
    ident, op = frames[0].bytes, frames[1].bytes
    if op == b"put":
        s.send_multipart([ident, b"ok"])
    elif op == b"get":
        size = int(frames[2].bytes)
        blob = blobs.setdefault(size, bytearray(size))
        s.send_multipart([ident, memoryview(blob)], copy=False)
    else:
        s.send_multipart([ident, b"bye"])
        break
"""


#: the benchmark's sections, in the order they run
SECTIONS = ("payload", "metadata", "transfers", "leases", "rebuild", "failover", "memory",
            "rebuild-e2e", "checksum", "segment-loss")


def _mib_list(text: str) -> str:
    """``--sizes``: comma-separated positive whole MiB."""
    if not all(part.strip().isdigit() and int(part) > 0 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    parser.add_argument("--sizes", type=_mib_list, default="1,8,32",
                        help="object sizes in MiB (default 1,8,32)")
    parser.add_argument("--repeat", type=int, default=15, help="transfers per size and path")
    parser.add_argument("--meta-keys", type=int, default=2048, help="4 KiB keys per metadata run")
    parser.add_argument("--memory-objects", type=int, default=1_000_000,
                        help="objects for the master-memory figure (0 to skip)")
    parser.add_argument("--xfer-count", type=int, default=1000,
                        help="64 KiB gets per transfer-engine run (0 to skip)")
    parser.add_argument("--xfer-repeat", type=int, default=5, help="transfer-engine runs")
    parser.add_argument("--lease-keys", type=int, default=2048,
                        help="4 KiB keys per lease-vs-pin get run (0 skips the section)")
    parser.add_argument("--lease-repeat", type=int, default=5, help="lease-vs-pin runs")
    parser.add_argument("--failover-trials", type=int, default=10,
                        help="kill -9 trials per coordinator backend (0 skips the section)")
    parser.add_argument("--rebuild-objects", type=int, default=1_000_000,
                        help="objects the failover rebuild recovers (0 skips it)")
    parser.add_argument("--rebuild-repeat", type=int, default=3,
                        help="runs of the failover rebuild with and without tenants (0 skips those)")
    parser.add_argument("--rebuild-replicas", type=int, choices=(1, 2, 4), default=1,
                        help="replicas of each object the failover rebuild recovers (of 4 nodes)")
    parser.add_argument("--e2e-objects", type=int, default=1_000_000,
                        help="objects stored before the end-to-end failover rebuild (0 skips it)")
    parser.add_argument("--loss-objects", type=int, default=1_000_000,
                        help="objects on the segment the segment-loss figure loses (0 skips it)")
    parser.add_argument("--loss-repeat", type=int, default=3, help="segment-loss runs")


def _median_rate(samples: list[float], nbytes: int) -> float:
    return nbytes / statistics.median(samples) / 1e9


def _timed(fn, repeat: int) -> list[float]:
    fn()  # warm up (connections, page faults)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _start_store(segment: str) -> tuple[list[subprocess.Popen], str]:
    """A master and one storage node as processes; returns once the node registered."""
    from kvproto.runtime.client import Client

    master = _spawn(["-m", "kvproto", "master", "--listen", "tcp://127.0.0.1:*"])
    address = master.stdout.readline().split()[-1]
    storage = _spawn(["-m", "kvproto", "storage", "--master", address, "--size", segment])
    storage.stdout.readline()
    with Client(address, timeout=20.0) as client:
        deadline = time.monotonic() + 20
        while not any(s["live"] for s in client.stats()["segments"].values()):
            if time.monotonic() > deadline:
                raise RuntimeError("storage node did not register")
            time.sleep(0.05)
    return [storage, master], address


def _cpu_seconds(pid: int) -> Optional[float]:
    """CPU time process ``pid`` has used, all its threads (its ZeroMQ I/O
    threads too), from ``/proc`` in nanoseconds (None where there is none)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        total = 0
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass    # a thread that ended meanwhile
    except OSError:
        return None
    return total / 1e9


def _start_raw():
    """The raw pyzmq peer: a process with a ROUTER, and a DEALER connected to it."""
    import zmq

    raw = _spawn(["-c", _RAW_SERVER])
    port = int(raw.stdout.readline())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return raw, sock


def _stop(procs: list[subprocess.Popen], raw=None, sock=None) -> None:
    if sock is not None:
        sock.send_multipart([b"stop"])
        sock.close(linger=0)
        raw.wait(5)
    for p in procs:
        p.terminate()
        p.wait(10)


def _fixed_costs(writer, reader, repeat: int) -> dict[str, float]:
    """Seconds per call of a same-host put, get and get_into of a 4 KiB
    object (medians): the round trips and bookkeeping a call costs whatever
    its size, which bound the ratio to a memcpy of small objects."""
    small = np.ones(4096, dtype=np.uint8)
    keys = iter([f"fixed/{i}".encode() for i in range(repeat + 1)])
    out = {"put": statistics.median(_timed(lambda: writer.put(next(keys), small), repeat))}
    out["get"] = statistics.median(_timed(lambda: reader.get(b"fixed/0"), repeat))
    out["get_into"] = statistics.median(_timed(lambda: reader.get_into(b"fixed/0", small), repeat))
    reader.flush_releases()
    for i in range(repeat + 1):
        writer.remove(f"fixed/{i}".encode(), force=True)
    return out


def payload_bench(sizes_mib: list[int], repeat: int) -> list[dict]:
    from kvproto.runtime.client import Client

    raw, sock = _start_raw()

    procs, address = _start_store(f"{max(sizes_mib) * (repeat + 4)}MiB")
    rows = []
    try:
        net = Client(address, timeout=60.0, local_reads=False)
        local = Client(address, timeout=60.0)
        fixed = _fixed_costs(net, local, repeat)
        for mib in sizes_mib:
            n = mib * MiB
            src = np.random.default_rng(mib).integers(0, 256, n, dtype=np.uint8)
            dst = np.empty_like(src)
            key = f"bench/{mib}".encode()
            put_keys = iter([f"bench/{mib}/{i}".encode() for i in range(repeat + 1)])

            def put() -> None:
                net.put(next(put_keys), src)

            def raw_put() -> None:
                sock.send_multipart([b"put", memoryview(src)], copy=False)
                sock.recv()

            def raw_get() -> None:
                sock.send_multipart([b"get", str(n).encode()])
                sock.recv(copy=False)

            put_s = _timed(put, repeat)
            for i in range(repeat + 1):
                net.remove(f"bench/{mib}/{i}".encode())
            raw_put_s = _timed(raw_put, repeat)
            net.put(key, src)
            get_net_s = _timed(lambda: net.get(key), repeat)
            get_shm_s = _timed(lambda: local.get(key), repeat)
            get_into_s = _timed(lambda: local.get_into(key, dst), repeat)
            if not np.array_equal(dst, src):
                raise AssertionError(f"get_into read wrong bytes for {mib} MiB")
            raw_get_s = _timed(raw_get, repeat)
            memcpy_s = _timed(lambda: np.copyto(dst, src), repeat)
            got = local.get(key)
            if bytes(got) != src.tobytes() or bytes(net.get(key)) != src.tobytes():
                raise AssertionError(f"wrong bytes read back for {mib} MiB")
            local.flush_releases()
            net.remove(key)
            rows.append({
                "size": f"{mib} MiB",
                "put": _median_rate(put_s, n), "raw_put": _median_rate(raw_put_s, n),
                "get_net": _median_rate(get_net_s, n), "raw_get": _median_rate(raw_get_s, n),
                "get_shm": _median_rate(get_shm_s, n), "memcpy": _median_rate(memcpy_s, n),
                "get_into": _median_rate(get_into_s, n), "fixed": fixed,
            })
        net.close()
        local.close()
    finally:
        _stop(procs, raw, sock)
    return rows


def checksum_bench(sizes_mib: list[int], repeat: int) -> list[dict]:
    """The checksum's cost per byte, next to memcpy and to the same gets and
    puts without it (GB/s, medians)."""
    from kvproto.runtime.client import Client
    from kvproto.runtime.datapath import checksum

    procs, address = _start_store(f"{max(sizes_mib) * 3}MiB")
    rows = []
    try:
        clients = {"net": Client(address, timeout=60.0, local_reads=False),
                   "shm": Client(address, timeout=60.0),
                   "plain": Client(address, timeout=60.0, checksums=False)}
        for mib in sizes_mib:
            n = mib * MiB
            src = np.random.default_rng(mib).integers(0, 256, n, dtype=np.uint8)
            dst = np.empty_like(src)
            key = f"sum/{mib}".encode()

            def put_remove(client) -> None:
                client.put(key, src)
                client.remove(key)

            row = {"size": f"{mib} MiB",
                   "memcpy": _median_rate(_timed(lambda: np.copyto(dst, src), repeat), n),
                   "checksum": _median_rate(_timed(lambda: checksum(src), repeat), n),
                   "put": _median_rate(_timed(lambda: put_remove(clients["shm"]), repeat), n),
                   "put_plain": _median_rate(_timed(lambda: put_remove(clients["plain"]), repeat), n)}
            clients["shm"].put(key, src)
            for path in ("shm", "net"):
                c = clients[path]
                row[f"get_{path}"] = _median_rate(_timed(lambda: c.get(key), repeat), n)
                row[f"verify_{path}"] = _median_rate(_timed(lambda: c.get(key, verify=True), repeat), n)
                if c.checksum_counters["checksum_verified"] != repeat + 1:
                    raise AssertionError(f"{path} gets of {mib} MiB were not verified")
                c.checksum_counters["checksum_verified"] = 0
                c.flush_releases()
            clients["shm"].remove(key)
            rows.append(row)
        for c in clients.values():
            c.close()
    finally:
        _stop(procs)
    return rows


#: the metadata rows: (keys a request, requests of one call in flight at once)
META_ROWS = ((1, 1), (128, 1), (128, 4))


def metadata_bench(keys: int) -> list[dict]:
    """4 KiB put, get and exists in keys/s at batch 1 and 128, next to raw pyzmq
    moving the same bytes in the same number of round trips (one request of
    ``batch`` x 4 KiB and its acknowledgement; one request and ``batch`` x 4 KiB
    back; for exists, ``batch`` 24-byte keys each way). The last row asks for
    all the keys in one call of a client with ``batch=128, window=4``: its
    lookups go four requests in flight (a put, the next chunk's ``put_start``
    while a chunk is written), and the raw peer keeps as many in flight; its
    get and exists are three such calls (the first faults in the memory the
    values are read into; the rows one request at a time reuse it from their
    second call)."""
    from kvproto.runtime.client import Client

    raw, sock = _start_raw()
    procs, address = _start_store("256MiB")
    rows = []
    spent: dict = {}

    def rate(fn, rounds: int, name: str = "", times: int = 1) -> float:
        """Keys/s of ``rounds`` calls (of every key), ``times`` over; with
        ``name``, also the CPU time the master, the storage node and the
        client (this process) spent per key (``spent``)."""
        pids = [p.pid for p in procs] + [os.getpid()]
        before = [_cpu_seconds(pid) for pid in pids] if name else []
        t0 = time.perf_counter()
        for _ in range(times):
            for i in range(rounds):
                fn(i)
        elapsed = time.perf_counter() - t0
        if name and None not in before:
            for side, pid, was in zip(("node", "master", "client"), pids, before):
                spent[f"{name}_{side}_us"] = (_cpu_seconds(pid) - was) / (keys * times) * 1e6
        return keys * times / elapsed

    try:
        blob = np.zeros(4096, dtype=np.uint8)
        client = Client(address, timeout=60.0)
        for batch, window in META_ROWS:
            client.batch, client.window = batch, window
            names = [f"meta/{batch}/{window}/{i:016d}".encode() for i in range(keys)]
            chunks = [names[i:i + batch] for i in range(0, keys, batch)]
            if window > 1:      # one call of every key
                chunks = [names]
            rounds = len(chunks)

            def put(i):
                failed = [e for e in client.put_many([(k, blob) for k in chunks[i]]) if e is not None]
                if failed:
                    raise failed[0]

            def get(i):
                if any(v is None for v in client.get_many(chunks[i])):
                    raise AssertionError("a put key was missing")

            def exists(i):
                if not all(client.exists_many(chunks[i])):
                    raise AssertionError("a put key was missing")

            payload = bytes(4096 * batch)
            keyblob = b"".join(names[:batch])

            def raw_calls(*frames):
                requests = -(-keys // batch) if window > 1 else 1

                def run(i):
                    waiting = 0
                    for _ in range(requests):
                        sock.send_multipart(frames, copy=False)
                        waiting += 1
                        if waiting == window:
                            sock.recv(copy=False)
                            waiting -= 1
                    for _ in range(waiting):
                        sock.recv(copy=False)
                return run
            raw_put = raw_calls(b"put", payload)
            raw_get = raw_calls(b"get", str(len(payload)).encode())
            raw_exists = raw_calls(b"get", str(len(keyblob)).encode(), keyblob)

            # one call of every key is read three times: the first faults in
            # the memory its values are copied into, as a client's first
            # call does; the next ones reuse it, the values let go meanwhile
            reads = 1 if window == 1 else 3
            spent.clear()
            row = {"batch": batch, "window": window, "put_keys_s": rate(put, rounds, "put"),
                   "get_keys_s": rate(get, rounds, "get", reads),
                   "exists_keys_s": rate(exists, rounds, "exists", reads),
                   "raw_put_keys_s": rate(raw_put, rounds),
                   "raw_get_keys_s": rate(raw_get, rounds, times=reads),
                   "raw_exists_keys_s": rate(raw_exists, rounds, times=reads), **spent}
            if any(client.remove_many(names)):
                raise AssertionError("a put key was not removed")
            rows.append(row)
        client.close()
    finally:
        _stop(procs, raw, sock)
    return rows


def transfer_bench(count: int, repeat: int, size: int = 64 << 10) -> dict:
    """Gets/s of ``size``-byte objects: transfer engine, plain get, raw pyzmq."""
    from kvproto.runtime.client import Client

    raw, sock = _start_raw()
    procs, address = _start_store("64MiB")
    try:
        client = Client(address, timeout=60.0, local_reads=False)
        src = np.random.default_rng(64).integers(0, 256, size, dtype=np.uint8)
        key = b"bench/xfer"
        client.put(key, src)
        engine = client.transfer_engine(buffers=2, buffer_size=size)
        request = engine.request()
        expected = src.tobytes()

        def engine_gets() -> None:
            for _ in range(count):
                buf = request.acquire()
                request.get_into(key, buf, timeout=10.0)
                request.consume(buf)
                request.release(buf)

        def plain_gets() -> None:
            for _ in range(count):
                client.get(key)

        def raw_gets() -> None:
            msg = [b"get", str(size).encode()]
            for _ in range(count):
                sock.send_multipart(msg)
                sock.recv(copy=False)

        rates = {name: count / statistics.median(_timed(fn, repeat))
                 for name, fn in (("engine", engine_gets), ("get", plain_gets), ("raw", raw_gets))}
        buf = request.acquire()
        if bytes(request.consume(request.get_into(key, buf, timeout=10.0))) != expected:
            raise AssertionError("wrong bytes through the transfer engine")
        counts = engine.counts()
        if counts["stale_dropped"] or counts["timed_out"]:
            raise AssertionError(f"unexpected timeouts in the bench: {counts}")
        client.close()
    finally:
        _stop(procs, raw, sock)
    return rates


_MEMORY = r"""
import sys
from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.statemachines import lease as L, publish as P
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
n = int(sys.argv[1])
d = DirectoryCore()
leases = LeaseCore(5.0, rows=d.rows)
d.step(P.AddSegment("s0", n * 4096))
d.step(P.AddSegment("s1", n * 4096))
before = rss()
for i in range(n):
    key = b"prefix/%017d" % i
    placement = (P.Replica("s0", i * 4096, 4096), P.Replica("s1", i * 4096, 4096))
    token = d.step(P.PutStart(key, 4096, placement))[0].token
    d.step(P.PutEnd(key, token))
    leases.step(L.Put(key, (key, token), 2 * 4096))
print((rss() - before) / n)
"""


def memory_per_object(objects: int) -> float:
    out = subprocess.run([sys.executable, "-c", _MEMORY, str(objects)], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip())


def lease_bench(keys: int, repeat: int) -> list[dict]:
    """4 KiB gets, keys/s, with a read lease per key (grant, acceptance check,
    release) and without (the publish pin: read_begin/read_end), batch 1 and
    128, on the same store in the same run (the client's ``leases`` switch)."""
    from kvproto.runtime.client import Client

    procs, address = _start_store("256MiB")
    rows = []
    try:
        with Client(address, timeout=60.0, leases=True) as leased, \
                Client(address, timeout=60.0, leases=False) as pinned:
            blob = bytes(4096)
            names = [f"lease/{i}".encode() for i in range(keys)]
            for at in range(0, keys, 128):
                leased.put_many([(k, blob) for k in names[at:at + 128]])
            for batch in (1, 128):
                def run(c):
                    t0 = time.perf_counter()
                    for at in range(0, keys, batch):
                        c.get_many(names[at:at + batch])
                    return keys / (time.perf_counter() - t0)
                with_l, without = [], []
                for _ in range(repeat):           # interleaved, so drift hits both
                    with_l.append(run(leased))
                    without.append(run(pinned))
                rows.append({"batch": batch, "lease": statistics.median(with_l),
                             "pin": statistics.median(without)})
    finally:
        _stop(procs)
    return rows


def _failover_trials(url: str, trials: int, ttl: float) -> list[dict]:
    """``trials`` kills of the active master; seconds to the first put on the next."""
    from kvproto.runtime.client import Client, put_retrying
    from kvproto.runtime.coordinator import connect

    def master() -> tuple[subprocess.Popen, str]:
        p = _spawn(["-m", "kvproto", "master", "--listen", "tcp://127.0.0.1:*", "--coordinator", url,
                    "--standby", "--ttl", str(ttl), "--fence-timeout", "1", "--log-level", "WARNING"])
        return p, p.stdout.readline().split()[-1]

    coord = connect(url, ttl=ttl)
    masters: dict[str, subprocess.Popen] = {}             # address -> process
    for _ in range(2):
        proc, address = master()
        masters[address] = proc
    storage = _spawn(["-m", "kvproto", "storage", "--master", url, "--size", "64MiB"])
    storage.stdout.readline()
    client = Client(url, timeout=0.2, lookup_timeout=0.2)
    out = []
    try:
        # the first master open, with the node registered
        put_retrying(client, b"warm-up", b"w" * 4096, 30, pause=0.05)
        for trial in range(trials):
            term, address = coord.leader()
            masters.pop(address).kill()
            took = put_retrying(client, f"after-kill-{trial}".encode(), b"x" * 4096, 60)
            last = client.stats()["failover"]["last"]
            out.append({"s": took, "fence_s": last["fence_s"], "recover_s": last["recover_s"]})
            proc, addr = master()                          # the next standby
            masters[addr] = proc
    finally:
        client.close()
        _stop([storage, *masters.values()])
        coord.close()
    return out


def failover_bench(trials: int, ttl: float = 1.0) -> dict:
    """kill -9 -> first put on the new master, embedded and etcd coordinators."""
    import tempfile
    from kvproto.runtime.coordinator import LocalEtcd

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["embedded"] = _failover_trials(f"file://{tmp}/coordinator", trials, ttl)
        etcd = LocalEtcd(tmp)
        try:
            results["etcd"] = _failover_trials(f"{etcd.url}/bench", trials, ttl)
        finally:
            etcd.stop()
    return results


def _filled_storage(master: str, size: int, page: int, first: int, count: int) -> None:
    """A storage process for ``rebuild-e2e``: once registered, its node takes
    ``count`` 100-byte objects ``e2e-{first..}`` through its own command
    handlers at its master's term (``assign``: StampedAllocate and
    AssignRegion; ``write``: the bytes; ``publish``: StampedPublish with the
    checksum), 4096 a turn of its loop, as its master's put grants would have
    them; it prints ``filled`` when done and serves on. The active master
    never hears of these objects: only the standby's takeover reads them, from
    the node's index, as it reads objects put through it."""
    from kvproto.runtime.datapath import checksum
    from kvproto.runtime.embedded import _serve
    from kvproto.runtime.storage_server import StorageServer

    value = b"v" * 100
    total = checksum(value)

    class Filled(StorageServer):
        chunks = iter(range(first, first + count, 4096))

        def _timers(self) -> None:
            super()._timers()
            if self.chunks is None or not self.registered.is_set():
                return
            at = next(self.chunks, None)
            if at is None:
                self.chunks = None
                print("filled", flush=True)
                return
            core, ids = self.core, range(at, min(at + 4096, first + count))
            head = {"segment": core.segment, "term": core.term}
            keys = [f"e2e-{i:09d}".encode() for i in ids]
            offsets = [(i - first) * page for i in ids]
            results = core.handle("assign", {**head, "regions": [
                [o, len(value), k, i + 1] for o, k, i in zip(offsets, keys, ids)]}, [])[0]["results"]
            for o, i in zip(offsets, ids):
                core.handle("write", {**head, "offset": o, "token": i + 1}, [memoryview(value)])
            results += core.handle("publish", {**head, "regions": [
                [o, k, i + 1, total, 1] for o, k, i in zip(offsets, keys, ids)]}, [])[0]["results"]
            if any(status for status, _ in results):
                raise RuntimeError(f"filling the node failed: {results}")

    _serve(Filled(master, size, page_size=page), "storage", None, "WARNING")


def rebuild_e2e_bench(objects: int, nodes: int = 2) -> dict:
    """The rebuild end to end: ``objects`` small published objects on storage
    processes (each node fills its own index, :func:`_filled_storage`), the
    active master killed with SIGKILL, and the standby's takeover over TCP
    (fence with every node's index frame, decode, rebuild, purge, open), as
    the new master's own ``stats()["failover"]`` reports it."""
    import tempfile
    from kvproto import errors
    from kvproto.runtime.client import Client
    from kvproto.runtime.coordinator import connect

    page = 512
    per = -(-objects // nodes)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/coordinator"
        coord = connect(url, ttl=2.0)
        masters: dict[str, subprocess.Popen] = {}
        procs: list[subprocess.Popen] = []
        try:
            for _ in range(2):
                p = _spawn(["-m", "kvproto", "master", "--listen", "tcp://127.0.0.1:*", "--coordinator",
                            url, "--standby", "--ttl", "2", "--fence-timeout", "300",
                            "--storage-timeout", "300", "--log-level", "WARNING"])
                masters[p.stdout.readline().split()[-1]] = p
            t0 = time.perf_counter()
            for n in range(nodes):
                first, count = n * per, max(0, min(per, objects - n * per))
                procs.append(_spawn(["-c", f"from kvproto.bench import _filled_storage; "
                                     f"_filled_storage({url!r}, {(per + 1024) * page}, {page}, "
                                     f"{first}, {count})"]))
            for p in procs:
                lines = [p.stdout.readline() for _ in range(3)]   # listening, ready, filled
                if lines[-1].strip() != "filled":
                    raise RuntimeError(f"a storage node did not fill: {lines}")
            filled = time.perf_counter() - t0
            with Client(url, timeout=300.0) as client:
                term, active = coord.leader()
                masters.pop(active).kill()
                deadline = time.monotonic() + 600
                while True:
                    try:
                        failover = client.stats(timeout=5.0)["failover"]
                        if failover["term"] > term and failover["phase"] == "open":
                            break
                    except errors.KvError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the standby did not open")
                    time.sleep(0.2)
            last = failover["last"]
        finally:
            # the masters first: a storage node stopping deregisters, and the
            # master would drop its half million objects (SegmentLost) first
            _stop([*masters.values(), *procs])
            coord.close()
    return {"objects": objects, "filled_s": filled, **last,
            "objects_s": last["recovered"] / last["open_s"]}


def main(args: argparse.Namespace) -> int:
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        print(f"kvproto bench: unknown section(s) {sorted(only - set(SECTIONS))}; "
              f"choose from {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"kvproto bench (medians of {args.repeat} transfers; loopback TCP; "
          f"master and storage node in separate processes)\n")
    if "payload" in only:
        rows = payload_bench(sizes, args.repeat)
        print(f"{'size':>7} {'put GB/s':>9} {'raw put':>8} {'ratio':>6}   {'get net':>8} {'raw get':>8} "
              f"{'ratio':>6}   {'get shm':>8} {'memcpy':>7} {'ratio':>6}")
        for r in rows:
            print(f"{r['size']:>7} {r['put']:9.2f} {r['raw_put']:8.2f} {r['put'] / r['raw_put']:6.2f}   "
                  f"{r['get_net']:8.2f} {r['raw_get']:8.2f} {r['get_net'] / r['raw_get']:6.2f}   "
                  f"{r['get_shm']:8.2f} {r['memcpy']:7.2f} {r['get_shm'] / r['memcpy']:6.2f}")
        print("\nsame host (the put is a direct write into the node's segment), GB/s and "
              "ratio to the memcpy")
        print(f"{'size':>7} {'memcpy':>7}   {'put':>6} {'ratio':>6}   {'get':>6} {'ratio':>6}   "
              f"{'get_into':>8} {'ratio':>6}")
        for r in rows:
            m = r["memcpy"]
            print(f"{r['size']:>7} {m:7.2f}   {r['put']:6.2f} {r['put'] / m:6.2f}   "
                  f"{r['get_shm']:6.2f} {r['get_shm'] / m:6.2f}   "
                  f"{r['get_into']:8.2f} {r['get_into'] / m:6.2f}")
        if rows:
            f = rows[0]["fixed"]
            print(f"  per call whatever the size (4 KiB object): put {f['put'] * 1e3:.2f} ms, "
                  f"get {f['get'] * 1e3:.2f} ms, get_into {f['get_into'] * 1e3:.2f} ms")
        print()
    if "metadata" in only:
        meta = metadata_bench(args.meta_keys)
        print("4 KiB objects, keys/s (put = start + write + end; get = begin + read + end), "
              "next to raw pyzmq with the same bytes and round trips")
        for r in meta:
            print(f"  batch {r['batch']:>3}" + (f", {r['window']} in flight:" if r["window"] > 1
                                                else ":") + "".join(
                f"   {op} {r[op + '_keys_s']:,.0f} (raw {r['raw_' + op + '_keys_s']:,.0f}, "
                f"{r[op + '_keys_s'] / r['raw_' + op + '_keys_s']:.3f})" for op in ("put", "get", "exists")))
            if "put_master_us" in r:
                print("             CPU per key, master / storage node / client:" + "".join(
                    f"   {op} {r[op + '_master_us']:.1f} / {r[op + '_node_us']:.1f} / "
                    f"{r[op + '_client_us']:.1f} µs"
                    for op in ("put", "get", "exists")))
    if args.xfer_count and "transfers" in only:
        x = transfer_bench(args.xfer_count, args.xfer_repeat)
        print(f"\n64 KiB gets/s over loopback TCP (medians of {args.xfer_repeat} runs of "
              f"{args.xfer_count}): transfer engine {x['engine']:,.0f}   plain get {x['get']:,.0f}   "
              f"raw pyzmq {x['raw']:,.0f}")
        print(f"  engine / plain get {x['engine'] / x['get']:.2f}   engine / raw {x['engine'] / x['raw']:.2f}   "
              f"plain get / raw {x['get'] / x['raw']:.2f}")
    if args.lease_keys and "leases" in only:
        print(f"\n4 KiB gets, keys/s, with and without a read lease (medians of {args.lease_repeat} "
              f"runs of {args.lease_keys} keys; same store, same run)")
        for r in lease_bench(args.lease_keys, args.lease_repeat):
            print(f"  batch {r['batch']:>3}: leased {r['lease']:10,.0f}   pinned {r['pin']:10,.0f}   "
                  f"leased / pinned {r['lease'] / r['pin']:.2f}")
    if args.rebuild_objects and "rebuild" in only:
        from kvproto.bench_takeover import rebuild_bench
        r = rebuild_bench(args.rebuild_objects, replicas=args.rebuild_replicas)
        print(f"\nfailover rebuild: {r['objects']:,} published objects on 4 nodes "
              f"({args.rebuild_replicas} replica(s) each) recovered in "
              f"{r['encode_s'] + r['rebuild_s']:.2f}s ({r['objects_s']:,.0f} objects/s; nodes encode "
              f"their index {r['encode_s']:.2f}s, master decodes, rebuilds and opens {r['rebuild_s']:.2f}s)")
        if args.rebuild_repeat:
            from kvproto import bench_takeover
            bench_takeover.report(args.rebuild_objects, args.rebuild_repeat)
    if args.failover_trials and "failover" in only:
        print(f"\nkill -9 of the active master -> first successful put on the new one "
              f"({args.failover_trials} trials per coordinator, lease TTL 1 s, one storage node)")
        for name, runs in failover_bench(args.failover_trials).items():
            secs = [r["s"] for r in runs]
            print(f"  {name:>8}: median {statistics.median(secs):.2f}s   worst {max(secs):.2f}s   "
                  f"(fence median {statistics.median(r['fence_s'] for r in runs) * 1000:.1f} ms, "
                  f"recover median {statistics.median(r['recover_s'] for r in runs) * 1000:.1f} ms)")
    if args.e2e_objects and "rebuild-e2e" in only:
        r = rebuild_e2e_bench(args.e2e_objects)
        print(f"\nfailover rebuild end to end: {r['objects']:,} objects (100 B) on 2 storage processes; "
              f"after SIGKILL of the active master the standby recovered {r['recovered']:,} in "
              f"{r['open_s']:.2f}s from its term to open ({r['objects_s']:,.0f} objects/s; fence and "
              f"index transfer {r['fence_s']:.2f}s, rebuild {r['recover_s']:.2f}s; the nodes filled their "
              f"indexes in {r['filled_s']:.0f}s)")
    if "checksum" in only:
        print(f"\nobject checksums (XXH3-64), GB/s, medians of {args.repeat}; same store, same run")
        print(f"{'size':>7} {'checksum':>9} {'memcpy':>7} {'ratio':>6}   {'get shm':>8} {'verify':>7} "
              f"{'ratio':>6}   {'get net':>8} {'verify':>7} {'ratio':>6}   {'put':>6} {'no sum':>7} "
              f"{'ratio':>6}")
        for r in checksum_bench(sizes, args.repeat):
            print(f"{r['size']:>7} {r['checksum']:9.2f} {r['memcpy']:7.2f} "
                  f"{r['checksum'] / r['memcpy']:6.2f}   {r['get_shm']:8.2f} {r['verify_shm']:7.2f} "
                  f"{r['verify_shm'] / r['get_shm']:6.2f}   {r['get_net']:8.2f} {r['verify_net']:7.2f} "
                  f"{r['verify_net'] / r['get_net']:6.2f}   {r['put']:6.2f} {r['put_plain']:7.2f} "
                  f"{r['put'] / r['put_plain']:6.2f}")
    if args.loss_objects and "segment-loss" in only:
        from kvproto import bench_loss
        bench_loss.report(args.loss_objects, args.loss_repeat)
    if args.memory_objects and "memory" in only:
        per = memory_per_object(args.memory_objects)
        print(f"\nmaster memory: {per:.0f} bytes per published object, directory and lease "
              f"table ({args.memory_objects:,} objects, 2 replicas, 24-byte keys)")
    return 0
