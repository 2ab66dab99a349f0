"""Garbage at the master and at a storage node: typed errors, no state change,
and both keep serving."""

from __future__ import annotations

import msgpack
import pytest

import kvproto
from kvproto import errors
from kvproto.runtime import wire

V = wire.PROTOCOL_VERSION


def hdr(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=2, segment_size="2MiB") as c:
        yield c


def master_state(client) -> dict:
    s = client.stats()
    counters = {k: v for k, v in s["counters"].items() if k not in ("rejected", "refused", "stale_terms")}
    return {"counters": counters, "segments": s["segments"], "objects": s["objects"],
            "pending": s["pending"], "clients": s["clients"], "next_token": s["next_token"]}


GOOD_PUT = {"client": "c", "replicas": 1, "items": [[b"k", 10]]}

MASTER_CASES = [
    ("garbage", [b"\xde\xad\xbe\xef garbage"], errors.MalformedFrame),
    ("empty", [b""], errors.MalformedFrame),
    ("truncated", [hdr(V, "put_start", 1, GOOD_PUT)[:-3]], errors.MalformedFrame),
    ("not-a-list", [msgpack.packb({"op": "stats"})], errors.MalformedFrame),
    ("short-header", [hdr(V, "stats", 1)], errors.MalformedFrame),
    ("wrong-version", [hdr(V + 41, "put_start", 1, GOOD_PUT)], errors.UnsupportedVersion),
    ("unknown-op", [hdr(V, "format_disk", 1, {})], errors.UnknownMessage),
    ("storage-op", [hdr(V, "write", 1, {"segment": "s", "offset": 0, "token": 1})], errors.UnknownMessage),
    ("missing-field", [hdr(V, "put_start", 1, {"client": "c", "items": [[b"k", 10]]})], errors.MalformedFrame),
    ("missing-client", [hdr(V, "read_begin", 1, {"keys": [b"k"]})], errors.MalformedFrame),
    ("wrong-type", [hdr(V, "put_start", 1, {**GOOD_PUT, "items": [["k", 10]]})], errors.MalformedFrame),
    ("wrong-type-body", [hdr(V, "exists", 1, [b"k"])], errors.MalformedFrame),
    ("wrong-type-found", [hdr(V, "exists", 1, {"keys": [b"k"], "found": 1})], errors.MalformedFrame),
    ("wrong-type-columns", [hdr(V, "put_end", 1, {"client": "c", "items": [[b"k", 5]], "columns": 1})],
     errors.MalformedFrame),
    ("bad-value", [hdr(V, "put_start", 1, {**GOOD_PUT, "items": [[b"k", 0]]})], errors.InvalidArgument),
    ("bad-token", [hdr(V, "put_end", 1, {"client": "c", "items": [[b"k", -5]]})], errors.InvalidArgument),
    ("bad-endpoint", [hdr(V, "register", 1, {
        "segment": "s", "capacity": 8192, "endpoint": "carrier-pigeon", "host": "h", "shm": "x",
        "gen_shm": "y", "nonce": 1, "page_size": 4096})], errors.InvalidArgument),
    ("bad-page-size", [hdr(V, "register", 1, {
        "segment": "s", "capacity": 8192, "endpoint": "tcp://h:1", "host": "h", "shm": "x",
        "gen_shm": "y", "nonce": 1, "page_size": 3000})], errors.InvalidArgument),
    ("stale-put-end", [hdr(V, "put_end", 1, {"client": "c", "items": [[b"keep", 999999]]})], None),
    ("payload-to-master", [hdr(V, "stats", 1, {}), b"bytes never go to the master"], errors.FrameTooLarge),
    ("oversized-header", [b"\x00" * (wire.MASTER_MAX_HEADER + 1)], errors.FrameTooLarge),
]


def test_master_rejects_bad_frames_and_keeps_serving(cluster, raw):
    client = cluster.client()
    client.put(b"keep", b"kept bytes", replicas=2)
    before = master_state(client)
    rejected = client.stats()["counters"]["rejected"]
    r = raw(cluster.master_address)
    for name, frames, error in MASTER_CASES:
        # each case on a connection of its own: several reuse request id 1,
        # and a connection's second request with an id is a duplicate
        r = raw(cluster.master_address)
        reply = r.send_frames(frames)
        if error is None:   # well-formed, refused per key by the machine
            assert reply.status == 0 and reply.body["items"][0][0] == errors.StaleToken.code
            continue
        assert reply.status == error.code, (name, reply.status, reply.body)
        assert isinstance(reply.error(), error), name
    # the request id is echoed whenever it could be read
    assert raw(cluster.master_address).send_frames([hdr(V + 1, "stats", 77, {})]).request_id == 77
    assert master_state(client) == before
    # (two register cases and the stale put_end passed the decoder)
    assert client.stats()["counters"]["rejected"] == rejected + len(MASTER_CASES) - 3 + 1
    assert bytes(client.get(b"keep")) == b"kept bytes"
    client.put(b"after-garbage", b"still works")
    assert bytes(client.get(b"after-garbage")) == b"still works"


def test_a_request_delivered_twice_is_served_once(cluster, raw):
    """A copy of a request on the same connection (same request id) is
    answered DuplicateRequest and not served: a put_start copy would
    otherwise be refused KeyExists, and a copied remove could remove the
    key's next generation. The same request under a new id is served."""
    client = cluster.client()
    client.put(b"dup-removed", b"first generation")
    r = raw(cluster.master_address)
    remove = [hdr(V, "remove", 41, {"keys": [b"dup-removed"]})]
    first = r.send_frames(remove)
    assert first.status == 0 and first.body["items"][0][0] == 0
    client.put(b"dup-removed", b"second generation")
    dropped = client.stats()["counters"]["duplicates_dropped"]
    copy = r.send_frames(remove)
    assert copy.status == errors.DuplicateRequest.code and copy.request_id == 41
    assert bytes(client.get(b"dup-removed")) == b"second generation"
    assert client.stats()["counters"]["duplicates_dropped"] == dropped + 1
    again = r.send_frames([hdr(V, "remove", 42, {"keys": [b"dup-removed"]})])
    assert again.status == 0 and again.body["items"][0][0] == 0
    with pytest.raises(errors.KeyNotFound):
        client.get(b"dup-removed")


def storage_state(node) -> dict:
    s = node.core.stats()
    counters = {k: v for k, v in s["counters"].items() if k not in ("rejected", "refused", "stale_terms")}
    return {**s, "counters": counters, "node": node.core.node.reference(),
            "memory": bytes(node.memory.data)}


def test_storage_rejects_bad_frames_and_keeps_serving(cluster, raw):
    client = cluster.client()
    client.put(b"stored", b"S" * 5000, replicas=2)
    node = cluster.storage[0]
    seg = node.segment
    before = storage_state(node)
    cap = node.memory.capacity
    w = {"segment": seg, "offset": 0, "token": 1, "term": 1}
    cases = [
        ("garbage", [b"\x00\x01\x02"], errors.MalformedFrame),
        ("truncated", [hdr(V, "read", 1, {**w, "length": 5})[:-1]], errors.MalformedFrame),
        ("wrong-version", [hdr(0, "read", 1, {**w, "length": 5})], errors.UnsupportedVersion),
        ("unknown-op", [hdr(V, "put_start", 1, GOOD_PUT)], errors.UnknownMessage),
        ("missing-field", [hdr(V, "write", 1, {"segment": seg, "offset": 0}), b"x"], errors.MalformedFrame),
        ("missing-payload", [hdr(V, "write", 1, w)], errors.MalformedFrame),
        ("two-payloads", [hdr(V, "write", 1, w), b"a", b"b"], errors.MalformedFrame),
        ("wrong-type", [hdr(V, "read", 1, {**w, "offset": "0", "length": 5})], errors.MalformedFrame),
        ("bad-value", [hdr(V, "read", 1, {**w, "length": 0})], errors.InvalidArgument),
        ("oversized-header", [b"\x00" * (wire.STORAGE_MAX_HEADER + 1)], errors.FrameTooLarge),
        ("oversized-payload", [hdr(V, "write", 1, w), b"\x00" * (cap + 1)], errors.FrameTooLarge),
        ("assign-garbage", [hdr(V, "assign", 1, {"segment": seg, "regions": [[0, 1, "k", 1]]})],
         errors.MalformedFrame),
        ("other-segment", [hdr(V, "write", 1, {**w, "segment": "nope"}), b"x"], errors.SegmentUnavailable),
        ("read-unassigned", [hdr(V, "read", 1, {**w, "offset": cap - 4096, "length": 1})], errors.RegionMismatch),
        ("stale-term", [hdr(V, "write", 1, {**w, "term": 0}), b"x"], errors.StaleTerm),
        ("stale-term-assign", [hdr(V, "assign", 1, {"segment": seg, "term": 0, "regions": [[0, 1, b"k", 1]]})],
         errors.StaleTerm),
        ("wrong-type-tally", [hdr(V, "publish", 1, {"segment": seg, "term": 1, "tally": 1,
                                                    "regions": [[0, b"k", 1]]})], errors.MalformedFrame),
    ]
    r = raw(node.endpoint)
    for name, frames, error in cases:
        reply = r.send_frames(frames)
        assert reply.status == error.code, (name, reply.status, reply.body)
    assert storage_state(node) == before
    assert bytes(client.get(b"stored")) == b"S" * 5000
    client.put(b"stored-after", b"T" * 5000, replicas=2)
    assert bytes(cluster.client(local_reads=False).get(b"stored-after")) == b"T" * 5000
