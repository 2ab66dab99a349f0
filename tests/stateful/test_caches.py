"""Fields left out of state equality cannot change what a step does.

The conformance test deduplicates Python states by equality, and three
fields are excluded from it: the lease table's ``earliest`` (a lower bound on
the earliest expiry, so a Tick before it skips the scan) and ``last_used``
(the eviction policy's recency), and the transfer pool's ``stats``
(observations). Two states that differ only there are one state to the
explorer, so the explorer would hide a difference in behaviour if one of
these fields could cause it. These tests show that none can: from any state
reached by a run of events, replacing the fields by any other admissible
values (any lower bound for ``earliest``; anything at all for ``last_used``
and ``stats``) gives equal successors and identical effects on every event,
and every step keeps ``earliest`` a lower bound (``type_ok`` checks that too,
in every state the stateful tests reach). The last tests show the check
fails on a mutation that lets one of these fields matter.
"""

import attrs
from hypothesis import given, strategies as st

from kvproto.statemachines import lease as L
from kvproto.statemachines import timeout as T


def comparable(value):
    """Effects with their errors as (kind, message): exceptions compare by identity."""
    if isinstance(value, BaseException):
        return type(value).__name__, str(value)
    if attrs.has(type(value)):
        return type(value).__name__, tuple(comparable(getattr(value, f.name))
                                           for f in attrs.fields(type(value)))
    if isinstance(value, (tuple, list)):
        return tuple(comparable(v) for v in value)
    return value


# --------------------------------------------------------------------------
# The lease table: earliest and last_used
# --------------------------------------------------------------------------

TTL = 3
KEYS = ("k0", "k1", "k2")
REGIONS = ("r0", "r1")
HOLDERS = ("h0", "h1", "h2")


def lease_events(now: int) -> list:
    """Every event of the universe, from a table whose clock reads ``now``."""
    return ([L.Tick(now + d) for d in range(5)]
            + [L.Put(k, r) for k in KEYS for r in REGIONS]
            + [L.Grant(h, k) for h in HOLDERS for k in KEYS]
            + [e(h) for h in HOLDERS for e in (L.Renew, L.Release)]
            + [e(k) for k in KEYS for e in (L.Remove, L.Evict, L.Disown)])


TAKEOVER = "takeover"


def replay(choices: list[int]) -> L.LeaseTable:
    """The table after a run: each choice picks an event (or a takeover)."""
    table = L.new_table(TTL)
    for choice in choices:
        events = lease_events(table.now) + [TAKEOVER]
        event = events[choice % len(events)]
        if event == TAKEOVER:
            table = L.restored_table(TTL, table.now,
                                     [(k, o.region, o.size) for k, o in table.objects.items()])
        else:
            table, _ = L.master_step(table, event)
    return table


def earliest_is_a_lower_bound(table: L.LeaseTable) -> bool:
    if table.earliest is None:
        return not table.leases
    return all(lease.expires >= table.earliest for lease in table.leases.values())


@st.composite
def lease_cases(draw):
    """A reached table and the same table with other admissible caches."""
    table = replay(draw(st.lists(st.integers(0, 10_000), max_size=30)))
    if table.leases:
        first = min(lease.expires for lease in table.leases.values())
        earliest = draw(st.integers(first - 6, first))
    else:
        earliest = draw(st.none() | st.integers(0, 20))
    last_used = draw(st.dictionaries(st.sampled_from(KEYS), st.integers(0, 20)))
    other = attrs.evolve(table, earliest=earliest, last_used=L.map_of(last_used.items()))
    return table, other


def lease_caches_change_no_step(case) -> None:
    table, other = case
    assert earliest_is_a_lower_bound(table)
    for event in lease_events(table.now):
        a, b = L.master_step(table, event), L.master_step(other, event)
        assert a[0] == b[0], f"{event}: the successors differ"
        assert comparable(a[1]) == comparable(b[1]), f"{event}: the effects differ"
        assert earliest_is_a_lower_bound(a[0]) and earliest_is_a_lower_bound(b[0]), event


@given(lease_cases())
def test_lease_caches_change_no_step(case):
    lease_caches_change_no_step(case)


# --------------------------------------------------------------------------
# The transfer pool: stats
# --------------------------------------------------------------------------

BUFFERS = ("b0", "b1")
REQUESTS = ("q0", "q1")


def pool_events(pool: T.Pool) -> list:
    gens = range(1, pool.next_gen + 1)
    return ([T.StartRequest(q) for q in REQUESTS]
            + [e(q, b) for q in REQUESTS for b in BUFFERS
               for e in (T.Acquire, T.Release, T.Issue, T.Consume)]
            + [T.Complete(g, b) for g in gens for b in BUFFERS]
            + [e(g) for g in gens for e in (T.Timeout, T.Cancel, T.CancelAck, T.GiveUp)]
            + [e(q) for q in REQUESTS for e in (T.RequestCancel, T.RequestFinish)])


@st.composite
def pool_cases(draw):
    pool = T.new_pool(BUFFERS, max_cancels=1, max_leaked=1)
    for choice in draw(st.lists(st.integers(0, 10_000), max_size=40)):
        events = pool_events(pool)
        pool, _ = T.pool_step(pool, events[choice % len(events)])
    counts = st.integers(0, 5)
    other = attrs.evolve(pool, stats=T.Stats(draw(counts), draw(counts), draw(counts),
                                             draw(counts)))
    return pool, other


def pool_stats_change_no_step(case) -> None:
    pool, other = case
    for event in pool_events(pool):
        a, b = T.pool_step(pool, event), T.pool_step(other, event)
        assert a[0] == b[0], f"{event}: the successors differ"
        assert comparable(a[1]) == comparable(b[1]), f"{event}: the effects differ"


@given(pool_cases())
def test_pool_stats_change_no_step(case):
    pool_stats_change_no_step(case)


# --------------------------------------------------------------------------
# The checks can fail: mutations that let an excluded field matter
# --------------------------------------------------------------------------


def falsified(check, witness) -> bool:
    """Whether ``check`` fails on ``witness()``, a case built under the mutation.
    (A concrete case rather than a search: which cases a derandomized search
    draws changes between Hypothesis versions.)"""
    try:
        check(witness())
    except AssertionError:
        return True
    return False


def table_after(*events) -> L.LeaseTable:
    table = L.new_table(TTL)
    for event in events:
        table, _ = L.master_step(table, event)
    return table


def two_readers():
    """Two leases on one key, the later granted last."""
    table = table_after(L.Put("k0", "r0"), L.Grant("h0", "k0"), L.Tick(1), L.Grant("h1", "k0"))
    return table, table


def a_lease_expiring_at_earliest():
    """One lease; ``earliest`` exactly its expiry, and one below it."""
    table = table_after(L.Put("k0", "r0"), L.Grant("h0", "k0"))
    return table, attrs.evolve(table, earliest=table.earliest - 1)


def an_object_used_now():
    """An unleased object; recency says used at this tick, and never."""
    table = table_after(L.Put("k0", "r0"))
    return (attrs.evolve(table, last_used=L.map_of([("k0", table.now)])),
            attrs.evolve(table, last_used=L.map_of([])))


def a_transfer_with_counters():
    """A transfer in flight; counters that say the budget is spent, and zero."""
    pool = T.new_pool(BUFFERS, max_cancels=1, max_leaked=1)
    for event in (T.StartRequest("q0"), T.Acquire("q0", "b0"), T.Issue("q0", "b0")):
        pool, _ = T.pool_step(pool, event)
    return attrs.evolve(pool, stats=T.Stats(written_off=1)), attrs.evolve(pool, stats=T.Stats())


def test_an_earliest_overwritten_by_the_newest_lease_is_caught(monkeypatch):
    """``earliest`` set to the lease just granted, not the minimum: harmless
    with one reader (so Lease_Skew, with one reader, passes it), wrong with two."""
    def with_lease(table, lease, **changes):
        new = with_lease.original(table, lease, **changes)
        return attrs.evolve(new, earliest=lease.expires)
    with_lease.original = L._with_lease
    monkeypatch.setattr(L, "_with_lease", with_lease)
    assert falsified(lease_caches_change_no_step, two_readers)


def test_a_tick_that_trusts_earliest_too_far_is_caught(monkeypatch):
    """A Tick that skips the scan when ``earliest`` equals the new time (so a
    lease expiring exactly then outlives its expiry, unless ``earliest`` is lower)."""
    def tick(table, ev):
        if table.earliest is not None and table.earliest >= ev.now > table.now:
            return attrs.evolve(table, now=ev.now), ()
        return tick.original(table, ev)
    tick.original = L.tick
    monkeypatch.setitem(L._MASTER_HANDLERS, L.Tick, tick)
    assert falsified(lease_caches_change_no_step, a_lease_expiring_at_earliest)


def test_a_step_that_reads_last_used_is_caught(monkeypatch):
    """An Evict that spares the object used at this very tick (recency is the
    policy's business, outside the step)."""
    def evict(table, ev):
        if table.last_used.get(ev.key) == table.now:
            return L._refuse(table, L.errors.ObjectLeased(f"{ev.key!r} was just used"))
        return L.evict(table, ev)
    monkeypatch.setitem(L._MASTER_HANDLERS, L.Evict, evict)
    assert falsified(lease_caches_change_no_step, an_object_used_now)


def test_a_leak_budget_counted_from_stats_is_caught(monkeypatch):
    """GiveUp's budget taken from the counters (written off less recovered),
    which equal ``leaked`` in every run, but are observations, not state."""
    def give_up(pool, ev):
        if pool.stats.written_off - pool.stats.recovered >= pool.max_leaked:
            return T._refuse(pool, T.errors.LeakBudgetExhausted("the counters say it is spent"))
        return give_up.original(pool, ev)
    give_up.original = T.give_up
    monkeypatch.setitem(T._POOL_HANDLERS, T.GiveUp, give_up)
    assert falsified(pool_stats_change_no_step, a_transfer_with_counters)
