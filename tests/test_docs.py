"""The protocol docs link every spec action, invariant and property to the
Python code that implements it and the tests that exercise it."""

from pathlib import Path

from kvproto.checking import doccheck

ROOT = Path(__file__).resolve().parent.parent


def test_every_spec_name_is_linked_to_code_and_tests():
    assert doccheck.check(ROOT) == []


def test_checker_reports_a_missing_row(tmp_path):
    (tmp_path / "spec").mkdir()
    (tmp_path / "docs" / "protocols").mkdir(parents=True)
    (tmp_path / "spec" / "Publish.tla").write_text((ROOT / "spec" / "Publish.tla").read_text())
    (tmp_path / "spec" / "Publish.cfg").write_text((ROOT / "spec" / "Publish.cfg").read_text())
    doc = (ROOT / "docs" / "protocols" / "publish.md").read_text()
    trimmed = "\n".join(l for l in doc.splitlines() if not l.startswith("| `PutRevoke`"))
    (tmp_path / "docs" / "protocols" / "publish.md").write_text(trimmed)
    problems = doccheck.check(tmp_path)
    assert any("no row for PutRevoke" in p for p in problems)


SOURCE = '''\
def put():
    pass


class Table:
    def put(self):
        def inner():
            pass


class Other:
    async def put(self):
        pass
'''


def test_definition_lines_follow_classes():
    assert doccheck.definition_lines(SOURCE, "put") == [1]            # a plain name: the module's own
    assert doccheck.definition_lines(SOURCE, "Table.put") == [6]
    assert doccheck.definition_lines(SOURCE, "Other.put") == [12]
    assert doccheck.definition_lines(SOURCE, "Table") == [5]
    assert doccheck.definition_lines(SOURCE, "inner") == [7]
    assert doccheck.definition_lines(SOURCE, "Table.inner") == []
    assert doccheck.definition_lines(SOURCE, "take") == []


def anchored_repo(tmp_path, row_code: str, prose: str = ""):
    (tmp_path / "kvproto").mkdir()
    (tmp_path / "kvproto" / "m.py").write_text(SOURCE)
    (tmp_path / "docs" / "protocols").mkdir(parents=True)
    page = tmp_path / "docs" / "protocols" / "p.md"
    page.write_text(f"{prose}\n| Spec | Python | Tests |\n|---|---|---|\n"
                    f"| `Put` | {row_code} | [`t`](../../tests/t.py) |\n")
    return page


def test_line_anchors_are_checked_and_fixed(tmp_path):
    page = anchored_repo(tmp_path, "[`put`](../../kvproto/m.py#L2), [`Table.put`](../../kvproto/m.py)",
                         prose="See [`Other.put`](../../kvproto/m.py#L12) and [`put`](../../kvproto/m.py).")
    problems = doccheck.check_anchors(tmp_path)
    assert len(problems) == 2
    assert "[`put`](../../kvproto/m.py#L2) is stale: put is defined on line 1" in problems[0]
    assert "[`Table.put`](../../kvproto/m.py) has no line anchor; Table.put is defined on line 6" in problems[1]

    assert doccheck.check_anchors(tmp_path, fix=True) == []
    text = page.read_text()
    assert "[`put`](../../kvproto/m.py#L1), [`Table.put`](../../kvproto/m.py#L6)" in text
    # prose links are checked only when they carry an anchor
    assert "[`Other.put`](../../kvproto/m.py#L12) and [`put`](../../kvproto/m.py)." in text
    assert doccheck.check_anchors(tmp_path) == []


def test_unresolvable_anchors_are_reported_not_rewritten(tmp_path):
    page = anchored_repo(tmp_path, "[`take`](../../kvproto/m.py#L1)",
                         prose="[`inner`](../../kvproto/m.py#L1) [`Table.put`](../../kvproto/m.py#L6)")
    problems = doccheck.check_anchors(tmp_path, fix=True)
    assert problems == ["docs/protocols/p.md: [`take`](../../kvproto/m.py#L1) links a file that defines no take"]
    text = page.read_text()
    assert "[`take`](../../kvproto/m.py#L1)" in text                 # left as it was
    assert "[`inner`](../../kvproto/m.py#L7) [`Table.put`](../../kvproto/m.py#L6)" in text


def test_the_command_fails_on_problems_and_fixes_anchors(tmp_path, capsys):
    anchored_repo(tmp_path, "[`put`](../../kvproto/m.py#L5)")
    (tmp_path / "spec").mkdir()
    assert doccheck.main(["--root", str(tmp_path)]) == 1
    assert "is stale" in capsys.readouterr().out
    assert doccheck.main(["--root", str(tmp_path), "--fix"]) == 0
