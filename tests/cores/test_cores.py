"""What the differential test's populations do not reach: eviction order over
thousands of candidates (several selection batches), segment ids past the
16-bit columns, and the row dicts staying out of the garbage collector."""

import gc
import random

from kvproto.cores.directory import DirectoryCore, SEGMENT_ID_LIMIT
from kvproto.cores.leases import LeaseCore
from kvproto.statemachines import lease as L, publish as P


def test_eviction_candidates_are_least_recently_used_first_over_many_batches():
    rng = random.Random(7)
    core, ref = LeaseCore(1000), L.new_table(1000)

    def step(event):
        nonlocal ref
        ref, _ = L.master_step(ref, event)
        core.step(event)

    keys = [f"k{i}" for i in range(5000)]
    for i, key in enumerate(keys):
        step(L.Put(key, (key, i), rng.randint(1, 100)))
    for t in range(1, 400):
        step(L.Tick(t))
        for key in rng.sample(keys, 8):
            step(L.Grant(("reader", t, key), key))
        for holder in rng.sample(list(ref.leases), min(6, len(ref.leases))):
            step(L.Release(holder))
    mine = list(core.eviction_candidates())
    theirs = list(L.eviction_candidates(ref))
    assert len(mine) > 256 * 8 and sorted(mine) == sorted(theirs)
    last = [ref.last_used[k] for k, _ in mine]
    assert last == sorted(last)
    assert not any(core.is_leased(k) for k, _ in mine)
    assert core.reference() == ref


def test_segment_ids_past_the_columns_take_the_overflow_path():
    capacities = {f"s{i}": 1 << 20 for i in range(SEGMENT_ID_LIMIT + 2)}
    core, ref = DirectoryCore.restored(capacities, [], 1), P.restored(capacities, [], 1)

    def step(event):
        nonlocal ref
        ref, expected = P.master_step(ref, event)
        assert core.step(event) == expected

    far, near = f"s{SEGMENT_ID_LIMIT + 1}", "s3"
    step(P.PutStart(b"k", 10, (P.Replica(near, 0, 10), P.Replica(far, 0, 10))))
    assert core._extra                     # the replica on `far` is not in the columns
    step(P.PutEnd(b"k", 1))
    step(P.ReadBegin(b"k"))
    step(P.SegmentLost(far))
    step(P.ReadBegin(b"k"))
    assert core.reference() == ref


def test_row_dicts_stay_out_of_the_garbage_collector():
    core = DirectoryCore()
    leases = LeaseCore(5, rows=core.rows)
    core.step(P.AddSegment("s", 1 << 30))
    for i in range(1000):
        key = b"key-%d" % i
        grant = core.step(P.PutStart(key, 1, (P.Replica("s", i, 1),)))[0]
        core.step(P.PutEnd(key, grant.token))
        leases.step(L.Put(key, (key, grant.token), 1))
    assert not gc.is_tracked(core.rows.index) and not gc.is_tracked(core.rows.keys)
    assert len(core.rows.index) == 1000 == core.count == leases.count


def test_reclaimable_names_the_refusal_remove_would_give_and_steps_nothing():
    core = LeaseCore(5.0)
    core.step(L.Put("k", ("k", 1), 10))
    core.step(L.Grant("h", "k"))
    for key in ("k", "absent"):
        before = core.reference()
        err = core.reclaimable(key)
        assert core.reference() == before
        refused = core.copy().step(L.Remove(key))
        assert type(refused[0]) is L.Refused and type(refused[0].error) is type(err)
        assert str(refused[0].error) == str(err)
    core.step(L.Release("h"))
    assert core.reclaimable("k") is None and core.copy().step(L.Evict("k"))[0].key == "k"
    inherited = LeaseCore.restored(5.0, 0.0, [("j", ("j", 1), 10)])
    assert "previous master" in str(inherited.reclaimable("j"))


def test_rows_released_in_bulk_are_free_once_swept_and_a_key_holds_its_row_again():
    """``Rows.release_many`` leaves the keys in the index until ``sweep`` (or
    a new key's ``acquire``) takes them out; a key acquired again meanwhile
    holds its old row; a row listed but freed or reused since is freed once."""
    import numpy as np
    from kvproto.cores.rows import Rows
    rows = Rows()
    held = [rows.acquire(b"k%d" % i, 1) for i in range(8)]
    rows.release_many(np.array(held[:6]), 1)
    assert rows.index[b"k0"] == held[0] and not rows.free and len(rows.stale) == 6
    assert rows.acquire(b"k1", 2) == held[1]             # held again: stays held
    rows.release(held[1], 2)                              # freed one at a time
    assert rows.acquire(b"new", 1) == held[5]             # k5 swept first, its row reused
    rows.release_many(np.array([held[5]]), 1)             # listed again (row 1: freed, listed)
    assert rows.sweep(1 << 20) == 0
    assert set(rows.index) == {b"k6", b"k7"}
    assert all(rows.keys[row] == key for key, row in rows.index.items())
    assert sorted(rows.free) == sorted(held[:6]) and len(set(rows.free)) == 6
    assert [rows.acquire(b"x%d" % i, 1) for i in range(6)] and rows.size == 8


def test_leases_granted_together_expire_alone_once_renewed_or_granted_again():
    """Of the leases one ``grant_many`` granted, one renewed, or released and
    granted again, is not ended with the others (the reference stepped alike
    ends the same leases)."""
    keys = [f"k{i}" for i in range(4)]
    core, ref = LeaseCore(5), L.new_table(5)
    steps = [L.Put(k, (k, 1), 10) for k in keys]
    for event in steps:
        ref, _ = L.master_step(ref, event)
        core.step(event)
    holders = [("c", i) for i in range(4)]
    assert core.grant_many(list(zip(holders, keys))) == [5, 5, 5, 5]
    for event in [L.Grant(h, k) for h, k in zip(holders, keys)]:
        ref, _ = L.master_step(ref, event)
    for event in (L.Tick(1), L.Renew(holders[1]), L.Release(holders[2]),
                  L.Grant(holders[2], keys[3]), L.Tick(5.5), L.Tick(6)):
        ref, expected = L.master_step(ref, event)
        got = core.step(event)
        assert sorted(map(repr, got)) == sorted(map(repr, expected)), event
        assert core.reference() == ref
    assert not core.leases
