"""Where replicas go: a page-aligned first-fit allocator per segment, and placement.

The publish machine treats placement as an input (like time): the master asks
:class:`Placer` for one region on each of ``replicas`` distinct live segments,
feeds ``PutStart(key, length, placement)`` to the machine, and gives the regions
back if the machine refuses. When the machine's effects free a region
(``FreeRegion``) the master returns it here.

Each :class:`SegmentAllocator` keeps a sorted list of free extents (two parallel
lists, ``starts`` and ``lengths``, searched with :mod:`bisect`) in whole pages;
``allocate`` is first-fit, ``free`` coalesces with both neighbours. It keeps no
per-allocation record: ``free`` is told the length (the master reads it from the
directory record the machine just dropped), so the allocator's memory grows
with fragmentation, not with the number of objects.

Two byte counts are kept: :attr:`SegmentAllocator.free_bytes` counts object
bytes exactly as the machine's ledger does (``SegmentLedger.free``; an object of
``n`` bytes takes ``n``), while :attr:`SegmentAllocator.free_extent_bytes` counts
the free pages (an object of ``n`` bytes occupies ``ceil(n / page)`` pages). The
first must always equal the ledger; the second is what can actually be handed
out, so the allocator may refuse (``None``) a length the ledger would accept.
"""

from __future__ import annotations

import bisect
from typing import Collection, Iterable, Mapping, Optional

import numpy as np

from kvproto.statemachines.publish import Replica


class AllocatorCorrupt(RuntimeError):
    """A free overlapped a free extent (double free or a wrong length): a bug."""


class SegmentAllocator:
    """First-fit, page-aligned allocator over ``[0, capacity)`` of one segment."""

    __slots__ = ("capacity", "page_size", "free_bytes", "_starts", "_lengths", "_extent_bytes")

    def __init__(self, capacity: int, page_size: int = 4096) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError("page_size must be a power of two")
        if capacity <= 0 or capacity % page_size:
            raise ValueError("capacity must be a positive multiple of page_size")
        self.capacity = capacity
        self.page_size = page_size
        self.free_bytes = capacity
        self._starts = [0]
        self._lengths = [capacity]
        self._extent_bytes = capacity

    @classmethod
    def with_used(cls, capacity: int, page_size: int, used) -> "SegmentAllocator":
        """An allocator whose ``(offset, length)`` regions are already taken
        (a directory recovered after failover): pairs, or an ``(n, 2)`` array
        (one vectorised pass, for millions of regions)."""
        alloc = cls(capacity, page_size)
        pairs = np.asarray(used if isinstance(used, np.ndarray) else list(used), np.int64).reshape(-1, 2)
        pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
        offsets, lengths = pairs[:, 0], pairs[:, 1]
        mask = page_size - 1
        ends = offsets + ((lengths + mask) & ~mask)
        previous = np.concatenate(([0], ends[:-1]))
        bad = (offsets < previous) | (offsets % page_size != 0) | (ends > capacity)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise AllocatorCorrupt(f"recovered region {int(offsets[i])}+{int(lengths[i])} "
                                   f"overlaps or is outside")
        gaps = offsets > previous
        starts = previous[gaps].tolist()
        sizes = (offsets - previous)[gaps].tolist()
        pos = int(ends[-1]) if len(ends) else 0
        if pos < capacity:
            starts.append(pos)
            sizes.append(capacity - pos)
        alloc._starts, alloc._lengths = starts, sizes
        alloc._extent_bytes = sum(sizes)
        alloc.free_bytes = capacity - int(lengths.sum())
        return alloc

    def rounded(self, length: int) -> int:
        mask = self.page_size - 1
        return (length + mask) & ~mask

    @property
    def free_extent_bytes(self) -> int:
        return self._extent_bytes

    @property
    def largest_free_extent(self) -> int:
        return max(self._lengths, default=0)

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as ``(offset, length)``, sorted."""
        return list(zip(self._starts, self._lengths))

    def allocate(self, length: int) -> Optional[int]:
        """Offset of a fresh region of ``length`` bytes, or ``None`` if none fits."""
        if length <= 0:
            raise ValueError("length must be positive")
        mask = self.page_size - 1
        need = (length + mask) & ~mask      # rounded(length)
        if need > self._extent_bytes:
            return None
        lengths = self._lengths
        for i, size in enumerate(lengths):
            if size >= need:
                offset = self._starts[i]
                if size == need:
                    del self._starts[i]
                    del lengths[i]
                else:
                    self._starts[i] = offset + need
                    lengths[i] = size - need
                self._extent_bytes -= need
                self.free_bytes -= length
                return offset
        return None

    def free(self, offset: int, length: int) -> None:
        """Give back the region of ``length`` bytes at ``offset``; coalesces."""
        need = self.rounded(length)
        end = offset + need
        if offset < 0 or end > self.capacity or offset % self.page_size:
            raise AllocatorCorrupt(f"free({offset}, {length}) outside the segment")
        starts, lengths = self._starts, self._lengths
        i = bisect.bisect_left(starts, offset)
        if i < len(starts) and starts[i] < end:
            raise AllocatorCorrupt(f"free({offset}, {length}) overlaps a free extent")
        if i > 0 and starts[i - 1] + lengths[i - 1] > offset:
            raise AllocatorCorrupt(f"free({offset}, {length}) overlaps a free extent")
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == offset
        merge_next = i < len(starts) and starts[i] == end
        if merge_prev and merge_next:
            lengths[i - 1] += need + lengths[i]
            del starts[i]
            del lengths[i]
        elif merge_prev:
            lengths[i - 1] += need
        elif merge_next:
            starts[i] = offset
            lengths[i] += need
        else:
            starts.insert(i, offset)
            lengths.insert(i, need)
        self._extent_bytes += need
        self.free_bytes += length


def _free_extent_bytes(item: tuple[str, "SegmentAllocator"]) -> int:
    return item[1]._extent_bytes


class Region:
    """A region as the batch steps take a replica's (``segment``, ``offset``,
    ``length``, as a :class:`~kvproto.statemachines.publish.Replica` says
    it), made at a third of a ``Replica``'s cost."""

    __slots__ = ("segment", "offset", "length")

    def __init__(self, segment: str, offset: int, length: int) -> None:
        self.segment = segment
        self.offset = offset
        self.length = length


class Placer:
    """Chooses placements over the live segments' allocators."""

    def __init__(self) -> None:
        self.allocators: dict[str, SegmentAllocator] = {}

    def add(self, segment: str, capacity: int, page_size: int,
            used: Iterable[tuple[int, int]] = ()) -> None:
        """A segment joins; ``used`` ``(offset, length)`` regions are already taken."""
        self.allocators[segment] = SegmentAllocator.with_used(capacity, page_size, used)

    def drop(self, segment: str) -> None:
        self.allocators.pop(segment, None)

    def place(self, length: int, replicas: int, exclude: Collection[str] = (),
              region: type = Replica) -> Optional[tuple]:
        """One region on each of ``replicas`` distinct segments (none of
        ``exclude``), most free space first; ``None`` (and nothing held) if that
        many segments cannot fit it. Each made a ``region`` (:class:`Region`
        for the batch steps)."""
        if replicas == 1 and not exclude and self.allocators:
            # one replica: the sort's first, the first of the most free space
            segment, alloc = max(self.allocators.items(), key=_free_extent_bytes)
            offset = alloc.allocate(length)
            if offset is not None:
                return (region(segment, offset, length),)
        candidates = [kv for kv in self.allocators.items() if kv[0] not in exclude] \
            if exclude else self.allocators.items()
        if replicas > len(candidates):
            return None
        order = sorted(candidates, key=_free_extent_bytes, reverse=True)
        chosen: list = []
        for segment, alloc in order:
            offset = alloc.allocate(length)
            if offset is not None:
                chosen.append(region(segment, offset, length))
                if len(chosen) == replicas:
                    return tuple(chosen)
        self.release(chosen)
        return None

    def release(self, replicas: Iterable) -> None:
        """Return regions (a refused placement, or regions the machine freed)."""
        for r in replicas:
            self.free(r.segment, r.offset, r.length)

    def free(self, segment: str, offset: int, length: int) -> None:
        """Return one region."""
        alloc = self.allocators.get(segment)
        if alloc is not None:  # a lost segment's allocator is gone
            alloc.free(offset, length)

    def free_bytes(self) -> Mapping[str, int]:
        return {s: a.free_bytes for s, a in self.allocators.items()}
