"""The master's read leases of ``spec/Lease.tla`` as a mutable, compact core.

Reference machine: :class:`kvproto.statemachines.lease.LeaseTable` stepped by
:func:`kvproto.statemachines.lease.master_step`. :class:`LeaseCore` takes the
same events (``Tick``, ``Put``, ``Grant``, ``Renew``, ``Release``, ``Remove``,
``Evict``, ``Disown``), returns the same effects, refuses with the same single
``Refused`` effect and changes nothing then; :func:`restored_table` is the
spec's ``Takeover`` (every object inherited, no lease known, inherited objects
leased until ``quiet_until``). :meth:`LeaseCore.reference` gives the equal
frozen ``LeaseTable``.

Layout. Per cached object, columns indexed by the rows of
:class:`~kvproto.cores.rows.Rows` — in the master the same rows as the
directory's, so an object costs a few column entries here and no Python
object: flags (cached, inherited, region is its own), size, region token and
last use. A region that names its own object, ``(key, token)`` as the runtime's
do, is stored as its token; any other region (the spec's shared slots) goes in
a dict. Leases — the reads in flight, few — are small records in a dict
(holder -> key, row, expiry; the region is the row's, which cannot change
while the object is leased), counted per row in a column, with an expiry queue, so a :class:`~kvproto.statemachines.lease.Tick` costs
O(leases it ends) (the reference walks every lease). Every expiry is the clock
plus the one TTL, and the clock never goes back, so the queue is in expiry
order as it is appended: a first-in-first-out queue, one entry per step that
grants or renews, a batch of grants (:meth:`LeaseCore.grant_many`) one entry
for all its leases.

Eviction order (the runtime's policy; the spec allows evicting any unleased
object): :meth:`LeaseCore.eviction_candidates` yields the unleased cached
objects by last use (the master clock of the object's put, last grant or
renewal, or :meth:`LeaseCore.touch`), least recent first, ties by row, exact;
it selects them in batches with a vectorised partial sort, O(n) per batch, the
batches growing eightfold. :func:`kvproto.statemachines.lease.plan_eviction`
takes them with its watermark semantics unchanged.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Optional

import immutables
import numpy as np

from kvproto import errors
from kvproto.cores.directory import PUBLISHED, DirectoryCore
from kvproto.cores.rows import Rows, grow
from kvproto.statemachines.lease import (
    CachedObject, Cached, Disown, Evict, Grant, Lease, LeaseEnded, LeaseGranted,
    LeaseReleased, LeaseRenewed, LeaseTable, Put, Reclaimed, Refused, Release, Remove, Renew,
    Tick,
)
from kvproto.statemachines.maps import map_of

#: flag bits per row
CACHED, INHERITED, OWN_REGION = 1, 2, 4
_OWN = CACHED | OWN_REGION
_INT64 = (-(1 << 63), 1 << 63)


def _refused(error: errors.KvError) -> tuple:
    return (Refused(error),)


class Refusal:
    """A refused step's error, where an accepted step's value may be any key."""

    __slots__ = ("error",)

    def __init__(self, error: errors.KvError) -> None:
        self.error = error


#: one reader's lease is a tuple ``(key, row, expires, seq)`` (a renewal replaces
#: it: ``seq`` names its current queue entry)
KEY, ROW, EXPIRES, SEQ = range(4)


class LeaseCore:
    """The master's lease table: ``step(event) -> effects``, mutating in place.

    ``rows`` may be shared with the directory (:class:`~kvproto.cores.directory.DirectoryCore`);
    this core holds a row with owner bit :attr:`BIT`. Read it through
    :attr:`objects`, :attr:`regions`, :attr:`leases` and :attr:`by_key`
    (built on access) and :attr:`now`, :attr:`ttl`, :attr:`used`,
    :attr:`quiet_until`, as one reads the frozen ``LeaseTable``.
    """

    BIT = 2

    __slots__ = ("rows", "ttl", "now", "quiet_until", "used", "count", "_flags", "_size",
                 "_rtok", "_last", "_held", "_regions", "_region_of", "_leases", "_queue",
                 "_seq", "_handlers", "objects", "regions", "leases", "by_key")

    def __init__(self, ttl, rows: Optional[Rows] = None, *, now=0, quiet_until=0) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.rows = Rows() if rows is None else rows
        self.ttl, self.now, self.quiet_until = ttl, now, quiet_until
        self.used = 0
        self.count = 0
        self._flags = array("B")
        self._size = array("q")
        self._rtok = array("q")            # the token of an OWN_REGION region (key, token)
        self._last = array("d")            # recency: master time of put, grant, renewal, touch
        #: leases on the row; every lease held is unexpired (a Tick ends those
        #: it reaches), so a row is ``Leased`` while it counts one
        self._held = array("I")
        self._regions: dict = {}           # region -> row, regions that are not (key, token)
        self._region_of: dict = {}         # row -> region, the same
        self._leases: dict = {}            # holder -> (key, row, expires, seq)
        #: (expires, seq, holders): the j-th holder's lease, if its seq is still
        #: seq + j, expires then; stale holders (released, renewed) are skipped
        self._queue: deque = deque()
        self._seq = 0
        self._setup()
        self.rows.attach(self._grow)

    def _setup(self) -> None:
        self._handlers = {
            Tick: self._tick, Put: self._put, Grant: self._grant, Renew: self._renew,
            Release: self._release, Remove: self._remove, Evict: self._evict,
            Disown: self._disown,
        }
        self.objects = _Objects(self)
        self.regions = _Regions(self)
        self.leases = _Leases(self)
        self.by_key = _ByKey(self)

    def _columns(self) -> tuple:
        return (self._flags, self._size, self._rtok, self._last, self._held)

    def _grow(self, size: int) -> None:
        grow(self._columns(), size)

    # ------------------------------------------------------------------ stepping

    def step(self, event) -> tuple:
        """Apply one event (the events of ``lease.master_step``)."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a lease event: {event!r}") from None
        return handler(event)

    def _tick(self, ev: Tick) -> tuple:
        """Spec ``Tick``: the clock never goes back; leases with ``expires <= now`` end."""
        now = ev.now
        if now < self.now:
            return _refused(errors.InvalidArgument(
                f"master clock went back from {self.now} to {now}"))
        if now == self.now:
            return ()
        self.now = now
        queue, leases = self._queue, self._leases
        ended = []
        while queue and queue[0][0] <= now:
            _, seq, holders = queue.popleft()
            if leases.keys().isdisjoint(holders):
                continue                   # all released or renewed since
            for holder in holders:
                lease = leases.get(holder)
                if lease is not None and lease[SEQ] == seq:
                    self._forget(holder, lease)
                    ended.append(LeaseEnded(holder, lease[KEY]))
                seq += 1                   # else released or renewed since
        return tuple(ended)

    def _put(self, ev: Put, inherited: bool = False) -> tuple:
        """Spec ``Put``: the key is not cached and the region is free."""
        err = self._cache(ev.key, ev.region, ev.size, inherited)
        return (Cached(ev.key, ev.region),) if err is None else (Refused(err),)

    def _cache(self, key, region, size, inherited: bool = False) -> Optional[errors.KvError]:
        """``Put(key, region, size)`` without its effect: None, or the error
        it is refused with (nothing changed)."""
        row = self.rows.index.get(key)
        if row is not None and self._flags[row] & CACHED:
            return errors.KeyExists(f"{key!r} is cached")
        own = type(region) is tuple and len(region) == 2 and region[0] == key \
            and type(region[1]) is int and _INT64[0] <= region[1] < _INT64[1]
        # an own region (key, token) of an uncached key can only be held
        # through the dict (:meth:`_region_row`'s second test needs it cached)
        if (region in self._regions) if own else self._region_row(region) is not None:
            return errors.NoSpace(f"region {region!r} holds another object")
        if size <= 0:
            return errors.InvalidArgument("object size must be positive")
        row = self.rows.acquire(key, self.BIT)
        flags = CACHED | (INHERITED if inherited else 0)
        if own:
            flags |= OWN_REGION
            self._rtok[row] = region[1]
        else:
            self._regions[region] = row
            self._region_of[row] = region
        self._flags[row] = flags
        self._size[row] = size
        self._last[row] = self.now
        self.used += size
        self.count += 1
        return None

    def _grant(self, ev: Grant) -> tuple:
        """Spec ``Grant``: a lease on a cached object expiring at ``now + ttl``, or a miss."""
        got = self._lease(ev.holder, ev.key)
        if type(got) is not tuple:
            return (Refused(got),)
        return (LeaseGranted(ev.holder, ev.key, got[0], got[1], self.ttl),)

    def _lease(self, holder, key) -> "tuple | errors.KvError":
        """``Grant(holder, key)`` without its effect: ``(region, expires)``, or
        the error it is refused with (nothing changed)."""
        if holder in self._leases:
            return errors.LeaseHeld(f"{holder!r} already holds a lease")
        row = self.rows.index.get(key)
        if row is None or not self._flags[row] & CACHED:
            return errors.KeyNotFound(f"{key!r}")
        expires = self.now + self.ttl
        region = self._region(row)
        self._seq += 1
        self._leases[holder] = (key, row, expires, self._seq)
        self._held[row] += 1
        self._queue.append((expires, self._seq, (holder,)))
        self._last[row] = self.now
        return region, expires

    def _renew(self, ev: Renew) -> tuple:
        """Spec ``Renew``: only an unexpired lease is extended (to ``now + ttl``)."""
        lease = self._leases.get(ev.holder)
        if lease is None or lease[EXPIRES] <= self.now:
            return _refused(errors.LeaseExpired(f"{ev.holder!r} holds no unexpired lease"))
        self._seq += 1
        lease = self._leases[ev.holder] = (lease[KEY], lease[ROW], self.now + self.ttl, self._seq)
        self._queue.append((lease[EXPIRES], self._seq, (ev.holder,)))
        self._last[lease[ROW]] = self.now
        return (LeaseRenewed(ev.holder, lease[KEY], lease[EXPIRES]),)

    def _release(self, ev: Release) -> tuple:
        """Spec ``Release``: the lease ends; the object is not touched."""
        key = self._end(ev.holder)
        return (LeaseReleased(ev.holder, key),) if type(key) is not Refusal \
            else (Refused(key.error),)

    def _end(self, holder):
        """``Release(holder)`` without its effect: the key of the lease ended,
        or a :class:`Refusal` (nothing changed)."""
        lease = self._leases.get(holder)
        if lease is None:
            return Refusal(errors.LeaseExpired(f"{holder!r} holds no lease"))
        self._forget(holder, lease)
        return lease[KEY]

    # ------------------------------------------------------------------ batches

    def put_many(self, items: Iterable[tuple]) -> list:
        """``Put(key, region, size)`` of each item, in order: the fold of the
        single steps. Per item None, or the error its step is refused with;
        :func:`put_effects` gives the effects."""
        cache = self._cache
        return [cache(key, region, size) for key, region, size in items]

    def grant_many(self, items: Iterable[tuple]) -> list:
        """``Grant(holder, key)`` of each item, in order: the fold of the
        single steps. Per item the lease's expiry, or the error its step is
        refused with; :func:`grant_effects` gives the effects (at once: they
        name the regions as they are). The leases granted share one expiry
        and one queue entry."""
        leases, index, flags, held, last = (self._leases, self.rows.index, self._flags,
                                            self._held, self._last)
        now = self.now
        expires = now + self.ttl
        first = seq = self._seq + 1
        granted, out = [], []
        for holder, key in items:
            row = index.get(key)
            if row is None or not flags[row] & CACHED:
                out.append(errors.LeaseHeld(f"{holder!r} already holds a lease") if holder in leases
                           else errors.KeyNotFound(f"{key!r}"))
                continue
            lease = (key, row, expires, seq)
            if leases.setdefault(holder, lease) is not lease:
                out.append(errors.LeaseHeld(f"{holder!r} already holds a lease"))
                continue
            seq += 1
            held[row] += 1
            last[row] = now
            granted.append(holder)
            out.append(expires)
        if granted:
            self._seq = seq - 1
            self._queue.append((expires, first, tuple(granted)))
        return out

    def release_many(self, holders: Iterable) -> list:
        """``Release(holder)`` of each holder, in order: the fold of the single
        steps. Per holder the key of its lease, or a :class:`Refusal` (its
        ``error`` the step's); :func:`release_effects` gives the effects."""
        leases, held, out = self._leases, self._held, []
        for holder in holders:
            lease = leases.pop(holder, None)
            if lease is None:
                out.append(Refusal(errors.LeaseExpired(f"{holder!r} holds no lease")))
                continue
            held[lease[ROW]] -= 1
            out.append(lease[KEY])
        return out

    def _forget(self, holder, lease: tuple) -> None:
        del self._leases[holder]
        self._held[lease[ROW]] -= 1

    def _leased_by(self, row: int) -> int:
        """How many unexpired leases are on ``row`` (0 when none)."""
        return self._held[row]

    def _reclaimable(self, key, row: Optional[int]) -> Optional[errors.KvError]:
        """Why ``key`` may not be reclaimed now (spec ``Leased(k)``), or None."""
        if row is None or not self._flags[row] & CACHED:
            return errors.KeyNotFound(f"{key!r}")
        held = self._leased_by(row)
        if held:
            return errors.ObjectLeased(f"{key!r} has {held} unexpired lease(s)")
        if self._flags[row] & INHERITED \
                and self.now < self.quiet_until:
            return errors.ObjectLeased(
                f"{key!r} may still be leased by the previous master "
                f"({self.quiet_until - self.now} more)")
        return None

    def _reclaim(self, key, evicted: bool) -> tuple:
        row = self.rows.index.get(key)
        err = self._reclaimable(key, row)
        if err is not None:
            return _refused(err)
        region, size = self._region(row), self._size[row]
        if not self._flags[row] & OWN_REGION:
            del self._regions[region], self._region_of[row]
        self._flags[row] = 0
        self.used -= size
        self.count -= 1
        self.rows.release(row, self.BIT)
        return (Reclaimed(key, region, size, evicted),)

    def _remove(self, ev: Remove) -> tuple:
        """Spec ``Remove``: refused with ``ObjectLeased`` while ``Leased(k)``."""
        return self._reclaim(ev.key, evicted=False)

    def _evict(self, ev: Evict) -> tuple:
        """Spec ``Evict``: like ``Remove``; which object is the policy's choice."""
        return self._reclaim(ev.key, evicted=True)

    def _disown(self, ev: Disown) -> tuple:
        """An operator's forced remove: ``key`` stops counting as inherited."""
        row = self.rows.index.get(ev.key)
        if row is None or not self._flags[row] & CACHED:
            return _refused(errors.KeyNotFound(f"{ev.key!r}"))
        self._flags[row] &= ~INHERITED
        return ()

    def drop_many(self, keys, rows=None, evicted: bool = False) -> "Drops":
        """Of each cached key of ``keys`` (distinct), in order, the steps the
        master takes when its object left the directory: ``Release`` of each
        of its leases (holders in the order :meth:`holders` gives), ``Disown``
        while it counts as inherited, then ``Remove`` (``Evict`` if
        ``evicted``), which is then always accepted; keys not cached are left
        out. One vectorised step with the state and the effects of those steps
        one by one; the effects in columns (:class:`Drops`). ``rows``: the
        keys' rows (an int array) when the caller has them."""
        if not isinstance(keys, np.ndarray):
            keys = np.fromiter(keys, object, len(keys))
        if rows is None:
            get = self.rows.index.get
            rows = np.fromiter((get(k, -1) for k in keys.tolist()), np.int64, len(keys))
        else:
            rows = np.asarray(rows, np.int64)
        size = len(self._flags)
        flags = np.frombuffer(self._flags, np.uint8, size)
        cached = rows >= 0
        cached[cached] = (flags[rows[cached]] & CACHED) != 0
        if not cached.all():
            keys, rows = keys[cached], rows[cached]
        drops = Drops(keys, np.frombuffer(self._size, np.int64, size)[rows],
                      np.frombuffer(self._rtok, np.int64, size)[rows], evicted)
        if self._leases:
            held = np.flatnonzero(np.frombuffer(self._held, np.uint32, size)[rows])
            if len(held):
                at = dict.fromkeys(rows[held].tolist())
                for holder, lease in self._leases.items():
                    if lease[ROW] in at:
                        at[lease[ROW]] = (at[lease[ROW]] or ()) + (holder,)
                for i, row in zip(held.tolist(), at):
                    key = self.rows.keys[row]
                    for holder in at[row]:
                        self._forget(holder, self._leases[holder])
                    drops.released[i] = tuple(LeaseReleased(h, key) for h in at[row])
        own = (flags[rows] & OWN_REGION) != 0
        if not own.all():
            for i in np.flatnonzero(~own).tolist():
                row = int(rows[i])
                region = self._region_of.pop(row)
                del self._regions[region]
                drops.regions[i] = region
        flags[rows] = 0
        del flags
        self.used -= int(drops.sizes.sum())
        self.count -= len(rows)
        self.rows.release_many(rows, self.BIT)
        return drops

    # ------------------------------------------------------------------ regions

    def _region(self, row: int):
        if self._flags[row] & OWN_REGION:
            return (self.rows.keys[row], self._rtok[row])
        return self._region_of[row]

    def _region_row(self, region) -> Optional[int]:
        """The row of the cached object in ``region``, or None."""
        row = self._regions.get(region)
        if row is not None:
            return row
        if type(region) is tuple and len(region) == 2:
            row = self.rows.index.get(region[0])
            if row is not None and self._flags[row] & _OWN == _OWN \
                    and self._rtok[row] == region[1]:
                return row
        return None

    # ------------------------------------------------------------------ queries

    def is_leased(self, key: Hashable) -> bool:
        """Spec ``Leased(k)``: an unexpired lease, or inherited before ``quiet_until``."""
        row = self.rows.index.get(key)
        if row is None or not self._flags[row] & CACHED:
            return False
        if self._held[row]:
            return True
        return bool(self._flags[row] & INHERITED) and self.now < self.quiet_until

    def is_inherited(self, key: Hashable) -> bool:
        """Whether ``key`` counts as leased only because a previous master may have leased it."""
        row = self.rows.index.get(key)
        return row is not None and self._flags[row] & (CACHED | INHERITED) == CACHED | INHERITED \
            and self.now < self.quiet_until

    def inherited_quiet(self) -> bool:
        """Whether objects this master inherited still count as leased."""
        return self.now < self.quiet_until

    def reclaimable(self, key: Hashable) -> Optional[errors.KvError]:
        """The error ``Remove(key)`` or ``Evict(key)`` would be refused with
        now (``KeyNotFound``, ``ObjectLeased``), or None; steps nothing."""
        return self._reclaimable(key, self.rows.index.get(key))

    def holders(self, key: Hashable) -> tuple:
        """The holders of ``key``'s leases."""
        row = self.rows.index.get(key)
        if row is None or not self._held[row]:
            return ()
        return tuple(h for h, lease in self._leases.items() if lease[ROW] == row)

    @property
    def earliest(self):
        """The earliest expiry of a lease held, or None."""
        return min((lease[EXPIRES] for lease in self._leases.values()), default=None)

    def touch(self, key: Hashable) -> None:
        """Mark ``key`` used now for the eviction order (a read without a lease);
        not protocol state."""
        row = self.rows.index.get(key)
        if row is not None and self._flags[row] & CACHED:
            self._last[row] = self.now

    def eviction_candidates(self) -> Iterator[tuple[Hashable, int]]:
        """``(key, size)`` of the cached objects with no unexpired lease that are
        not inherited-and-quiet, least recently used first, ties by row, as
        they stand when iteration starts (take what is needed, e.g. with
        ``lease.plan_eviction``, before stepping the table again)."""
        if not self.count:
            return
        flags = np.frombuffer(self._flags, np.uint8)
        mask = (flags & CACHED) != 0
        if self.now < self.quiet_until:
            mask &= (flags & INHERITED) == 0
        mask &= np.frombuffer(self._held, np.uint32, len(flags)) == 0
        rows = np.flatnonzero(mask)
        last = np.frombuffer(self._last, np.float64)[rows]
        del flags, mask
        done, batch = 0, 256
        while done < len(rows):
            if batch < len(rows):
                bound = np.partition(last, batch - 1)[batch - 1]
                chosen = np.flatnonzero(last <= bound)
            else:
                chosen = np.arange(len(rows))
            chosen = chosen[np.lexsort((rows[chosen], last[chosen]))]
            for row in rows[chosen[done:]].tolist():
                if self._flags[row] & CACHED:
                    yield self.rows.keys[row], self._size[row]
            done, batch = len(chosen), batch * 8

    # ------------------------------------------------------------------ checks

    def reference(self) -> LeaseTable:
        """The equal frozen :class:`LeaseTable` (O(n); for checks)."""
        objects, regions, last = [], [], []
        keys, flags = self.rows.keys, self._flags
        for key, row in self.rows.index.items():
            f = flags[row]
            if f & CACHED:
                region = self._region(row)
                objects.append((key, CachedObject(region, self._size[row], bool(f & INHERITED))))
                regions.append((region, key))
                last.append((key, self._last[row]))
        by_key: dict = {}
        for holder, lease in self._leases.items():
            by_key.setdefault(keys[lease[ROW]], {})[holder] = True
        return LeaseTable(
            ttl=self.ttl, now=self.now, objects=map_of(objects), regions=map_of(regions),
            leases=immutables.Map({h: Lease(h, lease[KEY], self._region(lease[ROW]), lease[EXPIRES])
                                   for h, lease in self._leases.items()}),
            by_key=immutables.Map({k: immutables.Map(hs) for k, hs in by_key.items()}),
            used=self.used, quiet_until=self.quiet_until, earliest=self.earliest,
            last_used=map_of(last))

    def copy(self) -> "LeaseCore":
        """An independent copy (with its own rows, shared with nothing)."""
        new = LeaseCore.__new__(LeaseCore)
        new.rows = self.rows.copy()
        new.ttl, new.now, new.quiet_until = self.ttl, self.now, self.quiet_until
        new.used, new.count, new._seq = self.used, self.count, self._seq
        new._flags, new._size, new._rtok, new._last, new._held = (
            col[:] for col in self._columns())
        new._regions, new._region_of = dict(self._regions), dict(self._region_of)
        new._leases = dict(self._leases)
        new._queue = deque(self._queue)
        new._setup()
        new.rows.attach(new._grow)
        return new

    # ------------------------------------------------------------------ takeover

    @classmethod
    def restored(cls, ttl, now, objects: Iterable[tuple[Hashable, Hashable, int]], quiet=None,
                 rows: Optional[Rows] = None) -> "LeaseCore":
        """Spec ``Takeover`` (:func:`kvproto.statemachines.lease.restored_table`):
        every ``(key, region, size)`` cached and inherited, no lease known,
        inherited objects leased until ``now + quiet`` (default ``ttl``)."""
        core = cls(ttl, rows, now=now, quiet_until=now + (ttl if quiet is None else quiet))
        for key, region, size in objects:
            effects = core._put(Put(key, region, size), inherited=True)
            if effects and type(effects[0]) is Refused:
                raise ValueError(f"recovered object {key!r} repeats a key or region, or is empty")
        return core

    @classmethod
    def inherit(cls, directory: DirectoryCore, ttl, now, quiet=None) -> "LeaseCore":
        """:meth:`restored` of every published object of ``directory`` (a
        :class:`~kvproto.cores.directory.DirectoryCore`), sharing its rows, as the
        runtime master takes over: region ``(key, token)``, size ``length`` times
        its replicas. Vectorised: no Python object per object."""
        core = cls(ttl, directory.rows, now=now,
                   quiet_until=now + (ttl if quiet is None else quiet))
        size = len(directory.rows.owners)
        published = np.frombuffer(directory._st, np.int8, size) == PUBLISHED
        nrep = np.frombuffer(directory._nrep, np.uint8, size).astype(np.int64)
        for row, placed in directory._extra.items():
            nrep[row] = len(placed)
        sizes = np.where(published, np.frombuffer(directory._len, np.int64, size) * nrep, 0)
        flags = np.where(published, CACHED | INHERITED | OWN_REGION, 0).astype(np.uint8)
        tokens = np.where(published, np.frombuffer(directory._tok, np.int64, size), 0)
        owners = np.frombuffer(directory.rows.owners, np.uint8)
        owners[published] |= cls.BIT
        del owners
        core._flags, core._size, core._rtok, core._last, core._held = (
            _column(code, values) for code, values in (
                ("B", flags), ("q", sizes), ("q", tokens), ("d", np.full(size, float(now))),
                ("I", np.zeros(size, np.uint32))))
        core.used, core.count = int(sizes.sum()), int(published.sum())
        core._setup()
        return core


class Drops:
    """The effects of :meth:`LeaseCore.drop_many` in columns: per key dropped
    (``keys``, in order) its ``LeaseReleased`` effects (``released``: index
    -> tuple, keys with leases only) and its ``Reclaimed(key, region, size,
    evicted)``, the region ``(key, tokens[i])`` unless ``regions`` has it."""

    __slots__ = ("keys", "sizes", "tokens", "evicted", "released", "regions")

    def __init__(self, keys, sizes, tokens, evicted: bool) -> None:
        self.keys, self.sizes, self.tokens, self.evicted = keys, sizes, tokens, evicted
        self.released: dict[int, tuple] = {}
        self.regions: dict = {}

    def __len__(self) -> int:
        return len(self.keys)

    def effects(self) -> tuple:
        """The effects of the steps one by one, in order (``Disown``'s are none)."""
        out: list = []
        released, regions, evicted = self.released, self.regions, self.evicted
        for i, (key, size, token) in enumerate(zip(self.keys.tolist(), self.sizes.tolist(),
                                                   self.tokens.tolist())):
            out.extend(released.get(i, ()))
            out.append(Reclaimed(key, regions[i] if i in regions else (key, token), size,
                                 evicted))
        return tuple(out)


def put_effects(items, results) -> tuple:
    """The effects of the steps :meth:`LeaseCore.put_many` folded."""
    return tuple(Cached(key, region) if err is None else Refused(err)
                 for (key, region, _), err in zip(items, results))


def grant_effects(core: LeaseCore, items, results) -> tuple:
    """The effects of the steps :meth:`LeaseCore.grant_many` folded (the
    regions as ``core`` holds them now)."""
    return tuple(Refused(r) if isinstance(r, errors.KvError) else
                 LeaseGranted(holder, key, core._region(core.rows.index[key]), r, core.ttl)
                 for (holder, key), r in zip(items, results))


def release_effects(holders, results) -> tuple:
    """The effects of the steps :meth:`LeaseCore.release_many` folded."""
    return tuple(Refused(r.error) if type(r) is Refusal else LeaseReleased(holder, r)
                 for holder, r in zip(holders, results))


def _column(typecode: str, values: np.ndarray) -> array:
    """A column holding ``values``, copied once."""
    col = array(typecode)
    col.frombytes(memoryview(np.ascontiguousarray(values, np.dtype(typecode))).cast("B"))
    return col


def new_table(ttl) -> LeaseCore:
    """The drop-in for ``lease.new_table``."""
    return LeaseCore(ttl)


def restored_table(ttl, now, objects: Iterable[tuple[Hashable, Hashable, int]],
                   quiet=None) -> LeaseCore:
    """The drop-in for ``lease.restored_table`` (spec ``Takeover``)."""
    return LeaseCore.restored(ttl, now, objects, quiet)


# --------------------------------------------------------------------------
# Read views with the frozen LeaseTable's shape
# --------------------------------------------------------------------------


class _View(Mapping):
    __slots__ = ("_core",)

    def __init__(self, core: LeaseCore) -> None:
        self._core = core


class _Objects(_View):
    """``key -> CachedObject``."""

    __slots__ = ()

    def _row(self, key) -> Optional[int]:
        row = self._core.rows.index.get(key)
        return row if row is not None and self._core._flags[row] & CACHED else None

    def __getitem__(self, key) -> CachedObject:
        row = self._row(key)
        if row is None:
            raise KeyError(key)
        core = self._core
        return CachedObject(core._region(row), core._size[row],
                            bool(core._flags[row] & INHERITED))

    def __contains__(self, key) -> bool:
        return self._row(key) is not None

    def __len__(self) -> int:
        return self._core.count

    def __iter__(self) -> Iterator:
        flags = self._core._flags
        return (key for key, row in self._core.rows.index.items() if flags[row] & CACHED)


class _Regions(_View):
    """``region -> key``."""

    __slots__ = ()

    def __getitem__(self, region):
        row = self._core._region_row(region)
        if row is None:
            raise KeyError(region)
        return self._core.rows.keys[row]

    def __contains__(self, region) -> bool:
        return self._core._region_row(region) is not None

    def __len__(self) -> int:
        return self._core.count

    def __iter__(self) -> Iterator:
        core = self._core
        flags = core._flags
        return (core._region(row) for row in core.rows.index.values() if flags[row] & CACHED)


class _Leases(_View):
    """``holder -> Lease``."""

    __slots__ = ()

    def __getitem__(self, holder) -> Lease:
        lease = self._core._leases[holder]
        return Lease(holder, lease[KEY], self._core._region(lease[ROW]), lease[EXPIRES])

    def __contains__(self, holder) -> bool:
        return holder in self._core._leases

    def __len__(self) -> int:
        return len(self._core._leases)

    def __iter__(self) -> Iterator:
        return iter(list(self._core._leases))


class _ByKey(_View):
    """``key -> (holder, ...)``, keys with leases only."""

    __slots__ = ()

    def __getitem__(self, key) -> tuple:
        holders = self._core.holders(key)
        if not holders:
            raise KeyError(key)
        return holders

    def __len__(self) -> int:
        return len(self._leased())

    def __iter__(self) -> Iterator:
        keys = self._core.rows.keys
        return iter([keys[row] for row in self._leased()])

    def _leased(self) -> list:
        """The rows with leases, in the order their first lease held was granted."""
        return list(dict.fromkeys(lease[ROW] for lease in self._core._leases.values()))
