"""``kvproto plan``: flags, the TOML file, one-line mistakes, the worked
example in docs/planning.md, and the measured per-object figures."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from kvproto import cli
from kvproto.ops import plan as P
from kvproto.ops.measure import measure_metadata, wire_overhead

DOC = Path(__file__).resolve().parents[2] / "docs" / "planning.md"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def doc_block(after: str) -> str:
    """The fenced block of docs/planning.md that starts with ``after``."""
    text = DOC.read_text()
    for block in re.findall(r"```(?:\w*)\n(.*?)```", text, flags=re.S):
        if block.startswith(after):
            return block
    raise AssertionError(f"no block starting {after!r} in {DOC}")


def test_the_worked_example_in_the_docs_is_what_the_command_prints(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert "= 128.0 KiB per token" in out
    assert doc_block("$ kvproto plan\n") == "$ kvproto plan\n" + out


def test_the_docs_toml_file_gives_the_same_plan(capsys, tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(doc_block("# plan.toml"))
    code, from_file, err = run(capsys, "--config", str(path))
    assert code == 0, err
    assert from_file == run(capsys)[1]


def test_flags_override_the_file(capsys, tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[store]\nchunk_tokens = 128\nreplicas = 3\n[cluster]\nhosts = 8\n'
                    'failure_domains = 2\nsegment_per_host = "1TiB"\n')
    code, out, err = run(capsys, "--config", str(path), "--replicas", "1", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["store"]["chunk_tokens"] == 128 and plan["store"]["replicas"] == 1
    assert plan["cluster"]["hosts"] == 8 and plan["cluster"]["segment_per_host"] == 1 << 40
    assert plan["capacity"]["object_bytes"] == 128 * 131072


def test_prompt_lengths_and_sizes_from_flags(capsys):
    code, out, err = run(capsys, "--prompt-tokens", "2048", "--sharing", "0.5", "--chunk", "64",
                         "--memory", "2TiB", "--dtype", "fp8", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["workload"]["prompt_tokens"] == [[2048, 1.0]]
    assert plan["bytes_per_token"] == 65536
    assert plan["tokens"]["reused"] == pytest.approx(1024 - 63 / 2)
    assert plan["cluster"]["memory_per_host"] == 2 << 40


def test_compare_chunk(capsys):
    code, out, _ = run(capsys, "--compare-chunk", "128")
    assert code == 0
    assert "Q: chunk 256 -> 128 tokens" in out


@pytest.mark.parametrize("argv, message", [
    (["--chunk", "abc"], "--chunk: cannot use 'abc'"),
    (["--replicas", "20"], "20 replicas need as many hosts, not 16"),
    (["--sharing", "2"], "sharing must be in [0, 1]"),
    (["--memory", "lots"], "--memory: cannot use 'lots'"),
    (["--prompt-tokens", "10:x"], "--prompt-tokens: cannot use '10:x'"),
    (["--config", "/nonexistent/plan.toml"], "cannot read /nonexistent/plan.toml"),
    (["--measure", "0"], "--measure needs a positive number of objects"),
])
def test_a_mistake_is_one_line_and_status_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvproto plan: ") and message in err, err


@pytest.mark.parametrize("text, message", [
    ("[store]\nchunk = 64\n", "unknown key 'chunk' in [store] (known: chunk_tokens,"),
    ("[stor]\nchunk_tokens = 64\n", "unknown table [stor]"),
    ("[cluster]\nhosts = 'many'\n", "[cluster] hosts: cannot use 'many'"),
    ("[model\n", "plan.toml:"),
])
def test_a_bad_file_is_one_line_and_status_2(capsys, tmp_path, text, message):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    code, _, err = run(capsys, "--config", str(path))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_without_tomllib_or_tomli_the_file_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    """Python 3.10 has no tomllib; the tomli package stands in for it."""
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    path = tmp_path / "plan.toml"
    path.write_text("[store]\nchunk_tokens = 64\n")
    code, _, err = run(capsys, "--config", str(path))
    assert code == 2
    assert err == "kvproto plan: reading a TOML file needs Python 3.11 or the tomli package\n"


def test_the_recorded_wire_figures_are_the_wire_format_s():
    assert wire_overhead(P.MEASURED.key_bytes, P.MEASURED.replicas) == (
        P.MEASURED.read_wire_bytes, P.MEASURED.write_wire_bytes)
    # longer keys cost more bytes per object
    read, write = wire_overhead(256, 2)
    assert read > P.MEASURED.read_wire_bytes and write > P.MEASURED.write_wire_bytes


@pytest.mark.runtime
def test_metadata_is_measured_on_running_processes():
    m = measure_metadata(objects=4000, replicas=1, warmup=500)
    # a directory entry, a lease-table entry and the recency list cost hundreds
    # of bytes per object, not nothing and not megabytes
    assert 500 < m["master_bytes_per_object"] < 3000, m
    assert 100 < m["node_bytes_per_replica"] < 2000, m
    assert m["command"] == "kvproto plan --measure 4000"
