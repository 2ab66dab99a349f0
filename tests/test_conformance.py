"""Spec and code agree: for every conformance model under spec/, the state graph
TLC dumps equals the Python machine's reachable graph under the stated mapping
(same states, same initial states, same action-labelled edges) — for the
reference machine, and for the fast core the runtime runs where there is one
(kvproto/cores, run inside the same closed system). TLC runs once per model.

Models whose cfg says ``conformance: soak`` (the main models, 70k-120k states)
are compared only under ``pytest --soak``."""

from pathlib import Path

import pytest

from kvproto.checking import tlc
from kvproto.checking.conformance import compare
from kvproto.checking.tla import parse_dot
from kvproto.cores.bindings import FAST_BINDINGS
from kvproto.statemachines import BINDINGS

SPEC = Path(__file__).resolve().parent.parent / "spec"
MODELS = [m for m in tlc.discover(SPEC) if m.conformance]
KINDS = {"reference": BINDINGS, "fast": FAST_BINDINGS}
CASES = [pytest.param(m, kind, id=f"{m.name}-{kind}",
                      marks=[pytest.mark.soak] if m.conformance_soak else [])
         for m in MODELS for kind, bindings in KINDS.items() if m.module in bindings]


@pytest.fixture(scope="module")
def tlc_graph(tmp_path_factory):
    """TLC's graph of a model (checked ``ok``), run once per model."""
    graphs: dict = {}

    def graph(model):
        if model.name not in graphs:
            dot = tmp_path_factory.mktemp("tlc") / f"{model.name}.dot"
            result = tlc.run(model, dump_dot=dot)
            assert result.verdict == "ok", result.output[-3000:]
            g = parse_dot(dot.read_text())
            dot.unlink()
            assert len(g.states) == result.distinct_states
            graphs[model.name] = g
        return graphs[model.name]
    return graph


def test_every_spec_has_a_conformance_model():
    modules = {p.stem for p in SPEC.glob("*.tla")}
    assert modules <= {m.module for m in MODELS if not m.conformance_soak}
    assert modules <= set(BINDINGS)
    assert set(FAST_BINDINGS) <= set(BINDINGS)


@pytest.mark.tlc
@pytest.mark.parametrize("model, kind", CASES)
def test_tlc_graph_equals_python_graph(model, kind, tlc_graph):
    graph = tlc_graph(model)
    py_graph = KINDS[kind][model.module].graph(tlc.cfg_constants(model.cfg.read_text()),
                                               max_states=max(100_000, 2 * len(graph.states)))
    report = compare(graph, py_graph)
    assert report.ok, report.describe()


def _small(tlc_graph):
    model = next(m for m in MODELS if m.name == "Publish_Small")
    return tlc_graph(model), tlc.cfg_constants(model.cfg.read_text())


@pytest.mark.tlc
def test_a_weakened_machine_is_caught(tlc_graph, monkeypatch):
    """The comparison can fail: a machine that accepts PutEnd from any attempt
    (the Publish_Weak_NoToken flaw, in Python) no longer equals the spec."""
    from kvproto.statemachines import publish

    def any_attempt_owns(state, key, token):
        record = state.objects.get(key)
        return record if record is not None and record.status is publish.Status.PENDING else None

    graph, constants = _small(tlc_graph)
    monkeypatch.setattr(publish, "_pending_with", any_attempt_owns)
    report = compare(graph, BINDINGS["Publish"].graph(constants))
    assert not report.ok
    assert "PutEnd" in report.describe()


@pytest.mark.tlc
def test_a_weakened_fast_core_is_caught(tlc_graph, monkeypatch):
    """The same flaw in the fast directory (its PutEnd no longer compares the
    token) makes the fast core's graph differ from TLC's."""
    from kvproto.cores.directory import PENDING, DirectoryCore

    def any_attempt_owns(self, key, token):
        row = self.rows.index.get(key)
        return row if row is not None and self._st[row] == PENDING else None

    graph, constants = _small(tlc_graph)
    monkeypatch.setattr(DirectoryCore, "_pending_row", any_attempt_owns)
    report = compare(graph, FAST_BINDINGS["Publish"].graph(constants))
    assert not report.ok
    assert "PutEnd" in report.describe()


@pytest.mark.tlc
def test_a_weakened_fast_pool_is_caught(tlc_graph, monkeypatch):
    """The fast pool takes a timed-out copy for one still in flight when its
    completion arrives (the Timeout_Weak_AcceptLate flaw, in the core): the
    late bytes are handed to the request, and the graph differs from TLC's."""
    from kvproto.cores.pool import PoolCore
    from kvproto.statemachines import timeout

    original = PoolCore._complete

    def accept_late(self, ev):
        t = self._xfers.get(ev.gen)
        if t is not None and t.buffer == ev.buffer and t.state is timeout.XferState.TIMEDOUT:
            self._xfers[ev.gen] = timeout.Transfer(t.gen, t.request, t.buffer)
        return original(self, ev)

    model = next(m for m in MODELS if m.name == "Timeout_Small")
    graph = tlc_graph(model)
    monkeypatch.setattr(PoolCore, "_complete", accept_late)
    report = compare(graph, FAST_BINDINGS["Timeout"].graph(tlc.cfg_constants(model.cfg.read_text())))
    assert not report.ok
    assert "Complete" in report.describe()


@pytest.mark.tlc
def test_a_weakened_fast_tenancy_is_caught(tlc_graph, monkeypatch):
    """The fast tenancy core renews a read whose grant was revoked (the
    Tenancy_Weak_RenewIgnoresRevoke flaw, in the core): its graph has Renew
    edges TLC's has not."""
    from kvproto import errors
    from kvproto.cores.tenancy import TenancyCore
    from kvproto.statemachines.tenancy import ReadPhase

    def renew_ignores_revoke(self, ev, now):
        read = self._reads.get(ev.holder)
        if read is None or read.phase is not ReadPhase.GRANTED or read.expires <= now:
            return errors.LeaseExpired(f"{ev.holder!r} holds no unexpired read")
        return None

    model = next(m for m in MODELS if m.name == "Tenancy_Grants")
    graph = tlc_graph(model)
    monkeypatch.setattr(TenancyCore, "_judge_renew", renew_ignores_revoke)
    report = compare(graph, FAST_BINDINGS["Tenancy"].graph(tlc.cfg_constants(model.cfg.read_text())))
    assert not report.ok
    assert "Renew" in report.describe()
