"""Tenants, namespaces, read grants and quotas of ``spec/Tenancy.tla`` as a
mutable, compact core.

Reference machine: :class:`kvproto.statemachines.tenancy.Tenancy` stepped by
:func:`kvproto.statemachines.tenancy.step`. :class:`TenancyCore` takes the
same events and returns the same effects; a refused event returns the same
single ``Refused`` effect and changes nothing. :meth:`TenancyCore.reference`
gives the equal frozen ``Tenancy``.

Every step is a judgement (the reference's guards, in its order, with its
messages: :meth:`TenancyCore.refusal`, which changes nothing and may be asked
at a later time than the core's clock) followed by the change. The master
checks a tenancy step before the step it guards and commits it after.

Layout: plain dicts. An object is one int, its size, negative while it is
being written (its owner is its namespace's); a tenant and a namespace are
small slotted records; reads, few, are the reference's ``ReadState`` values.
Nothing is a persistent map, so a step allocates no map nodes.

:meth:`TenancyCore.drop_many` is what the master takes for the published
objects of a lost segment: for each object, the ``Release`` of each of its
reads, then ``AgeOut`` (its namespace retiring) or ``Remove`` by its owner,
the steps composed in one pass. :meth:`TenancyCore.add_many` is what a
takeover takes for the objects it recovered: their ``AddObject`` steps
composed in one pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Optional

import immutables

from kvproto import errors
from kvproto.statemachines.refusal import Refused
from kvproto.statemachines.tenancy import (
    WRITABLE, AddNamespace, AddObject, AddTenant, AgeOut, Begin, Bucket, Create, Done, Drop,
    Evict, Fetch, Freed, GrantRead, NamespaceState, ObjectState, Phase, PreWarm, Quota,
    ReadGranted, ReadPhase, ReadState, Release, Remove, Renew, RevokeRead, RouteBack, Status,
    Switch, Tenancy, TenantState, Tick, WriteAbort, WriteEnd, WriteStart,
)

_DONE = (Done(),)
_RELEASED = Done()
_NOWHERE = object()       # no namespace yet (of a run of objects)


class _Tenant:
    """A tenant: its quota, its bucket's tokens at time ``at``, its sums."""

    __slots__ = ("quota", "tokens", "at", "held", "in_flight")

    def __init__(self, quota: Quota, tokens: float, at: float, held: int = 0,
                 in_flight: int = 0) -> None:
        self.quota, self.tokens, self.at = quota, tokens, at
        self.held, self.in_flight = held, in_flight

    def level(self, now: float) -> float:
        """``Bucket.level``, computed alike."""
        q = self.quota
        return min(q.write_burst, self.tokens + q.write_rate * (now - self.at))


class _Namespace:
    __slots__ = ("owner", "phase", "previous", "grants", "kept")

    def __init__(self, owner: str, phase: Phase, previous: Optional[Hashable] = None,
                 grants: Optional[set] = None, kept: frozenset = frozenset()) -> None:
        self.owner, self.phase, self.previous = owner, phase, previous
        self.grants = set() if grants is None else grants
        self.kept = kept


class TenancyCore:
    """The master's tenancy state: ``step(event) -> effects``, in place.

    Read it through :attr:`tenants`, :attr:`namespaces`, :attr:`objects`,
    :attr:`reads` and :attr:`readers` (shaped like the frozen value's maps,
    records built on access), ``now``, ``ttl``, ``capacity`` and ``used``."""

    __slots__ = ("ttl", "capacity", "now", "used", "_tenants", "_ns", "_objects", "_reads",
                 "_readers", "tenants", "namespaces", "objects", "reads",
                 "readers")

    def __init__(self, ttl: float, capacity: int) -> None:
        if ttl <= 0 or capacity < 0:
            raise ValueError("ttl must be positive and capacity not negative")
        self.ttl, self.capacity, self.now, self.used = ttl, capacity, 0, 0
        self._tenants: dict[str, _Tenant] = {}
        self._ns: dict[Hashable, _Namespace] = {}
        self._objects: dict[tuple, int] = {}      # (ns, key) -> size, negative while pending
        self._reads: dict[Hashable, ReadState] = {}
        self._readers: dict[tuple, set] = {}      # (ns, key) -> holders of its reads
        self._setup()

    def _setup(self) -> None:
        self.tenants = _Tenants(self)
        self.namespaces = _Namespaces(self)
        self.objects = _Objects(self)
        self.reads = MappingProxyType(self._reads)
        self.readers = _Readers(self)

    # ------------------------------------------------------------------ stepping

    def step(self, event) -> tuple:
        """Apply one event (those of ``tenancy.step``)."""
        judge, change = _methods(event)
        err = getattr(self, judge)(event, self.now)
        if err is not None:
            return (Refused(err),)
        return getattr(self, change)(event)

    def refusal(self, event, now: Optional[float] = None) -> Optional[errors.KvError]:
        """The error :meth:`step` would refuse ``event`` with once the clock
        is at ``now`` (default: the core's; not earlier), or ``None``; changes
        nothing."""
        now = self.now if now is None or now < self.now else now
        return getattr(self, _methods(event)[0])(event, now)

    def settle(self) -> None:
        """Every bucket counted up to ``now`` (``tenancy.settle``)."""
        now = self.now
        for t in self._tenants.values():
            if t.at != now:
                t.tokens, t.at = t.level(now), now

    def drop_many(self, objects: Iterable[tuple], effects: bool = False) -> tuple:
        """For each ``(ns, key)`` of ``objects`` the machine holds (others are
        passed over), in order: ``Release`` of each of its reads (holders in
        ``repr`` order), then ``AgeOut`` if its namespace is retiring, else
        ``Remove`` by its owner — those steps composed. Returns their effects
        in order (``effects``), or only the refusals (a pending object, one
        held for inspection: it stays)."""
        objs, nss, readers, tenants = self._objects, self._ns, self._readers, self._tenants
        out: list = []
        last, rec, fast, run = None, None, False, 0
        for o in objects:
            size = objs.pop(o, None)
            if size is None:
                continue
            if o[0] is not last:     # runs of one namespace: judged once
                if run:
                    tenants[rec.owner].held -= run
                    self.used -= run
                last, rec, run = o[0], nss[o[0]], 0
                fast = rec.phase is not Phase.HELD
            if fast and size > 0 and not (readers and o in readers):
                run += size              # accepted: a published, unread object
                if effects:
                    why = "aged-out" if rec.phase is Phase.RETIRING else "removed"
                    out.append(Freed(o[0], o[1], rec.owner, size, why))
                continue
            objs[o] = size               # the steps one by one
            for holder in sorted(readers.get(o, ()), key=repr):
                self._release(Release(holder))
                if effects:
                    out.append(_RELEASED)
            ev = AgeOut(*o) if rec.phase is Phase.RETIRING else Remove(rec.owner, *o)
            got = self.step(ev)
            if effects or type(got[0]) is Refused:
                out += got
        if run:
            tenants[rec.owner].held -= run
            self.used -= run
        return tuple(out)

    def add_many(self, objects: Iterable[tuple]) -> list:
        """``AddObject(ns, key, size)`` of each ``(ns, key, size)`` of
        ``objects``, in order — those steps composed (what a takeover takes
        for the objects it recovered). Returns ``(i, Refused)`` of each
        refused one (``i``: its position in ``objects``; it is not added);
        every other step's effect is ``Done``."""
        objs, nss, tenants = self._objects, self._ns, self._tenants
        refused: list = []
        used, capacity = self.used, self.capacity
        last, t, held, stored = _NOWHERE, None, 0, -1
        for i, (ns, key, size) in enumerate(objects):
            if ns is not last:       # runs of one namespace: its owner's sums held locally
                if t is not None:
                    t.held = held
                rec = nss.get(ns)
                last = ns
                t = tenants[rec.owner] if rec is not None else None
                held, stored = (t.held, t.quota.stored) if t is not None else (0, -1)
            if size > 0 and held + size <= stored and used + size <= capacity:
                n = len(objs)
                objs.setdefault((ns, key), size)
                if len(objs) > n:    # accepted: a new object
                    used += size
                    held += size
                    continue
            self.used = used         # the judgement of the step alone, for its refusal
            if t is not None:
                t.held = held
            refused.append((i, Refused(self._judge_add_object(AddObject(ns, key, size),
                                                              self.now))))
        if t is not None:
            t.held = held
        self.used = used
        return refused

    # ------------------------------------------------------------------ queries

    def may_read(self, tenant: str, ns: Hashable) -> bool:
        """Spec ``CanRead``: ``tenant`` owns ``ns`` or holds a read grant on it."""
        rec = self._ns.get(ns)
        return rec is not None and (rec.owner == tenant or tenant in rec.grants)

    def is_leased(self, o: tuple, now: float) -> bool:
        """Spec ``Leased`` at ``now``."""
        reads = self._reads
        return any(reads[h].expires > now for h in self._readers.get(o, ()))

    def per_namespace(self) -> dict:
        """``namespace -> (objects, bytes)`` of the namespaces holding objects
        (one pass over the objects, no record built)."""
        held: dict = {}
        for (ns, _), size in self._objects.items():
            count, total = held.get(ns, (0, 0))
            held[ns] = (count + 1, total + abs(size))
        return held

    # ------------------------------------------------------------------ judgements

    def _owned(self, tenant: str, ns: Hashable):
        rec = self._ns.get(ns)
        if rec is None:
            return None, errors.UnknownNamespace(f"no namespace {ns!r}")
        if rec.owner != tenant:
            return None, errors.AccessDenied(f"tenant {tenant!r} does not own namespace {ns!r}")
        return rec, None

    def _admit_write(self, tenant: str, size, now: float) -> Optional[errors.KvError]:
        t = self._tenants[tenant]
        q = t.quota
        if t.held + size > q.stored:
            return errors.QuotaExceeded(
                f"tenant {tenant!r} holds {t.held} of its {q.stored} bytes; {size} more do not fit")
        if t.level(now) < size:
            return errors.QuotaExceeded(
                f"tenant {tenant!r} is over its write bandwidth ({q.write_rate:g} bytes per "
                f"second, bursts of {q.write_burst:g})")
        if t.in_flight + size > q.in_flight:
            return errors.QuotaExceeded(
                f"tenant {tenant!r} has {t.in_flight} of its {q.in_flight} bytes in flight")
        return None

    def _fair(self, tenant: str, victim: str) -> bool:
        if tenant == victim:
            return True
        t, v = self._tenants[tenant], self._tenants[victim]
        return t.held < t.quota.reserve and v.held > v.quota.reserve

    def _reclaimable(self, ns, key, now: float) -> Optional[errors.KvError]:
        size = self._objects.get((ns, key))
        if size is None:
            return errors.KeyNotFound(f"{key!r} in namespace {ns!r}")
        if size < 0:
            return errors.NotPublished(f"{key!r} in namespace {ns!r} is being written")
        if self._ns[ns].phase is Phase.HELD:
            return errors.NamespaceClosed(f"namespace {ns!r} is held for inspection")
        if self.is_leased((ns, key), now):
            return errors.ObjectLeased(f"{key!r} in namespace {ns!r} is being read")
        return None

    def _judge_add_tenant(self, ev: AddTenant, now):
        q = ev.quota
        if ev.tenant in self._tenants:
            return errors.InvalidArgument(f"tenant {ev.tenant!r} exists")
        if min(q.stored, q.write_rate, q.write_burst, q.in_flight, q.reserve) < 0:
            return errors.InvalidArgument("quotas must not be negative")
        return None

    def _judge_add_namespace(self, ev: AddNamespace, now):
        if ev.tenant not in self._tenants:
            return errors.Unauthorized(f"no tenant {ev.tenant!r}")
        if ev.ns in self._ns:
            return errors.InvalidArgument(f"namespace {ev.ns!r} exists")
        return None

    def _judge_add_object(self, ev: AddObject, now):
        rec = self._ns.get(ev.ns)
        if rec is None:
            return errors.UnknownNamespace(f"no namespace {ev.ns!r}")
        if (ev.ns, ev.key) in self._objects:
            return errors.KeyExists(f"{ev.key!r} in namespace {ev.ns!r}")
        if ev.size <= 0:
            return errors.InvalidArgument("object size must be positive")
        t = self._tenants[rec.owner]
        if t.held + ev.size > t.quota.stored:
            return errors.QuotaExceeded(
                f"tenant {rec.owner!r} holds {t.held} of its {t.quota.stored} bytes; "
                f"{ev.size} more do not fit")
        if self.used + ev.size > self.capacity:
            return errors.NoSpace(f"{self.capacity - self.used} bytes free, {ev.size} needed")
        return None

    def _judge_tick(self, ev: Tick, now):
        if ev.now < now:
            return errors.InvalidArgument(f"clock went back from {now} to {ev.now}")
        return None

    def _judge_grant(self, ev: GrantRead, now):
        rec, err = self._owned(ev.owner, ev.ns)
        if err is not None:
            return err
        if ev.grantee not in self._tenants or ev.grantee == ev.owner:
            return errors.InvalidArgument(f"cannot grant to {ev.grantee!r}")
        if ev.grantee in rec.grants:
            return errors.InvalidArgument(f"{ev.grantee!r} already holds a grant")
        return None

    def _judge_revoke(self, ev: RevokeRead, now):
        rec, err = self._owned(ev.owner, ev.ns)
        if err is not None:
            return err
        if ev.grantee not in rec.grants:
            return errors.InvalidArgument(f"{ev.grantee!r} holds no grant on {ev.ns!r}")
        return None

    def _judge_begin(self, ev: Begin, now):
        t = self._tenants.get(ev.tenant)
        if t is None:
            return errors.Unauthorized(f"no tenant {ev.tenant!r}")
        if ev.holder in self._reads:
            return errors.LeaseHeld(f"{ev.holder!r} already holds a read")
        if ev.ns not in self._ns:
            return errors.UnknownNamespace(f"no namespace {ev.ns!r}")
        if not self.may_read(ev.tenant, ev.ns):
            return errors.AccessDenied(
                f"tenant {ev.tenant!r} holds no grant on namespace {ev.ns!r}")
        size = self._objects.get((ev.ns, ev.key))
        if size is None or size < 0:
            return errors.KeyNotFound(f"{ev.key!r} in namespace {ev.ns!r}")
        if t.in_flight + size > t.quota.in_flight:
            return errors.QuotaExceeded(
                f"tenant {ev.tenant!r} has {t.in_flight} of its {t.quota.in_flight} bytes "
                f"in flight")
        return None

    def _judge_fetch(self, ev: Fetch, now):
        read = self._reads.get(ev.holder)
        if not (read is not None and read.tenant == ev.tenant
                and read.phase is ReadPhase.GRANTED and read.src == ev.ns
                and read.key == ev.key and now < read.expires):
            return errors.AccessDenied(
                f"no unexpired read of {ev.key!r} in {ev.ns!r} for tenant {ev.tenant!r}")
        return None

    def _judge_renew(self, ev: Renew, now):
        read = self._reads.get(ev.holder)
        if read is None or read.phase is not ReadPhase.GRANTED or read.expires <= now:
            return errors.LeaseExpired(f"{ev.holder!r} holds no unexpired read")
        if not self.may_read(read.tenant, read.ns):
            return errors.AccessDenied(
                f"tenant {read.tenant!r}'s grant on namespace {read.ns!r} was revoked")
        return None

    def _judge_release(self, ev: Release, now):
        if ev.holder not in self._reads:
            return errors.LeaseExpired(f"{ev.holder!r} holds no read")
        return None

    def _judge_write_start(self, ev: WriteStart, now):
        if ev.tenant not in self._tenants:
            return errors.Unauthorized(f"no tenant {ev.tenant!r}")
        rec, err = self._owned(ev.tenant, ev.ns)
        if err is not None:
            return err
        if rec.phase not in WRITABLE:
            return errors.NamespaceClosed(
                f"namespace {ev.ns!r} is {rec.phase.value}: it takes no writes")
        if (ev.ns, ev.key) in self._objects:
            return errors.KeyExists(f"{ev.key!r} in namespace {ev.ns!r}")
        if ev.size <= 0:
            return errors.InvalidArgument("object size must be positive")
        err = self._admit_write(ev.tenant, ev.size, now)
        if err is not None:
            return err
        if self.used + ev.size > self.capacity:
            return errors.NoSpace(
                f"{self.capacity - self.used} bytes free, {ev.size} needed: evict first")
        return None

    def _judge_pending(self, ev, now):
        size = self._objects.get((ev.ns, ev.key))
        if size is None or size > 0:
            return errors.StaleToken(f"no write of {ev.key!r} in {ev.ns!r} in progress")
        return None

    def _judge_remove(self, ev: Remove, now):
        _, err = self._owned(ev.tenant, ev.ns)
        return err or self._reclaimable(ev.ns, ev.key, now)

    def _judge_evict(self, ev: Evict, now):
        if ev.tenant not in self._tenants:
            return errors.Unauthorized(f"no tenant {ev.tenant!r}")
        if self.capacity - self.used >= ev.size:
            return errors.InvalidArgument("memory has room: nothing to evict")
        err = self._admit_write(ev.tenant, ev.size, now) or \
            self._reclaimable(ev.ns, ev.key, now)
        if err is not None:
            return err
        victim = self._ns[ev.ns].owner
        if not self._fair(ev.tenant, victim):
            return errors.AccessDenied(
                f"a write of {ev.tenant!r} may not evict {victim!r}'s bytes")
        return None

    def _judge_age_out(self, ev: AgeOut, now):
        rec = self._ns.get(ev.ns)
        if rec is None or rec.phase is not Phase.RETIRING:
            return errors.InvalidArgument(f"namespace {ev.ns!r} is not retiring")
        return self._reclaimable(ev.ns, ev.key, now)

    def _judge_create(self, ev: Create, now):
        if ev.ns in self._ns:
            return errors.InvalidArgument(f"namespace {ev.ns!r} exists")
        prev, err = self._owned(ev.tenant, ev.previous)
        if err is not None:
            return err
        if prev.phase is not Phase.LIVE or any(
                r.previous == ev.previous and r.phase in (Phase.CANARY, Phase.WARMING)
                for r in self._ns.values()):
            return errors.InvalidArgument(
                f"namespace {ev.previous!r} is not live or is already being upgraded")
        return None

    def _lifecycle(self, tenant: str, ns, allowed, what: str):
        rec, err = self._owned(tenant, ns)
        if err is not None:
            return err
        prev = self._ns.get(rec.previous) if rec.previous is not None else None
        if not allowed(rec, prev):
            return errors.InvalidArgument(f"namespace {ns!r} is {rec.phase.value}: cannot {what}")
        return None

    def _judge_pre_warm(self, ev: PreWarm, now):
        return self._lifecycle(ev.tenant, ev.ns, lambda r, p: r.phase is Phase.CANARY,
                               "pre-warm")

    def _judge_switch(self, ev: Switch, now):
        return self._lifecycle(
            ev.tenant, ev.ns,
            lambda r, p: r.phase is Phase.WARMING and p is not None and p.phase is Phase.LIVE,
            "switch")

    def _judge_route_back(self, ev: RouteBack, now):
        def may(r, p):
            return p is not None and (
                (r.phase in (Phase.CANARY, Phase.WARMING) and p.phase is Phase.LIVE)
                or (r.phase is Phase.LIVE and p.phase is Phase.RETIRING))
        return self._lifecycle(ev.tenant, ev.ns, may, "route back")

    def _judge_drop(self, ev: Drop, now):
        return self._lifecycle(ev.tenant, ev.ns, lambda r, p: r.phase is Phase.HELD, "drop")

    # ------------------------------------------------------------------ changes (judged)

    def _add_tenant(self, ev: AddTenant) -> tuple:
        self._tenants[ev.tenant] = _Tenant(ev.quota, ev.quota.write_burst, self.now)
        return _DONE

    def _add_namespace(self, ev: AddNamespace) -> tuple:
        self._ns[ev.ns] = _Namespace(ev.tenant, Phase.LIVE)
        return _DONE

    def _add_object(self, ev: AddObject) -> tuple:
        self._objects[(ev.ns, ev.key)] = ev.size
        self.used += ev.size
        self._tenants[self._ns[ev.ns].owner].held += ev.size
        return _DONE

    def _tick(self, ev: Tick) -> tuple:
        if ev.now == self.now:
            return ()
        self.now = ev.now
        return _DONE

    def _set_cut(self, grantee: str, ns, cut) -> None:
        reads = self._reads
        for h, r in list(reads.items()):
            if r.tenant == grantee and r.ns == ns:
                reads[h] = ReadState(r.tenant, r.ns, r.key, r.src, r.size, r.expires, r.phase,
                                     r.authorized, cut)

    def _grant(self, ev: GrantRead) -> tuple:
        self._ns[ev.ns].grants.add(ev.grantee)
        self._set_cut(ev.grantee, ev.ns, None)
        return _DONE

    def _revoke(self, ev: RevokeRead) -> tuple:
        self._ns[ev.ns].grants.discard(ev.grantee)
        self._set_cut(ev.grantee, ev.ns, self.now)
        return _DONE

    def _begin(self, ev: Begin) -> tuple:
        o = (ev.ns, ev.key)
        size = self._objects[o]
        expires = self.now + self.ttl
        self._reads[ev.holder] = ReadState(ev.tenant, ev.ns, ev.key, ev.ns, size, expires)
        holders = self._readers.get(o)
        if holders is None:
            self._readers[o] = {ev.holder}
        else:
            holders.add(ev.holder)
        self._tenants[ev.tenant].in_flight += size
        return (ReadGranted(ev.holder, ev.ns, ev.key, size, expires, self.ttl),)

    def _fetch(self, ev: Fetch) -> tuple:
        r = self._reads[ev.holder]
        self._reads[ev.holder] = ReadState(r.tenant, r.ns, r.key, r.src, r.size, r.expires,
                                           ReadPhase.SERVED, r.authorized, r.cut)
        return _DONE

    def _renew(self, ev: Renew) -> tuple:
        r = self._reads[ev.holder]
        self._reads[ev.holder] = ReadState(r.tenant, r.ns, r.key, r.src, r.size,
                                           self.now + self.ttl, r.phase, r.authorized, r.cut)
        return _DONE

    def _release(self, ev: Release) -> tuple:
        read = self._reads.pop(ev.holder)
        o = (read.src, read.key)
        holders = self._readers[o]
        holders.discard(ev.holder)
        if not holders:
            del self._readers[o]
        self._tenants[read.tenant].in_flight -= read.size
        return _DONE

    def _write_start(self, ev: WriteStart) -> tuple:
        self._objects[(ev.ns, ev.key)] = -ev.size
        self.used += ev.size
        t = self._tenants[ev.tenant]
        t.held += ev.size
        t.in_flight += ev.size
        t.tokens, t.at = t.level(self.now) - ev.size, self.now     # Bucket.take
        return _DONE

    def _write_end(self, ev: WriteEnd) -> tuple:
        o = (ev.ns, ev.key)
        size = -self._objects[o]
        self._objects[o] = size
        self._tenants[self._ns[ev.ns].owner].in_flight -= size
        return _DONE

    def _drop_object(self, ns, key, why: str) -> tuple:
        size = self._objects.pop((ns, key))
        owner = self._ns[ns].owner
        t = self._tenants[owner]
        if size < 0:
            size = -size
            t.in_flight -= size
        self.used -= size
        t.held -= size
        return (Freed(ns, key, owner, size, why),)

    def _write_abort(self, ev: WriteAbort) -> tuple:
        return self._drop_object(ev.ns, ev.key, "abandoned")

    def _remove(self, ev: Remove) -> tuple:
        return self._drop_object(ev.ns, ev.key, "removed")

    def _evict(self, ev: Evict) -> tuple:
        return self._drop_object(ev.ns, ev.key, "evicted")

    def _age_out(self, ev: AgeOut) -> tuple:
        return self._drop_object(ev.ns, ev.key, "aged-out")

    def _create(self, ev: Create) -> tuple:
        self._ns[ev.ns] = _Namespace(ev.tenant, Phase.CANARY, previous=ev.previous)
        return _DONE

    def _pre_warm(self, ev: PreWarm) -> tuple:
        self._ns[ev.ns].phase = Phase.WARMING
        return _DONE

    def _switch(self, ev: Switch) -> tuple:
        rec = self._ns[ev.ns]
        rec.phase = Phase.LIVE
        self._ns[rec.previous].phase = Phase.RETIRING
        return _DONE

    def _route_back(self, ev: RouteBack) -> tuple:
        """Writes in progress abandoned, in the core's order (the reference's:
        its map's)."""
        effects: list = []
        for (ns, key), size in list(self._objects.items()):
            if ns == ev.ns and size < 0:
                effects += self._drop_object(ns, key, "abandoned")
        rec = self._ns[ev.ns]
        rec.phase = Phase.HELD
        rec.kept = frozenset(k for (ns, k) in self._objects if ns == ev.ns)
        self._ns[rec.previous].phase = Phase.LIVE
        return tuple(effects) or _DONE

    def _drop(self, ev: Drop) -> tuple:
        rec = self._ns[ev.ns]
        rec.phase, rec.kept = Phase.RETIRING, frozenset()
        return _DONE

    # ------------------------------------------------------------------ checks

    def _tenant_state(self, t: _Tenant) -> TenantState:
        q = t.quota
        return TenantState(q, Bucket(q.write_rate, q.write_burst, t.tokens, t.at), t.held,
                           t.in_flight)

    def _ns_state(self, rec: _Namespace) -> NamespaceState:
        return NamespaceState(rec.owner, rec.phase, rec.previous, frozenset(rec.grants), rec.kept)

    def _object(self, ns, size: int) -> ObjectState:
        return ObjectState(self._ns[ns].owner, abs(size),
                           Status.PENDING if size < 0 else Status.PUBLISHED)

    def reference(self) -> Tenancy:
        """The equal frozen :class:`Tenancy` (O(n); for checks)."""
        return Tenancy(
            ttl=self.ttl, capacity=self.capacity, now=self.now, used=self.used,
            tenants=immutables.Map({n: self._tenant_state(t) for n, t in self._tenants.items()}),
            namespaces=immutables.Map({n: self._ns_state(r) for n, r in self._ns.items()}),
            objects=immutables.Map({o: self._object(o[0], s) for o, s in self._objects.items()}),
            reads=immutables.Map(self._reads),
            readers=immutables.Map({o: frozenset(hs) for o, hs in self._readers.items()}))

    def copy(self) -> "TenancyCore":
        """An independent copy."""
        new = TenancyCore.__new__(TenancyCore)
        new.ttl, new.capacity, new.now, new.used = self.ttl, self.capacity, self.now, self.used
        new._tenants = {n: _Tenant(t.quota, t.tokens, t.at, t.held, t.in_flight)
                        for n, t in self._tenants.items()}
        new._ns = {n: _Namespace(r.owner, r.phase, r.previous, set(r.grants), r.kept)
                   for n, r in self._ns.items()}
        new._objects = dict(self._objects)
        new._reads = dict(self._reads)
        new._readers = {o: set(hs) for o, hs in self._readers.items()}
        new._setup()
        return new

    def __repr__(self) -> str:
        return (f"TenancyCore({len(self._tenants)} tenants, {len(self._ns)} namespaces, "
                f"{len(self._objects)} objects, {len(self._reads)} reads)")


#: Per event type, by name, the method that judges it (its refusal, or
#: ``None``) and the one that applies it: a copy binds no methods of its own.
_METHODS = {
    AddTenant: ("_judge_add_tenant", "_add_tenant"),
    AddNamespace: ("_judge_add_namespace", "_add_namespace"),
    AddObject: ("_judge_add_object", "_add_object"),
    Tick: ("_judge_tick", "_tick"),
    GrantRead: ("_judge_grant", "_grant"),
    RevokeRead: ("_judge_revoke", "_revoke"),
    Begin: ("_judge_begin", "_begin"),
    Fetch: ("_judge_fetch", "_fetch"),
    Renew: ("_judge_renew", "_renew"),
    Release: ("_judge_release", "_release"),
    WriteStart: ("_judge_write_start", "_write_start"),
    WriteEnd: ("_judge_pending", "_write_end"),
    WriteAbort: ("_judge_pending", "_write_abort"),
    Remove: ("_judge_remove", "_remove"),
    Evict: ("_judge_evict", "_evict"),
    AgeOut: ("_judge_age_out", "_age_out"),
    Create: ("_judge_create", "_create"),
    PreWarm: ("_judge_pre_warm", "_pre_warm"),
    Switch: ("_judge_switch", "_switch"),
    RouteBack: ("_judge_route_back", "_route_back"),
    Drop: ("_judge_drop", "_drop"),
}


def _methods(event) -> tuple[str, str]:
    try:
        return _METHODS[type(event)]
    except KeyError:
        raise TypeError(f"not a tenancy event: {event!r}") from None


class _View(Mapping):
    """A read-only map over one of a core's dicts, values built on access."""

    __slots__ = ("_core", "_dict")

    def __init__(self, core: TenancyCore, table: dict) -> None:
        self._core, self._dict = core, table

    def _value(self, key, raw):
        raise NotImplementedError

    def __getitem__(self, key):
        return self._value(key, self._dict[key])

    def get(self, key, default=None):
        raw = self._dict.get(key)
        return default if raw is None else self._value(key, raw)

    def __contains__(self, key) -> bool:
        return key in self._dict

    def __len__(self) -> int:
        return len(self._dict)

    def __iter__(self) -> Iterator:
        return iter(list(self._dict))

    def items(self):
        return [(k, self._value(k, v)) for k, v in self._dict.items()]

    def values(self):
        return [self._value(k, v) for k, v in self._dict.items()]


class _Tenants(_View):
    __slots__ = ()

    def __init__(self, core: TenancyCore) -> None:
        super().__init__(core, core._tenants)

    def _value(self, key, raw):
        return self._core._tenant_state(raw)


class _Namespaces(_View):
    __slots__ = ()

    def __init__(self, core: TenancyCore) -> None:
        super().__init__(core, core._ns)

    def _value(self, key, raw):
        return self._core._ns_state(raw)


class _Objects(_View):
    __slots__ = ()

    def __init__(self, core: TenancyCore) -> None:
        super().__init__(core, core._objects)

    def _value(self, key, raw):
        return self._core._object(key[0], raw)


class _Readers(_View):
    __slots__ = ()

    def __init__(self, core: TenancyCore) -> None:
        super().__init__(core, core._readers)

    def _value(self, key, raw):
        return frozenset(raw)
