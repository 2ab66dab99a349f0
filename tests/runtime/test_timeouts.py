"""The Timeout protocol on the real runtime: the client's transfer engine
(``kvproto.runtime.transfers``) against storage nodes with test-only faults
(delay, late replies, duplicates, drops), in an embedded cluster on loopback.

Every wait is bounded; delays are a few hundred milliseconds."""

from __future__ import annotations

import time

import pytest

import kvproto
from kvproto import errors
from kvproto.runtime import datapath

from runtime_helpers import wait_for

KiB = 1 << 10
SIZE = 16 * KiB


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB", client_timeout=10.0,
                          storage_debug=True) as c:
        yield c


@pytest.fixture
def node(cluster):
    node = cluster.storage[0]
    yield node
    for name in node.FAULTS:
        node.faults[name] = 0


@pytest.fixture
def client(cluster):
    c = cluster.client(local_writes=False)     # writes cross the network: they can time out
    yield c
    c.close()


def blob(tag: int, size: int = SIZE) -> bytes:
    return bytes((tag * 31 + i) % 251 for i in range(size))


def put(client, key: bytes, data: bytes) -> bytes:
    client.put(key, data)
    return data


def counters(node) -> dict:
    return dict(node.core.counters)


def test_timeout_raised_within_the_deadline_and_buffer_quarantined_until_ack(client, node):
    """Storage node slow to run the load: the caller gets TransferTimeout at its
    deadline, the buffer is quarantined (handed to no one), the cancel stops the
    transfer and its ack drains the buffer; the stopped load never writes."""
    data = put(client, b"slow", blob(1))
    engine = client.transfer_engine(buffers=1, buffer_size=SIZE)
    before = counters(node)
    node.faults["delay_ms"] = 400
    r1 = engine.request()
    buf = r1.acquire()
    t0 = time.monotonic()
    with pytest.raises(errors.TransferTimeout):
        client.get_into(b"slow", buf, timeout=0.15)
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed < 0.15 + 0.5
    counts = engine.counts()
    assert counts["timed_out"] == 1 and counts["quarantined"] + counts["free"] == 1
    # quarantined at once (unless the ack already came): no other request can take it
    if counts["quarantined"]:
        with pytest.raises(errors.BufferBusy):
            engine.request().acquire()
    with pytest.raises((errors.BufferQuarantined, errors.BufferBusy)):
        r1.consume(buf)
    # the cancel's ack drains it (long before the 400 ms delay ends)
    assert r1.drain(2.0)
    assert engine.counts()["free"] == 1 and engine.counts()["quarantined"] == 0
    assert counters(node)["cancels"] == before["cancels"] + 1
    # the held load comes due and is discarded, never sent
    wait_for(lambda: counters(node)["discarded"] == before["discarded"] + 1, 3.0, what="discard")
    assert bytes(engine.pool.view(buf.name)) == bytes(SIZE)
    assert engine.counts()["stale_dropped"] == 0
    node.faults["delay_ms"] = 0
    r2 = engine.request()
    b2 = r2.acquire()
    assert bytes(r2.consume(r2.get_into(b"slow", b2, timeout=2.0))) == data


def test_late_completion_never_lands_in_a_reassigned_buffer(client, node):
    """The node ran the load but its bytes are late on the network; the cancel
    ack overtakes them and drains the buffer, which is then reassigned and
    loaded with other bytes. The late completion is recognised by generation,
    dropped and counted: it never writes the reassigned buffer."""
    put(client, b"late/old", blob(2))
    new = put(client, b"late/new", blob(3))
    engine = client.transfer_engine(buffers=1, buffer_size=SIZE)
    node.faults["reply_delay_ms"] = 400
    r1 = engine.request()
    buf = r1.acquire()
    with pytest.raises(errors.TransferTimeout):
        r1.get_into(b"late/old", buf, timeout=0.1)
    assert r1.drain(2.0)                        # by the ack: the node says it landed
    node.faults["reply_delay_ms"] = 0
    r2 = engine.request()
    b2 = r2.acquire()
    assert b2.name == buf.name                  # the same memory, reassigned
    r2.get_into(b"late/new", b2, timeout=2.0)
    assert engine.counts()["stale_dropped"] == 0
    wait_for(lambda: engine.counts()["stale_dropped"] == 1, 3.0, what="late completion")
    assert bytes(engine.pool.view(b2.name)) == new
    assert bytes(r2.consume(b2)) == new


def test_late_completion_of_a_written_off_transfer_recovers_the_buffer(client, node):
    """With no cancel allowed (max_cancels=0) a timed-out load is written off at
    once: its buffer goes on the leak ledger, the request drains and ends; the
    late completion brings the buffer back (recovered), without using the bytes."""
    put(client, b"wo", blob(4))
    engine = client.transfer_engine(buffers=2, buffer_size=SIZE, max_cancels=0, max_leaked=1)
    node.faults["reply_delay_ms"] = 300
    r = engine.request()
    buf = r.acquire()
    with pytest.raises(errors.TransferTimeout):
        r.get_into(b"wo", buf, timeout=0.1)
    assert r.drain(1.0)
    c = engine.counts()
    assert c["leaked"] == 1 and c["written_off"] == 1 and c["free"] == 1
    r.cancel()
    assert r.ended
    wait_for(lambda: engine.counts()["recovered"] == 1, 3.0, what="recovery")
    c = engine.counts()
    assert c["leaked"] == 0 and c["free"] == 2 and c["transfers"] == 0


def test_duplicate_completions_are_idempotent(client, node):
    """Every completion is sent twice, the copy late: the first loads the
    buffer, the copy arrives after the buffer was reassigned and is dropped."""
    a = put(client, b"dup/a", blob(5))
    b = put(client, b"dup/b", blob(6))
    engine = client.transfer_engine(buffers=1, buffer_size=SIZE)
    node.faults.update(duplicate=1, duplicate_delay_ms=300)
    r1 = engine.request()
    buf = r1.acquire()
    assert bytes(r1.consume(r1.get_into(b"dup/a", buf, timeout=2.0))) == a
    r1.finish()
    r2 = engine.request()
    b2 = r2.acquire()
    r2.get_into(b"dup/b", b2, timeout=2.0)
    wait_for(lambda: engine.counts()["stale_dropped"] == 1, 3.0, what="duplicate")
    assert bytes(r2.consume(b2)) == b
    assert counters(node)["duplicated"] >= 1


def test_cancelling_a_request_with_100_loads_in_flight_drains_to_zero(client, node):
    keys = [f"many/{i}".encode() for i in range(100)]
    assert client.put_many([(k, blob(i, 4 * KiB)) for i, k in enumerate(keys)]) == [None] * 100
    engine = client.transfer_engine(buffers=100, buffer_size=4 * KiB)
    before = counters(node)
    # every load is still held when the request is cancelled: 2 s is longer
    # than issuing the 100 takes on a loaded machine (held 300 ms, 73 of
    # them had completed first in one run of the suite)
    node.faults["delay_ms"] = 2000
    r = engine.request()
    transfers = [r.load(k, r.acquire(), timeout=10.0) for k in keys]
    assert engine.counts()["loading"] == 100
    r.cancel()
    assert not r.active
    assert r.drain(5.0)
    assert r.ended
    c = engine.counts()
    assert (c["free"], c["held"], c["quarantined"], c["leaked"], c["transfers"], c["requests"]) == \
        (100, 0, 0, 0, 0, 0)
    for t in transfers:
        with pytest.raises(errors.RequestNotActive):
            t.wait()
    assert counters(node)["cancels"] - before["cancels"] == 100
    wait_for(lambda: counters(node)["discarded"] - before["discarded"] == 100, 5.0, what="discards")
    assert bytes(engine.pool.memory) == bytes(100 * 4 * KiB)     # nothing was ever written


def test_dropped_reply_is_recovered_by_cancel_and_ack(client, node):
    data = put(client, b"drop", blob(7))
    engine = client.transfer_engine(buffers=1, buffer_size=SIZE)
    node.faults["drop"] = 1
    r = engine.request()
    buf = r.acquire()
    with pytest.raises(errors.TransferTimeout):
        r.get_into(b"drop", buf, timeout=0.2)
    assert r.drain(2.0)
    assert engine.counts()["free"] == 1 and counters(node)["dropped"] >= 1
    b2 = r.acquire()
    assert bytes(r.consume(r.get_into(b"drop", b2, timeout=2.0))) == data
    assert engine.counts()["stale_dropped"] == 0


def test_put_timeout_cancels_and_discards_the_write(client, node):
    before = counters(node)
    node.faults["delay_ms"] = 400
    t0 = time.monotonic()
    with pytest.raises(errors.TransferTimeout):
        client.put(b"slow-put", blob(8), timeout=0.15)
    assert time.monotonic() - t0 < 0.15 + datapath.CANCEL_GRACE + 0.5
    assert counters(node)["cancels"] == before["cancels"] + 1
    assert not client.exists(b"slow-put")            # revoked at the master
    wait_for(lambda: counters(node)["discarded"] == before["discarded"] + 1, 3.0, what="discard")
    assert counters(node)["writes"] == before["writes"]
    node.faults["delay_ms"] = 0
    client.put(b"slow-put", blob(9))
    assert bytes(client.get(b"slow-put")) == blob(9)


def test_usable_prefix_stops_at_the_first_gap(client, node):
    put(client, b"chunk/0", blob(10))
    put(client, b"chunk/2", blob(12))
    put(client, b"chunk/3", blob(13))
    engine = client.transfer_engine(buffers=4, buffer_size=SIZE)
    r = engine.request()
    b0, b1, b2, b3 = (r.acquire() for _ in range(4))
    r.get_into(b"chunk/0", b0, timeout=2.0)
    with pytest.raises(errors.KeyNotFound):
        r.get_into(b"chunk/1", b1, timeout=2.0)     # a miss: nothing issued
    r.get_into(b"chunk/2", b2, timeout=2.0)
    node.faults["delay_ms"] = 300
    t3 = r.load(b"chunk/3", b3, timeout=5.0)
    plan = r.usable_prefix([b0, b1, b2, b3])
    assert plan.usable == 1 and plan.recompute == (1, 2, 3)
    assert plan.keep == {b0.name} and plan.quarantine == {b3.name}
    assert plan.release == {b1.name, b2.name}
    assert engine._plan([b3], 1).quarantine == {b3.name}
    assert bytes(r.consume(b0)) == blob(10)
    r.cancel()                                      # chunk 3 is abandoned, not awaited
    with pytest.raises(errors.RequestNotActive):
        t3.wait()
    assert r.drain(2.0) and engine.counts()["free"] == 4


def test_no_wrong_bytes_under_mixed_faults(client, node):
    """Loads with random late replies and tight deadlines into a small pool:
    whatever is consumed is exactly the key's bytes; everything drains."""
    import random
    rng = random.Random(7)
    values = {f"mix/{i}".encode(): put(client, f"mix/{i}".encode(), blob(20 + i, 8 * KiB))
              for i in range(6)}
    engine = client.transfer_engine(buffers=3, buffer_size=8 * KiB, cancel_interval=0.05)
    ok = timeouts = 0
    for _ in range(24):
        node.faults["reply_delay_ms"] = rng.choice([0, 0, 120])
        r = engine.request()
        try:
            buf = r.acquire()
        except errors.BufferBusy:
            assert engine.wait_idle(3.0)
            buf = r.acquire()
        key = rng.choice(list(values))
        try:
            r.get_into(key, buf, timeout=rng.choice([0.05, 0.5]))
        except errors.TransferTimeout:
            timeouts += 1
        else:
            assert bytes(r.consume(buf)) == values[key]
            ok += 1
        r.cancel()
    node.faults["reply_delay_ms"] = 0
    assert ok and timeouts
    assert engine.wait_idle(5.0)
    c = engine.counts()
    assert (c["free"], c["quarantined"], c["leaked"], c["requests"]) == (3, 0, 0, 0)


def test_debug_op_exists_only_when_enabled(raw):
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB") as plain:
        reply = raw(plain.storage[0].endpoint).call("debug", {"delay_ms": 5})
        assert isinstance(reply.error(), errors.UnknownMessage)
        assert plain.storage[0].faults["delay_ms"] == 0


def test_debug_op_sets_faults(cluster, node, raw):
    reply = raw(node.endpoint).call("debug", {"drop": 0, "reply_delay_ms": 7})
    assert reply.status == 0 and reply.body["reply_delay_ms"] == 7
    assert node.faults["reply_delay_ms"] == 7


def test_node_transfer_table_stays_bounded_over_500_loads(client, node):
    """500 loads through one engine, 10 at a time: plain rounds, rounds held at
    the node and timed out (the cancel stops them there), rounds whose replies
    are late (the cancel reaches a node that already ran and forgot them, and is
    acknowledged all the same). The node forgets every transfer that landed or
    was stopped, so its table never holds more than the loads in flight and is
    empty (the engine's entry gone) when none is; nothing is written off."""
    KEY, N, ROUNDS = b"bounded", 10, 50
    data = put(client, KEY, blob(40, 4 * KiB))
    engine = client.transfer_engine(buffers=N, buffer_size=4 * KiB, cancel_interval=0.05)
    r = engine.request()
    held_peak = ok = timeouts = 0
    for rnd in range(ROUNDS):
        held, late = rnd % 10 == 3, rnd % 10 == 7
        node.faults["delay_ms"] = 300 if held else 0
        node.faults["reply_delay_ms"] = 150 if late else 0
        bufs = [r.acquire() for _ in range(N)]
        loads = [r.load(KEY, b, timeout=0.05 if held or late else 5.0) for b in bufs]
        if held:   # all N arrived and wait at the node: the table holds exactly them
            wait_for(lambda: node.core.xfer_records() == N, 2.0, what="held loads")
            held_peak = max(held_peak, node.core.xfer_records())
            assert len(node.core.xfers.get(engine.owner).transfers) == N
        for t, b in zip(loads, bufs):
            try:
                t.wait()
            except errors.TransferTimeout:
                timeouts += 1       # quarantined; the cancel's ack frees it
            else:
                assert bytes(r.consume(b)) == data
                r.release(b)
                ok += 1
        assert engine.wait_idle(3.0)
        assert node.core.xfer_records() <= N
    node.faults["delay_ms"] = node.faults["reply_delay_ms"] = 0
    assert ok + timeouts == ROUNDS * N and ok >= 40 * N and timeouts >= 5 * N
    assert held_peak == N
    wait_for(lambda: node.core.xfer_records() == 0, 3.0, what="empty table")
    assert engine.owner not in node.core.xfers
    c = engine.counts()
    assert (c["free"], c["quarantined"], c["leaked"], c["written_off"]) == (N, 0, 0, 0)
