"""The columnar rebuild (kvproto/cores/recovery.py) against the reference:
``failover.rebuild_directory`` then ``publish.restored``, on random indexes of
several nodes that agree, disagree (another term, another token, another
checksum) or hold unpublished allocations; and the wire form of an index."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from kvproto import errors
from kvproto.cores.recovery import COLUMNS, IndexColumns, Rebuild, recovered
from kvproto.statemachines import failover as fm
from kvproto.statemachines import publish as P
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
    terms: dict = {}
    assert recovered(capacities, columns, next_token, mismatches=mismatches,
                     terms=terms).reference() == want
    assert mismatches == fm.checksum_mismatches(indexes, frozenset(capacities))
    listed = fm.rebuild_directory(indexes, frozenset(capacities)).values()
    assert terms == {b: (min(e.token for e in listed if e.by == b),
                         max(e.token for e in listed if e.by == b))
                     for b in {e.by for e in listed}}


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


@pytest.mark.parametrize("node_kind", ["reference", "core"])
def test_a_repaired_replica_and_its_original_are_both_recovered(node_kind):
    """The original was published in term 1 on n-a; the master of term 4
    repaired it to n-b: allocated there under the object's token and
    published with the object's publishing term (spec ``RepairedEntry``).
    Both hold the object's one allocation: a new master lists both, through
    the reference rebuild and the columns alike, and frees neither."""
    from kvproto.cores.storage import StorageNodeCore
    original = fm.IndexEntry(1, True, 1, 20480, 7122, 0xC, 13, 2)
    repair = [fm.Fence(4), fm.StampedAllocate("n-b", b"k", 4, 40960, 7122, 13),
              fm.StampedPublish("n-b", b"k", 4, 0xC, 2, by=1)]
    if node_kind == "core":
        node = StorageNodeCore("n-b")
        for ev in repair:
            (effect,) = node.step(ev)
            assert not isinstance(effect, fm.Refused)
        copy = node.entry(b"k")
    else:
        node = fm.StorageNode()
        for ev in repair:
            node, (effect,) = fm.storage_step(node, ev)
            assert not isinstance(effect, fm.Refused)
        copy = node.index[b"k"]
    assert copy == attrs.evolve(original, offset=40960)
    indexes = {"n-a": {b"k": original}, "n-b": {b"k": copy}}
    rebuilt = fm.rebuild_directory(indexes, frozenset(indexes))
    assert sorted(rebuilt[b"k"].replicas) == [("n-a", 20480), ("n-b", 40960)]
    capacities = dict.fromkeys(indexes, 1 << 20)
    core = recovered(capacities, {n: IndexColumns.of(ix) for n, ix in indexes.items()}, 14)
    assert sorted((r.segment, r.offset) for r in core.objects[b"k"].replicas) == \
        [("n-a", 20480), ("n-b", 40960)]
    assert core.reference() == reference(capacities, indexes, 14)


def test_a_repair_stamped_with_its_own_term_would_leave_the_original_out():
    """Why the copy records the object's publishing term: stamped with the
    repairing master's (the weakened Failover_Weak_RepairStampsOwnTerm), the
    rebuild takes it for a later allocation and the original is left out,
    its region never freed."""
    original = fm.IndexEntry(1, True, 1, 20480, 7122, 0xC, 13, 2)
    own_term = fm.IndexEntry(4, True, 4, 40960, 7122, 0xC, 13, 2)
    indexes = {"n-a": {b"k": original}, "n-b": {b"k": own_term}}
    assert fm.rebuild_directory(indexes, frozenset(indexes))[b"k"].replicas == (("n-b", 40960),)


@pytest.mark.parametrize("node_kind", ["reference", "core"])
def test_a_publishing_term_above_the_commands_is_refused(node_kind):
    from kvproto.cores.storage import StorageNodeCore
    allocate = fm.StampedAllocate("n-b", b"k", 2, 0, 10, 3)
    publish = fm.StampedPublish("n-b", b"k", 2, 0, 0, by=3)
    if node_kind == "core":
        node = StorageNodeCore("n-b")
        node.step(allocate)
        (effect,) = node.step(publish)
        entry = node.entry(b"k")
    else:
        node, _ = fm.storage_step(fm.StorageNode(), allocate)
        node, (effect,) = fm.storage_step(node, publish)
        entry = node.index[b"k"]
    assert isinstance(effect, fm.Refused) and isinstance(effect.error, errors.InvalidArgument)
    assert not entry.published


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
        Rebuild().add("n-a", IndexColumns.from_frames(frames, count))


def _index(keys, published=1, by=1, token=None):
    """Published entries of 10 bytes at offsets 0, 4096, ..."""
    n = len(keys)
    return IndexColumns(keys, term=[1] * n, published=[published] * n, by=[by] * n,
                        offset=[4096 * i for i in range(n)], length=[10] * n,
                        token=token or list(range(1, n + 1)), checksum=[7] * n, requested=[0] * n)


def test_a_refused_index_leaves_the_rebuild_as_it_was():
    """A node whose index lists a key twice joins nothing, not even its
    other keys; one that joined already cannot join again."""
    rebuild = Rebuild()
    rebuild.add("n-a", _index([b"k1", b"k2"]))
    with pytest.raises(ValueError):
        rebuild.add("n-b", _index([b"k3", b"k1", b"k4", b"k4"]))
    with pytest.raises(ValueError):
        rebuild.add("n-a", _index([b"k5"]))
    assert rebuild.seen == {b"k1": 0, b"k2": 1} and rebuild.entries == 2
    rebuild.add("n-b", _index([b"k3"]))
    core = rebuild.directory({"n-a": 1 << 20, "n-b": 1 << 20}, 1)
    assert sorted(core.objects) == [b"k1", b"k2", b"k3"]


@pytest.mark.parametrize("shape", ["one replica", "left out", "two replicas", "mostly unpublished"])
def test_the_keys_dict_becomes_the_row_index_when_no_key_is_on_two_nodes(shape):
    """One replica per object: the rebuild's dict of keys is the directory's
    row index, entries left out (unpublished) are free rows; a key on two
    nodes, or many entries left out, number the rows afresh. Either way the
    directory is the reference's."""
    a = [b"a%03d" % i for i in range(40)]
    b = [b"b%03d" % i for i in range(40)] if shape != "two replicas" else a
    indexes = {"n-a": _index(a), "n-b": _index(b, token=[i + 1 for i in range(40)])}
    if shape == "left out":
        indexes["n-c"] = _index([b"c%03d" % i for i in range(5)], published=0)
    elif shape == "mostly unpublished":
        indexes["n-c"] = _index([b"c%03d" % i for i in range(60)], published=0)
    capacities = dict.fromkeys(indexes, 1 << 30)
    rebuild = Rebuild()
    for node in ("n-b", "n-c", "n-a"):
        if node in indexes:
            rebuild.add(node, indexes[node])
    seen = rebuild.seen
    core = rebuild.directory(capacities, 1)
    assert (core.rows.index is seen) == (shape in ("one replica", "left out"))
    assert len(core.rows.free) == (5 if shape == "left out" else 0)
    reference_indexes = {n: ix.entries() for n, ix in indexes.items()}
    assert core.reference() == reference(capacities, reference_indexes, 1)
    core.step(P.AddSegment("n-d", 1 << 20))     # free rows are reused, the columns grow
    for i in range(50):
        (granted, *_) = core.step(P.PutStart(b"new%d" % i, 10, (Replica("n-d", 4096 * i, 10),)))
        assert isinstance(granted, P.PutGranted)
    assert len(core.objects) == (40 if shape == "two replicas" else 80) + 50


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
