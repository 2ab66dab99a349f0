"""Object checksums on the running store (an embedded master and two storage
nodes): the writer's checksum reaches the directory and every replica's
index; ``verify=True`` finds bytes changed behind the protocol in a node's
segment (same-host and network reads), tries the next replica, and counts."""

from __future__ import annotations

import numpy as np
import pytest

import kvproto
from kvproto import errors
from kvproto.runtime.datapath import checksum

KiB = 1 << 10
#: the transfer counter of each reader's path
PATH = {"local": "local_reads", "remote": "network_reads"}


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=2, segment_size="8MiB", client_timeout=10.0) as c:
        yield c


@pytest.fixture(scope="module")
def local(cluster):
    return cluster.client()


@pytest.fixture(scope="module")
def remote(cluster):
    """A client that never reads shared memory (always the network path)."""
    return cluster.client(local_reads=False)


def payload(key: bytes, size: int = 64 * KiB) -> bytes:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(
        0, 256, size, dtype=np.uint8).tobytes()


def replicas_of(cluster, key: bytes) -> list:
    return list(cluster.master.core.directory.objects[key].replicas)


def flip(cluster, replica, at: int = 1000) -> None:
    """Change one byte of ``replica`` in its node's segment memory, behind
    the protocol (no request, no generation word touched)."""
    (node,) = [n for n in cluster.storage if n.core.segment == replica.segment]
    node.memory.data[replica.offset + at] ^= 0xFF


def delta(client, before: dict) -> dict:
    return {k: v - before[k] for k, v in client.checksum_counters.items() if v != before[k]}


def test_the_writers_checksum_is_in_the_directory_and_every_replica_index(cluster, local):
    data = payload(b"recorded")
    local.put(b"recorded", data, replicas=2)
    record = cluster.master.core.directory.objects[b"recorded"]
    assert record.checksum == checksum(data) != 0
    for node in cluster.storage:
        assert node.core.node.index[b"recorded"].checksum == checksum(data)


@pytest.mark.parametrize("reader", ["local", "remote"])
def test_verify_finds_a_flipped_byte_and_plain_reads_do_not(cluster, reader, request):
    client = request.getfixturevalue(reader)
    key = b"flipped-" + reader.encode()
    data = payload(key)
    client.put(key, data)
    before, path = dict(client.checksum_counters), client.transfer_counters[PATH[reader]]
    assert bytes(client.get(key, verify=True)) == data
    assert delta(client, before) == {"checksum_verified": 1}
    assert client.transfer_counters[PATH[reader]] == path + 1     # the path under test
    (replica,) = replicas_of(cluster, key)
    flip(cluster, replica)
    before = dict(client.checksum_counters)
    with pytest.raises(errors.ChecksumMismatch) as raised:
        client.get(key, verify=True)
    assert raised.value.code == errors.ChecksumMismatch.code
    assert delta(client, before) == {"checksum_mismatches": 1}
    wrong = bytes(client.get(key))                       # verify=False: the changed bytes
    assert wrong != data and len(wrong) == len(data)
    assert sum(a != b for a, b in zip(wrong, data)) == 1
    buffer = bytearray(len(data))
    with pytest.raises(errors.ChecksumMismatch):
        client.get_into(key, buffer, verify=True)
    assert client.get_many([key, b"absent"]) == [wrong, None]
    with pytest.raises(errors.ChecksumMismatch):
        client.get_many([key, b"absent"], verify=True)


@pytest.mark.parametrize("reader", ["local", "remote"])
def test_verify_reads_the_next_replica_when_one_is_damaged(cluster, reader, request):
    client = request.getfixturevalue(reader)
    mismatches = 0
    for n in range(4):    # damage each replica in turn, across keys (reads start at either)
        key = b"two-%s-%d" % (reader.encode(), n)
        data = payload(key)
        client.put(key, data, replicas=2)
        flip(cluster, replicas_of(cluster, key)[n % 2])
        before = dict(client.checksum_counters)
        assert bytes(client.get(key, verify=True)) == data
        got = delta(client, before)
        assert got["checksum_verified"] == 1 and got.get("checksum_mismatches", 0) <= 1
        mismatches += got.get("checksum_mismatches", 0)
        buffer = bytearray(len(data))
        assert client.get_many_into([key], [buffer], verify=True) == [len(data)]
        assert bytes(buffer) == data
    assert mismatches >= 1          # a damaged replica was read first, then the other


def test_an_object_put_without_a_checksum_is_read_unchecked(cluster):
    writer = cluster.client(checksums=False)
    data = payload(b"unchecked")
    writer.put(b"unchecked", data)
    assert cluster.master.core.directory.objects[b"unchecked"].checksum == 0
    flip(cluster, replicas_of(cluster, b"unchecked")[0])
    before = dict(writer.checksum_counters)
    got = bytes(writer.get(b"unchecked", verify=True))
    assert got != data and delta(writer, before) == {"checksum_absent": 1}


def test_verify_refuses_a_destination_it_cannot_hash(cluster, local):
    from kvproto.runtime.datapath import Consume
    local.put(b"consumed", payload(b"consumed"))
    with pytest.raises(errors.InvalidArgument):
        local.get_into(b"consumed", Consume(64 * KiB, lambda src: None), verify=True)


@pytest.mark.parametrize("direct", [True, False])
def test_a_fills_checksum_is_taken_where_it_produced_the_bytes(cluster, direct):
    """A Fill (a GPU's DMA) writes straight into a same-host segment, or into
    a staging buffer that is sent: the checksum is of those bytes."""
    from kvproto.runtime.datapath import Fill
    writer = cluster.client(local_writes=direct)
    key, data = b"filled-%d" % direct, payload(b"filled-%d" % direct)

    def fill(dst):
        dst[:] = np.frombuffer(data, np.uint8)

    before = writer.transfer_counters["direct_writes"]
    writer.put(key, Fill(len(data), fill), replicas=2)
    assert (writer.transfer_counters["direct_writes"] > before) == direct
    assert cluster.master.core.directory.objects[key].checksum == checksum(data)
    assert bytes(writer.get(key, verify=True)) == data


@pytest.mark.parametrize("batch", [4096, 2], ids=["one put_start", "put_starts sent ahead"])
def test_a_puts_checksums_are_computed_while_its_put_start_is_with_the_master(
        cluster, monkeypatch, batch):
    """Each key's bytes are hashed after the ``put_start`` naming it was sent
    and before its answer is awaited, so the hash overlaps the master's work
    (with ``batch=2`` the later chunks' requests go out ahead of their writes);
    the checksums still reach the directory."""
    from kvproto.runtime import datapath
    writer = cluster.client(batch=batch, window=2)
    keys = [b"overlap-%d-%d" % (batch, n) for n in range(5)]
    data = {k: k.ljust(32, b".") + payload(k, 4 * KiB) for k in keys}
    events: list = []
    started: dict[int, list] = {}           # put_start rid -> its keys
    send, await_master = writer._send, writer._await_master

    def sending(sock, op, body, *more):
        rid = send(sock, op, body, *more)
        if op == "put_start":
            started[rid] = [bytes(item[0]) for item in body["items"]]
            events.append(("sent", rid))
        return rid

    def awaiting(sock, rid, *more):
        if rid in started:
            events.append(("await", rid))
        return await_master(sock, rid, *more)

    def hashing(view, checksum=datapath.checksum):
        events.append(("hash", bytes(view[:32]).rstrip(b".")))
        return checksum(view)

    monkeypatch.setattr(writer, "_send", sending)
    monkeypatch.setattr(writer, "_await_master", awaiting)
    monkeypatch.setattr(datapath, "checksum", hashing)
    assert writer.put_many([(k, data[k]) for k in keys]) == [None] * len(keys)
    assert len(started) == (1 if batch > len(keys) else 3)
    for rid, named in started.items():
        sent, awaited = events.index(("sent", rid)), events.index(("await", rid))
        for key in named:
            assert sent < events.index(("hash", key)) < awaited, (key, events)
    for k in keys:
        assert cluster.master.core.directory.objects[k].checksum == checksum(data[k])
