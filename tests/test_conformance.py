"""Spec and code agree: for every conformance model under spec/, the state graph
TLC dumps equals the Python machine's reachable graph under the stated mapping
(same states, same initial states, same action-labelled edges).

Models whose cfg says ``conformance: soak`` (the main models, 70k-120k states)
are compared only under ``pytest --soak``."""

from pathlib import Path

import pytest

from kvproto.checking import tlc
from kvproto.statemachines import BINDINGS
from kvproto.checking.conformance import compare
from kvproto.checking.tla import parse_dot

SPEC = Path(__file__).resolve().parent.parent / "spec"
MODELS = [m for m in tlc.discover(SPEC) if m.conformance]


def test_every_spec_has_a_conformance_model():
    modules = {p.stem for p in SPEC.glob("*.tla")}
    assert modules <= {m.module for m in MODELS if not m.conformance_soak}
    assert modules <= set(BINDINGS)


@pytest.mark.tlc
@pytest.mark.parametrize("model", [
    pytest.param(m, id=m.name, marks=[pytest.mark.soak] if m.conformance_soak else [])
    for m in MODELS])
def test_tlc_graph_equals_python_graph(model, tmp_path):
    dot = tmp_path / f"{model.name}.dot"
    result = tlc.run(model, dump_dot=dot)
    assert result.verdict == "ok", result.output[-3000:]
    tlc_graph = parse_dot(dot.read_text())
    dot.unlink()
    limit = max(100_000, 2 * result.distinct_states)
    py_graph = BINDINGS[model.module].graph(tlc.cfg_constants(model.cfg.read_text()), max_states=limit)
    report = compare(tlc_graph, py_graph)
    assert report.ok, report.describe()
    assert len(tlc_graph.states) == result.distinct_states


@pytest.mark.tlc
def test_a_weakened_machine_is_caught(tmp_path, monkeypatch):
    """The comparison can fail: a machine that accepts PutEnd from any attempt
    (the Publish_Weak_NoToken flaw, in Python) no longer equals the spec."""
    from kvproto.statemachines import publish

    def any_attempt_owns(state, key, token):
        record = state.objects.get(key)
        return record if record is not None and record.status is publish.Status.PENDING else None

    model = next(m for m in MODELS if m.name == "Publish_Small")
    dot = tmp_path / "small.dot"
    tlc.run(model, dump_dot=dot)
    monkeypatch.setattr(publish, "_pending_with", any_attempt_owns)
    py_graph = BINDINGS["Publish"].graph(tlc.cfg_constants(model.cfg.read_text()))
    report = compare(parse_dot(dot.read_text()), py_graph)
    assert not report.ok
    assert "PutEnd" in report.describe()
