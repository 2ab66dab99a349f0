"""Direct writers with real processes (spec/DirectWrite.tla,
docs/protocols/directwrite.md): a client on the storage node's host writes its
replicas straight into the segment; a writer paused past its revoke keeps its
region (draining) until it resumes and reports or dies, and no reader ever
sees its bytes in another object."""

from __future__ import annotations

import hashlib
import signal
import time

import pytest

import kvproto
from kvproto import errors

from runtime_helpers import wait_for

pytestmark = pytest.mark.runtime

SIZE = 256 << 10
SEGMENT = 4 * SIZE          # four regions: a held one is missed at once


def value(key: bytes, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


def start_master(spawn, writer_timeout=0.6):
    m = spawn(f"""
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout={writer_timeout}, storage_timeout=30.0,
                   high_watermark=1.0)      # a full segment is not evicted: the test fills it
    """)
    return m, m.readline().rsplit(" ", 1)[1]


def start_storage(spawn, master):
    s = spawn(f"""
        from kvproto.runtime.embedded import run_storage
        run_storage({master!r}, {SEGMENT}, page_size=4096)
    """)
    s.readline()
    return s


# A direct writer that stops after its grant (the assign shown, nothing copied)
# until the file GO exists, then copies, reports and asks to publish.
WRITER = """
    import os, time
    from kvproto.runtime import datapath
    from kvproto.runtime.client import Client
    c = Client({address!r}, timeout=10.0)
    lock = c._writer_lock()
    rep = c._call_master("put_start", {{"client": c.client_id, "replicas": 1, "writer": lock.name,
                                       "host": c._writable.host, "items": [[b"victim", {size}]]}},
                         time.monotonic() + 5)
    code, grant = rep.body["items"][0]
    assert code == 0 and grant.get("direct"), grant
    seg, off, length = grant["replicas"][0]
    info = rep.body["segments"][seg]
    mapped = c._writable.get(info)
    while not mapped.assigned(off, grant["token"], info[4]):
        time.sleep(0.001)
    print("granted", off, flush=True)
    while not os.path.exists({go!r}):
        time.sleep(0.005)
    wrote = datapath.write_direct(mapped, off, grant["token"], info[4],
                                  memoryview(b"V" * {size}), time.monotonic() + 5)
    print("wrote", wrote, flush=True)
    from kvproto.runtime import wire
    end = c._call_master("put_end", {{"client": c.client_id, "items": [[b"victim", grant["token"]]]}},
                         time.monotonic() + 5)
    err, _ = wire.item_result(end.body["items"][0])
    print("ended" if err is None else "refused " + type(err).__name__, flush=True)
    time.sleep(60)
"""


@pytest.fixture
def store(children):
    master, address = start_master(children)
    start_storage(children, address)
    client = kvproto.Client(address, timeout=10.0)
    wait_for(lambda: any(s["live"] for s in client.stats()["segments"].values()),
             what="the storage node")
    yield address, client
    client.close()


def segment(client) -> dict:
    (s,) = [s for s in client.stats()["segments"].values() if s["live"]]
    return s


def test_same_host_puts_write_straight_into_the_segment(store):
    _, client = store
    keys = [b"d%d" % i for i in range(3)]
    assert client.put_many([(k, value(k)) for k in keys]) == [None] * 3
    assert client.transfer_counters["direct_writes"] == 3
    assert client.transfer_counters["network_writes"] == 0
    for k in keys:
        assert bytes(client.get(k)) == value(k)
    remote = kvproto.Client(store[0], local_reads=False, local_writes=False)
    remote.put(b"net", value(b"net"))
    assert remote.transfer_counters == {"direct_writes": 0, "network_writes": 1,
                                        "local_reads": 0, "network_reads": 0}
    assert bytes(remote.get(b"net")) == value(b"net")
    remote.close()


def _paused_writer(children, address, client, go):
    """A direct writer granted a region, then stopped (SIGSTOP) before it wrote,
    past its writer timeout: the master reclaims the attempt, and the node
    keeps the region draining for it."""
    writer = children(WRITER.format(address=address, size=SIZE, go=str(go)))
    _, offset = writer.readline().split()
    writer.proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: client.stats()["counters"]["reclaimed"] == 1, timeout=10, what="the reclaim")
    wait_for(lambda: segment(client)["draining"] == SIZE, what="the region draining")
    return writer, int(offset)


def test_a_writer_paused_past_its_revoke_keeps_its_region_until_it_reports(store, children, tmp_path):
    address, client = store
    writer, offset = _paused_writer(children, address, client, tmp_path / "go")
    s = segment(client)
    assert s["free"] == SEGMENT and s["allocator_free"] == SEGMENT - SIZE   # not handed out
    # the other three regions fill up; the fourth is the paused writer's
    others = [b"o%d" % i for i in range(3)]
    assert client.put_many([(k, value(k)) for k in others]) == [None] * 3
    with pytest.raises(errors.NoSpace):
        client.put(b"one-too-many", value(b"one-too-many"))
    # it wakes, writes its bytes (into its own region only), reports: the
    # region drains; its put_end is refused (its attempt was reclaimed)
    writer.proc.send_signal(signal.SIGCONT)
    (tmp_path / "go").touch()
    assert writer.readline() == "wrote True"
    assert writer.readline() == "refused StaleToken"
    wait_for(lambda: segment(client)["draining"] == 0, what="the region drained")
    for k in others:
        assert bytes(client.get(k)) == value(k)          # never mixed with the writer's bytes
    client.put(b"reused", value(b"reused"))              # the region is free again
    assert bytes(client.get(b"reused")) == value(b"reused")
    with pytest.raises(errors.KeyNotFound):
        client.get(b"victim")


def test_a_paused_writer_that_dies_frees_its_region_once_its_death_is_seen(store, children, tmp_path):
    address, client = store
    writer, offset = _paused_writer(children, address, client, tmp_path / "go")
    time.sleep(0.3)                                      # alive but paused: still draining
    assert segment(client)["draining"] == SIZE
    assert segment(client)["allocator_free"] == SEGMENT - SIZE
    writer.proc.send_signal(signal.SIGKILL)
    writer.proc.send_signal(signal.SIGCONT)
    writer.proc.wait(5)
    wait_for(lambda: segment(client)["draining"] == 0, what="the region drained")
    s = segment(client)
    assert s["allocator_free"] == s["free"] == SEGMENT
    keys = [b"after%d" % i for i in range(4)]                # every region usable again
    assert client.put_many([(k, value(k)) for k in keys]) == [None] * 4
    for k in keys:
        assert bytes(client.get(k)) == value(k)
