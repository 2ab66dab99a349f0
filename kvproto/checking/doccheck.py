"""Keep the links between spec, code, tests and docs from rotting.

For every ``spec/X.tla`` that has a Python binding, ``docs/protocols/x.md`` must
hold a table row for each action of ``Next``, each invariant and each temporal
property its models check. A row reads::

    | `PutStart` | [`put_start`](../../kvproto/statemachines/publish.py) | [`test_a`](../../tests/t.py), ... |

The first cell names the spec operator; the second links the Python function or
class that implements it; the third links one or more tests. The checker fails
when a spec name has no row, when an action or invariant has no Python twin in
the binding, when a linked file lacks the named ``def``/``class``, or when a row
names something the spec does not define.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvproto.checking import tlc
from kvproto.statemachines import BINDINGS

_ROW = re.compile(r"^\|\s*`(?P<name>\w+)`\s*\|(?P<code>[^|]*)\|(?P<tests>[^|]*)\|")
_LINK = re.compile(r"\[`(?P<name>[\w.]+)`\]\((?P<path>[^)#]+)(?:#[^)]*)?\)")


def spec_actions(tla_text: str) -> list[str]:
    """The operators that ``Next`` applies (its disjuncts' action names)."""
    m = re.search(r"^Next\s*==(.*?)(?=^\S)", tla_text, flags=re.M | re.S)
    if not m:
        return []
    body = re.sub(r"\\\*.*", "", m.group(1))
    # an action is applied with arguments, or stands alone after \/ or a quantifier's ':'
    named = re.findall(r"\b([A-Z]\w*)\s*\(|(?:\\/|:)\s*([A-Z]\w*)\b", body)
    return list(dict.fromkeys(a or b for a, b in named))


def spec_checks(spec_dir: Path, module: str) -> tuple[list[str], list[str]]:
    """Invariants and temporal properties named by the module's models that
    are expected to pass (weakened models reuse the same names)."""
    invariants: dict[str, None] = {}
    properties: dict[str, None] = {}
    for model in tlc.discover(spec_dir):
        if model.module != module or model.expect != "ok":
            continue
        text = model.cfg.read_text()
        invariants.update(dict.fromkeys(tlc.cfg_names(text, ("INVARIANT", "INVARIANTS"))))
        properties.update(dict.fromkeys(model.properties))
    return list(invariants), list(properties)


def _defines(path: Path, name: str) -> bool:
    leaf = name.split(".")[-1]
    return bool(re.search(rf"^\s*(?:def|class)\s+{re.escape(leaf)}\b", path.read_text(), re.M))


def check(root: Path) -> list[str]:
    """Every problem found under ``root`` (the repository); empty when all is linked."""
    problems: list[str] = []
    spec_dir = root / "spec"
    for tla in sorted(spec_dir.glob("*.tla")):
        module = tla.stem
        binding = BINDINGS.get(module)
        if binding is None:
            problems.append(f"{tla.name}: no Python binding in kvproto.statemachines.BINDINGS")
            continue
        actions = spec_actions(tla.read_text())
        invariants, properties = spec_checks(spec_dir, module)
        for name in actions:
            if name not in binding.actions:
                problems.append(f"{module}: action {name} has no Python twin in the binding")
        for name in invariants:
            if name not in binding.invariants:
                problems.append(f"{module}: invariant {name} has no Python twin in the binding")
        doc = root / "docs" / "protocols" / f"{module.lower()}.md"
        if not doc.exists():
            problems.append(f"{module}: {doc.relative_to(root)} is missing")
            continue
        rows = {}
        for line in doc.read_text().splitlines():
            m = _ROW.match(line.strip())
            if m and _LINK.search(m["tests"]):
                rows[m["name"]] = m
        wanted = actions + invariants + properties
        for name in wanted:
            row = rows.get(name)
            if row is None:
                problems.append(f"{doc.name}: no row for {name}")
                continue
            code = list(_LINK.finditer(row["code"]))
            tests = list(_LINK.finditer(row["tests"]))
            if name not in properties and not code:
                problems.append(f"{doc.name}: {name} links no Python code")
            if not tests:
                problems.append(f"{doc.name}: {name} links no test")
            for link in code + tests:
                target = (doc.parent / link["path"]).resolve()
                if not target.is_file():
                    problems.append(f"{doc.name}: {name} links missing file {link['path']}")
                elif not _defines(target, link["name"]):
                    problems.append(f"{doc.name}: {name}: {link['path']} defines no {link['name']}")
        for name in rows.keys() - set(wanted):
            problems.append(f"{doc.name}: row {name} is not an action, invariant or property of {module}")
    return problems
