"""The publish protocol far beyond what TLC enumerates: dozens of keys, writers
that crash or stall at any point, timeouts that fire on slow writers, objects of
different sizes, and segments lost with their bytes. Every invariant of
spec/Publish.tla is checked after every step, and every refusal is checked to
change nothing."""

from collections import deque

import attrs
import pytest
from hypothesis import HealthCheck, Phase, event, seed, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvproto import errors
from kvproto.statemachines import publish as P

KEYS = [f"key-{i}".encode() for i in range(24)]
WRITERS = [f"w{i}" for i in range(6)]
SEGMENTS = [f"s{i}" for i in range(5)]
CAPACITY = 64


def free_offset(sys: P.System, segment: str, length: int):
    """First fit over the directory's extents: what an allocator could choose."""
    spans = sorted((offset, offset + rec.length)
                   for rec in sys.directory.objects.values()
                   for seg, offset in P._held(rec) if seg == segment)
    cursor = 0
    for start, end in spans:
        if start - cursor >= length:
            return cursor
        cursor = max(cursor, end)
    return cursor if CAPACITY - cursor >= length else None


class PublishSystem(RuleBasedStateMachine):
    @initialize(replicas=st.integers(1, 3))
    def start(self, replicas):
        self.replicas = replicas
        self.sys = P.System.initial({s: CAPACITY for s in SEGMENTS}, WRITERS)
        self.published = 0
        self.repairs = self.listed = 0
        self.steps = 0
        self.most_objects = 0

    def busy(self):
        return sorted(w for w, a in self.sys.writers.items() if a is not None)   # not hash order

    @rule(w=st.sampled_from(WRITERS), key=st.sampled_from(KEYS),
          length=st.integers(1, 12), data=st.data())
    def put_start(self, w, key, length, data):
        live = [s for s in SEGMENTS if self.sys.directory.segments[s].live]
        if self.sys.writers[w] is not None or len(live) < self.replicas:
            return
        segs = data.draw(st.lists(st.sampled_from(live), min_size=self.replicas,
                                  max_size=self.replicas, unique=True))
        placement = []
        for s in segs:
            offset = free_offset(self.sys, s, length)
            if offset is None:
                return
            placement.append(P.Replica(s, offset, length))
        new = P.sys_put_start(self.sys, w, key, tuple(placement))
        if new is None:
            assert key in self.sys.directory.objects
        else:
            assert new.directory.objects[key].status is P.Status.PENDING
            self.sys = new

    @rule(w=st.sampled_from(WRITERS), key=st.sampled_from(KEYS),
          length=st.integers(1, 12), data=st.data())
    def whole_put(self, w, key, length, data):
        """A writer that keeps going: PutStart, every WriteReplica, PutEnd."""
        if self.sys.writers[w] is not None:
            return
        self.put_start(w, key, length, data)
        attempt = self.sys.writers[w]
        if attempt is None:
            return
        for r in attempt.replicas:
            self.sys = P.sys_write_replica(self.sys, w, r.segment)
        self.sys = P.sys_put_end(self.sys, w)
        assert self.sys.directory.objects[key].status is P.Status.PUBLISHED
        self.published += 1

    @precondition(lambda self: self.busy())
    @rule(data=st.data())
    def write_replica(self, data):
        w = data.draw(st.sampled_from(self.busy()))
        attempt = self.sys.writers[w]
        segment = data.draw(st.sampled_from([r.segment for r in attempt.replicas]))
        new = P.sys_write_replica(self.sys, w, segment)
        if new is not None:
            self.sys = new

    @precondition(lambda self: self.busy())
    @rule(data=st.data())
    def put_end(self, data):
        w = data.draw(st.sampled_from(self.busy()))
        attempt = self.sys.writers[w]
        new = P.sys_put_end(self.sys, w)
        if new is None:
            assert not P.writer_may_put_end(attempt)
            return
        record = new.directory.objects.get(attempt.key)
        if record is not None and record.token == attempt.token:
            assert record.status is P.Status.PUBLISHED
            self.published += 1
        self.sys = new

    @precondition(lambda self: self.busy())
    @rule(data=st.data(), crash=st.booleans())
    def writer_gives_up(self, data, crash):
        w = data.draw(st.sampled_from(self.busy()))
        action = P.sys_writer_crash if crash else P.sys_put_revoke
        self.sys = action(self.sys, w)
        assert self.sys.writers[w] is None

    @rule(key=st.sampled_from(KEYS))
    def reclaim_abandoned(self, key):
        new = P.sys_reclaim_abandoned(self.sys, key)
        if new is not None:
            assert key not in new.directory.objects
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def read_begin(self, key):
        new = P.sys_read_begin(self.sys, key)
        record = self.sys.directory.objects.get(key)
        readable = record is not None and record.status is P.Status.PUBLISHED
        assert (new is not None) == readable
        if new is not None:
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def read_end(self, key):
        new = P.sys_read_end(self.sys, key)
        if new is not None:
            self.sys = new

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        new = P.sys_remove(self.sys, key)
        if new is not None:
            assert key not in new.directory.objects
            self.sys = new

    @precondition(lambda self: sum(l.live for l in self.sys.directory.segments.values()) > 3)
    @rule(segment=st.sampled_from(SEGMENTS))
    def segment_lost(self, segment):
        new = P.sys_segment_lost(self.sys, segment)
        if new is not None:
            assert not new.directory.segments[segment].live
            self.sys = new

    @rule(key=st.sampled_from(KEYS), token=st.integers(0, 50))
    def stale_events_change_nothing(self, key, token):
        """Refused master events return the same directory and one Refused effect."""
        d = self.sys.directory
        record = d.objects.get(key)
        if record is not None and record.token == token:
            return
        for event in (P.PutEnd(key, token), P.PutRevoke(key, token),
                      P.ReclaimAbandoned(key, token), P.ReadEnd(key, token)):
            new, effects = P.master_step(d, event)
            assert new is d
            assert len(effects) == 1 and isinstance(effects[0], P.Refused)
            assert isinstance(effects[0].error, errors.StaleToken)

    @invariant()
    def spec_invariants_hold(self):
        assert P.BINDING.violated(self.sys) == []
        self.steps += 1
        self.most_objects = max(self.most_objects, len(self.sys.directory.objects))

    def teardown(self):
        # Shown by --hypothesis-show-statistics: how far the runs got.
        event(f"steps >= {self.steps // 25 * 25}")
        event(f"objects at once >= {self.most_objects // 5 * 5}")
        event(f"publishes >= {self.published // 5 * 5}")
        event(f"repairs started >= {min(self.repairs, 3)}, listed >= {min(self.listed, 3)}")


TestPublishSystem = PublishSystem.TestCase


class PublishWithRepairs(PublishSystem):
    """The same system with the master repairing objects below their requested
    count (RepairStart, the copier's CopyReplica, ListReplica on its report,
    RepairCancel) and late copier reports."""

    def _below(self):
        return sorted(k for k, rec in self.sys.directory.objects.items()
                      if rec.status is P.Status.PUBLISHED and rec.below())

    @rule(key=st.sampled_from(KEYS), data=st.data())
    def repair_start(self, key, data):
        """RepairStart on a live segment holding none of the object: accepted
        exactly for a published object below its count (mostly drawn from those)."""
        below = self._below()
        if below and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(below))
        record = self.sys.directory.objects.get(key)
        if record is None:
            return
        held = {seg for seg, _ in P._held(record)}
        live = [s for s in SEGMENTS if self.sys.directory.segments[s].live and s not in held]
        if not live:
            return
        segment = data.draw(st.sampled_from(live))
        offset = free_offset(self.sys, segment, record.length)
        if offset is None:
            return
        new = P.sys_repair_start(self.sys, key, segment, offset)
        assert (new is not None) == (record.status is P.Status.PUBLISHED and record.below())
        if new is not None:
            self.sys = new
            self.repairs += 1

    @precondition(lambda self: self._below())
    @rule(data=st.data())
    def repair_all_below(self, data):
        """The master's planner: a repair for every object below its count."""
        for key in self._below():
            self.repair_start(key, data)

    @precondition(lambda self: sum(l.live for l in self.sys.directory.segments.values()) > 3)
    @rule(data=st.data())
    def lose_a_replica_and_repair(self, data):
        """A segment holding a replica of an object that has another is lost,
        and the master repairs what is below its count."""
        several = sorted({r.segment for rec in self.sys.directory.objects.values()
                          if rec.status is P.Status.PUBLISHED and len(rec.replicas) > 1
                          for r in rec.replicas})
        if several:
            self.segment_lost(data.draw(st.sampled_from(several)))
            self.repair_all_below(data)

    def _repairing(self):
        return sorted((key, p.segment) for key, rec in self.sys.directory.objects.items()
                      for p in rec.repairs)

    @precondition(lambda self: self._repairing())
    @rule(data=st.data(), how=st.sampled_from(["copy", "list", "cancel", "copy and list"]))
    def repair_step(self, data, how):
        """The copier copies, the master lists on its report, or cancels."""
        key, segment = data.draw(st.sampled_from(self._repairing()))
        if "copy" in how:
            new = P.sys_copy_replica(self.sys, key, segment)
            self.sys = new if new is not None else self.sys
        if "list" in how:
            new = P.sys_list_replica(self.sys, key, segment)
            if new is not None:
                self.listed += 1
                self.sys = new
            else:
                p = next(p for p in self.sys.directory.objects[key].repairs if p.segment == segment)
                assert not P.repair_copied(self.sys, key, segment, p.offset)
        if how == "cancel":
            self.sys = P.sys_repair_cancel(self.sys, key, segment)

    @rule(key=st.sampled_from(KEYS), repair=st.integers(0, 50), data=st.data())
    def stale_repair_reports_change_nothing(self, key, repair, data):
        """A report or cancel naming no repair in flight (a late one) is refused."""
        d = self.sys.directory
        record = d.objects.get(key)
        segment = data.draw(st.sampled_from(SEGMENTS))
        if record is not None and any(p.segment == segment and p.id == repair
                                      for p in record.repairs):
            return
        for event in (P.ListReplica(key, segment, repair), P.RepairCancel(key, segment, repair)):
            new, effects = P.master_step(d, event)
            assert new is d
            assert len(effects) == 1 and isinstance(effects[0].error, errors.StaleToken)



TestPublishWithRepairs = PublishWithRepairs.TestCase


# --------------------------------------------------------------------------
# The Python machine, model-checked: each check is what keeps it safe
# --------------------------------------------------------------------------

SMALL = P.Constants(keys=("k1",), writers=("w1", "w2"), segments=("s1", "s2"),
                    slots_per_segment=1, replica_count=2, max_token=3,
                    max_reads=1)          # spec/Publish_Small.cfg


def _violations(c: P.Constants = SMALL) -> set[str]:
    """Breadth-first over the Python machine: every invariant some reachable state breaks."""
    start = c.initial()
    seen, queue, broken = {start}, deque([start]), set()
    while queue:
        state = queue.popleft()
        broken.update(P.BINDING.violated(state))
        for _, nxt in P.successors(state, c):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return broken


def _accepts_any_write(storage_step):
    """The storage node of Publish_Weak_NoStorageTokenCheck: a write into any
    allocated region is accepted, whatever its token. The spec's node has no
    write-once rule either; with that rule alone a stale write would only make
    the owner's own write fail, so the twin drops both checks."""
    def step(table, event):
        region = table.regions.get(event.offset)
        if isinstance(event, P.WriteReplica) and region is not None:
            done = attrs.evolve(region, done=True)
            return (attrs.evolve(table, regions=table.regions.set(event.offset, done)),
                    (P.Accepted(table.segment, event.offset, event.token),))
        return storage_step(table, event)
    return step


def test_python_machine_keeps_every_invariant_in_every_reachable_state():
    assert _violations() == set()


def test_storage_without_the_token_check_breaks_published_bytes(monkeypatch):
    """Publish_Weak_NoStorageTokenCheck, in Python."""
    monkeypatch.setattr(P, "storage_step", _accepts_any_write(P.storage_step))
    assert "PublishedBytesAreTheAttempts" in _violations()


def test_the_stateful_test_catches_storage_without_the_token_check(monkeypatch):
    """The same twin, found by the Hypothesis state machine above: a writer
    whose allocation was reclaimed writes into the next attempt's region."""
    monkeypatch.setattr(P, "storage_step", _accepts_any_write(P.storage_step))

    # random seeds need from a handful to about 1,000 examples to find it; this
    # one finds it within a hundred (another Hypothesis version or a change to
    # the rules may need more: up to 3,000 are allowed)
    @seed(4)
    class Seeded(PublishSystem):
        pass
    found = settings(max_examples=3000, stateful_step_count=100, database=None,
                     phases=[Phase.generate], deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
    with pytest.raises(AssertionError, match="PublishedBytesAreTheAttempts"):
        run_state_machine_as_test(Seeded, settings=found)


def test_remove_that_ignores_pins_breaks_only_published_readable(monkeypatch):
    """A Remove that frees an object under a reader (the spec's Remove without
    ``dir[k].reads = 0``) leaves that reader holding descriptors of no object."""
    def remove(state, ev):
        record = state.objects.get(ev.key)
        if record is None or record.status is not P.Status.PUBLISHED:
            return P.remove(state, ev)
        return P._drop(state, ev.key, record), (P.Removed(ev.key, record.token),) \
            + P._free_effects(ev.key, record)

    monkeypatch.setitem(P._MASTER_HANDLERS, P.Remove, remove)
    assert "OnlyPublishedReadable" in _violations()


def test_put_end_acknowledged_but_not_published_breaks_one_attempt(monkeypatch):
    """A master that answers PutEnd without publishing: the writer is told its
    put is published, the key stays pending and is reclaimed later."""
    def put_end(state, ev):
        if P._pending_with(state, ev.key, ev.token) is None:
            return P.put_end(state, ev)
        return state, (P.Published(ev.key, ev.token),)

    monkeypatch.setitem(P._MASTER_HANDLERS, P.PutEnd, put_end)
    assert "OneAttemptPublishes" in _violations()
