"""Timeouts, quarantine and drain far beyond what TLC enumerates: a pool of a
dozen buffers shared by requests that come and go, transfers that complete
long after they timed out, completion callbacks and cancel acks delivered again
and again (after their buffer was reused), cancels that go unanswered or reach
a storage node that already forgot the transfer, and requests cancelled with
loads in flight. Every invariant of spec/Timeout.tla is
checked after every step; every refused event is checked to change nothing,
and every stale callback to change nothing but the counter that observes it."""

from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvproto import errors
from kvproto.statemachines import timeout as T

BUFFERS = [f"b{i}" for i in range(12)]
MAX_LIVE_REQUESTS = 6
CALLBACKS = (T.Complete, T.CancelAck)


class TimeoutSystem(RuleBasedStateMachine):
    @initialize(max_cancels=st.integers(0, 3), max_leaked=st.integers(0, 3))
    def start(self, max_cancels, max_leaked):
        self.sys = T.System.initial(BUFFERS, ["r0", "r1"],
                                    max_cancels=max_cancels, max_leaked=max_leaked)
        self.next_request = 2
        self.late = 0
        self.drains = 0
        self.steps = 0

    # -- helpers -----------------------------------------------------------

    def step(self, ev):
        """Step the pool inside the system; check that a refusal changed nothing."""
        before = self.sys
        after, effects = before._pool(ev)
        refused = bool(effects) and isinstance(effects[0], T.Refused)
        if refused:
            assert len(effects) == 1
            assert after == before
            if isinstance(ev, CALLBACKS):
                assert isinstance(effects[0].error, errors.StaleGeneration)
                assert after.pool.stats.stale_dropped == before.pool.stats.stale_dropped + 1
            else:
                assert after.pool is before.pool, "a refused event built a new state"
        self.sys = after
        return effects, refused

    def live(self):
        return sorted(self.sys.pool.requests)

    def active(self):
        return [r for r, q in self.sys.pool.requests.items() if q.state is T.ReqState.ACTIVE]

    def free(self):
        return sorted(b for b, buf in self.sys.pool.buffers.items() if buf.state is T.BufState.FREE)

    def tracked(self, *states):
        return sorted(g for g, t in self.sys.pool.transfers.items() if t.state in states)

    def running(self):
        return sorted(g for g, _ in self.sys.moving)

    def pick(self, data, items):
        return data.draw(st.sampled_from(items))

    def buffer_for(self, data, r):
        """Mostly one of ``r``'s own buffers (so the event can apply), sometimes any."""
        own = sorted(b for b, buf in self.sys.pool.buffers.items() if buf.owner == r)
        if own and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(own))
        return data.draw(st.sampled_from(BUFFERS))

    # -- requests and buffers ----------------------------------------------

    @precondition(lambda self: len(self.sys.pool.requests) < MAX_LIVE_REQUESTS)
    @rule()
    def start_request(self):
        self.step(T.StartRequest(f"r{self.next_request}"))
        self.next_request += 1

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data(), b=st.sampled_from(BUFFERS))
    def acquire(self, data, b):
        r = self.pick(data, self.live())
        buf = self.sys.pool.buffers[b]
        active = r in self.active()
        effects, refused = self.step(T.Acquire(r, b))
        if active and buf.state in (T.BufState.QUARANTINED, T.BufState.LEAKED):
            assert refused and isinstance(effects[0].error, errors.BufferQuarantined)
        if not refused:
            assert buf.state is T.BufState.FREE

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data())
    def release(self, data):
        r = self.pick(data, self.live())
        b = self.buffer_for(data, r)
        buf = self.sys.pool.buffers[b]
        reading = [g for g, t in self.sys.pool.transfers.items()
                   if t.state is T.XferState.INFLIGHT and b in t.sources]
        _, refused = self.step(T.Release(r, b))
        if not refused:
            assert not reading, "released the source of an awaited copy"
            assert buf.owner == r and buf.state in (T.BufState.HELD, T.BufState.READY, T.BufState.USED)
            assert self.sys.pool.buffers[b] == T.FREE_BUFFER

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data())
    def issue(self, data):
        r = self.pick(data, self.live())
        b = self.buffer_for(data, r)
        effects, refused = self.step(T.Issue(r, b))
        if not refused:
            (issued,) = effects
            assert self.sys.pool.buffers[b] == T.Buffer(r, issued.gen, T.BufState.LOADING)
            assert self.sys.node.transfers[issued.gen].buffer == b

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data())
    def issue_sourced(self, data):
        """A copy that reads other buffers (a save of blocks into a staging
        buffer); then a source's release or reuse is refused while the copy is
        awaited, and allowed once it timed out."""
        r = self.pick(data, self.live())
        b = self.buffer_for(data, r)
        sources = frozenset(self.buffer_for(data, r) for _ in range(data.draw(st.integers(1, 3))))
        effects, refused = self.step(T.Issue(r, b, sources))
        if refused:
            return
        (issued,) = effects
        assert b not in sources
        for c in sources:
            src = self.sys.pool.buffers[c]
            assert src.owner == r and src.state in (T.BufState.HELD, T.BufState.READY,
                                                    T.BufState.USED)
        assert self.sys.pool.transfers[issued.gen].sources == sources
        c = data.draw(st.sampled_from(sorted(sources)))
        held = self.sys.pool.buffers[c].state is T.BufState.HELD
        for ev in (T.Release(r, c), T.Issue(r, c)):
            effects, refused = self.step(ev)
            assert refused, ev
            if held or isinstance(ev, T.Release):
                assert isinstance(effects[0].error, errors.TransferInFlight), effects
        event("sourced copy: source release refused while awaited")

    @precondition(lambda self: self.active() and self.free())
    @rule()
    def a_load(self):
        """A request takes a free buffer and loads into it. (Hypothesis tries
        rules with fewer arguments, then by name, first: so the simplest runs
        load, rather than only start requests.)"""
        active, free = self.active(), self.free()
        r, b = active[self.steps % len(active)], free[0]
        self.step(T.Acquire(r, b))
        _, refused = self.step(T.Issue(r, b))
        assert not refused

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data())
    def consume(self, data):
        r = self.pick(data, self.live())
        b = self.buffer_for(data, r)
        buf = self.sys.pool.buffers[b]
        active = r in self.active()
        effects, refused = self.step(T.Consume(r, b))
        if not refused:
            assert buf.state is T.BufState.READY and effects == (T.Consumed(r, b, buf.gen),)
            assert self.sys.data[b] == buf.gen and buf.gen not in self.sys.timed_out
        elif active and buf.state in (T.BufState.QUARANTINED, T.BufState.LEAKED):
            assert isinstance(effects[0].error, errors.BufferQuarantined)

    @precondition(lambda self: self.sys.pool.requests)
    @rule(data=st.data(), finish=st.booleans(), now=st.integers(0, 2))
    def request_ends(self, data, finish, now):
        r = self.pick(data, self.live())
        if now != 2:  # requests live a while: end one only now and then
            return
        req = self.sys.pool.requests[r]
        ev = T.RequestFinish(r) if finish else T.RequestCancel(r)
        effects, refused = self.step(ev)
        if refused:
            return
        assert req.state is T.ReqState.ACTIVE
        after = self.sys.pool.requests.get(r)
        if after is None:
            assert isinstance(effects[-1], T.RequestEnded)
        else:
            assert after.state is T.ReqState.DRAINING and after.pending
            assert all(self.sys.pool.buffers[b].state is T.BufState.QUARANTINED for b in after.buffers)

    # -- transfers: the client's side ---------------------------------------

    @precondition(lambda self: self.tracked(T.XferState.INFLIGHT))
    @rule(data=st.data())
    def timeout(self, data):
        g = self.pick(data, self.tracked(T.XferState.INFLIGHT))
        b = self.sys.pool.transfers[g].buffer
        effects, refused = self.step(T.Timeout(g))
        assert not refused and isinstance(effects[0].error, errors.TransferTimeout)
        assert self.sys.pool.buffers[b].state is T.BufState.QUARANTINED

    @precondition(lambda self: self.tracked(T.XferState.TIMEDOUT, T.XferState.LEAKED))
    @rule(data=st.data())
    def cancel(self, data):
        g = self.pick(data, self.tracked(T.XferState.TIMEDOUT, T.XferState.LEAKED))
        t = self.sys.pool.transfers[g]
        effects, refused = self.step(T.Cancel(g))
        if refused:
            assert t.state is T.XferState.LEAKED or t.cancels >= self.sys.pool.max_cancels
            assert isinstance(effects[0].error, errors.CleanupFailed)

    @precondition(lambda self: self.tracked(T.XferState.TIMEDOUT))
    @rule(data=st.data())
    def give_up(self, data):
        g = self.pick(data, self.tracked(T.XferState.TIMEDOUT))
        pool = self.sys.pool
        effects, refused = self.step(T.GiveUp(g))
        if not refused:
            assert pool.transfers[g].cancels == pool.max_cancels and pool.leaked < pool.max_leaked
            assert isinstance(effects[0], T.WrittenOff)
        elif pool.transfers[g].cancels == pool.max_cancels:
            assert isinstance(effects[0].error, errors.LeakBudgetExhausted)

    @precondition(lambda self: self.sys.callbacks)
    @rule(data=st.data())
    def complete(self, data):
        """Deliver any completion callback ever sent: the first, a duplicate,
        or one whose buffer has since been drained and reused."""
        self.complete_one(*self.pick(data, sorted(self.sys.callbacks)))

    def complete_one(self, g, b):
        t = self.sys.pool.transfers.get(g)
        new = T.sys_complete(self.sys, g, b)
        if t is None:
            assert new == self.sys and new.pool.stats.stale_dropped == self.sys.pool.stats.stale_dropped + 1
        elif t.state is T.XferState.INFLIGHT:
            assert new.pool.buffers[t.buffer].state is T.BufState.READY
        else:
            assert new.pool.buffers[t.buffer] == T.FREE_BUFFER, "late bytes were handed out"
            self.late += 1
        self.sys = new

    # -- transfers: the storage node's side ---------------------------------

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def land(self, data):
        g = self.pick(data, self.running())
        self.sys = T.sys_land(self.sys, g)
        assert g not in self.sys.node.transfers, "a landed transfer is forgotten"

    @precondition(lambda self: self.sys.cancels)
    @rule(data=st.data())
    def storage_cancel(self, data):
        g = self.pick(data, sorted(self.sys.cancels))
        known = g in self.sys.node.transfers
        before = self.sys
        self.sys = T.sys_storage_cancel(self.sys, g)
        assert g not in self.sys.node.transfers and g in self.sys.acks
        if not known:   # landed or stopped, and forgotten: acked without effect
            assert self.sys.node == before.node and self.sys.moving == before.moving
        assert not any(m[0] == g for m in self.sys.moving), "acked while it may still write"

    @precondition(lambda self: self.sys.acks)
    @rule(data=st.data())
    def cancel_ack(self, data):
        g = self.pick(data, sorted(self.sys.acks))
        t = self.sys.pool.transfers.get(g)
        new = T.sys_cancel_ack(self.sys, g)
        if t is None:
            assert new == self.sys
        else:
            assert new.pool.buffers[t.buffer] == T.FREE_BUFFER and g not in new.pool.transfers
        self.sys = new

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def transfer_finishes(self, data):
        """The common case: a transfer lands and its callback arrives at once."""
        g = self.pick(data, self.running())
        self.sys = T.sys_land(self.sys, g)
        self.complete_one(*next(m for m in self.sys.callbacks if m[0] == g))

    @precondition(lambda self: self.sys.pool.next_gen > 1)
    @rule(now=st.integers(0, 7))
    def everything_drains(self, now):
        """Fairness, played out (now and then): every running transfer
        completes, every callback and ack is delivered. Then nothing is
        quarantined or written off and no request is draining."""
        if now != 7:  # the simplest draw (0) does nothing, so shrinking drops it
            return
        for g in self.running():
            self.sys = T.sys_land(self.sys, g)
        for g, b in sorted(self.sys.callbacks):
            self.sys = T.sys_complete(self.sys, g, b)
        for g in sorted(self.sys.acks):
            self.sys = T.sys_cancel_ack(self.sys, g)
        assert T.BINDING.violated(self.sys) == []
        pool = self.sys.pool
        assert pool.leaked == 0 and not pool.transfers
        assert not self.sys.node.transfers, "the node's table keeps only running transfers"
        assert all(b.state not in (T.BufState.QUARANTINED, T.BufState.LEAKED, T.BufState.LOADING)
                   for b in pool.buffers.values())
        assert all(q.state is T.ReqState.ACTIVE for q in pool.requests.values())
        self.drains += 1

    # -- refusals ------------------------------------------------------------

    @rule(g=st.integers(0, 60))
    def stale_events_change_nothing(self, g):
        """Events naming a generation the pool does not track: timers and
        cancels are refused (same state), callbacks dropped (counted)."""
        pool = self.sys.pool
        if g in pool.transfers:
            return
        for ev in (T.Timeout(g), T.Cancel(g), T.GiveUp(g)):
            new, effects = T.pool_step(pool, ev)
            assert new is pool and len(effects) == 1
            assert isinstance(effects[0].error, errors.StaleGeneration)
        for ev in (T.Complete(g, "b0"), T.CancelAck(g)):
            new, effects = T.pool_step(pool, ev)
            assert new == pool and new.stats.stale_dropped == pool.stats.stale_dropped + 1
            assert isinstance(effects[0].error, errors.StaleGeneration)

    @invariant()
    def spec_invariants_hold(self):
        assert T.BINDING.violated(self.sys) == []
        self.steps += 1

    def teardown(self):
        # Shown by --hypothesis-show-statistics: how far the runs got.
        stats = self.sys.pool.stats
        event(f"steps >= {self.steps // 25 * 25}")
        event(f"transfers issued >= {(self.sys.pool.next_gen - 1) // 10 * 10}")
        event(f"stale callbacks dropped >= {stats.stale_dropped // 5 * 5}")
        event(f"timed out >= {stats.timed_out // 5 * 5}")
        event(f"late completions drained (by the complete rules) >= {self.late // 2 * 2}")
        event(f"written off >= {stats.written_off}, recovered >= {stats.recovered}")
        event(f"full drains >= {min(self.drains, 3)}")


TestTimeoutSystem = TimeoutSystem.TestCase
