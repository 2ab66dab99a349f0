"""Read leases (``spec/Lease.tla``) as pure, sans-IO state machines and functions.

The rule: a read lease is time-bounded protection of one object's bytes for one
reader. While any lease on an object is unexpired by the master's clock, neither
Remove nor eviction may reclaim its space. Ending protection (release or expiry)
is not deletion: the object stays cached. And a transfer that succeeded is not
usable data: unless the reader is sure its lease was still valid when the
transfer completed, the space may already have been reclaimed and rewritten, and
the bytes must be rejected.

Two sides take part:

* the master's :class:`LeaseTable` (cached objects and the leases on them, on the
  master's clock), stepped by :func:`master_step`. Time is an input: a
  :class:`Tick` says what the master's clock reads and expires the leases it
  reached. ``Remove`` and ``Evict`` of a leased object are refused with
  :class:`~kvproto.errors.ObjectLeased`;
* the reader, which needs no state machine of its own: it keeps the local time at
  which it *sent* its request (or its last renewal) and, when the transfer
  completes, asks :func:`accept_transfer` whether to keep the bytes.

Around them, pure helpers for the runtime and for operators:
:func:`recommend_ttl` sizes a lease from measured phase latencies and the clock
bound; :func:`classify_rejection` says why a rejected read missed its deadline
("lease-too-short", "network-slow", "queued-too-long");
:func:`renewals_needed` prices renewing; :func:`usable_slices` applies the check
to an object read in slices; :func:`plan_eviction` and
:func:`eviction_candidates` are the watermark eviction policy (least recently
used among unleased objects).

:class:`System` composes the table with readers into the closed system the spec
describes; its actions (:data:`ACTIONS`) carry the spec's action names and are
what the conformance test and the Hypothesis stateful test drive. Invariants
carry the spec's invariant names (:data:`INVARIANTS`).

Every step is ``(state, event) -> (state, effects)``. A refused event returns the
state unchanged (the same object) and one :class:`Refused` effect carrying a
typed error from :mod:`kvproto.errors`. Objects and leases live in persistent
hash maps, so a step costs O(log32 n); a :class:`Tick` that reaches the earliest
expiry walks the leases once.

Pure: no I/O, no clocks, no randomness.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Callable, Optional, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit, memoised_step
from kvproto.statemachines.maps import map_of
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse
from kvproto.checking.tla import Fn, ModelValue, model_names

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


@attrs.frozen
class CachedObject:
    """A cached (published) object: the region holding its bytes and its size.
    ``inherited``: this master found it when it took over (spec ``inherited``),
    so a lease of the old master may cover it until ``quiet_until``."""

    region: str
    size: int = 1
    inherited: bool = False


@attrs.frozen
class Lease:
    """One reader's lease (``lease[r]`` in the spec): unexpired while ``now < expires``."""

    holder: str
    key: Hashable
    region: str
    expires: int


@attrs.frozen(cache_hash=True)
class LeaseTable:
    """The master's state: ``now``, ``dir`` and ``lease`` of the spec.

    ``by_key`` indexes the holders of each key's leases; ``earliest`` is a lower
    bound on the earliest expiry (a :class:`Tick` before it does no work) and
    ``last_used`` is the eviction policy's recency (master time of the last grant
    or renewal); both are caches, not protocol state, and are excluded from
    equality. No step's result depends on them as long as ``earliest`` is a
    lower bound (None only with no lease), which every step keeps
    (tests/stateful/test_caches.py).
    """

    ttl: int
    now: int = 0
    objects: immutables.Map = immutables.Map()    # key -> CachedObject
    regions: immutables.Map = immutables.Map()    # region -> key
    leases: immutables.Map = immutables.Map()     # holder -> Lease
    by_key: immutables.Map = immutables.Map()     # key -> Map(holder -> True)
    used: int = 0                                 # bytes held by cached objects
    quiet_until: int = 0                          # inherited objects count as leased before this
    earliest: Optional[int] = attrs.field(default=None, eq=False)
    last_used: immutables.Map = attrs.field(default=immutables.Map(), eq=False)


# --------------------------------------------------------------------------
# Events fed to the master (named after the spec's actions)
# --------------------------------------------------------------------------


@attrs.frozen
class Tick:
    """``Tick``: the master's clock reads ``now``; leases it reached expire."""

    now: int


@attrs.frozen
class Put:
    """``Put``: an object was published into ``region`` (spec/Publish.tla's PutEnd)."""

    key: Hashable
    region: str
    size: int = 1


@attrs.frozen
class Grant:
    """``Grant``: a read request of ``key`` by ``holder`` reached the master."""

    holder: str
    key: Hashable


@attrs.frozen
class Renew:
    """``Renew``: extend ``holder``'s lease to ``now + ttl``; refused once it expired."""

    holder: str


@attrs.frozen
class Release:
    """``Release``: ``holder`` is done; its lease ends (the object stays cached)."""

    holder: str


@attrs.frozen
class Remove:
    """``Remove``: a client deletes ``key``; refused under an unexpired lease."""

    key: Hashable


@attrs.frozen
class Evict:
    """``Evict``: the eviction policy reclaims ``key``; refused under an unexpired lease."""

    key: Hashable


@attrs.frozen
class Disown:
    """An operator's forced remove: ``key`` stops counting as leased by a
    previous master. Outside the spec, like the forced ``Release`` of other
    readers' leases that comes with it; it breaks their protection knowingly."""

    key: Hashable


MasterEvent = Union[Tick, Put, Grant, Renew, Release, Remove, Evict, Disown]

# --------------------------------------------------------------------------
# Effects
# --------------------------------------------------------------------------



@attrs.frozen
class Cached:
    key: Hashable
    region: str


@attrs.frozen
class LeaseGranted:
    """The reply to a read: where the bytes are and the lease's TTL. The reader
    measures the TTL from when it *sent* the request, never from this reply."""

    holder: str
    key: Hashable
    region: str
    expires: int      # master's clock; informational for the reader
    ttl: int


@attrs.frozen
class LeaseRenewed:
    holder: str
    key: Hashable
    expires: int


@attrs.frozen
class LeaseReleased:
    holder: str
    key: Hashable


@attrs.frozen
class LeaseEnded:
    """A lease expired on the master's clock (a :class:`Tick` reached it)."""

    holder: str
    key: Hashable


@attrs.frozen
class Reclaimed:
    """``key``'s region is free: the storage node may hand it to a new object."""

    key: Hashable
    region: str
    size: int
    evicted: bool


Effects = tuple

# --------------------------------------------------------------------------
# Master
# --------------------------------------------------------------------------


def new_table(ttl: int) -> LeaseTable:
    if ttl <= 0:
        raise ValueError("ttl must be positive")
    return LeaseTable(ttl=ttl)



def restored_table(ttl: int, now, objects: Iterable[tuple[Hashable, str, int]],
                   quiet=None) -> LeaseTable:
    """The table of a master that takes over (spec ``Takeover``; the runtime
    calls it after ``spec/Failover.tla``'s ``Recover``): every recovered
    ``(key, region, size)`` is cached and *inherited*, and no lease is known
    (the old master's leases are not carried over). Inherited objects count
    as leased until ``now + quiet`` (default ``ttl``: the old master granted
    nothing after it lost its term, so none of its leases outlives that); a
    runtime whose clocks may drift apart passes a margin on top."""
    cached, regions, used = {}, {}, 0
    for key, region, size in objects:
        if key in cached or region in regions or size <= 0:
            raise ValueError(f"recovered object {key!r} repeats a key or region, or is empty")
        cached[key] = CachedObject(region, size, True)
        regions[region] = key
        used += size
    return LeaseTable(ttl=ttl, now=now, objects=map_of(cached.items()),
                      regions=map_of(regions.items()), used=used,
                      quiet_until=now + (ttl if quiet is None else quiet),
                      last_used=map_of((key, now) for key in cached))


def inherited_quiet(table: LeaseTable) -> bool:
    """Whether objects this master inherited still count as leased."""
    return table.now < table.quiet_until


def is_inherited(table: LeaseTable, key: Hashable) -> bool:
    """Whether ``key`` counts as leased only because a previous master may
    have leased it (spec ``inherited``, before ``quietUntil``)."""
    obj = table.objects.get(key)
    return obj is not None and obj.inherited and table.now < table.quiet_until


def is_leased(table: LeaseTable, key: Hashable) -> bool:
    """Spec ``Leased(k)``: some lease on ``key`` is unexpired by the master's
    clock, or ``key`` was inherited at a takeover less than ``quiet`` ago."""
    holders = table.by_key.get(key)
    if not holders:
        if table.now < table.quiet_until:
            obj = table.objects.get(key)
            return obj is not None and obj.inherited
        return False
    return any(table.leases[h].expires > table.now for h in holders)


def _with_lease(table: LeaseTable, lease: Lease, **changes) -> LeaseTable:
    holders = table.by_key.get(lease.key, immutables.Map())
    earliest = lease.expires if table.earliest is None else min(table.earliest, lease.expires)
    return attrs.evolve(table, leases=table.leases.set(lease.holder, lease),
                        by_key=table.by_key.set(lease.key, holders.set(lease.holder, True)),
                        earliest=earliest,
                        last_used=table.last_used.set(lease.key, table.now), **changes)


def _without_leases(table: LeaseTable, dropped: Sequence[Lease]) -> LeaseTable:
    with table.leases.mutate() as leases, table.by_key.mutate() as by_key:
        for lease in dropped:
            del leases[lease.holder]
            holders = by_key[lease.key].delete(lease.holder)
            if holders:
                by_key[lease.key] = holders
            else:
                del by_key[lease.key]
        return attrs.evolve(table, leases=leases.finish(), by_key=by_key.finish())


def tick(table: LeaseTable, ev: Tick):
    """Spec ``Tick``: the clock never goes back; leases with ``expires <= now`` end."""
    if ev.now < table.now:
        return _refuse(table, errors.InvalidArgument(
            f"master clock went back from {table.now} to {ev.now}"))
    if ev.now == table.now:
        return table, ()
    table = attrs.evolve(table, now=ev.now)
    if table.earliest is None or table.earliest > ev.now:
        return table, ()
    ended = [l for l in table.leases.values() if l.expires <= ev.now]
    table = _without_leases(table, ended)
    earliest = min((l.expires for l in table.leases.values()), default=None)
    return (attrs.evolve(table, earliest=earliest),
            tuple(LeaseEnded(l.holder, l.key) for l in ended))


def put(table: LeaseTable, ev: Put):
    """Spec ``Put``: the key is not cached and the region is free."""
    if ev.key in table.objects:
        return _refuse(table, errors.KeyExists(f"{ev.key!r} is cached"))
    if ev.region in table.regions:
        return _refuse(table, errors.NoSpace(f"region {ev.region!r} holds another object"))
    if ev.size <= 0:
        return _refuse(table, errors.InvalidArgument("object size must be positive"))
    return (attrs.evolve(table, objects=table.objects.set(ev.key, CachedObject(ev.region, ev.size)),
                         regions=table.regions.set(ev.region, ev.key), used=table.used + ev.size,
                         last_used=table.last_used.set(ev.key, table.now)),
            (Cached(ev.key, ev.region),))


def grant(table: LeaseTable, ev: Grant):
    """Spec ``Grant``: a lease on a cached object expiring at ``now + ttl``, or a miss."""
    if ev.holder in table.leases:
        return _refuse(table, errors.LeaseHeld(f"{ev.holder!r} already holds a lease"))
    obj = table.objects.get(ev.key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"{ev.key!r}"))
    lease = Lease(ev.holder, ev.key, obj.region, table.now + table.ttl)
    return (_with_lease(table, lease),
            (LeaseGranted(ev.holder, ev.key, obj.region, lease.expires, table.ttl),))


def renew(table: LeaseTable, ev: Renew):
    """Spec ``Renew``: only an unexpired lease is extended (to ``now + ttl``)."""
    lease = table.leases.get(ev.holder)
    if lease is None or lease.expires <= table.now:
        return _refuse(table, errors.LeaseExpired(f"{ev.holder!r} holds no unexpired lease"))
    lease = attrs.evolve(lease, expires=table.now + table.ttl)
    return _with_lease(table, lease), (LeaseRenewed(ev.holder, lease.key, lease.expires),)


def release(table: LeaseTable, ev: Release):
    """Spec ``Release``: the lease ends; the object is not touched."""
    lease = table.leases.get(ev.holder)
    if lease is None:
        return _refuse(table, errors.LeaseExpired(f"{ev.holder!r} holds no lease"))
    return _without_leases(table, [lease]), (LeaseReleased(ev.holder, lease.key),)


def _reclaim(table: LeaseTable, key: Hashable, evicted: bool):
    obj = table.objects.get(key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"{key!r}"))
    if is_leased(table, key):
        if key not in table.by_key or not any(table.leases[h].expires > table.now
                                              for h in table.by_key[key]):
            return _refuse(table, errors.ObjectLeased(
                f"{key!r} may still be leased by the previous master "
                f"({table.quiet_until - table.now} more)"))
        return _refuse(table, errors.ObjectLeased(
            f"{key!r} has {len(table.by_key[key])} unexpired lease(s)"))
    new = attrs.evolve(table, objects=table.objects.delete(key),
                       regions=table.regions.delete(obj.region), used=table.used - obj.size,
                       last_used=table.last_used.delete(key) if key in table.last_used
                       else table.last_used)
    return new, (Reclaimed(key, obj.region, obj.size, evicted),)


def remove(table: LeaseTable, ev: Remove):
    """Spec ``Remove``: refused with ``ObjectLeased`` while ``Leased(k)``."""
    return _reclaim(table, ev.key, evicted=False)


def evict(table: LeaseTable, ev: Evict):
    """Spec ``Evict``: like ``Remove``; which object to evict is the policy's
    choice (:func:`plan_eviction`)."""
    return _reclaim(table, ev.key, evicted=True)


def disown(table: LeaseTable, ev: Disown):
    """See :class:`Disown`; a key not inherited is left as it is."""
    obj = table.objects.get(ev.key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"{ev.key!r}"))
    if not obj.inherited:
        return table, ()
    return attrs.evolve(table, objects=table.objects.set(ev.key, attrs.evolve(obj, inherited=False))), ()


_MASTER_HANDLERS: dict[type, Callable] = {
    Tick: tick, Put: put, Grant: grant, Renew: renew, Release: release,
    Remove: remove, Evict: evict, Disown: disown,
}


@memoised_step
def master_step(table: LeaseTable, event: MasterEvent) -> tuple[LeaseTable, Effects]:
    """Apply one event to the master's lease table."""
    return _MASTER_HANDLERS[type(event)](table, event)


# --------------------------------------------------------------------------
# Reader: the acceptance check
# --------------------------------------------------------------------------


def accept_transfer(sent_local: float, completed_local: float, ttl: float,
                    max_skew: float) -> bool:
    """Keep the bytes of a transfer only if it completed before the reader's
    conservative deadline (spec ``ReaderAccepts``).

    ``sent_local`` is the reader's clock when it *sent* the read request (or its
    last granted renewal), never when the reply arrived; ``completed_local`` is
    its clock when the last byte was read from the store. ``max_skew`` bounds
    how far the reader's measure of that interval may be off from the master's.
    Then ``completed_local - sent_local < ttl - max_skew`` implies that on the
    master's clock the transfer completed before ``grant + ttl``, the lease's
    expiry, since the grant came after the send: the space was still protected.
    """
    if max_skew < 0:
        raise ValueError("max_skew must be >= 0")
    return completed_local - sent_local < ttl - max_skew


def local_deadline(sent_local: float, ttl: float, max_skew: float) -> float:
    """The reader's local time by which the last byte must have been read."""
    return sent_local + ttl - max_skew


def usable_slices(sent_local: float, completions_local: Sequence[float], ttl: float,
                  max_skew: float) -> int:
    """An object read in slices under one lease: how many leading slices may be
    used. A slice whose transfer completed before the deadline was read under
    protection; one that completed after must be read again (under a new lease)
    or recomputed, and, as with any prefix of loaded chunks, slices after the
    first rejected one do not count (only a contiguous run from the start is
    usable)."""
    n = 0
    for done in completions_local:
        if not accept_transfer(sent_local, done, ttl, max_skew):
            break
        n += 1
    return n


# --------------------------------------------------------------------------
# Lease sizing, renewal cost and failure reasons
# --------------------------------------------------------------------------


def recommend_ttl(queue_p99: float, transfer_p99: float, verify_p99: float,
                  clock_bound: float, margin: float = 0.25) -> float:
    """A lease TTL under which a read whose phases stay within their p99s is
    always accepted, for every clock error within ``clock_bound``::

        ttl = (1 + margin) * (queue_p99 + transfer_p99 + verify_p99) + 2 * clock_bound

    ``queue_p99`` is everything from the reader's send to the start of the
    transfer (request on the wire, master queue, reply, storage queue);
    ``verify_p99`` is whatever must still read the store after the transfer (a
    region stamp re-read); ``clock_bound`` is the bound on the reader's error
    measuring one read (its clock resolution included). The clock bound counts
    twice: the acceptance check subtracts it (a slow reader clock must not accept
    late bytes), and a fast reader clock adds it to the measured time (which must
    still pass). ``margin > 0`` covers tails beyond the p99 sum.
    """
    phases = (queue_p99, transfer_p99, verify_p99)
    if min(phases) < 0 or clock_bound < 0:
        raise ValueError("latencies and the clock bound must be >= 0")
    if margin <= 0 or sum(phases) <= 0:
        raise ValueError("margin and the latency sum must be > 0")
    return (1 + margin) * sum(phases) + 2 * clock_bound


def renewals_needed(read_time: float, ttl: float, clock_bound: float, renew_rtt: float) -> int:
    """Renewals a reader must make to keep a read of ``read_time`` (local clock,
    send to last byte) acceptable, renewing every ``ttl - clock_bound - renew_rtt``
    (a renewal must reach the master before its lease expires, and restarts the
    deadline from when it was sent). Each costs one master round trip and one
    lease-table write."""
    window = ttl - clock_bound
    period = window - renew_rtt
    if period <= 0:
        raise ValueError("ttl must exceed clock_bound + renew_rtt for renewing to help")
    if read_time < window:
        return 0
    return math.floor((read_time - window) / period) + 1


class RejectReason(str, enum.Enum):
    LEASE_TOO_SHORT = "lease-too-short"   # every phase within budget: the TTL is too small
    NETWORK_SLOW = "network-slow"         # the transfer or verification overran
    QUEUED_TOO_LONG = "queued-too-long"   # the wait before the transfer overran


@attrs.frozen
class ReadPhases:
    """How long a read spent in each phase, on the reader's clock."""

    queued: float        # send -> transfer start (request, master queue, reply, storage queue)
    transferring: float  # transfer start -> last byte
    verifying: float     # post-transfer reads of the store

    @property
    def total(self) -> float:
        return self.queued + self.transferring + self.verifying


@attrs.frozen
class LeaseBudget:
    """The p99 latencies and clock bound a lease was sized for."""

    queue: float
    transfer: float
    verify: float
    clock_bound: float
    margin: float = 0.25

    @property
    def ttl(self) -> float:
        return recommend_ttl(self.queue, self.transfer, self.verify, self.clock_bound,
                             self.margin)


def classify_rejection(phases: ReadPhases, budget: LeaseBudget) -> RejectReason:
    """Why a rejected read missed its deadline: "lease too short", "network
    slow" and "queued too long" are recorded apart, so an operator can tell
    which budget to raise.

    The phase that overran its budget by the most time is blamed: the queue
    ("queued-too-long"), or the transfer or verification ("network-slow"); ties
    go to the earlier phase. A read whose phases all stayed within budget was
    rejected because the lease is too short for the budget ("lease-too-short").
    """
    overruns = (
        (phases.queued - budget.queue, RejectReason.QUEUED_TOO_LONG),
        (phases.transferring - budget.transfer, RejectReason.NETWORK_SLOW),
        (phases.verifying - budget.verify, RejectReason.NETWORK_SLOW),
    )
    worst, reason = overruns[0]
    for over, why in overruns[1:]:
        if over > worst:
            worst, reason = over, why
    return reason if worst > 0 else RejectReason.LEASE_TOO_SHORT


# --------------------------------------------------------------------------
# Eviction policy: watermark, least recently used among unleased objects
# --------------------------------------------------------------------------


@attrs.frozen
class EvictionPlan:
    keys: tuple            # to evict, in order
    target: float          # bytes the plan wanted to free (0: under the watermark)
    freed: int             # bytes the keys free

    @property
    def short(self) -> bool:
        """Not enough evictable objects to reach the target (all else is leased)."""
        return self.freed < self.target


def over_watermark(used: int, capacity: int, high_watermark: float = 0.90) -> bool:
    """Usage passed the high watermark."""
    if capacity <= 0:
        raise ValueError("capacity must be positive")
    return used > high_watermark * capacity


def plan_eviction(used: int, capacity: int, candidates: Iterable[tuple[Hashable, int]], *,
                  high_watermark: float = 0.90, free_fraction: float = 0.05) -> EvictionPlan:
    """Once ``used / capacity`` passes ``high_watermark``, take candidates in
    the order given until usage is down to ``high_watermark - free_fraction``
    (so at least ``free_fraction`` of capacity is freed when usage just crossed).

    ``candidates`` yields ``(key, size)`` of evictable objects (published and
    unleased), least recently used first: :func:`eviction_candidates` from the
    master's table, or the runtime's LRU order. It is consumed lazily, so the
    cost is O(k) in the candidates taken. Deterministic.
    """
    if not 0 <= free_fraction <= high_watermark <= 1:
        raise ValueError("need 0 <= free_fraction <= high_watermark <= 1")
    if not over_watermark(used, capacity, high_watermark):
        return EvictionPlan((), 0, 0)
    target = used - (high_watermark - free_fraction) * capacity
    keys, freed = [], 0
    source = iter(candidates)
    while freed < target:
        nxt = next(source, None)
        if nxt is None:
            break
        keys.append(nxt[0])
        freed += nxt[1]
    return EvictionPlan(tuple(keys), target, freed)


def eviction_candidates(table: LeaseTable) -> Iterator[tuple[Hashable, int]]:
    """Cached objects with no unexpired lease, least recently used (granted,
    renewed or cached) first, ties by key. O(n) to start, O(log n) per
    candidate taken."""
    heap = [(table.last_used.get(k, 0), k, obj.size)
            for k, obj in table.objects.items() if not is_leased(table, k)]
    heapq.heapify(heap)
    while heap:
        _, key, size = heapq.heappop(heap)
        yield key, size


# --------------------------------------------------------------------------
# The closed system of the spec: master + readers
# --------------------------------------------------------------------------


class Phase(str, enum.Enum):
    ASKED = "asked"                  # request sent, not yet handled by the master
    GRANTED = "granted"              # lease granted, reply on its way
    TRANSFERRING = "transferring"    # the reader has the reply; bytes are moving
    ACCEPTED = "accepted"            # transfer completed in time: bytes kept
    REJECTED = "rejected"            # transfer completed too late: bytes dropped


#: Phases in which the reader's slot is being read (a reclaim clobbers the read).
READING = (Phase.GRANTED, Phase.TRANSFERRING)


@attrs.frozen
class ReadState:
    """A reader's read in progress (``reader[r]``). ``base`` is the master's
    time when the reader sent its request (or last renewal); the reader's own
    clock is taken to read the same at that instant, and to be off by at most
    ``max_skew`` at completion. ``clobbered`` is a ghost: the region was
    reclaimed while being read."""

    phase: Phase
    key: Hashable
    base: int
    region: Optional[str] = None
    clobbered: bool = False


@attrs.frozen(cache_hash=True)
class System:
    table: LeaseTable
    slots: tuple                   # the storage regions, one object each
    readers: immutables.Map        # reader -> ReadState | None
    dropped: frozenset             # history: keys never put, or removed/evicted since put
    max_skew: int = 0
    takeovers: int = 0             # how many times a new master took over
    keys: frozenset = frozenset()  # the spec's Keys: every key a client may use

    @classmethod
    def initial(cls, keys: Sequence[Hashable], slots: Sequence[str], readers: Sequence[str],
                ttl: int, max_skew: int) -> "System":
        return cls(new_table(ttl), tuple(slots), immutables.Map({r: None for r in readers}),
                   frozenset(keys), max_skew, keys=frozenset(keys))

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def master(self, event) -> tuple["System", Effects]:
        """Step the master and deliver its effects to the readers. An accepted
        Remove or Evict is recorded in ``dropped`` (the request, not the
        reclaim it causes: spec ``ReleaseIsNotDelete``)."""
        table, effects = master_step(self.table, event)
        if table is self.table:
            return self, effects
        new = self._with(table=table)
        if isinstance(event, (Remove, Evict)):
            new = new._with(dropped=new.dropped | {event.key})
        for eff in effects:
            if isinstance(eff, Reclaimed):
                new = new._clobber(eff.region)
            elif isinstance(eff, Cached):
                new = new._with(dropped=new.dropped - {eff.key})
        return new, effects

    def _clobber(self, region: str) -> "System":
        hit = [r for r, read in self.readers.items()
               if read is not None and read.phase in READING and read.region == region]
        if not hit:
            return self
        with self.readers.mutate() as m:
            for r in hit:
                m[r] = attrs.evolve(m[r], clobbered=True)
            return self._with(readers=m.finish())

    def free_slots(self) -> list[str]:
        return [s for s in self.slots if s not in self.table.regions]



def _read(sys: System, r: str, *phases: Phase) -> Optional[ReadState]:
    read = sys.readers[r]
    return read if read is not None and read.phase in phases else None


def _set_read(sys: System, r: str, read: Optional[ReadState]) -> System:
    return sys._with(readers=sys.readers.set(r, read))


def sys_tick(sys: System, t: int) -> Optional[System]:
    if t <= sys.table.now:
        return None
    new, effects = sys.master(Tick(t))
    return new if _accepted(effects) else None


def sys_put(sys: System, k: Hashable, s: str) -> Optional[System]:
    new, effects = sys.master(Put(k, s))
    return new if _accepted(effects) else None


def sys_request(sys: System, r: str, k: Hashable) -> Optional[System]:
    if sys.readers[r] is not None:
        return None
    return _set_read(sys, r, ReadState(Phase.ASKED, k, base=sys.table.now))


def sys_grant(sys: System, r: str) -> Optional[System]:
    read = _read(sys, r, Phase.ASKED)
    if read is None:
        return None
    new, effects = sys.master(Grant(r, read.key))
    if not _accepted(effects):
        if isinstance(effects[0].error, errors.KeyNotFound):
            return _set_read(sys, r, None)          # a miss ends the read
        return None
    return _set_read(new, r, attrs.evolve(read, phase=Phase.GRANTED, region=effects[0].region))


def deadline_base(read: ReadState, now: int) -> int:
    """Spec ``BaseOnReply``: the reply does not restart the deadline."""
    return read.base


def sys_reply(sys: System, r: str) -> Optional[System]:
    read = _read(sys, r, Phase.GRANTED)
    if read is None:
        return None
    return _set_read(sys, r, attrs.evolve(read, phase=Phase.TRANSFERRING,
                                          base=deadline_base(read, sys.table.now)))


def sys_renew(sys: System, r: str) -> Optional[System]:
    read = _read(sys, r, Phase.TRANSFERRING)
    if read is None:
        return None
    new, effects = sys.master(Renew(r))
    if not _accepted(effects):
        return None
    return _set_read(new, r, attrs.evolve(read, base=sys.table.now))


def sys_complete(sys: System, r: str, d: int) -> Optional[System]:
    """The transfer completes at the master's ``now``; the reader's clock then
    reads ``now + d`` (``|d| <= max_skew``), having read ``base`` at the send."""
    read = _read(sys, r, Phase.TRANSFERRING)
    if read is None or abs(d) > sys.max_skew:
        return None
    ok = accept_transfer(read.base, sys.table.now + d, sys.table.ttl, sys.max_skew)
    return _set_read(sys, r, attrs.evolve(read, phase=Phase.ACCEPTED if ok else Phase.REJECTED))


def sys_release(sys: System, r: str) -> Optional[System]:
    if _read(sys, r, Phase.ACCEPTED, Phase.REJECTED) is None:
        return None
    new, _ = sys.master(Release(r))     # LeaseExpired: it already ended; nothing to do
    return _set_read(new, r, None)


def sys_takeover(sys: System) -> System:
    """Spec ``Takeover``: a new master's table (:func:`restored_table`) with
    the objects of the old one, all inherited, and none of its leases."""
    t = sys.table
    table = restored_table(t.ttl, t.now, [(k, o.region, o.size) for k, o in t.objects.items()])
    return sys._with(table=table, takeovers=sys.takeovers + 1)


def sys_remove(sys: System, k: Hashable) -> Optional[System]:
    new, effects = sys.master(Remove(k))
    return new if _accepted(effects) else None


def sys_evict(sys: System, k: Hashable) -> Optional[System]:
    """Spec ``Evict``: only under memory pressure (no free slot)."""
    if sys.free_slots():
        return None
    new, effects = sys.master(Evict(k))
    return new if _accepted(effects) else None


#: The spec's actions, each as a function on :class:`System` that returns the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "Tick": sys_tick,
    "Put": sys_put,
    "Request": sys_request,
    "Grant": sys_grant,
    "Reply": sys_reply,
    "Renew": sys_renew,
    "Complete": sys_complete,
    "Release": sys_release,
    "Remove": sys_remove,
    "Evict": sys_evict,
    "Takeover": sys_takeover,
}

# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``, plus the agreement of the table's indexes (regions,
    by_key, used) with its records."""
    t = sys.table
    if {obj.region: k for k, obj in t.objects.items()} != dict(t.regions):
        return False
    if len(t.regions) != len(t.objects) or t.used != sum(o.size for o in t.objects.values()):
        return False
    index = {k: set(hs) for k, hs in t.by_key.items()}
    actual: dict = {}
    for h, lease in t.leases.items():
        if lease.holder != h or lease.expires > t.now + t.ttl:
            return False
        actual.setdefault(lease.key, set()).add(h)
    if index != actual:
        return False
    if t.earliest is None and t.leases:
        return False
    if t.earliest is not None and any(l.expires < t.earliest for l in t.leases.values()):
        return False
    for read in sys.readers.values():
        if read is not None and not (isinstance(read.phase, Phase) and 0 <= read.base <= t.now):
            return False
    return True


def no_reclaim_under_lease(sys: System) -> bool:
    """Spec ``NoReclaimUnderLease``: an unexpired lease's object is still cached
    in the region the lease protects (and so no other object is there)."""
    t = sys.table
    for lease in t.leases.values():
        if lease.expires > t.now:
            obj = t.objects.get(lease.key)
            if obj is None or obj.region != lease.region or t.regions.get(lease.region) != lease.key:
                return False
    return True


def no_consume_of_reclaimed_bytes(sys: System) -> bool:
    """Spec ``NoConsumeOfReclaimedBytes``: no accepted read was clobbered."""
    return not any(read is not None and read.phase is Phase.ACCEPTED and read.clobbered
                   for read in sys.readers.values())


def release_is_not_delete(sys: System) -> bool:
    """Spec ``ReleaseIsNotDelete``: a key is uncached exactly when it was never
    put, or a Remove or an Evict took it since (tracked by ``dropped``)."""
    return all((k in sys.table.objects) != (k in sys.dropped)
               for k in sys.keys | set(sys.table.objects) | sys.dropped)


def leases_held_by_reads(sys: System) -> bool:
    """Spec ``LeasesHeldByReads``: every lease belongs to a granted read of its key."""
    for h, lease in sys.table.leases.items():
        read = sys.readers.get(h)
        if read is None or read.phase is Phase.ASKED or read.key != lease.key \
                or read.region != lease.region:
            return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "NoReclaimUnderLease": no_reclaim_under_lease,
    "NoConsumeOfReclaimedBytes": no_consume_of_reclaimed_bytes,
    "ReleaseIsNotDelete": release_is_not_delete,
    "LeasesHeldByReads": leases_held_by_reads,
}



# --------------------------------------------------------------------------
# Model constants and the successor relation (for conformance and exploration)
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    """The spec's CONSTANTS; keys, slots and readers are model-value names."""

    keys: tuple[str, ...]
    slots: tuple[str, ...]
    readers: tuple[str, ...]
    ttl: int
    max_skew: int
    max_time: int
    max_takeovers: int = 0

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Keys"]), model_names(consts["Slots"]), model_names(consts["Readers"]),
                   consts["TTL"], consts["MaxSkew"], consts["MaxTime"], consts["MaxTakeovers"])

    def initial(self) -> System:
        return System.initial(self.keys, self.slots, self.readers, self.ttl, self.max_skew)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    if sys.table.now < c.max_time:
        yield from emit("Tick", sys_tick(sys, sys.table.now + 1))
    if sys.takeovers < c.max_takeovers:
        yield from emit("Takeover", sys_takeover(sys))
    for k in c.keys:
        for s in c.slots:
            yield from emit("Put", sys_put(sys, k, s))
    for r in c.readers:
        for k in c.keys:
            yield from emit("Request", sys_request(sys, r, k))
        yield from emit("Grant", sys_grant(sys, r))
        yield from emit("Reply", sys_reply(sys, r))
        yield from emit("Renew", sys_renew(sys, r))
        yield from emit("Release", sys_release(sys, r))
        for d in range(-c.max_skew, c.max_skew + 1):
            yield from emit("Complete", sys_complete(sys, r, d))
    for k in c.keys:
        yield from emit("Remove", sys_remove(sys, k))
        yield from emit("Evict", sys_evict(sys, k))


NONE = ModelValue("None")


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping from a Python :class:`System` to the spec's variables.

    Keys, slots (regions) and readers map to model values of the same name; an
    uncached key, an absent lease, an idle reader and a read's unknown region to
    the model value ``None``; a lease's holder is its reader. ``earliest`` and
    ``last_used`` are caches that change no step's result, and are not mapped.
    """
    t = sys.table

    def mv(name):
        return NONE if name is None else ModelValue(name)

    def lease(r: str):
        l = t.leases.get(r)
        return NONE if l is None else Fn.of(
            {"key": ModelValue(l.key), "slot": ModelValue(l.region), "exp": l.expires})

    def read(r: str):
        x = sys.readers[r]
        return NONE if x is None else Fn.of(
            {"ph": x.phase.value, "key": ModelValue(x.key), "slot": mv(x.region),
             "base": x.base, "clob": x.clobbered})

    return Fn.of({
        "now": t.now,
        "dir": Fn.of({ModelValue(k): mv(t.objects[k].region if k in t.objects else None)
                      for k in c.keys}),
        "lease": Fn.of({ModelValue(r): lease(r) for r in c.readers}),
        "reader": Fn.of({ModelValue(r): read(r) for r in c.readers}),
        "dropped": frozenset(ModelValue(k) for k in sys.dropped),
        "inherited": frozenset(ModelValue(k) for k, o in t.objects.items() if o.inherited),
        "quietUntil": t.quiet_until,
        "takeovers": sys.takeovers,
    })


BINDING = SpecBinding(
    module="Lease",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
