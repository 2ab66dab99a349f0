"""The bulk construction of :class:`~kvproto.cores.directory.DirectoryCore`
and the column layout it shares with the core.

:class:`DirectoryBuild` gives the core its constructors of many published
objects at once: from records (:meth:`~DirectoryBuild.restored`, the
drop-in for ``publish.restored``) and from the columns an index frame
decodes to (:meth:`~DirectoryBuild.from_columns`), writing the core's
columns with vectorised stores and no Python object per object but its key
and row.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np

from kvproto.cores.rows import Rows

if TYPE_CHECKING:
    from kvproto.cores.directory import DirectoryCore

#: status column values (0: the row holds no object of this directory)
PENDING, PUBLISHED = 1, 2
#: replicas kept in the row's own columns; more go to the overflow dict
INLINE = 2
#: ``nrep`` of a row whose replicas are all in the overflow dict
OVERFLOW = 255
#: segment ids from here on do not fit the 16-bit columns (overflow path)
SEGMENT_ID_LIMIT = 0xFFFF


class DirectoryBuild:
    """The classmethods that build a :class:`~kvproto.cores.directory.DirectoryCore`
    of published objects in bulk (the core's base class)."""

    __slots__ = ()

    @classmethod
    def restored(cls, capacities: Mapping[str, int], objects: Iterable[tuple], next_token: int,
                 rows: Optional[Rows] = None) -> "DirectoryCore":
        """:func:`kvproto.statemachines.publish.restored` as a core: every
        ``(key, token, length, replicas[, checksum])`` published on its replicas on live
        segments (others dropped; an object left with none is not listed), the
        segments of ``capacities`` live with those bytes taken, tokens from
        ``next_token``. A replica whose length is not its object's is refused
        with ``ValueError`` (the protocol never makes one)."""
        ids = {name: i for i, name in enumerate(capacities)}
        used = [0] * len(ids)
        listed: dict = {}
        for key, token, length, replicas, *extra in objects:
            checksum, requested = (list(extra) + [0, 0])[:2]
            kept = []
            for r in replicas:
                s = ids.get(r.segment)
                if s is not None:
                    if r.length != length:
                        raise ValueError(f"replica of {key!r} has length {r.length}, not {length}")
                    kept.append((s, r.offset))
                    used[s] += length
            if kept:
                listed[key] = (token, length, kept, checksum, requested)
                next_token = max(next_token, token + 1)
        width = max((len(k) for _, _, k, _, _ in listed.values()), default=1)
        n = len(listed)
        sids = np.full((n, width), -1, np.int64)
        offs = np.zeros((n, width), np.int64)
        for i, (_, _, kept, _, _) in enumerate(listed.values()):
            for j, (s, o) in enumerate(kept):
                sids[i, j], offs[i, j] = s, o
        tokens = np.fromiter((t for t, _, _, _, _ in listed.values()), np.int64, n)
        lengths = np.fromiter((l for _, l, _, _, _ in listed.values()), np.int64, n)
        sums = np.fromiter((c for _, _, _, c, _ in listed.values()), np.uint64, n)
        req = np.fromiter((r for _, _, _, _, r in listed.values()), np.int64, n)
        return cls._build(capacities, list(listed), tokens, lengths, sids, offs, next_token,
                          used, rows, sums, req)

    @classmethod
    def from_columns(cls, capacities: Mapping[str, int], segments: Sequence[str],
                     keys: bytes, key_offsets, tokens, lengths, replica_segments,
                     replica_offsets, next_token: int,
                     rows: Optional[Rows] = None, checksums=None,
                     requested=None) -> "DirectoryCore":
        """:meth:`restored` from columns, as a columnar index frame decodes:
        object ``i`` has key ``keys[key_offsets[i]:key_offsets[i + 1]]``, token
        ``tokens[i]``, length ``lengths[i]``, checksum ``checksums[i]`` (none:
        0), requested replica count ``requested[i]`` (none, or 0: the replicas
        it has) and replicas ``(segments[j], replica_offsets[i, c])`` for each
        ``j = replica_segments[i, c] >= 0``. Keys must be distinct. No Python
        object is made per object but its key and row."""
        tokens = np.asarray(tokens, np.int64)
        lengths = np.asarray(lengths, np.int64)
        sums = np.zeros(len(tokens), np.uint64) if checksums is None else \
            np.asarray(checksums, np.uint64)
        req = np.zeros(len(tokens), np.int64) if requested is None else \
            np.asarray(requested, np.int64)
        rsegs = np.asarray(replica_segments, np.int64)
        roffs = np.asarray(replica_offsets, np.int64)
        if rsegs.ndim == 1:
            rsegs, roffs = rsegs[:, None], roffs[:, None]
        ids = {name: i for i, name in enumerate(capacities)}
        lut = np.full(len(segments) + 1, -1, np.int64)   # the last entry maps -1 to -1
        for j, name in enumerate(segments):
            lut[j] = ids.get(name, -1)
        sids = lut[rsegs]
        kept = sids >= 0
        used = np.zeros(len(ids), np.int64)
        np.add.at(used, sids[kept], np.broadcast_to(lengths[:, None], sids.shape)[kept])
        if kept.all():
            offs, listed = roffs, kept[:, 0]
        else:
            order = np.argsort(~kept, axis=1, kind="stable")   # kept replicas first, in order
            sids = np.take_along_axis(sids, order, 1)
            offs = np.take_along_axis(roffs, order, 1)
            listed = kept.any(1)
        names = _slices(keys, np.asarray(key_offsets, np.int64), listed)
        if not listed.all():
            tokens, lengths, sids, offs = tokens[listed], lengths[listed], sids[listed], offs[listed]
            sums, req = sums[listed], req[listed]
        if len(tokens):
            next_token = max(next_token, int(tokens.max()) + 1)
        return cls._build(capacities, names, tokens, lengths, sids, offs, next_token,
                          used.tolist(), rows, sums, req)

    @classmethod
    def _build(cls, capacities, keys, tokens, lengths, sids, offs, next_token: int,
               used: Sequence[int], rows: Optional[Rows], sums, requested=None) -> "DirectoryCore":
        """A directory of published objects: ``keys`` (a list) at rows
        ``0..n-1``, or ``(index, names, held)`` (:meth:`Rows.adopt`) at the
        held rows in row order; ``sids``/``offs`` (n x width, kept replicas
        first, -1 after) in the ids of ``capacities``, checksums ``sums``,
        requested counts ``requested`` (none, or below the replicas kept: the
        replicas kept)."""
        core = cls(rows)
        for (name, capacity), u in zip(capacities.items(), used):
            core._join(name, capacity, capacity - u)
        if any(l.free < 0 for l in core._by_id):
            raise ValueError("recovered objects exceed a segment's capacity")
        if isinstance(keys, list):
            core.rows.bulk(keys, cls.BIT)
            at = slice(0, len(keys))
        else:
            core.rows.adopt(*keys, cls.BIT)
            held = keys[2]
            at = slice(0, len(held)) if held.all() else np.flatnonzero(held)
        n = len(tokens)
        core.count, core.next_token = n, next_token
        if not n:
            return core
        width = sids.shape[1]
        nrep = (sids >= 0).sum(1)
        inline = (nrep <= INLINE) & (sids[:, :min(width, INLINE)] < SEGMENT_ID_LIMIT).all(1)
        every = bool(inline.all())             # no overflow: the columns as they are

        def kept(values, mask=inline, other=0):
            return values if every and mask is inline else np.where(mask, values, other)

        req = nrep if requested is None else np.maximum(np.asarray(requested, np.int64), nrep)
        cols = {"_st": PUBLISHED, "_tok": tokens, "_len": lengths, "_sum": sums,
                "_req": np.minimum(req, 0xFFFF), "_nrep": kept(nrep, other=OVERFLOW),
                "_s0": kept(sids[:, 0]), "_o0": kept(offs[:, 0])}
        if width > 1:
            cols["_s1"] = kept(sids[:, 1], inline & (nrep > 1))
            cols["_o1"] = kept(offs[:, 1], inline & (nrep > 1))
        size = len(core.rows.owners)           # the columns grew to it when the rows filled
        for name, values in cols.items():
            col = getattr(core, name)
            view = np.frombuffer(col, np.dtype(col.typecode), size)
            view[at] = values
            del view                           # the column may grow again
        rows_of = np.arange(at.start, at.stop) if isinstance(at, slice) else at
        for i in np.flatnonzero(~inline).tolist():
            core._extra[int(rows_of[i])] = tuple(
                (s, o) for s, o in zip(sids[i].tolist(), offs[i].tolist()) if s >= 0)
        return core


def _slices(blob: bytes, offsets: np.ndarray, listed: np.ndarray) -> list[bytes]:
    """``blob[offsets[i]:offsets[i + 1]]`` for each listed ``i``. The bounds are
    taken one at a time (no list of n ints outlives the loop to leave the
    allocator's arenas fragmented under the keys)."""
    starts, ends = offsets[:-1], offsets[1:]
    if listed.all():
        widths = ends - starts
        if len(widths) and widths[0] > 0 and (widths == widths[0]).all():
            w, first = int(widths[0]), int(starts[0])
            return [blob[i:i + w] for i in range(first, first + w * len(widths), w)]
    else:
        starts, ends = starts[listed], ends[listed]
    return [blob[a:b] for a, b in zip(array("q", starts.tobytes()), array("q", ends.tobytes()))]
