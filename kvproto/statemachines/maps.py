"""Building a large persistent map without holding up the other threads."""

from __future__ import annotations

from typing import Any, Iterable

import immutables


def map_of(items: Iterable[tuple[Any, Any]]) -> immutables.Map:
    """An :class:`immutables.Map` of ``items``, inserted one at a time.

    As fast as ``immutables.Map(dict)``, which builds in one call that keeps
    every other thread of the process waiting (most of a second for a million
    entries): a master recovering a large directory must still renew its
    leadership from another thread meanwhile."""
    with immutables.Map().mutate() as m:
        for key, value in items:
            m[key] = value
        return m.finish()
