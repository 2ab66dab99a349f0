"""Keeping Python's cyclic garbage collector out of the way of large tables.

The master's and the storage nodes' tables are fast cores (:mod:`kvproto.cores`):
columns and dicts of bytes and ints, which the collector does not walk. What
is still built object by object is a storage node's index frame at a
takeover, encoded by the node and decoded by the new master: millions of
entries, each a few tracked objects. One full collection of them would take
seconds, during which the process answers nothing. They hold no reference
cycles, so the runtime builds them with the collector paused (:func:`paused`) and moves what survives out of its reach
(``gc.freeze``): later collections scan only what was allocated since.
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
