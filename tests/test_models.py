"""Every TLC model under spec/ gives the verdict its cfg expects: the real models
pass, and every weakened model is rejected with the invariant or property it
names (so a check that cannot fail would show up here).

A model whose graph tests/test_conformance.py compares in every run (cfg
header ``conformance: yes``) is checked there, from the same TLC run that
dumps its graph (which must end ``ok``): it is not run a second time here.
Under ``--soak`` the main models (``conformance: soak``) are compared there
too, and still checked here."""

from pathlib import Path

import pytest

from kvproto.checking import tlc

SPEC = Path(__file__).resolve().parent.parent / "spec"
MODELS = tlc.discover(SPEC)
#: the models tests/test_conformance.py runs in every run (their verdict is its)
COMPARED = [m for m in MODELS if m.conformance and not m.conformance_soak]


def test_every_spec_has_a_weakened_model_that_must_fail():
    for module in {m.module for m in MODELS}:
        weakened = [m for m in MODELS if m.module == module and m.expect != "ok"]
        assert len(weakened) >= 2, f"{module} needs at least two weakened models"


def test_every_model_compared_elsewhere_is_expected_to_pass():
    """The conformance fixture asserts the ``ok`` verdict; a compared model
    expecting anything else would be checked nowhere."""
    assert COMPARED and all(m.expect == "ok" for m in COMPARED)


@pytest.mark.tlc
@pytest.mark.parametrize("model", [m for m in MODELS if m not in COMPARED], ids=lambda m: m.name)
def test_model_gives_expected_verdict(model):
    result = tlc.run(model)
    assert result.matches, (
        f"{model.name}: expected {model.expectation}, got {result.outcome}\n" + result.output[-4000:])
