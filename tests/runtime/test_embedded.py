"""Round trips through an embedded store (master + 2 storage nodes in threads, TCP)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvproto
from kvproto import errors

from runtime_helpers import wait_for

MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=2, segment_size="48MiB", client_timeout=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.client()


@pytest.fixture(scope="module")
def remote(cluster):
    """A client that never reads shared memory (always the network path)."""
    return cluster.client(local_reads=False)


def storage_reads(cluster) -> int:
    return sum(node.core.counters["reads"] for node in cluster.storage)


def make(kind: str, size: int, seed: int):
    raw = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    if kind == "bytes":
        return raw.tobytes()
    if kind == "bytearray":
        return bytearray(raw.tobytes())
    if kind == "memoryview":
        return memoryview(raw.tobytes())
    if kind == "numpy":
        return raw.view(np.int16) if size % 2 == 0 else raw
    raise AssertionError(kind)


def as_bytes(data) -> bytes:
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("size", [1, 4096, 8 * MiB])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy"])
def test_round_trip(cluster, client, remote, kind, size, replicas):
    key = f"rt/{kind}/{size}/{replicas}".encode()
    data = make(kind, size, hash(key) & 0xFFFF)
    client.put(key, data, replicas=replicas)
    assert client.exists(key)

    before = storage_reads(cluster)
    view = client.get(key)                       # same host: shared-memory read
    assert isinstance(view, memoryview) and view.nbytes == size
    assert bytes(view) == as_bytes(data)
    assert storage_reads(cluster) == before      # no network read was needed

    view = remote.get(key)                       # network read, zero-copy frame
    assert bytes(view) == as_bytes(data)
    assert storage_reads(cluster) == before + 1
    if isinstance(data, np.ndarray):
        assert np.array_equal(np.frombuffer(view, dtype=data.dtype), data)

    # `remote`'s read_end is fire-and-forget on another connection: it may still
    # be on its way, and until it lands the object is leased (ObjectLeased; or
    # pinned, ObjectBusy, for a read without a lease)
    remove_when_unpinned(client, key)
    assert not client.exists(key)
    with pytest.raises(errors.KeyNotFound):
        client.get(key)


def remove_when_unpinned(client, key, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.remove(key)
        except (errors.ObjectBusy, errors.ObjectLeased):   # a pin or a read lease
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def test_replicas_land_on_distinct_segments(cluster, client):
    client.put(b"two-copies", b"x" * 10000, replicas=2)
    segs = [s for s in client.stats()["segments"].values() if s["live"]]
    assert all(s["used"] >= 10000 for s in segs)
    client.remove(b"two-copies")


def test_miss_exists_and_double_put(client):
    with pytest.raises(errors.KeyNotFound):
        client.get(b"never-put")
    assert client.exists(b"never-put") is False
    with pytest.raises(errors.KeyNotFound):
        client.remove(b"never-put")
    client.put(b"once", b"first")
    with pytest.raises(errors.KeyExists):
        client.put(b"once", b"second")
    assert bytes(client.get(b"once")) == b"first"
    client.remove(b"once")
    client.put(b"once", b"third")                # the key is free again
    assert bytes(client.get(b"once")) == b"third"
    client.remove(b"once")


def test_batches_report_per_key(client):
    client.put(b"batch/taken", b"old")
    results = client.put_many([(b"batch/a", b"aaa"), (b"batch/taken", b"new"),
                               (b"batch/b", np.arange(100, dtype=np.int64)),
                               (b"batch/a", b"dup in batch"), (b"batch/empty", b"")], replicas=2)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], errors.KeyExists)
    assert isinstance(results[3], errors.KeyExists)
    assert isinstance(results[4], errors.InvalidArgument)
    # an engine can count and retry
    assert sum(r is None for r in results) == 2

    got = client.get_many([b"batch/a", b"batch/missing", b"batch/b", b"batch/taken"])
    assert bytes(got[0]) == b"aaa" and got[1] is None
    assert np.array_equal(np.frombuffer(got[2], dtype=np.int64), np.arange(100))
    assert bytes(got[3]) == b"old"
    assert client.exists_many([b"batch/a", b"batch/missing", b"batch/b"]) == [True, False, True]
    assert client.get_many([]) == [] and client.exists_many([]) == []
    for k in (b"batch/a", b"batch/b", b"batch/taken"):
        client.remove(k)


@pytest.mark.parametrize("window", [1, 4])
def test_large_batches_are_chunked(cluster, window):
    c = cluster.client(batch=1000, window=window)
    keys = [b"chunk/%05d/" % i + b"k" * 300 for i in range(2500)]   # long keys: split commands
    results = c.put_many([(k, k[:16]) for k in keys], replicas=2)
    assert results == [None] * len(keys)
    assert c.exists_many(keys) == [True] * len(keys)
    got = c.get_many(keys)
    assert all(bytes(g) == k[:16] for g, k in zip(got, keys))
    assert c.remove_many(keys) == [None] * len(keys)
    assert c.stats()["counters"]["storage_refusals"] == 0


def test_non_contiguous_and_str_keys(client):
    arr = np.arange(64, dtype=np.int32).reshape(8, 8)[:, ::2]   # not contiguous: copied once
    client.put("strkey", arr)
    assert np.array_equal(np.frombuffer(client.get(b"strkey"), dtype=np.int32).reshape(8, 4), arr)
    client.remove("strkey")
    with pytest.raises(errors.InvalidArgument):
        client.put(b"", b"x")
    with pytest.raises(errors.InvalidArgument):
        client.put(123, b"x")
    with pytest.raises(errors.InvalidArgument):
        client.put(b"k", object())
    with pytest.raises(errors.InvalidArgument):
        client.put(b"k", b"x", replicas=0)


def test_remove_refuses_pinned_and_pending(cluster, raw):
    c = cluster.client()
    c.put(b"pinned", b"bytes")
    r = raw(cluster.master_address)
    grant = r.call("read_begin", {"client": "pinner", "keys": [b"pinned"]}).body["items"][0]
    assert grant[0] == 0
    with pytest.raises(errors.ObjectBusy):
        c.remove(b"pinned")
    r.call("read_end", {"client": "pinner", "items": [[b"pinned", grant[1]["token"]]]})
    c.remove(b"pinned")
    start = r.call("put_start", {"client": "slow", "replicas": 1, "items": [[b"pending", 5]]})
    token = start.body["items"][0][1]["token"]
    with pytest.raises(errors.NotPublished):
        c.remove(b"pending")
    assert not c.exists(b"pending")
    with pytest.raises(errors.KeyNotFound):
        c.get(b"pending")                        # only published objects are readable
    r.call("put_revoke", {"client": "slow", "items": [[b"pending", token]]})


def test_remove_many_answers_each_key(cluster, raw):
    """Several requests (``batch`` 3), each key's own answer: removed,
    missing, pinned; the store frees what it removed (the storage nodes'
    batched free included: 40 keys a request)."""
    c = cluster.client(batch=3)
    c.put(b"pinned", b"bytes")
    r = raw(cluster.master_address)
    grant = r.call("read_begin", {"client": "pinner", "keys": [b"pinned"]}).body["items"][0]
    assert c.put_many([(b"rm/%d" % i, b"v" * 100) for i in range(4)]) == [None] * 4
    got = c.remove_many([b"rm/0", b"nothing", b"pinned", b"rm/1", b"rm/2", b"rm/3", b"rm/1"])
    assert [type(e).__name__ if e else None for e in got] == [
        None, "KeyNotFound", "ObjectBusy", None, None, None, "KeyNotFound"]
    assert c.exists_many([b"rm/0", b"pinned", b"rm/3"]) == [False, True, False]
    r.call("read_end", {"client": "pinner", "items": [[b"pinned", grant[1]["token"]]]})
    assert c.remove_many([]) == []
    big = cluster.client()
    keys = [b"rm/big/%d" % i for i in range(40)]
    assert big.put_many([(k, b"w" * 4096) for k in keys], replicas=2) == [None] * 40
    assert big.remove_many([*keys, b"pinned"]) == [None] * 41
    assert big.stats()["objects"] == 0


def test_a_revoked_writer_cannot_publish_the_next_attempt(cluster, raw):
    """``PutEnd`` publishes only the attempt its token names (spec
    ``TokenOwns``): a writer whose attempt was revoked, ending its put after
    another writer started one on the same key and wrote its bytes, gets
    ``StaleToken`` and publishes nothing; the other writer's own end then
    publishes its object."""
    c = cluster.client()
    r = raw(cluster.master_address)
    first = r.call("put_start", {"client": "w1", "replicas": 1, "items": [[b"taken", 4096]]})
    t1 = first.body["items"][0][1]["token"]
    assert r.call("put_revoke", {"client": "w1", "items": [[b"taken", t1]]}).body["items"][0][0] == 0
    second = r.call("put_start", {"client": "w2", "replicas": 1, "items": [[b"taken", 4096]]})
    grant = second.body["items"][0][1]
    t2 = grant["token"]
    assert t2 > t1
    ((seg, off, length),) = grant["replicas"]
    node = raw(second.body["segments"][seg][0])
    wrote = node.call("write", {"segment": seg, "offset": off, "token": t2,
                                "term": second.body["term"]}, [b"2" * length])
    assert wrote.status == 0, wrote.body
    ended = r.call("put_end", {"client": "w1", "items": [[b"taken", t1]]})
    assert ended.body["items"][0][0] == errors.StaleToken.code
    assert not c.exists(b"taken")
    with pytest.raises(errors.KeyNotFound):
        c.get(b"taken")
    ended = r.call("put_end", {"client": "w2", "items": [[b"taken", t2]]})
    assert ended.body["items"][0][0] == 0
    assert bytes(c.get(b"taken")) == b"2" * 4096
    remove_when_unpinned(c, b"taken")


def test_a_get_with_a_stale_descriptor_looks_up_again(cluster):
    """A node refuses a read stamped with an older term than its own
    (``StaleTerm``: the descriptor came from a master since replaced); the
    client then finds the current master and looks the key up once more,
    rather than missing. The stale reply is made here by lowering the term of
    the first lookup's reply, as a deposed master's would be."""
    c = cluster.client(local_reads=False)         # a same-host read carries no term
    c.put(b"stale-term", b"t" * 5000)
    lookup, replies = c._lookup, []

    def from_a_deposed_master(op, *args, **kwargs):
        reply = lookup(op, *args, **kwargs)
        replies.append(reply.body["term"])
        if op == "read_begin" and len(replies) == 1:
            reply.body["term"] -= 1
        return reply

    c._lookup = from_a_deposed_master
    assert bytes(c.get(b"stale-term")) == b"t" * 5000
    assert len(replies) == 2 and c.failover_counters["stale_term_relookups"] == 1
    c.remove(b"stale-term")


def test_region_reuse_after_free(cluster, client):
    for i in range(20):
        payload = bytes([i]) * 5000
        client.put(b"reuse", payload, replicas=2)
        assert bytes(client.get(b"reuse")) == payload
        client.remove(b"reuse")
    stats = client.stats()
    for s in stats["segments"].values():
        if s["live"]:
            assert s["allocator_free"] == s["free"]


def test_threads_with_own_clients(cluster):
    errs = []

    def worker(n):
        try:
            c = cluster.client()
            for i in range(15):
                key = f"t{n}/{i}".encode()
                data = np.full(70000 + i, n, dtype=np.uint8)
                c.put(key, data, replicas=1 + (i % 2))
                assert bytes(c.get(key)) == data.tobytes()
                c.remove(key)
        except BaseException as exc:  # pragma: no cover - reported below
            errs.append(exc)
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errs, errs


def test_stats_counters(client):
    before = client.stats()["counters"]
    client.put(b"counted", b"1")
    client.get(b"counted")
    client.get_many([b"counted-miss"])
    client.remove(b"counted")
    after = client.stats()["counters"]
    for name, delta in [("puts_started", 1), ("puts_published", 1), ("reads", 1), ("misses", 1),
                        ("removes", 1)]:
        assert after[name] - before[name] == delta, name


def test_no_space():
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB") as small:
        c = small.client()
        with pytest.raises(errors.NoSpace):
            c.put(b"too-big", b"x" * (2 * MiB))
        with pytest.raises(errors.NoSpace):
            c.put(b"two-copies", b"x", replicas=2)   # only one segment
        c.put(b"a", b"x" * (600 << 10))
        with pytest.raises(errors.NoSpace):
            c.put(b"b", b"y" * (600 << 10))
        assert isinstance(c.put_many([(b"c", b"z" * (300 << 10)), (b"d", b"w" * (300 << 10))])[1],
                          errors.NoSpace)
        c.remove(b"a")
        c.put(b"b", b"y" * (600 << 10))              # space came back
        seg = next(iter(c.stats()["segments"].values()))
        assert seg["allocator_free"] == seg["free"] == MiB - (600 << 10) - (300 << 10)


def test_segment_lost_drops_single_replicas_keeps_others():
    with kvproto.embedded(storage_nodes=2, segment_size="4MiB") as cl:
        c = cl.client()
        c.put(b"both", b"B" * 9000, replicas=2)
        singles = [f"one{i}".encode() for i in range(6)]
        for k in singles:
            c.put(k, b"S" * 9000, replicas=1)
        cl._threads[1].stop()                    # storage node 0 deregisters: SegmentLost
        wait_for(lambda: sum(s["live"] for s in c.stats()["segments"].values()) == 1,
                 what="segment lost")
        assert bytes(c.get(b"both")) == b"B" * 9000
        remote = cl.client(local_reads=False)
        assert bytes(remote.get(b"both")) == b"B" * 9000
        survived = [k for k, v in zip(singles, c.get_many(singles)) if v is not None]
        assert 0 < len(survived) < len(singles)      # placement spread them over both nodes
        stats = c.stats()
        assert stats["counters"]["segments_lost"] == 1
        assert stats["objects"] == 1 + len(survived)


def test_dead_master_times_out_without_wedging():
    c = kvproto.Client("tcp://127.0.0.1:1", timeout=0.3)   # nothing listens there
    try:
        for _ in range(2):
            t = time.monotonic()
            with pytest.raises(errors.RequestTimeout):
                c.put(b"k", b"v")
            assert time.monotonic() - t < 5.0
        # a lookup the master does not answer by a short deadline is a miss while
        # it has been silent for less than lookup_timeout (2 s; past it:
        # MasterUnreachable, see test_usability.py)
        with pytest.raises(errors.KeyNotFound):
            c.get(b"k", timeout=0.2)
        assert c.get_many([b"k"], timeout=0.2) == [None]
        assert c.failover_counters["switch_misses"] == 2
    finally:
        c.close()


def test_run_master_and_run_storage_stop_on_event():
    import socket as _socket
    from kvproto.runtime.embedded import run_master, run_storage
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()
    threads = [threading.Thread(target=run_master, args=(address,), kwargs={"stop": stop}),
               threading.Thread(target=run_storage, args=(address, "1MiB"), kwargs={"stop": stop})]
    for t in threads:
        t.start()
    try:
        with kvproto.Client(address, timeout=5.0) as c:
            wait_for(lambda: any(s["live"] for s in c.stats()["segments"].values()), what="register")
            c.put(b"k", b"v")
            assert bytes(c.get(b"k")) == b"v"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("kind", ["bytearray", "numpy", "memoryview", "torch"])
def test_get_into_caller_memory(cluster, client, remote, kind):
    """``get_into`` reads into the caller's own memory: from a same-host
    replica with one memcpy, from a remote one with one copy out of the frame;
    ``get_many_into`` gives the byte count per key and None for a miss."""
    size = 3 * 4096 + 17
    key = f"into/{kind}".encode()
    data = make("bytes", size, 7)
    client.put(key, data)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        bufs = [torch.empty(size + 5, dtype=torch.uint8) for _ in range(2)]
        as_b = lambda b: bytes(b.numpy()[:size])                      # noqa: E731
    elif kind == "numpy":
        bufs = [np.zeros(size + 5, dtype=np.uint8) for _ in range(2)]
        as_b = lambda b: b[:size].tobytes()                           # noqa: E731
    elif kind == "memoryview":
        bufs = [memoryview(bytearray(size + 5)) for _ in range(2)]
        as_b = lambda b: bytes(b[:size])                              # noqa: E731
    else:
        bufs = [bytearray(size + 5) for _ in range(2)]
        as_b = lambda b: bytes(b[:size])                              # noqa: E731
    before = storage_reads(cluster)
    assert client.get_into(key, bufs[0]) == size
    assert as_b(bufs[0]) == data and storage_reads(cluster) == before     # same host: no network read
    assert remote.get_into(key, bufs[1]) == size
    assert as_b(bufs[1]) == data and storage_reads(cluster) == before + 1
    assert client.get_many_into([key, b"into/missing"], [bufs[0], bytearray(10)]) == [size, None]
    with pytest.raises(errors.KeyNotFound):
        client.get_into(b"into/missing", bufs[0])
    with pytest.raises(errors.InvalidArgument):
        client.get_into(key, bytearray(size - 1))                     # too small: nothing read
    with pytest.raises(errors.InvalidArgument):
        client.get_into(key, b"read-only" * 10000)
    remove_when_unpinned(client, key)
