"""A takeover's directory rebuild on columns: the fast twin of
:func:`kvproto.statemachines.failover.rebuild_directory` followed by
:func:`kvproto.statemachines.publish.restored` (spec ``Recover``,
``RecoveredDir``).

A fenced storage node answers its index as :class:`IndexColumns` (one frame
per column, :meth:`IndexColumns.frames`), read straight from its
:class:`~kvproto.cores.storage.StorageNodeCore`'s columns; the new master
decodes them without a Python object per entry but its key
(:meth:`IndexColumns.from_frames`), joins each to a :class:`Rebuild` as it
arrives (one dict of the keys, which with one replica per object becomes the
directory's row index as it is) and rebuilds (:meth:`Rebuild.directory`,
:func:`recovered`): per key, of the published entries on live nodes, the one with the highest
publishing term, then the first node in name order, listed with every live
node that published that same allocation (same term and token) with the same
checksum, in node order; a replica of that allocation with another checksum
is left out and reported (``failover.checksum_mismatches``).
``tests/cores/test_recovery.py`` holds it to the reference on random indexes.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from itertools import chain, compress
from typing import Optional

import numpy as np

from kvproto.cores.directory import DirectoryCore
from kvproto.cores.rows import Rows
from kvproto.statemachines import failover as fm

#: the numeric columns, in frame order, with their dtypes
COLUMNS = (("term", np.int64), ("published", np.int8), ("by", np.int64),
           ("offset", np.int64), ("length", np.int64), ("token", np.int64),
           ("checksum", np.uint64), ("requested", np.int64))


class IndexColumns:
    """A storage node's index as columns: entry ``i`` is ``keys[i]`` with
    ``term[i]``, ``published[i]``, ``by[i]``, ``offset[i]``, ``length[i]``,
    ``token[i]``, ``checksum[i]``, ``requested[i]`` (an
    :class:`~kvproto.statemachines.failover.IndexEntry` each)."""

    __slots__ = ("keys",) + tuple(name for name, _ in COLUMNS)

    def __init__(self, keys: list, **columns) -> None:
        self.keys = keys
        for name, dtype in COLUMNS:
            value = np.ascontiguousarray(columns[name], dtype)
            if value.shape != (len(keys),):
                raise ValueError(f"index column {name} has {value.shape}, not ({len(keys)},)")
            setattr(self, name, value)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def of(cls, index: Mapping) -> "IndexColumns":
        """From a ``key -> IndexEntry`` map (the reference's shape)."""
        entries = list(index.values())
        return cls(list(index), **{name: [getattr(e, name) for e in entries]
                                   for name, _ in COLUMNS})

    def entries(self) -> dict:
        """``key -> IndexEntry`` (O(n); for checks)."""
        cols = [getattr(self, name).tolist() for name, _ in COLUMNS]
        return {key: fm.IndexEntry(term, bool(pub), by, off, length, checksum, tok, req)
                for key, term, pub, by, off, length, tok, checksum, req in zip(self.keys, *cols)}

    def frames(self) -> list:
        """The wire form: the keys joined, their end offsets, then one frame per column."""
        ends = np.cumsum(np.fromiter(map(len, self.keys), np.int64, len(self.keys)))
        return [b"".join(self.keys), ends.tobytes()] + \
            [memoryview(getattr(self, name)).cast("B") for name, _ in COLUMNS]

    @classmethod
    def from_frames(cls, frames: list, count: int) -> "IndexColumns":
        """Decode :meth:`frames` of ``count`` entries; ``ValueError`` if they
        are not that (sizes, key bounds). A key listed twice is refused when
        the index joins a :class:`Rebuild`."""
        if len(frames) != 2 + len(COLUMNS):
            raise ValueError(f"an index is {2 + len(COLUMNS)} frames, not {len(frames)}")
        blob = bytes(frames[0])
        columns = {}
        for (name, dtype), frame in zip((("ends", np.int64),) + COLUMNS, frames[1:]):
            data = memoryview(frame).cast("B")
            if len(data) != count * np.dtype(dtype).itemsize:
                raise ValueError(f"index column {name} holds {len(data)} bytes, not {count} entries")
            columns[name] = np.frombuffer(data, dtype)
        ends = columns.pop("ends")
        starts = np.concatenate(([0], ends[:-1])) if count else ends
        if count and (ends[-1] != len(blob) or (ends < starts).any() or starts[0] != 0):
            raise ValueError("index keys do not tile their frame")
        return cls(_split(blob, starts, ends), **columns)


def _split(blob: bytes, starts: np.ndarray, ends: np.ndarray) -> list[bytes]:
    """``[blob[a:b] for a, b in zip(starts, ends)]``, made in one pass (a
    fixed-width array's ``tolist``) when the keys have one width and none
    ends in a NUL byte (which that array would strip)."""
    n = len(ends)
    width = int(ends[0]) if n else 0
    if width and len(blob) == width * n and \
            np.frombuffer(blob, np.uint8)[width - 1::width].all() and \
            (ends == np.arange(width, width * n + 1, width)).all():
        return np.frombuffer(blob, f"S{width}").tolist()
    return [blob[a:b] for a, b in zip(array("q", starts.tobytes()), array("q", ends.tobytes()))]


class Rebuild:
    """The indexes of a takeover's fenced nodes, joined as they arrive
    (``add``), then rebuilt into the directory the new master opens with
    (``directory``, once).

    Every entry is numbered in order of arrival; ``seen`` maps each key to
    the number of its first entry. A key held by one node only (the usual
    case with one replica per object) needs nothing more: when no key is on
    two nodes and at most an eighth of the entries are left out (unpublished,
    or on nodes not live), ``seen`` becomes the directory's row index as it
    is, the entry numbers its rows and the entries left out free rows. Else
    the entries are grouped by key (their first entry's number), each group
    is rebuilt on columns and the rows are numbered afresh."""

    __slots__ = ("seen", "parts", "entries")

    def __init__(self) -> None:
        self.seen: dict = {}
        self.parts: list[tuple[str, IndexColumns, int, np.ndarray]] = []  # node, index, first, groups
        self.entries = 0

    def add(self, node: str, index: IndexColumns) -> None:
        """Join ``node``'s index; ``ValueError`` (and nothing joined) if it
        lists a key twice, or the node joined already."""
        if any(node == name for name, _, _, _ in self.parts):
            raise ValueError(f"node {node!r} joined the rebuild already")
        first, n = self.entries, len(index)
        groups = np.fromiter(map(self.seen.setdefault, index.keys, range(first, first + n)),
                             np.int64, n)
        own = np.arange(first, first + n)
        if ((groups >= first) & (groups != own)).any():
            for key in compress(index.keys, (groups == own).tolist()):
                del self.seen[key]
            raise ValueError("an index lists a key twice")
        self.parts.append((node, index, first, groups))
        self.entries += n

    def directory(self, capacities: Mapping[str, int], next_token: int,
                  rows: Optional[Rows] = None, mismatches: Optional[list] = None,
                  terms: Optional[dict] = None) -> DirectoryCore:
        """The directory of :func:`recovered` for the nodes joined (``seen``
        may become its row index: the rebuild is spent)."""
        ids = {name: i for i, name in enumerate(capacities)}
        parts, n = self.parts, self.entries
        live = sorted(node for node, _, _, _ in parts if node in ids)
        rank_of = {node: r for r, node in enumerate(live)}
        cat = {name: np.concatenate([getattr(ix, name) for _, ix, _, _ in parts] or
                                    [np.zeros(0, dtype)]) for name, dtype in COLUMNS}
        sid = _per_entry(parts, [ids.get(node, -1) for node, _, _, _ in parts], n)
        listed = (cat["published"] != 0) & (sid >= 0)
        kept = int(np.count_nonzero(listed))
        if not kept:
            return DirectoryCore._build(capacities, [], np.zeros(0, np.int64), np.zeros(0, np.int64),
                                        np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64),
                                        next_token, [0] * len(ids), rows, np.zeros(0, np.uint64))
        keys = np.fromiter(chain.from_iterable(ix.keys for _, ix, _, _ in parts), object, n)
        if len(self.seen) == n and n - kept <= n // 8:
            # no key on two nodes: each listed entry is its object's one replica
            if kept < n:
                for key in keys[~listed].tolist():
                    del self.seen[key]
                keys[~listed] = None
                cat = {name: col[listed] for name, col in cat.items()}
                sid = sid[listed]
            tokens, lengths = cat["token"], cat["length"]
            _term_ranges(cat["by"], tokens, terms)
            return DirectoryCore._build(
                capacities, (self.seen, keys, listed), tokens, lengths, sid[:, None],
                cat["offset"][:, None], max(next_token, int(tokens.max()) + 1),
                _sums(sid, lengths, len(ids)), rows, cat["checksum"], cat["requested"])
        rank = _per_entry(parts, [rank_of.get(node, -1) for node, _, _, _ in parts], n)
        group = np.concatenate([g for _, _, _, g in parts])
        return _grouped(capacities, ids, live, parts, cat, keys, sid, rank, group, listed,
                        next_token, rows, mismatches, terms)


def _per_entry(parts: list, values: list, n: int) -> np.ndarray:
    """Each entry's value of its part (node)."""
    if not parts:
        return np.zeros(0, np.int64)
    return np.repeat(np.array(values, np.int64), [len(ix) for _, ix, _, _ in parts])


def _sums(segments: np.ndarray, lengths: np.ndarray, count: int) -> list[int]:
    """Bytes taken per segment id."""
    used = np.zeros(count, np.int64)
    np.add.at(used, segments, lengths)
    return used.tolist()


def _term_ranges(by: np.ndarray, tokens: np.ndarray, terms: Optional[dict]) -> None:
    """Into ``terms``: each publishing term of the objects listed, with the
    least and greatest token of its objects."""
    if terms is None or not len(by):
        return
    values, which = np.unique(by, return_inverse=True)
    low = np.full(len(values), np.iinfo(np.int64).max, np.int64)
    high = np.full(len(values), np.iinfo(np.int64).min, np.int64)
    np.minimum.at(low, which, tokens)
    np.maximum.at(high, which, tokens)
    terms.update(zip(values.tolist(), zip(low.tolist(), high.tolist())))


def _grouped(capacities, ids, live, parts, cat, keys, sid, rank, group, listed, next_token,
             rows, mismatches, terms) -> DirectoryCore:
    """The rebuild when keys are on several nodes: per group (key), of its
    listed entries, the one with the highest ``by``, then the first in node
    order (``rank``), with every listed entry of that allocation (same ``by``
    and token) and checksum as its replicas, in node order."""
    n = len(group)
    entries = np.flatnonzero(listed)
    g, by, rk = group[entries], cat["by"][entries], rank[entries]
    top = np.full(n, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(top, g, by)
    candidate = by == top[g]
    best = np.full(n, len(live), np.int64)
    np.minimum.at(best, g[candidate], rk[candidate])
    head = candidate & (rk == best[g])              # one per group: ranks differ within a key
    chosen = entries[head]                          # the entry each key lists, in entry order
    obj = np.full(n, -1, np.int64)
    obj[g[head]] = np.arange(len(chosen))
    of = obj[g]                                     # each listed entry's object
    lead = chosen[of]
    tok, sums = cat["token"], cat["checksum"]
    same = (by == cat["by"][lead]) & (tok[entries] == tok[lead])
    agree = sums[entries] == sums[lead]
    if mismatches is not None:
        names = list(capacities)
        mismatches.extend(sorted((keys[i], names[sid[i]], int(cat["offset"][i]))
                                 for i in entries[same & ~agree].tolist()))
    keep = same & agree
    kept, owner = entries[keep], of[keep]           # replicas, in entry order, and their objects
    slot = np.empty(len(kept), np.int64)            # a replica's column: node order within its object
    count = np.zeros(len(chosen), np.int64)
    for node in live:
        _, ix, first, _ = next(p for p in parts if p[0] == node)
        lo, hi = np.searchsorted(kept, (first, first + len(ix)))
        block = owner[lo:hi]                        # one node: each object at most once
        slot[lo:hi] = count[block]
        count[block] += 1
    width = int(count.max())
    sids = np.full((len(chosen), width), -1, np.int64)
    offs = np.zeros((len(chosen), width), np.int64)
    sids[owner, slot] = sid[kept]
    offs[owner, slot] = cat["offset"][kept]
    lengths, tokens = cat["length"][chosen], tok[chosen]
    _term_ranges(cat["by"][chosen], tokens, terms)
    return DirectoryCore._build(capacities, keys[chosen].tolist(), tokens, lengths, sids, offs,
                                max(next_token, int(tokens.max()) + 1),
                                _sums(sid[kept], lengths[owner], len(ids)), rows, sums[chosen],
                                cat["requested"][chosen])


def recovered(capacities: Mapping[str, int], indexes: Mapping[str, IndexColumns],
              next_token: int, rows: Optional[Rows] = None,
              mismatches: Optional[list] = None, terms: Optional[dict] = None) -> DirectoryCore:
    """The directory a master opens with after fencing the nodes of
    ``capacities`` (the live ones) whose indexes are ``indexes``: equal to
    ``publish.restored(capacities, [(key, e.token, e.length, replicas,
    e.checksum, e.requested) for the entries of failover.rebuild_directory(indexes, live)],
    next_token)``. With a list ``mismatches``, appends to it
    ``failover.checksum_mismatches(indexes, live)``: the ``(key, node,
    offset)`` of each replica left out because its checksum differs from the
    listed one's. With a dict ``terms``, sets in it each publishing term of
    the listed objects (their entries' ``by``) to the least and greatest
    token of its objects (a repaired replica's publish carries its object's
    term: tokens grow across terms, so the ranges do not overlap).
    ``ValueError`` if an index lists a key twice, or the objects exceed a
    segment's capacity."""
    rebuild = Rebuild()
    for node in sorted(indexes):
        rebuild.add(node, indexes[node])
    return rebuild.directory(capacities, next_token, rows, mismatches, terms)
