"""Fixtures for the runtime tests (helpers live in :mod:`runtime_helpers`)."""

from __future__ import annotations

import pytest

from runtime_helpers import Child, Raw


@pytest.fixture
def raw():
    opened = []

    def make(endpoint: str) -> Raw:
        r = Raw(endpoint)
        opened.append(r)
        return r
    yield make
    for r in opened:
        r.close()


@pytest.fixture
def children():
    started: list[Child] = []

    def spawn(code: str) -> Child:
        c = Child(code)
        started.append(c)
        return c
    yield spawn
    for c in reversed(started):
        c.stop()
