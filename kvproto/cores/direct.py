"""A storage node's regions granted to direct writers as a mutable, compact core.

Reference machine: :class:`kvproto.statemachines.directwrite.DirectTable`
stepped by :func:`kvproto.statemachines.directwrite.node_step`
(``spec/DirectWrite.tla``). :class:`DirectCore` takes the same events
(``GrantDirect``, ``WriteReported``, ``PublishDirect``, ``FreeDirect``,
``Drain``) and returns the same effects; a refused event returns the same
single ``Refused`` effect and changes nothing. :meth:`DirectCore.reference`
gives the equal frozen ``DirectTable``.

Layout: offsets number rows (:class:`~kvproto.cores.rows.Rows`); per row flat
columns hold the token, the writer (names interned to small ints: a node has
a writer per client process), the state and whether the write was reported.
A region published by its direct writer stays in the table until it is
freed, so the table grows with the objects a node stores: no Python object
per region, so the garbage collector never walks it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from typing import Optional

import immutables
import numpy as np

from kvproto import errors
from kvproto.cores.rows import Rows, grow, put
from kvproto.statemachines.directwrite import (
    DirectRegion, DirectTable, Drain, Drained, Draining, FreeDirect, Freed, GrantDirect,
    PublishDirect, RegionState, WriteReported,
)
from kvproto.statemachines.refusal import Refused

#: state column values
GRANTED, PUBLISHED, DRAINING = 1, 2, 3
_STATE = {GRANTED: RegionState.GRANTED, PUBLISHED: RegionState.PUBLISHED,
          DRAINING: RegionState.DRAINING}
_CODE = {state: code for code, state in _STATE.items()}


def _refused(error: errors.KvError) -> tuple:
    return (Refused(error),)


class DirectCore:
    """A node's direct regions: ``step(event) -> effects``, mutating in place.

    Read it through :attr:`regions` (offset -> :class:`DirectRegion`, built on
    access), as one reads the frozen ``DirectTable``, or :meth:`unreported`."""

    __slots__ = ("_rows", "_tok", "_wid", "_st", "_wrote", "_writers", "_writer_ids",
                 "_handlers", "regions")

    def __init__(self) -> None:
        self._rows = Rows()                 # offset -> row
        self._tok, self._wid = array("q"), array("I")
        self._st, self._wrote = array("b"), array("b")
        self._writers: list[str] = []       # writer id -> name
        self._writer_ids: dict[str, int] = {}
        self._setup()

    def _setup(self) -> None:
        self._handlers = {
            GrantDirect: self._grant, WriteReported: self._reported,
            PublishDirect: self._publish, FreeDirect: self._free, Drain: self._drain,
        }
        self.regions = _Regions(self)
        self._rows.attach(lambda size: grow(self._columns(), size))

    def _columns(self) -> tuple:
        return (self._tok, self._wid, self._st, self._wrote)

    def step(self, event) -> tuple:
        """Apply one event (those of ``directwrite.node_step``)."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a direct-write event: {event!r}") from None
        return handler(event)

    def _held(self, offset, token: int) -> Optional[int]:
        """The row of the region at ``offset`` if ``token`` holds it."""
        row = self._rows.index.get(offset)
        return row if row is not None and self._tok[row] == token else None

    def _grant(self, ev: GrantDirect) -> tuple:
        err = self.grant(ev.offset, ev.token, ev.writer)
        return () if err is None else _refused(err)

    def grant(self, offset, token: int, writer: str) -> Optional[errors.KvError]:
        """``GrantDirect(offset, token, writer)`` without an event object:
        ``None`` (applied) or the refusal's error (nothing changed)."""
        row = self._rows.index.get(offset)
        if row is not None:
            return errors.RegionMismatch(
                f"region {offset} is still {_STATE[self._st[row]].value} for token "
                f"{self._tok[row]}")
        wid = self._writer_ids.get(writer)
        if wid is None:
            wid = self._writer_ids[writer] = len(self._writers)
            self._writers.append(writer)
        row = self._rows.acquire(offset, 1)
        self._tok[row], self._wid[row], self._st[row], self._wrote[row] = token, wid, GRANTED, 0
        return None

    def vacant(self, offsets: list) -> bool:
        """Whether no region of ``offsets`` is in the table (each one's
        ``GrantDirect`` is accepted; no other offset is held or draining)."""
        return self._rows.index.keys().isdisjoint(offsets)

    def grant_many(self, offsets: list, tokens: list, writers: list) -> bool:
        """:meth:`grant` of each region in turn when every one is accepted:
        True, all applied; else False and nothing changed. Every one is
        accepted when the offsets are distinct and none has a row here."""
        rows = self._rows
        if len(set(offsets)) != len(offsets) or not self.vacant(offsets):
            return False
        ids = self._writer_ids
        for writer in dict.fromkeys(writers):
            if writer not in ids:
                ids[writer] = len(self._writers)
                self._writers.append(writer)
        at = rows.acquire_new(offsets, 1)
        for col, value in ((self._tok, tokens), (self._wid, [ids[w] for w in writers]),
                           (self._st, GRANTED), (self._wrote, 0)):
            put(col, at, value)
        return True

    def _reported(self, ev: WriteReported) -> tuple:
        err = self.report(ev.offset, ev.token)
        return () if err is None else _refused(err)

    def report(self, offset, token: int) -> Optional[errors.KvError]:
        """``WriteReported(offset, token)`` without an event object: ``None``
        (applied) or the refusal's error (nothing changed)."""
        row = self._held(offset, token)
        if row is None or self._wrote[row]:
            return errors.StaleToken(f"region {offset} holds no unreported write of token {token}")
        self._wrote[row] = 1
        return None

    def _publish(self, ev: PublishDirect) -> tuple:
        err = self.publish(ev.offset, ev.token)
        return () if err is None else _refused(err)

    def publish(self, offset, token: int) -> Optional[errors.KvError]:
        """``PublishDirect(offset, token)`` without an event object: ``None``
        (applied) or the refusal's error (nothing changed)."""
        row = self._held(offset, token)
        if row is None or self._st[row] != GRANTED or not self._wrote[row]:
            return errors.StaleToken(
                f"region {offset} holds no finished direct write of token {token}")
        self._st[row] = PUBLISHED
        return None

    def publishable(self, offsets: list, tokens: list, shown: list) -> list:
        """Per region, None where its token does not hold it, else whether
        ``PublishDirect`` is accepted after ``WriteReported`` where ``shown``
        (its write shows done in the region's word; nothing is stepped)."""
        return self._publishable(list(map(self._rows.index.get, offsets)), tokens, shown)

    def _publishable(self, rows: list, tokens: list, shown: list) -> list:
        """:meth:`publishable` of the regions at ``rows`` (None where none)."""
        tok, st, wrote = self._tok, self._st, self._wrote
        return [None if row is None or tok[row] != token
                else st[row] == GRANTED and bool(wrote[row] or seen)
                for row, token, seen in zip(rows, tokens, shown)]

    def publish_many(self, offsets: list, tokens: list, shown: list) -> bool:
        """``WriteReported`` where ``shown`` and not yet reported, then
        ``PublishDirect``, of each region in turn, when every
        ``PublishDirect`` is accepted (:meth:`publishable`, the offsets
        distinct): True, all applied; else False and nothing changed."""
        rows = list(map(self._rows.index.get, offsets))
        if len(set(rows)) != len(rows) or not all(self._publishable(rows, tokens, shown)):
            return False
        at = np.array(rows, np.intp)
        put(self._wrote, at, 1)
        put(self._st, at, PUBLISHED)
        return True

    def freeable(self, offsets: list, tokens: list) -> list:
        """Per region, None where its token does not hold it, else whether
        ``FreeDirect`` frees it whatever its writer's liveness (not draining,
        its write reported; nothing is stepped)."""
        return self._freeable(list(map(self._held, offsets, tokens)))

    def _freeable(self, rows: list) -> list:
        """:meth:`freeable` of the regions at ``rows`` (None where none)."""
        st, wrote = self._st, self._wrote
        return [None if row is None else st[row] != DRAINING and bool(wrote[row])
                for row in rows]

    def free_many(self, offsets: list, tokens: list) -> bool:
        """``FreeDirect`` of each region in turn when every one is held by its
        token and :meth:`freeable` (each one then ``Freed``): True, all
        applied; else False and nothing changed."""
        rows = list(map(self._held, offsets, tokens))
        if len(set(rows)) != len(rows) or not all(self._freeable(rows)):
            return False
        release = self._rows.release
        for row in rows:
            release(row, 1)
        return True

    def _free(self, ev: FreeDirect) -> tuple:
        row = self._held(ev.offset, ev.token)
        if row is None or self._st[row] == DRAINING:
            return _refused(errors.StaleToken(
                f"region {ev.offset} is not held by token {ev.token}"))
        if self._st[row] == GRANTED and not self._wrote[row] and ev.writer_alive:
            self._st[row] = DRAINING
            return (Draining(ev.offset),)
        self._rows.release(row, 1)
        return (Freed(ev.offset),)

    def _drain(self, ev: Drain) -> tuple:
        row = self._rows.index.get(ev.offset)
        if row is None or self._st[row] != DRAINING:
            return _refused(errors.StaleToken(f"region {ev.offset} is not draining"))
        if ev.writer_alive and not self._wrote[row]:
            return _refused(errors.BufferQuarantined(
                f"region {ev.offset}: writer {self._writers[self._wid[row]]} may still write it"))
        self._rows.release(row, 1)
        return (Drained(ev.offset),)

    # ------------------------------------------------------------------ reading

    def unreported(self, offset, token: int) -> bool:
        """Whether ``token`` holds the region at ``offset`` and its write was
        not reported yet (what ``WriteReported`` needs)."""
        row = self._held(offset, token)
        return row is not None and not self._wrote[row]

    def held(self, offset, token: int) -> Optional[tuple[RegionState, bool]]:
        """``(state, reported)`` of the region at ``offset`` if ``token``
        holds it, else None: the :class:`DirectRegion` view's fields without
        building it."""
        row = self._held(offset, token)
        return None if row is None else (_STATE[self._st[row]], bool(self._wrote[row]))

    def _region(self, row: int) -> DirectRegion:
        return DirectRegion(self._tok[row], self._writers[self._wid[row]],
                            _STATE[self._st[row]], bool(self._wrote[row]))

    def reference(self) -> DirectTable:
        """The equal frozen ``DirectTable`` (O(n))."""
        return DirectTable(immutables.Map({offset: self._region(row)
                                           for offset, row in self._rows.index.items()}))

    def copy(self) -> "DirectCore":
        new = DirectCore.__new__(DirectCore)
        new._rows = self._rows.copy()
        new._tok, new._wid = array("q", self._tok), array("I", self._wid)
        new._st, new._wrote = array("b", self._st), array("b", self._wrote)
        new._writers, new._writer_ids = list(self._writers), dict(self._writer_ids)
        new._setup()
        return new


class _Regions(Mapping):
    """``offset -> DirectRegion`` over a :class:`DirectCore` (built on access)."""

    __slots__ = ("_core",)

    def __init__(self, core: DirectCore) -> None:
        self._core = core

    def __getitem__(self, offset) -> DirectRegion:
        row = self._core._rows.index.get(offset)
        if row is None:
            raise KeyError(offset)
        return self._core._region(row)

    def get(self, offset, default=None):
        row = self._core._rows.index.get(offset)
        return default if row is None else self._core._region(row)

    def __contains__(self, offset) -> bool:
        return offset in self._core._rows.index

    def __len__(self) -> int:
        return len(self._core._rows.index)

    def __iter__(self) -> Iterator:
        return iter(list(self._core._rows.index))

    def items(self):
        core = self._core
        return [(offset, core._region(row)) for offset, row in core._rows.index.items()]
