"""A master's trace and its storage nodes' traces, merged by the protocol's
causality and checked by TLC as one behaviour of ``spec/Publish.tla``
(``kvproto trace merge``, :mod:`kvproto.checking.mergetrace`).

A real run with tracing on (``KVPROTO_TRACE``: the master writes the file, each
node its own beside it) of puts (one by a same-host direct writer), network
reads, a remove, an attempt reclaimed by the writer timeout, its writer's late
write into the region the next attempt now owns (refused by its node), that
attempt revoked, and a node that leaves (its segment lost) is a behaviour of
the spec, and so is a run of a master and two nodes as separate processes, one
of them killed. Node steps changed by hand (a write accepted for a token that
no longer owns its region, a free the node skipped) are rejected, and so is
the run of a node that takes a late write under a token older than its
region's owner as the owner's (the ``node-write-older-token-to-owner``
mutant)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

import kvproto
from kvproto import cli, errors
from kvproto.checking import mergetrace, nodetrace
from kvproto.runtime import tracing

from runtime_helpers import Raw as RawClient, wait_for

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc, pytest.mark.runtime]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def master_steps(path: Path, kind: str) -> list[dict]:
    return [r for r in rows(path) if r["machine"] == "publish"
            and r.get("event", {}).get("type") == kind]


def item(raw: RawClient, op: str, body: dict):
    status, value = raw.call(op, body, timeout=30).body["items"][0]
    return status, value


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The master's trace file of a short real run (its nodes' files beside it)."""
    path = tmp_path_factory.mktemp("merged") / "run.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=2, segment_size="4MiB", writer_timeout=2.0) as cluster:
            c = cluster.client(local_reads=False, local_writes=False)
            raw = RawClient(cluster.master_address)
            try:
                c.put(b"a", b"x" * 5000, replicas=2)
                c.put(b"b", b"y" * 100, replicas=2)
                assert bytes(c.get(b"a")) == b"x" * 5000        # network reads
                c.remove(b"b")
                with pytest.raises(errors.KeyNotFound):
                    c.get(b"b")
                c.put(b"e", b"z" * 3000, replicas=2)
                assert bytes(c.get(b"e")) == b"z" * 3000
                # a same-host writer writes its regions itself (spec/DirectWrite.tla):
                # its node steps the write when it publishes the object
                cluster.client().put(b"f", b"f" * 2000, replicas=2)
                # w2 starts an attempt and falls silent
                status, g2 = item(raw, "put_start", {"client": "w2", "replicas": 2,
                                                     "items": [[b"d", 4096]]})
                assert status == 0
                wait_for(lambda: master_steps(path, "ReclaimAbandoned"), timeout=60,
                         what="the silent writer's attempt reclaimed")
                seg, offset, length = g2["replicas"][0]
                node = next(n for n in cluster.storage if n.segment == seg)
                wait_for(lambda: offset not in node.core.node.regions, timeout=30,
                         what="the reclaimed attempt's region freed at its node")
                # w1 starts an attempt on the same space (its region there is
                # assigned, not yet written), and w2 writes late, with the token
                # that has moved on: its node refuses it (the verdict on the
                # write is the trace check's)
                status, g1 = item(raw, "put_start", {"client": "w1", "replicas": 2,
                                                     "items": [[b"c", 4096]]})
                assert status == 0
                assert [seg, offset, length] in g1["replicas"], "the next attempt took other space"
                wait_for(lambda: offset in node.core.node.regions, timeout=30,
                         what="the next attempt's region assigned at the node")
                late = RawClient(node.endpoint)
                try:
                    late.call("writes", {"segment": seg, "term": 1, "owner": "w2/put",
                                         "regions": [[offset, g2["token"], 1]]},
                              [b"L" * length], timeout=30)
                finally:
                    late.close()
                # w1 gives up its attempt
                raw.call("put_revoke", {"client": "w1", "items": [[b"c", g1["token"]]]}, timeout=30)
                # a node leaves: its segment is lost (no other segment can take a
                # repair), the other replicas stay
                cluster.storage[1].stop()
                wait_for(lambda: master_steps(path, "SegmentLost"), timeout=60,
                         what="the leaving node's segment lost")
                assert bytes(c.get(b"a")) == b"x" * 5000
            finally:
                raw.close()
    return path


def test_every_node_records_its_region_steps_beside_the_masters_file(run):
    files = nodetrace.node_files(run)
    assert len(files) == 2
    kinds = set()
    for f in files:
        lines = rows(f)
        assert lines[0]["machine"] == "storage" and "segment" in lines[0]["opened"]
        kinds |= {r["event"]["type"] for r in lines if "event" in r}
    assert kinds >= {"AssignRegion", "FreeRegion", "WriteReplica", "ReadReplica", "Fence",
                     "StampedAllocate", "StampedPublish"}
    # each write and read asked of a node is recorded with the token its
    # request carried, first; a direct writer's write (stepped at the publish) is not
    asked = [(r["asked"]["op"], r["asked"]["token"]) for f in files for r in rows(f) if "asked" in r]
    assert {op for op, _ in asked} == {"write", "read"}
    steps = [r for f in files for r in rows(f)
             if r.get("event", {}).get("type") in ("WriteReplica", "ReadReplica")]
    assert len(asked) == len(steps) - 2


@needs_java
def test_the_merged_run_is_a_behaviour_of_the_spec(run, tmp_path, capsys):
    verdict = mergetrace.check(run, keep=tmp_path)
    assert verdict.ok, verdict.message
    assert "EXTENDS PublishTrace" in (tmp_path / "MergedTrace.tla").read_text()
    assert cli.main(["trace", "merge", str(run)]) == 0
    assert "of the master and 2 node(s) are steps of spec/Publish.tla" in capsys.readouterr().out


def rewrite(run: Path, out: Path, change) -> tuple[Path, int]:
    """The run copied to ``out`` with ``change`` applied to the first node step
    it accepts (returns True): the node file and the step's number."""
    shutil.copy(run, out)
    hit = None
    for f in nodetrace.node_files(run):
        lines = rows(f)
        kept = []
        for r in lines:
            if hit is None and r.get("event") and change(r):
                hit = (Path(f"{out}.storage-{f.name.split('storage-')[1]}"), r["n"])
                if r.get("drop"):
                    continue
            kept.append(r)
        Path(f"{out}.storage-{f.name.split('storage-')[1]}").write_text(
            "".join(json.dumps(r) + "\n" for r in kept))
    assert hit is not None
    return hit


def _stale_write(row):
    ev = row["event"]
    if ev["type"] != "WriteReplica" or row["effects"][0]["type"] != "Accepted" or ev["token"] < 2:
        return False
    ev["token"] -= 1
    row["effects"][0]["token"] -= 1
    return True


def _skipped_free(row):
    if row["event"]["type"] != "FreeRegion":
        return False
    row["drop"] = True
    return True


@needs_java
@pytest.mark.parametrize("change, at", [(_stale_write, "this step"), (_skipped_free, "later")])
def test_a_node_step_changed_by_hand_is_rejected(run, tmp_path, change, at):
    bad = tmp_path / "bad.trace"
    node_file, n = rewrite(run, bad, change)
    verdict = mergetrace.check(bad)
    assert not verdict.ok
    assert f"{node_file.name} step {verdict.failed_step} " in verdict.message
    # a changed write fails at itself; a skipped free at the node's next command
    assert verdict.failed_step == n if at == "this step" else verdict.failed_step > n
    assert cli.main(["trace", "merge", str(bad)]) == 1


def test_a_master_file_without_node_files_is_a_one_line_error(tmp_path, capsys):
    lone = tmp_path / "lone.trace"
    lone.write_text('{"machine":"publish","opened":{"next_token":1,"objects":0,"segments":{}}}\n')
    assert cli.main(["trace", "merge", str(lone)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvproto trace: no storage node trace beside") and err.count("\n") == 1


@needs_java
def test_a_run_of_separate_processes_with_a_node_killed_is_a_behaviour_of_the_spec(
        children, tmp_path):
    """A master and two storage nodes as processes, each with ``--trace`` its
    own file; one node is killed (SIGKILL) and its segment lost: the files,
    the killed node's up to its last step, merge into a behaviour of the spec."""
    master_file = tmp_path / "master.trace"
    nodes = [tmp_path / f"node{i}.trace" for i in range(2)]
    m = children(f"""
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout=1.5, storage_timeout=1.5,
                   trace={str(master_file)!r})
    """)
    line = m.readline()
    assert line.startswith("kvproto master listening on "), line
    address = line.rsplit(" ", 1)[1]
    storage = []
    for f in nodes:
        s = children(f"""
            from kvproto.runtime.embedded import run_storage
            run_storage({address!r}, "8MiB", trace={str(f)!r})
        """)
        assert s.readline().startswith("kvproto storage listening on ")
        storage.append(s)
    c = kvproto.Client(master=address, timeout=10.0, local_reads=False, local_writes=False)
    try:
        wait_for(lambda: sum(1 for s in c.stats()["segments"].values() if s["live"]) == 2,
                 what="two storage nodes")
        for i in range(4):
            c.put(b"k%d" % i, bytes([i]) * (3000 + i), replicas=2)
        assert bytes(c.get(b"k1")) == bytes([1]) * 3001
        c.remove(b"k0")
        c.put(b"k4", b"4" * 3000, replicas=2)
        storage[1].stop(signal.SIGKILL)
        wait_for(lambda: master_steps(master_file, "SegmentLost"), timeout=30,
                 what="the killed node's segment lost")
        assert bytes(c.get(b"k2")) == bytes([2]) * 3002
    finally:
        c.close()
    verdict = mergetrace.check(master_file, nodes)
    assert verdict.ok, verdict.message


def test_a_storage_node_that_cannot_write_its_trace_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "no such dir" / "node.trace"
    assert cli.main(["storage", "--master", "tcp://127.0.0.1:1", "--size", "1MiB",
                     "--trace", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvproto storage: cannot write the trace to {missing}: " \
                  "No such file or directory\n"


@needs_java
def test_a_run_with_repairs_is_a_behaviour_of_the_spec(tmp_path):
    """Three nodes, one leaves: the master repairs the objects it held onto
    the third node, whose copier reads a listed replica and writes the
    repair's region (the spec's ``CopyReplica``) before the master lists it."""
    path = tmp_path / "repair.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=3, segment_size="4MiB", storage_timeout=1.0) as cluster:
            c = cluster.client(local_reads=False, local_writes=False)
            for i in range(4):
                c.put(b"k%d" % i, bytes([65 + i]) * 3000, replicas=2)
            c.remove(b"k0")
            cluster.storage[2].stop()
            wait_for(lambda: master_steps(path, "ListReplica"), timeout=60,
                     what="a repaired replica listed")
            for i in range(1, 4):
                assert bytes(c.get(b"k%d" % i)) == bytes([65 + i]) * 3000
    copies = [r for f in nodetrace.node_files(path) for r in rows(f)
              if r.get("asked", {}).get("op") == "write"]
    assert copies, "no write recorded"
    verdict = mergetrace.check(path)
    assert verdict.ok, verdict.message
