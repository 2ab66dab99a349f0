"""Keep the links between spec, code, tests and docs from rotting.

For every ``spec/X.tla`` that has a Python binding, ``docs/protocols/x.md`` must
hold a table row for each action of ``Next``, each invariant and each temporal
property its models check. A row reads::

    | `PutStart` | [`put_start`](../../kvproto/statemachines/publish.py#L412) | [`test_a`](../../tests/t.py), ... |

The first cell names the spec operator; the second links the Python function or
class that implements it, with the line it is defined on; the third links one or
more tests. The checker fails when a spec name has no row, when an action or
invariant has no Python twin in the binding, when a linked file lacks the named
``def``/``class``, or when a row names something the spec does not define.

Line anchors: a link ``[`name`](path#L123)`` anywhere in ``README.md`` or under
``docs/`` must point at the line that defines ``name`` (``def name`` or
``class name``; ``Class.method`` names a method of that class), and every code
link of a protocol table must carry one. ``python -m kvproto.checking.doccheck
--fix`` rewrites stale or missing line numbers; without ``--fix`` it prints the
problems and exits 1 when there are any.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvproto.checking import tlc
from kvproto.statemachines import BINDINGS

_ROW = re.compile(r"^\|\s*`(?P<name>\w+)`\s*\|(?P<code>[^|]*)\|(?P<tests>[^|]*)\|")
_LINK = re.compile(r"\[`(?P<name>[\w.]+)`\]\((?P<path>[^)#]+)(?:#(?P<anchor>[^)]*))?\)")


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
    return bool(definition_lines(path.read_text(), name))


_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?(?:def|class)[ \t]+(?P<name>\w+)\b")


def definition_lines(source: str, name: str) -> list[int]:
    """The 1-based lines of ``source`` that define ``name``: ``def``/``class``
    of its last dotted part, inside the classes its other parts name (for
    ``Class.method``, a ``def method`` in ``class Class``)."""
    *outer, leaf = name.split(".")
    found: list[tuple[int, int]] = []     # (line, depth)
    scopes: list[tuple[int, str]] = []    # (indent, name) of the defs enclosing the line
    for number, line in enumerate(source.splitlines(), 1):
        m = _DEF.match(line)
        if m is None:
            continue
        indent = len(m["indent"].expandtabs())
        while scopes and scopes[-1][0] >= indent:
            scopes.pop()
        enclosing = [n for _, n in scopes]
        if m["name"] == leaf and enclosing[len(enclosing) - len(outer):] == outer:
            found.append((number, len(enclosing)))
        scopes.append((indent, m["name"]))
    if not outer and any(depth == 0 for _, depth in found):
        found = [(number, depth) for number, depth in found if depth == 0]   # a plain name: the module's own
    return [number for number, _ in found]


def _markdown_files(root: Path) -> list[Path]:
    return sorted(p for p in [root / "README.md", *(root / "docs").rglob("*.md")] if p.is_file())


def _anchor_line(anchor: str | None) -> int | None:
    m = re.fullmatch(r"L(\d+)", anchor or "")
    return int(m[1]) if m else None


def _code_cells(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` offsets of the code cells of protocol-table rows in ``text``."""
    cells, offset = [], 0
    for line in text.splitlines(keepends=True):
        m = _ROW.match(line)
        if m:
            cells.append((offset + m.start("code"), offset + m.end("code")))
        offset += len(line)
    return cells


def check_anchors(root: Path, fix: bool = False) -> list[str]:
    """Problems with line anchors under ``root``: an anchored link whose line
    does not define its name, and (in protocol pages) a code link without an
    anchor. With ``fix``, every such link whose name is defined exactly once
    in its file is rewritten to point at that definition."""
    problems: list[str] = []
    for doc in _markdown_files(root):
        text = doc.read_text()
        needs_anchor = _code_cells(text) if doc.parent.name == "protocols" else []
        out, last = [], 0
        for link in _LINK.finditer(text):
            line = _anchor_line(link["anchor"])
            required = any(a <= link.start() < b for a, b in needs_anchor)
            if line is None and not required:
                continue
            target = (doc.parent / link["path"]).resolve()
            if not target.is_file():
                continue   # a missing file is reported by check()
            where = definition_lines(target.read_text(), link["name"])
            if line in where:
                continue
            place = f"{doc.relative_to(root)}: {link[0]}"
            if fix and len(where) == 1:
                out += [text[last:link.start("path")], f"{link['path']}#L{where[0]})"]
                last = link.end()
                continue
            if not where:
                problems.append(f"{place} links a file that defines no {link['name']}")
            elif len(where) > 1:
                problems.append(f"{place}: {link['name']} is defined on several lines "
                                f"({', '.join(map(str, where))}); name its class")
            elif line is None:
                problems.append(f"{place} has no line anchor; {link['name']} is defined on line {where[0]} "
                                "(python -m kvproto.checking.doccheck --fix)")
            else:
                problems.append(f"{place} is stale: {link['name']} is defined on line "
                                f"{where[0]} (python -m kvproto.checking.doccheck --fix)")
        if fix and out:
            doc.write_text("".join(out) + text[last:])
    return problems


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
    return problems + check_anchors(root)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvproto.checking.doccheck",
                                     description="Check the links between spec, code, tests and docs.")
    parser.add_argument("--fix", action="store_true", help="rewrite stale or missing line anchors first")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the repository (default: the one this module is in)")
    args = parser.parse_args(argv)
    if args.fix:
        check_anchors(args.root, fix=True)
    problems = check(args.root)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
