"""Row numbers for keys, shared by the cores whose columns they index.

A core keeps one row per key in flat columns (:mod:`array` arrays, one value
per row); :class:`Rows` hands out the row numbers. Two cores may share one
:class:`Rows` — the master's directory and its lease table do, since every
published object is cached — so a key has one row in both and each core marks
the rows it holds with its own owner bit; a row is free again once no core
holds it, and free rows are reused last-in first-out. Rows released in bulk
(:meth:`Rows.release_many`, a lost segment's objects) leave their keys in the
index until :meth:`Rows.sweep` takes them out, a bounded number at a time.

Per key the only Python objects are the key itself and its row ``int``: a dict
key -> row, and a numpy object array row -> key (8 bytes a row). Neither is
walked by the cyclic garbage collector — the dict is untracked while its keys
and values are atomic (bytes, str, int), and numpy does not expose an array's
elements to it — so a full collection does not visit ten million keys, as it
would through a list (about 0.1 s). Keys must not be containers that could
close a reference cycle (the protocol's are bytes and strings).
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Callable, Hashable, Iterable, Optional

import numpy as np


def grow(columns: Iterable[array], size: int) -> None:
    """Extend each column with zeros up to ``size`` rows."""
    for col in columns:
        missing = size - len(col)
        if missing > 0:
            col.frombytes(bytes(missing * col.itemsize))


def put(col: array, rows: np.ndarray, value) -> None:
    """``col[row] = value`` (one value, or one per row) for each of ``rows``."""
    view = np.frombuffer(col, col.typecode, len(col))
    view[rows] = value
    del view                                # the column may grow again


class Rows:
    """Keys to row numbers and back, with a free list and per-row owner bits.

    ``index`` maps key -> row, ``keys`` row -> key (None for a free row). Cores
    that number their columns by these rows :meth:`attach` a grow callback:
    whenever a new row passes the allocated size, every attached core grows
    its columns (by an eighth, so appends cost O(1) amortised and a column
    carries at most 12.5% slack)."""

    __slots__ = ("index", "keys", "owners", "free", "stale", "size", "_growers")

    def __init__(self) -> None:
        self.index: dict = {}
        self.keys = np.empty(0, object)
        self.owners = array("B")
        self.free = array("q")
        self.stale = array("q")            # released in bulk, in ``index`` until swept
        self.size = 0                      # rows allocated (held or free)
        self._growers: list[Callable[[int], None]] = []

    def attach(self, grower: Callable[[int], None]) -> None:
        """Call ``grower(size)`` now and whenever the row space grows."""
        self._growers.append(grower)
        grower(len(self.owners))

    def _extend(self, needed: int) -> None:
        capacity = max(needed, len(self.owners) + (len(self.owners) >> 3) + 64)
        grow((self.owners,), capacity)
        keys = np.empty(capacity, object)
        keys[:len(self.keys)] = self.keys
        self.keys = keys
        for grower in self._growers:
            grower(capacity)

    def acquire(self, key: Hashable, bit: int) -> int:
        """The row of ``key``, allocated if it has none; ``bit`` now holds it."""
        row = self.index.get(key)
        if row is not None:
            self.owners[row] |= bit
            return row
        if self.stale:                     # amortised: one for each new key
            self._sweep_one()
        if self.free:
            row = self.free.pop()
        else:
            row = self.size
            self.size += 1
            if row >= len(self.owners):
                self._extend(row + 1)
        self.index[key] = row
        self.keys[row] = key
        self.owners[row] = bit
        return row

    def acquire_new(self, keys: list, bit: int) -> np.ndarray:
        """:meth:`acquire` of each of ``keys`` in turn, for keys that have no
        row (distinct, none in ``index``: the caller checked): their rows, in
        order, now held by ``bit``."""
        n = len(keys)
        for _ in range(min(n, len(self.stale))):   # one for each new key, as acquire
            self._sweep_one()
        reused = min(n, len(self.free))
        rows = np.empty(n, np.intp)
        if reused:                          # popped last-in first-out, as acquire
            rows[:reused] = np.frombuffer(self.free, np.int64)[::-1][:reused]
            del self.free[len(self.free) - reused:]
        if reused < n:
            rows[reused:] = np.arange(self.size, self.size + n - reused)
            self.size += n - reused
            if self.size > len(self.owners):
                self._extend(self.size)
        self.index.update(zip(keys, rows.tolist()))
        self.keys[rows] = np.fromiter(keys, object, n)
        owners = np.frombuffer(self.owners, np.uint8, len(self.owners))
        owners[rows] = bit
        del owners                          # the column may grow again
        return rows

    def release(self, row: int, bit: int) -> None:
        """``bit`` no longer holds ``row``; the row is free once nothing does."""
        left = self.owners[row] & ~bit
        self.owners[row] = left
        if not left:
            del self.index[self.keys[row]]
            self.keys[row] = None
            self.free.append(row)

    def release_many(self, rows: np.ndarray, bit: int) -> None:
        """:meth:`release` of each of ``rows`` (distinct), vectorised: the rows no
        core holds any more are free once :meth:`sweep` has taken their keys
        out of ``index`` (until then a lookup finds such a row, held by no
        core: the cores read it as absent, and :meth:`acquire` of its key
        holds it again)."""
        if not len(rows):
            return
        owners = np.frombuffer(self.owners, np.uint8, len(self.owners))
        owners[rows] &= ~bit & 0xFF
        freed = rows[owners[rows] == 0]
        del owners                          # the column may grow again
        self.stale.frombytes(np.ascontiguousarray(freed, np.int64).tobytes())

    def sweep(self, limit: int) -> int:
        """Free up to ``limit`` of the rows :meth:`release_many` left for it
        (a row held again since stays held); returns how many are left."""
        stale = self.stale
        cut = max(0, len(stale) - limit)
        if cut == len(stale):
            return cut
        todo = np.unique(np.frombuffer(stale, np.int64)[cut:])
        del stale[cut:]
        held = np.frombuffer(self.owners, np.uint8, len(self.owners))[todo] != 0
        named = self.keys[todo]
        done = todo[~held & (named != None)]   # noqa: E711 (elementwise)
        deque(map(self.index.__delitem__, self.keys[done].tolist()), 0)
        self.keys[done] = None
        self.free.frombytes(done[::-1].tobytes())
        return cut

    def _sweep_one(self) -> None:
        row = self.stale.pop()
        key = self.keys[row]
        if not self.owners[row] and key is not None:
            del self.index[key]
            self.keys[row] = None
            self.free.append(row)

    def row(self, key: Hashable) -> Optional[int]:
        return self.index.get(key)

    def bulk(self, keys: list, bit: int) -> None:
        """Fill an empty :class:`Rows` with ``keys`` at rows ``0..n-1``, all
        held by ``bit``. Keys must be distinct."""
        if self.size:
            raise ValueError("bulk filling needs empty rows")
        n = len(keys)
        rows = range(n)
        self.index = dict(zip(keys, rows))
        if len(self.index) != n:
            raise ValueError("a key repeats")
        self.keys = np.fromiter(keys, object, n)
        self.size = n
        self.owners = array("B", bytes([bit])) * n if n else array("B")
        for grower in self._growers:
            grower(n)

    def adopt(self, index: dict, keys: np.ndarray, held: np.ndarray, bit: int) -> None:
        """Fill an empty :class:`Rows` with rows ``0..len(keys)-1``: ``index``
        (key -> row, taken over as it is) holds the rows where ``held`` is
        true, each held by ``bit``, ``keys`` (an object array, taken over)
        names them; the other rows are free."""
        if self.size:
            raise ValueError("adopting rows needs empty rows")
        n = len(keys)
        if held.shape != (n,) or len(index) != int(np.count_nonzero(held)):
            raise ValueError("the index does not name exactly the held rows")
        self.index, self.keys, self.size = index, keys, n
        self.owners = array("B", np.where(held, bit, 0).astype(np.uint8).tobytes())
        self.free = array("q", np.flatnonzero(~held)[::-1].astype(np.int64).tobytes())
        for grower in self._growers:
            grower(n)

    def copy(self) -> "Rows":
        """An independent copy, with no attached cores."""
        new = Rows()
        new.index = dict(self.index)
        new.keys = self.keys.copy()
        new.owners = array("B", self.owners)
        new.free = array("q", self.free)
        new.stale = array("q", self.stale)
        new.size = self.size
        return new
