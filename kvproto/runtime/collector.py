"""Keeping Python's cyclic garbage collector out of the way of large tables.

A master with a million objects holds several million tracked objects (the
directory's maps and records, the lease table); one full collection of them
takes seconds, during which the process answers nothing: long enough to miss
heartbeats and to lose its leadership lease. The tables hold no reference
cycles (records are replaced, and freed by reference counting), so the
runtime builds them with the collector paused (:func:`paused`) and moves
what survives out of its reach (:class:`Freezer`, ``gc.freeze``): later
collections scan only what was allocated since.
"""

from __future__ import annotations

import contextlib
import gc


#: entries from which :func:`paused` acts (below, the collector's cost is small)
PAUSE_FROM = 10_000


@contextlib.contextmanager
def paused(entries: int):
    """Build or decode ``entries`` table entries, up to millions (a storage
    node's index frame, a recovered directory), without the collector
    re-scanning them over and over; below :data:`PAUSE_FROM` it does nothing.

    On the way out everything alive is frozen before the collector is enabled
    again: otherwise the first allocation after it would collect the young
    generation, now holding every object built here, in one pass of seconds.
    Frozen objects are still freed by reference counting when dropped; nothing
    built here forms reference cycles."""
    if entries < PAUSE_FROM:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


class Freezer:
    """Freeze (``gc.freeze``) what is alive each time a table grew by ``step``
    entries since the last freeze, so a full collection scans at most about
    ``step`` entries' worth of objects. Garbage cycles alive at a freeze are
    never collected; the tables make none."""

    def __init__(self, step: int = 20_000) -> None:
        if step <= 0:
            raise ValueError("step must be positive")
        self.step = step
        self._frozen_at = 0

    def grown(self, size: int) -> bool:
        """Tell the table's size; freezes and returns True when it grew by ``step``."""
        if size < self._frozen_at:
            self._frozen_at = size
        if size - self._frozen_at < self.step:
            return False
        gc.freeze()
        self._frozen_at = size
        return True
