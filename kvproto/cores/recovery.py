"""A takeover's directory rebuild on columns: the fast twin of
:func:`kvproto.statemachines.failover.rebuild_directory` followed by
:func:`kvproto.statemachines.publish.restored` (spec ``Recover``,
``RecoveredDir``).

A fenced storage node answers its index as :class:`IndexColumns` (one frame
per column, :meth:`IndexColumns.frames`), read straight from its
:class:`~kvproto.cores.storage.StorageNodeCore`'s columns; the new master
decodes them without a Python object per entry but its key
(:meth:`IndexColumns.from_frames`) and rebuilds with :func:`recovered`: per
key, of the published entries on live nodes, the one with the highest
publishing term, then the first node in name order, listed with every live
node that published that same allocation (same term and token) with the same
checksum, in node order; a replica of that allocation with another checksum
is left out and reported (``failover.checksum_mismatches``).
``tests/cores/test_recovery.py`` holds it to the reference on random indexes.
"""

from __future__ import annotations

from collections.abc import Mapping
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
        are not that (sizes, key bounds, a key twice)."""
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
        keys = [blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        if len(set(keys)) != count:
            raise ValueError("an index lists a key twice")
        return cls(keys, **columns)


def recovered(capacities: Mapping[str, int], indexes: Mapping[str, IndexColumns],
              next_token: int, rows: Optional[Rows] = None,
              mismatches: Optional[list] = None) -> DirectoryCore:
    """The directory a master opens with after fencing the nodes of
    ``capacities`` (the live ones) whose indexes are ``indexes``: equal to
    ``publish.restored(capacities, [(key, e.token, e.length, replicas,
    e.checksum, e.requested) for the entries of failover.rebuild_directory(indexes, live)],
    next_token)``. With a list ``mismatches``, appends to it
    ``failover.checksum_mismatches(indexes, live)``: the ``(key, node,
    offset)`` of each replica left out because its checksum differs from the
    listed one's."""
    live = [node for node in sorted(indexes) if node in capacities]
    ids = {name: i for i, name in enumerate(capacities)}
    parts = [(ids[node], indexes[node]) for node in live]
    keys: list = []
    for _, ix in parts:
        keys.extend(ix.keys)
    cat = {name: np.concatenate([getattr(ix, name) for _, ix in parts] or [np.zeros(0, dtype)])
           for name, dtype in COLUMNS}
    node = np.concatenate([np.full(len(ix), sid, np.int64) for sid, ix in parts] or [np.zeros(0, np.int64)])
    # the order of ``live`` is the node order; ids follow ``capacities``
    rank = np.concatenate([np.full(len(ix), r, np.int64) for r, (_, ix) in enumerate(parts)]
                          or [np.zeros(0, np.int64)])
    pub = np.flatnonzero(cat["published"] != 0)
    if len(pub) < len(keys):
        keys = [keys[i] for i in pub.tolist()]
        cat = {name: col[pub] for name, col in cat.items()}
        node, rank = node[pub], rank[pub]
    n = len(keys)
    if not n:
        return DirectoryCore._build(capacities, [], np.zeros(0, np.int64), np.zeros(0, np.int64),
                                    np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64),
                                    next_token, [0] * len(ids), rows, np.zeros(0, np.uint64))
    # group the entries by key: the group of a key is the position of its last entry
    last = dict(zip(keys, range(n)))
    group = np.fromiter(map(last.__getitem__, keys), np.int64, n)
    by, tok, sums = cat["by"], cat["token"], cat["checksum"]
    order = np.lexsort((rank, -by, group))          # per key: highest ``by``, then node order
    g = group[order]
    head = np.ones(n, bool)
    head[1:] = g[1:] != g[:-1]
    starts = np.flatnonzero(head)
    chosen = order[starts]                          # the entry each key lists
    per = np.diff(np.append(starts, n))
    same = (by[order] == np.repeat(by[chosen], per)) & (tok[order] == np.repeat(tok[chosen], per))
    agree = sums[order] == np.repeat(sums[chosen], per)
    if mismatches is not None:
        names_of = list(capacities)
        offsets = cat["offset"]
        mismatches.extend(sorted((keys[i], names_of[node[i]], int(offsets[i]))
                                 for i in order[same & ~agree].tolist()))
    same &= agree
    kept = order[same]                              # its replicas, by key then node order
    owner = np.repeat(np.arange(len(chosen)), per)[same]
    count = np.bincount(owner, minlength=len(chosen))
    width = int(count.max())
    col = np.arange(len(kept)) - np.repeat(np.cumsum(count) - count, count)
    sids = np.full((len(chosen), width), -1, np.int64)
    offs = np.zeros((len(chosen), width), np.int64)
    sids[owner, col] = node[kept]
    offs[owner, col] = cat["offset"][kept]
    lengths = cat["length"][chosen]
    tokens = tok[chosen]
    used = np.zeros(len(ids), np.int64)
    np.add.at(used, node[kept], lengths[owner])
    names = [keys[i] for i in chosen.tolist()]
    next_token = max(next_token, int(tokens.max()) + 1)
    return DirectoryCore._build(capacities, names, tokens, lengths, sids, offs, next_token,
                                used.tolist(), rows, sums[chosen], cat["requested"][chosen])
