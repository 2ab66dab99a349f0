"""Every TLC model under spec/ gives the verdict its cfg expects: the real models
pass, and every weakened model is rejected with the invariant or property it
names (so a check that cannot fail would show up here)."""

from pathlib import Path

import pytest

from kvproto.checking import tlc

SPEC = Path(__file__).resolve().parent.parent / "spec"
MODELS = tlc.discover(SPEC)


def test_every_spec_has_a_weakened_model_that_must_fail():
    for module in {m.module for m in MODELS}:
        weakened = [m for m in MODELS if m.module == module and m.expect != "ok"]
        assert len(weakened) >= 2, f"{module} needs at least two weakened models"


@pytest.mark.tlc
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_model_gives_expected_verdict(model):
    result = tlc.run(model)
    assert result.matches, (
        f"{model.name}: expected {model.expectation}, got {result.outcome}\n" + result.output[-4000:])
