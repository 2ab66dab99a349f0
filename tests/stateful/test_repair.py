"""Replica repair far beyond what TLC enumerates: a dozen objects asking for
one to three replicas over eight segments, segments lost one after another,
repairs started by hand or as the master plans them (within the rate limit),
copied chunk by chunk, listed, raced by reads and removes. Every invariant of
spec/Repair.tla is checked after every step, and every refused event is
checked to change nothing. A master that lists a repaired replica before its
copy is complete, or keeps copying from a lost segment, is caught."""

import attrs
import immutables
import pytest
from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto.statemachines import repair as R

KEYS = [f"k{i}" for i in range(12)]
SEGMENTS = [f"s{i}" for i in range(8)]
CHUNKS = 3


class RepairSystem(RuleBasedStateMachine):
    @initialize(max_repairs=st.integers(1, 3),
                placement=st.lists(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3, unique=True),
                                   min_size=len(KEYS), max_size=len(KEYS)),
                lost=st.lists(st.sampled_from(SEGMENTS), max_size=2, unique=True))
    def start(self, max_repairs, placement, lost):
        self.sys = R.System.initial(dict(zip(KEYS, placement)), {k: len(p) for k, p in zip(KEYS, placement)},
                                    SEGMENTS, CHUNKS, max_repairs)
        self.listed = self.cancelled = 0
        for s in lost:
            self.sys = R.sys_segment_lost(self.sys, s)

    def step(self, action, *args):
        new = action(self.sys, *args)
        if new is not None:
            self.sys = new
        return new

    @rule(k=st.sampled_from(KEYS), src=st.sampled_from(SEGMENTS), dst=st.sampled_from(SEGMENTS))
    def repair_start(self, k, src, dst):
        self.step(R.sys_repair_start, k, src, dst)

    @rule()
    def start_planned_repairs(self):
        """The master's plan fills the rate limit, and every planned repair is accepted."""
        plan = R.plan_repairs(self.sys.master)
        for start in plan:
            assert self.step(R.sys_repair_start, start.key, start.src, start.dst) is not None
        below = [k for k in self.sys.master.objects if self.sys.master.below(k)]
        if below and len(self.sys.master.repairs) < self.sys.master.max_repairs:
            # what is left below its count has no live segment to take a new replica
            t = self.sys.master
            assert all(all(t.holds(k, s) for s in t.live) for k in below)

    @rule(data=st.data())
    def copy_chunk(self, data):
        if self.sys.copied:
            k, dst = data.draw(st.sampled_from(sorted(self.sys.copied)))
            self.step(R.sys_copy_chunk, k, dst)

    @rule(data=st.data())
    def copy_and_list(self, data):
        if not self.sys.copied:
            self.start_planned_repairs()
        if self.sys.copied:
            k, dst = data.draw(st.sampled_from(sorted(self.sys.copied)))
            while self.sys.copied.get((k, dst), CHUNKS) < CHUNKS:
                self.step(R.sys_copy_chunk, k, dst)
            assert self.step(R.sys_list_replica, k, dst) is not None
            assert dst in self.sys.master.objects[k].listed
            self.listed += 1

    @rule(k=st.sampled_from(KEYS), dst=st.sampled_from(SEGMENTS))
    def list_replica(self, k, dst):
        complete = self.sys.copied.get((k, dst)) == CHUNKS
        assert (self.step(R.sys_list_replica, k, dst) is not None) == complete

    @rule(s=st.sampled_from(SEGMENTS))
    def segment_lost(self, s):
        before = len(self.sys.master.repairs)
        if self.step(R.sys_segment_lost, s) is not None:
            self.cancelled += before - len(self.sys.master.repairs)

    @rule(k=st.sampled_from(KEYS), s=st.sampled_from(SEGMENTS))
    def read_begin(self, k, s):
        self.step(R.sys_read_begin, k, s)

    @rule(k=st.sampled_from(KEYS), s=st.sampled_from(SEGMENTS))
    def read_end(self, k, s):
        self.step(R.sys_read_end, k, s)

    @rule(k=st.sampled_from(KEYS))
    def remove(self, k):
        self.step(R.sys_remove, k)

    @rule(k=st.sampled_from(KEYS), a=st.sampled_from(SEGMENTS), b=st.sampled_from(SEGMENTS),
          kind=st.sampled_from(["start", "copied", "lose", "begin", "end", "remove"]))
    def any_event(self, k, a, b, kind):
        """Any event the master may be sent: a refusal changes nothing."""
        ev = {"start": R.StartRepair(k, a, b), "copied": R.RepairCopied(k, b), "lose": R.LoseSegment(a),
              "begin": R.BeginRead(k, a), "end": R.EndRead(k, a), "remove": R.RemoveObject(k)}[kind]
        table, effects = R.step(self.sys.master, ev)
        if effects and isinstance(effects[0], R.Refused):
            assert table is self.sys.master and len(effects) == 1

    @invariant()
    def spec_invariants_hold(self):
        assert R.BINDING.violated(self.sys) == []

    def teardown(self):
        if hasattr(self, "sys"):
            event(f"replicas listed by repair {min(self.listed, 3)}")
            event(f"repairs cancelled by a segment loss {min(self.cancelled, 2)}")


TestRepairSystem = RepairSystem.TestCase


def one_object_losing_a_replica():
    """k on s1 and s2 (asked for 2), s2 lost, a repair from s1 into s3 started."""
    sys = R.System.initial({"k": frozenset({"s1", "s2"})}, {"k": 2}, ["s1", "s2", "s3"], 2, 1)
    sys = R.sys_segment_lost(sys, "s2")
    return R.sys_repair_start(sys, "k", "s1", "s3")


def test_a_master_that_lists_before_the_copy_is_caught(monkeypatch):
    """Repair_Weak_ListBeforeCopy in Python: the replica is listed at StartRepair."""
    real = R._HANDLERS[R.StartRepair]

    def list_at_once(table, ev):
        new, effects = real(table, ev)
        if R._accepted(effects):
            obj = new.objects[ev.key]
            new = attrs.evolve(new, objects=new.objects.set(ev.key, attrs.evolve(obj, listed=obj.listed | {ev.dst})))
        return new, effects

    monkeypatch.setitem(R._HANDLERS, R.StartRepair, list_at_once)
    sys = one_object_losing_a_replica()
    assert "ListedReplicasAreComplete" in R.BINDING.violated(sys)
    monkeypatch.undo()
    # the real master lists it only once the copy is complete
    sys = one_object_losing_a_replica()
    assert sys.master.objects["k"].listed == {"s1"} and R.sys_list_replica(sys, "k", "s3") is None
    sys = R.sys_copy_chunk(R.sys_copy_chunk(sys, "k", "s3"), "k", "s3")
    sys = R.sys_list_replica(sys, "k", "s3")
    assert sys.master.objects["k"].listed == {"s1", "s3"} and R.BINDING.violated(sys) == []


def test_a_master_that_keeps_copying_from_a_lost_segment_is_caught(monkeypatch):
    """Repair_Weak_SourceOnLostSegment in Python: a lost source's repairs go on;
    the copier gets nothing from it, and the finished replica is listed empty."""
    def keep_repairs(table, ev):
        objects = immutables.Map({k: attrs.evolve(o, listed=o.listed - {ev.segment})
                                  for k, o in table.objects.items()})
        return attrs.evolve(table, live=table.live - {ev.segment}, objects=objects), ()

    sys = one_object_losing_a_replica()
    monkeypatch.setitem(R._HANDLERS, R.LoseSegment, keep_repairs)
    sys = R.sys_segment_lost(sys, "s1")
    sys = R.sys_copy_chunk(R.sys_copy_chunk(sys, "k", "s3"), "k", "s3")
    sys = R.sys_list_replica(sys, "k", "s3")
    assert sys.master.objects["k"].listed == {"s3"}
    assert "ListedReplicasAreComplete" in R.BINDING.violated(sys)
    monkeypatch.undo()
    # the real master cancels the repair and frees its region: the object is lost
    sys = R.sys_segment_lost(one_object_losing_a_replica(), "s1")
    assert len(sys.master.repairs) == 0 and "k" not in sys.master.objects
    assert sys.region["s3"] == frozenset() and R.BINDING.violated(sys) == []


@pytest.mark.parametrize("max_repairs, rounds", [(1, 3), (2, 2), (5, 1)])
def test_the_plan_keeps_to_the_rate_limit(max_repairs, rounds):
    """Three objects lose a replica with one segment; the plan starts at most
    max_repairs copies at a time, the rest once those are listed."""
    segments = ["s1", "s2", "s3", "s4"]
    placement = {"a": frozenset({"s1", "s2"}), "b": frozenset({"s1", "s3"}), "c": frozenset({"s1", "s4"})}
    sys = R.System.initial(placement, {k: 2 for k in placement}, segments, 1, max_repairs)
    sys = R.sys_segment_lost(sys, "s1")
    planned = []
    while plan := R.plan_repairs(sys.master):
        planned.append(len(plan))
        for start in plan:
            sys = R.sys_repair_start(sys, start.key, start.src, start.dst)
        assert R.plan_repairs(sys.master) == []          # the limit is reached, or nothing is left
        for k, dst in list(sys.copied):
            sys = R.sys_list_replica(R.sys_copy_chunk(sys, k, dst), k, dst)
    assert len(planned) == rounds and max(planned) == min(max_repairs, 3) and sum(planned) == 3
    assert all(len(o.listed) == 2 for o in sys.master.objects.values()) and R.BINDING.violated(sys) == []
