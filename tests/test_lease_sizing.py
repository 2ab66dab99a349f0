"""The pure helpers of the lease protocol (kvproto/statemachines/lease.py): the
reader's acceptance check, lease sizing, renewal cost, the failure-reason
classifier and the watermark eviction policy, as properties; and the Python
machine model-checked in Python against the spec's invariants, with the
weakened checks of the Lease_Weak_* models caught."""

from collections import deque

import attrs
import pytest
from hypothesis import given, strategies as st

from kvproto import errors
from kvproto.statemachines import lease as L

ints = st.integers(0, 10_000)


# --- the reader's acceptance check -------------------------------------------

@given(sent=ints, ttl=st.integers(1, 10_000), bound=st.integers(0, 500), data=st.data())
def test_accepted_completion_is_within_the_lease_on_the_masters_clock(sent, ttl, bound, data):
    """Master's clock: the reader sends at ``sent``, the master grants at
    ``sent + queue`` (lease until ``grant + ttl``), the transfer completes at
    ``sent + elapsed``. The reader's clock reads ``sent + o1`` at the send and
    ``sent + elapsed + o2`` at completion, its measure of the interval off by
    ``o2 - o1`` within ``bound``. Whatever the offsets, an accepted completion
    happened while the lease was unexpired."""
    queue = data.draw(st.one_of(st.integers(0, 3), ints), label="queue")
    near_expiry = st.integers(max(0, ttl - 2 * bound - 2), ttl + 2 * bound + 2)
    elapsed = data.draw(st.one_of(near_expiry, ints), label="elapsed")
    o1 = data.draw(st.integers(-10_000, 10_000), label="offset at send")
    error = data.draw(st.one_of(st.sampled_from([-bound, bound]), st.integers(-bound, bound)),
                      label="error over the interval")
    grant = sent + queue
    if L.accept_transfer(sent + o1, sent + elapsed + o1 + error, ttl, bound):
        assert sent + elapsed < grant + ttl


@given(ttl=st.integers(1, 10_000), bound=st.integers(1, 500))
def test_the_skew_margin_is_tight(ttl, bound):
    """With one tick less margin, a reader whose clock ran slow by ``bound``
    accepts a transfer that completed exactly when the lease expired."""
    sent = grant = 0
    completed = grant + ttl                      # the master expired the lease here
    seen = completed - bound                     # the reader's clock ran slow
    assert not L.accept_transfer(sent, seen, ttl, bound)
    assert seen - sent < ttl - (bound - 1)       # accept_transfer with bound - 1 would accept


def test_wall_clock_offsets_count_twice():
    """Clocks that agree with the master within e at every instant can be off
    by 2e over an interval: pass ``max_skew = 2 * e``, not e."""
    e, ttl = 5, 100
    sent_local, completed_master = 0 + e, ttl + e - 1     # reader ahead by e at the send ...
    completed_local = completed_master - e                # ... behind by e at completion
    assert completed_master >= ttl                        # the lease (granted at 0) expired
    assert L.accept_transfer(sent_local, completed_local, ttl, e)            # unsafe
    assert not L.accept_transfer(sent_local, completed_local, ttl, 2 * e)    # safe


def test_negative_skew_is_refused():
    with pytest.raises(ValueError):
        L.accept_transfer(0, 1, 10, -1)


@given(sent=ints, ttl=st.integers(1, 1000), bound=st.integers(0, 100),
       done=st.lists(ints, max_size=20))
def test_usable_slices_are_the_accepted_prefix(sent, ttl, bound, done):
    n = L.usable_slices(sent, done, ttl, bound)
    assert all(L.accept_transfer(sent, c, ttl, bound) for c in done[:n])
    assert n == len(done) or not L.accept_transfer(sent, done[n], ttl, bound)


# --- lease sizing ------------------------------------------------------------

latency = st.floats(0, 1e3)
budgets = st.builds(L.LeaseBudget, queue=latency, transfer=latency, verify=latency,
                    clock_bound=st.floats(0, 10), margin=st.floats(0.01, 1)).filter(
                        lambda b: b.queue + b.transfer + b.verify >= 1e-3)


@given(budget=budgets, data=st.data())
def test_recommended_ttl_accepts_every_read_within_budget_for_every_skew(budget, data):
    share = st.floats(0, 1)
    phases = L.ReadPhases(budget.queue * data.draw(share), budget.transfer * data.draw(share),
                          budget.verify * data.draw(share))
    d = data.draw(st.floats(-budget.clock_bound, budget.clock_bound))
    assert L.accept_transfer(0.0, phases.total + d, budget.ttl, budget.clock_bound)


def test_recommend_ttl_formula():
    assert L.recommend_ttl(0.002, 0.010, 0.001, 0.0005, margin=0.25) == pytest.approx(
        1.25 * 0.013 + 2 * 0.0005)
    assert L.recommend_ttl(1, 2, 3, 0) == pytest.approx(7.5)   # default margin 0.25
    for bad in [(-1, 1, 1, 0), (1, 1, 1, -1), (0, 0, 0, 1)]:
        with pytest.raises(ValueError):
            L.recommend_ttl(*bad)
    with pytest.raises(ValueError):
        L.recommend_ttl(1, 1, 1, 0, margin=0)


@given(budget=budgets, which=st.sampled_from(["queue", "transfer", "verify", "clock_bound"]),
       more=st.floats(1e-3, 1e3))
def test_recommend_ttl_grows_with_every_input(budget, which, more):
    bigger = attrs.evolve(budget, **{which: getattr(budget, which) + more})
    assert bigger.ttl > budget.ttl


# --- renewal cost --------------------------------------------------------------

@given(read_time=st.integers(0, 100_000), ttl=st.integers(1, 1000), bound=st.integers(0, 100),
       rtt=st.integers(0, 100))
def test_renewals_needed_is_the_fewest_that_keep_the_read_acceptable(read_time, ttl, bound, rtt):
    period = ttl - bound - rtt
    if period <= 0:
        with pytest.raises(ValueError):
            L.renewals_needed(read_time, ttl, bound, rtt)
        return
    n = L.renewals_needed(read_time, ttl, bound, rtt)
    # renewing every `period` moves the deadline base to n * period
    assert L.accept_transfer(n * period, read_time, ttl, bound)
    if n:
        assert not L.accept_transfer((n - 1) * period, read_time, ttl, bound)


# --- failure reasons -------------------------------------------------------------

phase_times = st.floats(0, 2e3)


@given(budget=budgets, q=phase_times, t=phase_times, v=phase_times)
def test_classifier_blames_the_phase_that_overran_most(budget, q, t, v):
    phases = L.ReadPhases(q, t, v)
    reason = L.classify_rejection(phases, budget)
    over = {"q": q - budget.queue, "t": t - budget.transfer, "v": v - budget.verify}
    worst = max(over.values())
    if worst <= 0:
        assert reason is L.RejectReason.LEASE_TOO_SHORT
    elif over["q"] == worst:
        assert reason is L.RejectReason.QUEUED_TOO_LONG
    else:
        assert reason is L.RejectReason.NETWORK_SLOW


@given(budget=budgets, q=phase_times, t=phase_times, v=phase_times, data=st.data())
def test_a_read_rejected_under_the_recommended_ttl_overran_some_phase(budget, q, t, v, data):
    """So 'lease-too-short' under a recommended TTL means the budget is wrong."""
    phases = L.ReadPhases(q, t, v)
    d = data.draw(st.floats(-budget.clock_bound, budget.clock_bound))
    if not L.accept_transfer(0.0, phases.total + d, budget.ttl, budget.clock_bound):
        assert L.classify_rejection(phases, budget) is not L.RejectReason.LEASE_TOO_SHORT


def test_classifier_examples():
    b = L.LeaseBudget(queue=2, transfer=10, verify=1, clock_bound=0.5)
    assert L.classify_rejection(L.ReadPhases(9, 10, 1), b) is L.RejectReason.QUEUED_TOO_LONG
    assert L.classify_rejection(L.ReadPhases(2, 30, 1), b) is L.RejectReason.NETWORK_SLOW
    assert L.classify_rejection(L.ReadPhases(2, 10, 5), b) is L.RejectReason.NETWORK_SLOW
    assert L.classify_rejection(L.ReadPhases(2, 10, 1), b) is L.RejectReason.LEASE_TOO_SHORT
    assert L.RejectReason.LEASE_TOO_SHORT.value == "lease-too-short"


# --- eviction policy ---------------------------------------------------------------

@given(capacity=st.integers(1, 10_000), used_share=st.floats(0, 1),
       sizes=st.lists(st.integers(1, 500), max_size=60),
       hw=st.floats(0.5, 1), frac=st.floats(0, 0.5))
def test_plan_eviction_takes_the_shortest_lru_prefix_that_reaches_the_target(
        capacity, used_share, sizes, hw, frac):
    frac = min(frac, hw)
    used = int(capacity * used_share)
    candidates = [(f"k{i}", size) for i, size in enumerate(sizes)]
    pulled = []

    def lazily():
        for c in candidates:
            pulled.append(c)
            yield c

    plan = L.plan_eviction(used, capacity, lazily(), high_watermark=hw, free_fraction=frac)
    if used <= hw * capacity:
        assert plan.keys == () and pulled == []
        return
    k = len(plan.keys)
    assert plan.keys == tuple(key for key, _ in candidates[:k])
    assert plan.freed == sum(sizes[:k])
    assert len(pulled) <= k + 1                       # consumed lazily
    if plan.short:
        assert k == len(candidates)
    else:
        assert used - plan.freed <= (hw - frac) * capacity + 1e-6
        assert k == 0 or plan.freed - sizes[k - 1] < plan.target


def _table_with(objects, leased, stamps):
    t = L.new_table(ttl=10)
    for i, (key, size) in enumerate(objects):
        t, _ = L.master_step(t, L.Put(key, f"region{i}", size))
    for key, stamp in stamps.items():
        t = attrs.evolve(t, last_used=t.last_used.set(key, stamp))
    for i, key in enumerate(leased):
        t, eff = L.master_step(t, L.Grant(f"h{i}", key))
    return t


@given(n=st.integers(0, 30), data=st.data())
def test_eviction_candidates_are_unleased_and_least_recently_used_first(n, data):
    keys = [f"k{i:02d}" for i in range(n)]
    objects = [(k, data.draw(st.integers(1, 9))) for k in keys]
    leased = data.draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    stamps = {k: data.draw(st.integers(-50, 50)) for k in keys if k not in leased}
    t = _table_with(objects, leased, stamps)
    got = list(L.eviction_candidates(t))
    assert [k for k, _ in got] == sorted((k for k in keys if k not in leased),
                                         key=lambda k: (stamps[k], k))
    assert dict(got) == {k: s for k, s in objects if k not in leased}
    assert got == list(L.eviction_candidates(t))     # deterministic


def test_master_refuses_remove_and_evict_under_lease_and_release_keeps_the_object():
    t = L.new_table(ttl=5)
    t, _ = L.master_step(t, L.Put("k", "r0", 4))
    t, (g,) = L.master_step(t, L.Grant("reader", "k"))
    assert g.expires == 5
    for ev in (L.Remove("k"), L.Evict("k")):
        same, (refused,) = L.master_step(t, ev)
        assert same is t and isinstance(refused.error, errors.ObjectLeased)
    t, _ = L.master_step(t, L.Tick(4))
    t, (renewed,) = L.master_step(t, L.Renew("reader"))
    assert renewed.expires == 9
    t, (released,) = L.master_step(t, L.Release("reader"))
    assert "k" in t.objects and not t.leases              # release is not delete
    t, _ = L.master_step(t, L.Grant("other", "k"))
    t, ended = L.master_step(t, L.Tick(9))
    assert ended == (L.LeaseEnded("other", "k"),) and "k" in t.objects   # expiry is not delete
    same, (refused,) = L.master_step(t, L.Renew("other"))
    assert same is t and isinstance(refused.error, errors.LeaseExpired)
    t, (gone,) = L.master_step(t, L.Evict("k"))
    assert gone == L.Reclaimed("k", "r0", 4, evicted=True) and t.used == 0


# --- the Python machine, model-checked in Python ----------------------------------

SKEW_MODEL = L.Constants(keys=("k1", "k2"), slots=("s1",), readers=("r1",), ttl=4,
                         max_skew=2, max_time=6)          # spec/Lease_Skew.cfg


def _reachable_violations(c: L.Constants) -> dict[str, int]:
    """Breadth-first over the Python machine; how many states break each invariant."""
    start = c.initial()
    seen, queue, broken = {start}, deque([start]), {}
    while queue:
        s = queue.popleft()
        for name in L.BINDING.violated(s):
            broken[name] = broken.get(name, 0) + 1
        for _, nxt in L.successors(s, c):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return broken


def test_python_machine_keeps_every_invariant_in_every_reachable_state():
    assert _reachable_violations(SKEW_MODEL) == {}


def test_a_check_that_ignores_skew_is_caught(monkeypatch):
    """Lease_Weak_IgnoreSkew, in Python."""
    monkeypatch.setattr(L, "accept_transfer", lambda sent, done, ttl, skew: done - sent < ttl)
    assert "NoConsumeOfReclaimedBytes" in _reachable_violations(SKEW_MODEL)


def test_a_deadline_from_the_reply_is_caught(monkeypatch):
    """Lease_Weak_DeadlineFromReply, in Python."""
    monkeypatch.setattr(L, "deadline_base", lambda read, now: now)
    assert "NoConsumeOfReclaimedBytes" in _reachable_violations(SKEW_MODEL)


def test_eviction_that_ignores_leases_is_caught(monkeypatch):
    """Lease_Weak_EvictIgnoresLeases, in Python (Remove ignores them too here)."""
    monkeypatch.setattr(L, "is_leased", lambda table, key: False)
    assert "NoReclaimUnderLease" in _reachable_violations(SKEW_MODEL)


def test_a_release_that_reclaims_is_caught(monkeypatch):
    """A release that reclaims the object it protected (going through the
    same reclaim as Remove and Evict) breaks ReleaseIsNotDelete."""
    def reclaiming_release(table, ev):
        lease = table.leases.get(ev.holder)
        table, effects = L.release(table, ev)
        if lease is None:
            return table, effects
        gone, more = L._reclaim(table, lease.key, evicted=False)
        return (gone, effects + more) if gone is not table else (table, effects)

    monkeypatch.setitem(L._MASTER_HANDLERS, L.Release, reclaiming_release)
    assert "ReleaseIsNotDelete" in _reachable_violations(SKEW_MODEL)
