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
import random
from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings, strategies as st
from hypothesis import event as hypothesis_event   # step() names its argument event
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test,
)

from kvproto import errors
from kvproto.cores.direct import DirectCore
from kvproto.cores import directory as D_core, leases as L_core
from kvproto.cores.directory import PENDING, DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.recovery import IndexColumns, recovered
from kvproto.cores.storage import StorageNodeCore
from kvproto.statemachines import directwrite as D, failover as F, lease as L, publish as P
from kvproto.statemachines.refusal import Refused

SOAK = os.environ.get("HYPOTHESIS_PROFILE") == "soak"
#: CI: short runs; soak: bursts of seeded steps make thousands of steps an example
RUNS = settings(max_examples=400 if SOAK else 20, stateful_step_count=100 if SOAK else 120,
                deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
BURST = 300

KEYS = [b"prefix/%017d" % i for i in range(300)] + [b"", b"k", b"a-longer-key-" * 4]
SEGMENTS = [f"seg-{i}" for i in range(24)]
#: checksums a writer sends with PutEnd (0: none; up to 64 bits)
CHECKSUMS = [0, 1, 0xDEADBEEF, (1 << 63) + 5, (1 << 64) - 1]
GONE = ["gone-0", "gone-1"]                                 # never joined


def _norm(effect):
    """Errors compare by type and message (an exception equals only itself)."""
    if isinstance(effect, Refused):
        return ("refused", type(effect.error), str(effect.error))
    error = getattr(effect, "error", None)
    if isinstance(error, Exception):
        return attrs.evolve(effect, error=(type(error), str(error)))
    return effect


def _groups(effects) -> Counter:
    """``SegmentLost`` effects as a multiset of per-object runs (an object
    that keeps its other replicas has only the cancellations of its repairs)."""
    runs: list = []
    for e in effects:
        key = getattr(e, "key", None)
        if isinstance(e, (P.Revoked, P.Removed)) or not runs \
                or (key is not None and key != runs[-1][0].key):
            runs.append([])
        runs[-1].append(e)
    return Counter(tuple(r) for r in runs)


def assert_same(expected: tuple, got: tuple, order: str = "exact") -> None:
    """Equal effects; ``order`` "objects": as a multiset of per-object runs
    (``SegmentLost``), "none": as a multiset (``Tick``), "kinds": as a
    multiset with the same sequence of effect types (a request's end)."""
    expected, got = tuple(map(_norm, expected)), tuple(map(_norm, got))
    if order == "objects":
        assert _groups(expected) == _groups(got), (expected, got)
    elif order == "none":
        assert Counter(expected) == Counter(got), (expected, got)
    elif order == "kinds":
        assert Counter(expected) == Counter(got), (expected, got)
        assert [type(e) for e in expected] == [type(e) for e in got], (expected, got)
    else:
        assert expected == got


class Choose:
    """The machines' random choices: drawn from Hypothesis (each step
    shrinkable) or, in a soak burst, from a PRNG seeded by one draw."""

    def __init__(self, data=None, seed=None) -> None:
        self.data, self.rng = data, None if seed is None else random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi) if self.rng else self.data.draw(st.integers(lo, hi))

    def float(self, lo: float, hi: float) -> float:
        return self.rng.uniform(lo, hi) if self.rng else \
            self.data.draw(st.floats(lo, hi, allow_nan=False))

    def one(self, options):
        options = list(options)
        return self.rng.choice(options) if self.rng else self.data.draw(st.sampled_from(options))

    def some(self, options, lo: int, hi: int, unique: bool = True) -> list:
        options = list(options)
        if self.rng:
            n = self.rng.randint(lo, min(hi, len(options)) if unique else hi)
            return self.rng.sample(options, n) if unique else \
                [self.rng.choice(options) for _ in range(n)]
        return self.data.draw(st.lists(st.sampled_from(options), min_size=lo, max_size=hi,
                                       unique=unique))

    def rare(self, one_in: int = 10) -> bool:
        return self.int(0, one_in - 1) == 0

    def mostly(self, usual: list, other: list, one_in: int = 5):
        """One of ``usual`` (when there is one) but one time in ``one_in`` one of ``other``."""
        return self.one(usual) if usual and not self.rare(one_in) else self.one(other)


class Differential(RuleBasedStateMachine):
    """A reference and a core stepped alike. Subclasses list their actions
    (methods taking a :class:`Choose`) in ``ACTIONS`` and set up both sides in
    ``begin``."""

    ACTIONS: tuple = ()

    @initialize(data=st.data())
    def start(self, data):
        self.begin(Choose(data))

    @rule(data=st.data())
    def act(self, data):
        choose = Choose(data)
        name = choose.one(self.ACTIONS)
        event(name)
        getattr(self, name)(choose)

    @precondition(lambda self: SOAK)
    @rule(seed=st.integers(0, 2 ** 32 - 1))
    def burst(self, seed):
        """``BURST`` steps chosen by a PRNG (soak only)."""
        choose = Choose(seed=seed)
        for _ in range(BURST):
            getattr(self, choose.one(self.ACTIONS))(choose)


# --------------------------------------------------------------------------
# The master's directory
# --------------------------------------------------------------------------


def random_objects(c: Choose, segments: list, unique: bool):
    objects = []
    for _ in range(c.int(0, 250 if SOAK else 80)):
        key, length = c.one(KEYS), c.int(1, 64)
        replicas = tuple(P.Replica(s, c.int(0, 1 << 20), length)
                         for s in c.some(segments + GONE, 1, 4))
        sums = () if c.rare(3) else (c.one(CHECKSUMS),)      # the fifth item is optional
        objects.append((key, c.int(1, 5000), length, replicas, *sums))
    if unique:
        objects = list({o[0]: o for o in objects}.values())
    return objects


def columns_of(objects, segments: list):
    """The columnar frame of ``objects`` (as an index frame would decode)."""
    frame = segments + GONE
    width = max((len(o[3]) for o in objects), default=1)
    rsegs = np.full((len(objects), width), -1, np.int64)
    roffs = np.zeros((len(objects), width), np.int64)
    for i, (_, _, _, replicas, *_) in enumerate(objects):
        for j, r in enumerate(replicas):
            rsegs[i, j], roffs[i, j] = frame.index(r.segment), r.offset
    offsets = np.cumsum([0] + [len(o[0]) for o in objects])
    sums = {"checksums": [o[4] if len(o) > 4 else 0 for o in objects]} \
        if any(len(o) > 4 for o in objects) else {}
    return dict(segments=frame, keys=b"".join(o[0] for o in objects), key_offsets=offsets,
                tokens=[o[1] for o in objects], lengths=[o[2] for o in objects],
                replica_segments=rsegs, replica_offsets=roffs, **sums)


class DirectoryDiff(Differential):
    """publish.Directory + master_step against DirectoryCore."""

    ACTIONS = ("add_segment", "put_start", "put_start", "put_start", "put_start", "put_end",
               "put_end", "put_end", "put_revoke", "reclaim_abandoned", "read_begin",
               "read_end", "remove", "segment_lost", "repair_start", "repair_start",
               "repair_end", "repair_end", "batch", "batch")

    def begin(self, c: Choose):
        segments = c.some(SEGMENTS, 1, len(SEGMENTS))
        self.ref, self.core = P.Directory(), DirectoryCore()
        how = c.one(["empty", "restored", "columns"])
        if how != "empty":
            capacities = {s: c.one([1 << 30, 4096]) for s in segments}
            objects = random_objects(c, segments, unique=how == "columns")
            next_token = c.int(1, 9000)
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
            self.step(P.AddSegment(s, c.one([64, 4096, 1 << 30, 1 << 30])))

    def step(self, event):
        self.ref, expected = P.master_step(self.ref, event)
        got = self.core.step(event)
        assert_same(expected, got, "objects" if isinstance(event, P.SegmentLost) else "exact")
        assert self.core.reference() == self.ref
        record = self.ref.objects.get(getattr(event, "key", None))
        if record is not None:   # the publish marks' fields, read without a record
            assert self.core.placed(event.key) == (
                record.length, record.checksum, record.requested,
                [(r.segment, r.offset) for r in record.replicas])
        assert set(self.core.below()) == {k for k, r in self.ref.objects.items()
                                          if r.status is P.Status.PUBLISHED and r.below()}
        objects = self.ref.objects    # what an exists answers: Readable(k) of each key
        readable = [k in objects and objects[k].status is P.Status.PUBLISHED for k in KEYS]
        assert self.core.published_many(KEYS) == bytes(readable)
        assert [self.core.published(k) for k in KEYS] == readable
        keys, sizes = self.core.requested_bytes()   # what a takeover charges, no record built
        assert keys == list(self.core.objects)
        assert dict(zip(keys, sizes)) == {k: r.length * r.requested
                                          for k, r in self.ref.objects.items()}
        if isinstance(event, (P.RepairStart, P.ListReplica, P.RepairCancel)):
            ok = not (expected and isinstance(expected[0], Refused))
            hypothesis_event(f"{type(event).__name__} {'accepted' if ok else 'refused'}")

    def key_in(self, c: Choose, status) -> bytes:
        return c.mostly([k for k, r in self.ref.objects.items() if r.status is status], KEYS)

    def token_for(self, c: Choose, key) -> int:
        """The key's token mostly, another one sometimes."""
        record = self.ref.objects.get(key)
        if record is not None and not c.rare(5):
            return record.token
        return c.int(0, self.ref.next_token + 1)

    def add_segment(self, c: Choose):
        self.step(P.AddSegment(c.one(SEGMENTS + GONE), c.int(-1, 1 << 16)))

    def put_start(self, c: Choose):
        self.step(self.put_start_event(c))

    def put_start_event(self, c: Choose) -> P.PutStart:
        key, length = c.one(KEYS), c.int(1, 64)
        live = [s for s, l in self.ref.segments.items() if l.live]
        pool = live if live and not c.rare() else SEGMENTS + GONE
        placement = []
        for s in c.some(pool, 1, 4, unique=not c.rare(20)):
            ledger = self.ref.segments.get(s)
            room = max(0, (ledger.capacity if ledger else 64) - length)
            offset = c.int(0, room) if not c.rare(20) else room + 1
            placement.append(P.Replica(s, offset, length if not c.rare(20) else length + 1))
        if c.rare(30):
            length = c.one([0, -1])
        return P.PutStart(key, length, tuple(placement))

    def batch(self, c: Choose):
        """A batch of one kind of step (``put_start_many``, ``put_end_many``,
        ``remove_many``, ``read_many`` with and without pins) equals the reference's single
        steps folded: the same effects in order, the same state after; a
        refused ``PutStart`` is reported at once, before the next is taken."""
        kind, n = c.one(["put_start", "put_end", "read", "read", "remove"]), c.int(0, 12)
        if kind == "put_start":
            events = [self.put_start_event(c) for _ in range(n)]
            items = [(e.key, e.length, e.placement) for e in events]
            taken, refused = [], []

            def lazily():
                for item in items:
                    taken.append(item)
                    yield item
            results = self.core.put_start_many(
                lazily(), lambda item: refused.append((item, len(taken))))
            got = D_core.put_start_effects(items, results)
            assert refused == [(item, i + 1) for i, (item, r) in enumerate(zip(items, results))
                               if type(r) is not int]
        elif kind == "put_end":
            events = []
            for _ in range(n):
                key = self.key_in(c, P.Status.PENDING)
                events.append(P.PutEnd(key, self.token_for(c, key), c.one(CHECKSUMS)))
            results = self.core.put_end_many([(e.key, e.token, e.checksum) for e in events])
            got = D_core.put_end_effects([(e.key, e.token, e.checksum) for e in events], results)
        elif kind == "remove":
            keys = [self.key_in(c, c.one([P.Status.PUBLISHED, P.Status.PENDING]))
                    for _ in range(n)]
            events = [P.Remove(key) for key in keys]
            got = D_core.remove_effects(keys, self.core.remove_many(keys))
        else:
            pin = c.one([True, False])
            keys = [self.key_in(c, P.Status.PUBLISHED) for _ in range(n)]
            events = [P.ReadBegin(key) for key in keys]
            results = self.core.read_many(keys, pin)
            got = D_core.read_effects(keys, results)
        expected, ref = [], self.ref
        for e in events:
            ref, out = P.master_step(ref, e)
            expected.extend(out)
            if kind == "read" and not pin and isinstance(out[0], P.ReadGranted):
                # the pin ends at once
                ref, ended = P.master_step(ref, P.ReadEnd(e.key, out[0].token))
                assert ended == ()
            if kind == "put_end" and isinstance(out[0], P.Published):
                record = ref.objects[e.key]
                assert results[len(expected) - 1] == (
                    record.length, record.checksum, record.requested,
                    [(r.segment, r.offset) for r in record.replicas])
        self.ref = ref
        assert_same(tuple(expected), got)
        assert self.core.reference() == self.ref

    def put_end(self, c: Choose):
        key = self.key_in(c, P.Status.PENDING)
        self.step(P.PutEnd(key, self.token_for(c, key), c.one(CHECKSUMS)))

    def put_revoke(self, c: Choose):
        key = self.key_in(c, P.Status.PENDING)
        self.step(P.PutRevoke(key, self.token_for(c, key)))

    def reclaim_abandoned(self, c: Choose):
        """A writer timed out."""
        key = self.key_in(c, P.Status.PENDING)
        self.step(P.ReclaimAbandoned(key, self.token_for(c, key)))

    def read_begin(self, c: Choose):
        self.step(P.ReadBegin(self.key_in(c, P.Status.PUBLISHED)))

    def read_end(self, c: Choose):
        pinned = [k for k, r in self.ref.objects.items() if r.reads]
        key = c.mostly(pinned, KEYS, 4)
        self.step(P.ReadEnd(key, self.token_for(c, key)))

    def remove(self, c: Choose):
        self.step(P.Remove(self.key_in(c, P.Status.PUBLISHED)))

    def repair_start(self, c: Choose):
        """A repair of a published object (mostly one below its count), into a
        region of a live segment (mostly one holding none of it)."""
        below = [k for k, r in self.ref.objects.items()
                 if r.status is P.Status.PUBLISHED and r.below()]
        several = sorted({r.replicas[0].segment for r in self.ref.objects.values()
                          if r.status is P.Status.PUBLISHED and len(r.replicas) > 1})
        if not below and several and not c.rare(3):
            # lose a segment of an object with another replica: it is below now
            self.step(P.SegmentLost(c.one(several)))
            fresh = [s for s in SEGMENTS if s not in self.ref.segments]
            if fresh:
                self.step(P.AddSegment(fresh[0], 1 << 30))
            below = [k for k, r in self.ref.objects.items()
                     if r.status is P.Status.PUBLISHED and r.below()]
        key = c.mostly(below, KEYS, 4)
        record = self.ref.objects.get(key)
        length = record.length if record is not None else c.int(1, 64)
        held = set() if record is None else \
            {r.segment for r in record.replicas} | {p.segment for p in record.repairs}
        live = [s for s, l in self.ref.segments.items() if l.live]
        segment = c.mostly([s for s in live if s not in held], SEGMENTS + GONE, 6)
        ledger = self.ref.segments.get(segment)
        room = max(0, (ledger.capacity if ledger else 64) - length)
        offset = c.int(0, room) if not c.rare(20) else room + 1
        token = self.token_for(c, key)
        self.step(P.RepairStart(key, token, P.Replica(segment, offset,
                                                     length if not c.rare(20) else length + 1)))

    def repair_end(self, c: Choose):
        """A copier's report (``ListReplica``) or a cancel, of a repair in flight
        mostly, of none sometimes (a late report)."""
        flying = [(k, p) for k, r in self.ref.objects.items() for p in r.repairs]
        if flying and not c.rare(5):
            key, p = c.one(flying)
            segment, repair = p.segment, p.id if not c.rare(10) else p.id + 1
        else:
            key, segment, repair = c.one(KEYS), c.one(SEGMENTS), c.int(0, self.ref.next_token)
        self.step(c.one([P.ListReplica, P.RepairCancel])(key, segment, repair))

    def segment_lost(self, c: Choose):
        """A segment dies; a node joins with a new one (as a restarted node does)."""
        if c.rare(8):
            self.step(P.SegmentLost(c.one(SEGMENTS + GONE)))
            fresh = [s for s in SEGMENTS if s not in self.ref.segments]
            if fresh:
                self.step(P.AddSegment(fresh[0], 1 << 30))


# --------------------------------------------------------------------------
# The master's lease table
# --------------------------------------------------------------------------

LKEYS = [f"k{i}" for i in range(500)]
SLOTS = [f"slot-{i}" for i in range(60)]
HOLDERS = [("client", i) for i in range(40)]


def drop_reference(ref, core: LeaseCore, keys, evicted: bool = False):
    """The reference's steps for ``core.drop_many(keys)`` one by one (the
    runtime master's for an object gone from its directory), each accepted;
    returns the new reference and the effects in order."""
    effects: list = []
    for key in keys:
        if key not in ref.objects:
            continue
        steps = [L.Release(h) for h in core.holders(key)]
        steps.append(L.Evict(key) if evicted else L.Remove(key))
        for event in steps:
            if isinstance(event, (L.Remove, L.Evict)) and L.is_inherited(ref, key):
                ref, none = L.master_step(ref, L.Disown(key))
                assert none == ()
            ref, out = L.master_step(ref, event)
            assert not isinstance(out[0], Refused), out
            effects.extend(out)
    return ref, tuple(effects)


class LeaseDiff(Differential):
    """lease.LeaseTable + master_step against LeaseCore, with the runtime's own
    regions ``(key, token)``, the spec's shared slots, and takeovers."""

    ACTIONS = ("tick", "tick", "put", "put", "put", "put", "put", "grant", "grant", "renew",
               "release", "remove", "evict", "disown", "takeover", "queries", "eviction",
               "drop_many", "batch", "batch")

    def begin(self, c: Choose):
        ttl, now = c.one([1, 5, 40, 2.5]), c.one([0, 100, 7.25])
        self.ref, self.core = L.LeaseTable(ttl=ttl, now=now), LeaseCore(ttl, now=now)

    def step(self, event):
        self.ref, expected = L.master_step(self.ref, event)
        got = self.core.step(event)
        assert_same(expected, got, "none" if isinstance(event, L.Tick) else "exact")
        assert self.core.reference() == self.ref

    def cached(self, c: Choose):
        return c.mostly(list(self.ref.objects), LKEYS)

    def holder(self, c: Choose):
        return c.mostly(list(self.ref.leases), HOLDERS)

    def tick(self, c: Choose):
        if c.rare(15):
            self.step(L.Tick(self.ref.now - 1))
        else:
            self.step(L.Tick(self.ref.now + (c.int(0, 50) if c.rare(2) else c.float(0, 10))))

    def put(self, c: Choose):
        key, token = c.one(LKEYS), c.int(1, 50)
        kind = c.one(["own", "own", "slot", "taken", "float", "named"])
        if kind == "own":
            region = (key, token)
        elif kind == "named":   # (key, token) first held by another key, then put as key's own
            self.step(L.Put(c.one(LKEYS), (key, token), c.int(1, 1 << 20)))
            region = (key, token)
        elif kind == "slot":
            region = c.one(SLOTS)
        elif kind == "taken" and self.ref.regions:
            region = c.one(sorted(self.ref.regions, key=repr))
        else:
            region = (key, float(token))        # equal to (key, token): the dict's path
        self.step(L.Put(key, region, c.int(1, 1 << 20) if not c.rare(30) else 0))

    def grant(self, c: Choose):
        self.step(L.Grant(c.one(HOLDERS), self.cached(c)))

    def renew(self, c: Choose):
        self.step(L.Renew(self.holder(c)))

    def release(self, c: Choose):
        self.step(L.Release(self.holder(c)))

    def remove(self, c: Choose):
        self.step(L.Remove(self.cached(c)))

    def evict(self, c: Choose):
        self.step(L.Evict(self.cached(c)))

    def disown(self, c: Choose):
        self.step(L.Disown(self.cached(c)))

    def drop_many(self, c: Choose):
        """``drop_many`` of some keys (cached or not, leased, inherited) is
        the reference's steps one by one: per cached key, ``Release`` of each
        lease, ``Disown`` while inherited, then ``Remove`` (or ``Evict``)."""
        leased = sorted(self.ref.by_key)
        others = sorted((set(self.ref.objects) | set(LKEYS[:40])) - set(leased))
        keys = c.some(leased, 0, 8) if leased else []
        keys += c.some(others, 0, 30) if others else []
        evicted = c.rare(3)
        self.ref, expected = drop_reference(self.ref, self.core, keys, evicted)
        rows = [self.core.rows.index.get(k, -1) for k in keys] if c.rare(2) else None
        drops = self.core.drop_many(keys, rows, evicted=evicted)
        assert_same(expected, drops.effects())
        assert len(drops) == sum(isinstance(e, L.Reclaimed) for e in expected)
        assert self.core.reference() == self.ref

    def batch(self, c: Choose):
        """A batch of one kind of step (``put_many``, ``grant_many``,
        ``release_many``) equals the reference's single steps folded: the same
        effects in order, the same state after."""
        kind, n = c.one(["put", "grant", "release"]), c.int(0, 12)
        if kind == "put":
            items = []
            for _ in range(n):
                key, token = c.one(LKEYS), c.int(1, 50)
                region = (key, token) if not c.rare(4) else c.one(SLOTS)
                items.append((key, region, c.int(1, 1 << 20) if not c.rare(30) else 0))
            events = [L.Put(*item) for item in items]
            got = L_core.put_effects(items, self.core.put_many(items))
        elif kind == "grant":
            items = [(c.one(HOLDERS), self.cached(c)) for _ in range(n)]
            events = [L.Grant(*item) for item in items]
            got = L_core.grant_effects(self.core, items, self.core.grant_many(items))
        else:
            holders = [self.holder(c) for _ in range(n)]
            events = [L.Release(h) for h in holders]
            got = L_core.release_effects(holders, self.core.release_many(holders))
        expected = []
        for e in events:
            self.ref, out = L.master_step(self.ref, e)
            expected.extend(out)
        assert_same(tuple(expected), got)
        assert self.core.reference() == self.ref

    def takeover(self, c: Choose):
        """Spec ``Takeover``: a new master's table with the old one's objects, inherited."""
        quiet = c.one([None, 0, 3, 0.5, 100])
        objects = [(k, o.region, o.size) for k, o in self.ref.objects.items()]
        ttl, now = self.ref.ttl, self.ref.now
        self.ref = L.restored_table(ttl, now, objects, quiet)
        self.core = LeaseCore.restored(ttl, now, objects, quiet)
        assert self.core.reference() == self.ref

    def queries(self, c: Choose):
        key = self.cached(c)
        assert self.core.is_leased(key) == L.is_leased(self.ref, key)
        assert self.core.is_inherited(key) == L.is_inherited(self.ref, key)
        assert self.core.inherited_quiet() == L.inherited_quiet(self.ref)
        assert set(self.core.holders(key)) == set(self.ref.by_key.get(key, ()))

    def eviction(self, c: Choose):
        """The same candidates, least recently used first (ties may differ), and
        the watermark plan frees the same target."""
        mine = list(self.core.eviction_candidates())
        theirs = list(L.eviction_candidates(self.ref))
        assert Counter(mine) == Counter(theirs)
        last = self.ref.last_used
        order = [last.get(k, 0) for k, _ in mine]
        assert order == sorted(order)
        high = c.float(0.1, 1.0)
        capacity = max(1, int(self.ref.used / c.float(0.05, 1.5)))
        plans = [L.plan_eviction(self.ref.used, capacity, iter(candidates), high_watermark=high,
                                 free_fraction=high / 2) for candidates in (mine, theirs)]
        assert (plans[0].target, plans[0].short) == (plans[1].target, plans[1].short)


# --------------------------------------------------------------------------
# The master: directory and lease table on shared rows, as the runtime uses them
# --------------------------------------------------------------------------


class MasterDiff(Differential):
    """Both master tables on one set of rows, stepped as the runtime master
    steps them (a published object is cached with region ``(key, token)``; a
    remove asks the lease table first; a takeover restores both in bulk)."""

    TTL = 10
    ACTIONS = ("put", "put", "put", "leased_read", "leased_read", "time_passes", "remove",
               "evict", "segment_lost", "takeover")

    def begin(self, c: Choose):
        self.ref, self.dir = P.Directory(), DirectoryCore()
        self.lref, self.lease = L.new_table(self.TTL), LeaseCore(self.TTL, rows=self.dir.rows)
        for s in SEGMENTS[:c.int(2, 12)]:
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

    def put(self, c: Choose):
        key, n, length = c.one(KEYS), c.int(1, 3), c.int(1, 4096)
        live = [s for s, l in self.ref.segments.items() if l.live]
        if len(live) < n:
            return
        effects = self.dstep(P.PutStart(key, length, tuple(
            P.Replica(s, c.int(0, 1 << 29), length) for s in c.some(live, n, n))))
        if isinstance(effects[0], P.PutGranted) and not c.rare(4):
            self.dstep(P.PutEnd(key, effects[0].token, c.one(CHECKSUMS)))
        self.check()

    def leased_read(self, c: Choose):
        keys = list(self.ref.objects)
        if not keys:
            return
        key = c.one(keys)
        effects = self.dstep(P.ReadBegin(key))
        if isinstance(effects[0], P.ReadGranted):
            self.dstep(P.ReadEnd(key, effects[0].token))
            self.lstep(L.Grant(c.one(HOLDERS), key))
        self.check()

    def time_passes(self, c: Choose):
        self.lstep(L.Tick(self.lref.now + c.int(0, 8)))
        held = list(self.lref.leases)
        if held:
            holder = c.one(held)
            self.lstep(L.Renew(holder) if c.rare(2) else L.Release(holder))
        self.check()

    def remove(self, c: Choose):
        keys = list(self.ref.objects)
        if not keys:
            return
        key = c.one(keys)
        _, effects = L.master_step(self.lref, L.Remove(key))     # asked, not committed
        if key in self.lref.objects and isinstance(effects[0], Refused):
            assert_same(effects, self.lease.step(L.Remove(key)))
        else:
            self.dstep(P.Remove(key))
        self.check()

    def evict(self, c: Choose):
        """Past the watermark of a capacity a little above what is used."""
        if not c.rare(3):
            return
        high = c.float(0.5, 0.95)
        capacity = max(1, int(self.lref.used * c.float(1.0, 2.0)))
        plan = L.plan_eviction(self.lref.used, capacity, self.lease.eviction_candidates(),
                               high_watermark=high, free_fraction=0.05)
        for key in plan.keys:
            self.dstep(P.Remove(key))
        self.check()

    def segment_lost(self, c: Choose):
        """As the runtime master: the objects forgotten whole leave the lease
        table in one ``drop_many`` (the reference: one by one), the others'
        effects are carried out one by one."""
        live = [s for s, l in self.ref.segments.items() if l.live]
        if live and c.rare(4):
            event = P.SegmentLost(c.one(live))
            self.ref, expected = P.master_step(self.ref, event)
            loss = self.dir.lose(event)
            assert_same(expected, loss.effects(), "objects")
            for _, run in loss.runs:
                for e in run:
                    if isinstance(e, P.Removed):
                        self.lref, want = drop_reference(self.lref, self.lease, [e.key])
                        assert_same(want, self.lease.drop_many([e.key]).effects())
            self.lref, want = drop_reference(self.lref, self.lease, loss.keys.tolist())
            assert_same(want, self.lease.drop_many(loss.keys, loss.rows).effects())
            fresh = [s for s in SEGMENTS if s not in self.ref.segments]
            if fresh:
                self.dstep(P.AddSegment(fresh[0], 1 << 30))
            self.check()

    def takeover(self, c: Choose):
        """A new master rebuilds both tables in bulk from the published
        objects: from columns, or from the nodes' indexes (each replica an
        entry, listed in node order; some unpublished entries besides, left
        out as free rows), as the runtime master rebuilds; with one replica
        per object the rebuild's dict of keys becomes the row index."""
        if not c.rare(3):
            return
        quiet = c.one([0, 5, 30])
        capacities = {s: l.capacity for s, l in self.ref.segments.items() if l.live}
        indexes = c.one([None, "all", "first"])     # "first": the other replicas were lost
        objects = [(k, r.token, r.length, r.replicas if indexes is None else
                    tuple(sorted(r.replicas, key=lambda p: p.segment))[:None if indexes == "all" else 1],
                    r.checksum)
                   for k, r in self.ref.objects.items() if r.status is P.Status.PUBLISHED]
        now = self.lref.now
        self.ref = P.restored(capacities, objects, self.ref.next_token)
        if indexes:
            self.dir = recovered(capacities, self._indexes(c, objects, list(capacities)),
                                 self.dir.next_token)
        else:
            self.dir = DirectoryCore.from_columns(capacities, **columns_of(objects, list(capacities)),
                                                  next_token=self.dir.next_token)
        self.lref = L.restored_table(self.TTL, now, [
            (k, (k, r.token), r.length * len(r.replicas)) for k, r in self.ref.objects.items()],
            quiet)
        self.lease = LeaseCore.inherit(self.dir, self.TTL, now, quiet)
        self.check()

    @staticmethod
    def _indexes(c: Choose, objects: list, nodes: list) -> dict:
        """The live nodes' indexes holding ``objects``, and unpublished
        allocations of other keys."""
        index: dict = {node: {} for node in nodes}
        for key, token, length, replicas, checksum in objects:
            for r in replicas:
                index[r.segment][key] = F.IndexEntry(1, True, 1, r.offset, length, checksum, token)
        listed = {o[0] for o in objects}
        for key in c.some([k for k in KEYS if k not in listed], 0, 6) if nodes else ():
            index[c.one(nodes)][key] = F.IndexEntry(2, False, 0, 0, 8, 0, 1)
        return {node: IndexColumns.of(entries) for node, entries in index.items()}


# --------------------------------------------------------------------------
# A storage node: region table and index
# --------------------------------------------------------------------------

OFFSETS = list(range(0, 200 * 4096, 4096))
NODE = "node-0"


class StorageDiff(Differential):
    """publish.RegionTable + failover.StorageNode and their storage_steps
    against StorageNodeCore."""

    ACTIONS = ("assign", "assign", "assign", "free", "write", "write", "read", "fence",
               "allocate", "allocate", "allocate", "publish", "publish", "stamped_read",
               "index_request", "purge", "stamped_free", "restart",
               "allocate_region", "allocate_region", "publish_region", "publish_region",
               "allocate_regions", "allocate_regions", "publish_regions", "publish_regions",
               "free_regions", "free_regions")

    def begin(self, c: Choose):
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
        offset = getattr(event, "offset", None)
        if offset is not None:   # the region's fields, read without a Region
            region = self.table.regions.get(offset)
            assert self.core.owner(offset) == (None if region is None else (
                region.key, region.token, region.done))
        key = getattr(event, "key", None)
        if key is not None:
            entry = self.node.index.get(key)
            assert self.core.open_allocation(key) == (entry is not None and not entry.published)

    def region(self, c: Choose):
        """An offset, mostly one with a region, and mostly its token."""
        offset = c.mostly(list(self.table.regions), OFFSETS)
        region = self.table.regions.get(offset)
        return offset, region.token if region is not None and not c.rare(5) else c.int(1, 400)

    def key(self, c: Choose):
        return c.mostly(list(self.node.index), KEYS)

    def fold(self, events: list):
        """The reference steps ``events`` in turn, all or none: ``None`` when
        every one is accepted, else the first refusal's error (and the
        reference is left as it was)."""
        table, node = self.table, self.node
        for event in events:
            if isinstance(event, (P.AssignRegion, P.WriteReplica, P.FreeRegion)):
                table, effects = P.storage_step(table, event)
            else:
                node, effects = F.storage_step(node, event)
            if effects and isinstance(effects[0], Refused):
                return effects[0].error
        self.table, self.node = table, node
        return None

    def compound(self, events: list, got) -> None:
        """A core's steps of one request at once (``got``: its ``None`` or
        error) against the fold of the reference's single steps."""
        expected = self.fold(events)
        assert (type(got), str(got)) == (type(expected), str(expected))
        assert self.core.reference() == (self.table, self.node)

    def allocate_region(self, c: Choose):
        """An ``assign``'s region: StampedAllocate then AssignRegion, all or none."""
        seg, key, offset = self.core.segment, c.one(KEYS), c.one(OFFSETS)
        term, length, token = self.term(c), c.int(1, 4096), c.int(1, 400)
        self.compound([F.StampedAllocate(seg, key, term, offset, length, token),
                       P.AssignRegion(seg, offset, length, key, token)],
                      self.core.allocate_region(term, offset, length, key, token))

    def publish_region(self, c: Choose):
        """A ``publish``'s region: WriteReplica (a direct writer's region, by
        its owner) then StampedPublish, all or none; mostly the region's key."""
        seg, (offset, token) = self.core.segment, self.region(c)
        region = self.table.regions.get(offset)
        key = region.key if region is not None and not c.rare(5) else self.key(c)
        term, write = self.term(c), c.one([True, False])
        recorded = (c.one([0, 7, (1 << 64) - 1]), c.int(0, 3), c.one([0, 0, 1, self.term(c)]))
        self.compound([P.WriteReplica(seg, offset, token)] * write
                      + [F.StampedPublish(seg, key, term, *recorded)],
                      self.core.publish_region(term, offset, token, key, *recorded, write=write))

    def batch(self, got: bool, accepted: bool) -> None:
        """A core's batch step (``got``: True, all applied, or False, nothing
        changed) against the reference's steps, all accepted or none."""
        assert got == accepted
        assert self.core.reference() == (self.table, self.node)

    def allocate_regions(self, c: Choose):
        """An ``assign``'s regions at once: each one's StampedAllocate then
        AssignRegion, in turn, all or none; mostly keys not held and offsets
        not owned, sometimes one repeated."""
        seg, term, n = self.core.segment, self.term(c), c.int(1, 6)
        keys = [c.mostly([k for k in KEYS if k not in self.node.index], KEYS) for _ in range(n)]
        offsets = [c.mostly([o for o in OFFSETS if o not in self.table.regions], OFFSETS)
                   for _ in range(n)]
        if c.rare(4):                       # a key repeated, or an offset
            twice = c.one([True, False])
            keys.append(keys[0] if twice else c.one(KEYS))
            offsets.append(c.one(OFFSETS) if twice else offsets[0])
        lengths, tokens = [c.int(1, 4096) for _ in keys], [c.int(1, 400) for _ in keys]
        events = [event for key, offset, length, token in zip(keys, offsets, lengths, tokens)
                  for event in (F.StampedAllocate(seg, key, term, offset, length, token),
                                P.AssignRegion(seg, offset, length, key, token))]
        got = self.core.allocate_regions(term, offsets, lengths, keys, tokens)
        self.batch(got, self.fold(events) is None)

    def publish_regions(self, c: Choose):
        """A ``publish``'s regions at once: each one (its key's, owned by its
        token, written or, a direct writer's, written now) WriteReplica where
        unwritten then StampedPublish, in turn, all or none."""
        seg, term = self.core.segment, self.term(c)
        # mostly distinct regions whose key's allocation is open; sometimes any
        ready = [o for o, r in self.table.regions.items()
                 if r.key in self.node.index and not self.node.index[r.key].published]
        picks = [self.region(c) for _ in range(c.int(1, 6))] if not ready or c.rare(3) else \
            [(o, self.table.regions[o].token if not c.rare(8) else c.int(1, 400))
             for o in c.some(ready, 1, 6)]
        keys, direct, recorded = [], [], []
        for offset, _ in picks:
            region = self.table.regions.get(offset)
            keys.append(region.key if region is not None and not c.rare(8) else self.key(c))
            direct.append(c.mostly([region is not None and not region.done], [True, False]))
            recorded.append((c.one([0, 7, (1 << 64) - 1]), c.int(0, 3),
                             c.one([0, 0, 0, 1, self.term(c)])))
        got = self.core.publish_regions(term, [o for o, _ in picks], keys, [t for _, t in picks],
                                        *map(list, zip(*recorded)), direct)
        ours = all(region is not None and (region.key, region.token) == (key, token)
                   and (region.done or d) for region, key, token, d in zip(
                       (self.table.regions.get(o) for o, _ in picks), keys,
                       (t for _, t in picks), direct))
        table, node = self.table, self.node
        for (offset, token), key, d, rec in zip(picks, keys, direct, recorded) if ours else ():
            if d and not self.table.regions[offset].done:
                self.table, _ = P.storage_step(self.table, P.WriteReplica(seg, offset, token))
            self.node, effects = F.storage_step(self.node, F.StampedPublish(seg, key, term, *rec))
            if effects and isinstance(effects[0], Refused):
                self.table, self.node, ours = table, node, False
                break
        self.batch(got, ours)

    def free_regions(self, c: Choose):
        """A ``free``'s regions at once: each one's FreeRegion then StampedFree
        of its key's entry, in turn, all or none; mostly regions whose key
        holds an entry of their token, sometimes one repeated."""
        seg, term = self.core.segment, self.term(c)
        index = self.node.index
        ready = [o for o, r in self.table.regions.items()
                 if r.key in index and index[r.key].token == r.token]
        picks = [self.region(c) for _ in range(c.int(1, 6))] if not ready or c.rare(3) else \
            [(o, self.table.regions[o].token if not c.rare(8) else c.int(1, 400))
             for o in c.some(ready, 1, 6)]
        if c.rare(4):
            picks.append(picks[0])
        events = []
        for offset, token in picks:
            region = self.table.regions.get(offset)
            key = region.key if region is not None else self.key(c)
            events += [P.FreeRegion(seg, offset, token, 1), F.StampedFree(seg, key, term, token)]
        got = self.core.free_regions(term, [o for o, _ in picks], [t for _, t in picks])
        self.batch(got, self.fold(events) is None)

    def term(self, c: Choose) -> int:
        """Mostly the node's term or the next; sometimes a stale or a later one."""
        t = self.node.term
        return max(0, c.mostly([t, t, t + 1], [t - 2, t - 1, t + 2], 4))

    def assign(self, c: Choose):
        self.step(P.AssignRegion(NODE, c.one(OFFSETS), c.int(1, 4096), c.one(KEYS), c.int(1, 400)))

    def free(self, c: Choose):
        self.step(P.FreeRegion(NODE, *self.region(c), 1))

    def write(self, c: Choose):
        self.step(P.WriteReplica(NODE, *self.region(c)))

    def read(self, c: Choose):
        self.step(P.ReadReplica(NODE, *self.region(c)))

    def fence(self, c: Choose):
        self.step(F.Fence(self.term(c)))

    def allocate(self, c: Choose):
        self.step(F.StampedAllocate(NODE, c.one(KEYS), self.term(c), c.one(OFFSETS),
                                    c.int(1, 4096), c.int(0, 400)))

    def publish(self, c: Choose):
        # a repaired replica's publish carries the object's publishing term
        # (0: the command's; one above it is refused)
        self.step(F.StampedPublish(NODE, self.key(c), self.term(c), c.one([0, 7, (1 << 64) - 1]),
                                   0, c.one([0, 0, 1, self.term(c)])))

    def stamped_read(self, c: Choose):
        self.step(F.StampedRead(NODE, self.key(c), self.term(c)))

    def index_request(self, c: Choose):
        if c.rare(5):
            self.step(F.IndexRequest(self.term(c)))

    def purge(self, c: Choose):
        """The purge, and first the core's view of what it drops."""
        if c.rare(4):
            below = self.term(c)
            _, keys, _ = F.purge_unpublished(self.node.index, below)
            assert self.core.unpublished(below) == [(k, self.node.index[k]) for k in keys]
            self.step(F.PurgeUnpublished(NODE, below))

    def stamped_free(self, c: Choose):
        key = self.key(c)
        entry = self.node.index.get(key)
        token = entry.token if entry is not None and not c.rare(5) else c.int(0, 400)
        self.step(F.StampedFree(NODE, key, self.term(c), token))

    def restart(self, c: Choose):
        """The node starts over under a new segment id, keeping its term."""
        if c.rare(50):
            segment = f"node-{c.int(1, 9)}"
            self.table, self.node = P.RegionTable(segment), F.StorageNode(self.node.term)
            self.core.restart(segment)
            assert self.core.reference() == (self.table, self.node)


# --------------------------------------------------------------------------
# A storage node's regions granted to direct writers
# --------------------------------------------------------------------------

WRITERS = [f"w{i}" for i in range(6)]


class DirectDiff(Differential):
    """directwrite.DirectTable + node_step against DirectCore: grants on many
    offsets by a few writers, reports, publishes, frees of live and dead
    writers' regions (draining), drains, and stale tokens."""

    ACTIONS = ("grant", "grant", "grant", "report", "report", "publish", "publish", "free",
               "drain", "grant_many", "grant_many", "publish_many", "publish_many",
               "free_many", "free_many")

    def begin(self, c: Choose):
        self.table, self.core = D.DirectTable(), DirectCore()

    def step(self, event):
        self.table, expected = D.node_step(self.table, event)
        got = self.core.step(event)
        assert_same(expected, got)
        assert self.core.reference() == self.table
        region = self.table.regions.get(event.offset)   # read without a DirectRegion
        for token in {getattr(event, "token", 0), region.token if region else 0}:
            assert self.core.held(event.offset, token) == (
                (region.state, region.wrote) if region is not None and region.token == token
                else None)

    def region(self, c: Choose):
        """An offset, mostly one with a region, and mostly its token."""
        offset = c.mostly(list(self.table.regions), OFFSETS)
        region = self.table.regions.get(offset)
        token = region.token if region is not None and not c.rare(5) else c.int(1, 400)
        assert self.core.unreported(offset, token) == (
            region is not None and region.token == token and not region.wrote)
        return offset, token

    def grant(self, c: Choose):
        self.step(D.GrantDirect(c.one(OFFSETS), c.int(1, 400), c.one(WRITERS)))

    def report(self, c: Choose):
        self.step(D.WriteReported(*self.region(c)))

    def publish(self, c: Choose):
        self.step(D.PublishDirect(*self.region(c)))

    def free(self, c: Choose):
        self.step(D.FreeDirect(*self.region(c), c.one([True, False])))

    def drain(self, c: Choose):
        self.step(D.Drain(c.mostly(list(self.table.regions), OFFSETS), c.one([True, False])))

    def fold(self, steps: list) -> bool:
        """The reference steps each of ``steps`` (a function of the table
        giving its events) in turn, all or none: whether all were accepted."""
        table = self.table
        for events in steps:
            for event in events(table):
                table, effects = D.node_step(table, event)
                if effects and isinstance(effects[0], Refused):
                    return False
        self.table = table
        return True

    def grant_many(self, c: Choose):
        """GrantDirect of several regions at once, all or none (and first
        ``vacant``); mostly offsets without a region, sometimes one repeated."""
        offsets = [c.mostly([o for o in OFFSETS if o not in self.table.regions], OFFSETS)
                   for _ in range(c.int(1, 5))]
        if c.rare(4):
            offsets.append(offsets[0])
        tokens, writers = [c.int(1, 400) for _ in offsets], [c.one(WRITERS) for _ in offsets]
        assert self.core.vacant(offsets) == all(o not in self.table.regions for o in offsets)
        got = self.core.grant_many(offsets, tokens, writers)
        assert got == self.fold([lambda table, ev=D.GrantDirect(*g): [ev]
                                 for g in zip(offsets, tokens, writers)])
        assert self.core.reference() == self.table

    def publish_many(self, c: Choose):
        """WriteReported where the write shows and is unreported, then
        PublishDirect, of several regions at once, all or none; and first
        what ``publishable`` says of each."""
        offsets, tokens = map(list, zip(*(self.region(c) for _ in range(c.int(1, 5)))))
        shown = [c.one([True, False]) for _ in offsets]
        regions = [self.table.regions.get(o) for o in offsets]
        assert self.core.publishable(offsets, tokens, shown) == [
            None if r is None or r.token != t else r.state is D.RegionState.GRANTED
            and (r.wrote or s) for r, t, s in zip(regions, tokens, shown)]

        def steps(offset, token, seen):
            def events(table):
                region = table.regions.get(offset)
                report = seen and region is not None and region.token == token \
                    and not region.wrote
                return [D.WriteReported(offset, token)] * report + [D.PublishDirect(offset, token)]
            return events
        got = self.core.publish_many(offsets, tokens, shown)
        assert got == self.fold([steps(*r) for r in zip(offsets, tokens, shown)])
        assert self.core.reference() == self.table

    def free_many(self, c: Choose):
        """FreeDirect of several regions at once, taken only when each one is
        Freed whether or not its writer lives, all or none (and first what
        ``freeable`` says of each); mostly reported regions, sometimes one
        repeated."""
        done = [o for o, r in self.table.regions.items()
                if r.wrote and r.state is not D.RegionState.DRAINING]
        picks = [self.region(c) for _ in range(c.int(1, 5))] if not done or c.rare(3) else \
            [(o, self.table.regions[o].token) for o in c.some(done, 1, 5)]
        if c.rare(4):
            picks.append(picks[0])
        regions = [self.table.regions.get(o) for o, _ in picks]
        assert self.core.freeable([o for o, _ in picks], [t for _, t in picks]) == [
            None if r is None or r.token != t else r.state is not D.RegionState.DRAINING
            and r.wrote for r, (_, t) in zip(regions, picks)]
        table, freed = self.table, True
        for offset, token in picks:
            for alive in (True, False):
                after, effects = D.node_step(table, D.FreeDirect(offset, token, alive))
                freed = freed and bool(effects) and isinstance(effects[0], D.Freed)
            table = after
        got = self.core.free_many([o for o, _ in picks], [t for _, t in picks])
        assert got == freed
        if freed:
            self.table = table
        assert self.core.reference() == self.table


for machine in (DirectoryDiff, LeaseDiff, MasterDiff, StorageDiff, DirectDiff):
    machine.TestCase.settings = RUNS
TestDirectory = DirectoryDiff.TestCase
TestLeases = LeaseDiff.TestCase
TestMaster = MasterDiff.TestCase
TestStorage = StorageDiff.TestCase
TestDirect = DirectDiff.TestCase


def test_a_direct_core_copy_is_independent():
    core = DirectCore()
    core.step(D.GrantDirect(0, 1, "w0"))
    copy = core.copy()
    copy.step(D.WriteReported(0, 1))
    assert core.unreported(0, 1) and not copy.unreported(0, 1)
    assert core.reference() != copy.reference()


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


@pytest.mark.parametrize("step", ["allocate_region", "allocate_regions"])
def test_an_assign_that_ignores_the_fence_is_caught(monkeypatch, step):
    """A storage node whose ``assign`` (``allocate_region``, or the batch
    step ``allocate_regions``) records allocations stamped with a stale term."""
    original = getattr(StorageNodeCore, step)

    def no_fence(self, term, *args):
        fence = self.term
        self.term = min(fence, term)
        try:
            return original(self, term, *args)
        finally:
            self.term = max(fence, self.term)

    monkeypatch.setattr(StorageNodeCore, step, no_fence)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(StorageDiff, settings=HUNT)


def test_a_publish_batch_of_an_unwritten_region_is_caught(monkeypatch):
    """A storage node whose batched ``publish`` (publish_regions) publishes a
    region nobody wrote (every region taken as a direct writer's)."""
    original = StorageNodeCore.publish_regions

    def unwritten(self, *args):
        return original(self, *args[:-1], [True] * len(args[-1]))

    monkeypatch.setattr(StorageNodeCore, "publish_regions", unwritten)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(StorageDiff, settings=HUNT)


def test_a_direct_publish_batch_of_an_unreported_write_is_caught(monkeypatch):
    """A node whose batched direct publish (publish_many) takes every write
    as reported (the DirectWrite_Weak_PublishUnwritten flaw, in a batch)."""
    original = DirectCore.publish_many

    def unreported(self, offsets, tokens, shown):
        return original(self, offsets, tokens, [True] * len(shown))

    monkeypatch.setattr(DirectCore, "publish_many", unreported)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectDiff, settings=HUNT)


def test_a_publish_of_an_unreported_direct_write_is_caught(monkeypatch):
    """A node that publishes a direct writer's region before the writer
    reported its write (the DirectWrite_Weak_PublishUnwritten flaw)."""
    def publish_unwritten(self, ev):
        row = self._held(ev.offset, ev.token)
        if row is None:
            return (Refused(errors.StaleToken(f"region {ev.offset} holds no finished direct "
                                              f"write of token {ev.token}")),)
        self._st[row] = 2
        return ()

    monkeypatch.setattr(DirectCore, "_publish", publish_unwritten)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectDiff, settings=HUNT)


def test_a_free_that_never_drains_is_caught(monkeypatch):
    """A node that frees a region at once while its live writer may still
    write it (the DirectWrite_Weak_FreeAtOnce flaw)."""
    def free_at_once(self, ev):
        row = self._held(ev.offset, ev.token)
        if row is None or self._st[row] == 3:
            return (Refused(errors.StaleToken(f"region {ev.offset} is not held by token "
                                              f"{ev.token}")),)
        self._rows.release(row, 1)
        return (D.Freed(ev.offset),)

    monkeypatch.setattr(DirectCore, "_free", free_at_once)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectDiff, settings=HUNT)


def test_a_leased_read_batch_that_keeps_its_pins_is_caught(monkeypatch):
    """``read_many(keys, pin=False)`` pins the objects as ``ReadBegin`` does
    but never ends the pins (a leased read would hold its object forever)."""
    plain = DirectoryCore.read_many
    monkeypatch.setattr(DirectoryCore, "read_many", lambda self, keys, pin=True: plain(self, keys))
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectoryDiff, settings=HUNT)


def test_a_put_start_batch_that_reports_refusals_late_is_caught(monkeypatch):
    """``put_start_many`` reports the refused items after taking the whole
    batch (the master would place the next key while a refused placement is
    still held)."""
    def late(self, items, refused=None):
        items = list(items)
        out = [self._start(*item) for item in items]
        for item, token in zip(items, out):
            if refused is not None and type(token) is not int:
                refused(item)
        return out

    monkeypatch.setattr(DirectoryCore, "put_start_many", late)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectoryDiff, settings=HUNT)


def test_a_release_batch_that_skips_repeated_holders_is_caught(monkeypatch):
    """``release_many`` releases each holder once and answers a repeated
    holder as released again (the fold refuses the second ``Release``)."""
    def once(self, holders):
        done, out = {}, []
        for holder in holders:
            if holder not in done:
                done[holder] = self._end(holder)
            out.append(done[holder])
        return out

    monkeypatch.setattr(LeaseCore, "release_many", once)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeaseDiff, settings=HUNT)


def test_a_release_batch_that_leaves_the_object_leased_is_caught(monkeypatch):
    """``release_many`` ends the leases but leaves their objects counted as
    leased (``Remove`` and ``Evict`` then refuse what the spec allows)."""
    def still_counted(self, holders):
        out = []
        for holder in holders:
            lease = self._leases.pop(holder, None)
            out.append(L_core.Refusal(errors.LeaseExpired(f"{holder!r} holds no lease"))
                       if lease is None else lease[0])
        return out

    monkeypatch.setattr(LeaseCore, "release_many", still_counted)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeaseDiff, settings=HUNT)


def test_a_grant_batch_that_queues_one_expiry_is_caught(monkeypatch):
    """``grant_many`` queues the expiry of its first lease only (the batch's
    one queue entry names one holder): the others never end."""
    grant_many = LeaseCore.grant_many

    def first_only(self, items):
        queued = len(self._queue)
        out = grant_many(self, items)
        if len(self._queue) > queued:
            expires, seq, holders = self._queue.pop()
            self._queue.append((expires, seq, holders[:1]))
        return out

    monkeypatch.setattr(LeaseCore, "grant_many", first_only)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeaseDiff, settings=HUNT)


def test_a_remove_batch_that_frees_a_pinned_object_is_caught(monkeypatch):
    """``remove_many`` takes no notice of the readers' pins (spec ``Remove``
    refuses an object being read)."""
    def unpinned(self, keys):
        out = []
        for key in keys:
            row = self.rows.index.get(key)
            if row is not None:
                self._reads[row] = 0
            out.append(self._take(key))
        return out

    monkeypatch.setattr(DirectoryCore, "remove_many", unpinned)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(DirectoryDiff, settings=HUNT)
