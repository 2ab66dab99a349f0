"""Running TLC on a tiny spec: verdicts, traces, ``kvproto check``, and conformance."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvproto import cli
from kvproto.checking import tlc
from kvproto.checking.conformance import StateLimitExceeded, compare, explore
from kvproto.checking.tla import Fn, ModelValue, parse_dot, trace_changes

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")

TINY_TLA = r"""---- MODULE Tiny ----
EXTENDS Integers, Sequences, FiniteSets
CONSTANTS Keys, Max
VARIABLES count, held, log
vars == <<count, held, log>>

Init == /\ count = 0
        /\ held = [k \in Keys |-> "free"]
        /\ log = <<>>

Take(k) == /\ held[k] = "free"
           /\ count < Max
           /\ held' = [held EXCEPT ![k] = "taken"]
           /\ count' = count + 1
           /\ log' = Append(log, k)

Drop(k) == /\ held[k] = "taken"
           /\ held' = [held EXCEPT ![k] = "free"]
           /\ UNCHANGED <<count, log>>

Idle == /\ count = Max
        /\ UNCHANGED vars

Next == Idle \/ \E k \in Keys : Take(k) \/ Drop(k)
Spec == Init /\ [][Next]_vars

CountBounded == count <= Max
AtMostOne == Cardinality({k \in Keys : held[k] = "taken"}) <= 1
EventuallyFull == <>(count = Max)
====
"""

CONSTANTS = "CONSTANTS Keys = {k1, k2}\n          Max = 3\n"
MODELS = {
    "Tiny.cfg": "\\* expect: ok\n" + CONSTANTS + "INIT Init\nNEXT Next\nINVARIANT CountBounded\n",
    "Tiny_Weak.cfg": "\\* expect: safety AtMostOne\n" + CONSTANTS
    + "INIT Init\nNEXT Next\nINVARIANTS CountBounded\n           AtMostOne\n",
    "Tiny_Live.cfg": "\\* expect: liveness EventuallyFull\n" + CONSTANTS
    + "SPECIFICATION Spec\nPROPERTY EventuallyFull\n",
    "Tiny_Wrong.cfg": "\\* expect: safety CountBounded\n" + CONSTANTS
    + "INIT Init\nNEXT Next\nINVARIANT CountBounded AtMostOne\n",
}


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "Tiny.tla").write_text(TINY_TLA)
    for name, text in MODELS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def models(spec_dir: Path) -> dict[str, tlc.Model]:
    return {m.name: m for m in tlc.discover(spec_dir)}


# --- model convention (no TLC needed) ----------------------------------------------

def test_discover_reads_cfg_headers(spec_dir):
    found = models(spec_dir)
    assert sorted(found) == ["Tiny", "Tiny_Live", "Tiny_Weak", "Tiny_Wrong"]
    assert {m.module for m in found.values()} == {"Tiny"}
    assert found["Tiny"].tla == spec_dir / "Tiny.tla"
    assert (found["Tiny"].expect, found["Tiny"].expect_violated) == ("ok", None)
    assert found["Tiny_Weak"].expectation == "safety AtMostOne"
    assert found["Tiny_Live"].properties == ("EventuallyFull",)
    assert found["Tiny"].conformance and not found["Tiny_Live"].conformance
    assert not found["Tiny_Weak"].conformance
    assert not any(m.check_deadlock for m in found.values())


def test_cfg_header_options_and_errors(tmp_path):
    cfg = tmp_path / "Spec_Deadlock.cfg"
    cfg.write_text("\n\\* a note\n\\* expect: deadlock\n\\* conformance: yes\nINIT Init\n\\* expect: ok\n")
    model = tlc.Model.from_cfg(cfg)
    assert (model.module, model.expect, model.check_deadlock, model.conformance, model.conformance_soak) == (
        "Spec", "deadlock", True, True, False)
    cfg.write_text("\\* conformance: soak\nINIT Init\n")
    model = tlc.Model.from_cfg(cfg)
    assert model.conformance and model.conformance_soak
    assert not model.optimise
    cfg.write_text("\\* jit: full\nINIT Init\n")
    assert tlc.Model.from_cfg(cfg).optimise
    for header in ["expect: safety", "expect: ok Inv", "expect: maybe", "deadlock: sometimes",
                   "conformance: perhaps", "jit: fast"]:
        cfg.write_text(f"\\* {header}\nINIT Init\n")
        with pytest.raises(ValueError):
            tlc.Model.from_cfg(cfg)


@needs_java
def test_only_a_model_marked_jit_full_gets_the_optimising_compiler(tmp_path):
    cfg = tmp_path / "Spec.cfg"
    for header, quick_only in (("", True), ("\\* jit: quick\n", True), ("\\* jit: full\n", False)):
        cfg.write_text(f"{header}INIT Init\n")
        command = tlc.tlc_command(tlc.Model.from_cfg(cfg), metadir=tmp_path)
        assert ("-XX:TieredStopAtLevel=1" in command) is quick_only, header


def test_parse_progress():
    line = "Progress(6) at 2026-11-29 11:54:50: 1,064 states generated, 64 distinct states found, 3 states left on queue."
    assert tlc.parse_progress(line) == tlc.Progress(depth=6, states_generated=1064, distinct_states=64, queued=3)
    assert tlc.parse_progress("Starting... (2026-11-29 11:54:50)") is None


# --- TLC runs -----------------------------------------------------------------------

@pytest.mark.tlc
@needs_java
class TestWithTlc:
    def test_ok_model(self, spec_dir, tmp_path):
        lines = []
        dot = tmp_path / "tiny.dot"
        result = tlc.run(models(spec_dir)["Tiny"], dump_dot=dot, on_output=lines.append)
        assert (result.exit_code, result.verdict, result.violated) == (0, "ok", None)
        assert result.matches and result.trace == []
        assert result.distinct_states == len(parse_dot(dot.read_text()).states)
        assert result.depth == 7 and result.states_generated > result.distinct_states
        assert "Model checking completed. No error has been found." in lines
        assert not (spec_dir / "states").exists()

    def test_the_class_archive_is_written_once_then_mapped(self, spec_dir, tmp_path,
                                                          monkeypatch):
        """The first run writes the archive of TLC's classes, the next map it
        with the same verdicts; an archive that cannot be written, or one the
        JVM cannot use, leaves the run as it was."""
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        archive = tlc.class_archive(shutil.which("java"), tlc.find_jar())
        assert archive.parent == tmp_path / "cache" / "kvproto" and not archive.exists()
        tiny = models(spec_dir)["Tiny_Weak"]
        first = tlc.run(tiny)
        assert archive.stat().st_size > 0 and list(archive.parent.iterdir()) == [archive]
        assert tlc._archive_options(archive)[0][0] == f"-XX:SharedArchiveFile={archive}"
        for result in (first, tlc.run(tiny)):
            assert (result.exit_code, result.verdict, result.violated) == (12, "safety", "AtMostOne")
        archive.write_bytes(b"not an archive")
        assert tlc.run(models(spec_dir)["Tiny"]).verdict == "ok"
        blocked = tmp_path / "a-file"               # no directory can be made under it
        blocked.write_text("")
        assert tlc._archive_options(blocked / "tla2tools.jsa") == ([], None)
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
        assert tlc.class_archive(shutil.which("java"), tlc.find_jar()) is None
        assert tlc.run(models(spec_dir)["Tiny"]).verdict == "ok"

    def test_safety_violation_and_its_trace(self, spec_dir):
        result = tlc.run(models(spec_dir)["Tiny_Weak"])
        assert (result.exit_code, result.verdict, result.violated) == (12, "safety", "AtMostOne")
        assert result.matches
        steps = result.trace
        assert [s.action for s in steps] == ["Initial predicate", "Take", "Take"]
        assert steps[-1].state["held"] == Fn.of({k: "taken" for k in KEYS})
        assert set(trace_changes(steps)[1]) == {"count", "held", "log"}

    def test_liveness_violation(self, spec_dir):
        result = tlc.run(models(spec_dir)["Tiny_Live"])
        assert (result.verdict, result.violated) == ("liveness", "EventuallyFull")
        assert result.matches and result.trace[-1].action == "Stuttering"

    def test_check_exits_nonzero_on_a_wrong_expectation(self, spec_dir, capsys):
        assert cli.main(["check", "--spec-dir", str(spec_dir)]) == 1
        out = capsys.readouterr().out
        assert "checking Tiny_Weak (expect safety AtMostOne) ..." in out
        assert "Tiny_Wrong: " in out and "UNEXPECTED (expected safety CountBounded)" in out
        assert "1. Initial predicate" in out and "2. Take" in out  # unexpected -> trace shown
        assert "3 of 4 models as expected" in out

    def test_check_exits_zero_when_all_match(self, spec_dir, capsys):
        assert cli.main(["check", "--spec-dir", str(spec_dir), "--model", "Weak", "--model", "Live",
                         "--show-traces"]) == 0
        out = capsys.readouterr().out
        assert "Tiny_Weak: " in out and "as expected" in out and "Stuttering" in out
        assert "2 of 2 models as expected" in out and "UNEXPECTED" not in out

    def test_conformance_with_python_machine(self, spec_dir, tmp_path):
        dot = tmp_path / "tiny.dot"
        tlc.run(models(spec_dir)["Tiny"], dump_dot=dot)
        tlc_graph = parse_dot(dot.read_text())

        report = compare(tlc_graph, explore([INITIAL], tiny_successors, to_tla))
        assert report.ok, report.describe()
        assert "identical" in report.describe()

        report = compare(tlc_graph, explore([INITIAL], buggy_successors, to_tla))
        assert not report.ok
        text = report.describe()
        assert "Steps only TLC takes from states both reach" in text
        assert "TLC: Drop changes held[k2]: \"taken\" -> \"free\"" in text
        assert "Python: no Drop step from this state" in text
        assert "/\\ held = (k1 :> " in text


# --- the Python twin of Tiny.tla ------------------------------------------------------

KEYS = (ModelValue("k1"), ModelValue("k2"))
MAX = 3
INITIAL = (0, frozenset(), ())  # (count, taken keys, log)


def tiny_successors(state, drop_keys=KEYS):
    count, taken, log = state
    if count == MAX:
        yield "Idle", state
    for k in KEYS:
        if k not in taken and count < MAX:
            yield "Take", (count + 1, taken | {k}, log + (k,))
        if k in taken and k in drop_keys:
            yield "Drop", (count, taken - {k}, log)


def buggy_successors(state):
    """Forgets that k2 can be dropped."""
    return tiny_successors(state, drop_keys=KEYS[:1])


def to_tla(state) -> Fn:
    count, taken, log = state
    held = Fn.of({k: "taken" if k in taken else "free" for k in KEYS})
    return Fn.of({"count": count, "held": held, "log": log})


def test_explore_limits_states():
    graph = explore([INITIAL], tiny_successors, to_tla)
    took_k1 = (1, frozenset(KEYS[:1]), KEYS[:1])
    assert graph.initial == {to_tla(INITIAL)}
    assert (to_tla(INITIAL), "Take", to_tla(took_k1)) in graph.edges
    with pytest.raises(StateLimitExceeded):
        explore([INITIAL], tiny_successors, to_tla, max_states=5)


def test_compare_reports_every_kind_of_difference():
    """compare() matches states by value, also when TLC's edges hold other
    (equal) objects than its state set, as a parsed graph may."""
    from kvproto.checking.tla import StateGraph, format_value, parse_value

    def copy(state):
        return parse_value(format_value(state))

    py = explore([INITIAL], tiny_successors, to_tla)
    tlc_side = StateGraph(frozenset(map(copy, py.states)), frozenset(map(copy, py.initial)),
                          frozenset((copy(a), label, copy(b)) for a, label, b in py.edges))
    assert compare(tlc_side, py).ok

    buggy = explore([INITIAL], buggy_successors, to_tla)
    report = compare(tlc_side, buggy)
    assert {label for a, label, _ in report.edges_only_tlc if a in buggy.states} == {"Drop"}
    assert report.states_only_tlc == py.states - buggy.states != frozenset()
    assert not (report.edges_only_py or report.states_only_py or report.initial_only_tlc)

    odd = to_tla((9, frozenset(), ()))
    extra = StateGraph(py.states | {odd}, py.initial | {odd}, py.edges | {(odd, "Idle", odd)})
    report = compare(tlc_side, extra)
    assert report.states_only_py == {odd} and report.initial_only_py == {odd}
    assert report.edges_only_py == {(odd, "Idle", odd)}
    assert not (report.states_only_tlc or report.edges_only_tlc)
