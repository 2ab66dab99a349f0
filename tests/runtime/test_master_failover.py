"""Master failover with real processes (spec/Failover.tla, docs/protocols/failover.md).

Masters, storage nodes and the coordinator's clients run as separate
processes on loopback; the coordinator is the embedded one (a directory) or a
real etcd started by the ``etcd`` fixture.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import pytest

import kvproto
from kvproto import errors
from kvproto.cores.recovery import IndexColumns
from kvproto.runtime import datapath, wire
from kvproto.runtime.coordinator import connect
from kvproto.runtime.master import MasterCore
from kvproto.runtime.shm import SegmentMemory
from kvproto.runtime.storage import StorageCore

from runtime_helpers import wait_for

pytestmark = pytest.mark.runtime

#: the masters' election TTL: short, so that a takeover fits within one read
#: lease (1.5 s)
TTL = 1.0
SEGMENT = 8 << 20


def value(key: bytes, size: int = 3000) -> bytes:
    """The only bytes ever stored under ``key``: a reader can tell wrong bytes."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture(params=["file", "etcd"])
def coordinator_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/coordinator"
    return request.getfixturevalue("etcd")


def start_master(spawn, url: str, lease_ttl: float = 5.0):
    m = spawn(f"""
        import logging; logging.basicConfig(level=logging.INFO)
        from kvproto.runtime.coordinator import connect
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout=1.5, storage_timeout=3.0, fence_timeout=1.5,
                   coordinator=connect({url!r}, ttl={TTL}), log_level="INFO", lease_ttl={lease_ttl})
    """)
    line = m.readline()
    assert line.startswith("kvproto master listening on tcp://127.0.0.1:"), line
    return m, line.rsplit(" ", 1)[1]


def start_storage(spawn, url: str):
    s = spawn(f"""
        from kvproto.runtime.embedded import run_storage
        run_storage({url!r}, "{SEGMENT}")
    """)
    line = s.readline()
    assert line.startswith("kvproto storage listening on tcp://127.0.0.1:"), line
    return s, line.rsplit(" ", 1)[1]


def open_at(url: str, address: str, raw) -> dict:
    """The master at ``address`` leads and is open: its failover stats."""
    leader = connect(url, ttl=TTL).leader()
    if leader is None or leader[1] != address:
        return {}
    failover = raw(address).call("stats", {}).body["failover"]
    return {**failover["last"], "term": failover["term"]} if failover["phase"] == "open" else {}


def cluster(children, url: str, raw, nodes: int = 2, lease_ttl: float = 5.0):
    a, a_addr = start_master(children, url, lease_ttl)
    wait_for(lambda: open_at(url, a_addr, raw), what="the first master open")
    b, b_addr = start_master(children, url, lease_ttl)
    storage = [start_storage(children, url) for _ in range(nodes)]
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == nodes,
             what="storage nodes registered")
    return (a, a_addr), (b, b_addr), storage, client


def node_stats(raw, endpoint: str) -> dict:
    return raw(endpoint).call("stats", {}).body


def test_kill_9_of_the_active_master_with_writers_and_readers(children, raw, coordinator_url):
    url = coordinator_url
    (a, a_addr), (b, b_addr), storage, client = cluster(children, url, raw)
    keys = [f"obj-{i}".encode() for i in range(40)]
    for i, k in enumerate(keys):
        client.put(k, value(k), replicas=1 + i % 2)
    # three allocations written but never published (their writer stalls)
    pending = [b"pending-0", b"pending-1", b"pending-2"]
    rep = client._call_master("put_start", {"client": "stalled", "replicas": 1,
                                            "items": [[k, 3000] for k in pending]},
                              time.monotonic() + 5)
    grants = {i: (k, memoryview(value(k)), item[1]["token"], item[1]["replicas"])
              for i, (k, item) in enumerate(zip(pending, rep.body["items"]))}
    assert not datapath.write_all(client, grants, rep.body["segments"], time.monotonic() + 5,
                                  rep.body["term"])
    old_term = rep.body["term"]

    wrong, done, stop = [], [], threading.Event()

    def traffic(n: int) -> None:
        # the second writer puts four keys a call in chunks of two, so its
        # put_ends are answered while the next chunk is written
        c = kvproto.Client(url, timeout=2.0, lookup_timeout=0.5,
                           **({"batch": 2, "window": 2} if n else {}))
        i = 0
        try:
            while not stop.is_set():
                i += 1
                put = [f"live-{n}-{i}-{j}".encode() for j in range(4 if n else 1)]
                try:
                    results = c.put_many([(k, value(k)) for k in put])
                    done.extend(k for k, err in zip(put, results) if err is None)
                except errors.KvError:
                    pass
                probe = keys + done[-5:]
                for key, got in zip(probe, c.get_many(probe)):
                    if got is not None and bytes(got) != value(key):
                        wrong.append(key)
        finally:
            c.close()

    threads = [threading.Thread(target=traffic, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    a.stop(signal.SIGKILL)
    killed = time.monotonic()
    last = wait_for(lambda: open_at(url, b_addr, raw), timeout=20, what="the standby open")
    opened = time.monotonic() - killed
    time.sleep(1.0)                           # traffic against the new master
    stop.set()
    for t in threads:
        t.join(30)
    assert not wrong, f"wrong bytes read for {wrong[:5]}"
    assert any(k.startswith(b"live-1-") for k in done)     # the chunked writer stored
    assert last["term"] > old_term and last["nodes_lost"] == 0
    assert opened < 15
    # every object published before the kill is served by the new master
    reader = kvproto.Client(url, timeout=5.0)
    assert [bytes(v) for v in reader.get_many(keys)] == [value(k) for k in keys]
    for k in done:   # acknowledged puts survive the failover
        got = reader.get_many([k])[0]
        assert got is not None and bytes(got) == value(k), k
    # the unpublished allocations were purged from the storage nodes
    assert reader.get_many(pending) == [None] * 3
    stats = [node_stats(raw, ep) for _, ep in storage]
    assert sum(s["counters"]["purged"] for s in stats) >= 3
    assert all(s["indexed"] == s["published"] for s in stats)
    assert all(s["term"] == last["term"] for s in stats)
    reader.put(b"after", value(b"after"))
    assert bytes(reader.get(b"after")) == value(b"after")
    reader.close()
    client.close()


def test_paused_master_is_fenced_and_steps_down(children, raw, coordinator_url):
    url = coordinator_url
    (a, a_addr), (b, b_addr), storage, client = cluster(children, url, raw)
    client.put(b"before", value(b"before"))
    old = raw(a_addr).call("stats", {}).body["failover"]["term"]
    a.proc.send_signal(signal.SIGSTOP)
    try:
        new = wait_for(lambda: open_at(url, b_addr, raw), timeout=20, what="the standby open")
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert new["term"] > old
    # the woken master serves nothing: it stepped down before answering
    reply = raw(a_addr).call("put_start", {"client": "c", "replicas": 1, "items": [[b"x", 10]]})
    assert reply.status == errors.MasterNotOpen.code
    assert raw(a_addr).call("stats", {}).body["failover"]["phase"] == "standby"
    # and every storage node refuses anything stamped with the old term
    for _, endpoint in storage:
        seg = node_stats(raw, endpoint)["segment"]
        r = raw(endpoint).call("assign", {"segment": seg, "term": old, "regions": [[0, 10, b"x", 1]]})
        assert r.status == errors.StaleTerm.code
        r = raw(endpoint).call("read", {"segment": seg, "term": old, "offset": 0, "token": 1, "length": 1})
        assert r.status == errors.StaleTerm.code
    assert bytes(client.get(b"before")) == value(b"before")


def test_a_paused_master_never_acknowledges_the_removes_queued_while_it_slept(
        children, raw, coordinator_url):
    """Removes sent to the active master while it is stopped wait in its
    socket; a standby takes over meanwhile (and removes one key). On waking,
    the old master must not answer them "ok" (spec AcknowledgedChangesSurvive),
    nor answer a lookup from its stale directory: it cannot prove that it
    holds its term, so it answers MasterNotOpen to everything. Every key it was
    asked to remove is still there at the new master."""
    url = coordinator_url
    (a, a_addr), (b, b_addr), storage, client = cluster(children, url, raw)
    keys = [f"keep-{i}".encode() for i in range(8)]
    for k in keys:
        client.put(k, value(k), replicas=2)
    gone = keys.pop()
    a.proc.send_signal(signal.SIGSTOP)
    sock = raw(a_addr)
    try:
        wait_for(lambda: open_at(url, b_addr, raw), timeout=20, what="the standby open")
        client.remove(gone, force=True)     # at the new master
        for i, k in enumerate(keys):        # queued in the stopped master's socket
            sock.sock.send(wire.encode_request("remove", 5000 + i, {"keys": [k]}))
        sock.sock.send(wire.encode_request("exists", 6000, {"keys": [gone]}))
    finally:
        a.proc.send_signal(signal.SIGCONT)
    for _ in range(len(keys) + 1):
        assert sock.sock.poll(10_000), "the woken master did not answer"
        reply = wire.decode_reply(sock.sock.recv_multipart())
        assert reply.status == errors.MasterNotOpen.code, (reply.request_id, reply.status, reply.body)
    for k, got in zip(keys, client.get_many(keys)):
        assert got is not None and bytes(got) == value(k), k
    assert not client.exists(gone)


def test_a_new_master_keeps_what_it_recovered_leased_for_one_lease_ttl(children, raw, tmp_path):
    """A reader holds a lease from the old master when it is killed. The new
    master knows none of the old leases (spec Lease.tla, Takeover), so it
    refuses to remove what it recovered until one lease TTL (plus a margin)
    has passed since it opened; the reader's renewal, of an older term's lease
    id, is refused rather than extending somebody else's lease; the reader's
    bytes are intact within its deadline and refused past it."""
    from kvproto.statemachines import lease as lm
    lease_ttl = 1.5
    url = f"file://{tmp_path}/coordinator"
    (a, a_addr), (b, b_addr), storage, client = cluster(children, url, raw, nodes=1,
                                                       lease_ttl=lease_ttl)
    client.put(b"held", value(b"held"))
    reader = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    (held,) = reader.read_begin([b"held"])
    assert held.lease >> 32 >= 1           # the lease id carries the term that granted it
    a.stop(signal.SIGKILL)
    wait_for(lambda: open_at(url, b_addr, raw), timeout=20, what="the standby open")
    opened = time.monotonic()
    with pytest.raises(errors.ObjectLeased):
        client.remove(b"held")
    assert reader.renew([held])[0].__class__ is errors.LeaseExpired
    # the reader's transfer within its lease: the bytes are the object's
    seg, off, length = held.replicas[0]
    local = reader._local.get(held.segments[seg])
    got = local.read(off, length, held.token, held.segments[seg][4])
    assert got is not None and bytes(got) == value(b"held")
    assert lm.accept_transfer(held.sent, time.monotonic(), held.ttl, reader.max_skew)
    # once the old master's leases have surely ended, the remove goes through
    wait_for(lambda: _removed(client, b"held"), timeout=10, what="the remove after the quiet period")
    assert time.monotonic() - opened >= lease_ttl * 0.9
    assert not lm.accept_transfer(held.sent, time.monotonic(), held.ttl, reader.max_skew)
    with pytest.raises(errors.KeyNotFound):
        client.get(b"held")
    reader.close()


def _removed(client, key: bytes) -> bool:
    """Whether ``remove(key)`` went through; not yet while it is leased, nor
    while the master is not open: a master that misses a renewal (a loaded
    machine) steps down and campaigns again, and its quiet period starts
    again when it reopens."""
    try:
        client.remove(key)
        return True
    except (errors.ObjectLeased, errors.MasterNotOpen):
        return False


def test_storage_node_lost_during_the_switch(children, raw, tmp_path):
    url = f"file://{tmp_path}/coordinator"
    (a, a_addr), (b, b_addr), storage, client = cluster(children, url, raw)
    keys = [f"k{i}".encode() for i in range(30)]
    for k in keys:
        client.put(k, value(k))
    where = {}
    for lease in client.read_begin(keys):
        where[lease.key] = lease.replicas[0][0]
    client.release([lease for lease in client.read_begin(keys)])
    victim, victim_ep = storage[0]
    victim_seg = node_stats(raw, victim_ep)["segment"]
    victim.stop(signal.SIGKILL)
    # the coordinator lists a dead node until its registration runs out (2 s
    # after its last refresh), and the standby takes over about a master TTL
    # after the kill: on a loaded machine that can come later. The node is
    # listed again here, for longer, so that its death surely falls within
    # the switch (the standby fences it, no answer comes: lost)
    lister = connect(url, ttl=30.0)
    lister.register_node(victim_seg, victim_ep)
    lister.close()
    a.stop(signal.SIGKILL)
    last = wait_for(lambda: open_at(url, b_addr, raw), timeout=20, what="the standby open")
    assert last["nodes_lost"] == 1
    got = client.get_many(keys)
    for k, v in zip(keys, got):
        if where[k] == victim_seg:
            assert v is None, k          # its bytes are gone: a miss
        else:
            assert v is not None and bytes(v) == value(k), k
    assert any(where[k] == victim_seg for k in keys) and any(where[k] != victim_seg for k in keys)
    client.put(b"after", value(b"after"))


# --------------------------------------------------------------------------
# The fence without processes: cores stepped directly
# --------------------------------------------------------------------------


def test_a_fenced_node_refuses_the_old_master_which_steps_down():
    memory = SegmentMemory(1 << 20, 4096)
    try:
        node = StorageCore(memory, "seg")
        old = MasterCore()                     # term 1, open
        status, body = old.handle("register", {
            "segment": "seg", "capacity": memory.capacity, "endpoint": "tcp://127.0.0.1:1",
            "host": "h", "shm": memory.name, "gen_shm": memory.gen_name, "nonce": memory.nonce,
            "page_size": 4096})
        assert status == 0 and node.fence_to(body["term"])
        # a new master fences the node at term 2 and reads its (empty) index
        body, frames = node.handle("fence", {"segment": "seg", "term": 2}, [])
        assert body["term"] == 2 and body["objects"] == 0
        assert len(IndexColumns.from_frames([bytes(f) for f in frames], 0)) == 0
        # the old master's assign is refused for its term (its grant, which does
        # not wait for the assign, names that term: the writer's writes are refused) ...
        status, body = old.handle("put_start", {"client": "c", "replicas": 1, "items": [[b"k", 10]]})
        assert status == 0 and body["term"] == 1
        (seg, op, cmd_id, command), = old.outbox
        assert (op, command["term"]) == ("assign", 1)
        with pytest.raises(errors.StaleTerm) as refused:
            node.handle(op, command, [])
        # ... and the old master steps down on that refusal (HigherTermSeen)
        old.storage_reply(seg, wire.Reply(refused.value.code, cmd_id, {"message": str(refused.value)}, []))
        assert old.failover.phase.value == "standby"
        with pytest.raises(errors.MasterNotOpen):
            old.handle("put_start", {"client": "c", "replicas": 1, "items": [[b"k2", 10]]})
        # its clients' reads and writes are refused too
        for op, extra, payloads in (("read", {"length": 1}, []), ("write", {}, [memoryview(b"x")])):
            with pytest.raises(errors.StaleTerm):
                node.handle(op, {"segment": "seg", "term": 1, "offset": 0, "token": 1, **extra}, payloads)
        assert node.counters["stale_terms"] == 3
        assert len(node.node.regions) == 0 and len(node.node.index) == 0
    finally:
        memory.close()


def test_a_master_whose_loop_is_stuck_lets_its_lease_run_out(tmp_path):
    """Leadership renews from a thread, but only while the serving loop turns
    (or recovers): a wedged master loses its term and a standby can win."""
    from kvproto.runtime.master_server import MasterServer
    url = f"file://{tmp_path}/coordinator"
    server = MasterServer(coordinator=connect(url, ttl=0.5))
    server.STUCK_AFTER = 0.5
    try:
        wait_for(lambda: server._once(10) or server.core.failover.phase.value == "open",
                 what="the master open")
        term = server._term
        time.sleep(1.0)                         # the loop turns no more: wedged
        probe = connect(url, ttl=0.5)
        wait_for(lambda: probe.leader() is None, timeout=5, what="the lease running out")
        assert probe.campaign("tcp://127.0.0.1:2") == term + 1
        server._once(10)                       # the loop turns again: it steps down
        assert server._term == 0 and server.core.failover.phase.value == "standby"
        probe.close()
    finally:
        server.close()


class _StillCoordinator:
    """A coordinator that grants term 1 and renews whenever asked; its TTL is
    long, so the test alone decides when the master's last renewal grows old
    (as a pause would make it)."""

    ttl = 1000.0

    def campaign(self, address):
        return 1

    def nodes(self):
        return {}

    def keepalive(self, term):
        return True

    def leader(self):
        return (1, "")

    def resign(self, term):
        pass

    def close(self):
        pass


def test_a_master_that_cannot_prove_its_term_answers_only_master_not_open(raw):
    """The leadership check runs after a request is read and again before its
    reply is sent (not only at the top of the loop, before the poll): a master
    whose last renewal is older than HELD_FRACTION of the TTL answers
    MasterNotOpen and steps down, whether the pause came before the request
    was handled or between handling it and replying."""
    from kvproto.runtime.master_server import MasterServer
    server = MasterServer("tcp://127.0.0.1:*", coordinator=_StillCoordinator())
    sock = raw(server.address)

    def roundtrip(op, body, rid):
        sock.sock.send(wire.encode_request(op, rid, body))
        wait_for(lambda: server.router.poll(10), what="the request queued")
        server._drain_router()            # what the loop does after its poll returns
        assert sock.sock.poll(5000)
        return wire.decode_reply(sock.sock.recv_multipart())

    try:
        server._lead()
        assert server._term == 1 and server.core.failover.phase.value == "open"
        assert roundtrip("exists", {"keys": [b"k"]}, 1).status == 0

        # paused between handling a request and sending its reply
        handle = server.core.handle

        def paused_while_handling(*args):
            result = handle(*args)
            server._renewer.renewed -= 2 * _StillCoordinator.ttl
            return result
        server.core.handle = paused_while_handling
        assert roundtrip("exists", {"keys": [b"k"]}, 2).status == errors.MasterNotOpen.code
        assert server._term == 0 and server.core.failover.phase.value == "standby"

        # paused before handling it: the request is not even handled
        server._next_lead = 0.0
        server._lead()
        assert server._term == 1
        core = server.core
        server._renewer.renewed -= 2 * _StillCoordinator.ttl
        assert roundtrip("remove", {"keys": [b"k"]}, 3).status == errors.MasterNotOpen.code
        assert server._term == 0 and core.counters["refused"] == 0
    finally:
        server.close()


def test_a_segment_this_master_did_not_recover_joins_only_empty():
    """A node the new master fenced out (its answer came after the fence
    timeout) counts as lost with its bytes: registering with what it still
    holds is refused (it starts over empty), else its objects, removed ones
    too, would come back at the next takeover."""
    memory = SegmentMemory(1 << 20, 4096)
    try:
        node = StorageCore(memory, "seg")
        master = MasterCore()
        body = {**node.registration(), "endpoint": "tcp://127.0.0.1:1"}
        assert body["held"] == 0
        status, _ = master.handle("register", body)          # empty: joins
        assert status == 0
        node.handle("assign", {"segment": "seg", "term": 1, "regions": [[0, 10, b"k", 1]]}, [])
        assert node.held() == 2                               # a region and its index entry
        other = MasterCore()
        with pytest.raises(errors.SegmentUnavailable, match="start over empty"):
            other.handle("register", {**node.registration(), "endpoint": "tcp://127.0.0.1:1"})
        assert "seg" not in other.segments
    finally:
        memory.close()
