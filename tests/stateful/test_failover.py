"""Master failover far beyond what TLC enumerates: three masters that crash,
pause and wake up still believing they serve, repeated takeovers (unbounded
terms), four storage nodes that die with their bytes during the switch, and
writers and readers running throughout. Every invariant of spec/Failover.tla is
checked after every step; a master whose term was fenced is checked to be
refused; a reader that misses falls back to recomputation through the rate
limiter. Property tests cover the directory rebuild and the limiter."""

import math

import immutables
from hypothesis import event, given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import attrs

from kvproto import errors
from kvproto.statemachines import failover as F

MASTERS = ["m0", "m1", "m2"]
NODES = ["n0", "n1", "n2", "n3"]
KEYS = [f"k{i}" for i in range(8)]
READERS = ["r0", "r1", "r2"]


class FailoverSystem(RuleBasedStateMachine):
    @initialize(rate=st.integers(1, 5), burst=st.integers(1, 4))
    def start(self, rate, burst):
        self.sys = F.System.initial(MASTERS, NODES, READERS, KEYS)
        self.limiter = F.RecomputeLimiter(rate=rate, burst=burst)
        self.now = 0.0
        self.recomputes = []
        self.takeovers = self.stale_refused = self.hits = self.misses = 0
        self.removes = self.stale_removes_refused = self.repairs = 0

    def step(self, action, *args):
        new = action(self.sys, *args)
        if new is not None:
            self.sys = new
        return new

    # -- the master's takeover, step by step and whole -----------------------

    @rule(m=st.sampled_from(MASTERS))
    def obtain_term(self, m):
        before = self.sys.coord_term
        if self.step(F.sys_obtain_term, m) is not None:
            assert self.sys.coord_term == before + 1 == self.sys.masters[m].term

    @rule(m=st.sampled_from(MASTERS), n=st.sampled_from(NODES))
    def fence(self, m, n):
        self.step(F.sys_fence, m, n)

    @rule(m=st.sampled_from(MASTERS))
    def recover(self, m):
        master = self.sys.masters[m]
        if self.step(F.sys_recover, m) is not None and self.sys.masters[m].phase is F.Phase.RECOVERED:
            assert master.phase is F.Phase.FENCING and F.fence_complete(master, self.sys.live)

    @rule(m=st.sampled_from(MASTERS))
    def open(self, m):
        phase = self.sys.masters[m].phase
        if self.step(F.sys_open, m) is not None:
            assert phase is F.Phase.RECOVERED

    @rule(m=st.sampled_from(MASTERS))
    def takeover(self, m):
        """A standby master obtains a term, fences every live node, recovers, opens."""
        if F.sys_obtain_term(self.sys, m) is None:
            return
        self.step(F.sys_obtain_term, m)
        for n in sorted(self.sys.live):
            self.step(F.sys_fence, m, n)
        self.step(F.sys_recover, m)
        if self.step(F.sys_open, m) is not None:
            self.takeovers += 1
            for other in MASTERS:
                if other != m:
                    assert not F.can_mutate(self.sys, other)

    @rule(m=st.sampled_from(MASTERS))
    def crash(self, m):
        if self.step(F.sys_crash, m) is not None:
            assert self.sys.masters[m] == F.Master()

    # -- writers -----------------------------------------------------------

    @rule(m=st.sampled_from(MASTERS), k=st.sampled_from(KEYS), n=st.sampled_from(NODES))
    def allocate(self, m, k, n):
        master = self.sys.masters[m]
        fenced = master.phase is F.Phase.OPEN and n in self.sys.live \
            and self.sys.nodes[n].term > master.term and k not in master.directory \
            and k not in self.sys.nodes[n].index
        self.step(F.sys_allocate, m, k, n)
        if fenced:   # a paused master woke up: refused by the fence, it steps down
            assert self.sys.masters[m].phase is F.Phase.STANDBY
            self.stale_refused += 1

    @rule(m=st.sampled_from(MASTERS), data=st.data())
    def paused_master_wakes(self, m, data):
        """An open master whose term a newer master has fenced wakes up and keeps
        sending: its allocation and publish are refused and it steps down."""
        master = self.sys.masters[m]
        newer = [o for o in self.sys.masters.values() if o.term > master.term
                 and o.phase in (F.Phase.RECOVERED, F.Phase.OPEN)]
        if master.phase is not F.Phase.OPEN or not newer:
            return
        key = data.draw(st.sampled_from(KEYS))
        node = data.draw(st.sampled_from(sorted(self.sys.live)))
        pending = [k for k, e in master.directory.items() if not e.published]
        if key in master.directory or key in self.sys.nodes[node].index:
            if not pending:
                return
            self.step(F.sys_publish, m, pending[0])
        else:
            self.step(F.sys_allocate, m, key, node)
        after = self.sys.masters[m]
        assert after.phase is F.Phase.STANDBY or after == master
        self.stale_refused += after.phase is F.Phase.STANDBY

    @rule(m=st.sampled_from(MASTERS), k=st.sampled_from(KEYS))
    def publish(self, m, k):
        self.step(F.sys_publish, m, k)

    @rule(m=st.sampled_from(MASTERS), k=st.sampled_from(KEYS), n=st.sampled_from(NODES))
    def whole_put(self, m, k, n):
        if self.step(F.sys_allocate, m, k, n) is not None:
            self.step(F.sys_publish, m, k)

    @rule(m=st.sampled_from(MASTERS), k=st.sampled_from(KEYS))
    def remove(self, m, k):
        """A remove is acknowledged (``told``) only when the node recorded it;
        a paused master's remove is refused by a fenced node and not told."""
        master = self.sys.masters[m]
        entry = master.directory.get(k)
        listed = [n for n, _ in entry.listed()] if entry is not None else []
        stale = master.phase is F.Phase.OPEN and entry is not None and entry.published \
            and all(n in self.sys.live and k in self.sys.nodes[n].index for n in listed) \
            and any(self.sys.nodes[n].term > master.term for n in listed) \
            and all(d is None or d.key != k for d in self.sys.desc.values())
        told = self.sys.told.get(k)
        if self.step(F.sys_remove, m, k) is None:
            return
        if stale:
            assert self.sys.masters[m].phase is F.Phase.STANDBY and self.sys.told.get(k) == told
            self.stale_removes_refused += 1
        else:
            assert self.sys.told[k] == F.TOLD_REMOVED and k not in self.sys.masters[m].directory
            assert all(k not in self.sys.nodes[n].index for n in listed)   # every replica freed
            self.removes += 1

    @rule(m=st.sampled_from(MASTERS), data=st.data())
    def repair(self, m, data):
        """A repaired replica records the object's publishing term, not the
        repairing master's, and is listed beside its source."""
        listed = {k: e for k, e in self.sys.masters[m].directory.items() if e.published}
        k = data.draw(st.sampled_from(sorted(listed) or KEYS))
        sources = [n for n, _ in listed[k].listed()] if k in listed else NODES
        s = data.draw(st.sampled_from(sources))
        d = data.draw(st.sampled_from([n for n in NODES if n not in sources] or NODES))
        source = self.sys.nodes[s].index.get(k)
        if self.step(F.sys_repair, m, k, s, d, 3) is None:
            return
        master = self.sys.masters[m]
        if master.phase is F.Phase.OPEN:
            assert self.sys.nodes[d].index[k] == attrs.evolve(
                source, offset=self.sys.nodes[d].index[k].offset)
            assert {s, d} <= {n for n, _ in master.directory[k].listed()}
            self.repairs += 1

    # -- readers -----------------------------------------------------------

    def fall_back(self):
        """A miss: the engine recomputes, if the limiter allows it now."""
        self.misses += 1
        self.limiter, allowed = self.limiter.take(self.now)
        if allowed:
            self.recomputes.append(self.now)

    @rule(r=st.sampled_from(READERS), m=st.sampled_from(MASTERS), k=st.sampled_from(KEYS))
    def lookup(self, r, m, k):
        _, effects = F.master_step(self.sys.masters[m], F.Lookup(k))
        if not isinstance(effects[0], F.Descriptor):
            assert isinstance(effects[0].error, (errors.MasterNotOpen, errors.KeyNotFound))
            if self.sys.desc[r] is None:
                self.fall_back()       # a failed lookup is a miss, not an error
            return
        self.step(F.sys_lookup, r, m, k)

    @rule(r=st.sampled_from(READERS))
    def read(self, r):
        if self.step(F.sys_read, r) is None:
            return
        got = self.sys.got[r]
        if got == F.MISS:
            self.fall_back()
        else:
            assert got.published
            self.hits += 1

    @rule(dt=st.floats(0, 2, allow_nan=False))
    def tick(self, dt):
        self.now += dt

    # -- storage -------------------------------------------------------------

    @rule(n=st.sampled_from(NODES))
    def node_lost(self, n):
        if len(self.sys.live) > 1:
            self.step(F.sys_node_lost, n)
            assert not self.sys.nodes[n].index

    # -- checks ------------------------------------------------------------

    @invariant()
    def spec_invariants_hold(self):
        for name, check in F.INVARIANTS.items():
            assert check(self.sys), name

    @invariant()
    def recomputes_are_rate_limited(self):
        lim = self.limiter
        for i, t0 in enumerate(self.recomputes):
            window = [t for t in self.recomputes[i:] if t <= self.now]
            assert len(window) <= lim.burst + lim.rate * (self.now - t0) + 1e-6

    def teardown(self):
        event(f"takeovers={min(self.takeovers, 3)}")
        event(f"stale master refused={min(self.stale_refused, 2)}")
        event(f"removes acknowledged={min(self.removes, 2)}")
        event(f"stale removes refused={min(self.stale_removes_refused, 1)}")
        event(f"repairs={min(self.repairs, 2)}")


TestFailoverSystem = FailoverSystem.TestCase


# --------------------------------------------------------------------------
# Storage fence
# --------------------------------------------------------------------------


@given(node_term=st.integers(0, 6), term=st.integers(0, 6), key=st.sampled_from(KEYS))
def test_storage_refuses_every_lower_term_request(node_term, term, key):
    entry = F.IndexEntry(term=max(node_term, 1))
    node = F.StorageNode(node_term, immutables.Map({key: entry}))
    for ev in (F.Fence(term), F.StampedAllocate("n", "other", term),
               F.StampedPublish("n", key, term), F.StampedRead("n", key, term),
               F.IndexRequest(term), F.StampedFree("n", key, term, entry.token)):
        after, effects = F.storage_step(node, ev)
        if term < node_term:
            assert after is node and len(effects) == 1
            assert isinstance(effects[0].error, errors.StaleTerm)
        else:
            assert not isinstance(effects[0], F.Refused)
            assert after.term == max(node_term, term) or isinstance(ev, (F.StampedRead, F.IndexRequest))


@given(term=st.integers(1, 6), token=st.integers(1, 9), other=st.integers(1, 9))
def test_free_drops_only_the_entry_of_its_own_allocation(term, token, other):
    node = F.StorageNode(term, immutables.Map({"k": F.IndexEntry(term, True, term, token=token)}))
    after, effects = F.storage_step(node, F.StampedFree("n", "k", term, other))
    if other == token:
        assert "k" not in after.index and effects == (F.StorageAccepted("k", term),)
    else:   # a free of an older allocation of the key leaves the newer one
        assert after is node and isinstance(effects[0].error, errors.StaleToken)


# --------------------------------------------------------------------------
# Directory rebuild
# --------------------------------------------------------------------------

entries = st.builds(F.IndexEntry, term=st.integers(1, 5), published=st.booleans(),
                    by=st.integers(1, 5), offset=st.integers(0, 100), length=st.integers(1, 16),
                    checksum=st.sampled_from([0, 5, 5, 2**64 - 1]), token=st.integers(0, 3))
indexes = st.dictionaries(st.sampled_from(NODES),
                          st.dictionaries(st.sampled_from(KEYS), entries).map(immutables.Map))


@given(indexes=indexes, live=st.frozensets(st.sampled_from(NODES)))
def test_rebuild_lists_exactly_published_objects_on_live_nodes(indexes, live):
    directory = F.rebuild_directory(indexes, live)
    expected = {k for n, idx in indexes.items() if n in live
                for k, e in idx.items() if e.published}
    assert set(directory.keys()) == expected
    for key, d in directory.items():
        assert d.published and d.node in live
        held = indexes[d.node][key]
        assert held.published and (held.offset, held.length, held.checksum) == \
            (d.offset, d.length, d.checksum)
        # every live node holding the same published allocation with the
        # same checksum is a replica; one with another checksum is a mismatch
        alike = [(n, idx[key]) for n, idx in indexes.items()
                 if n in live and key in idx and idx[key].published
                 and (idx[key].by, idx[key].token) == (held.by, held.token)]
        same = sorted((n, e.offset) for n, e in alike if e.checksum == held.checksum)
        assert list(d.replicas) == same and d.token == held.token
        odd = sorted((key, n, e.offset) for n, e in alike if e.checksum != held.checksum)
        assert [m for m in F.checksum_mismatches(indexes, live) if m[0] == key] == odd


@given(index=st.dictionaries(st.sampled_from(KEYS), entries).map(immutables.Map),
       below=st.integers(1, 6))
def test_purge_drops_older_unpublished_and_frees_their_space(index, below):
    kept, gone, freed = F.purge_unpublished(index, below)
    assert set(gone) == {k for k, e in index.items() if not e.published and e.term < below}
    assert freed == sum(index[k].length for k in gone)
    assert set(kept.keys()) == set(index.keys()) - set(gone)
    assert all(kept[k] == index[k] for k in kept)


# --------------------------------------------------------------------------
# Recompute limiter
# --------------------------------------------------------------------------


@given(rate=st.floats(0, 50, allow_nan=False), burst=st.integers(1, 10),
       gaps=st.lists(st.floats(0, 1, allow_nan=False), max_size=200))
def test_limiter_allows_at_most_burst_plus_rate_times_interval(rate, burst, gaps):
    limiter = F.RecomputeLimiter(rate=rate, burst=burst)
    now, allowed_at = 0.0, []
    for gap in gaps:
        now += gap
        limiter, allowed = limiter.take(now)
        if allowed:
            allowed_at.append(now)
        assert 0 <= limiter.tokens <= burst
    for i, t0 in enumerate(allowed_at):
        for j in range(i, len(allowed_at)):
            assert j - i + 1 <= burst + rate * (allowed_at[j] - t0) + 1e-6


@given(rate=st.floats(0.01, 50, allow_nan=False), burst=st.integers(1, 10),
       start=st.floats(0, 1000, allow_nan=False))
def test_limiter_refills_after_a_quiet_spell(rate, burst, start):
    limiter = F.RecomputeLimiter(rate=rate, burst=burst)
    for _ in range(burst):
        limiter, allowed = limiter.take(start)
        assert allowed
    limiter, allowed = limiter.take(start)
    assert not allowed
    limiter, allowed = limiter.take(start + math.ceil(burst / rate) + 1)
    assert allowed


@given(burst=st.integers(1, 5), times=st.lists(st.floats(0, 100, allow_nan=False), max_size=50))
def test_limiter_gains_nothing_from_a_clock_going_backwards(burst, times):
    limiter = F.RecomputeLimiter(rate=1.0, burst=burst)
    allowed_count = 0
    for t in times:
        limiter, allowed = limiter.take(t)
        allowed_count += allowed
    latest = max(times, default=0.0)
    first = times[0] if times else 0.0
    assert allowed_count <= burst + max(0.0, latest - first) + 1e-6


# --------------------------------------------------------------------------
# The Python machine, model-checked: the fence is what keeps it safe
# --------------------------------------------------------------------------


def _first_violation(limit=20_000, c=F.Constants(("m1", "m2"), ("n1", "n2"), ("k1",), ("r1",), 2)):
    from collections import deque
    start = c.initial()
    seen, queue = {start}, deque([start])
    while queue and len(seen) < limit:
        state = queue.popleft()
        bad = F.BINDING.violated(state)
        if bad:
            return bad
        for _, nxt in F.successors(state, c):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return []


def test_python_machine_without_the_term_check_breaks_an_invariant(monkeypatch):
    assert _first_violation() == []
    monkeypatch.setattr(F, "node_accepts", lambda node, term: True)
    assert "NoStaleTermWriteAccepted" in _first_violation()


def test_python_machine_whose_fence_forgets_the_term_breaks_an_invariant(monkeypatch):
    """Failover_Weak_FenceForgetsTerm, in Python: a node acknowledges a fence
    without recording its term, so it keeps the promise only on paper."""
    storage_step = F.storage_step

    def forgetful(node, event):
        new, effects = storage_step(node, event)
        return (node if isinstance(event, F.Fence) else new), effects

    monkeypatch.setattr(F, "storage_step", forgetful)
    assert "NoStaleTermWriteAccepted" in _first_violation()


def test_python_machine_whose_repair_stamps_its_own_term_breaks_an_invariant(monkeypatch):
    """Failover_Weak_RepairStampsOwnTerm, in Python: the repair's copy records
    the repairing master's term; after a publish in term 1, a repair in term 2
    and a takeover in term 3 the original is left out of the directory."""
    c = F.Constants(("m1", "m2"), ("n1", "n2"), ("k1",), (), 3, 2)
    assert _first_violation(60_000, c) == []
    repair = F._MASTER_HANDLERS[F.Repair]

    def own_term(state, ev):
        state, effects = repair(state, ev)
        if effects and isinstance(effects[-1], F.StampedPublish):
            effects = effects[:-1] + (attrs.evolve(effects[-1], by=0),)
        return state, effects

    monkeypatch.setitem(F._MASTER_HANDLERS, F.Repair, own_term)
    assert "NoPublishedCopyOrphaned" in _first_violation(60_000, c)

