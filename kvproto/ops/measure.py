"""The planner's per-object figures, taken from the running system rather than guessed.

:func:`measure_metadata` starts a master and storage nodes as processes
(``python -m kvproto master`` / ``storage``), publishes objects through a
:class:`~kvproto.runtime.client.Client`, and reads each process's anonymous
resident memory (``RssAnon`` in ``/proc/PID/status``: the heap, not the
shared-memory segment) before and after: the growth per object is what the
directory, lease table, recency list and sessions cost in the master, and
what the region table and failover index cost in a storage node.

:func:`wire_overhead` encodes the messages of one batched read and one
batched write with the runtime's wire format (:mod:`kvproto.runtime.wire`)
and divides by the objects they carry: header, key and descriptor bytes per
object (ZeroMQ's framing, a few bytes per frame, is not counted).

``kvproto plan --measure N`` runs both and prints the figures; the recorded
defaults are :data:`kvproto.ops.plan.MEASURED`.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

from kvproto import errors

#: representative identifiers (lengths as the runtime makes them)
_CLIENT = "inference-host-0001:123456:0123456789ab"
_SEGMENT = "inference-host-0001:123457:01234567"
_TOKEN = 1 << 24
_OFFSET = 1 << 38


def wire_overhead(key_bytes: int = 64, replicas: int = 2, batch: int = 64,
                  object_bytes: int = 32 << 20) -> tuple[int, int]:
    """``(read, write)``: bytes on the wire besides payload per object read
    (``read_begin`` + its reply + ``release``, shares of a ``batch``, and one
    network ``read`` request and reply) and per replica written (``put_start``
    and ``put_end`` with their replies, shared by ``replicas`` replicas and a
    ``batch``, and one ``write`` request and reply)."""
    from kvproto.runtime import wire

    keys = [bytes([65 + i % 26]) * key_bytes for i in range(batch)]
    descriptors = [[_SEGMENT, _OFFSET, object_bytes] for _ in range(replicas)]
    info = ["tcp://10.0.0.1:40001", "a" * 16, "kvproto-seg-01234567", "kvproto-gen-01234567",
            1 << 40, 4096, 1 << 39]
    lookup = (wire.encode_request("read_begin", 1, {"client": _CLIENT, "keys": keys, "lease": True}),
              wire.encode_reply(1, 0, {
                  "items": [wire.ok_item({"token": _TOKEN, "length": object_bytes,
                                          "replicas": descriptors, "lease": _TOKEN, "ttl": 5.0})
                            for _ in keys],
                  "segments": {_SEGMENT: info}, "heartbeat": 2.5, "term": 1}),
              wire.encode_request("release", 2, {"client": _CLIENT, "leases": [_TOKEN] * batch}))
    read = (wire.encode_request("read", 3, {"segment": _SEGMENT, "offset": _OFFSET, "token": _TOKEN,
                                            "term": 1, "length": object_bytes}),
            wire.encode_reply(3, 0, {}))
    put = (wire.encode_request("put_start", 4, {"client": _CLIENT, "replicas": replicas,
                                                "items": [[k, object_bytes] for k in keys]}),
           wire.encode_reply(4, 0, {"items": [wire.ok_item({"token": _TOKEN, "replicas": descriptors})
                                              for _ in keys],
                                    "segments": {_SEGMENT: info}, "heartbeat": 2.5, "term": 1}),
           wire.encode_request("put_end", 5, {"client": _CLIENT, "items": [[k, _TOKEN] for k in keys]}),
           wire.encode_reply(5, 0, {"items": [wire.ok_item() for _ in keys]}))
    write = (wire.encode_request("write", 6, {"segment": _SEGMENT, "offset": _OFFSET, "token": _TOKEN,
                                              "term": 1, "owner": _CLIENT + "/put", "xfer": _TOKEN}),
             wire.encode_reply(6, 0, {}))
    per_read = sum(map(len, lookup)) / batch + sum(map(len, read))
    per_replica = sum(map(len, put)) / batch / replicas + sum(map(len, write))
    return round(per_read), round(per_replica)


def _rss_anon(pid: int) -> int:
    """Anonymous resident bytes of process ``pid`` (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError as err:
        raise errors.InvalidArgument(f"cannot read /proc/{pid}/status: {err}") from err
    raise errors.InvalidArgument("this kernel reports no RssAnon: measuring needs Linux")


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvproto", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _endpoint(proc: subprocess.Popen, role: str) -> str:
    line = proc.stdout.readline()
    if not line.startswith(f"kvproto {role} listening on "):
        raise RuntimeError(f"{role} did not start: {line!r}")
    return line.split()[-1]


def measure_metadata(objects: int = 200_000, replicas: int = 2, key_bytes: int = 64,
                     batch: int = 2048, warmup: int = 2000) -> dict:
    """Publish ``objects`` objects of one 512-byte page with ``replicas``
    replicas and ``key_bytes``-byte keys into a fresh master and ``replicas``
    storage nodes (separate processes); returns the master's and a node's
    memory growth per object, with how it was measured."""
    from kvproto.runtime.client import Client

    if objects <= 0 or replicas <= 0 or key_bytes < 8:
        raise errors.InvalidArgument("need objects > 0, replicas > 0 and keys of at least 8 bytes")
    page = 512
    procs = [_spawn("master", "--listen", "tcp://127.0.0.1:*")]
    try:
        address = _endpoint(procs[0], "master")
        size = (objects + warmup) * page * 5 // 4 + (1 << 20)   # below the eviction watermark
        for _ in range(replicas):
            procs.append(_spawn("storage", "--master", address, "--size", str(size),
                                "--page-size", str(page)))
            _endpoint(procs[-1], "storage")
        blob = bytes(page)
        with Client(address, timeout=60.0) as client:
            deadline = time.monotonic() + 30
            while sum(s["live"] for s in client.stats()["segments"].values()) < replicas:
                if time.monotonic() > deadline:
                    raise RuntimeError("storage nodes did not register")
                time.sleep(0.05)

            def fill(start: int, count: int) -> None:
                for at in range(start, start + count, batch):
                    keys = [b"%0*d" % (key_bytes, i) for i in range(at, min(at + batch, start + count))]
                    failed = [e for e in client.put_many([(k, blob) for k in keys], replicas=replicas)
                              if e is not None]
                    if failed:
                        raise failed[0]

            fill(0, warmup)                 # the structures exist; their growth is what we measure
            before = [_rss_anon(p.pid) for p in procs]
            t0 = time.perf_counter()
            fill(warmup, objects)
            seconds = time.perf_counter() - t0
            time.sleep(0.2)                 # the nodes answer publish marks after the replies
            after = [_rss_anon(p.pid) for p in procs]
            held = client.stats()["objects"]
        if held != warmup + objects:
            raise RuntimeError(f"the master holds {held} objects, not {warmup + objects}")
        nodes = [(a - b) / objects for a, b in zip(after[1:], before[1:])]
        return {"master_bytes_per_object": (after[0] - before[0]) / objects,
                "node_bytes_per_replica": sum(nodes) / len(nodes),
                "objects": objects, "replicas": replicas, "key_bytes": key_bytes,
                "put_objects_s": objects / seconds,
                "date": datetime.date.today().isoformat(),
                "command": f"kvproto plan --measure {objects}"}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
