"""The collector helpers that keep a large master's full collections short."""

from __future__ import annotations

import gc

import pytest

from kvproto.runtime import collector


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_paused_restores_the_collector_state_and_freezes_what_it_built(unfrozen):
    assert gc.isenabled()
    with collector.paused(collector.PAUSE_FROM):
        assert not gc.isenabled()
        built = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() >= len(built)
    assert gc.get_count()[0] < 1000     # the young generation does not hold them
    frozen = gc.get_freeze_count()
    with collector.paused(collector.PAUSE_FROM - 1):   # small: left to the collector
        assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
    gc.disable()
    try:
        with collector.paused(collector.PAUSE_FROM):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
