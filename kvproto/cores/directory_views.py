"""The results of :class:`~kvproto.cores.directory.DirectoryCore` in the
reference's shape.

The effects of its batch steps folded (:func:`put_start_effects`,
:func:`put_end_effects`, :func:`remove_effects`, :func:`read_effects`, from a
batch's items and results), a ``read_many``'s results in columns (:class:`Reads`), a ``SegmentLost`` step's effects in columns
(:class:`Loss`) and the read-only views of its objects and segment ledgers
(the frozen ``Directory``'s ``objects`` and ``segments``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from kvproto.statemachines.publish import (
    AssignRegion, FreeRegion, ObjectRecord, Published, PutGranted, ReadGranted, Refused,
    Removed, RepairCancelled, Replica, SegmentLedger,
)

if TYPE_CHECKING:
    from kvproto.cores.directory import DirectoryCore


class Loss:
    """The effects of one ``SegmentLost`` step in columns.

    ``keys``, ``tokens`` and ``rows`` (arrays, in row order): the published
    objects forgotten whole, each with the single effect ``Removed(key,
    token)`` (their only replica was on the segment, none in repair); ``runs``:
    ``(row, effects)`` of every other object the step changed, in row order.
    :meth:`effects` is the tuple ``step`` returns (objects in row order);
    ``refused``: its single ``Refused`` effect, or ``()``."""

    __slots__ = ("refused", "keys", "tokens", "rows", "runs")

    def __init__(self, refused: tuple, keys=(), tokens=(), rows=()) -> None:
        self.refused, self.keys, self.tokens, self.rows = refused, keys, tokens, rows
        self.runs: list[tuple[int, tuple]] = []

    def effects(self) -> tuple:
        if self.refused:
            return self.refused
        bulk = ((row, (Removed(key, token),)) for row, key, token in
                zip(self.rows.tolist(), self.keys.tolist(), self.tokens.tolist()))
        return tuple(e for _, run in heapq.merge(bulk, self.runs, key=itemgetter(0)) for e in run)


def put_start_effects(items: Sequence[tuple], results: Sequence) -> tuple:
    """The effects of the steps :meth:`DirectoryCore.put_start_many` folded,
    from its ``items`` and ``results``."""
    out: list = []
    for (key, length, placement), token in zip(items, results):
        if type(token) is not int:
            out.append(Refused(token))
            continue
        out.append(PutGranted(key, token, tuple(placement)))
        out.extend(AssignRegion(r.segment, r.offset, length, key, token) for r in placement)
    return tuple(out)


def put_end_effects(items: Sequence[tuple], results: Sequence) -> tuple:
    """The effects of the steps :meth:`DirectoryCore.put_end_many` folded."""
    return tuple(Published(key, token) if type(r) is tuple else Refused(r)
                 for (key, token, _), r in zip(items, results))


def _dropped(key, token: int, length: int, freed: list, repairs: list) -> tuple:
    """The effects of freeing an object (:meth:`DirectoryCore._unhold`)."""
    out = [FreeRegion(segment, offset, token, length) for segment, offset in freed]
    for segment, offset, rid, free in repairs:
        out.append(RepairCancelled(key, token, rid, segment))
        if free:
            out.append(FreeRegion(segment, offset, token, length))
    return tuple(out)


def remove_effects(keys: Sequence, results: Sequence) -> tuple:
    """The effects of the steps :meth:`DirectoryCore.remove_many` folded."""
    out: list = []
    for key, r in zip(keys, results):
        if type(r) is not tuple:
            out.append(Refused(r))
            continue
        out.append(Removed(key, r[0]))
        out.extend(_dropped(key, *r))
    return tuple(out)


class Reads:
    """The results of :meth:`DirectoryCore.read_many` in columns, one entry
    per key (``token``, ``length``, ``checksum``: a refused key's 0s;
    ``replicas``: how many of ``segment``/``offset``, a refused key's none)
    and the keys refused, ``refused``: ``(index, error)`` in order."""

    __slots__ = ("token", "length", "checksum", "replicas", "segment", "offset", "refused")

    def __init__(self, token: list, length: list, checksum: list, replicas: list,
                 segment: list, offset: list, refused: list) -> None:
        self.token, self.length, self.checksum, self.replicas = token, length, checksum, replicas
        self.segment, self.offset, self.refused = segment, offset, refused


def read_effects(keys: Sequence, reads: Reads) -> tuple:
    """The effects of the steps :meth:`DirectoryCore.read_many` folded (an
    accepted ``ReadEnd`` has none)."""
    out: list = []
    refused, at = dict(reads.refused), 0
    for i, (key, token, length, checksum, n) in enumerate(zip(
            keys, reads.token, reads.length, reads.checksum, reads.replicas)):
        if i in refused:
            out.append(Refused(refused[i]))
            continue
        out.append(ReadGranted(key, token, tuple(
            Replica(s, o, length) for s, o in zip(reads.segment[at:at + n], reads.offset[at:at + n])),
            length, checksum))
        at += n
    return tuple(out)


# --------------------------------------------------------------------------
# Read views with the frozen Directory's shape
# --------------------------------------------------------------------------



class _Objects(Mapping):
    """``key -> ObjectRecord`` over a :class:`DirectoryCore` (records built on access)."""

    __slots__ = ("_core",)

    def __init__(self, core: DirectoryCore) -> None:
        self._core = core

    def __getitem__(self, key) -> ObjectRecord:
        record = self._core.record(key)
        if record is None:
            raise KeyError(key)
        return record

    def get(self, key, default=None):
        record = self._core.record(key)
        return default if record is None else record

    def __contains__(self, key) -> bool:
        row = self._core.rows.index.get(key)
        return row is not None and self._core._st[row] != 0

    def __len__(self) -> int:
        return self._core.count

    def __iter__(self) -> Iterator:
        return (key for key, _ in self._core._items())

    def items(self):
        core = self._core
        return [(key, core._record(row)) for key, row in core._items()]

    def values(self):
        core = self._core
        return [core._record(row) for _, row in core._items()]


class _Ledgers(Mapping):
    """``segment -> SegmentLedger`` over a :class:`DirectoryCore`."""

    __slots__ = ("_core",)

    def __init__(self, core: DirectoryCore) -> None:
        self._core = core

    def __getitem__(self, name: str) -> SegmentLedger:
        return self._core._ledgers[name].value()

    def __contains__(self, name) -> bool:
        return name in self._core._ledgers

    def __len__(self) -> int:
        return len(self._core._ledgers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._core._ledgers)
