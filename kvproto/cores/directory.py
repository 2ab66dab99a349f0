"""The master's directory of ``spec/Publish.tla`` as a mutable, compact core.

Reference machine: :class:`kvproto.statemachines.publish.Directory` stepped by
:func:`kvproto.statemachines.publish.master_step`. :class:`DirectoryCore` takes
the same events and returns the same effects (the classes of
:mod:`kvproto.statemachines.publish`); a refused event returns the same single
:class:`~kvproto.statemachines.refusal.Refused` effect and changes nothing.
:meth:`DirectoryCore.reference` gives the equal frozen ``Directory``; the
conformance graphs and the differential test hold the two to each other
(``docs/cores.md``).

Layout: a key's row comes from :class:`~kvproto.cores.rows.Rows` (shared with
the lease table in the master); per row, flat columns hold the status, token,
length, checksum, read pins and up to :data:`INLINE` replicas as (segment id, offset),
segment names interned to small ints. An object with more replicas, or on a
segment whose id does not fit in 16 bits, keeps its replicas in a small
overflow dict. The requested replica count is a column; the repairs in
flight (spec ``RepairStart`` .. ``ListReplica``), few at any time, are a
small dict by row. Segment ledgers are a few plain objects. A step allocates no
per-object Python object except the key's row; ``SegmentLost`` finds the
objects on the segment with one vectorised scan of the replica columns and
forgets the published ones that had their only replica there in bulk,
returning their effects in columns (:meth:`DirectoryCore.lose`).

The bulk constructors and the column layout's constants are in
:mod:`kvproto.cores.directory_build`; the batch steps' effects, the
``SegmentLost`` effects in columns and the read views in
:mod:`kvproto.cores.directory_views`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Optional

import immutables
import numpy as np

from kvproto import errors
from kvproto.cores.directory_build import (  # noqa: F401  (the layout, for the core's users)
    INLINE, OVERFLOW, PENDING, PUBLISHED, SEGMENT_ID_LIMIT, DirectoryBuild,
)
from kvproto.cores.directory_views import (  # noqa: F401  (the batch effects, with the core)
    Loss, Reads, _dropped, _Ledgers, _Objects, put_end_effects, put_start_effects,
    read_effects, remove_effects,
)
from kvproto.cores.rows import Rows, grow
from kvproto.statemachines.maps import map_of
from kvproto.statemachines.publish import (
    AddSegment, AssignRegion, Directory, FreeRegion, ListReplica, ObjectRecord, Published,
    PutEnd, PutGranted, PutRevoke, PutStart, ReadBegin, ReadEnd, ReadGranted,
    ReclaimAbandoned, Refused, Remove, Removed, RepairCancel, RepairCancelled, RepairRegion,
    RepairStart, RepairStarted, Replica, ReplicaListed, Revoked, SegmentLedger, SegmentLost,
    Status,
)

_STATUS = {PENDING: Status.PENDING, PUBLISHED: Status.PUBLISHED}
_CODE = {Status.PENDING: PENDING, Status.PUBLISHED: PUBLISHED}


def _refused(error: errors.KvError) -> tuple:
    return (Refused(error),)


class Ledger:
    """One segment's space account (``free[s]``, ``s \\in live``), mutable."""

    __slots__ = ("name", "id", "capacity", "free", "live")

    def __init__(self, name: str, id: int, capacity: int, free: int, live: bool = True):
        self.name, self.id, self.capacity, self.free, self.live = name, id, capacity, free, live

    def value(self) -> SegmentLedger:
        return SegmentLedger(self.capacity, self.free, self.live)


class DirectoryCore(DirectoryBuild):
    """The master's directory: ``step(event) -> effects``, mutating in place.

    ``rows`` may be shared with other cores (:class:`~kvproto.cores.leases.LeaseCore`);
    this core holds a row with owner bit :attr:`BIT`. Read it through
    :attr:`objects` (key -> :class:`ObjectRecord`, built on access),
    :attr:`segments` (name -> :class:`SegmentLedger`) and :attr:`next_token`,
    as one reads the frozen ``Directory``.
    """

    BIT = 1

    __slots__ = ("rows", "next_token", "count", "_st", "_nrep", "_tok", "_len", "_sum", "_reads",
                 "_s0", "_s1", "_o0", "_o1", "_req", "_extra", "_repairs", "_ledgers", "_by_id",
                 "_names", "_handlers", "objects", "segments")

    def __init__(self, rows: Optional[Rows] = None) -> None:
        self.rows = Rows() if rows is None else rows
        self.next_token = 1
        self.count = 0                     # objects held
        self._st = array("b")              # 0, PENDING or PUBLISHED
        self._nrep = array("B")            # inline replicas, or OVERFLOW
        self._tok = array("q")
        self._len = array("q")
        self._sum = array("Q")             # the writer's checksum (0: none)
        self._reads = array("I")
        self._s0, self._s1 = array("H"), array("H")
        self._o0, self._o1 = array("q"), array("q")
        self._req = array("H")             # the replica count its put requested
        self._extra: dict[int, tuple] = {}  # row -> ((segment id, offset), ...) when OVERFLOW
        self._repairs: dict[int, tuple] = {}  # row -> ((segment id, offset, repair id), ...)
        self._ledgers: dict[str, Ledger] = {}
        self._by_id: list[Ledger] = []
        self._names: list[str] = []        # segment id -> name
        self._setup()
        self.rows.attach(self._grow)

    def _setup(self) -> None:
        self._handlers = {
            AddSegment: self._add_segment, PutStart: self._put_start, PutEnd: self._put_end,
            PutRevoke: self._put_revoke, ReclaimAbandoned: self._reclaim_abandoned,
            ReadBegin: self._read_begin, ReadEnd: self._read_end, Remove: self._remove,
            SegmentLost: self._segment_lost, RepairStart: self._repair_start,
            ListReplica: self._list_replica, RepairCancel: self._repair_cancel,
        }
        self.objects = _Objects(self)
        self.segments = _Ledgers(self)

    def _columns(self) -> tuple:
        return (self._st, self._nrep, self._tok, self._len, self._sum, self._reads,
                self._s0, self._s1, self._o0, self._o1, self._req)

    def _grow(self, size: int) -> None:
        grow(self._columns(), size)

    # ------------------------------------------------------------------ stepping

    def step(self, event) -> tuple:
        """Apply one event (the events of ``publish.master_step``)."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a master event: {event!r}") from None
        return handler(event)

    def _add_segment(self, ev: AddSegment) -> tuple:
        if ev.segment in self._ledgers:
            return _refused(errors.InvalidArgument(f"segment {ev.segment!r} already joined"))
        if ev.capacity <= 0:
            return _refused(errors.InvalidArgument("segment capacity must be positive"))
        self._join(ev.segment, ev.capacity, ev.capacity)
        return ()

    def _join(self, name: str, capacity: int, free: int) -> Ledger:
        ledger = Ledger(name, len(self._by_id), capacity, free)
        self._ledgers[name] = ledger
        self._by_id.append(ledger)
        self._names.append(name)
        return ledger

    def _put_start(self, ev: PutStart) -> tuple:
        """Spec ``PutStart``: the key is absent and every replica fits on a live segment."""
        key, length, placement = ev.key, ev.length, ev.placement
        token = self._start(key, length, placement)
        if type(token) is not int:
            return (Refused(token),)
        return (PutGranted(key, token, tuple(placement)),) + tuple(
            AssignRegion(r.segment, r.offset, length, key, token) for r in placement)

    def _start(self, key, length: int, placement) -> "int | errors.KvError":
        """``PutStart(key, length, placement)`` without its effects: the token
        granted, or the error it is refused with (nothing changed)."""
        row = self.rows.index.get(key)
        if row is not None and self._st[row]:
            return errors.KeyExists(f"key {key!r} exists or is being put")
        if length <= 0 or not placement:
            return errors.InvalidArgument("empty object or placement")
        n = len(placement)
        if (placement[0].segment == placement[1].segment if n == 2 else
                n > 1 and len({r.segment for r in placement}) != n):
            return errors.InvalidArgument("two replicas on one segment")
        if n > 0xFFFF:
            return errors.InvalidArgument(f"{n} replicas is more than {0xFFFF}")
        ledgers, chosen = self._ledgers, []
        for r in placement:
            ledger = ledgers.get(r.segment)
            if ledger is None or not ledger.live:
                return errors.SegmentUnavailable(f"segment {r.segment!r} is not live")
            # r.length == length from here on, as the first test says
            if r.length != length or ledger.free < length or r.offset < 0 \
                    or r.offset + length > ledger.capacity:
                return errors.NoSpace(f"segment {r.segment!r} cannot hold {length} bytes")
            chosen.append(ledger)
        token = self.next_token
        self.next_token = token + 1
        row = self.rows.acquire(key, 1)
        self._st[row] = PENDING
        self._tok[row] = token
        self._len[row] = length
        self._sum[row] = 0
        self._req[row] = n
        for ledger in chosen:
            ledger.free -= length
        if n == 1 and chosen[0].id < SEGMENT_ID_LIMIT:
            self._nrep[row] = 1
            self._s0[row], self._o0[row] = chosen[0].id, placement[0].offset
        elif n == 2 and chosen[0].id < SEGMENT_ID_LIMIT and chosen[1].id < SEGMENT_ID_LIMIT:
            self._nrep[row] = 2
            self._s0[row], self._o0[row] = chosen[0].id, placement[0].offset
            self._s1[row], self._o1[row] = chosen[1].id, placement[1].offset
        else:
            self._place(row, [(l.id, r.offset) for l, r in zip(chosen, placement)])
        self.count += 1
        return token

    def _pending_row(self, key, token: int) -> Optional[int]:
        """Spec ``TokenOwns(k, t)``: the row of the pending object ``token`` owns."""
        row = self.rows.index.get(key)
        if row is not None and self._st[row] == PENDING and self._tok[row] == token:
            return row
        return None

    def _put_end(self, ev: PutEnd) -> tuple:
        """Spec ``PutEnd``: publish only if ``TokenOwns(k, t)``; else StaleToken."""
        row = self._publish(ev.key, ev.token, ev.checksum)
        if type(row) is not int:
            return (Refused(row),)
        return (Published(ev.key, ev.token),)

    def _publish(self, key, token: int, checksum: int) -> "int | errors.KvError":
        """``PutEnd(key, token, checksum)`` without its effect: the object's
        row, or the error it is refused with (nothing changed)."""
        row = self._pending_row(key, token)
        if row is None:
            return errors.StaleToken(f"token {token} does not own {key!r}")
        self._st[row] = PUBLISHED
        self._sum[row] = checksum
        return row

    def _put_revoke(self, ev) -> tuple:
        """Spec ``PutRevoke``: free the allocation if ``token`` still owns it."""
        row = self._pending_row(ev.key, ev.token)
        if row is None:
            return _refused(errors.StaleToken(f"token {ev.token} does not own {ev.key!r}"))
        return (Revoked(ev.key, ev.token),) + self._drop(row, ev.key)

    #: Spec ``ReclaimAbandoned``: the writer fell silent; free its allocation.
    _reclaim_abandoned = _put_revoke

    def _read_begin(self, ev: ReadBegin) -> tuple:
        """Spec ``ReadBegin``: only a published object is readable; pin it."""
        key = ev.key
        row = self.rows.index.get(key)
        if row is None or self._st[row] != PUBLISHED:
            return _refused(errors.KeyNotFound(f"{key!r}"))
        self._reads[row] += 1
        length = self._len[row]
        return (ReadGranted(key, self._tok[row], self._replicas(row, length), length,
                            self._sum[row]),)

    def _read_end(self, ev: ReadEnd) -> tuple:
        """Spec ``ReadEnd``: unpin; a read of an object that is gone changes nothing."""
        row = self.rows.index.get(ev.key)
        if row is None or not self._st[row] or self._tok[row] != ev.token \
                or self._reads[row] == 0:
            return _refused(errors.StaleToken(f"no read of {ev.key!r} with token {ev.token}"))
        self._reads[row] -= 1
        return ()

    # ------------------------------------------------------------------ batches

    def put_start_many(self, items: Iterable[tuple], refused=None) -> list:
        """``PutStart(key, length, placement)`` of each ``(key, length,
        placement)`` of ``items``, in order: the fold of the single steps. Per
        item the token granted, or the error its step is refused with (that
        step changed nothing); :func:`put_start_effects` gives the effects the
        steps return. ``items`` is taken one at a time, each after the one
        before was stepped, and ``refused(item)`` is called at once for a
        refused one (the master gives its placement back before placing the
        next)."""
        start, out = self._start, []
        for item in items:
            token = start(*item)
            out.append(token)
            if refused is not None and type(token) is not int:
                refused(item)
        return out

    def put_end_many(self, items: Iterable[tuple]) -> list:
        """``PutEnd(key, token, checksum)`` of each item, in order: the fold of
        the single steps. Per item what :meth:`placed` gives of the object
        published, or the error its step is refused with;
        :func:`put_end_effects` gives the effects."""
        publish, placed, out = self._publish, self._placed_at, []
        for key, token, checksum in items:
            row = publish(key, token, checksum)
            out.append(placed(row) if type(row) is int else row)
        return out

    def remove_many(self, keys: Iterable) -> list:
        """``Remove(key)`` of each key, in order: the fold of the single
        steps. Per key ``(token, length, [(segment, offset), ...] freed,
        [(segment, offset, repair id, freed), ...] cancelled)``, or the error
        its step is refused with; :func:`remove_effects` gives the effects."""
        take = self._take
        return [take(key) for key in keys]

    def read_many(self, keys: Sequence, pin: bool = True) -> Reads:
        """``ReadBegin(key)`` of each key, in order; with ``pin`` false each
        accepted one followed at once by its ``ReadEnd(key, token)`` (a read
        whose pin ends in the same request: a leased read). The fold of those
        single steps, its results in columns (:class:`Reads`: the grants'
        token, length, checksum and replicas, the errors of the refused);
        :func:`read_effects` gives the effects."""
        index, st, reads, tok, length, sums = (self.rows.index, self._st, self._reads,
                                               self._tok, self._len, self._sum)
        nrep, names, s0, o0 = self._nrep, self._names, self._s0, self._o0
        rows = [index.get(key) for key in keys]
        refused = [] if None not in rows and [st[r] for r in rows].count(PUBLISHED) == len(rows) \
            else [(i, errors.KeyNotFound(f"{key!r}")) for i, (key, row) in enumerate(zip(keys, rows))
                  if row is None or st[row] != PUBLISHED]
        if refused:
            for i, _ in refused:
                rows[i] = None
            granted = [row for row in rows if row is not None]
        else:
            granted = rows
        if pin:
            for row in granted:
                reads[row] += 1
        counts = [nrep[row] for row in granted]
        if counts.count(1) == len(counts):
            segment, offset = [names[s0[row]] for row in granted], [o0[row] for row in granted]
        else:
            s1, o1 = self._s1, self._o1
            segment, offset, counts = [], [], []
            for row in granted:
                n = nrep[row]
                if n == 1:
                    segment.append(names[s0[row]])
                    offset.append(o0[row])
                elif n == 2:
                    segment += (names[s0[row]], names[s1[row]])
                    offset += (o0[row], o1[row])
                else:       # none, or more than two
                    placed = self._placed(row)
                    n = len(placed)
                    segment += [names[s] for s, _ in placed]
                    offset += [o for _, o in placed]
                counts.append(n)
        if not refused:
            return Reads([tok[row] for row in rows], [length[row] for row in rows],
                         [sums[row] for row in rows], counts, segment, offset, refused)
        counts = iter(counts)
        return Reads([0 if row is None else tok[row] for row in rows],
                     [0 if row is None else length[row] for row in rows],
                     [0 if row is None else sums[row] for row in rows],
                     [0 if row is None else next(counts) for row in rows], segment, offset, refused)

    def _remove(self, ev: Remove) -> tuple:
        """Spec ``Remove``: published and unpinned only."""
        got = self._take(ev.key)
        if type(got) is not tuple:
            return (Refused(got),)
        return (Removed(ev.key, got[0]),) + _dropped(ev.key, *got)

    def _take(self, key) -> "tuple | errors.KvError":
        """``Remove(key)`` without its effects: ``(token, length, freed,
        repairs)`` as :meth:`_unhold` gives them, or the error it is refused
        with (nothing changed)."""
        row = self.rows.index.get(key)
        status = 0 if row is None else self._st[row]
        if not status:
            return errors.KeyNotFound(f"{key!r}")
        if status != PUBLISHED:
            return errors.NotPublished(f"{key!r} is being put")
        reads = self._reads[row]
        if reads:
            return errors.ObjectBusy(f"{key!r} has {reads} reader(s)")
        return (self._tok[row], self._len[row]) + self._unhold(row)

    def _segment_lost(self, ev: SegmentLost) -> tuple:
        """Spec ``SegmentLost`` (:meth:`lose`, its effects as a tuple)."""
        return self.lose(ev).effects()

    def lose(self, ev: SegmentLost) -> "Loss":
        """Spec ``SegmentLost``: revoke pending objects with a replica there, drop
        the replica from published ones, forget published ones left with none.

        The step of ``step(ev)``, its effects in columns (:class:`Loss`): the
        published objects whose only replica was there, none in repair, are
        found, forgotten and released in bulk (vectorised over the columns);
        the others (pending, overflowing, in repair), few, one by one."""
        ledger = self._ledgers.get(ev.segment)
        if ledger is None or not ledger.live:
            return Loss(_refused(errors.SegmentUnavailable(
                f"segment {ev.segment!r} is not live")))
        ledger.free, ledger.live = 0, False
        sid, size = ledger.id, self.rows.size
        special = {row for row, held in self._repairs.items()
                   if any(s == sid for s, _, _ in held)}
        special.update(row for row, placed in self._extra.items()
                       if any(s == sid for s, _ in placed))
        gone = np.empty(0, np.int64)
        if size and sid < SEGMENT_ID_LIMIT:
            st = np.frombuffer(self._st, np.int8, size)
            nrep = np.frombuffer(self._nrep, np.uint8, size)
            s0 = np.frombuffer(self._s0, np.uint16, size)
            s1 = np.frombuffer(self._s1, np.uint16, size)
            on0 = ((nrep == 1) | (nrep == 2)) & (s0 == sid)
            on1 = (nrep == 2) & (s1 == sid)
            on = on0 | on1
            bulk = on & (st == PUBLISHED)
            if special or self._repairs:
                others = np.fromiter(special.union(self._repairs), np.int64)
                others = others[on[others]]          # on the segment, with repairs or lost ones'
                special.update(others.tolist())
                bulk[others] = False
            special.update(np.flatnonzero(on & (st == PENDING)).tolist())
            gone = np.flatnonzero(bulk & (nrep == 1))
            # two replicas, one kept: the kept one moves to the first column
            first = np.flatnonzero(bulk & on0 & (nrep == 2))
            if len(first):
                o0 = np.frombuffer(self._o0, np.int64, size)
                o1 = np.frombuffer(self._o1, np.int64, size)
                s0[first], o0[first] = s1[first], o1[first]
                del o0, o1
            nrep[bulk & (nrep == 2)] = 1
            if len(gone):
                st[gone] = 0
                nrep[gone] = 0
                np.frombuffer(self._reads, np.uint32, size)[gone] = 0
            del st, nrep, s0, s1, on0, on1, on, bulk
        loss = Loss((), self.rows.keys[gone], np.frombuffer(self._tok, np.int64, size)[gone],
                    gone)
        if len(gone):
            self.count -= len(gone)
            self.rows.release_many(gone, self.BIT)
        for row in sorted(special):
            loss.runs.append((row, self._lost_row(row, sid, ledger.name)))
        return loss

    def _lost_row(self, row: int, sid: int, name: str) -> tuple:
        """The effects of ``SegmentLost`` on the object of ``row``, one by one."""
        placed = self._placed(row)
        kept = [(s, o) for s, o in placed if s != sid]
        key, token = self.rows.keys[row], self._tok[row]
        if self._st[row] == PENDING or not kept:
            first = Revoked(key, token) if self._st[row] == PENDING else Removed(key, token)
            return (first,) + self._drop(row, key, skip=sid)
        if len(kept) != len(placed):
            self._place(row, kept)
        held = self._repairs.get(row)
        if not held:
            return ()
        self._set_repairs(row, tuple(h for h in held if h[0] != sid))
        return tuple(RepairCancelled(key, token, rid, name) for s, _, rid in held if s == sid)

    # ------------------------------------------------------------------ repair

    def _set_repairs(self, row: int, held: tuple) -> None:
        if held:
            self._repairs[row] = held
        else:
            self._repairs.pop(row, None)

    def _repair_start(self, ev: RepairStart) -> tuple:
        """Spec ``RepairStart``: a published object with ``token`` below its
        requested count; a region on a live segment holding none of it."""
        key = ev.key
        row = self.rows.index.get(key)
        if row is None or self._st[row] != PUBLISHED or self._tok[row] != ev.token:
            return _refused(errors.StaleToken(f"no published {key!r} with token {ev.token}"))
        held = self._repairs.get(row, ())
        placed = self._placed(row)
        if len(placed) + len(held) >= self._req[row]:
            return _refused(errors.InvalidArgument(
                f"{key!r} has the {self._req[row]} replica(s) it requested"))
        r = ev.replica
        ledger = self._ledgers.get(r.segment)
        if ledger is not None and (any(s == ledger.id for s, _ in placed)
                                   or any(s == ledger.id for s, _, _ in held)):
            return _refused(errors.InvalidArgument("two replicas on one segment"))
        if ledger is None or not ledger.live:
            return _refused(errors.SegmentUnavailable(f"segment {r.segment!r} is not live"))
        length = self._len[row]
        if r.length != length or ledger.free < length or r.offset < 0 \
                or r.offset + length > ledger.capacity:
            return _refused(errors.NoSpace(f"segment {r.segment!r} cannot hold {r.length} bytes"))
        repair = self.next_token
        self.next_token = repair + 1
        ledger.free -= length
        self._repairs[row] = held + ((ledger.id, r.offset, repair),)
        return (RepairStarted(key, ev.token, repair, r),
                AssignRegion(r.segment, r.offset, length, key, ev.token))

    def _repair_at(self, ev) -> tuple[Optional[int], Optional[tuple]]:
        """``(row, (segment id, offset, id))`` of the repair ``ev`` names, or ``(None, None)``."""
        row = self.rows.index.get(ev.key)
        ledger = self._ledgers.get(ev.segment)
        if row is not None and ledger is not None and self._st[row]:
            for h in self._repairs.get(row, ()):
                if h[0] == ledger.id and h[2] == ev.repair:
                    return row, h
        return None, None

    def _end_repair(self, ev) -> tuple:
        """``(row, region)`` of the repair in flight that ``ev`` names, taken off
        the row's repairs; ``(None, refusal)`` if there is none."""
        row, h = self._repair_at(ev)
        if row is None:
            return None, _refused(errors.StaleToken(
                f"no repair {ev.repair} of {ev.key!r} into {ev.segment!r} in flight"))
        self._set_repairs(row, tuple(x for x in self._repairs[row] if x is not h))
        return row, h

    def _list_replica(self, ev: ListReplica) -> tuple:
        """Spec ``ListReplica``: only the repair in flight that the report names."""
        row, h = self._end_repair(ev)
        if row is None:
            return h
        self._place(row, self._placed(row) + [(h[0], h[1])])
        length = self._len[row]
        return (ReplicaListed(ev.key, self._tok[row], ev.repair,
                              Replica(ev.segment, h[1], length)),)

    def _repair_cancel(self, ev: RepairCancel) -> tuple:
        """Spec ``RepairCancel``: the repair ends unlisted; its region is freed."""
        row, h = self._end_repair(ev)
        if row is None:
            return h
        token, length = self._tok[row], self._len[row]
        self._by_id[h[0]].free += length
        return (RepairCancelled(ev.key, token, ev.repair, ev.segment),
                FreeRegion(ev.segment, h[1], token, length))

    def below(self) -> list:
        """Keys of the published objects below their requested count, counting
        the repairs in flight (spec ``Below``), in row order (vectorised)."""
        size = self.rows.size
        if not size:
            return []
        st = np.frombuffer(self._st, np.int8, size)
        nrep = np.frombuffer(self._nrep, np.uint8, size).astype(np.int64)
        req = np.frombuffer(self._req, np.uint16, size)
        for row, placed in self._extra.items():
            nrep[row] = len(placed)
        for row, held in self._repairs.items():
            nrep[row] += len(held)
        return self.rows.keys[np.flatnonzero((st == PUBLISHED) & (nrep < req))].tolist()

    # ------------------------------------------------------------------ rows

    def _place(self, row: int, placed: Sequence[tuple[int, int]]) -> None:
        """Store ``(segment id, offset)`` replicas in the row, or its overflow entry."""
        n = len(placed)
        if n <= INLINE and all(s < SEGMENT_ID_LIMIT for s, _ in placed):
            self._nrep[row] = n
            if n:
                self._s0[row], self._o0[row] = placed[0]
            if n == 2:
                self._s1[row], self._o1[row] = placed[1]
            self._extra.pop(row, None)
        else:
            self._nrep[row] = OVERFLOW
            self._extra[row] = tuple(placed)

    def _placed(self, row: int) -> list[tuple[int, int]]:
        n = self._nrep[row]
        if n == OVERFLOW:
            return list(self._extra[row])
        out = []
        if n:
            out.append((self._s0[row], self._o0[row]))
        if n == 2:
            out.append((self._s1[row], self._o1[row]))
        return out

    def _replicas(self, row: int, length: int) -> tuple:
        n = self._nrep[row]
        names = self._names
        if n == 2:
            return (Replica(names[self._s0[row]], self._o0[row], length),
                    Replica(names[self._s1[row]], self._o1[row], length))
        if n == 1:
            return (Replica(names[self._s0[row]], self._o0[row], length),)
        return tuple(Replica(names[s], o, length) for s, o in self._placed(row))

    def _drop(self, row: int, key, skip: int = -1) -> tuple:
        """Free the object's replicas and repair regions (spec ``FreeObjects``;
        none on segment id ``skip``) and its row; the repairs are cancelled."""
        token, length = self._tok[row], self._len[row]
        return _dropped(key, token, length, *self._unhold(row, skip))

    def _unhold(self, row: int, skip: int = -1) -> tuple[list, list]:
        """:meth:`_drop` without its effects: ``[(segment, offset), ...]`` of
        the replicas freed and ``[(segment, offset, repair id, freed), ...]``
        of the repairs cancelled (their region freed unless on ``skip``)."""
        length, by_id = self._len[row], self._by_id
        freed, repairs = [], []
        for s, o in self._placed(row):
            if s != skip:
                ledger = by_id[s]
                ledger.free += length
                freed.append((ledger.name, o))
        for s, o, rid in self._repairs.get(row, ()):
            ledger = by_id[s]
            if s != skip:
                ledger.free += length
            repairs.append((ledger.name, o, rid, s != skip))
        self._clear(row)
        return freed, repairs

    def _clear(self, row: int) -> None:
        self._st[row] = 0
        self._nrep[row] = 0
        self._reads[row] = 0
        self._extra.pop(row, None)
        self._repairs.pop(row, None)
        self.count -= 1
        self.rows.release(row, self.BIT)

    def regions(self) -> dict:
        """``segment -> (n, 2)`` array of the ``(offset, length)`` of every
        replica on it, objects pending or published (vectorised; what a new
        master's allocators start from)."""
        size = self.rows.size
        st = np.frombuffer(self._st, np.int8, size)
        nrep = np.frombuffer(self._nrep, np.uint8, size)
        length = np.frombuffer(self._len, np.int64, size)
        sids, offs, lens = [], [], []
        for c, (scol, ocol) in enumerate(((self._s0, self._o0), (self._s1, self._o1))):
            rows = np.flatnonzero((st != 0) & (nrep != OVERFLOW) & (nrep > c))
            sids.append(np.frombuffer(scol, np.uint16, size)[rows].astype(np.int64))
            offs.append(np.frombuffer(ocol, np.int64, size)[rows])
            lens.append(length[rows])
        for row, placed in self._extra.items():
            sids.append(np.array([s for s, _ in placed], np.int64))
            offs.append(np.array([o for _, o in placed], np.int64))
            lens.append(np.full(len(placed), self._len[row], np.int64))
        sid, off, ln = np.concatenate(sids), np.concatenate(offs), np.concatenate(lens)
        out = {}
        for ledger in self._by_id:
            on = sid == ledger.id
            out[ledger.name] = np.stack((off[on], ln[on]), axis=1)
        return out

    # ------------------------------------------------------------------ reading

    def record(self, key) -> Optional[ObjectRecord]:
        """``dir[key]`` as the reference's :class:`ObjectRecord`, or None."""
        row = self.rows.index.get(key)
        if row is None or not self._st[row]:
            return None
        return self._record(row)

    def _record(self, row: int) -> ObjectRecord:
        length, names = self._len[row], self._names
        return ObjectRecord(_STATUS[self._st[row]], self._tok[row], self._replicas(row, length),
                            length, self._reads[row], self._sum[row], self._req[row],
                            tuple(RepairRegion(names[s], o, rid)
                                  for s, o, rid in self._repairs.get(row, ())))

    def placed(self, key) -> tuple[int, int, int, list[tuple[str, int]]]:
        """``(length, checksum, requested, [(segment, offset), ...])`` of the
        object ``key`` (which must be held): what a publish mark carries,
        without building its :class:`ObjectRecord`."""
        return self._placed_at(self.rows.index[key])

    def _placed_at(self, row: int) -> tuple[int, int, int, list[tuple[str, int]]]:
        names, n = self._names, self._nrep[row]
        if n == 1:
            placed = [(names[self._s0[row]], self._o0[row])]
        elif n == 2:
            placed = [(names[self._s0[row]], self._o0[row]), (names[self._s1[row]], self._o1[row])]
        else:
            placed = [(names[s], o) for s, o in self._placed(row)]
        return self._len[row], self._sum[row], self._req[row], placed

    def requested_bytes(self) -> tuple[list, list]:
        """The keys of the objects held, in the order of :attr:`objects`, and
        of each its length × the replica count its put requested (what a
        takeover charges its owner); no record built."""
        index = self.rows.index
        if not index:
            return [], []
        rows = np.fromiter(index.values(), np.int64, len(index))
        sizes = np.frombuffer(self._len, np.int64)[rows] * \
            np.frombuffer(self._req, np.uint16)[rows]
        held = np.frombuffer(self._st, np.int8)[rows] != 0
        if held.all():
            return list(index), sizes.tolist()
        return ([k for k, h in zip(index, held.tolist()) if h], sizes[held].tolist())

    def published(self, key) -> bool:
        """Whether ``key`` names a published object (spec ``Readable(k)``)."""
        row = self.rows.index.get(key)
        return row is not None and self._st[row] == PUBLISHED

    def published_many(self, keys) -> bytes:
        """One byte per key of ``keys``: 1 where it names a published object
        (spec ``Readable(k)``), else 0."""
        get, st = self.rows.index.get, self._st
        return bytes([(row := get(key)) is not None and st[row] == PUBLISHED for key in keys])

    def _items(self) -> Iterator[tuple]:
        st = self._st
        for key, row in self.rows.index.items():
            if st[row]:
                yield key, row

    def reference(self) -> Directory:
        """The equal frozen :class:`Directory` (O(n); for checks)."""
        return Directory(map_of((key, self._record(row)) for key, row in self._items()),
                         immutables.Map({l.name: l.value() for l in self._by_id}),
                         self.next_token)

    def copy(self) -> "DirectoryCore":
        """An independent copy (with its own rows, shared with nothing)."""
        new = DirectoryCore.__new__(DirectoryCore)
        new.rows = self.rows.copy()
        new.next_token, new.count = self.next_token, self.count
        (new._st, new._nrep, new._tok, new._len, new._sum, new._reads,
         new._s0, new._s1, new._o0, new._o1, new._req) = (col[:] for col in self._columns())
        new._extra = dict(self._extra)
        new._repairs = dict(self._repairs)
        new._by_id = [Ledger(l.name, l.id, l.capacity, l.free, l.live) for l in self._by_id]
        new._ledgers = {l.name: l for l in new._by_id}
        new._names = list(self._names)
        new._setup()
        new.rows.attach(new._grow)
        return new


def restored(capacities: Mapping[str, int], objects: Iterable[tuple], next_token: int
             ) -> DirectoryCore:
    """:meth:`DirectoryCore.restored` (the drop-in for ``publish.restored``)."""
    return DirectoryCore.restored(capacities, objects, next_token)
