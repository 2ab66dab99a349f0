"""Tenants, namespaces, read grants, quotas and the upgrade lifecycle
(``spec/Tenancy.tla``) as a pure, sans-IO state machine.

The rule: an object is named by its namespace *and* its key, so the same key
string in two namespaces names two objects, and a read of namespace ``n``
finds only ``n``'s objects. A namespace is an isolation label, not access
control: only its owner writes it, and a tenant reads it only as its owner or
under a read grant from the owner; that check is separate and always runs, at
the master when it grants a read (:class:`Begin`) or renews one
(:class:`Renew`), and at the storage node when it serves the bytes
(:func:`node_admits`: only under the reader's own unexpired ticket). Revoking a
grant ends new reads at once; a read already granted keeps its lease, which can
no longer be renewed, so no byte is served to the reader more than one TTL
after the revocation.

Each tenant has quotas (:class:`Quota`): bytes held (published or being
written, counted from the allocation), a token bucket of write bandwidth fed
by time (:class:`Tick`), and bytes in flight (writes not yet published, reads
not yet released). A request over a quota is refused with
:class:`~kvproto.errors.QuotaExceeded` and changes nothing. Under memory
pressure a write may evict an unleased object (:class:`Evict`): its tenant's
own, or another tenant's only while the writer holds less than its reserve and
the victim's owner more than its own (:func:`fair_eviction`;
:func:`eviction_victims` is the policy that picks them).

Namespaces go through an upgrade lifecycle:
:class:`Create` (canary) -> :class:`PreWarm` -> :class:`Switch` (the previous
namespace retires and :class:`AgeOut` takes its objects), or
:class:`RouteBack` (the previous namespace is live again; the new one takes no
writes, those in progress are abandoned, and its objects are kept for
inspection until :class:`Drop`).

Every step is ``(state, event) -> (state, effects)``; a refused event returns
the same state object and one :class:`~kvproto.statemachines.refusal.Refused`
effect with a typed error. The closed system of the spec, its actions and
invariants under the spec's names, and the stated mapping are in
:mod:`kvproto.statemachines.tenancy_system`.

Pure: no I/O, no clocks, no randomness.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from typing import Callable, Optional, Union

import attrs
import immutables

from kvproto import errors
from kvproto.statemachines.refusal import refuse as _refuse

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


class Phase(str, enum.Enum):
    CANARY = "canary"        # new: a fraction of the writes come here
    WARMING = "warming"      # new: hot prefixes are recomputed into it
    LIVE = "live"            # takes the traffic
    RETIRING = "retiring"    # old: no writes; its objects age out
    HELD = "held"            # routed back from: no writes, objects kept for inspection


WRITABLE = frozenset({Phase.CANARY, Phase.WARMING, Phase.LIVE})


@attrs.frozen
class Quota:
    """One tenant's limits, in bytes (and bytes per unit of time)."""

    stored: int                 # bytes held: published or being written
    write_rate: float           # write tokens (bytes) added per unit of time
    write_burst: float          # the bucket's size: the largest burst of writes
    in_flight: int              # bytes of transfers in flight
    reserve: int = 0            # bytes no other tenant's write evicts it below


@attrs.frozen
class Bucket:
    """A token bucket fed time as an argument: ``tokens`` at time ``at``,
    ``rate`` more per unit of time, never more than ``burst``. Over any
    window of length ``w`` it lets through at most ``burst + rate * w``."""

    rate: float
    burst: float
    tokens: float
    at: float = 0

    def level(self, now: float) -> float:
        """The tokens at ``now`` (not before ``at``)."""
        return min(self.burst, self.tokens + self.rate * (now - self.at))

    def take(self, now: float, n: float) -> Optional["Bucket"]:
        """The bucket after ``n`` tokens are spent at ``now``, or ``None`` if
        it holds fewer."""
        level = self.level(now)
        return None if level < n else Bucket(self.rate, self.burst, level - n, now)

    def settled(self, now: float) -> "Bucket":
        """The same bucket, counted up to ``now``."""
        return self if self.at == now else Bucket(self.rate, self.burst, self.level(now), now)


@attrs.frozen
class TenantState:
    """A tenant's quota, usage and write-bandwidth bucket."""

    quota: Quota
    bucket: Bucket
    held: int = 0
    in_flight: int = 0


@attrs.frozen
class NamespaceState:
    owner: str
    phase: Phase
    previous: Optional[Hashable] = None   # the namespace this one upgrades
    grants: frozenset = frozenset()       # tenants that may read it
    kept: frozenset = frozenset()         # keys held for inspection (phase HELD)


class Status(str, enum.Enum):
    PENDING = "pending"
    PUBLISHED = "published"


@attrs.frozen
class ObjectState:
    owner: str
    size: int
    status: Status


class ReadPhase(str, enum.Enum):
    GRANTED = "granted"      # the master granted a lease (and a ticket)
    SERVED = "served"        # a storage node served the bytes


@attrs.frozen
class ReadState:
    """A read in progress. ``src`` is the namespace of the object found (the
    read's own, ``ns``); ``authorized`` records that the read was allowed when
    it started (a ghost: it is always true here); ``cut`` is when the reader's
    grant on ``ns`` was revoked, if it was."""

    tenant: str
    ns: Hashable
    key: Hashable
    src: Hashable
    size: int
    expires: float
    phase: ReadPhase = ReadPhase.GRANTED
    authorized: bool = True
    cut: Optional[float] = None


@attrs.frozen(cache_hash=True)
class Tenancy:
    """The master's tenancy state (``now``, ``dir``, ``phase``, ``grants``,
    ``tokens`` and ``read`` of the spec). ``used`` and each tenant's ``held``
    and ``in_flight`` are sums kept up to date; ``readers`` indexes the holders
    of reads per object."""

    ttl: float
    capacity: int
    now: float = 0
    tenants: immutables.Map = immutables.Map()      # name -> TenantState
    namespaces: immutables.Map = immutables.Map()   # name -> NamespaceState
    objects: immutables.Map = immutables.Map()      # (ns, key) -> ObjectState
    reads: immutables.Map = immutables.Map()        # holder -> ReadState
    readers: immutables.Map = immutables.Map()      # (ns, key) -> frozenset of holders
    used: int = 0


def new_tenancy(ttl: float, capacity: int) -> Tenancy:
    if ttl <= 0 or capacity < 0:
        raise ValueError("ttl must be positive and capacity not negative")
    return Tenancy(ttl=ttl, capacity=capacity)


# --------------------------------------------------------------------------
# Events (named after the spec's actions; set-up events are outside the spec)
# --------------------------------------------------------------------------


@attrs.frozen
class AddTenant:
    """Set-up (the spec's ``Init``): a tenant with its quota, bucket full."""
    tenant: str
    quota: Quota


@attrs.frozen
class AddNamespace:
    """Set-up (the spec's ``Init``): a live namespace with no predecessor."""
    tenant: str
    ns: Hashable


@attrs.frozen
class AddObject:
    """Set-up (the spec's ``Init`` of a store a new master recovered): a
    published object of ``ns``, owned by the namespace's owner, ``size``
    bytes held. Within the owner's stored-bytes quota only."""
    ns: Hashable
    key: Hashable
    size: int


@attrs.frozen
class Tick:
    now: float


@attrs.frozen
class GrantRead:
    owner: str
    ns: Hashable
    grantee: str


@attrs.frozen
class RevokeRead:
    owner: str
    ns: Hashable
    grantee: str


@attrs.frozen
class Begin:
    holder: Hashable
    tenant: str
    ns: Hashable
    key: Hashable


@attrs.frozen
class Fetch:
    """A storage node is asked by ``tenant`` for the bytes at ``(ns, key)``
    under the ticket of read ``holder``."""
    holder: Hashable
    tenant: str
    ns: Hashable
    key: Hashable


@attrs.frozen
class Renew:
    holder: Hashable


@attrs.frozen
class Release:
    """The read ends: released by its reader, or its lease expired."""
    holder: Hashable


@attrs.frozen
class WriteStart:
    tenant: str
    ns: Hashable
    key: Hashable
    size: int = 1


@attrs.frozen
class WriteEnd:
    ns: Hashable
    key: Hashable


@attrs.frozen
class WriteAbort:
    ns: Hashable
    key: Hashable


@attrs.frozen
class Remove:
    tenant: str
    ns: Hashable
    key: Hashable


@attrs.frozen
class Evict:
    """Evict ``(ns, key)`` to make room for ``size`` bytes of ``tenant``'s write."""
    tenant: str
    ns: Hashable
    key: Hashable
    size: int = 1


@attrs.frozen
class AgeOut:
    ns: Hashable
    key: Hashable


@attrs.frozen
class Create:
    tenant: str
    ns: Hashable
    previous: Hashable


@attrs.frozen
class PreWarm:
    tenant: str
    ns: Hashable


@attrs.frozen
class Switch:
    tenant: str
    ns: Hashable


@attrs.frozen
class RouteBack:
    tenant: str
    ns: Hashable


@attrs.frozen
class Drop:
    tenant: str
    ns: Hashable


Event = Union[AddTenant, AddNamespace, AddObject, Tick, GrantRead, RevokeRead, Begin, Fetch, Renew,
              Release, WriteStart, WriteEnd, WriteAbort, Remove, Evict, AgeOut, Create,
              PreWarm, Switch, RouteBack, Drop]

# --------------------------------------------------------------------------
# Effects
# --------------------------------------------------------------------------


@attrs.frozen
class ReadGranted:
    """The reply to a read: where the object is, its size and the lease."""
    holder: Hashable
    src: Hashable
    key: Hashable
    size: int
    expires: float
    ttl: float


@attrs.frozen
class Freed:
    """An object left the store (removed, evicted, aged out, or a write abandoned)."""
    ns: Hashable
    key: Hashable
    owner: str
    size: int
    why: str            # "removed" | "evicted" | "aged-out" | "abandoned"


@attrs.frozen
class Done:
    """The event was applied; nothing else to report."""


_DONE = (Done(),)

# --------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------


def settle(table: Tenancy) -> Tenancy:
    """The same state with every bucket counted up to ``now`` (nothing a step
    can observe changes)."""
    stale = [(n, t) for n, t in table.tenants.items() if t.bucket.at != table.now]
    if not stale:
        return table
    with table.tenants.mutate() as tenants:
        for name, t in stale:
            tenants[name] = attrs.evolve(t, bucket=t.bucket.settled(table.now))
        return attrs.evolve(table, tenants=tenants.finish())


def may_read(table: Tenancy, tenant: str, ns: Hashable) -> bool:
    """Spec ``CanRead``: ``tenant`` owns ``ns`` or holds a read grant on it."""
    rec = table.namespaces.get(ns)
    return rec is not None and (rec.owner == tenant or tenant in rec.grants)


def lookup(table: Tenancy, ns: Hashable, key: Hashable) -> Optional[Hashable]:
    """Spec ``Lookup``: the namespace of the object a read of ``key`` in ``ns``
    finds: ``ns`` itself when it holds that key published, else nothing."""
    obj = table.objects.get((ns, key))
    return ns if obj is not None and obj.status is Status.PUBLISHED else None


def is_leased(table: Tenancy, ns: Hashable, key: Hashable) -> bool:
    """Spec ``Leased``: some read of the object holds an unexpired lease."""
    return any(table.reads[h].expires > table.now for h in table.readers.get((ns, key), ()))


def admit_write(table: Tenancy, tenant: str, size: int) -> Optional[errors.KvError]:
    """Spec ``AdmitWrite``: why ``size`` more bytes of ``tenant``'s writes
    would break a quota, or ``None``. Checked before allocating."""
    t = table.tenants[tenant]
    q = t.quota
    if t.held + size > q.stored:
        return errors.QuotaExceeded(
            f"tenant {tenant!r} holds {t.held} of its {q.stored} bytes; {size} more do not fit")
    if t.bucket.level(table.now) < size:
        return errors.QuotaExceeded(
            f"tenant {tenant!r} is over its write bandwidth ({q.write_rate:g} bytes per second, "
            f"bursts of {q.write_burst:g})")
    if t.in_flight + size > q.in_flight:
        return errors.QuotaExceeded(
            f"tenant {tenant!r} has {t.in_flight} of its {q.in_flight} bytes in flight")
    return None


def fair_eviction(table: Tenancy, tenant: str, victim: str) -> bool:
    """Spec ``FairEviction``: a write of ``tenant`` may evict bytes of
    ``victim``: its own, or another's only while ``tenant`` holds less than its
    reserve and ``victim`` more than its own."""
    if tenant == victim:
        return True
    t, v = table.tenants[tenant], table.tenants[victim]
    return t.held < t.quota.reserve and v.held > v.quota.reserve


def node_admits(table: Tenancy, holder: Hashable, tenant: str, ns: Hashable,
                key: Hashable) -> bool:
    """Spec ``NodeAdmits``: a storage node serves the bytes at ``(ns, key)``
    only to the tenant whose granted, unexpired read names that location."""
    read = table.reads.get(holder)
    return (read is not None and read.tenant == tenant and read.phase is ReadPhase.GRANTED
            and read.src == ns and read.key == key and table.now < read.expires)


def eviction_victims(table: Tenancy, tenant: str, size: int,
                     order: Optional[Sequence[tuple[Hashable, Hashable]]] = None
                     ) -> list[tuple[Hashable, Hashable]]:
    """Objects whose eviction, one after another, makes room for ``size``
    bytes of ``tenant``'s write, each allowed by :func:`fair_eviction` at its
    turn; empty if no such set exists. Candidates are taken in ``order``
    (e.g. least recently used first; default: the table's order), the
    tenant's own objects before anyone else's. Unleased, published objects of
    namespaces not held for inspection only."""
    need = size - (table.capacity - table.used)
    if need <= 0:
        return []
    order = list(table.objects.keys()) if order is None else order
    held = {name: t.held for name, t in table.tenants.items()}
    own = [o for o in order if table.objects.get(o) is not None
           and table.objects[o].owner == tenant]
    others = [o for o in order if table.objects.get(o) is not None
              and table.objects[o].owner != tenant]
    victims, freed = [], 0
    for o in own + others:
        obj = table.objects[o]
        if (obj.status is not Status.PUBLISHED or is_leased(table, *o)
                or table.namespaces[o[0]].phase is Phase.HELD):
            continue
        if obj.owner != tenant:
            reserve = table.tenants
            if not (held[tenant] < reserve[tenant].quota.reserve
                    and held[obj.owner] > reserve[obj.owner].quota.reserve):
                continue
        victims.append(o)
        held[obj.owner] -= obj.size
        freed += obj.size
        if freed >= need:
            return victims
    return []


# --------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------


def _tenant(table: Tenancy, name: str) -> Optional[TenantState]:
    return table.tenants.get(name)


def _owned(table: Tenancy, tenant: str, ns: Hashable):
    """The namespace record if ``tenant`` owns ``ns``, else the refusal's error."""
    rec = table.namespaces.get(ns)
    if rec is None:
        return None, errors.UnknownNamespace(f"no namespace {ns!r}")
    if rec.owner != tenant:
        return None, errors.AccessDenied(f"tenant {tenant!r} does not own namespace {ns!r}")
    return rec, None


def _set_tenant(table: Tenancy, name: str, **changes) -> Tenancy:
    return attrs.evolve(table, tenants=table.tenants.set(
        name, attrs.evolve(table.tenants[name], **changes)))


def _set_ns(table: Tenancy, ns: Hashable, **changes) -> Tenancy:
    return attrs.evolve(table, namespaces=table.namespaces.set(
        ns, attrs.evolve(table.namespaces[ns], **changes)))


def _set_cut(table: Tenancy, grantee: str, ns: Hashable, cut: Optional[float]) -> Tenancy:
    hit = [h for h, r in table.reads.items() if r.tenant == grantee and r.ns == ns]
    if not hit:
        return table
    with table.reads.mutate() as reads:
        for h in hit:
            reads[h] = attrs.evolve(reads[h], cut=cut)
        return attrs.evolve(table, reads=reads.finish())


def add_tenant(table: Tenancy, ev: AddTenant):
    q = ev.quota
    if ev.tenant in table.tenants:
        return _refuse(table, errors.InvalidArgument(f"tenant {ev.tenant!r} exists"))
    if min(q.stored, q.write_rate, q.write_burst, q.in_flight, q.reserve) < 0:
        return _refuse(table, errors.InvalidArgument("quotas must not be negative"))
    state = TenantState(q, Bucket(q.write_rate, q.write_burst, q.write_burst, table.now))
    return attrs.evolve(table, tenants=table.tenants.set(ev.tenant, state)), _DONE


def add_namespace(table: Tenancy, ev: AddNamespace):
    if ev.tenant not in table.tenants:
        return _refuse(table, errors.Unauthorized(f"no tenant {ev.tenant!r}"))
    if ev.ns in table.namespaces:
        return _refuse(table, errors.InvalidArgument(f"namespace {ev.ns!r} exists"))
    rec = NamespaceState(ev.tenant, Phase.LIVE)
    return attrs.evolve(table, namespaces=table.namespaces.set(ev.ns, rec)), _DONE


def add_object(table: Tenancy, ev: AddObject):
    rec = table.namespaces.get(ev.ns)
    if rec is None:
        return _refuse(table, errors.UnknownNamespace(f"no namespace {ev.ns!r}"))
    if (ev.ns, ev.key) in table.objects:
        return _refuse(table, errors.KeyExists(f"{ev.key!r} in namespace {ev.ns!r}"))
    if ev.size <= 0:
        return _refuse(table, errors.InvalidArgument("object size must be positive"))
    t = table.tenants[rec.owner]
    if t.held + ev.size > t.quota.stored:
        return _refuse(table, errors.QuotaExceeded(
            f"tenant {rec.owner!r} holds {t.held} of its {t.quota.stored} bytes; "
            f"{ev.size} more do not fit"))
    if table.used + ev.size > table.capacity:
        return _refuse(table, errors.NoSpace(f"{table.capacity - table.used} bytes free, "
                                             f"{ev.size} needed"))
    table = attrs.evolve(table, objects=table.objects.set(
        (ev.ns, ev.key), ObjectState(rec.owner, ev.size, Status.PUBLISHED)),
        used=table.used + ev.size)
    return _set_tenant(table, rec.owner, held=t.held + ev.size), _DONE


def tick(table: Tenancy, ev: Tick):
    """Spec ``Tick``: time only goes forward; buckets refill lazily."""
    if ev.now < table.now:
        return _refuse(table, errors.InvalidArgument(
            f"clock went back from {table.now} to {ev.now}"))
    if ev.now == table.now:
        return table, ()
    return attrs.evolve(table, now=ev.now), _DONE


def grant_read(table: Tenancy, ev: GrantRead):
    """Spec ``GrantRead``: the owner lets another tenant read the namespace."""
    rec, err = _owned(table, ev.owner, ev.ns)
    if err is not None:
        return _refuse(table, err)
    if ev.grantee not in table.tenants or ev.grantee == ev.owner:
        return _refuse(table, errors.InvalidArgument(f"cannot grant to {ev.grantee!r}"))
    if ev.grantee in rec.grants:
        return _refuse(table, errors.InvalidArgument(f"{ev.grantee!r} already holds a grant"))
    table = _set_ns(table, ev.ns, grants=rec.grants | {ev.grantee})
    return _set_cut(table, ev.grantee, ev.ns, None), _DONE


def revoke_read(table: Tenancy, ev: RevokeRead):
    """Spec ``RevokeRead``: new reads end now; reads in progress keep their
    leases (which can no longer be renewed) and record the revocation."""
    rec, err = _owned(table, ev.owner, ev.ns)
    if err is not None:
        return _refuse(table, err)
    if ev.grantee not in rec.grants:
        return _refuse(table, errors.InvalidArgument(f"{ev.grantee!r} holds no grant on {ev.ns!r}"))
    table = _set_ns(table, ev.ns, grants=rec.grants - {ev.grantee})
    return _set_cut(table, ev.grantee, ev.ns, table.now), _DONE


def begin(table: Tenancy, ev: Begin):
    """Spec ``Begin``: the grant is checked, then the object looked up in the
    read's own namespace, then the in-flight quota."""
    t = _tenant(table, ev.tenant)
    if t is None:
        return _refuse(table, errors.Unauthorized(f"no tenant {ev.tenant!r}"))
    if ev.holder in table.reads:
        return _refuse(table, errors.LeaseHeld(f"{ev.holder!r} already holds a read"))
    if ev.ns not in table.namespaces:
        return _refuse(table, errors.UnknownNamespace(f"no namespace {ev.ns!r}"))
    if not may_read(table, ev.tenant, ev.ns):
        return _refuse(table, errors.AccessDenied(
            f"tenant {ev.tenant!r} holds no grant on namespace {ev.ns!r}"))
    src = lookup(table, ev.ns, ev.key)
    if src is None:
        return _refuse(table, errors.KeyNotFound(f"{ev.key!r} in namespace {ev.ns!r}"))
    size = table.objects[(src, ev.key)].size
    if t.in_flight + size > t.quota.in_flight:
        return _refuse(table, errors.QuotaExceeded(
            f"tenant {ev.tenant!r} has {t.in_flight} of its {t.quota.in_flight} bytes in flight"))
    read = ReadState(ev.tenant, ev.ns, ev.key, src, size, table.now + table.ttl,
                     authorized=may_read(table, ev.tenant, ev.ns))
    o = (src, ev.key)
    table = attrs.evolve(table, reads=table.reads.set(ev.holder, read),
                         readers=table.readers.set(o, table.readers.get(o, frozenset()) | {ev.holder}))
    table = _set_tenant(table, ev.tenant, in_flight=t.in_flight + size)
    return table, (ReadGranted(ev.holder, src, ev.key, size, read.expires, table.ttl),)


def fetch(table: Tenancy, ev: Fetch):
    """Spec ``Fetch``: the storage node's check (:func:`node_admits`)."""
    if not node_admits(table, ev.holder, ev.tenant, ev.ns, ev.key):
        return _refuse(table, errors.AccessDenied(
            f"no unexpired read of {ev.key!r} in {ev.ns!r} for tenant {ev.tenant!r}"))
    read = table.reads[ev.holder]
    return attrs.evolve(table, reads=table.reads.set(
        ev.holder, attrs.evolve(read, phase=ReadPhase.SERVED))), _DONE


def renew(table: Tenancy, ev: Renew):
    """Spec ``Renew``: an unexpired lease of a read not yet served, whose
    tenant may still read the namespace, runs to ``now + ttl``."""
    read = table.reads.get(ev.holder)
    if read is None or read.phase is not ReadPhase.GRANTED or read.expires <= table.now:
        return _refuse(table, errors.LeaseExpired(f"{ev.holder!r} holds no unexpired read"))
    if not may_read(table, read.tenant, read.ns):
        return _refuse(table, errors.AccessDenied(
            f"tenant {read.tenant!r}'s grant on namespace {read.ns!r} was revoked"))
    return attrs.evolve(table, reads=table.reads.set(
        ev.holder, attrs.evolve(read, expires=table.now + table.ttl))), _DONE


def release(table: Tenancy, ev: Release):
    """Spec ``Release``: the read's bytes are no longer in flight."""
    read = table.reads.get(ev.holder)
    if read is None:
        return _refuse(table, errors.LeaseExpired(f"{ev.holder!r} holds no read"))
    o = (read.src, read.key)
    holders = table.readers[o] - {ev.holder}
    table = attrs.evolve(table, reads=table.reads.delete(ev.holder),
                         readers=table.readers.set(o, holders) if holders
                         else table.readers.delete(o))
    t = table.tenants[read.tenant]
    return _set_tenant(table, read.tenant, in_flight=t.in_flight - read.size), _DONE


def write_start(table: Tenancy, ev: WriteStart):
    """Spec ``WriteStart``: the owner writes into a writable namespace, within
    its quotas (checked before the allocation) and the memory."""
    if ev.tenant not in table.tenants:
        return _refuse(table, errors.Unauthorized(f"no tenant {ev.tenant!r}"))
    rec, err = _owned(table, ev.tenant, ev.ns)
    if err is not None:
        return _refuse(table, err)
    if rec.phase not in WRITABLE:
        return _refuse(table, errors.NamespaceClosed(
            f"namespace {ev.ns!r} is {rec.phase.value}: it takes no writes"))
    if (ev.ns, ev.key) in table.objects:
        return _refuse(table, errors.KeyExists(f"{ev.key!r} in namespace {ev.ns!r}"))
    if ev.size <= 0:
        return _refuse(table, errors.InvalidArgument("object size must be positive"))
    err = admit_write(table, ev.tenant, ev.size)
    if err is not None:
        return _refuse(table, err)
    if table.used + ev.size > table.capacity:
        return _refuse(table, errors.NoSpace(
            f"{table.capacity - table.used} bytes free, {ev.size} needed: evict first"))
    t = table.tenants[ev.tenant]
    table = attrs.evolve(table, objects=table.objects.set(
        (ev.ns, ev.key), ObjectState(ev.tenant, ev.size, Status.PENDING)),
        used=table.used + ev.size)
    table = _set_tenant(table, ev.tenant, held=t.held + ev.size, in_flight=t.in_flight + ev.size,
                        bucket=t.bucket.take(table.now, ev.size))
    return table, _DONE


def _pending(table: Tenancy, ns: Hashable, key: Hashable) -> Optional[ObjectState]:
    obj = table.objects.get((ns, key))
    return obj if obj is not None and obj.status is Status.PENDING else None


def write_end(table: Tenancy, ev: WriteEnd):
    """Spec ``WriteEnd``: the write is published; no longer in flight."""
    obj = _pending(table, ev.ns, ev.key)
    if obj is None:
        return _refuse(table, errors.StaleToken(f"no write of {ev.key!r} in {ev.ns!r} in progress"))
    table = attrs.evolve(table, objects=table.objects.set(
        (ev.ns, ev.key), attrs.evolve(obj, status=Status.PUBLISHED)))
    t = table.tenants[obj.owner]
    return _set_tenant(table, obj.owner, in_flight=t.in_flight - obj.size), _DONE


def _drop_object(table: Tenancy, ns: Hashable, key: Hashable, why: str):
    obj = table.objects[(ns, key)]
    table = attrs.evolve(table, objects=table.objects.delete((ns, key)),
                         used=table.used - obj.size)
    t = table.tenants[obj.owner]
    in_flight = t.in_flight - (obj.size if obj.status is Status.PENDING else 0)
    table = _set_tenant(table, obj.owner, held=t.held - obj.size, in_flight=in_flight)
    return table, (Freed(ns, key, obj.owner, obj.size, why),)


def write_abort(table: Tenancy, ev: WriteAbort):
    """Spec ``WriteAbort``: an abandoned write's allocation is freed."""
    if _pending(table, ev.ns, ev.key) is None:
        return _refuse(table, errors.StaleToken(f"no write of {ev.key!r} in {ev.ns!r} in progress"))
    return _drop_object(table, ev.ns, ev.key, "abandoned")


def _reclaimable(table: Tenancy, ns: Hashable, key: Hashable) -> Optional[errors.KvError]:
    obj = table.objects.get((ns, key))
    if obj is None:
        return errors.KeyNotFound(f"{key!r} in namespace {ns!r}")
    if obj.status is not Status.PUBLISHED:
        return errors.NotPublished(f"{key!r} in namespace {ns!r} is being written")
    if table.namespaces[ns].phase is Phase.HELD:
        return errors.NamespaceClosed(f"namespace {ns!r} is held for inspection")
    if is_leased(table, ns, key):
        return errors.ObjectLeased(f"{key!r} in namespace {ns!r} is being read")
    return None


def remove(table: Tenancy, ev: Remove):
    """Spec ``Remove``: the owner removes an unleased object."""
    _, err = _owned(table, ev.tenant, ev.ns)
    err = err or _reclaimable(table, ev.ns, ev.key)
    if err is not None:
        return _refuse(table, err)
    return _drop_object(table, ev.ns, ev.key, "removed")


def evict(table: Tenancy, ev: Evict):
    """Spec ``Evict``: only under memory pressure, for a write the quotas
    admit, and only as :func:`fair_eviction` allows."""
    if ev.tenant not in table.tenants:
        return _refuse(table, errors.Unauthorized(f"no tenant {ev.tenant!r}"))
    if table.capacity - table.used >= ev.size:
        return _refuse(table, errors.InvalidArgument("memory has room: nothing to evict"))
    err = admit_write(table, ev.tenant, ev.size) or _reclaimable(table, ev.ns, ev.key)
    if err is not None:
        return _refuse(table, err)
    victim = table.objects[(ev.ns, ev.key)].owner
    if not fair_eviction(table, ev.tenant, victim):
        return _refuse(table, errors.AccessDenied(
            f"a write of {ev.tenant!r} may not evict {victim!r}'s bytes"))
    return _drop_object(table, ev.ns, ev.key, "evicted")


def age_out(table: Tenancy, ev: AgeOut):
    """Spec ``AgeOut``: an unleased object of a retiring namespace goes."""
    rec = table.namespaces.get(ev.ns)
    if rec is None or rec.phase is not Phase.RETIRING:
        return _refuse(table, errors.InvalidArgument(f"namespace {ev.ns!r} is not retiring"))
    err = _reclaimable(table, ev.ns, ev.key)
    if err is not None:
        return _refuse(table, err)
    return _drop_object(table, ev.ns, ev.key, "aged-out")


def _successor_in_progress(table: Tenancy, previous: Hashable) -> bool:
    return any(r.previous == previous and r.phase in (Phase.CANARY, Phase.WARMING)
               for r in table.namespaces.values())


def create(table: Tenancy, ev: Create):
    """Spec ``Create``: a canary next to the tenant's live namespace."""
    if ev.ns in table.namespaces:
        return _refuse(table, errors.InvalidArgument(f"namespace {ev.ns!r} exists"))
    prev, err = _owned(table, ev.tenant, ev.previous)
    if err is not None:
        return _refuse(table, err)
    if prev.phase is not Phase.LIVE or _successor_in_progress(table, ev.previous):
        return _refuse(table, errors.InvalidArgument(
            f"namespace {ev.previous!r} is not live or is already being upgraded"))
    rec = NamespaceState(ev.tenant, Phase.CANARY, previous=ev.previous)
    return attrs.evolve(table, namespaces=table.namespaces.set(ev.ns, rec)), _DONE


def _lifecycle(table: Tenancy, tenant: str, ns: Hashable, allowed: Callable[[NamespaceState,
               Optional[NamespaceState]], bool], what: str):
    rec, err = _owned(table, tenant, ns)
    if err is not None:
        return None, None, err
    prev = table.namespaces.get(rec.previous) if rec.previous is not None else None
    if not allowed(rec, prev):
        return None, None, errors.InvalidArgument(
            f"namespace {ns!r} is {rec.phase.value}: cannot {what}")
    return rec, prev, None


def pre_warm(table: Tenancy, ev: PreWarm):
    """Spec ``PreWarm``: the canary is healthy; hot prefixes go in."""
    _, _, err = _lifecycle(table, ev.tenant, ev.ns, lambda r, p: r.phase is Phase.CANARY,
                           "pre-warm")
    if err is not None:
        return _refuse(table, err)
    return _set_ns(table, ev.ns, phase=Phase.WARMING), _DONE


def switch(table: Tenancy, ev: Switch):
    """Spec ``Switch``: the namespace goes live; its predecessor retires."""
    rec, _, err = _lifecycle(
        table, ev.tenant, ev.ns,
        lambda r, p: r.phase is Phase.WARMING and p is not None and p.phase is Phase.LIVE,
        "switch")
    if err is not None:
        return _refuse(table, err)
    table = _set_ns(table, ev.ns, phase=Phase.LIVE)
    return _set_ns(table, rec.previous, phase=Phase.RETIRING), _DONE


def _may_route_back(r: NamespaceState, p: Optional[NamespaceState]) -> bool:
    if p is None:
        return False
    return ((r.phase in (Phase.CANARY, Phase.WARMING) and p.phase is Phase.LIVE)
            or (r.phase is Phase.LIVE and p.phase is Phase.RETIRING))


def route_back(table: Tenancy, ev: RouteBack):
    """Spec ``RouteBack``: the predecessor is live again; this namespace is
    held: writes in progress are abandoned, published objects kept."""
    rec, _, err = _lifecycle(table, ev.tenant, ev.ns, _may_route_back, "route back")
    if err is not None:
        return _refuse(table, err)
    effects = []
    for (ns, key), obj in list(table.objects.items()):
        if ns == ev.ns and obj.status is Status.PENDING:
            table, freed = _drop_object(table, ns, key, "abandoned")
            effects += freed
    kept = frozenset(k for (ns, k) in table.objects if ns == ev.ns)
    table = _set_ns(table, ev.ns, phase=Phase.HELD, kept=kept)
    return _set_ns(table, rec.previous, phase=Phase.LIVE), tuple(effects) or _DONE


def drop(table: Tenancy, ev: Drop):
    """Spec ``Drop``: inspection is over; the held namespace retires."""
    _, _, err = _lifecycle(table, ev.tenant, ev.ns, lambda r, p: r.phase is Phase.HELD, "drop")
    if err is not None:
        return _refuse(table, err)
    return _set_ns(table, ev.ns, phase=Phase.RETIRING, kept=frozenset()), _DONE


_HANDLERS: dict[type, Callable] = {
    AddTenant: add_tenant, AddNamespace: add_namespace, AddObject: add_object, Tick: tick, GrantRead: grant_read,
    RevokeRead: revoke_read, Begin: begin, Fetch: fetch, Renew: renew, Release: release,
    WriteStart: write_start, WriteEnd: write_end, WriteAbort: write_abort, Remove: remove,
    Evict: evict, AgeOut: age_out, Create: create, PreWarm: pre_warm, Switch: switch,
    RouteBack: route_back, Drop: drop,
}


def step(table: Tenancy, event: Event) -> tuple[Tenancy, tuple]:
    """Apply one event to the tenancy state."""
    return _HANDLERS[type(event)](table, event)
