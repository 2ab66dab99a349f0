"""Direct writers far beyond what TLC enumerates: a dozen writers sharing a few
slots, each granted, written, published, revoked while paused, or killed, in
any order; removes and drains throughout. Every invariant of
spec/DirectWrite.tla is checked after every step, and every refusal of the
node's table is checked to change nothing. A machine that frees a revoked
writer's slot at once is caught."""

import attrs
import immutables
from hypothesis import event, given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto.statemachines import directwrite as D

KEYS = [f"k{i}" for i in range(8)]
WRITERS = [f"w{i}" for i in range(12)]
SLOTS = [f"s{i}" for i in range(4)]
MAX_TOKEN = 10 ** 9


class DirectWriteSystem(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.sys = D.System.initial(KEYS, WRITERS, SLOTS)
        self.published = self.drained = self.paused_overwrites_held = 0

    def step(self, action, *args):
        new = action(self.sys, *args)
        if new is not None:
            self.sys = new
        return new

    @rule(w=st.sampled_from(WRITERS), k=st.sampled_from(KEYS), i=st.sampled_from(SLOTS))
    def grant(self, w, k, i):
        held = self.sys.table.regions.get(i)
        if self.step(D.sys_grant, w, k, i, MAX_TOKEN) is None:
            return
        assert held is None                       # never a slot still held or draining

    @rule(w=st.sampled_from(WRITERS))
    def write(self, w):
        a = self.sys.writers[w]
        if self.step(D.sys_write, w) is not None:
            region = self.sys.table.regions[a.slot]
            if region.state is D.RegionState.DRAINING:
                self.paused_overwrites_held += 1  # a revoked writer woke: its slot waited for it

    @rule(w=st.sampled_from(WRITERS))
    def put_end(self, w):
        a = self.sys.writers[w]
        if self.step(D.sys_put_end, w) is not None:
            assert self.sys.writers[w] is None
            e = self.sys.dir[a.key]
            self.published += e is not None and e[0] == a.token and e[2]

    @rule(w=st.sampled_from(WRITERS), k=st.sampled_from(KEYS), i=st.sampled_from(SLOTS))
    def whole_put(self, w, k, i):
        if self.step(D.sys_grant, w, k, i, MAX_TOKEN) is not None:
            self.write(w)
            self.put_end(w)

    @rule(w=st.sampled_from(WRITERS))
    def writer_dies(self, w):
        self.step(D.sys_writer_dies, w)

    @rule(k=st.sampled_from(KEYS))
    def revoke(self, k):
        self.step(D.sys_revoke, k)

    @rule(k=st.sampled_from(KEYS))
    def remove(self, k):
        self.step(D.sys_remove, k)

    @rule(i=st.sampled_from(SLOTS))
    def drain(self, i):
        if self.step(D.sys_drain, i) is not None:
            self.drained += 1

    @rule(i=st.sampled_from(SLOTS), token=st.integers(1, 30), writer=st.sampled_from(WRITERS),
          alive=st.booleans(), kind=st.sampled_from(["grant", "report", "publish", "free", "drain"]))
    def any_node_event(self, i, token, writer, alive, kind):
        """Any event the node may be sent: a refusal changes nothing."""
        ev = {"grant": D.GrantDirect(i, token, writer), "report": D.WriteReported(i, token),
              "publish": D.PublishDirect(i, token), "free": D.FreeDirect(i, token, alive),
              "drain": D.Drain(i, alive)}[kind]
        table, effects = D.node_step(self.sys.table, ev)
        if effects and isinstance(effects[0], D.Refused):
            assert table is self.sys.table and len(effects) == 1

    @invariant()
    def spec_invariants_hold(self):
        assert D.BINDING.violated(self.sys) == []

    def teardown(self):
        event(f"published {min(self.published, 3)}")
        event(f"drained {min(self.drained, 2)}")
        event(f"paused writer wrote into its draining slot {min(self.paused_overwrites_held, 1)}")


TestDirectWriteSystem = DirectWriteSystem.TestCase


def test_a_node_that_frees_a_revoked_writers_slot_at_once_is_caught():
    """The weakened model's flaw in the Python machine (FreedState <- None):
    grant to w1, revoke while w1 is paused, grant the slot to w2, w2 writes,
    w1 wakes and writes, w2 publishes: the published bytes are w1's."""
    real = D.node_step

    def free_at_once(table, ev):
        if isinstance(ev, D.FreeDirect):
            region = table.regions.get(ev.offset)
            if region is not None and region.token == ev.token:
                return D.DirectTable(table.regions.delete(ev.offset)), (D.Freed(ev.offset),)
        return real(table, ev)

    sys = D.System.initial(["k"], ["w1", "w2"], ["s"])
    D.node_step = free_at_once
    try:
        sys = D.sys_grant(sys, "w1", "k", "s", 9)
        sys = D.sys_revoke(sys, "k")
        sys = D.sys_grant(sys, "w2", "k", "s", 9)
        sys = D.sys_write(sys, "w2")
        sys = D.sys_write(sys, "w1")
        sys = D.sys_put_end(sys, "w2")
    finally:
        D.node_step = real
    assert D.BINDING.violated(sys) == ["PublishedBytesAreTheAttempts"]
    # the real machine keeps the slot draining: the second grant is refused
    sys = D.System.initial(["k"], ["w1", "w2"], ["s"])
    sys = D.sys_revoke(D.sys_grant(sys, "w1", "k", "s", 9), "k")
    assert sys.table.regions["s"].state is D.RegionState.DRAINING
    assert D.sys_grant(sys, "w2", "k", "s", 9) is None


@given(wrote=st.booleans(), alive=st.booleans(), published=st.booleans())
def test_free_drains_exactly_when_the_writer_may_still_write(wrote, alive, published):
    table = D.DirectTable(immutables.Map({0: D.DirectRegion(
        7, "w", D.RegionState.PUBLISHED if published else D.RegionState.GRANTED, wrote or published)}))
    new, effects = D.node_step(table, D.FreeDirect(0, 7, alive))
    may_write = alive and not wrote and not published
    assert effects == ((D.Draining(0),) if may_write else (D.Freed(0),))
    if may_write:
        # it drains once the writer reports or is gone, not before
        assert isinstance(D.node_step(new, D.Drain(0, True))[1][0], D.Refused)
        reported, _ = D.node_step(new, D.WriteReported(0, 7))
        assert D.node_step(reported, D.Drain(0, True))[1] == (D.Drained(0),)
        assert D.node_step(new, D.Drain(0, False))[1] == (D.Drained(0),)
    else:
        assert 0 not in new.regions
