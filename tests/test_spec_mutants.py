"""The invariants bind the actions, not only the guards the weakened models
replace: each mutant below changes an action of a spec the way a careless
edit would, and TLC must reject it with the invariant it names.

Each mutant is applied to a copy of ``spec/``; the model it runs keeps its
constants and checks only ``TypeOK`` and the named invariant, so the test
shows that this invariant (not some other one) catches the mutant. Before the
invariants were restated as properties of the behaviour, TLC passed every one
of these mutants (see the models tables in docs/protocols/).
"""

import re
import shutil
from pathlib import Path

import attrs
import pytest

from kvproto.checking import tlc

SPEC = Path(__file__).resolve().parent.parent / "spec"


@attrs.frozen
class SpecMutant:
    name: str
    model: str        # the cfg whose constants the mutant runs under
    invariant: str    # the invariant TLC must report violated
    old: str          # text of the spec replaced ...
    new: str          # ... by this


MUTANTS = [
    SpecMutant(
        "Publish: Remove ignores the readers' pins", "Publish_Small", "OnlyPublishedReadable",
        "    /\\ Published(k)\n    /\\ dir[k].reads = 0\n    /\\ FreeObjects({k})\n",
        "    /\\ Published(k)\n    /\\ FreeObjects({k})\n"),
    SpecMutant(
        "Publish: PutEnd answers the writer without publishing", "Publish_Small",
        "OneAttemptPublishes",
        "THEN /\\ dir' = [dir EXCEPT ![k].status = \"published\"]",
        "THEN /\\ dir' = dir"),
    SpecMutant(
        "Lease: a release reclaims the object it protected", "Lease_Skew", "ReleaseIsNotDelete",
        "    /\\ dir' = DirAfterRelease(r)\n"
        "    /\\ lease' = [lease EXCEPT ![r] = None]\n"
        "    /\\ reader' = [reader EXCEPT ![r] = None]\n"
        "    /\\ UNCHANGED <<now, dropped, inherited, quietUntil, takeovers>>\n",
        "    /\\ lease[r] # None /\\ Present(lease[r].key)\n"
        "    /\\ Reclaim(lease[r].key)\n"
        "    /\\ lease' = [lease EXCEPT ![r] = None]\n"
        "    /\\ UNCHANGED <<now, dropped, quietUntil, takeovers>>\n"),
    SpecMutant(
        "Repair: a loss cancels a repair but its destination keeps the region", "Repair_Small",
        "RegionsAccounted",
        "IF s2 = s THEN {} ELSE {k \\in region[s2] : ~freed(s2, k)}]",
        "IF s2 = s THEN {} ELSE region[s2]]"),
    SpecMutant(
        "Repair: a loss unlists its replicas but keeps the repairs reading them", "Repair_Small",
        "RepairNeverFromALostSegment",
        "LET cancelled == {r \\in repairs : r.dst = s \\/ ~KeepsRepair(r, s)}",
        "LET cancelled == {r \\in repairs : r.dst = s}"),
]


def mutated_model(spec: Path, mutant: SpecMutant, into: Path) -> tlc.Model:
    """A copy of ``spec`` with the mutant applied, and its model checking only
    ``TypeOK`` and the mutant's invariant."""
    shutil.copytree(spec, into)
    cfg = into / f"{mutant.model}.cfg"
    module = mutant.model.split("_", 1)[0]
    tla = into / f"{module}.tla"
    text = tla.read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: the mutated text is not in {tla.name} once"
    tla.write_text(text.replace(mutant.old, mutant.new))
    body = re.sub(r"INVARIANTS?\n(?:[ \t]+\S+\n?)*",
                  f"INVARIANTS\n    TypeOK\n    {mutant.invariant}\n", cfg.read_text())
    cfg.write_text(body)
    return tlc.Model(cfg=cfg, module=module, expect="safety", expect_violated=mutant.invariant,
                     conformance=False)


@pytest.mark.tlc
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_tlc_rejects_the_mutant(mutant, tmp_path):
    model = mutated_model(SPEC, mutant, tmp_path / "spec")
    result = tlc.run(model)
    assert result.matches, f"{mutant.name}: got {result.outcome}\n" + result.output[-3000:]


@pytest.mark.tlc
def test_the_unmutated_model_passes_the_same_check(tmp_path):
    """The mutants' runs can pass: with the text left as it is, the same
    restricted model is accepted."""
    mutant = attrs.evolve(MUTANTS[1], new=MUTANTS[1].old)
    model = attrs.evolve(mutated_model(SPEC, mutant, tmp_path / "spec"), expect="ok",
                         expect_violated=None)
    assert tlc.run(model).matches
