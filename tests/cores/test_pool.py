"""The client's pool core (:class:`~kvproto.cores.pool.PoolCore`) against its
reference machine (``timeout.Pool`` + ``pool_step``), with the differential
machinery of ``test_differential.py``: the same random events to both, the
same effects (refusals by type and message) and ``core.reference()`` equal to
the reference pool (its stats too) after every step; ``step_all`` against
the reference stepped event by event, all or none. Then mutants of the core
the check must catch, and what the random populations do not reach."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvproto import errors
from kvproto.cores.pool import PoolCore
from kvproto.statemachines import timeout as T
from kvproto.statemachines.refusal import Refused
from test_differential import HUNT, RUNS, SOAK, Choose, Differential, assert_same

# --------------------------------------------------------------------------
# The client's pool of destination buffers
# --------------------------------------------------------------------------

PBUFFERS = [f"blk{i}" for i in range(300)]
PREQUESTS = [f"g{i}" for i in range(16)]


class PoolDiff(Differential):
    """timeout.Pool + pool_step against PoolCore: up to 300 buffers and 16
    requests, copies with sources (saves), copy units of many buffers and runs
    of releases and reads stepped all or none (``step_all``), callbacks of
    right, wrong and stale generations and buffers, timeouts, cancels, acks,
    write-offs against small budgets, requests cancelled and finished."""

    ACTIONS = ("acquire", "issue", "complete", "acquire", "issue", "complete", "batch", "consume",
               "release", "release", "consume", "timeout", "timeout", "cancel", "cancel_ack",
               "give_up", "batch", "start_request", "start_request", "request_cancel",
               "request_finish", "add_buffer", "queries")

    def begin(self, c: Choose):
        names = PBUFFERS[:c.int(16, len(PBUFFERS) if SOAK else 64)]
        limits = dict(max_cancels=c.one([0, 1, 3]), max_leaked=c.one([0, 1, 4]))
        self.ref, self.core = T.new_pool(names, **limits), PoolCore(names, **limits)
        for r in c.some(PREQUESTS, 2, 8):
            self.step(T.StartRequest(r))

    def step(self, event):
        self.ref, expected = T.pool_step(self.ref, event)
        got = self.core.step(event)
        assert_same(expected, got,
                    "kinds" if isinstance(event, (T.RequestCancel, T.RequestFinish)) else "exact")
        self.check()
        return expected

    def check(self):
        assert self.core.reference() == self.ref
        assert self.core.stats == self.ref.stats

    def request(self, c: Choose):
        """Mostly an active request."""
        active = sorted(r for r, q in self.ref.requests.items() if q.state is T.ReqState.ACTIVE)
        return c.mostly(active, PREQUESTS)

    def held(self, c: Choose, request, n: int = 1, *states) -> list:
        """``n`` buffers, mostly of those ``request`` holds (in ``states``, when named)."""
        bufs = self.ref.buffers
        req = self.ref.requests.get(request)
        mine = sorted(req.buffers) if req is not None else []
        fit = [b for b in mine if bufs[b].state in states] if states else mine
        return [c.mostly(fit or mine, sorted(bufs) + ["nope"]) for _ in range(n)]

    def owned(self, c: Choose, *states) -> tuple:
        """``(request, buffer)``: mostly a buffer in ``states`` and its owner."""
        fit = sorted((buf.owner, b) for b, buf in self.ref.buffers.items()
                     if buf.state in states and buf.owner is not None)
        if fit and not c.rare(4):
            return c.one(fit)
        r = self.request(c)
        return r, self.held(c, r, 1, *states)[0]

    def free(self) -> list:
        return sorted(b for b, buf in self.ref.buffers.items() if buf.state is T.BufState.FREE)

    def gen(self, c: Choose, *states) -> int:
        """Mostly a tracked transfer's generation (in ``states``, when named)."""
        tracked = sorted(g for g, t in self.ref.transfers.items() if not states or t.state in states)
        return c.mostly(tracked or sorted(self.ref.transfers), range(1, self.ref.next_gen + 2))

    def start_request(self, c: Choose):
        fresh = [r for r in PREQUESTS if r not in self.ref.requests]
        self.step(T.StartRequest(c.mostly(fresh, PREQUESTS)))

    def add_buffer(self, c: Choose):
        if c.rare(4):
            self.step(T.AddBuffer(c.one(PBUFFERS + ["extra"])))

    def acquire(self, c: Choose):
        self.step(T.Acquire(self.request(c), c.mostly(self.free(), sorted(self.ref.buffers) + ["nope"])))

    def release(self, c: Choose):
        self.step(T.Release(*self.owned(c, T.BufState.HELD, T.BufState.READY, T.BufState.USED)))

    def sources(self, c: Choose, request) -> frozenset:
        if c.rare(2):
            return frozenset()
        return frozenset(self.held(c, request, c.int(1, 4), T.BufState.HELD, T.BufState.READY,
                                   T.BufState.USED))

    def issue(self, c: Choose):
        r, b = self.owned(c, T.BufState.HELD)
        self.step(T.Issue(r, b, self.sources(c, r)))

    def complete(self, c: Choose):
        g = self.gen(c)
        t = self.ref.transfers.get(g)
        buffer = t.buffer if t is not None and not c.rare(6) else c.one(sorted(self.ref.buffers))
        self.step(T.Complete(g, buffer))

    def timeout(self, c: Choose):
        self.step(T.Timeout(self.gen(c, T.XferState.INFLIGHT)))

    def cancel(self, c: Choose):
        self.step(T.Cancel(self.gen(c, T.XferState.TIMEDOUT)))

    def cancel_ack(self, c: Choose):
        self.step(T.CancelAck(self.gen(c, T.XferState.TIMEDOUT, T.XferState.LEAKED)))

    def give_up(self, c: Choose):
        self.step(T.GiveUp(self.gen(c, T.XferState.TIMEDOUT)))

    def request_cancel(self, c: Choose):
        self.step(T.RequestCancel(self.request(c)))

    def request_finish(self, c: Choose):
        self.step(T.RequestFinish(self.request(c)))

    def consume(self, c: Choose):
        self.step(T.Consume(*self.owned(c, T.BufState.READY)))

    def batch(self, c: Choose):
        """``step_all``: the reference stepped event by event, all or none."""
        r = self.request(c)
        kind = c.one(["acquire", "release", "issue", "consume", "complete"])
        if kind == "acquire":
            free = self.free()
            events = [T.Acquire(r, b) for b in c.some(free, 0, 12)] if free else []
            if c.rare(6):
                events.append(T.Acquire(r, c.one(sorted(self.ref.buffers))))
        elif kind == "complete":
            events = [T.Complete(g, t.buffer) for g, t in sorted(self.ref.transfers.items())
                      if t.request == r or c.rare(8)]
        else:
            cls = {"release": T.Release, "issue": T.Issue, "consume": T.Consume}[kind]
            req = self.ref.requests.get(r)
            mine = sorted(req.buffers) if req is not None else []
            some = c.some(mine, 0, len(mine)) if mine and not c.rare(8) else self.held(c, r, 3)
            if c.rare(6) and some:
                some.append(c.one(some))                   # one twice
            extra = (self.sources(c, r),) if kind == "issue" else ()
            events = [cls(r, b, *extra) for b in some]
        trial, expected = self.ref, []
        for ev in events:
            trial, effects = T.pool_step(trial, ev)
            if effects and isinstance(effects[0], Refused):
                trial, expected = self.ref, list(effects)
                break
            expected.extend(effects)
        assert_same(tuple(expected), self.core.step_all(events))
        self.ref = trial
        self.check()

    def queries(self, c: Choose):
        """The views read as the frozen pool does."""
        core, ref = self.core, self.ref
        assert dict(core.buffers) == dict(ref.buffers)
        assert dict(core.transfers) == dict(ref.transfers)
        assert set(core.requests) == set(ref.requests) and len(core.requests) == len(ref.requests)
        for name, req in ref.requests.items():
            view = core.requests[name]
            assert (view.state, set(view.buffers), set(view.pending)) == \
                (req.state, set(req.buffers), set(req.pending))
        assert (core.next_gen, core.leaked) == (ref.next_gen, ref.leaked)
        for b in ref.buffers:
            assert T.load_outcome(core, b) == T.load_outcome(ref, b)
        copy = core.copy()
        assert copy.reference() == ref
        copy.step(T.AddBuffer("copy-only"))
        assert "copy-only" not in core.buffers


PoolDiff.TestCase.settings = settings(RUNS, max_examples=RUNS.max_examples * 5)
TestPool = PoolDiff.TestCase


# --------------------------------------------------------------------------
# Mutants: a core that breaks a rule the reference keeps fails the check
# --------------------------------------------------------------------------

def test_a_release_of_a_source_still_read_is_caught(monkeypatch):
    """Release gives back a buffer an awaited copy still reads (the
    Timeout_Weak_ReleaseReadSource flaw): the pool forgets its readers."""
    monkeypatch.setattr(PoolCore, "_read_refusal", lambda self, request, buffer: None)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(PoolDiff, settings=HUNT)


def accept_late(self, ev):
    """``PoolCore._complete`` that takes a timed-out copy for one still in
    flight, so its late bytes go to its request (the Timeout_Weak_AcceptLate
    flaw) instead of draining."""
    t = self._xfers.get(ev.gen)
    if t is not None and t.buffer == ev.buffer and t.state is T.XferState.TIMEDOUT:
        self._xfers[ev.gen] = T.Transfer(t.gen, t.request, t.buffer)
    return ORIGINAL_COMPLETE(self, ev)


ORIGINAL_COMPLETE = PoolCore._complete


def test_a_late_completion_used_as_loaded_is_caught(monkeypatch):
    monkeypatch.setattr(PoolCore, "_complete", accept_late)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(PoolDiff, settings=HUNT)


# --------------------------------------------------------------------------
# What the random populations do not reach
# --------------------------------------------------------------------------

def both(names, events):
    """The reference and the core stepped alike from ``names``; the reference pool."""
    ref, core = T.new_pool(names), PoolCore(names)
    for ev in events:
        ref, expected = T.pool_step(ref, ev)
        assert_same(expected, core.step(ev))
    assert core.reference() == ref
    return ref, core


def test_a_save_of_thousands_of_blocks_keeps_its_sources_all_or_none():
    """A save reads 2048 blocks; a run of releases that includes one of them is
    refused whole, with the reference's refusal, and changes nothing; a copy
    unit of 2048 blocks issues in one ``step_all``."""
    blocks = [f"blk{i}" for i in range(4100)]
    events = [T.StartRequest("g"), T.AddBuffer("stg0")]
    events += [T.Acquire("g", b) for b in blocks] + [T.Acquire("g", "stg0")]
    events.append(T.Issue("g", "stg0", blocks[:2048]))
    ref, core = both(blocks, events)
    run = [T.Release("g", b) for b in blocks[4096:]] + [T.Release("g", blocks[7])]
    trial, expected = ref, None
    for ev in run:
        trial, effects = T.pool_step(trial, ev)
        if isinstance(effects[0], Refused):
            expected = effects
            break
    before = core.reference()
    assert_same(expected, core.step_all(run))
    assert type(expected[0].error) is errors.TransferInFlight and core.reference() == before
    unit = [T.Issue("g", b) for b in blocks[2048:4096]]
    issued = core.step_all(unit)
    assert [e.gen for e in issued] == list(range(2, 2050))
    for ev in unit:
        ref, _ = T.pool_step(ref, ev)
    assert core.reference() == ref
    assert core.step_all([T.Complete(1, "stg0")]) and core.step_all(run)[-1] == T.Released("g", "blk7")


def test_step_all_undoes_a_batch_that_raises_and_does_not_nest():
    core = PoolCore(["a", "b"])
    core.step(T.StartRequest("r"))
    before = core.reference()
    with pytest.raises(TypeError):
        core.step_all([T.Acquire("r", "a"), object()])
    assert core.reference() == before and core.stats == before.stats

    class Nested:
        pass
    core._handlers[Nested] = lambda ev: core.step_all([])
    with pytest.raises(RuntimeError):
        core.step_all([T.Acquire("r", "a"), Nested()])
    assert core.reference() == before
    assert core.step_all([T.Acquire("r", "a"), T.Acquire("r", "b")]) == ()
    assert core.requests["r"].buffers.keys() == {"a", "b"}


def test_a_stale_callback_in_a_refused_batch_is_not_counted():
    """All or none includes the observations: the batch is as if never stepped."""
    core = PoolCore(["a"])
    core.step(T.StartRequest("r"))
    (refused,) = core.step_all([T.Acquire("r", "a"), T.Complete(9, "a")])
    assert type(refused.error) is errors.StaleGeneration
    assert core.stats.stale_dropped == 0 and core.buffers["a"] == T.FREE_BUFFER
    assert type(core.step(T.Complete(9, "a"))[0].error) is errors.StaleGeneration
    assert core.stats.stale_dropped == 1


def test_a_copy_unit_is_checked_whole_before_any_issue():
    """``step_all`` of a copy unit (one request's ``Issue``s into distinct
    buffers, the same sources) checks every buffer before it applies any: the
    refusal of the last one is the reference's, with nothing changed; a unit
    of the right buffers gives the reference's generations and state, and a
    unit that repeats a buffer or reads one of its destinations is stepped
    event by event, as the reference does."""
    names = [f"blk{i}" for i in range(12)]
    events = [T.StartRequest("g"), T.StartRequest("h")]
    events += [T.Acquire("g", b) for b in names[:10]] + [T.Acquire("h", names[10])]
    ref, core = both(names, events)

    def against_reference(unit):
        trial, expected = ref, []
        for ev in unit:
            trial, effects = T.pool_step(trial, ev)
            if isinstance(effects[0], Refused):
                trial, expected = ref, list(effects)
                break
            expected.extend(effects)
        before = core.reference()
        assert_same(tuple(expected), core.step_all(unit))
        assert core.reference() == trial
        return trial, before

    src = frozenset(names[8:10])
    for last in (names[10], names[11], names[8]):   # another's, a free one, a source
        trial, before = against_reference([T.Issue("g", b, src) for b in names[:4] + [last]])
        assert trial is ref and core.reference() == before
    against_reference([T.Issue("g", b, src) for b in names[:3] + names[:1]])   # one twice
    ref, _ = against_reference([T.Issue("g", b, src) for b in names[:8]])
    assert [t.gen for t in ref.transfers.values()] == list(range(1, 9))
    assert core._readers[names[8]] == dict.fromkeys(range(1, 9), True)
    trial, before = against_reference([T.Issue("g", b) for b in names[:2]])   # loading already
    assert trial is ref and core.reference() == before
