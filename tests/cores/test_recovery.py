"""The columnar rebuild (kvproto/cores/recovery.py) against the reference:
``failover.rebuild_directory`` then ``publish.restored``, on random indexes of
several nodes that agree, disagree (another term, another token, another
checksum) or hold unpublished allocations; and the wire form of an index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvproto.cores.recovery import COLUMNS, IndexColumns, recovered
from kvproto.statemachines import failover as fm
from kvproto.statemachines.publish import Replica, restored

NODES = ["n-a", "n-b", "n-c", "n-d"]

entries = st.builds(fm.IndexEntry, term=st.integers(1, 3), published=st.booleans(),
                    by=st.integers(0, 3), offset=st.integers(0, 1 << 40),
                    length=st.integers(1, 4096), token=st.integers(1, 4),
                    checksum=st.sampled_from([0, 7, 7, 7, (1 << 64) - 1]),
                    requested=st.sampled_from([0, 1, 2, 3]))
keys = st.sampled_from([b"k%d" % i for i in range(12)] + [b"", b"x" * 30, "k\u00e9".encode()])
indexes = st.dictionaries(st.sampled_from(NODES), st.dictionaries(keys, entries, max_size=12),
                          max_size=4)


def reference(capacities, indexes, next_token):
    rebuilt = fm.rebuild_directory(indexes, frozenset(capacities))
    objects = [(key, e.token, e.length, tuple(Replica(n, off, e.length) for n, off in e.replicas),
                e.checksum, e.requested) for key, e in rebuilt.items()]
    return restored(capacities, objects, next_token)


@settings(max_examples=300, deadline=None)
@given(indexes=indexes, live=st.sets(st.sampled_from(NODES)), next_token=st.integers(1, 6),
       capacity=st.sampled_from([1 << 50, 5000]))
def test_recovered_equals_the_reference_rebuild(indexes, live, next_token, capacity):
    capacities = {n: capacity for n in sorted(live, reverse=True)}
    columns = {n: IndexColumns.of(ix) for n, ix in indexes.items()}
    try:
        want = reference(capacities, indexes, next_token)
    except ValueError:                          # more bytes than a segment holds
        with pytest.raises(ValueError):
            recovered(capacities, columns, next_token)
        return
    mismatches: list = []
    assert recovered(capacities, columns, next_token, mismatches=mismatches).reference() == want
    assert mismatches == fm.checksum_mismatches(indexes, frozenset(capacities))


def test_a_replica_with_another_checksum_is_left_out_and_reported():
    """Three nodes published one allocation; one records another checksum."""
    same = fm.IndexEntry(1, True, 1, 0, 10, 0xAB, 5)
    odd = fm.IndexEntry(1, True, 1, 4096, 10, 0xCD, 5)
    indexes = {"n-a": {b"k": same}, "n-b": {b"k": odd}, "n-c": {b"k": same}}
    capacities = dict.fromkeys(indexes, 1 << 20)
    mismatches: list = []
    core = recovered(capacities, {n: IndexColumns.of(ix) for n, ix in indexes.items()}, 1,
                     mismatches=mismatches)
    record = core.objects[b"k"]
    assert [r.segment for r in record.replicas] == ["n-a", "n-c"] and record.checksum == 0xAB
    assert mismatches == [(b"k", "n-b", 4096)] == fm.checksum_mismatches(indexes, frozenset(indexes))
    assert core.reference() == reference(capacities, indexes, 1)


@settings(max_examples=100, deadline=None)
@given(index=st.dictionaries(keys, entries, max_size=12))
def test_an_index_survives_its_wire_form(index):
    cols = IndexColumns.of(index)
    back = IndexColumns.from_frames([bytes(f) for f in cols.frames()], len(cols))
    assert back.entries() == index


def _frames(keys):
    zeros = {name: [0] * len(keys) for name, _ in COLUMNS}
    return [bytes(f) for f in IndexColumns(keys, **zeros).frames()]


@pytest.mark.parametrize("damage", ["frames", "count", "bounds", "twice"])
def test_a_malformed_index_is_refused(damage):
    frames, count = _frames([b"a", b"bb"]), 2
    if damage == "frames":
        frames = frames[:-1]
    elif damage == "count":
        count = 3
    elif damage == "bounds":
        frames[0] += b"z"
    else:
        frames = _frames([b"a", b"a"])
    with pytest.raises(ValueError):
        IndexColumns.from_frames(frames, count)


def test_a_nodes_index_columns_are_what_its_index_request_returns():
    from kvproto.cores.storage import StorageNodeCore
    node = StorageNodeCore("n-a")
    node.step(fm.Fence(2))
    for i in range(40):
        key = b"k%02d" % i
        node.step(fm.StampedAllocate("n-a", key, 2, 4096 * i, 100 + i, i + 1))
        if i % 3:
            node.step(fm.StampedPublish("n-a", key, 2, (1 << 64) - 1 - i if i % 2 else 0))
    for i in range(0, 40, 7):
        node.step(fm.StampedFree("n-a", b"k%02d" % i, 2, i + 1))
    (returned,) = node.step(fm.IndexRequest(2))
    want = dict(returned.index.items())
    assert len(want) == 34 and node.index_columns().entries() == want
    assert {e.checksum for e in want.values()} > {0, (1 << 64) - 2}
