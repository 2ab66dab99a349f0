"""The master's repair scheduling: which repairs to start, and when.

The rules of repair are the directory's (``spec/Publish.tla`` ``RepairStart``,
``ListReplica``, ``RepairCancel``; :class:`~kvproto.cores.directory.DirectoryCore`):
the master starts, lists and cancels repairs only by stepping it. What is
left here is choice and time, as the allocator's placement is: which objects
below their requested count to repair next, from which source replica, and
how fast.

* At most ``max_in_flight`` copies run at once (``spec/Repair.tla``
  ``RepairsWithinRate``).
* Each source node has a token bucket of repair bytes (:class:`TokenBucket`):
  ``rate`` bytes a second, up to ``burst`` saved. A repair from a source
  starts only when its bucket holds the object's length (or is full, for an
  object larger than the burst) and takes it, so repair reads of one node stay
  within ``rate`` on average, whatever the number of destinations; the rest
  of the node's bandwidth is left to foreground reads.
* A copy not reported within ``timeout`` is cancelled (the node is slow or
  gone; its late report is then refused by ``ListReplica``).
* A repaired replica is a copy of the object's allocation: its publish mark
  carries the object's publishing term (:class:`PublishTerms`), which its
  node records instead of the repairing master's (``spec/Failover.tla``
  ``Repair``, ``RepairedEntry``), so a later takeover lists it beside the
  original and frees neither.
"""

from __future__ import annotations

from collections import deque
from itertools import filterfalse
from typing import Iterable, Optional

import attrs


class TokenBucket:
    """``rate`` units a second, at most ``burst`` saved; starts full."""

    __slots__ = ("rate", "burst", "level", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate, self.burst, self.level, self.at = float(rate), float(burst), float(burst), now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
            self.at = now

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` if the bucket holds it (or is full: an amount above
        the burst goes into debt, repaid before the next take)."""
        self._refill(now)
        if self.level >= min(amount, self.burst):
            self.level -= amount
            return True
        return False


class PublishTerms:
    """The publishing term of an object, by its token: ``own`` for the tokens
    this master issued (from ``first`` on), else the term of the recovered
    objects whose tokens span it (``ranges``: term -> least and greatest
    token, from the takeover's rebuild). Tokens only grow across terms, so
    the ranges of different terms do not overlap. 0 where none is known
    (the node then records the command's term)."""

    __slots__ = ("own", "first", "ranges")

    def __init__(self, own: int = 0, first: int = 0,
                 ranges: Optional[dict] = None) -> None:
        self.own, self.first = own, first
        self.ranges = sorted((low, high, term) for term, (low, high) in (ranges or {}).items())

    def of(self, token: int) -> int:
        if token >= self.first:
            return self.own
        for low, high, term in self.ranges:
            if low <= token <= high:
                return term
        return 0


@attrs.define
class InFlight:
    """A repair the directory has in flight, as the scheduler times it."""

    key: bytes
    segment: str          # destination
    source: str           # source segment
    length: int
    started: float


class RepairScheduler:
    """Chooses the repairs to start and times the ones in flight (no sockets,
    no protocol state: the directory holds that)."""

    def __init__(self, rate: float = 256 << 20, burst: Optional[float] = None,
                 max_in_flight: int = 4, timeout: float = 30.0) -> None:
        if rate <= 0 or max_in_flight < 1 or timeout <= 0:
            raise ValueError("repair rate, copies in flight and timeout must be positive")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else self.rate / 4
        self.max_in_flight = int(max_in_flight)
        self.timeout = float(timeout)
        self.in_flight: dict[int, InFlight] = {}      # repair id -> what it copies
        self.buckets: dict[str, TokenBucket] = {}
        #: keys found below their count by the last scan, not yet started
        self.queue: deque = deque()
        #: the directory must be scanned again (a segment was lost, a repair
        #: ended unlisted, a master opened)
        self.stale = True

    def room(self) -> int:
        return self.max_in_flight - len(self.in_flight)

    def rescan(self, below: Iterable[bytes]) -> None:
        """The objects below their count, from a directory scan."""
        busy = {r.key for r in self.in_flight.values()}
        self.queue = deque(filterfalse(busy.__contains__, below))
        self.stale = False

    def source(self, segments: Iterable[str], length: int, now: float) -> Optional[str]:
        """The first of ``segments`` whose bucket allows ``length`` bytes now
        (taken from it), or None."""
        for seg in segments:
            bucket = self.buckets.get(seg)
            if bucket is None:
                bucket = self.buckets[seg] = TokenBucket(self.rate, self.burst, now)
            if bucket.take(length, now):
                return seg
        return None

    def started(self, repair: int, key: bytes, segment: str, source: str, length: int,
                now: float) -> None:
        self.in_flight[repair] = InFlight(key, segment, source, length, now)

    def ended(self, repair: int) -> Optional[InFlight]:
        return self.in_flight.pop(repair, None)

    def overdue(self, now: float) -> list[tuple[int, InFlight]]:
        return [(rid, r) for rid, r in self.in_flight.items() if now - r.started > self.timeout]

    def forget_segment(self, segment: str) -> None:
        self.buckets.pop(segment, None)
        self.stale = True
