"""The same-host data path's memory (:mod:`kvproto.runtime.datapath`,
:mod:`kvproto.runtime.shm`): a plain ``get`` copies into a buffer the client
uses again only once nobody holds it; a client maps a segment's pages when it
maps the segment; and for objects of many sizes (odd ones, page and MiB
boundaries) a direct put records the checksum of exactly the bytes it wrote,
which ``verify=True`` reads then find, by every read path."""

from __future__ import annotations

import mmap
import resource

import numpy as np
import pytest

import kvproto
from kvproto.runtime.datapath import ReadBuffers, checksum
from kvproto.runtime.shm import LocalSegment, SegmentMemory

MiB = 1 << 20
BIG = 2 * MiB           # at or above ReadBuffers.MIN_BYTES: plain gets reuse memory


def data_of(key: bytes, size: int) -> np.ndarray:
    return np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="48MiB", client_timeout=10.0) as c:
        yield c


@pytest.fixture
def client(cluster):
    c = cluster.client()
    yield c
    c.close()


# ------------------------------------------------------------------ ReadBuffers

def address(view) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_a_buffer_is_used_again_only_once_every_view_of_it_is_gone():
    pool = ReadBuffers()
    first = memoryview(pool.take(BIG))
    where = address(first)
    second = memoryview(pool.take(BIG))          # the first is held: fresh memory
    assert address(second) != where and pool.fresh == 2
    derived = np.frombuffer(first, dtype=np.uint16)[10:20]
    del first
    third = pool.take(BIG)                       # an array made from the view holds it still
    assert third.ctypes.data != where and pool.reused == 0
    del derived
    again = pool.take(BIG)
    assert again.ctypes.data == where and pool.reused == 1
    assert pool.take(BIG).ctypes.data not in (where, address(second), third.ctypes.data)


def test_a_buffer_is_reused_for_a_smaller_object_only_down_to_half_its_size():
    pool = ReadBuffers()
    where = pool.take(BIG).ctypes.data             # dropped at once: idle
    assert pool.take(BIG - 1).ctypes.data == where
    got = pool.take(BIG // 2)                       # half the size: not this buffer
    assert got.ctypes.data != where and got.nbytes == BIG // 2
    assert pool.take(BIG).nbytes == BIG


def test_small_objects_get_fresh_memory_and_the_pool_holds_at_most_its_capacity():
    pool = ReadBuffers(capacity=3 * BIG)
    assert pool.take(ReadBuffers.MIN_BYTES - 1).nbytes == ReadBuffers.MIN_BYTES - 1
    held = [pool.take(BIG) for _ in range(5)]      # all in use at once
    assert sum(b.nbytes for b in pool._bufs) <= 3 * BIG
    del held
    pool.take(3 * BIG)                              # idle buffers make room for it
    assert sum(b.nbytes for b in pool._bufs) <= 3 * BIG
    off = ReadBuffers(capacity=0)
    off.take(BIG)
    assert off._bufs == [] and off.take(BIG).nbytes == BIG


def test_small_objects_are_cut_from_shared_slabs_without_overlapping():
    pool = ReadBuffers()
    sizes = [1, 4096, 5000, ReadBuffers.SLAB_OBJECT] * 12     # several slabs' worth
    views = [pool.take(n) for n in sizes]
    assert [v.nbytes for v in views] == sizes and not any(v.readonly for v in views)
    for n, v in enumerate(views):
        v[:] = bytes([n]) * v.nbytes
    spans = sorted((address(v), address(v) + v.nbytes) for v in views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(bytes(v) == bytes([n]) * v.nbytes for n, v in enumerate(views))
    assert len({v.obj.ctypes.data for v in views}) > 1 and pool._bufs == []
    assert pool.take(ReadBuffers.SLAB_OBJECT + 1).nbytes == ReadBuffers.SLAB_OBJECT + 1


def test_a_slab_is_cut_again_only_once_every_value_cut_from_it_is_gone():
    pool = ReadBuffers()
    per_slab = ReadBuffers.SLAB_BYTES // 4096
    first = [pool.take(4096) for _ in range(per_slab)]
    slab = first[0].obj.ctypes.data
    held = np.frombuffer(first[-1], dtype=np.uint8)[:8]    # an array made from one value
    del first
    later = [pool.take(4096) for _ in range(2 * per_slab)]  # the first slab held: fresh ones
    assert slab not in {v.obj.ctypes.data for v in later} and pool.reused == 0
    del held
    again = [pool.take(4096) for _ in range(per_slab)]
    assert {v.obj.ctypes.data for v in again} == {slab} and pool.reused == per_slab
    assert len({address(v) for v in later + again}) == len(later + again)


def test_a_whole_request_of_small_objects_is_cut_again_from_kept_slabs():
    """The values of a get_many of 4,096 objects of 4 KiB (one request at
    the default batch), let go before the next such call: every copy of that
    call lands in memory the first one faulted in."""
    pool = ReadBuffers()
    first = [pool.take(4096) for _ in range(4096)]
    del first
    again = [pool.take(4096) for _ in range(4096)]
    assert (pool.fresh, pool.reused) == (4096, 4096)
    assert len({address(v) for v in again}) == len(again)


def test_a_held_get_keeps_its_bytes_while_later_gets_reuse_released_memory(client):
    a, b = data_of(b"held-a", BIG), data_of(b"held-b", BIG)
    client.put(b"held-a", a)
    client.put(b"held-b", b)
    kept = client.get(b"held-a")
    as_array = np.frombuffer(client.get(b"held-b"), dtype=np.uint8)   # only an array of it kept
    for _ in range(3):       # each returned view dropped at once: its memory serves the next
        assert bytes(client.get(b"held-b")) == b.tobytes()
    assert client.read_buffers.reused >= 2
    assert bytes(kept) == a.tobytes() and np.array_equal(as_array, b)
    assert address(kept) != as_array.ctypes.data
    assert not kept.readonly and kept.nbytes == BIG


# ------------------------------------------------------------------ mapping

def test_a_client_maps_the_segments_pages_when_it_maps_the_segment():
    """A copy into a region this process never touched takes no page faults
    (without MAP_POPULATE: one per 4 KiB page, 2,048 for these 8 MiB)."""
    mem = SegmentMemory(16 * MiB, 4096, prefix="kvpt")
    src = np.ones(8 * MiB, dtype=np.uint8)
    try:
        seg = LocalSegment(mem.name, mem.gen_name, mem.capacity, mem.page_size, writable=True)
        dst = seg.region(8 * MiB, 8 * MiB)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        np.copyto(dst, src)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < (8 * MiB // mmap.PAGESIZE) // 8, faults
        assert bytes(mem.view(8 * MiB, 16)) == b"\x01" * 16
        del dst
        seg.close()
    finally:
        mem.close()


# ------------------------------------------------------------------ checksums by size

SIZES = [1, 7, 4095, 4096, 4097, 65535, 65537, MiB - 1, MiB, MiB + 1, 3 * MiB + 12345]


def test_a_direct_put_records_the_checksum_of_the_bytes_it_wrote_for_every_size(cluster, client):
    network = cluster.client(local_reads=False)
    before = client.transfer_counters["direct_writes"]
    try:
        for size in SIZES:
            key = b"size-%d" % size
            data = data_of(key, size)
            client.put(key, data)
            record = cluster.master.core.directory.objects[key]
            assert record.checksum == checksum(data.tobytes()) != 0, size
            (replica,) = record.replicas
            (node,) = cluster.storage
            assert checksum(node.memory.view(replica.offset, size)) == record.checksum, size
            for reader in (client, network):
                assert bytes(reader.get(key, verify=True)) == data.tobytes(), size
                out = np.zeros(size + 3, dtype=np.uint8)
                assert reader.get_into(key, out, verify=True) == size
                assert np.array_equal(out[:size], data) and not out[size:].any(), size
    finally:
        network.close()
    assert client.transfer_counters["direct_writes"] - before == len(SIZES)
    assert client.checksum_counters["checksum_verified"] == 2 * len(SIZES)
    assert client.checksum_counters["checksum_mismatches"] == 0
