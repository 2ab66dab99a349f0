"""The fast cores against their reference machines, step by step, far beyond
what TLC enumerates: hundreds of keys, two dozen segments, random lengths and
replica counts (past the inline two), writers that stop or time out, segments
lost, pins and leases with time, takeovers, terms and stale stamps. Each
machine feeds every event to the reference and to the core and requires the
same effects (refusals by type and message) and ``core.reference()`` equal to
the reference state after every step.

Two effect sequences are compared as multisets, not in order: the expiries of
one ``Tick`` and the objects of one ``SegmentLost`` (each object's own
effects stay in order). The reference emits them in its hash map's order,
which is not protocol.

The last tests apply a mutation the reference would refuse to each core and
require this check to fail."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test,
)

from kvproto import errors
from kvproto.cores.directory import PENDING, DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.storage import StorageNodeCore
from kvproto.statemachines import failover as F, lease as L, publish as P
from kvproto.statemachines.refusal import Refused

SOAK = os.environ.get("HYPOTHESIS_PROFILE") == "soak"
#: CI: short runs; soak: thousands of steps per example
RUNS = settings(max_examples=400 if SOAK else 20, stateful_step_count=3000 if SOAK else 120,
                deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)

KEYS = [b"prefix/%017d" % i for i in range(300)] + [b"", b"k", b"a-longer-key-" * 4]
SEGMENTS = [f"seg-{i}" for i in range(24)]
GONE = ["gone-0", "gone-1"]                                 # never joined


def _norm(effect):
    if isinstance(effect, Refused):
        return ("refused", type(effect.error), str(effect.error))
    return effect


def _groups(effects) -> Counter:
    """``SegmentLost`` effects as a multiset of per-object runs."""
    runs: list = []
    for e in effects:
        if isinstance(e, (P.Revoked, P.Removed)) or not runs:
            runs.append([])
        runs[-1].append(e)
    return Counter(tuple(r) for r in runs)


def assert_same(expected: tuple, got: tuple, order: str = "exact") -> None:
    """Equal effects; ``order`` "objects": as a multiset of per-object runs
    (``SegmentLost``), "none": as a multiset (``Tick``)."""
    event(f"{type(got[0]).__name__ if got else 'no effect'}"
          + (f" {type(got[0].error).__name__}" if got and isinstance(got[0], Refused) else ""))
    expected, got = tuple(map(_norm, expected)), tuple(map(_norm, got))
    if order == "objects":
        assert _groups(expected) == _groups(got), (expected, got)
    elif order == "none":
        assert Counter(expected) == Counter(got), (expected, got)
    else:
        assert expected == got


def rare(data, one_in: int = 10) -> bool:
    return data.draw(st.integers(0, one_in - 1)) == 0


# --------------------------------------------------------------------------
# The master's directory
# --------------------------------------------------------------------------


def random_objects(data, segments: list, unique: bool):
    objects = []
    for _ in range(data.draw(st.integers(0, 250 if SOAK else 80))):
        key = data.draw(st.sampled_from(KEYS))
        length = data.draw(st.integers(1, 64))
        segs = data.draw(st.lists(st.sampled_from(segments + GONE), min_size=1, max_size=4,
                                  unique=True))
        replicas = tuple(P.Replica(s, data.draw(st.integers(0, 1 << 20)), length) for s in segs)
        objects.append((key, data.draw(st.integers(1, 5000)), length, replicas))
    if unique:
        objects = list({o[0]: o for o in objects}.values())
    return objects


def columns_of(objects, segments: list):
    """The columnar frame of ``objects`` (as an index frame would decode)."""
    frame = segments + GONE
    width = max((len(o[3]) for o in objects), default=1)
    rsegs = np.full((len(objects), width), -1, np.int64)
    roffs = np.zeros((len(objects), width), np.int64)
    for i, (_, _, _, replicas) in enumerate(objects):
        for j, r in enumerate(replicas):
            rsegs[i, j], roffs[i, j] = frame.index(r.segment), r.offset
    offsets = np.cumsum([0] + [len(o[0]) for o in objects])
    return dict(segments=frame, keys=b"".join(o[0] for o in objects), key_offsets=offsets,
                tokens=[o[1] for o in objects], lengths=[o[2] for o in objects],
                replica_segments=rsegs, replica_offsets=roffs)


class DirectoryDiff(RuleBasedStateMachine):
    """publish.Directory + master_step against DirectoryCore."""

    @initialize(how=st.sampled_from(["empty", "restored", "columns"]), data=st.data())
    def start(self, how, data):
        segments = data.draw(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=len(SEGMENTS),
                                      unique=True))
        self.ref, self.core = P.Directory(), DirectoryCore()
        if how != "empty":
            capacities = {s: data.draw(st.sampled_from([1 << 30, 4096])) for s in segments}
            objects = random_objects(data, segments, unique=how == "columns")
            next_token = data.draw(st.integers(1, 9000))
            try:
                ref = P.restored(capacities, objects, next_token)
            except ValueError:
                ref = None
            try:
                if how == "restored":
                    core = DirectoryCore.restored(capacities, objects, next_token)
                else:
                    core = DirectoryCore.from_columns(capacities, **columns_of(objects, segments),
                                                      next_token=next_token)
            except ValueError:
                core = None
            assert (ref is None) == (core is None)
            if ref is not None:
                self.ref, self.core = ref, core
                assert self.core.reference() == self.ref
                return
        for s in segments:
            self.step(P.AddSegment(s, data.draw(st.sampled_from([64, 512, 4096, 1 << 30]))))

    def step(self, event):
        self.ref, expected = P.master_step(self.ref, event)
        got = self.core.step(event)
        assert_same(expected, got, "objects" if isinstance(event, P.SegmentLost) else "exact")
        assert self.core.reference() == self.ref

    def keys_in(self, status):
        return [k for k, r in self.ref.objects.items() if r.status is status]

    def token_for(self, data, key):
        """The key's token mostly, another one sometimes."""
        record = self.ref.objects.get(key)
        if record is not None and not rare(data, 5):
            return record.token
        return data.draw(st.integers(0, self.ref.next_token + 1))

    def pick(self, data, status):
        keys = self.keys_in(status)
        if keys and not rare(data, 5):
            return data.draw(st.sampled_from(keys))
        return data.draw(st.sampled_from(KEYS))

    @rule(segment=st.sampled_from(SEGMENTS + GONE), capacity=st.integers(-1, 1 << 16))
    def add_segment(self, segment, capacity):
        self.step(P.AddSegment(segment, capacity))

    @rule(key=st.sampled_from(KEYS), length=st.integers(1, 64), data=st.data())
    def put_start(self, key, length, data):
        live = [s for s, l in self.ref.segments.items() if l.live]
        pool = live if live and not rare(data) else SEGMENTS + GONE
        segs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4,
                                  unique=not rare(data, 20)))
        placement = []
        for s in segs:
            ledger = self.ref.segments.get(s)
            room = max(0, (ledger.capacity if ledger else 64) - length)
            offset = data.draw(st.integers(0, room)) if not rare(data, 20) else room + 1
            placement.append(P.Replica(s, offset, length if not rare(data, 20) else length + 1))
        if rare(data, 30):
            length = data.draw(st.sampled_from([0, -1]))
        self.step(P.PutStart(key, length, tuple(placement)))

    @rule(data=st.data())
    def put_end(self, data):
        key = self.pick(data, P.Status.PENDING)
        self.step(P.PutEnd(key, self.token_for(data, key)))

    @rule(data=st.data())
    def put_revoke(self, data):
        key = self.pick(data, P.Status.PENDING)
        self.step(P.PutRevoke(key, self.token_for(data, key)))

    @rule(data=st.data())
    def reclaim_abandoned(self, data):
        """A writer timed out."""
        key = self.pick(data, P.Status.PENDING)
        self.step(P.ReclaimAbandoned(key, self.token_for(data, key)))

    @rule(data=st.data())
    def read_begin(self, data):
        self.step(P.ReadBegin(self.pick(data, P.Status.PUBLISHED)))

    @rule(data=st.data())
    def read_end(self, data):
        pinned = [k for k, r in self.ref.objects.items() if r.reads]
        key = data.draw(st.sampled_from(pinned)) if pinned and not rare(data, 4) \
            else self.pick(data, P.Status.PUBLISHED)
        self.step(P.ReadEnd(key, self.token_for(data, key)))

    @rule(data=st.data())
    def remove(self, data):
        self.step(P.Remove(self.pick(data, P.Status.PUBLISHED)))

    @rule(data=st.data())
    def segment_lost(self, data):
        if rare(data, 3):
            self.step(P.SegmentLost(data.draw(st.sampled_from(SEGMENTS + GONE))))


# --------------------------------------------------------------------------
# The master's lease table
# --------------------------------------------------------------------------

LKEYS = [f"k{i}" for i in range(200)]
SLOTS = [f"slot-{i}" for i in range(60)]
HOLDERS = [("client", i) for i in range(40)]


class LeaseDiff(RuleBasedStateMachine):
    """lease.LeaseTable + master_step against LeaseCore, with the runtime's own
    regions ``(key, token)``, the spec's shared slots, and takeovers."""

    @initialize(ttl=st.sampled_from([1, 5, 40, 2.5]), now=st.sampled_from([0, 100, 7.25]))
    def start(self, ttl, now):
        self.ref, self.core = L.LeaseTable(ttl=ttl, now=now), LeaseCore(ttl, now=now)

    def step(self, event):
        self.ref, expected = L.master_step(self.ref, event)
        got = self.core.step(event)
        assert_same(expected, got, "none" if isinstance(event, L.Tick) else "exact")
        assert self.core.reference() == self.ref

    def cached(self, data):
        keys = list(self.ref.objects)
        if keys and not rare(data, 5):
            return data.draw(st.sampled_from(keys))
        return data.draw(st.sampled_from(LKEYS))

    @rule(dt=st.one_of(st.integers(0, 50), st.floats(0, 10, allow_nan=False)), data=st.data())
    def tick(self, dt, data):
        self.step(L.Tick(self.ref.now + dt if not rare(data, 15) else self.ref.now - 1))

    @rule(key=st.sampled_from(LKEYS), kind=st.sampled_from(["own", "own", "slot", "taken", "float"]),
          size=st.integers(1, 1 << 20), data=st.data())
    def put(self, key, kind, size, data):
        token = data.draw(st.integers(1, 50))
        if kind == "own":
            region = (key, token)
        elif kind == "slot":
            region = data.draw(st.sampled_from(SLOTS))
        elif kind == "taken" and self.ref.regions:
            region = data.draw(st.sampled_from(sorted(self.ref.regions, key=repr)))
        else:
            region = (key, float(token))        # equal to (key, token): the dict's path
        self.step(L.Put(key, region, size if not rare(data, 30) else 0))

    @rule(holder=st.sampled_from(HOLDERS), data=st.data())
    def grant(self, holder, data):
        self.step(L.Grant(holder, self.cached(data)))

    def holder(self, data):
        held = list(self.ref.leases)
        return data.draw(st.sampled_from(held)) if held and not rare(data, 5) \
            else data.draw(st.sampled_from(HOLDERS))

    @rule(data=st.data())
    def renew(self, data):
        self.step(L.Renew(self.holder(data)))

    @rule(data=st.data())
    def release(self, data):
        self.step(L.Release(self.holder(data)))

    @rule(data=st.data())
    def remove(self, data):
        self.step(L.Remove(self.cached(data)))

    @rule(data=st.data())
    def evict(self, data):
        self.step(L.Evict(self.cached(data)))

    @rule(data=st.data())
    def disown(self, data):
        self.step(L.Disown(self.cached(data)))

    @rule(quiet=st.sampled_from([None, 0, 3, 0.5, 100]), data=st.data())
    def takeover(self, quiet, data):
        """Spec ``Takeover``: a new master's table with the old one's objects, inherited."""
        objects = [(k, o.region, o.size) for k, o in self.ref.objects.items()]
        ttl, now = self.ref.ttl, self.ref.now
        self.ref = L.restored_table(ttl, now, objects, quiet)
        self.core = LeaseCore.restored(ttl, now, objects, quiet)
        assert self.core.reference() == self.ref

    @rule(data=st.data())
    def queries(self, data):
        key = self.cached(data)
        assert self.core.is_leased(key) == L.is_leased(self.ref, key)
        assert self.core.is_inherited(key) == L.is_inherited(self.ref, key)
        assert self.core.inherited_quiet() == L.inherited_quiet(self.ref)
        assert set(self.core.holders(key)) == set(self.ref.by_key.get(key, ()))

    @rule(fraction=st.floats(0.05, 1.5), high=st.floats(0.1, 1.0))
    def eviction(self, fraction, high):
        """The same candidates, least recently used first (ties may differ), and
        the watermark plan frees the same target."""
        mine = list(self.core.eviction_candidates())
        theirs = list(L.eviction_candidates(self.ref))
        assert Counter(mine) == Counter(theirs)
        last = self.ref.last_used
        order = [last.get(k, 0) for k, _ in mine]
        assert order == sorted(order)
        capacity = max(1, int(self.ref.used / fraction))
        free = high / 2
        plan = L.plan_eviction(self.ref.used, capacity, iter(mine), high_watermark=high,
                               free_fraction=free)
        ref_plan = L.plan_eviction(self.ref.used, capacity, iter(theirs), high_watermark=high,
                                   free_fraction=free)
        assert (plan.target, plan.short) == (ref_plan.target, ref_plan.short)


# --------------------------------------------------------------------------
# The master: directory and lease table on shared rows, as the runtime uses them
# --------------------------------------------------------------------------


class MasterDiff(RuleBasedStateMachine):
    """Both master tables on one set of rows, stepped as the runtime master
    steps them (a published object is cached with region ``(key, token)``; a
    remove asks the lease table first; a takeover restores both in bulk)."""

    TTL = 10

    @initialize(data=st.data())
    def start(self, data):
        self.ref, self.dir = P.Directory(), DirectoryCore()
        self.lref, self.lease = L.new_table(self.TTL), LeaseCore(self.TTL, rows=self.dir.rows)
        for s in SEGMENTS[:data.draw(st.integers(2, 12))]:
            self.dstep(P.AddSegment(s, 1 << 30))

    def dstep(self, event):
        self.ref, expected = P.master_step(self.ref, event)
        got = self.dir.step(event)
        assert_same(expected, got, "objects" if isinstance(event, P.SegmentLost) else "exact")
        for e in expected:
            if isinstance(e, P.Published):
                record = self.ref.objects[e.key]
                self.lstep(L.Put(e.key, (e.key, e.token), record.length * len(record.replicas)))
            elif isinstance(e, P.Removed):
                for holder in list(self.lref.by_key.get(e.key, ())):
                    self.lstep(L.Release(holder))
                self.lstep(L.Remove(e.key))
        return expected

    def lstep(self, event):
        self.lref, expected = L.master_step(self.lref, event)
        got = self.lease.step(event)
        assert_same(expected, got, "none" if isinstance(event, L.Tick) else "exact")
        return expected

    def check(self):
        assert self.dir.reference() == self.ref
        assert self.lease.reference() == self.lref

    @rule(key=st.sampled_from(KEYS), n=st.integers(1, 3), length=st.integers(1, 4096),
          data=st.data())
    def put(self, key, n, length, data):
        live = [s for s, l in self.ref.segments.items() if l.live]
        if len(live) < n:
            return
        segs = data.draw(st.lists(st.sampled_from(live), min_size=n, max_size=n, unique=True))
        effects = self.dstep(P.PutStart(key, length, tuple(
            P.Replica(s, data.draw(st.integers(0, 1 << 29)), length) for s in segs)))
        if isinstance(effects[0], P.PutGranted) and not rare(data, 4):
            self.dstep(P.PutEnd(key, effects[0].token))
        self.check()

    @rule(holder=st.sampled_from(HOLDERS), data=st.data())
    def leased_read(self, holder, data):
        keys = list(self.ref.objects)
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        effects = self.dstep(P.ReadBegin(key))
        if isinstance(effects[0], P.ReadGranted):
            self.dstep(P.ReadEnd(key, effects[0].token))
            self.lstep(L.Grant(holder, key))
        self.check()

    @rule(dt=st.integers(0, 8), data=st.data())
    def time_passes(self, dt, data):
        self.lstep(L.Tick(self.lref.now + dt))
        held = list(self.lref.leases)
        if held:
            holder = data.draw(st.sampled_from(held))
            self.lstep(L.Renew(holder) if data.draw(st.booleans()) else L.Release(holder))
        self.check()

    @rule(data=st.data())
    def remove(self, data):
        keys = list(self.ref.objects)
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        _, effects = L.master_step(self.lref, L.Remove(key))     # asked, not committed
        if key in self.lref.objects and isinstance(effects[0], Refused):
            assert_same(effects, self.lease.step(L.Remove(key)))
        else:
            self.dstep(P.Remove(key))
        self.check()

    @rule(high=st.floats(0.0, 0.9))
    def evict(self, high):
        capacity = max(1, self.lref.used)
        plan = L.plan_eviction(self.lref.used, capacity, self.lease.eviction_candidates(),
                               high_watermark=high, free_fraction=high / 2)
        for key in plan.keys:
            self.dstep(P.Remove(key))
        self.check()

    @rule(data=st.data())
    def segment_lost(self, data):
        live = [s for s, l in self.ref.segments.items() if l.live]
        if live and rare(data, 4):
            self.dstep(P.SegmentLost(data.draw(st.sampled_from(live))))
            self.check()

    @rule(quiet=st.sampled_from([0, 5, 30]), data=st.data())
    def takeover(self, quiet, data):
        """A new master rebuilds both tables in bulk from the published objects."""
        if not rare(data, 6):
            return
        capacities = {s: l.capacity for s, l in self.ref.segments.items() if l.live}
        objects = [(k, r.token, r.length, r.replicas) for k, r in self.ref.objects.items()
                   if r.status is P.Status.PUBLISHED]
        segments = list(capacities)
        now = self.lref.now
        self.ref = P.restored(capacities, objects, self.ref.next_token)
        self.dir = DirectoryCore.from_columns(capacities, **columns_of(objects, segments),
                                              next_token=self.dir.next_token)
        self.lref = L.restored_table(self.TTL, now, [
            (k, (k, r.token), r.length * len(r.replicas)) for k, r in self.ref.objects.items()],
            quiet)
        self.lease = LeaseCore.inherit(self.dir, self.TTL, now, quiet)
        self.check()


# --------------------------------------------------------------------------
# A storage node: region table and index
# --------------------------------------------------------------------------

OFFSETS = list(range(0, 200 * 4096, 4096))
NODE = "node-0"


class StorageDiff(RuleBasedStateMachine):
    """publish.RegionTable + failover.StorageNode and their storage_steps
    against StorageNodeCore."""

    @initialize()
    def start(self):
        self.table, self.node = P.RegionTable(NODE), F.StorageNode()
        self.core = StorageNodeCore(NODE)

    def step(self, event):
        if isinstance(event, (P.AssignRegion, P.FreeRegion, P.WriteReplica, P.ReadReplica)):
            self.table, expected = P.storage_step(self.table, event)
        else:
            self.node, expected = F.storage_step(self.node, event)
        got = self.core.step(event)
        assert_same(expected, got)
        assert self.core.reference() == (self.table, self.node)

    def region_token(self, data, offset):
        region = self.table.regions.get(offset)
        if region is not None and not rare(data, 5):
            return region.token
        return data.draw(st.integers(1, 400))

    def offset(self, data):
        held = list(self.table.regions)
        return data.draw(st.sampled_from(held)) if held and not rare(data, 5) \
            else data.draw(st.sampled_from(OFFSETS))

    def key(self, data):
        held = list(self.node.index)
        return data.draw(st.sampled_from(held)) if held and not rare(data, 5) \
            else data.draw(st.sampled_from(KEYS))

    def term(self, data):
        return max(0, self.node.term + data.draw(st.integers(-2, 2)))

    @rule(offset=st.sampled_from(OFFSETS), key=st.sampled_from(KEYS), token=st.integers(1, 400),
          length=st.integers(1, 4096))
    def assign(self, offset, key, token, length):
        self.step(P.AssignRegion(NODE, offset, length, key, token))

    @rule(data=st.data())
    def free(self, data):
        offset = self.offset(data)
        self.step(P.FreeRegion(NODE, offset, self.region_token(data, offset), 1))

    @rule(data=st.data())
    def write(self, data):
        offset = self.offset(data)
        self.step(P.WriteReplica(NODE, offset, self.region_token(data, offset)))

    @rule(data=st.data())
    def read(self, data):
        offset = self.offset(data)
        self.step(P.ReadReplica(NODE, offset, self.region_token(data, offset)))

    @rule(data=st.data())
    def fence(self, data):
        self.step(F.Fence(self.term(data)))

    @rule(key=st.sampled_from(KEYS), offset=st.sampled_from(OFFSETS), length=st.integers(1, 4096),
          token=st.integers(0, 400), data=st.data())
    def allocate(self, key, offset, length, token, data):
        self.step(F.StampedAllocate(NODE, key, self.term(data), offset, length, token))

    @rule(checksum=st.sampled_from([0, 7, (1 << 64) - 1]), data=st.data())
    def publish(self, checksum, data):
        self.step(F.StampedPublish(NODE, self.key(data), self.term(data), checksum))

    @rule(data=st.data())
    def stamped_read(self, data):
        self.step(F.StampedRead(NODE, self.key(data), self.term(data)))

    @rule(data=st.data())
    def index_request(self, data):
        if rare(data, 5):
            self.step(F.IndexRequest(self.term(data)))

    @rule(data=st.data())
    def purge(self, data):
        self.step(F.PurgeUnpublished(NODE, self.term(data)))

    @rule(data=st.data())
    def stamped_free(self, data):
        key = self.key(data)
        entry = self.node.index.get(key)
        token = entry.token if entry is not None and not rare(data, 5) \
            else data.draw(st.integers(0, 400))
        self.step(F.StampedFree(NODE, key, self.term(data), token))

    @rule(data=st.data())
    def restart(self, data):
        """The node starts over under a new segment id, keeping its term."""
        if rare(data, 8):
            segment = f"node-{data.draw(st.integers(1, 9))}"
            self.table, self.node = P.RegionTable(segment), F.StorageNode(self.node.term)
            self.core.restart(segment)
            assert self.core.reference() == (self.table, self.node)


for machine in (DirectoryDiff, LeaseDiff, MasterDiff, StorageDiff):
    machine.TestCase.settings = RUNS
TestDirectory = DirectoryDiff.TestCase
TestLeases = LeaseDiff.TestCase
TestMaster = MasterDiff.TestCase
TestStorage = StorageDiff.TestCase


# --------------------------------------------------------------------------
# Mutants: a core that breaks a rule the reference keeps fails the check
# --------------------------------------------------------------------------

HUNT = settings(max_examples=300, stateful_step_count=60, deadline=None, derandomize=True,
                database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def test_a_put_end_that_ignores_the_token_is_caught(monkeypatch):
    """PutEnd publishes the pending object whatever token is presented."""
    def any_attempt_owns(self, key, token):
        row = self.rows.index.get(key)
        return row if row is not None and self._st[row] == PENDING else None

    monkeypatch.setattr(DirectoryCore, "_pending_row", any_attempt_owns)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectoryDiff, settings=HUNT)


def test_a_remove_that_ignores_inherited_leases_is_caught(monkeypatch):
    """Remove and Evict only look at this master's leases, not at the
    previous master's (the inherited objects before ``quiet_until``)."""
    def leases_only(self, key, row):
        if row is None or not self._flags[row] & 1:
            return errors.KeyNotFound(f"{key!r}")
        held = self._leased_by(row)
        return errors.ObjectLeased(f"{key!r} has {held} unexpired lease(s)") if held else None

    monkeypatch.setattr(LeaseCore, "_reclaimable", leases_only)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeaseDiff, settings=HUNT)


def test_an_allocation_that_ignores_the_fence_is_caught(monkeypatch):
    """A storage node that records an allocation stamped with a stale term."""
    original = StorageNodeCore._allocate

    def no_fence(self, ev):
        term = self.term
        self.term = min(term, ev.term)
        try:
            return original(self, ev)
        finally:
            self.term = max(term, self.term)

    monkeypatch.setattr(StorageNodeCore, "_allocate", no_fence)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(StorageDiff, settings=HUNT)
