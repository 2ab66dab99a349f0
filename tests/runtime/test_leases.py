"""Read leases in the runtime (``spec/Lease.tla``, docs/protocols/lease.md):
grants with every get, the reader's acceptance check, ``ObjectLeased`` on
remove (and ``force``), watermark eviction that skips leased objects, and the
counters. Real embedded clusters on loopback, each bounded to a few seconds."""

from __future__ import annotations

import time

import pytest

import kvproto
from kvproto import errors

from runtime_helpers import space_returned

KiB = 1 << 10


def counters(c):
    s = c.stats()
    return s["counters"], s["client"]


def test_a_read_slower_than_its_lease_is_rejected_and_classified():
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", storage_debug=True,
                          lease_ttl=0.3) as cluster:
        writer = cluster.client()
        reader = cluster.client(local_reads=False)       # the network path
        writer.put(b"slow", b"a" * (64 * KiB))
        node = cluster.storage[0]
        node.faults["read_delay_ms"] = 600               # the transfer outlives the lease
        with pytest.raises(errors.LeaseExpired):
            reader.get(b"slow")
        with pytest.raises(errors.LeaseExpired):
            reader.get_many([b"slow", b"missing"])
        master, client = counters(reader)
        assert client["lease_rejected"] == 2
        assert client["rejected_network-slow"] == 2       # the transfer overran its budget
        assert reader.last_read.transferring >= 0.5
        assert master["lease_grants"] >= 2
        assert node.core.counters["reads_delayed"] == 2
        node.faults["read_delay_ms"] = 0
        assert bytes(reader.get(b"slow")) == b"a" * (64 * KiB)   # in time: accepted
        assert counters(reader)[1]["lease_accepted"] == 1


def test_remove_of_a_leased_object_is_refused_and_force_works(caplog):
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=30) as cluster:
        c = cluster.client()
        other = cluster.client()
        c.put(b"held", b"x" * 100)
        c.put(b"held2", b"y" * 100)
        (lease,) = other.read_begin([b"held"])
        assert lease.ttl == 30 and lease.length == 100
        with pytest.raises(errors.ObjectLeased):
            c.remove(b"held")
        assert c.exists(b"held")
        with caplog.at_level("WARNING", logger="kvproto.master"):
            c.remove(b"held", force=True)
        assert any("forced remove" in r.message for r in caplog.records)
        assert not c.exists(b"held")
        with pytest.raises(errors.LeaseExpired):        # the forced remove ended it
            other.release([lease])
        # release ends protection without deleting
        (lease2,) = other.read_begin([b"held2"])
        assert other.renew([lease2]) == [None]
        other.release([lease2])
        assert c.exists(b"held2")
        c.remove(b"held2")
        master, _ = counters(c)
        assert master["removes_forced"] == 1 and master["leased_refusals"] == 1
        assert master["lease_renewals"] == 1 and master["lease_releases"] >= 1


def test_an_expired_lease_cannot_be_renewed_and_no_longer_protects():
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=0.2) as cluster:
        c = cluster.client()
        c.put(b"k", b"v")
        (lease,) = c.read_begin([b"k"])
        time.sleep(0.35)
        (err,) = c.renew([lease])
        assert isinstance(err, errors.LeaseExpired)
        c.remove(b"k")                                   # expiry: no longer protected
        master, client = counters(c)
        assert master["lease_expiries"] >= 1 and client["renewals_refused"] == 1


def test_eviction_spares_leased_objects_and_takes_them_after_release():
    size = 100 * KiB
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB", lease_ttl=30) as cluster:
        c = cluster.client()
        keys = [f"ev{i}".encode() for i in range(12)]
        for k in keys[:9]:                                # 900 KiB of 1 MiB: under 0.90
            c.put(k, k * (size // len(k)) + b"." * (size % len(k)))
        (lease,) = c.read_begin([keys[0]])               # ev0: held, and least recent below
        for k in keys[1:9]:
            c.get(k)
        c.put(keys[9], b"9" * size)                      # past the watermark
        assert c.exists(keys[0])                         # leased: spared
        assert not c.exists(keys[1]) and not c.exists(keys[2])   # the LRU unleased ones
        assert all(c.exists_many(keys[3:10]))
        master, _ = counters(c)
        assert master["evictions"] == 2
        space_returned(c)
        c.release([lease])
        c.put(keys[10], b"a" * size)
        c.put(keys[11], b"b" * size)                     # past the watermark again
        assert not c.exists(keys[0])                     # released: now the LRU victim
        assert counters(c)[0]["evictions"] >= 3
        stats = c.stats()
        assert stats["leases"]["used"] <= 0.90 * stats["leases"]["capacity"]


def test_a_gets_lease_is_released_with_the_next_request_or_when_the_client_goes_quiet():
    """A get's lease is not released by a message of its own: the release
    rides on the client's next lookup, goes before any other request of that
    client (so its own remove is never refused), and is sent by the heartbeat
    thread once no call runs (so another client's remove soon succeeds)."""
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=30.0) as cluster:
        a, b = cluster.client(), cluster.client()
        for k in (b"x", b"y", b"z"):
            a.put(k, b"v" * 1000)
        a.get(b"x")
        assert a._unreleased                                # held back
        a.get(b"y")                                         # x's release rides on this lookup
        m, _ = counters(b)
        assert m["lease_releases"] >= 1 and len(a._unreleased) == 1
        a.remove(b"y")                                      # y's release goes first: not ObjectLeased
        a.get(b"z")
        deadline = time.monotonic() + 2.0                   # far below the 30 s TTL
        while True:
            try:
                b.remove(b"z")                              # another client's remove
                break
            except errors.ObjectLeased:
                assert time.monotonic() < deadline, "the quiet client never released its lease"
                time.sleep(0.02)
        assert not a._unreleased


def test_flush_releases_lets_another_client_remove_at_once():
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=30.0) as cluster:
        a, b = cluster.client(), cluster.client()
        a.put(b"k", b"v" * 1000)
        a.get(b"k")
        a.flush_releases()                                  # not left to the heartbeat thread
        assert not a._unreleased
        b.remove(b"k")


def test_a_lease_is_timed_from_the_request_not_the_reply():
    """The master grants the lease somewhere between the request's send and
    the reply's arrival, so the reader's deadline runs from the send
    (``spec/Lease.tla`` ``ReaderAccepts``; weakened: Lease_Weak_DeadlineFromReply).
    A read_begin reply delayed past the TTL (here: held back in the client, as
    a slow network would) leaves a transfer that is quick itself rejected."""
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=0.4) as cluster:
        writer = cluster.client()
        reader = cluster.client(local_reads=False)
        writer.put(b"late", b"r" * (4 * KiB))
        lookup = reader._lookup

        def reply_arrives_late(op, *args, **kwargs):
            reply = lookup(op, *args, **kwargs)
            if op == "read_begin":
                time.sleep(0.6)                        # past the lease, before the transfer
            return reply

        reader._lookup = reply_arrives_late
        with pytest.raises(errors.LeaseExpired):
            reader.get(b"late")
        _, client = counters(reader)
        assert client["lease_rejected"] == 1 and client["lease_accepted"] == 0
        assert reader.last_read.queued >= 0.5 and reader.last_read.transferring < 0.4
        reader._lookup = lookup
        assert bytes(reader.get(b"late")) == b"r" * (4 * KiB)


def test_lookups_in_flight_are_timed_from_their_requests():
    """The same for a ``get_many`` whose lookups are in flight together
    (``window``): each read is judged from when its own request was sent, so
    replies that arrive late reject quick transfers."""
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=0.4) as cluster:
        writer = cluster.client()
        reader = cluster.client(local_reads=False, batch=1, window=2)
        keys = [b"late/0", b"late/1"]
        assert writer.put_many([(k, b"r" * (4 * KiB)) for k in keys]) == [None, None]
        awaited = reader._await_master

        def reply_arrives_late(*args):
            reply = awaited(*args)
            time.sleep(0.6)                            # past the lease, before the transfer
            return reply

        reader._await_master = reply_arrives_late
        with pytest.raises(errors.LeaseExpired):
            reader.get_many(keys)
        _, client = counters(reader)
        assert client["lease_rejected"] >= 1 and client["lease_accepted"] == 0
        reader._await_master = awaited
        assert [bytes(v) for v in reader.get_many(keys)] == [b"r" * (4 * KiB)] * 2


def test_a_transfer_within_the_ttl_but_not_within_the_skew_margin_is_rejected():
    """The reader keeps a transfer only if it completed before ``ttl -
    max_skew`` on its own clock (a slow clock measures too little;
    weakened: Lease_Weak_IgnoreSkew). A transfer of about 0.3 s under a 2 s
    lease is kept by a reader that bounds its skew at 2 ms and rejected by one
    that allows 1.9 s."""
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", storage_debug=True,
                          lease_ttl=2.0) as cluster:
        writer = cluster.client()
        careful = cluster.client(local_reads=False, max_skew=1.9)
        usual = cluster.client(local_reads=False)
        writer.put(b"skew", b"s" * (4 * KiB))
        cluster.storage[0].faults["read_delay_ms"] = 300
        with pytest.raises(errors.LeaseExpired):
            careful.get(b"skew")
        assert counters(careful)[1]["lease_rejected"] == 1
        assert careful.last_read.transferring >= 0.25
        assert bytes(usual.get(b"skew")) == b"s" * (4 * KiB)
        assert counters(usual)[1]["lease_accepted"] == 1


def test_the_heartbeat_threads_release_goes_before_the_clients_next_request():
    """When the heartbeat thread sends the held-back releases, it sends them
    on the client's own connection: a remove the client sends next cannot
    reach the master before them and be refused as ``ObjectLeased``."""
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", lease_ttl=30.0) as cluster:
        a = cluster.client()
        for i in range(40):
            key = b"hb%d" % i
            a.put(key, b"v" * 1000)
            a.get(key)
            deadline = time.monotonic() + 5.0
            while a._unreleased:                            # left to the heartbeat thread
                assert time.monotonic() < deadline, "the heartbeat thread never released"
                time.sleep(0.001)
            a.remove(key)                                   # right after: not ObjectLeased
