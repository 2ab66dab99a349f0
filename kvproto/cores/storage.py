"""A storage node's region table and object index as one mutable, compact core.

Reference machines: :class:`kvproto.statemachines.publish.RegionTable` stepped
by :func:`kvproto.statemachines.publish.storage_step` (which token owns which
region of the segment, ``spec/Publish.tla``), and
:class:`kvproto.statemachines.failover.StorageNode` stepped by
:func:`kvproto.statemachines.failover.storage_step` (the term fence and the
object index, ``spec/Failover.tla``). :class:`StorageNodeCore` takes the events
of both (their types are disjoint) through one ``step``, returns the same
effects and refuses with the same single ``Refused`` effect, changing nothing.
:meth:`StorageNodeCore.reference` gives both frozen values.

Layout: regions by offset and index entries by key, each a
:class:`~kvproto.cores.rows.Rows` numbering flat columns (token, length,
written; term, published, publishing term, offset, length, token, checksum).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from typing import Optional

import immutables
import numpy as np

from kvproto import errors
from kvproto.cores.recovery import IndexColumns
from kvproto.cores.rows import Rows, grow, put
from kvproto.statemachines import failover as fm
from kvproto.statemachines.maps import map_of
from kvproto.statemachines.publish import (
    Accepted, AssignRegion, FreeRegion, ReadReplica, Refused, Region, RegionTable, WriteReplica,
)


def _refused(error: errors.KvError) -> tuple:
    return (Refused(error),)


class StorageNodeCore:
    """One storage node's region table (publish) and fence + index (failover).

    Read it through :attr:`regions` (offset -> :class:`Region`), :attr:`index`
    (key -> :class:`~kvproto.statemachines.failover.IndexEntry`), built on
    access, and :attr:`segment`, :attr:`term`.
    """

    __slots__ = ("segment", "term", "_reg", "_r_key", "_r_tok", "_r_len", "_r_done",
                 "_idx", "_i_term", "_i_pub", "_i_by", "_i_off", "_i_len", "_i_tok",
                 "_i_sum", "_i_req", "_handlers", "regions", "index")

    def __init__(self, segment: str = "", term: int = 0) -> None:
        self.segment, self.term = segment, term
        self._reg = Rows()                  # offset -> region row
        self._r_key: dict = {}              # region row -> the object's key
        self._r_tok, self._r_len, self._r_done = array("q"), array("q"), array("b")
        self._idx = Rows()                  # key -> index row
        self._i_term, self._i_pub, self._i_by = array("q"), array("b"), array("q")
        self._i_off, self._i_len, self._i_tok = array("q"), array("q"), array("q")
        self._i_sum = array("Q")            # the checksum the publish recorded (0: none)
        self._i_req = array("q")            # the replica count the publish recorded (0: none)
        self._setup()

    def _setup(self) -> None:
        self._handlers = {
            AssignRegion: self._assign, FreeRegion: self._free, WriteReplica: self._write,
            ReadReplica: self._read, fm.Fence: self._fence,
            fm.StampedAllocate: self._allocate, fm.StampedPublish: self._publish,
            fm.StampedRead: self._stamped_read, fm.IndexRequest: self._index_request,
            fm.PurgeUnpublished: self._purge, fm.StampedFree: self._stamped_free,
        }
        self.regions = _Regions(self)
        self.index = _Index(self)
        self._reg.attach(lambda size: grow((self._r_tok, self._r_len, self._r_done), size))
        self._idx.attach(lambda size: grow(self._index_columns(), size))

    def _index_columns(self) -> tuple:
        return (self._i_term, self._i_pub, self._i_by, self._i_off, self._i_len, self._i_tok,
                self._i_sum, self._i_req)

    def step(self, event) -> tuple:
        """Apply one event (those of ``publish.storage_step`` and ``failover.storage_step``)."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a storage event: {event!r}") from None
        return handler(event)

    def restart(self, segment: str) -> None:
        """Start over under a new segment id: no region, no index; the fence
        keeps the highest term seen."""
        term = self.term
        self.__init__(segment, term)

    # ------------------------------------------------------------------ regions (publish)

    def _assign(self, ev: AssignRegion) -> tuple:
        """Master -> storage: ``token`` now owns the region at ``offset``."""
        if ev.offset in self._reg.index:
            return _refused(errors.RegionMismatch(f"offset {ev.offset} is already owned"))
        row = self._reg.acquire(ev.offset, 1)
        self._r_key[row] = ev.key
        self._r_tok[row], self._r_len[row], self._r_done[row] = ev.token, ev.length, 0
        return ()

    def _owned(self, ev) -> Optional[int]:
        """The region row at ``ev.offset`` if ``ev.token`` owns it."""
        row = self._reg.index.get(ev.offset)
        if row is None or self._r_tok[row] != ev.token:
            return None
        return row

    def _not_owned(self, ev) -> tuple:
        return _refused(errors.RegionMismatch(
            f"{self.segment}@{ev.offset} is not owned by token {ev.token}"))

    def _free(self, ev: FreeRegion) -> tuple:
        row = self._owned(ev)
        if row is None:
            return self._not_owned(ev)
        del self._r_key[row]
        self._reg.release(row, 1)
        return ()

    def _write(self, ev: WriteReplica) -> tuple:
        """Spec ``WriteReplica``: once, by the owning token."""
        err = self.write(ev.offset, ev.token)
        return (Accepted(self.segment, ev.offset, ev.token),) if err is None else _refused(err)

    def write(self, offset: int, token: int) -> Optional[errors.KvError]:
        """``WriteReplica(segment, offset, token)`` without an event or effect
        object: ``None`` (applied) or the refusal's error (nothing changed)."""
        row = self._reg.index.get(offset)
        if row is None or self._r_tok[row] != token:
            return errors.RegionMismatch(f"{self.segment}@{offset} is not owned by token {token}")
        if self._r_done[row]:
            return errors.RegionMismatch(f"{self.segment}@{offset} is already written")
        self._r_done[row] = 1
        return None

    def _read(self, ev: ReadReplica) -> tuple:
        row = self._owned(ev)
        if row is None:
            return self._not_owned(ev)
        if not self._r_done[row]:
            return _refused(errors.RegionMismatch(f"{self.segment}@{ev.offset} is incomplete"))
        return (Accepted(self.segment, ev.offset, ev.token),)

    def owner(self, offset: int) -> Optional[tuple]:
        """``(key, token, written)`` of the region at ``offset``, or None: the
        :class:`Region` view's fields without building it."""
        row = self._reg.index.get(offset)
        if row is None:
            return None
        return self._r_key[row], self._r_tok[row], self._r_done[row]

    def open_allocation(self, key) -> bool:
        """Whether ``key`` has an index entry not yet published (what
        ``StampedPublish`` needs, the term apart)."""
        row = self._idx.index.get(key)
        return row is not None and not self._i_pub[row]

    def region(self, offset: int) -> Optional[Region]:
        row = self._reg.index.get(offset)
        if row is None:
            return None
        return Region(self._r_key[row], self._r_tok[row], self._r_len[row], bool(self._r_done[row]))

    # ------------------------------------------------------------------ a request's steps at once

    def allocate_region(self, term: int, offset: int, length: int, key, token: int
                        ) -> Optional[errors.KvError]:
        """``StampedAllocate(segment, key, term, offset, length, token)`` then
        ``AssignRegion(segment, offset, length, key, token)`` (one region of an
        ``assign``), all or none, without an event or effect object: ``None``
        when both are accepted (and applied), else the first refusal's error
        (nothing changed). Equal to folding the two steps."""
        idx, reg = self._idx, self._reg
        if key in idx.index:
            return errors.KeyExists(f"{key!r} is held here")
        if term < self.term:
            return errors.StaleTerm(f"term {term} is below {self.term}")
        if offset in reg.index:
            return errors.RegionMismatch(f"offset {offset} is already owned")
        row = idx.acquire(key, 1)
        self._i_term[row], self._i_pub[row], self._i_by[row] = term, 0, 0
        self._i_off[row], self._i_len[row], self._i_tok[row] = offset, length, token
        self._i_sum[row] = self._i_req[row] = 0
        self.term = term
        row = reg.acquire(offset, 1)
        self._r_key[row] = key
        self._r_tok[row], self._r_len[row], self._r_done[row] = token, length, 0
        return None

    def allocate_regions(self, term: int, offsets: list, lengths: list, keys: list,
                         tokens: list) -> bool:
        """:meth:`allocate_region` of each region in turn when every one is
        accepted: True, all applied; else False and nothing changed (the
        regions are then taken one at a time, for each one's answer). Every
        one is accepted when the term is not stale and the keys and offsets
        are distinct and neither held nor owned here."""
        idx, reg, n = self._idx, self._reg, len(keys)
        if term < self.term or len(set(keys)) != n or len(set(offsets)) != n \
                or not idx.index.keys().isdisjoint(keys) \
                or not reg.index.keys().isdisjoint(offsets):
            return False
        at, length, token = (np.array(col, np.int64) for col in (offsets, lengths, tokens))
        rows = idx.acquire_new(keys, 1)
        for col, value in ((self._i_term, term), (self._i_pub, 0), (self._i_by, 0),
                           (self._i_off, at), (self._i_len, length), (self._i_tok, token),
                           (self._i_sum, 0), (self._i_req, 0)):
            put(col, rows, value)
        self.term = term
        rows = reg.acquire_new(offsets, 1)
        self._r_key.update(zip(rows.tolist(), keys))
        for col, value in ((self._r_tok, token), (self._r_len, length), (self._r_done, 0)):
            put(col, rows, value)
        return True

    def publish_regions(self, term: int, offsets: list, keys: list, tokens: list,
                        checksums: list, requested: list, bys: list, direct: list) -> bool:
        """:meth:`publish_region` of each region in turn when each region is
        its key's, owned by its token and written, or, where ``direct`` (a
        direct writer's region, which it reported written), written now
        (``write``), and every one is accepted: True, all applied; else False
        and nothing changed (the regions are then taken one at a time)."""
        n, reg, idx = len(keys), self._reg.index, self._idx.index
        if term < self.term or len(set(keys)) != n or max(bys) > term:
            return False
        rows = list(map(reg.get, offsets))
        irows = list(map(idx.get, keys))
        if None in rows or None in irows:
            return False
        rows, irows = np.array(rows, np.intp), np.array(irows, np.intp)
        done = np.frombuffer(self._r_done, np.int8, len(self._r_done))[rows]
        if list(map(self._r_key.__getitem__, rows.tolist())) != keys \
                or (np.frombuffer(self._r_tok, np.int64, len(self._r_tok))[rows]
                    != np.array(tokens, np.int64)).any() \
                or ((done == 0) & ~np.array(direct, bool)).any() \
                or np.frombuffer(self._i_pub, np.int8, len(self._i_pub))[irows].any():
            return False
        by = np.array(bys, np.int64)
        put(self._r_done, rows, 1)
        put(self._i_pub, irows, 1)
        put(self._i_by, irows, np.where(by != 0, by, term))
        put(self._i_sum, irows, np.array(checksums, np.uint64))
        put(self._i_req, irows, np.array(requested, np.int64))
        if by.any():        # a repaired replica: the object's allocation (RepairedEntry)
            put(self._i_term, irows[by != 0], by[by != 0])
        self.term = term
        return True

    def free_regions(self, term: int, offsets: list, tokens: list) -> bool:
        """``FreeRegion(segment, offset, token, length)`` then
        ``StampedFree(segment, key, term, token)`` of each region in turn
        (``key`` the region's) when every one is accepted: True, all applied;
        else False and nothing changed. Every one is accepted when the offsets
        and the regions' keys are distinct, each region is owned by its token,
        each region's key holds an index entry of that token, and the term is
        not stale."""
        reg, idx = self._reg, self._idx
        rows = list(map(reg.index.get, offsets))
        if term < self.term or None in rows or len(set(rows)) != len(rows):
            return False
        r_tok, r_key, i_tok = self._r_tok, self._r_key, self._i_tok
        keys = [r_key[row] for row in rows]
        entries = list(map(idx.index.get, keys))
        if None in entries or len(set(entries)) != len(entries) \
                or any(r_tok[row] != token for row, token in zip(rows, tokens)) \
                or any(i_tok[entry] != token for entry, token in zip(entries, tokens)):
            return False
        for row, entry in zip(rows, entries):
            del r_key[row]
            reg.release(row, 1)
            idx.release(entry, 1)
        self.term = term
        return True

    def publish_region(self, term: int, offset: int, token: int, key, checksum: int = 0,
                       requested: int = 0, by: int = 0, write: bool = False
                       ) -> Optional[errors.KvError]:
        """With ``write``, ``WriteReplica(segment, offset, token)`` (a direct
        writer's region, written by its owning token), then
        ``StampedPublish(segment, key, term, checksum, requested, by)`` (one
        region of a ``publish``), all or none, without an event or effect
        object: ``None`` when accepted (and applied), else the first refusal's
        error (nothing changed). Equal to folding the steps."""
        if write:
            row = self._reg.index.get(offset)
            if row is None or self._r_tok[row] != token:
                return errors.RegionMismatch(f"{self.segment}@{offset} is not owned by token {token}")
            if self._r_done[row]:
                return errors.RegionMismatch(f"{self.segment}@{offset} is already written")
        irow = self._idx.index.get(key)
        if irow is None or self._i_pub[irow]:
            return errors.NotPublished(f"{key!r} is not an open allocation here")
        if by > term:
            return errors.InvalidArgument(f"publishing term {by} is above the command's {term}")
        if term < self.term:
            return errors.StaleTerm(f"term {term} is below {self.term}")
        if write:
            self._r_done[row] = 1
        self._i_pub[irow], self._i_by[irow], self._i_sum[irow] = 1, by or term, checksum
        self._i_req[irow] = requested
        if by:              # a repaired replica: the object's allocation (RepairedEntry)
            self._i_term[irow] = by
        self.term = term
        return None

    # ------------------------------------------------------------------ fence and index (failover)

    def _stale(self, term: int) -> tuple:
        return _refused(errors.StaleTerm(f"term {term} is below {self.term}"))

    def _fence(self, ev: fm.Fence) -> tuple:
        """Spec ``Fence`` (node side)."""
        if ev.term < self.term:
            return self._stale(ev.term)
        self.term = ev.term
        return (fm.FenceAck(ev.term),)

    def _allocate(self, ev: fm.StampedAllocate) -> tuple:
        """Spec ``Allocate`` (node side): the region check, then the term fence."""
        if ev.key in self._idx.index:
            return _refused(errors.KeyExists(f"{ev.key!r} is held here"))
        if ev.term < self.term:
            return self._stale(ev.term)
        row = self._idx.acquire(ev.key, 1)
        self._i_term[row], self._i_pub[row], self._i_by[row] = ev.term, 0, 0
        self._i_off[row], self._i_len[row], self._i_tok[row] = ev.offset, ev.length, ev.token
        self._i_sum[row] = self._i_req[row] = 0
        self.term = max(self.term, ev.term)
        return (fm.StorageAccepted(ev.key, ev.term),)

    def _publish(self, ev: fm.StampedPublish) -> tuple:
        """Spec ``Publish`` (node side), and the destination's record of a
        ``Repair``: with ``by``, the object's publishing term."""
        row = self._idx.index.get(ev.key)
        if row is None or self._i_pub[row]:
            return _refused(errors.NotPublished(f"{ev.key!r} is not an open allocation here"))
        if ev.by > ev.term:
            return _refused(errors.InvalidArgument(
                f"publishing term {ev.by} is above the command's {ev.term}"))
        if ev.term < self.term:
            return self._stale(ev.term)
        by = ev.by or ev.term
        self._i_pub[row], self._i_by[row], self._i_sum[row] = 1, by, ev.checksum
        self._i_req[row] = ev.requested
        if ev.by:           # a repaired replica: the object's allocation (RepairedEntry)
            self._i_term[row] = by
        self.term = max(self.term, ev.term)
        return (fm.StorageAccepted(ev.key, ev.term),)

    def _stamped_read(self, ev: fm.StampedRead) -> tuple:
        """Spec ``Read`` (node side): the fence first, then the entry or a miss."""
        if ev.term < self.term:
            return self._stale(ev.term)
        entry = self.entry(ev.key)
        if entry is None:
            return _refused(errors.KeyNotFound(f"{ev.key!r}"))
        return (fm.ReadReturned(ev.key, entry),)

    def _index_request(self, ev: fm.IndexRequest) -> tuple:
        """A recovering master asks for the index (O(n): it is copied out)."""
        if ev.term < self.term:
            return self._stale(ev.term)
        return (fm.IndexReturned(self.index_map()),)

    def _purge(self, ev: fm.PurgeUnpublished) -> tuple:
        """Drop unpublished allocations of terms below ``below`` (one vectorised scan)."""
        gone = self._unpublished_rows(ev.below)
        freed = sum(self._i_len[row] for _, row in gone)
        for _, row in gone:
            self._drop_entry(row)
        return (fm.Purged(tuple(k for k, _ in gone), freed),)

    def _unpublished_rows(self, below: int) -> list:
        """``(key, row)`` of the unpublished allocations of terms below
        ``below``, by key (one vectorised scan)."""
        size = len(self._i_pub)
        rows: list = []
        if self._idx.index and size:
            held = np.frombuffer(self._idx.owners, np.uint8, size) != 0
            pub = np.frombuffer(self._i_pub, np.int8, size)
            term = np.frombuffer(self._i_term, np.int64, size)
            rows = np.flatnonzero(held & (pub == 0) & (term < below)).tolist()
            del held, pub, term
        keys = self._idx.keys
        return sorted((keys[row], row) for row in rows)

    def unpublished(self, below: int) -> list[tuple]:
        """``(key, IndexEntry)`` of what ``PurgeUnpublished(below)`` would drop,
        by key: a read view (the step's ``Purged`` names only the keys, and a
        node frees their regions after it)."""
        return [(key, self._entry(row)) for key, row in self._unpublished_rows(below)]

    def _stamped_free(self, ev: fm.StampedFree) -> tuple:
        """Spec ``Remove`` (node side): the entry of allocation ``token`` goes."""
        row = self._idx.index.get(ev.key)
        if row is None or self._i_tok[row] != ev.token:
            return _refused(errors.StaleToken(f"{ev.key!r} is not held here with token {ev.token}"))
        if ev.term < self.term:
            return self._stale(ev.term)
        self._drop_entry(row)
        self.term = max(self.term, ev.term)
        return (fm.StorageAccepted(ev.key, ev.term),)

    def _drop_entry(self, row: int) -> None:
        self._idx.release(row, 1)

    def entry(self, key) -> Optional[fm.IndexEntry]:
        row = self._idx.index.get(key)
        return None if row is None else self._entry(row)

    def _entry(self, row: int) -> fm.IndexEntry:
        return fm.IndexEntry(self._i_term[row], bool(self._i_pub[row]), self._i_by[row],
                             self._i_off[row], self._i_len[row], self._i_sum[row],
                             self._i_tok[row], self._i_req[row])

    def index_columns(self) -> IndexColumns:
        """The index as :class:`~kvproto.cores.recovery.IndexColumns` (what an
        accepted ``IndexRequest`` returns, read from the columns without an
        object per entry but its key)."""
        size = len(self._i_pub)
        if self._idx.free:
            held = np.flatnonzero(np.frombuffer(self._idx.owners, np.uint8, size) != 0)
        else:                                # rows 0..n-1 all held: copied as slices
            held = slice(0, self._idx.size)
        keys = self._idx.keys[held].tolist()
        cols = {name: np.frombuffer(col, dtype, size)[held].copy() for name, col, dtype in (
            ("term", self._i_term, np.int64), ("published", self._i_pub, np.int8),
            ("by", self._i_by, np.int64), ("offset", self._i_off, np.int64),
            ("length", self._i_len, np.int64), ("token", self._i_tok, np.int64),
            ("checksum", self._i_sum, np.uint64), ("requested", self._i_req, np.int64))}
        return IndexColumns(keys, **cols)

    def index_map(self) -> immutables.Map:
        """The index as the reference's persistent map (O(n))."""
        return map_of((key, self._entry(row)) for key, row in self._idx.index.items())

    # ------------------------------------------------------------------ checks

    def reference(self) -> tuple[RegionTable, fm.StorageNode]:
        """The equal frozen values: ``(RegionTable, StorageNode)`` (O(n); for checks)."""
        regions = map_of((off, self.region(off)) for off in self._reg.index)
        return RegionTable(self.segment, regions), fm.StorageNode(self.term, self.index_map())

    def copy(self) -> "StorageNodeCore":
        """An independent copy."""
        new = StorageNodeCore.__new__(StorageNodeCore)
        new.segment, new.term = self.segment, self.term
        new._reg, new._idx = self._reg.copy(), self._idx.copy()
        new._r_key = dict(self._r_key)
        new._r_tok, new._r_len, new._r_done = self._r_tok[:], self._r_len[:], self._r_done[:]
        (new._i_term, new._i_pub, new._i_by, new._i_off, new._i_len, new._i_tok,
         new._i_sum, new._i_req) = (col[:] for col in self._index_columns())
        new._setup()
        return new


class _Regions(Mapping):
    """``offset -> Region``."""

    __slots__ = ("_core",)

    def __init__(self, core: StorageNodeCore) -> None:
        self._core = core

    def __getitem__(self, offset) -> Region:
        region = self._core.region(offset)
        if region is None:
            raise KeyError(offset)
        return region

    def __contains__(self, offset) -> bool:
        return offset in self._core._reg.index

    def __len__(self) -> int:
        return len(self._core._reg.index)

    def __iter__(self) -> Iterator:
        return iter(self._core._reg.index)


class _Index(Mapping):
    """``key -> IndexEntry``."""

    __slots__ = ("_core",)

    def __init__(self, core: StorageNodeCore) -> None:
        self._core = core

    def __getitem__(self, key) -> fm.IndexEntry:
        entry = self._core.entry(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key) -> bool:
        return key in self._core._idx.index

    def __len__(self) -> int:
        return len(self._core._idx.index)

    def __iter__(self) -> Iterator:
        return iter(self._core._idx.index)
