"""The closed system of ``spec/Tenancy.tla`` over the machine of
:mod:`kvproto.statemachines.tenancy`: one read per tenant, held under the
tenant's own name; the spec's actions (:data:`ACTIONS`) and invariants
(:data:`INVARIANTS`) under the spec's names; the model's constants, the
successor relation TLC's ``Next`` generates, and the stated mapping
(:func:`to_tla`) that the conformance test compares with TLC's graph.

Pure: no I/O, no clocks, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable, Optional

import attrs

from kvproto.checking.conformance import SpecBinding, emit
from kvproto.checking.tla import Fn, ModelValue, model_names
from kvproto.statemachines.refusal import accepted
from kvproto.statemachines.tenancy import (
    AddNamespace, AddTenant, AgeOut, Begin, Create, Drop, Event, Evict, Fetch, GrantRead,
    Phase, PreWarm, Quota, Release, Remove, Renew, RevokeRead, RouteBack, Status, Switch,
    Tenancy, Tick, WriteAbort, WriteEnd, WriteStart, add_namespace, add_tenant,
    fair_eviction, may_read, new_tenancy, settle, step)

# --------------------------------------------------------------------------
# The closed system of the spec: one read per tenant, named after it
# --------------------------------------------------------------------------


@attrs.frozen(cache_hash=True)
class System:
    """The tenancy state and the spec's ghost ``robbed``: tenants that lost an
    object to an eviction :func:`fair_eviction` does not allow (so, always
    empty)."""

    table: Tenancy
    robbed: frozenset = frozenset()

    @classmethod
    def initial(cls, c: "Constants") -> "System":
        table = new_tenancy(c.ttl, c.capacity)
        quota = Quota(stored=c.store_quota, write_rate=c.write_rate, write_burst=c.write_burst,
                      in_flight=c.transfer_quota, reserve=c.reserve)
        for t in c.tenants:
            table, _ = add_tenant(table, AddTenant(t, quota))
            table, _ = add_namespace(table, AddNamespace(t, (t, 1)))
        return cls(table)

    def step(self, event: Event) -> Optional["System"]:
        """The successor, or ``None`` when the event is refused (not enabled).
        Buckets are brought to the present (:func:`settle`), so that equal
        spec states are equal Python states."""
        table, effects = step(self.table, event)
        return attrs.evolve(self, table=settle(table)) if accepted(effects) else None


def sys_evict(sys: System, t: str, ns, key, size: int = 1) -> Optional[System]:
    """Spec ``Evict``; the ghost records a victim the rule did not protect."""
    obj = sys.table.objects.get((ns, key))
    new = sys.step(Evict(t, ns, key, size))
    if new is None or fair_eviction(sys.table, t, obj.owner):
        return new
    return attrs.evolve(new, robbed=new.robbed | {obj.owner})


def _owner(ns) -> str:
    return ns[0]


def _previous(ns):
    return (ns[0], ns[1] - 1)


#: The spec's actions, each as a function on :class:`System` that returns the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "Tick": lambda s: s.step(Tick(s.table.now + 1)),
    "GrantRead": lambda s, n, t: s.step(GrantRead(_owner(n), n, t)),
    "RevokeRead": lambda s, n, t: s.step(RevokeRead(_owner(n), n, t)),
    "Begin": lambda s, t, n, k: s.step(Begin(t, t, n, k)),
    "Fetch": lambda s, t, n, k: s.step(Fetch(t, t, n, k)),
    "Renew": lambda s, t: s.step(Renew(t)),
    "Release": lambda s, t: s.step(Release(t)),
    "WriteStart": lambda s, t, n, k: s.step(WriteStart(t, n, k)),
    "WriteEnd": lambda s, n, k: s.step(WriteEnd(n, k)),
    "WriteAbort": lambda s, n, k: s.step(WriteAbort(n, k)),
    "Remove": lambda s, n, k: s.step(Remove(_owner(n), n, k)),
    "Evict": sys_evict,
    "AgeOut": lambda s, n, k: s.step(AgeOut(n, k)),
    "Create": lambda s, n: s.step(Create(_owner(n), n, _previous(n))),
    "PreWarm": lambda s, n: s.step(PreWarm(_owner(n), n)),
    "Switch": lambda s, n: s.step(Switch(_owner(n), n)),
    "RouteBack": lambda s, n: s.step(RouteBack(_owner(n), n)),
    "Drop": lambda s, n: s.step(Drop(_owner(n), n)),
}

# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK`` (memory within capacity, owners never granted, one live
    namespace per line of upgrades: per tenant in the spec), plus the
    agreement of the kept sums and indexes."""
    t = sys.table
    if t.used != sum(o.size for o in t.objects.values()) or t.used > t.capacity:
        return False
    for name, ten in t.tenants.items():
        held = sum(o.size for o in t.objects.values() if o.owner == name)
        flight = sum(o.size for o in t.objects.values()
                     if o.owner == name and o.status is Status.PENDING)
        flight += sum(r.size for r in t.reads.values() if r.tenant == name)
        if (ten.held, ten.in_flight) != (held, flight):
            return False
    index: dict = {}
    for h, r in t.reads.items():
        index.setdefault((r.src, r.key), set()).add(h)
    if index != {o: set(hs) for o, hs in t.readers.items()}:
        return False
    live: dict = {}
    for ns, rec in t.namespaces.items():
        if rec.owner in rec.grants or any(o.owner != rec.owner
                                          for (n, _), o in t.objects.items() if n == ns):
            return False
        root = ns
        while t.namespaces[root].previous is not None:
            root = t.namespaces[root].previous
        live[root] = live.get(root, 0) + (rec.phase is Phase.LIVE)
    return all(n == 1 for n in live.values()) and all(n in t.namespaces for n, _ in t.objects)


def no_read_without_grant(sys: System) -> bool:
    """Spec ``NoReadWithoutGrant``: every read was authorized when it started."""
    return all(r.authorized for r in sys.table.reads.values())


def revoked_grants_end_reads(sys: System) -> bool:
    """Spec ``RevokedGrantsEndReads``: a read its tenant may no longer make was
    granted before the revocation and expires at most one TTL after it."""
    t = sys.table
    return all(r.cut is not None and r.expires <= r.cut + t.ttl
               for r in t.reads.values() if not may_read(t, r.tenant, r.ns))


def quotas_never_exceeded(sys: System) -> bool:
    """Spec ``QuotasNeverExceeded``."""
    t = sys.table
    return all(ten.held <= ten.quota.stored and ten.bucket.level(t.now) >= 0
               and ten.in_flight <= ten.quota.in_flight for ten in t.tenants.values())


def eviction_respects_tenants(sys: System) -> bool:
    """Spec ``EvictionRespectsTenants``: no unfair eviction happened."""
    return not sys.robbed


def namespaces_never_cross(sys: System) -> bool:
    """Spec ``NamespacesNeverCross``: a read finds only its namespace's object."""
    return all(r.src == r.ns for r in sys.table.reads.values())


def route_back_keeps_objects(sys: System) -> bool:
    """Spec ``RouteBackKeepsObjects``: a held namespace has exactly the
    (published) objects it had when it was routed back from."""
    t = sys.table
    for ns, rec in t.namespaces.items():
        if rec.phase is Phase.HELD:
            objs = {k: o for (n, k), o in t.objects.items() if n == ns}
            if set(objs) != set(rec.kept) or any(o.status is Status.PENDING
                                                 for o in objs.values()):
                return False
    return True


def no_reclaim_under_lease(sys: System) -> bool:
    """Spec ``NoReclaimUnderLease``: an unexpired read's object is published."""
    t = sys.table
    for r in t.reads.values():
        if t.now < r.expires:
            obj = t.objects.get((r.src, r.key))
            if obj is None or obj.status is not Status.PUBLISHED:
                return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "NoReadWithoutGrant": no_read_without_grant,
    "RevokedGrantsEndReads": revoked_grants_end_reads,
    "QuotasNeverExceeded": quotas_never_exceeded,
    "EvictionRespectsTenants": eviction_respects_tenants,
    "NamespacesNeverCross": namespaces_never_cross,
    "RouteBackKeepsObjects": route_back_keeps_objects,
    "NoReclaimUnderLease": no_reclaim_under_lease,
}

# --------------------------------------------------------------------------
# Model constants, successors and the stated mapping
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    """The spec's CONSTANTS; tenants and keys are model-value names."""

    tenants: tuple[str, ...]
    generations: int
    upgraders: tuple[str, ...]
    keys: tuple[str, ...]
    capacity: int
    store_quota: int
    reserve: int
    write_rate: int
    write_burst: int
    transfer_quota: int
    ttl: int
    max_time: int

    @classmethod
    def from_tla(cls, c: Mapping) -> "Constants":
        return cls(model_names(c["Tenants"]), c["Generations"], model_names(c["Upgraders"]),
                   model_names(c["Keys"]), c["Capacity"], c["StoreQuota"], c["Reserve"],
                   c["WriteRate"], c["WriteBurst"], c["TransferQuota"], c["TTL"], c["MaxTime"])

    @property
    def namespaces(self) -> list[tuple[str, int]]:
        return [(t, g) for t in self.tenants for g in range(1, self.generations + 1)]


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them.
    Events that cannot be enabled (a read of a tenant already reading, a write
    of a key present, a step on an object absent) are not tried; the machine
    would refuse them anyway."""
    a, t = ACTIONS, sys.table
    if t.now < c.max_time:
        yield from emit("Tick", a["Tick"](sys))
    for n in c.namespaces:
        if n in t.namespaces:
            for g in c.tenants:
                yield from emit("GrantRead", a["GrantRead"](sys, n, g))
                yield from emit("RevokeRead", a["RevokeRead"](sys, n, g))
    for tn in c.tenants:
        read = t.reads.get(tn)
        for n in c.namespaces:
            for k in c.keys:
                obj = t.objects.get((n, k))
                if read is None:
                    yield from emit("Begin", a["Begin"](sys, tn, n, k))
                elif (read.src, read.key) == (n, k):
                    yield from emit("Fetch", a["Fetch"](sys, tn, n, k))
                if obj is None:
                    yield from emit("WriteStart", a["WriteStart"](sys, tn, n, k))
                elif t.used >= t.capacity:
                    yield from emit("Evict", a["Evict"](sys, tn, n, k))
        if read is not None:
            yield from emit("Renew", a["Renew"](sys, tn))
            yield from emit("Release", a["Release"](sys, tn))
    for (n, k), obj in t.objects.items():
        names = (("WriteEnd", "WriteAbort") if obj.status is Status.PENDING
                 else ("Remove", "AgeOut"))
        for name in names:
            yield from emit(name, a[name](sys, n, k))
    for n in c.namespaces:
        if n[0] in c.upgraders and n[1] > 1:
            yield from emit("Create", a["Create"](sys, n))
        if n in t.namespaces:
            for name in ("PreWarm", "Switch", "RouteBack", "Drop"):
                yield from emit(name, a[name](sys, n))


NONE = ModelValue("None")


def _ns_value(ns) -> tuple:
    return (ModelValue(ns[0]), ns[1])


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping from a :class:`System` to the spec's variables.

    A namespace ``(t, g)`` is the tuple ``<<t, g>>``; tenants and keys are
    model values of the same name; a namespace not created is in phase
    ``"none"``; an absent object is ``"none"``; a tenant's read is the read
    held under its own name (``None`` when it has none), its ``auth`` the
    read's ``authorized``; the bucket's tokens are its level now.
    """
    t = sys.table

    def read(name: str):
        r = t.reads.get(name)
        if r is None:
            return NONE
        return Fn.of({"ns": _ns_value(r.ns), "key": ModelValue(r.key), "src": _ns_value(r.src),
                      "exp": r.expires, "ph": r.phase.value, "auth": r.authorized,
                      "cut": NONE if r.cut is None else r.cut})

    def status(n, k) -> str:
        obj = t.objects.get((n, k))
        return "none" if obj is None else obj.status.value

    def ns_field(get) -> Fn:
        return Fn.of({_ns_value(n): get(t.namespaces.get(n)) for n in c.namespaces})

    return Fn.of({
        "now": t.now,
        "dir": Fn.of({_ns_value(n): Fn.of({ModelValue(k): status(n, k) for k in c.keys})
                      for n in c.namespaces}),
        "phase": ns_field(lambda r: "none" if r is None else r.phase.value),
        "grants": ns_field(lambda r: frozenset() if r is None
                           else frozenset(ModelValue(g) for g in r.grants)),
        "tokens": Fn.of({ModelValue(n): ten.bucket.level(t.now) for n, ten in t.tenants.items()}),
        "read": Fn.of({ModelValue(n): read(n) for n in c.tenants}),
        "kept": ns_field(lambda r: frozenset() if r is None
                         else frozenset(ModelValue(k) for k in r.kept)),
        "robbed": frozenset(ModelValue(n) for n in sys.robbed),
    })


BINDING = SpecBinding(
    module="Tenancy",
    constants=Constants.from_tla,
    initial=lambda c: [System.initial(c)],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
