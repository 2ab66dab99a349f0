"""Same-host reads (:mod:`kvproto.runtime.shm`, :mod:`kvproto.runtime.datapath`):
a reader on the storage node's host copies a region straight out of the
node's shared memory, with no term and no node in the loop, and keeps the copy
only if the region's generation word and the segment's nonce were the
descriptor's both before and after the copy (the seqlock). These tests change
the word or the nonce *during* the copy, as a node freeing, reassigning or
starting over at that moment would, and check that the copy is not kept."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvproto
from kvproto import errors
from kvproto.runtime import shm
from kvproto.runtime.datapath import Consume
from kvproto.runtime.shm import LocalSegment, SegmentMemory, gen_word

PAGE = 4096
LENGTH = 3 * PAGE


@pytest.fixture
def segment():
    mem = SegmentMemory(16 * PAGE, PAGE, prefix="kvpt")
    local = LocalSegment(mem.name, mem.gen_name, mem.capacity, mem.page_size)
    yield mem, local
    local.close()
    mem.close()


def publish(mem: SegmentMemory, offset: int, token: int, fill: int) -> None:
    """What a node does for a write of ``token`` into ``offset``: word, bytes, word."""
    mem.set_word(offset, gen_word(token, False))
    mem.view(offset, LENGTH)[:] = bytes([fill]) * LENGTH
    mem.set_word(offset, gen_word(token, True))


def test_a_region_rewritten_during_the_copy_is_not_kept(segment):
    mem, local = segment
    publish(mem, 0, 7, 0xAA)
    nonce = mem.nonce
    copied = []
    assert local.consume(0, LENGTH, 7, nonce, lambda src: copied.append(bytes(src)))
    assert copied == [b"\xaa" * LENGTH]                       # undisturbed: kept

    def freed_and_reassigned(src):
        copied.append(bytes(src))
        mem.set_word(0, 0)                                     # FreeRegion
        publish(mem, 0, 8, 0xBB)                               # another object's write
    assert not local.consume(0, LENGTH, 7, nonce, freed_and_reassigned)

    def rewritten_by_its_writer(src):
        mem.set_word(0, gen_word(8, False))                    # a write of the same token begins
        copied.append(bytes(src))
    assert not local.consume(0, LENGTH, 8, nonce, rewritten_by_its_writer)

    def started_over(src):
        copied.append(bytes(src))
        mem.reset()                                            # a new segment id, new nonce
        publish(mem, 0, 8, 0xCC)
    publish(mem, 0, 8, 0xBB)
    assert not local.consume(0, LENGTH, 8, nonce, started_over)
    # a region that is not complete is not copied at all
    mem.set_word(0, gen_word(8, False))
    assert not local.consume(0, LENGTH, 8, mem.nonce, copied.append)
    assert local.read(0, LENGTH, 8, mem.nonce) is None


@pytest.mark.parametrize("arrays_from", [1, 1 << 30], ids=["array-passes", "region-by-region"])
def test_a_batch_read_keeps_only_regions_complete_before_and_after(segment, monkeypatch, arrays_from):
    """``read_many``, a plain get's pass over one segment: per region the
    checks of every read, in array passes and region by region. Its ``take``
    runs between the first check and the copy, where these rewrites happen."""
    monkeypatch.setattr(shm, "READ_ARRAYS_FROM", arrays_from)
    mem, local = segment
    offsets, tokens = [0, LENGTH, 2 * LENGTH], [7, 8, 9]
    for offset, token, fill in zip(offsets, tokens, (0xAA, 0xBB, 0xCC)):
        publish(mem, offset, token, fill)
    nonce = mem.nonce

    def fresh(n):
        return bytearray(n)
    got = local.read_many(offsets, [LENGTH] * 3, tokens, nonce, fresh)
    assert [bytes(v) for v in got] == [bytes([f]) * LENGTH for f in (0xAA, 0xBB, 0xCC)]
    assert all(type(v) is memoryview for v in got)
    # another token, an old nonce: nothing copied
    assert local.read_many(offsets, [LENGTH] * 3, [8, 9, 7], nonce, fresh) == [None] * 3
    assert local.read_many(offsets, [LENGTH] * 3, tokens, nonce + 1, fresh) == [None] * 3
    taken = []

    def rewritten(n):                 # the middle region's writer starts again,
        taken.append(n)               # after its word was checked, before its copy:
        if len(taken) == (1 if arrays_from == 1 else 2):   # its own take, or the run's
            mem.set_word(LENGTH, gen_word(8, False))
        return bytearray(n)
    got = local.read_many(offsets, [LENGTH] * 3, tokens, nonce, rewritten)
    assert got[1] is None and bytes(got[0]) == b"\xaa" * LENGTH and bytes(got[2]) == b"\xcc" * LENGTH
    # in array passes the three regions, next to each other, are one copy
    assert taken == ([3 * LENGTH] if arrays_from == 1 else [LENGTH] * 3)
    publish(mem, LENGTH, 8, 0xBB)

    def started_over(n):              # a new segment id: the same tokens, other bytes
        mem.reset()
        for offset, token in zip(offsets, tokens):
            publish(mem, offset, token, 0xDD)
        return bytearray(n)
    assert local.read_many(offsets[:1], [LENGTH], tokens[:1], nonce, started_over) == [None]


def test_a_mapping_closed_under_a_batch_reads_and_writes_nothing(segment):
    """A batch holds a segment's mapping while a later lookup in it prunes the
    mapping (the node is gone): the read is a miss of this path, never an
    untyped error."""
    mem, local = segment
    publish(mem, 0, 7, 0xAA)
    local.close()
    assert local.read(0, LENGTH, 7, mem.nonce) is None
    assert not local.read_into(0, LENGTH, 7, mem.nonce, bytearray(LENGTH))
    assert not local.consume(0, LENGTH, 7, mem.nonce, lambda src: None)
    assert not local.assigned(0, 7, mem.nonce)
    assert not local.write(0, memoryview(b"x" * LENGTH))


def test_a_descriptor_of_a_segment_that_started_over_is_not_read(segment):
    """A node that starts over (new segment id) may carry the same token again
    for other bytes; a descriptor from before (old nonce) must not read them."""
    mem, local = segment
    publish(mem, 0, 5, 0x11)
    old = mem.nonce
    assert bytes(local.read(0, LENGTH, 5, old)) == b"\x11" * LENGTH
    mem.reset()
    publish(mem, 0, 5, 0x22)
    assert local.read(0, LENGTH, 5, old) is None
    dest = bytearray(LENGTH)
    assert not local.read_into(0, LENGTH, 5, old, memoryview(dest))
    assert not local.consume(0, LENGTH, 5, old, lambda src: None)
    assert bytes(local.read(0, LENGTH, 5, mem.nonce)) == b"\x22" * LENGTH


def test_a_same_host_read_torn_by_a_rewrite_falls_back_to_the_network():
    """The client's same-host path: when the region's word changes while the
    bytes are being consumed, the client does not keep that copy and asks the
    node over the network, which decides (here: the region is being rewritten,
    so the node refuses and the read is a miss, never the torn bytes)."""
    data = np.random.default_rng(3).integers(0, 256, LENGTH, dtype=np.uint8).tobytes()
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB") as cluster:
        client = cluster.client()
        client.put(b"k", data)
        node = cluster.storage[0]
        ((offset, region),) = node.core.node.regions.items()
        word = node.memory.word(offset)
        assert word == gen_word(region.token, True)
        seen = []

        def consume(src):
            seen.append(bytes(src))
            if len(seen) == 1:                                 # during the same-host copy
                node.memory.set_word(offset, gen_word(region.token, False))

        try:
            with pytest.raises(errors.StaleToken):
                client.get_into(b"k", Consume(LENGTH, consume))
        finally:
            node.memory.set_word(offset, word)
        assert client.transfer_counters["local_reads"] == 0
        assert node.core.counters["stale_reads"] == 1           # the network read was asked
        seen.clear()
        assert client.get_into(b"k", Consume(LENGTH, seen.append)) == LENGTH   # undisturbed
        assert seen == [data] and client.transfer_counters["local_reads"] == 1
        assert node.core.counters["reads"] == 0


def test_regions_next_to_each_other_are_copied_together_up_to_a_run(segment, monkeypatch):
    """In array passes a run of regions that follow each other in the segment
    is one buffer and one copy, cut at ``READ_RUN_BYTES``; a gap starts another."""
    monkeypatch.setattr(shm, "READ_ARRAYS_FROM", 1)
    monkeypatch.setattr(shm, "READ_RUN_BYTES", 2 * LENGTH)
    mem, local = segment
    offsets, tokens = [0, LENGTH, 2 * LENGTH, 4 * LENGTH], [7, 8, 9, 10]
    for offset, token, fill in zip(offsets, tokens, (0xAA, 0xBB, 0xCC, 0xDD)):
        publish(mem, offset, token, fill)
    taken = []

    def take(n):
        taken.append(n)
        return bytearray(n)
    got = local.read_many(offsets, [LENGTH] * 4, tokens, mem.nonce, take)
    assert [bytes(v) for v in got] == [bytes([f]) * LENGTH for f in (0xAA, 0xBB, 0xCC, 0xDD)]
    assert taken == [2 * LENGTH, LENGTH, LENGTH]


def _greedy_runs(starts: list, ends: list, limit: int) -> list:
    """The runs the array passes copy, cut one region at a time: a region
    joins the run before it when it starts where that run ends and the run
    stays within ``limit`` bytes (a run is one region at least)."""
    runs: list = []
    for start, end in zip(starts, ends):
        if runs and start == runs[-1][1] and end - runs[-1][0] <= limit:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [end - start for start, end in runs]


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_runs_of_array_passes_are_cut_one_region_at_a_time(data):
    """However the regions lie (next to each other or not, asked in their
    order in the segment or not, some not complete), the array passes copy
    each complete region's bytes and take one buffer per run of the cut made
    one region at a time (``_greedy_runs``)."""
    pages = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
    mem = SegmentMemory(sum(pages) * PAGE, PAGE, prefix="kvpt")
    local = LocalSegment(mem.name, mem.gen_name, mem.capacity, mem.page_size)
    try:
        regions, at = [], 0
        for n, count in enumerate(pages):
            length = count * PAGE - data.draw(st.sampled_from([0, 0, 1, PAGE - 1]))
            token, complete = n + 1, data.draw(st.booleans()) or n % 3 == 0
            mem.set_word(at, gen_word(token, False))
            mem.view(at, length)[:] = bytes([n + 1]) * length
            mem.set_word(at, gen_word(token, complete))
            regions.append((at, length, token, complete, n + 1))
            at += count * PAGE
        if data.draw(st.booleans()):
            regions = data.draw(st.permutations(regions))
        limit = data.draw(st.sampled_from([PAGE, 2 * PAGE, 5 * PAGE, 64 << 10]))
        offsets, lengths, tokens, complete, fills = (list(c) for c in zip(*regions))
        taken = []

        def take(n):
            taken.append(n)
            return bytearray(n)
        with mock.patch.object(shm, "READ_ARRAYS_FROM", 1), \
                mock.patch.object(shm, "READ_RUN_BYTES", limit):
            got = local.read_many(offsets, lengths, tokens, mem.nonce, take)
        ready = [(o, o + n) for o, n, ok in zip(offsets, lengths, complete) if ok]
        assert taken == _greedy_runs([s for s, _ in ready], [e for _, e in ready], limit)
        assert [None if v is None else bytes(v) for v in got] == \
            [bytes([fill]) * n if ok else None for n, ok, fill in zip(lengths, complete, fills)]
    finally:
        local.close()
        mem.close()
