"""Tenancy far beyond what TLC enumerates: four tenants with different quotas
and reserves, objects of different sizes, time in fractions, several reads
per tenant at once, grants given and revoked while reads are in flight,
several namespaces per tenant (the same key strings in each) moving through
the upgrade lifecycle, and eviction by the policy whenever a write does not
fit. Every invariant of spec/Tenancy.tla is checked after every step, every
refusal is checked to change nothing, and a shadow model predicts who may read
what, how much each tenant holds and what its bucket allows."""

from hypothesis import event, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto import errors
from kvproto.statemachines import tenancy as T, tenancy_system as S
from kvproto.statemachines.refusal import Refused, accepted

TENANTS = ["a", "b", "c", "d"]
KEYS = ["k0", "k1", "k2", "k3"]
HOLDERS = [f"r{i}" for i in range(10)]
SIZES = st.integers(1, 8)
LIFECYCLE_FROM = {"PreWarm": {T.Phase.CANARY}, "Switch": {T.Phase.WARMING},
                  "RouteBack": {T.Phase.CANARY, T.Phase.WARMING, T.Phase.LIVE},
                  "Drop": {T.Phase.HELD}}

quotas = st.builds(T.Quota, stored=st.integers(4, 40), write_rate=st.sampled_from([0.5, 2, 8]),
                   write_burst=st.integers(8, 24), in_flight=st.integers(8, 32),
                   reserve=st.integers(0, 12))


class TenancySystem(RuleBasedStateMachine):
    @initialize(capacity=st.integers(8, 32), ttl=st.sampled_from([0.5, 1, 3]),
                qs=st.lists(quotas, min_size=len(TENANTS), max_size=len(TENANTS)),
                recovered=st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(KEYS),
                                             SIZES), max_size=8))
    def start(self, capacity, ttl, qs, recovered):
        table = T.new_tenancy(ttl, capacity)
        for name, q in zip(TENANTS, qs):
            table = self.ok(table, T.AddTenant(name, q))
            table = self.ok(table, T.AddNamespace(name, (name, 0)))
        self.sys = S.System(table)
        # a store a new master recovered: published objects, each within its
        # owner's stored bytes and the memory, or refused with nothing changed
        for name, key, size in recovered:
            t, table = self.table.tenants[name], self.table
            effects, refused = self.step(T.AddObject((name, 0), key, size))
            assert refused == (((name, 0), key) in table.objects or t.held + size > t.quota.stored
                               or table.used + size > table.capacity)
            if not refused:
                assert self.table.tenants[name].held == t.held + size
                assert self.table.objects[((name, 0), key)].status is T.Status.PUBLISHED
        self.next_gen = {name: 1 for name in TENANTS}
        self.written = {name: [] for name in TENANTS}      # (time, bytes) of admitted writes
        self.counts = dict.fromkeys(["reads", "refused_grant", "revoked_in_flight", "evicted_other",
                                     "quota_refusals", "route_backs", "switches", "late_fetch"], 0)

    # -- helpers -------------------------------------------------------------

    @staticmethod
    def ok(table, ev):
        new, effects = T.step(table, ev)
        assert accepted(effects), effects
        return new

    @property
    def table(self) -> T.Tenancy:
        return self.sys.table

    def step(self, ev):
        """Step the machine; a refusal must return the same state object."""
        before = self.table
        after, effects = T.step(before, ev)
        refused = bool(effects) and isinstance(effects[0], Refused)
        if refused:
            assert after is before and len(effects) == 1
        else:
            self.sys = S.System(after, self.sys.robbed)
        return effects, refused

    def namespaces(self, data, phases=None):
        names = sorted(n for n, r in self.table.namespaces.items()
                       if phases is None or r.phase in phases)
        return data.draw(st.sampled_from(names)) if names else None

    # -- time ----------------------------------------------------------------

    @rule(dt=st.sampled_from([0.25, 0.5, 1, 2.5]))
    def tick(self, dt):
        before = self.table
        self.step(T.Tick(before.now + dt))
        for name, t in self.table.tenants.items():
            assert t.bucket.level(self.table.now) <= t.quota.write_burst
            assert t.bucket.level(self.table.now) >= before.tenants[name].bucket.level(before.now)

    @rule()
    def clock_never_goes_back(self):
        if self.table.now:
            _, refused = self.step(T.Tick(self.table.now - 0.25))
            assert refused

    # -- grants --------------------------------------------------------------

    @rule(data=st.data(), grantee=st.sampled_from(TENANTS), by_owner=st.booleans())
    def grant(self, data, grantee, by_owner):
        ns = self.namespaces(data)
        rec = self.table.namespaces[ns]
        who = rec.owner if by_owner else data.draw(st.sampled_from(TENANTS))
        effects, refused = self.step(T.GrantRead(who, ns, grantee))
        assert refused == (who != rec.owner or grantee == rec.owner or grantee in rec.grants)
        if who != rec.owner:
            assert isinstance(effects[0].error, errors.AccessDenied)

    @rule(data=st.data())
    def revoke(self, data):
        granted = [(ns, g) for ns, r in self.table.namespaces.items() for g in r.grants]
        if not granted:
            return
        ns, grantee = data.draw(st.sampled_from(sorted(granted)))
        in_flight = [h for h, r in self.table.reads.items() if r.tenant == grantee and r.ns == ns]
        _, refused = self.step(T.RevokeRead(self.table.namespaces[ns].owner, ns, grantee))
        assert not refused
        for h in in_flight:           # reads in flight keep their leases, and learn of the cut
            assert self.table.reads[h].cut == self.table.now
        self.counts["revoked_in_flight"] += bool(in_flight)
        # a new read is refused at once
        obj = next((k for (n, k) in self.table.objects if n == ns), None)
        free = [h for h in HOLDERS if h not in self.table.reads]
        if obj is not None and free:
            effects, refused = self.step(T.Begin(free[0], grantee, ns, obj))
            assert refused and isinstance(effects[0].error, errors.AccessDenied)

    # -- reads ---------------------------------------------------------------

    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), key=st.sampled_from(KEYS),
          steer=st.integers(0, 3))
    def begin(self, data, tenant, key, steer):
        """Mostly of a published object by a tenant that may read it."""
        free = [h for h in HOLDERS if h not in self.table.reads]
        published = sorted(o for o, obj in self.table.objects.items()
                           if obj.status is T.Status.PUBLISHED)
        if not free:
            return
        if published and steer:
            ns, key = data.draw(st.sampled_from(published))
            rec = self.table.namespaces[ns]
            if steer > 1:
                tenant = data.draw(st.sampled_from(sorted({rec.owner} | rec.grants)))
        else:
            ns = self.namespaces(data)
        holder = data.draw(st.sampled_from(free))
        t, rec = self.table.tenants[tenant], self.table.namespaces[ns]
        obj = self.table.objects.get((ns, key))
        effects, refused = self.step(T.Begin(holder, tenant, ns, key))
        allowed = rec.owner == tenant or tenant in rec.grants
        if not allowed:
            assert refused and isinstance(effects[0].error, errors.AccessDenied)
            self.counts["refused_grant"] += 1
        elif obj is None or obj.status is not T.Status.PUBLISHED:
            assert refused and isinstance(effects[0].error, errors.KeyNotFound)
        elif t.in_flight + obj.size > t.quota.in_flight:
            assert refused and isinstance(effects[0].error, errors.QuotaExceeded)
        else:
            assert not refused
            g = effects[0]
            assert (g.src, g.key, g.size) == (ns, key, obj.size)   # its own namespace's object
            assert g.expires == self.table.now + self.table.ttl
            self.counts["reads"] += 1

    @rule(data=st.data(), stolen=st.booleans())
    def fetch(self, data, stolen):
        """The storage node serves a read's location to its tenant before the
        lease expires, and to nobody else (a stolen location is refused)."""
        if not self.table.reads:
            return
        holder = data.draw(st.sampled_from(sorted(self.table.reads)))
        read = self.table.reads[holder]
        tenant = data.draw(st.sampled_from(TENANTS)) if stolen else read.tenant
        effects, refused = self.step(T.Fetch(holder, tenant, read.src, read.key))
        should = (tenant == read.tenant and read.phase is T.ReadPhase.GRANTED
                  and self.table.now < read.expires)
        assert refused == (not should)
        if read.cut is not None and not refused:
            assert self.table.now < read.cut + self.table.ttl     # within one TTL of the cut
        self.counts["late_fetch"] += refused and self.table.now >= read.expires

    @rule(owner=st.sampled_from(TENANTS), reader=st.sampled_from(TENANTS),
          key=st.sampled_from(KEYS), size=SIZES,
          waits=st.lists(st.sampled_from([0.25, 0.5, 1]), max_size=4))
    def revoked_mid_read(self, owner, reader, key, size, waits):
        """Owner writes, grants, the reader is granted a read, the owner
        revokes: new reads and renewals are refused at once, the read in
        flight is served only until its lease (granted before the revocation)
        expires."""
        ns = next(n for n, r in self.table.namespaces.items()
                  if r.owner == owner and r.phase is T.Phase.LIVE)
        free = [h for h in HOLDERS if h not in self.table.reads]
        if owner == reader or len(free) < 2 or (ns, key) in self.table.objects:
            return
        if self.step(T.WriteStart(owner, ns, key, size))[1]:
            return                                         # over a quota, or memory full
        assert not self.step(T.WriteEnd(ns, key))[1]
        if reader not in self.table.namespaces[ns].grants:
            assert not self.step(T.GrantRead(owner, ns, reader))[1]
        effects, refused = self.step(T.Begin(free[0], reader, ns, key))
        if refused:
            assert isinstance(effects[0].error, errors.QuotaExceeded)
            return
        expires = effects[0].expires
        assert not self.step(T.RevokeRead(owner, ns, reader))[1]
        cut = self.table.now
        effects, refused = self.step(T.Begin(free[1], reader, ns, key))
        assert refused and isinstance(effects[0].error, errors.AccessDenied)
        for dt in waits:
            self.step(T.Tick(self.table.now + dt))
            assert self.step(T.Renew(free[0]))[1]
            self.spec_invariants_hold()
        _, refused = self.step(T.Fetch(free[0], reader, ns, key))
        assert refused == (self.table.now >= expires)
        assert refused or self.table.now < cut + self.table.ttl
        self.counts["revoked_in_flight"] += 1
        assert not self.step(T.Release(free[0]))[1]

    @rule(data=st.data())
    def renew(self, data):
        if not self.table.reads:
            return
        holder = data.draw(st.sampled_from(sorted(self.table.reads)))
        read = self.table.reads[holder]
        effects, refused = self.step(T.Renew(holder))
        allowed = T.may_read(self.table, read.tenant, read.ns)
        fresh = read.phase is T.ReadPhase.GRANTED and self.table.now < read.expires
        assert refused == (not (allowed and fresh))
        if fresh and not allowed:
            assert isinstance(effects[0].error, errors.AccessDenied)

    @rule(data=st.data())
    def release(self, data):
        if not self.table.reads:
            return
        holder = data.draw(st.sampled_from(sorted(self.table.reads)))
        read = self.table.reads[holder]
        before = self.table.tenants[read.tenant].in_flight
        _, refused = self.step(T.Release(holder))
        assert not refused and self.table.tenants[read.tenant].in_flight == before - read.size

    # -- writes --------------------------------------------------------------

    @rule(data=st.data(), key=st.sampled_from(KEYS), size=SIZES, as_owner=st.integers(0, 3),
          publish=st.integers(0, 2))
    def write(self, data, key, size, as_owner, publish):
        """A write (mostly by the owner of a writable namespace, mostly
        published at once); if memory is full, the policy evicts for it first."""
        ns = self.namespaces(data, T.WRITABLE if as_owner else None)
        rec = self.table.namespaces[ns]
        tenant = rec.owner if as_owner else data.draw(st.sampled_from(TENANTS))
        if (tenant == rec.owner and rec.phase in T.WRITABLE and (ns, key) not in self.table.objects
                and T.admit_write(self.table, tenant, size) is None):
            for victim in T.eviction_victims(self.table, tenant, size):
                owner = self.table.objects[victim].owner
                if owner != tenant:      # only from a tenant over its reserve, for one under
                    held = {n: sum(o.size for o in self.table.objects.values() if o.owner == n)
                            for n in (owner, tenant)}
                    assert held[owner] > self.table.tenants[owner].quota.reserve
                    assert held[tenant] < self.table.tenants[tenant].quota.reserve
                    self.counts["evicted_other"] += 1
                self.sys = S.sys_evict(self.sys, tenant, *victim, size=size)
                assert self.sys is not None
        t, used = self.table.tenants[tenant], self.table.used
        tokens, present = t.bucket.level(self.table.now), (ns, key) in self.table.objects
        effects, refused = self.step(T.WriteStart(tenant, ns, key, size))
        if tenant != rec.owner:
            assert refused and isinstance(effects[0].error, errors.AccessDenied)
        elif rec.phase not in T.WRITABLE:
            assert refused and isinstance(effects[0].error, errors.NamespaceClosed)
        elif present:
            assert refused and isinstance(effects[0].error, errors.KeyExists)
        elif (t.held + size > t.quota.stored or tokens < size
              or t.in_flight + size > t.quota.in_flight):
            assert refused and isinstance(effects[0].error, errors.QuotaExceeded)
            self.counts["quota_refusals"] += 1
        elif used + size > self.table.capacity:
            assert refused and isinstance(effects[0].error, errors.NoSpace)
        else:
            assert not refused
            self.written[tenant].append((self.table.now, size))
            if publish:
                assert not self.step(T.WriteEnd(ns, key))[1]

    @rule(data=st.data(), publish=st.booleans())
    def write_done(self, data, publish):
        pending = sorted(o for o, obj in self.table.objects.items()
                         if obj.status is T.Status.PENDING)
        if not pending:
            return
        ns, key = data.draw(st.sampled_from(pending))
        _, refused = self.step(T.WriteEnd(ns, key) if publish else T.WriteAbort(ns, key))
        assert not refused

    @rule(data=st.data(), as_owner=st.booleans())
    def remove(self, data, as_owner):
        if not self.table.objects:
            return
        ns, key = data.draw(st.sampled_from(sorted(self.table.objects)))
        rec = self.table.namespaces[ns]
        tenant = rec.owner if as_owner else data.draw(st.sampled_from(TENANTS))
        leased = T.is_leased(self.table, ns, key)
        published = self.table.objects[(ns, key)].status is T.Status.PUBLISHED
        effects, refused = self.step(T.Remove(tenant, ns, key))
        assert refused == (tenant != rec.owner or leased or not published
                           or rec.phase is T.Phase.HELD)

    # -- lifecycle -----------------------------------------------------------

    @rule(data=st.data())
    def upgrade(self, data):
        live = self.namespaces(data, {T.Phase.LIVE})
        owner = self.table.namespaces[live].owner
        new = (owner, self.next_gen[owner])
        _, refused = self.step(T.Create(owner, new, live))
        if not refused:
            self.next_gen[owner] += 1
            assert self.table.namespaces[new].phase is T.Phase.CANARY

    @rule(data=st.data(), action=st.sampled_from(["PreWarm", "Switch", "RouteBack", "Drop"]))
    def lifecycle(self, data, action):
        ns = self.namespaces(data, LIFECYCLE_FROM[action])
        if ns is None:
            return
        rec = self.table.namespaces[ns]
        before = self.table
        effects, refused = self.step(getattr(T, action)(rec.owner, ns))
        if refused:
            return
        if action == "Switch":
            assert self.table.namespaces[rec.previous].phase is T.Phase.RETIRING
            self.counts["switches"] += 1
        if action == "RouteBack":
            self.counts["route_backs"] += 1
            assert self.table.namespaces[rec.previous].phase is T.Phase.LIVE
            kept = {k for (n, k), o in before.objects.items()
                    if n == ns and o.status is T.Status.PUBLISHED}
            assert self.table.namespaces[ns].kept == kept
            for key in KEYS:      # no more writes
                effects, refused = self.step(T.WriteStart(rec.owner, ns, key, 1))
                assert refused

    @rule(data=st.data())
    def age_out(self, data):
        retiring = sorted(o for o in self.table.objects
                          if self.table.namespaces[o[0]].phase is T.Phase.RETIRING)
        if retiring:
            o = data.draw(st.sampled_from(retiring))
            busy = (T.is_leased(self.table, *o)
                    or self.table.objects[o].status is not T.Status.PUBLISHED)
            _, refused = self.step(T.AgeOut(*o))
            assert refused == busy

    # -- invariants ----------------------------------------------------------

    @invariant()
    def spec_invariants_hold(self):
        assert S.BINDING.violated(self.sys) == []

    @invariant()
    def bucket_bounds_every_window(self):
        """Over every window, a tenant's admitted writes are at most its burst
        plus its rate times the window's length."""
        for name, log in self.written.items():
            q = self.table.tenants[name].quota
            for i, (start, _) in enumerate(log):
                total = sum(size for when, size in log[i:])
                assert total <= q.write_burst + q.write_rate * (self.table.now - start) + 1e-9

    def teardown(self):
        for name, n in self.counts.items():
            event(f"{name} {min(n, 3)}")


TestTenancySystem = TenancySystem.TestCase
