"""The fault matrix in CI: a seeded short run of every cell (``-m faults``).

One cluster serves all cells, one after another (:meth:`Matrix.run_all`); each
test then judges its cell's report. Long runs: ``kvproto chaos --minutes N``."""

from __future__ import annotations

import pytest

from kvproto.checking.chaos.cells import CELLS
from kvproto.checking.chaos.matrix import Matrix

pytestmark = [pytest.mark.faults, pytest.mark.runtime]

SEED = 16
SECONDS = 1.5


def _selected(session) -> list[str]:
    names = []
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if item.originalname == "test_cell" and callspec is not None:
            names.append(callspec.params["cell"])
    return names or list(CELLS)


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
