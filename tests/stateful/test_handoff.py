"""The hand-off machines far beyond what TLC enumerates: up to eight requests
sharing a recompute budget, up to four take-over attempts each, prefills that
publish (or not, or late), TTLs passing, storage nodes losing hand-offs, sweeps
and acknowledgements reclaiming them. Every invariant of spec/Handoff.tla is
checked after every step, every refused event is checked to change nothing,
and every event is also fed to the machine directly in states where the
System would not enable it: the machine must refuse it."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto.statemachines import handoff as H

REQUESTS = [f"r{i}" for i in range(8)]


class HandoffSystem(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 8), attempts=st.integers(1, 4), budget=st.integers(0, 4))
    def start(self, n, attempts, budget):
        self.reqs = REQUESTS[:n]
        self.sys = H.System.initial(self.reqs, attempts, budget)
        self.recomputed = self.refused = self.acked = self.reclaimed = 0

    def req(self, i: int) -> str:
        return self.reqs[i % len(self.reqs)]

    def act(self, name, r, *args):
        before = self.sys
        after = H.ACTIONS[name](before, r, *args)
        if after is not None:
            self.sys = after
        return after

    # -- the prefill and the store ------------------------------------------

    @rule(i=st.integers(0, 7), cache=st.booleans())
    def publish(self, i, cache):
        r = self.req(i)
        was = self.sys.requests[r].retention.obj
        after = self.act("Publish", r, cache)
        assert (after is not None) == (was is H.Obj.NONE)
        if after is not None:
            assert after.requests[r].retention.cache is (H.Cache.PUBLISHED if cache else H.Cache.NONE)

    @rule(i=st.integers(0, 7))
    def expire(self, i):
        self.act("Expire", self.req(i))

    @rule(i=st.integers(0, 7))
    def lose(self, i):
        self.act("Lose", self.req(i))

    @rule(i=st.integers(0, 7))
    def reclaim(self, i):
        r = self.req(i)
        q = self.sys.requests[r]
        allowed = (q.retention.obj is H.Obj.STORED and q.taker.dec is not H.Dec.READING
                   and (q.taker.dec is H.Dec.ACKED or q.retention.expired))
        after = self.act("Reclaim", r)
        assert (after is not None) == allowed
        if after is not None:
            self.reclaimed += 1
            assert after.requests[r].retention.cache is q.retention.cache   # the long-term copy stays

    # -- the decode side ----------------------------------------------------

    @rule(i=st.integers(0, 7))
    def attempt(self, i):
        r = self.req(i)
        q = self.sys.requests[r]
        after = self.act("Attempt", r)
        assert (after is not None) == (q.taker.dec is H.Dec.IDLE and q.taker.attempts < q.taker.max_attempts)
        if after is not None:
            t = after.requests[r].taker
            assert t.attempts == q.taker.attempts + 1
            assert (t.dec is H.Dec.READING) == (q.retention.obj is H.Obj.STORED)

    @rule(i=st.integers(0, 7), ok=st.booleans())
    def read_ends(self, i, ok):
        r = self.req(i)
        self.act("ReadDone" if ok else "ReadFails", r)

    @rule(i=st.integers(0, 7))
    def ack(self, i):
        if self.act("Ack", self.req(i)) is not None:
            self.acked += 1

    @rule(i=st.integers(0, 7))
    def fall_back(self, i):
        r = self.req(i)
        budget = self.sys.budget
        if self.act("Recompute", r) is not None:
            self.recomputed += 1
            assert self.sys.budget == budget - 1
        elif self.act("Refuse", r) is not None:
            self.refused += 1
            assert budget == 0

    # -- the machines on their own: refusals change nothing -----------------

    @rule(i=st.integers(0, 7), ev=st.sampled_from([H.Attempt(True), H.Attempt(False), H.ReadFailed(),
                                              H.ReadDone(), H.Ack(), H.FallBack(True), H.FallBack(False)]))
    def taker_refusals_change_nothing(self, i, ev):
        t = self.sys.requests[self.req(i)].taker
        after, effects = H.take_step(t, ev)
        if effects and isinstance(effects[0], H.Refused):
            assert after is t and len(effects) == 1

    @rule(i=st.integers(0, 7), ev=st.sampled_from([H.Publish(False), H.Publish(True), H.Expire(),
                                              H.Reclaim(False), H.Reclaim(True), H.Lose()]))
    def retention_refusals_change_nothing(self, i, ev):
        s = self.sys.requests[self.req(i)].retention
        after, effects = H.retention_step(s, ev)
        if effects and isinstance(effects[0], H.Refused):
            assert after is s and len(effects) == 1
        if isinstance(ev, H.Reclaim) and not ev.acked and not s.expired:
            assert effects and isinstance(effects[0], H.Refused)

    # -- invariants ----------------------------------------------------------

    @invariant()
    def spec_invariants_hold(self):
        if hasattr(self, "sys"):
            assert H.BINDING.violated(self.sys) == []

    @invariant()
    def outcomes_are_counted(self):
        if hasattr(self, "sys"):
            decs = [q.taker.dec for q in self.sys.requests.values()]
            assert decs.count(H.Dec.RECOMPUTED) == self.recomputed <= self.sys.total
            assert decs.count(H.Dec.FAILED) == self.refused
            assert decs.count(H.Dec.ACKED) == self.acked


TestHandoffSystem = HandoffSystem.TestCase
# each request's machine has a few dozen states: a fifth of the profile's
# examples (100 in CI, 1,000 in the soak profile) covers them many times over
TestHandoffSystem.settings = settings(settings.default,
                                      max_examples=max(50, settings.default.max_examples // 5))
