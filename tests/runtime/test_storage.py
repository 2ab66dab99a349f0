"""A storage node checks every write and read against the region's token."""

from __future__ import annotations

import time

import pytest

import kvproto
from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.shm import gen_word

from runtime_helpers import wait_for


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB") as c:
        yield c


def grant_of(raw_master, key: bytes) -> dict:
    reply = raw_master.call("read_begin", {"client": "probe", "keys": [key]})
    code, grant = reply.body["items"][0]
    assert code == 0
    raw_master.call("read_end", {"client": "probe", "items": [[key, grant["token"]]]})
    return grant


def test_wrong_token_write_is_refused_and_never_written(cluster, raw):
    client = cluster.client()
    node = cluster.storage[0]
    original = b"O" * 6000
    client.put(b"victim", original)
    g = grant_of(raw(cluster.master_address), b"victim")
    seg, offset, length = g["replicas"][0]
    r = raw(node.endpoint)
    written = node.core.counters["writes"]

    reply = r.call("write", {"segment": seg, "term": 1, "offset": offset, "token": g["token"] + 1000},
                   [b"X" * length])
    assert isinstance(reply.error(), errors.RegionMismatch)
    # an offset no region starts at, inside the object and past it
    far = node.memory.capacity - 8192
    for off in (offset + 4096, far):
        reply = r.call("write", {"segment": seg, "term": 1, "offset": off, "token": g["token"]}, [b"X" * 10])
        assert isinstance(reply.error(), errors.RegionMismatch)
    assert bytes(node.memory.view(offset, length)) == original
    assert bytes(node.memory.view(far, 10)) == b"\x00" * 10
    assert node.core.counters["writes"] == written
    assert bytes(client.get(b"victim")) == original

    # a wrong-token read is refused too
    reply = r.call("read", {"segment": seg, "term": 1, "offset": offset, "token": g["token"] + 1, "length": length})
    assert isinstance(reply.error(), errors.RegionMismatch)

    # after remove (and once the master's free reached the node: remove does not
    # wait for it), the old token owns nothing: a late write is refused
    client.remove(b"victim")
    wait_for(lambda: node.memory.word(offset) == 0, what="free applied")
    reply = r.call("write", {"segment": seg, "term": 1, "offset": offset, "token": g["token"]}, [b"L" * length])
    assert isinstance(reply.error(), errors.RegionMismatch)
    assert bytes(node.memory.view(offset, length)) == original


def test_write_of_wrong_length_is_refused(cluster, raw):
    m = raw(cluster.master_address)
    start = m.call("put_start", {"client": "w", "replicas": 1, "items": [[b"short", 100]]})
    code, grant = start.body["items"][0]
    assert code == 0
    seg, offset, length = grant["replicas"][0]
    r = raw(cluster.storage[0].endpoint)
    reply = r.call("write", {"segment": seg, "term": 1, "offset": offset, "token": grant["token"]}, [b"x" * 99])
    assert isinstance(reply.error(), errors.InvalidArgument)
    # the region is still unwritten: reading it is refused
    reply = r.call("read", {"segment": seg, "term": 1, "offset": offset, "token": grant["token"], "length": 100})
    assert isinstance(reply.error(), errors.RegionMismatch)
    assert r.call("write", {"segment": seg, "term": 1, "offset": offset, "token": grant["token"]},
                  [b"y" * 100]).status == 0
    assert m.call("put_end", {"client": "w", "items": [[b"short", grant["token"]]]}).body["items"][0][0] == 0
    assert bytes(cluster.client().get(b"short")) == b"y" * 100


def test_a_write_that_overtakes_its_assign_waits_for_it(raw):
    """The master grants without waiting for the node's assign ack, so a
    writer's write may reach the node first (another connection). The node
    holds such a write (its token is above every one it was assigned) until
    the assign arrives, then serves it; one whose assign never comes is
    refused after ASSIGN_WAIT; a write for a token the node has already seen
    is judged at once."""
    from kvproto.runtime.storage_server import StorageServer
    server = StorageServer("tcp://127.0.0.1:1", 1 << 20)
    server.ASSIGN_WAIT = 0.3
    try:
        seg, term = server.segment, 0
        writer, master = raw(server.endpoint), raw(server.endpoint)

        def pump(until):
            wait_for(until, timeout=5, what="the node to serve")

        def turn():
            server._drain_router()
            server._serve_assigned()

        writer.sock.send_multipart([wire.encode_request("write", 1, {
            "segment": seg, "offset": 0, "token": 5, "term": term}), b"x" * 10])
        pump(lambda: (turn(), server._awaiting)[1])             # held: no assign yet
        assert not writer.sock.poll(50)
        master.sock.send(wire.encode_request("assign", 2, {
            "segment": seg, "term": term, "regions": [[0, 10, b"k", 5]]}))
        pump(lambda: (turn(), writer.sock.poll(10))[1])
        assert wire.decode_reply(writer.sock.recv_multipart()).status == 0
        assert wire.decode_reply(master.sock.recv_multipart()).status == 0
        assert server.memory.word(0) == gen_word(5, True) and not server._awaiting

        # an assign that never comes: refused once the wait is over
        writer.sock.send_multipart([wire.encode_request("write", 3, {
            "segment": seg, "offset": 4096, "token": 9, "term": term}), b"y" * 10])
        pump(lambda: (turn(), writer.sock.poll(10))[1])
        assert wire.decode_reply(writer.sock.recv_multipart()).status == errors.RegionMismatch.code
        # a token at or below the highest assigned is judged at once
        writer.sock.send_multipart([wire.encode_request("write", 4, {
            "segment": seg, "offset": 4096, "token": 4, "term": term}), b"z" * 10])
        pump(lambda: (turn(), writer.sock.poll(10))[1])
        assert wire.decode_reply(writer.sock.recv_multipart()).status != 0
        assert not server._awaiting
    finally:
        server.close()


def test_one_writes_message_carries_a_batchs_regions(cluster):
    """A batch's writes to one node travel as one ``writes`` message, one
    payload frame per region, each region a tracked transfer of its own and
    judged on its own: a region whose token does not own it is refused while
    the others are written."""
    from kvproto.runtime import datapath
    client = cluster.client(local_writes=False)          # over the network, not direct
    node = cluster.storage[0]
    before = node.core.counters["writes"]
    errs = client.put_many([(b"w/%d" % i, bytes([i]) * 5000) for i in range(6)])
    assert errs == [None] * 6 and node.core.counters["writes"] - before == 6
    rep = client._call_master("put_start", {"client": client.client_id, "replicas": 1,
                                            "items": [[b"w/x", 100], [b"w/y", 100]]},
                              time.monotonic() + 5)
    grants = {i: (k, memoryview(b"z" * 100), item[1]["token"] + (7 if i else 0), item[1]["replicas"])
              for i, (k, item) in enumerate(zip([b"w/x", b"w/y"], rep.body["items"]))}
    failed = datapath.write_all(client, grants, rep.body["segments"], time.monotonic() + 5,
                                rep.body["term"])
    assert list(failed) == [1] and isinstance(failed[1], (errors.StaleToken, errors.RegionMismatch))
    client._revoke([(b"w/x", grants[0][2]), (b"w/y", grants[1][2] - 7)])
    client.close()
