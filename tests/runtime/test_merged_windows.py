"""The merged check of a long run, whole, in windows chained state to state
(:func:`kvproto.checking.mergetrace.check_windows`).

A real run of 36 puts, each read back (24 of them removed), names more keys
than one TLC run may (32): its merged behaviour is checked in windows that
end where the run is quiet (no pending put with a replica written),
each from the directory and region tables the one before ended in. A node
step changed by hand in a later window is rejected at its own recorded
number (the first window alone, all a prefix check walks, passes); a window
that claims the nodes ended in other tables than their steps left, or with a
command on its way that is not, fails ``NodesWindowEnd``; an attempt left
pending with nothing written is carried from window to window, and a run
that is never quiet again (an attempt written and never ended) is checked up
to there, and the verdict says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kvproto
from kvproto import cli, errors
from kvproto.checking import mergetrace, nodetrace
from kvproto.checking.tracerun import TraceError
from kvproto.runtime import tracing

from runtime_helpers import Raw as RawClient

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc, pytest.mark.runtime]

KEYS = 36
SIZE = 60       # master steps a window


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The master's trace file of a real run of more keys than one TLC run
    may name (its nodes' files beside it)."""
    path = tmp_path_factory.mktemp("windows") / "run.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=2, segment_size="4MiB") as cluster:
            c = cluster.client(local_reads=False, local_writes=False)
            for i in range(KEYS):
                key = b"k%d" % i
                c.put(key, bytes([i]) * 3000, replicas=2)
                assert bytes(c.get(key)) == bytes([i]) * 3000
                if i % 3:
                    c.remove(key)
    return path


def parts(path: Path, nodes=None):
    header, steps = mergetrace.master_run(path)
    files = [path] + (nodes or nodetrace.node_files(path))
    segments, node_steps, tables = nodetrace.read_nodes(files[1:], header.get("term", 1))
    return header, steps, node_steps, files, segments, tables


def test_a_window_ends_only_where_the_run_is_quiet(run):
    header, steps, node_steps, *_ = parts(run)
    cuts = mergetrace.Windows(header, steps, node_steps)
    kinds = [step["event"]["type"] for _, step in steps]
    assert cuts.quiet[0] and cuts.quiet[len(steps)]
    for p, kind in enumerate(kinds, 1):
        # a pending put is never a place to end; a published one is, once its
        # commands reached the nodes (the merge puts them right after it)
        assert cuts.quiet[p] == (kind != "PutStart"), (p, kind)
    assert cuts.merged(len(steps)) == len(steps) + sum(map(len, node_steps))


def test_commands_to_a_node_that_never_steps_again_do_not_keep_a_window_open(run):
    """A node killed halfway (its file cut): the master's commands to it that
    it never took can never be taken, so they hold no window open (and the
    window that ends with them on their way drops them: ``Idle``)."""
    header, steps, node_steps, *_ = parts(run)
    cut = [n[:len(n) // 2] if i == 1 else n for i, n in enumerate(node_steps)]
    cuts = mergetrace.Windows(header, steps, cut)
    segment = node_steps[1][0][1]["event"]["segment"]
    silent = cuts.last[segment]
    kinds = [step["event"]["type"] for _, step in steps]
    for p, kind in enumerate(kinds[silent:], silent + 1):
        assert cuts.quiet[p] == (kind != "PutStart"), (p, kind)
    assert any(segment in cuts.idle[p] for p in range(silent + 1, len(steps) + 1))
    # with every node stepping to the end, no window ends with a command on its way
    whole = mergetrace.Windows(header, steps, node_steps)
    assert all(not whole.idle[p] for p in range(len(steps) + 1) if whole.quiet[p])


def test_the_whole_run_is_past_one_tlc_runs_bounds(run):
    header, steps, node_steps, files, segments, tables = parts(run)
    with pytest.raises(TraceError, match=r"the run has 36 keys; at most 32"):
        mergetrace.check_steps(header, steps, node_steps, files, segments, tables=tables)


@needs_java
def test_a_long_merged_run_is_checked_whole_in_windows(run, tmp_path, capsys):
    header, steps, node_steps, files, segments, tables = parts(run)
    verdict = mergetrace.check_windows(header, steps, node_steps, files, segments,
                                       tables=tables, size=SIZE, keep=tmp_path)
    assert verdict.ok and not verdict.stopped, verdict.message
    assert verdict.windows >= 3
    total = len(steps) + sum(map(len, node_steps))
    assert verdict.steps == total
    assert verdict.message == (f"all {total} steps of the master and 2 node(s) are steps of "
                               f"spec/Publish.tla in {verdict.windows} windows")
    # each window after the first starts from the nodes' tables the one before
    # ended in, and every window but the last is held to its end
    second = (tmp_path / "window-2" / "MergedTrace.tla").read_text()
    assert "NodesOpened == <<" not in second and "NodesEnd == " in second
    assert "NodesWindowEnd" in (tmp_path / "window-1" / "MergedTrace.cfg").read_text()
    assert cli.main(["trace", "merge", str(run)]) == 0
    assert "node(s) are steps of spec/Publish.tla in 2 windows" in capsys.readouterr().out


def _stale_write(row: dict, first_token: int) -> bool:
    """An accepted write of a token from ``first_token`` on, changed to carry
    the token before its own."""
    ev = row["event"]
    if ev["type"] != "WriteReplica" or row["effects"][0]["type"] != "Accepted" \
            or ev["token"] < first_token:
        return False
    ev["token"] -= 1
    row["effects"][0]["token"] -= 1
    return True


@needs_java
def test_a_node_step_changed_in_a_later_window_is_rejected_at_its_number(run, tmp_path):
    header, steps, *_ = parts(run)
    # a token granted well past the first window's master steps
    late = next(e["token"] for _, s in steps[2 * SIZE:] for e in s["effects"]
                if e["type"] == "PutGranted")
    bad = tmp_path / "bad.trace"
    shutil.copy(run, bad)
    hit = None
    for f in nodetrace.node_files(run):
        lines = rows(f)
        for r in lines:
            if hit is None and r.get("event") and _stale_write(r, late):
                hit = (Path(f"{bad}.storage-{f.name.split('storage-')[1]}"), r["n"])
        Path(f"{bad}.storage-{f.name.split('storage-')[1]}").write_text(
            "".join(json.dumps(r) + "\n" for r in lines))
    assert hit is not None
    node_file, n = hit
    header, steps, node_steps, files, segments, tables = parts(bad)
    # what a check of the first window alone walks (a prefix) passes
    first = mergetrace.check_windows(header, steps, node_steps, files, segments,
                                     tables=tables, size=SIZE, max_windows=1)
    assert first.ok and "at most 1 window(s)" in first.stopped, first.message
    verdict = mergetrace.check_windows(header, steps, node_steps, files, segments,
                                       tables=tables, size=SIZE)
    assert not verdict.ok
    assert verdict.failed_step == n, verdict.message
    assert f"{node_file.name} step {n} " in verdict.message
    assert "(window " in verdict.message and "(window 1," not in verdict.message


@needs_java
def test_a_window_held_to_other_node_tables_fails_nodes_window_end(run):
    header, steps, node_steps, files, segments, tables = parts(run)
    cuts = mergetrace.Windows(header, steps, node_steps)
    part = steps[:cuts.cut({}, steps[:SIZE])]
    start = {"header": header, "tables": tables}
    end = cuts.boundary(start, part)
    good = mergetrace.check_steps(header, part, cuts.nodes_of(part), files, segments,
                                  tables=tables, end=end["header"], end_tables=end["tables"])
    assert good.ok, good.message
    segment, regions = next((s, r) for s, r in end["tables"].items() if r)
    offset = next(iter(regions))
    wrong = {**end["tables"], segment: {o: r for o, r in regions.items() if o != offset}}
    verdict = mergetrace.check_steps(header, part, cuts.nodes_of(part), files, segments,
                                     tables=tables, end=end["header"], end_tables=wrong)
    assert not verdict.ok and "invariant NodesWindowEnd is violated" in verdict.message
    # and to a command on its way that the master never sent (or a node took)
    assert end["header"]["sent"] == [] and not end["idle"]
    region = {"segment": segment, "type": "FreeRegion", "offset": offset,
              "token": regions[offset][0]}
    verdict = mergetrace.check_steps(header, part, cuts.nodes_of(part), files, segments,
                                     tables=tables, end={**end["header"], "sent": [region]},
                                     end_tables=end["tables"])
    assert not verdict.ok and "invariant NodesWindowEnd is violated" in verdict.message


@needs_java
def test_a_pending_put_unwritten_is_carried_and_one_written_and_never_ended_stops_it(tmp_path):
    """An attempt granted and assigned but never written (its writer stalled)
    does not stop the windows: a window ends with its writer busy, nothing
    written, and the next starts so. One written on a traced node and never
    ended (its put_end lost, never reclaimed) is where no later point is
    quiet: the run is checked up to its PutStart, and the verdict says so."""
    path = tmp_path / "pending.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=2, segment_size="4MiB", writer_timeout=600.0) \
                as cluster:
            c = cluster.client(local_reads=False, local_writes=False)
            raw = RawClient(cluster.master_address)
            try:
                for i in range(4):
                    c.put(b"a%d" % i, b"a" * 2000, replicas=2)
                status, _ = raw.call("put_start", {"client": "w9", "replicas": 2,
                                                   "items": [[b"stuck", 4096]]},
                                     timeout=30).body["items"][0]
                assert status == 0
                for i in range(3):
                    c.put(b"b%d" % i, b"b" * 2000, replicas=2)
                lost = cluster.client(local_reads=False, local_writes=False)
                real = lost._call_master

                def drop_put_end(op, body, deadline, **kw):
                    if op == "put_end":
                        raise errors.RequestTimeout("put_end lost")
                    return real(op, body, deadline, **kw)

                mp.setattr(lost, "_call_master", drop_put_end)
                mp.setattr(lost, "_revoke", lambda *a, **k: None)
                with pytest.raises(errors.RequestTimeout):
                    lost.put(b"written", b"w" * 2000, replicas=2)
                for i in range(6):
                    c.put(b"c%d" % i, b"c" * 2000, replicas=2)
            finally:
                raw.close()
    header, steps, node_steps, files, segments, tables = parts(path)
    starts = [p for p, (_, s) in enumerate(steps) if s["event"]["type"] == "PutStart"]
    stuck, written = (next(p for p in starts if steps[p][1]["event"]["key"] == key)
                      for key in ("stuck", "written"))
    # the cluster's shutdown loses its segments, and with them the written attempt
    shutdown = next(p for p, (_, s) in enumerate(steps) if s["event"]["type"] == "SegmentLost")
    cuts = mergetrace.Windows(header, steps, node_steps)
    assert cuts.quiet[stuck + 1] and not any(cuts.quiet[written + 1:shutdown + 1])
    size = stuck + 2
    assert shutdown - written > size
    keep = tmp_path / "windows"
    verdict = mergetrace.check_windows(header, steps, node_steps, files, segments,
                                       tables=tables, size=size, keep=keep)
    assert verdict.ok, verdict.message
    # window 1 ends after the stuck PutStart (the next PutStart's writes are merged after it)
    assert verdict.windows == 2
    opened = (keep / "window-2" / "PublishTrace.tla").read_text()
    assert "writers |-> (wr" in opened.split("Opened == ")[1].split("\n")[0]
    assert "no point where a window may end in the" in verdict.stopped
    n = steps[written][1]["n"]
    assert verdict.steps == cuts.merged(written)
    assert f"before the master's step {n} are steps of spec/Publish.tla" in verdict.message
    assert "from there on nothing is checked" in verdict.message
