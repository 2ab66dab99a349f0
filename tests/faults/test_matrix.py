"""The fault matrix in CI: a seeded short run of every cell (``-m faults``).

One cluster serves all cells, one after another (:meth:`Matrix.run_all`); each
test then judges its cell's report. Two extra cells damage the store from
outside the protocol — bytes flipped on the wire, acknowledged objects removed
behind the writers' backs — and must be reported. Long runs: ``kvproto chaos``."""

from __future__ import annotations

import os
import time

import pytest

import kvproto
from kvproto.errors import KvError
from kvproto.checking.chaos.cells import CELLS, Cell
from kvproto.checking.chaos.matrix import Matrix
from kvproto.checking.chaos.workers import read_journal

pytestmark = [pytest.mark.faults, pytest.mark.runtime]

SEED = 16
SECONDS = 1.5


def corrupt_network_reads(ctx):
    return [dict(route="storage", direction="reply", ops="read", action="corrupt",
                 probability=0.3, count=0)]


def remove_behind_the_writers(ctx):
    """Near the end of the traffic, remove the latest acknowledged puts with
    a client of our own (once): the verdict must find them lost."""
    if getattr(ctx, "removed", False) or time.monotonic() - ctx.started < SECONDS - 0.5:
        return []
    ctx.removed = True
    acked = []
    for name in os.listdir(ctx.folder):
        if name.startswith("writer"):
            records, _ = read_journal(os.path.join(ctx.folder, name))
            acked += [r["key"] for r in records if r.get("op") == "put" and r.get("out") == "ok"]
    with kvproto.Client(ctx.cluster.coordinator, timeout=5) as client:
        for key in acked[-10:]:
            try:
                client.remove(key, force=True)
            except KvError:        # its writer removed it meanwhile
                pass
    return []


CHECKS = {c.name: c for c in [
    Cell("check-corrupt", "bytes flipped in read replies", corrupt_network_reads, once=True),
    Cell("check-lost", "acknowledged objects removed from outside", remove_behind_the_writers,
         first_after=0.0, period=0.0, injects=False),
]}


def _selected(session) -> list:
    names = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "cell" in callspec.params:
            names.append(callspec.params["cell"])
    return [CELLS.get(n) or CHECKS[n] for n in names] or list(CELLS.values())


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory):
    with Matrix(tmp_path_factory.mktemp("chaos"), seed=SEED) as matrix:
        return {r.cell: r for r in matrix.run_all(_selected(request.session), SECONDS)}


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell(cell, reports):
    r = reports[cell]
    detail = f"{r.as_dict()}"
    assert r.operations > 0 and r.puts_acked > 0, detail
    if cell != "none":
        assert r.faults > 0, f"the cell injected no fault: {detail}"
    assert r.wrong_bytes == 0, detail
    assert r.acked_lost == 0, detail
    assert r.unexplained == 0, detail
    assert r.exceptions == 0, detail
    assert r.leaked == 0 and r.settled, detail


@pytest.mark.parametrize("cell", list(CHECKS))
def test_the_matrix_reports_damage(cell, reports):
    r = reports[cell]
    assert r.failed, r.as_dict()
    if cell == "check-corrupt":
        assert r.wrong_bytes > 0 and r.faults > 0, r.as_dict()
    else:
        assert r.lost_puts > 0, r.as_dict()
