"""Master, storage nodes and writers as separate processes on loopback."""

from __future__ import annotations

import signal
import time

import pytest

import kvproto
from kvproto import errors

from runtime_helpers import wait_for

pytestmark = pytest.mark.runtime

WRITER_TIMEOUT = 1.5
STORAGE_TIMEOUT = 1.5
SEGMENT = 8 << 20


def start_master(spawn):
    m = spawn(f"""
        import logging; logging.basicConfig(level=logging.WARNING)
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout={WRITER_TIMEOUT}, storage_timeout={STORAGE_TIMEOUT})
    """)
    line = m.readline()
    assert line.startswith("kvproto master listening on tcp://127.0.0.1:"), line
    return m, line.rsplit(" ", 1)[1]


def start_storage(spawn, master):
    s = spawn(f"""
        from kvproto.runtime.embedded import run_storage
        run_storage({master!r}, "{SEGMENT}")
    """)
    assert s.readline().startswith("kvproto storage listening on tcp://127.0.0.1:")
    return s


def live_segments(client) -> list[dict]:
    return [s for s in client.stats()["segments"].values() if s["live"]]


def storage_reads(client, raw) -> int:
    """Network reads served, summed over the live storage nodes (their own stats)."""
    return sum(raw(s["endpoint"]).call("stats", {}).body["counters"]["reads"]
               for s in live_segments(client))


@pytest.fixture
def store(children):
    master, address = start_master(children)
    storage = [start_storage(children, address) for _ in range(2)]
    client = kvproto.Client(master=address, timeout=10.0)
    wait_for(lambda: len(live_segments(client)) == 2, what="two storage nodes")
    yield address, master, storage, client
    client.close()


WRITER = """
    import sys, time
    from kvproto.runtime.client import Client
    from kvproto.runtime import datapath
    c = Client({address!r}, timeout=10.0)
    data = b"W" * {size}
    with c._activity():                       # heartbeats run, as in a real put
        deadline = time.monotonic() + 10
        rep = c._call_master("put_start", {{"client": c.client_id, "replicas": 2,
                                           "items": [[b"victim", len(data)]]}}, deadline)
        c._note_interval(rep)
        code, grant = rep.body["items"][0]
        assert code == 0, grant
        c._in_flight = (grant["token"],)      # the heartbeats name the attempt, as in a real put
        grants = {{0: (b"victim", memoryview(data), grant["token"], grant["replicas"])}}
        assert not datapath.write_all(c, grants, rep.body["segments"], deadline, rep.body["term"])
        print(grant["token"], flush=True)      # every replica written; put_end never comes
        time.sleep(120)
"""


def test_writer_killed_mid_put(store, children):
    address, _, _, client = store
    size = 1 << 20
    writer = children(WRITER.format(address=address, size=size))
    token = int(writer.readline())

    # pending: not readable, space taken, and the live writer's heartbeats keep it
    assert not client.exists(b"victim")
    with pytest.raises(errors.KeyNotFound):
        client.get(b"victim")
    time.sleep(2 * WRITER_TIMEOUT)
    stats = client.stats()
    assert stats["pending"] == 1 and stats["counters"]["reclaimed"] == 0
    assert all(s["free"] == SEGMENT - size for s in live_segments(client))

    writer.stop(signal.SIGKILL)
    wait_for(lambda: client.stats()["counters"]["reclaimed"] == 1, timeout=10 * WRITER_TIMEOUT,
             what="reclaim")
    stats = client.stats()
    assert stats["pending"] == 0 and stats["objects"] == 0
    for s in live_segments(client):
        assert s["free"] == s["allocator_free"] == SEGMENT
    with pytest.raises(errors.KeyNotFound):
        client.get(b"victim")

    # the key can be put again; the dead attempt's put_end is stale
    client.put(b"victim", b"fresh" * 1000, replicas=2)
    assert bytes(client.get(b"victim")) == b"fresh" * 1000
    assert client._call_master("put_end", {"client": "ghost", "items": [[b"victim", token]]},
                               time.monotonic() + 5).body["items"][0][0] == errors.StaleToken.code
    assert bytes(kvproto.Client(address, local_reads=False).get(b"victim")) == b"fresh" * 1000


def test_cross_process_reads_and_storage_loss(store, children, raw):
    address, _, storage, client = store
    data = bytes(range(256)) * 4096                      # 1 MiB
    client.put(b"shared", data, replicas=2)
    before = storage_reads(client, raw)
    assert bytes(client.get(b"shared")) == data          # shared memory of another process
    assert storage_reads(client, raw) == before
    with kvproto.Client(address, local_reads=False) as remote:
        assert bytes(remote.get(b"shared")) == data
    assert storage_reads(client, raw) == before + 1

    # a node that stops heartbeating is lost; when it wakes it starts over
    storage[0].proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: client.stats()["counters"]["segments_lost"] == 1,
                 timeout=10 * STORAGE_TIMEOUT, what="segment lost")
        assert bytes(client.get(b"shared")) == data      # the other replica
    finally:
        storage[0].proc.send_signal(signal.SIGCONT)
    wait_for(lambda: len(live_segments(client)) == 2, timeout=10 * STORAGE_TIMEOUT,
             what="re-registered")
    client.put(b"after-restart", data, replicas=2)
    assert bytes(client.get(b"after-restart")) == data

    # a clean shutdown deregisters at once and unlinks its memory
    storage[1].stop(signal.SIGTERM)
    assert storage[1].proc.returncode == 0, storage[1].stderr()
    wait_for(lambda: len(live_segments(client)) == 1, timeout=5, what="deregistered")
    assert "leaked" not in storage[1].stderr()


def test_servers_exit_cleanly_on_repeated_signals(children):
    master, address = start_master(children)
    node = start_storage(children, address)
    with kvproto.Client(address, timeout=10.0) as client:
        wait_for(lambda: len(live_segments(client)) == 1, what="storage registered")
        client.put(b"k", b"v" * 100000)
    for proc in (node.proc, master.proc):
        for sig in (signal.SIGTERM, signal.SIGTERM):   # as `timeout` does (child, then group)
            proc.send_signal(sig)
        assert proc.wait(10) == 0
    assert "Traceback" not in node.stderr() + master.stderr()


def test_a_put_that_timed_out_does_not_block_its_retry(children):
    """A put whose ``put_start`` timed out (the master was stopped while the
    request waited in its socket) never learned its token, yet the master
    grants the attempt when it wakes. The client abandons such an attempt
    (``put_abandon``), so a retry succeeds at once; and an attempt its client
    never names again lapses on its own deadline even while that client keeps
    working (the deadline is per attempt, not per client session)."""
    m = children("""
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout=1.0, storage_timeout=8.0)
    """)
    address = m.readline().rsplit(" ", 1)[1]
    start_storage(children, address)
    client = kvproto.Client(master=address, timeout=10.0)
    wait_for(lambda: len(live_segments(client)) == 1, what="the storage node")
    data = b"v" * 5000

    m.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(errors.RequestTimeout):
            client.put(b"a", data, timeout=0.5)
    finally:
        m.proc.send_signal(signal.SIGCONT)
    client.put(b"a", data)                                   # at once, not KeyExists
    assert bytes(client.get(b"a")) == data
    assert client.stats()["counters"]["abandoned"] == 1

    # an attempt whose token its client never received, and never abandoned
    m.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(errors.RequestTimeout):
            client._call_master("put_start", {"client": client.client_id, "replicas": 1,
                                              "items": [[b"b", len(data)]]}, time.monotonic() + 0.5)
    finally:
        m.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: client.stats()["pending"] == 1, what="the orphan attempt granted")
    started = time.monotonic()
    refusals = 0
    while True:
        client.put(b"busy-%d" % refusals, data)              # the client keeps its session busy
        try:
            client.put(b"b", data)
            break
        except errors.KeyExists:
            refusals += 1
            assert time.monotonic() - started < 5.0, "the orphan attempt never lapsed"
    assert refusals >= 1 and client.stats()["counters"]["reclaimed"] == 1
    assert bytes(client.get(b"b")) == data
    client.close()
