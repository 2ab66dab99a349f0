"""The fast tenancy core against the frozen tenancy machine, step by step, far
beyond what TLC enumerates: four tenants with random quotas (stored bytes,
write bandwidth, bytes in flight, reserves), a dozen namespaces with upgrades
and route-backs, hundreds of objects, reads under grants that are revoked,
renewed, served and released, evictions under memory pressure, time that
refills the buckets and ends leases. Every event goes to the reference
(``tenancy.step``) and to :class:`TenancyCore`; the effects must be the same
(refusals by type and message), and ``core.reference()`` equal to the
reference state, after every step. ``TenancyCore.refusal`` (the check the
master takes before the step it guards, at its own clock) must give the
refusal the reference gives once ticked to that clock, changing nothing.

``TenancyCore.drop_many`` (a lost segment's objects) is held to the fold the
master took one object at a time: per object present, ``Release`` of each of
its reads in ``repr`` order, then ``AgeOut`` (retiring namespace) or
``Remove`` by its owner — the same effects in the same order, the same state.

``TenancyCore.add_many`` (a takeover's recovered objects) is held to the
fold of their ``AddObject`` steps: random batches, in runs of one namespace
(over quotas and memory, keys present or listed twice, bad sizes, unknown
namespaces), the same refusals at the same positions, every other step
``Done``, the same state.

The last tests apply a mutation the reference would refuse to the core and
require these checks to fail."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvproto import errors
from kvproto.cores.tenancy import TenancyCore
from kvproto.statemachines import tenancy as T
from kvproto.statemachines.refusal import Refused
from test_differential import HUNT, RUNS, SOAK, Choose, Differential, assert_same

TENANTS = ["t0", "t1", "t2", "t3"]
HOLDERS = [f"r{i}" for i in range(8)] + [(f"t{i % 4}/c", i) for i in range(6)]
KEYS = [b"k%03d" % i for i in range(120 if SOAK else 60)] + [b"", b"a-longer-key-" * 3]
NAMES = ["default", "m", "v1", "v2", "v3"]


def fold(table: T.Tenancy, objects) -> tuple:
    """The steps the master took for each lost object, one by one."""
    out: list = []
    for o in objects:
        obj = table.objects.get(o)
        if obj is None:
            continue
        for holder in sorted(table.readers.get(o, ()), key=repr):
            table, effects = T.step(table, T.Release(holder))
            out += effects
        ev = (T.AgeOut(*o) if table.namespaces[o[0]].phase is T.Phase.RETIRING
              else T.Remove(obj.owner, *o))
        table, effects = T.step(table, ev)
        out += effects
    return table, tuple(out)


class TenancyDiff(Differential):
    """tenancy.Tenancy + tenancy.step against TenancyCore."""

    ACTIONS = ("tick", "grant", "grant", "revoke", "revoke", "begin_read", "begin_read",
               "begin_read", "begin_read", "fetch", "renew", "renew", "renew", "release", "write", "write", "write", "write", "end",
               "end", "end", "abort", "remove", "evict",
               "age_out", "create", "pre_warm", "switch", "route_back", "drop", "add_object",
               "lose", "load", "load", "check", "settle")

    def begin(self, c: Choose):
        ttl, capacity = c.one([0.5, 1.0, 2.5]), c.one([c.int(40, 200), c.int(200, 3000)])
        self.table, self.core = T.new_tenancy(ttl, capacity), TenancyCore(ttl, capacity)
        for t in TENANTS:
            quota = T.Quota(stored=c.int(0, 600), write_rate=c.one([0, 0.5, 3, 40]),
                            write_burst=c.int(0, 300), in_flight=c.int(0, 300),
                            reserve=c.int(0, 120))
            self.step(T.AddTenant(t, quota))
            for name in NAMES[:c.int(1, 2)]:
                self.step(T.AddNamespace(t, (t, name)))
        for ns in list(self.table.namespaces):    # as a tenants file and a takeover set up
            for grantee in c.some(TENANTS, 0, 2):
                self.step(T.GrantRead(ns[0], ns, grantee))
            for key in c.some(KEYS, 0, 6):
                self.step(T.AddObject(ns, key, c.int(1, 20)))
        if c.rare(3):
            self.step(T.AddTenant("bad", T.Quota(-1, 0, 0, 0)))

    def step(self, event, order: str = "exact"):
        expected_error = self.core.refusal(event)
        self.table, expected = T.step(self.table, event)
        got = self.core.step(event)
        assert_same(expected, got, order)
        refused = expected and isinstance(expected[0], Refused)
        assert (expected_error is None) == (not refused), (event, expected_error)
        if refused:
            assert (type(expected_error), str(expected_error)) == \
                (type(expected[0].error), str(expected[0].error))
        assert self.core.reference() == self.table
        held: dict = {}
        for (ns, _), obj in self.table.objects.items():
            count, size = held.get(ns, (0, 0))
            held[ns] = (count + 1, size + obj.size)
        assert self.core.per_namespace() == held
        return expected

    # ------------------------------------------------------------------ choices

    def ns(self, c: Choose):
        known = list(self.table.namespaces)
        return c.mostly(known, [(t, n) for t in TENANTS for n in NAMES] + [("nobody", "x")])

    def obj(self, c: Choose, pending: bool = False, phases=None):
        """Mostly an object of the machine (pending ones, or published ones of
        namespaces in ``phases``), else any."""
        t = self.table
        status = T.Status.PENDING if pending else T.Status.PUBLISHED
        objs = [o for o, v in t.objects.items() if v.status is status
                and (phases is None or t.namespaces[o[0]].phase in phases)]
        return c.mostly(objs, list(t.objects) + [(ns, k) for ns in list(t.namespaces)[:6]
                                                 for k in KEYS[:4]], 6)

    def in_phase(self, c: Choose, *phases):
        """Mostly a namespace in one of ``phases``."""
        return c.mostly([n for n, r in self.table.namespaces.items() if r.phase in phases],
                        [self.ns(c)], 6)

    def tenant(self, c: Choose, owner=None):
        return owner if owner is not None and not c.rare(6) else c.one(TENANTS + ["nobody"])

    def size(self, c: Choose) -> int:
        return c.int(1, 40) if not c.rare(25) else c.one([0, -3, 400])

    # ------------------------------------------------------------------ actions

    def tick(self, c: Choose):
        back = c.rare(20)
        dt = -c.float(0.01, 1) if back else c.one([0, 0.05, 0.25, 1, 2.5])
        self.step(T.Tick(self.table.now + dt))

    def grant(self, c: Choose):
        ns = self.ns(c)
        self.step(T.GrantRead(self.tenant(c, ns[0]), ns, c.one(TENANTS + ["nobody"])))

    def revoke(self, c: Choose):
        """Mostly the grant a read in progress was made under."""
        t = self.table
        under = [(r.ns, r.tenant) for r in t.reads.values() if r.tenant in t.namespaces[r.ns].grants]
        if under and not c.rare(3):
            ns, grantee = c.one(under)
            self.step(T.RevokeRead(ns[0], ns, grantee))
            return
        ns = c.mostly([n for n, r in t.namespaces.items() if r.grants], [self.ns(c)])
        rec = t.namespaces.get(ns)
        grantee = c.mostly(sorted(rec.grants) if rec else [], TENANTS)
        self.step(T.RevokeRead(self.tenant(c, ns[0]), ns, grantee))

    def holder(self, c: Choose, held: bool):
        return c.mostly(list(self.table.reads) if held else [], HOLDERS)

    def begin_read(self, c: Choose):
        ns, key = self.obj(c)
        rec = self.table.namespaces.get(ns)
        if rec is None or c.rare(8):
            tenant = c.one(TENANTS)
        else:       # mostly a grantee, if there is one
            tenant = c.one(sorted(rec.grants)) if rec.grants and not c.rare(3) else rec.owner
        self.step(T.Begin(self.holder(c, False), tenant, ns, key))

    def fetch(self, c: Choose):
        holder = self.holder(c, True)
        read = self.table.reads.get(holder)
        if read is not None and not c.rare(5):
            self.step(T.Fetch(holder, read.tenant, read.src, read.key))
        else:
            ns, key = self.obj(c)
            self.step(T.Fetch(holder, self.tenant(c), ns, key))

    def renew(self, c: Choose):
        """Mostly an unexpired read, one whose grant was revoked if any."""
        now = self.table.now
        live = [h for h, r in self.table.reads.items() if r.expires > now]
        cut = [h for h in live if self.table.reads[h].cut is not None]
        self.step(T.Renew(c.mostly(cut if cut and not c.rare(3) else live, HOLDERS)))

    def release(self, c: Choose):
        self.step(T.Release(self.holder(c, True)))

    def write(self, c: Choose):
        ns = self.ns(c)
        key = c.one(KEYS)
        self.step(T.WriteStart(self.tenant(c, ns[0]), ns, key, self.size(c)))

    def end(self, c: Choose):
        self.step(T.WriteEnd(*self.obj(c, pending=True)))

    def abort(self, c: Choose):
        self.step(T.WriteAbort(*self.obj(c, pending=True)))

    def remove(self, c: Choose):
        ns, key = self.obj(c)
        self.step(T.Remove(self.tenant(c, ns[0]), ns, key))

    def evict(self, c: Choose):
        """Mostly for a write just over the free memory."""
        ns, key = self.obj(c)
        free = self.table.capacity - self.table.used
        size = self.size(c) if c.rare(4) else max(1, free + c.int(1, 5))
        self.step(T.Evict(self.tenant(c, ns[0]) if c.rare(2) else c.one(TENANTS), ns, key, size))

    def age_out(self, c: Choose):
        self.step(T.AgeOut(*self.obj(c, phases=(T.Phase.RETIRING,))))

    def create(self, c: Choose):
        previous = self.in_phase(c, T.Phase.LIVE)
        ns = c.mostly([(previous[0], n) for n in NAMES
                       if (previous[0], n) not in self.table.namespaces], [self.ns(c)])
        self.step(T.Create(self.tenant(c, ns[0]), ns, previous))

    def lifecycle(self, c: Choose, kind, *phases):
        ns = self.in_phase(c, *phases)
        self.step(kind(self.tenant(c, ns[0]), ns), order="none")

    def pre_warm(self, c: Choose):
        self.lifecycle(c, T.PreWarm, T.Phase.CANARY)

    def switch(self, c: Choose):
        self.lifecycle(c, T.Switch, T.Phase.WARMING)

    def route_back(self, c: Choose):
        self.lifecycle(c, T.RouteBack, T.Phase.CANARY, T.Phase.WARMING, T.Phase.LIVE)

    def drop(self, c: Choose):
        self.lifecycle(c, T.Drop, T.Phase.HELD)

    def add_object(self, c: Choose):
        self.step(T.AddObject(self.ns(c), c.one(KEYS), self.size(c)))

    def lose(self, c: Choose):
        """A lost segment's objects in one ``drop_many``: the fold's effects
        and state; without ``effects``, its refusals only and the same state."""
        objs = list(self.table.objects)
        chosen = c.some(objs, 0, len(objs)) if objs else []
        chosen += [self.obj(c) for _ in range(c.int(0, 3))]    # absent, or listed twice
        table, expected = fold(self.table, chosen)
        quiet = self.core.copy()
        got = self.core.drop_many(chosen, effects=True)
        assert_same(expected, got)
        assert self.core.reference() == table
        refusals = quiet.drop_many(iter(chosen))
        assert_same(tuple(e for e in expected if isinstance(e, Refused)), refusals)
        assert quiet.reference() == table
        self.table = table

    def load(self, c: Choose):
        """A takeover's objects in one ``add_many``: the fold of their
        ``AddObject`` steps (the same refusals at the same positions, every
        other step ``Done``), the same state."""
        batch: list = []
        for _ in range(c.int(0, 4)):             # runs of one namespace
            ns = self.ns(c)
            if c.rare(4):                        # equal, not the same tuple
                ns = (ns[0], ns[1])
            batch += [(ns, c.one(KEYS), c.int(1, 20) if not c.rare(8) else self.size(c))
                      for _ in range(c.int(1, 10))]
        table, expected = self.table, []
        for i, (ns, key, size) in enumerate(batch):
            table, effects = T.step(table, T.AddObject(ns, key, size))
            if effects and isinstance(effects[0], Refused):
                expected.append((i, effects[0]))
            else:
                assert effects == (T.Done(),)
        got = self.core.add_many(iter(batch))
        assert [i for i, _ in got] == [i for i, _ in expected]
        assert_same(tuple(e for _, e in expected), tuple(e for _, e in got))
        assert self.core.reference() == table
        self.table = table

    def check(self, c: Choose):
        """The check at a later clock changes nothing and says what the
        reference says once ticked there."""
        later = self.table.now + c.one([0, 0.1, 1, 3])
        before = self.core.reference()
        probe = self.core.copy()
        event = self.probe_event(c)
        ticked, _ = T.step(self.table, T.Tick(later))
        _, expected = T.step(ticked, event)
        err = self.core.refusal(event, later)
        if expected and isinstance(expected[0], Refused):
            assert err is not None and (type(err), str(err)) == \
                (type(expected[0].error), str(expected[0].error))
        else:
            assert err is None, err
        assert self.core.reference() == before == probe.reference()

    def probe_event(self, c: Choose):
        ns, key = self.obj(c)
        holder = self.holder(c, True)
        return c.one([T.Begin(self.holder(c, False), self.tenant(c, ns[0]), ns, key),
                      T.WriteStart(self.tenant(c, ns[0]), ns, c.one(KEYS), self.size(c)),
                      T.Remove(self.tenant(c, ns[0]), ns, key), T.Renew(holder),
                      T.Evict(self.tenant(c), ns, key, self.size(c)), T.AgeOut(ns, key)])

    def settle(self, c: Choose):
        self.table = T.settle(self.table)
        self.core.settle()
        assert self.core.reference() == self.table


#: its steps are cheap: three times the examples of the other machines in CI
TenancyDiff.TestCase.settings = settings(RUNS, max_examples=RUNS.max_examples * 3)
TestTenancy = TenancyDiff.TestCase


def test_a_core_copy_is_independent_and_refusals_change_nothing():
    core = TenancyCore(1.0, 100)
    core.step(T.AddTenant("a", T.Quota(50, 1, 10, 50)))
    core.step(T.AddNamespace("a", ("a", "n")))
    copy = core.copy()
    assert copy.step(T.WriteStart("a", ("a", "n"), b"k", 5)) == (T.Done(),)
    assert (("a", "n"), b"k") not in core.objects and (("a", "n"), b"k") in copy.objects
    before = core.reference()
    (refused,) = core.step(T.WriteStart("a", ("a", "n"), b"k", 11))   # over the burst
    assert isinstance(refused.error, errors.QuotaExceeded) and core.reference() == before
    assert isinstance(core.refusal(T.Tick(-1)), errors.InvalidArgument)
    for probe in (core.step, core.refusal):
        with pytest.raises(TypeError):
            probe(object())


# --------------------------------------------------------------------------
# Mutants: a core that breaks a rule the reference keeps fails the check
# --------------------------------------------------------------------------


def test_a_renewal_after_the_grant_was_revoked_is_caught(monkeypatch):
    """The core renews a read whose tenant lost its grant (the
    Tenancy_Weak_RenewIgnoresRevoke flaw)."""
    def renew_ignores_revoke(self, ev, now):
        read = self._reads.get(ev.holder)
        if read is None or read.phase is not T.ReadPhase.GRANTED or read.expires <= now:
            return errors.LeaseExpired(f"{ev.holder!r} holds no unexpired read")
        return None

    monkeypatch.setattr(TenancyCore, "_judge_renew", renew_ignores_revoke)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(TenancyDiff, settings=HUNT)


def test_a_bulk_drop_that_leaves_the_reads_in_flight_is_caught(monkeypatch):
    """The bulk drop frees a leased object's bytes but leaves its readers'
    bytes in flight (it skips the Releases the master takes first)."""
    def drop_many(self, objects, effects=False):
        out = []
        for o in objects:
            if o in self._objects:
                rec = self._ns[o[0]]
                self._readers.pop(o, None)
                ev = (T.AgeOut(*o) if rec.phase is T.Phase.RETIRING else T.Remove(rec.owner, *o))
                got = self.step(ev)
                out += [e for e in got if effects or isinstance(e, Refused)]
        return tuple(out)

    monkeypatch.setattr(TenancyCore, "drop_many", drop_many)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(TenancyDiff, settings=HUNT)


def test_a_bulk_load_judged_against_the_state_before_it_is_caught(monkeypatch):
    """The bulk load judges each object against the sums before the batch, so
    a batch over a quota or the memory, or listing a key twice, passes whole."""
    def add_many(self, objects):
        before, refused = self.copy(), []
        for i, (ns, key, size) in enumerate(objects):
            event = T.AddObject(ns, key, size)
            err = before.refusal(event)
            if err is None:
                self._add_object(event)
            else:
                refused.append((i, Refused(err)))
        return refused

    monkeypatch.setattr(TenancyCore, "add_many", add_many)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(TenancyDiff, settings=HUNT)
