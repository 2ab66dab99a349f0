"""The traces of a master that takes over (``kvproto trace check``,
:mod:`kvproto.checking.traces` and :mod:`kvproto.checking.leasetrace`): real
processes, the first master killed. The new master's lease table opens with
what it recovered, inherited, and its recorded steps are a behaviour of
``spec/Lease.tla`` from the spec's ``Takeover``; the trace is checked before
what the client saw, so that a new master that forgets the old leases (the
mutant ``new-master-forgets-leases``) is caught by the trace. Its publish
steps (reads of what it recovered, puts, a refused put, removes) are a
behaviour of ``spec/Publish.tla`` from the directory it recovered, which its
``opened`` line lists; a step changed by hand (an accepted ``PutEnd``
recorded as refused) is rejected at that step, a read of a key the recovered
directory did not list at the read, and a recovered directory holding a
token the master had not issued from the start. Merged with its nodes'
steps under its term (``kvproto trace merge``, from the region tables they
held at its fence), the successor's run is a behaviour of ``spec/Publish.tla``
too; a node's write under a token the successor never granted, and a purge
freeing a listed region, are rejected at that step."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

import kvproto
from kvproto import cli, errors
from kvproto.checking import mergetrace, nodetrace, traces
from kvproto.runtime import tracing

import test_master_failover as failover
from runtime_helpers import Processes, wait_for

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")

LEASE_TTL = 1.5


@needs_java
def test_a_new_masters_lease_trace_is_a_behaviour_of_the_spec(children, raw, tmp_path, monkeypatch):
    url = f"file://{tmp_path}/coordinator"
    path = tmp_path / "second.trace"
    a, a_addr = failover.start_master(children, url, LEASE_TTL)
    wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
    monkeypatch.setenv(tracing.ENV, str(path))        # only the second master records
    b, b_addr = failover.start_master(children, url, LEASE_TTL)
    monkeypatch.delenv(tracing.ENV)
    failover.start_storage(children, url)
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 1,
             what="the storage node registered")
    client.put(b"held", failover.value(b"held"))
    client.put(b"other", failover.value(b"other"))
    reader = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    (held,) = reader.read_begin([b"held"])
    a.stop(signal.SIGKILL)
    wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20, what="the standby open")
    try:                                                  # the old master's lease may still run
        client.remove(b"held")
        early = "removed"
    except errors.ObjectLeased:
        early = "refused"
    assert bytes(client.get(b"other")) == failover.value(b"other")   # a lease of this master
    assert isinstance(reader.renew([held])[0], errors.LeaseExpired)  # an older term's lease id
    if early == "refused":
        wait_for(lambda: failover._removed(client, b"held"), timeout=10,
                 what="the remove after the quiet period")
    client.flush_releases()
    reader.close()
    client.close()

    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    opened = [s for s in recorded if s["machine"] == "lease" and "opened" in s]
    assert len(opened) == 1 and opened[0]["opened"]["objects"] == 2
    assert sorted(k for k, _ in opened[0]["opened"]["inherited"]) == ["held", "other"]
    verdicts = traces.check(path)
    assert verdicts["publish"].ok, verdicts["publish"].message    # from the recovered directory
    lease = verdicts["lease"]
    assert lease.ok and lease.steps > 0, lease.message
    removed = [s for s in recorded if s["machine"] == "lease"
               and s.get("event", {}).get("type") == "Remove"]
    assert removed and removed[0]["event"]["key"] == "held"
    assert early == "refused"        # what the client saw (checked after the trace, which
                                     # rejects a new master that removed it at once)



def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def publish_steps(path: Path, kind: str) -> list[dict]:
    return [r for r in rows(path) if r["machine"] == "publish"
            and r.get("event", {}).get("type") == kind]


@pytest.fixture(scope="module")
def successor(tmp_path_factory) -> Path:
    """The trace of a master that took over from one killed after puts of
    ``a``, ``b``, ``c`` (two replicas each, on two nodes), a remove of ``b``
    and a put of ``p`` left unpublished: it reads ``a``, puts ``d``, is
    refused a put of ``c`` (it exists), removes ``c`` once the old master's
    leases may have run out, reads ``d``. Its nodes record beside it from
    their start (``p``'s regions go in their purge)."""
    out = tmp_path_factory.mktemp("successor")
    url, path = f"file://{out}/coordinator", out / "second.trace"
    procs = Processes()
    children, raw = procs.child, procs.raw
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    try:
        a, a_addr = failover.start_master(children, url, LEASE_TTL)
        wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
        with pytest.MonkeyPatch.context() as mp:   # the second master records, and the
            mp.setenv(tracing.ENV, str(path))       # nodes (their files beside its file)
            _, b_addr = failover.start_master(children, url, LEASE_TTL)
            for _ in range(2):
                failover.start_storage(children, url)
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 2,
                 what="the storage nodes registered")
        for key in (b"a", b"b", b"c"):
            client.put(key, failover.value(key), replicas=2)
        client.remove(b"b")
        # an attempt left unpublished: the successor's nodes purge its regions
        body = raw(a_addr).call("put_start", {"client": "w", "replicas": 2,
                                              "items": [[b"p", 4096]]}).body
        assert "items" in body, f"the first master refused the unpublished put: {body}"
        status, _ = body["items"][0]
        assert status == 0
        wait_for(lambda: all(any(r.get("event", {}).get("type") == "AssignRegion"
                                 and r["event"]["key"] == "p" for r in rows(f))
                             for f in nodetrace.node_files(path)),
                 what="the unpublished attempt's regions assigned at both nodes")
        a.stop(signal.SIGKILL)
        wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20, what="the standby open")
        assert bytes(client.get(b"a")) == failover.value(b"a")
        client.put(b"d", failover.value(b"d"), replicas=2)
        with pytest.raises(errors.KeyExists):
            client.put(b"c", failover.value(b"c"), replicas=2)
        wait_for(lambda: failover._removed(client, b"c"), timeout=20,
                 what="the remove after the quiet period")
        assert bytes(client.get(b"d")) == failover.value(b"d")
        client.flush_releases()
    finally:
        client.close()
        procs.close()
    return path


def test_the_successor_lists_the_directory_it_recovered(successor):
    header = rows(successor)[0]["opened"]
    # term 2, or later where a loaded machine let the first master's election
    # key (TTL 1 s) lapse and it was elected again before it was killed
    assert header["term"] >= 2 and header["objects"] == 2
    directory = header["directory"]
    assert sorted(directory) == ["a", "c"]
    for key, record in directory.items():
        assert record["status"] == "published" and record["token"] < header["next_token"]
        assert record["length"] == len(failover.value(key.encode()))
        assert record["requested"] == 2 and record["reads"] == 0 and record["repairs"] == []
        assert len({r["segment"] for r in record["replicas"]}) == 2
        assert {"checksum", "length"} <= set(record)
    assert sorted(header["free"]) == sorted(header["segments"])
    for segment, capacity in header["segments"].items():
        held = sum(r["length"] for rec in directory.values() for r in rec["replicas"]
                   if r["segment"] == segment)
        assert header["free"][segment] == capacity - held


@needs_java
def test_the_successors_publish_run_is_a_behaviour_of_the_spec(successor, tmp_path, capsys):
    kinds = {r["event"]["type"] for r in rows(successor) if r["machine"] == "publish" and "n" in r}
    assert kinds >= {"ReadBegin", "PutStart", "PutEnd", "Remove"}
    # both machines' runs pass (status 0), checked as traces.check checks them
    assert cli.main(["trace", "check", "--keep", str(tmp_path), str(successor)]) == 0, \
        capsys.readouterr()
    out = capsys.readouterr().out
    assert "publish: all " in out and "lease: " in out, out
    assert "TraceInit == OpenedInit" in (tmp_path / "PublishTrace.tla").read_text()


def edited(path: Path, out: Path, change) -> tuple[Path, dict]:
    """``path`` with ``change`` applied to the first publish line it accepts
    (returns True), written to ``out``; and that line."""
    hit = None
    kept = []
    for r in rows(path):
        if hit is None and r["machine"] == "publish" and change(r):
            hit = r
        kept.append(r)
    assert hit is not None
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out, hit


def _refuse_put_end(r) -> bool:
    """An accepted PutEnd recorded as refused (the spec allowed it)."""
    if r.get("event", {}).get("type") != "PutEnd" or r["effects"][0]["type"] == "Refused":
        return False
    r["effects"] = [{"type": "Refused", "error": {"type": "StaleToken", "message": "changed"}}]
    return True


def _forget_a(r) -> bool:
    """The opened line without ``a``: the successor later reads a key it did not recover."""
    if "opened" not in r:
        return False
    header = r["opened"]
    del header["directory"]["a"]
    header["recovered"] = [e for e in header["recovered"] if e[0] != "a"]
    header["objects"] -= 1
    return True


@needs_java
def test_an_accepted_put_end_recorded_as_refused_is_rejected_at_that_step(successor, tmp_path):
    path, hit = edited(successor, tmp_path / "t.trace", _refuse_put_end)
    verdict = traces.check_each(path)["publish"]
    assert not verdict.ok and verdict.failed_step == hit["n"], verdict.message
    assert "PutEnd(" in verdict.message and "refused StaleToken" in verdict.message


@needs_java
def test_a_read_of_a_key_the_directory_did_not_recover_is_rejected(successor, tmp_path):
    path, _ = edited(successor, tmp_path / "t.trace", _forget_a)
    read = next(r for r in publish_steps(path, "ReadBegin") if r["event"]["key"] == "a")
    assert read["effects"][0]["type"] == "ReadGranted"
    verdict = traces.check_each(path)["publish"]
    assert not verdict.ok and verdict.failed_step == read["n"], verdict.message
    assert "ReadBegin(key='a')" in verdict.message


@needs_java
def test_a_recovered_token_the_master_would_issue_again_is_rejected(successor, tmp_path):
    """The directory opened with ``c`` under the token the master issues next
    (a master that restarts its tokens below what it recovered)."""
    def reissue(r) -> bool:
        if "opened" not in r:
            return False
        r["opened"]["directory"]["c"]["token"] = r["opened"]["next_token"]
        return True
    path, _ = edited(successor, tmp_path / "t.trace", reissue)
    verdict = traces.check_each(path)["publish"]
    assert not verdict.ok and verdict.failed_step is None, verdict.message
    assert "TokensIssued" in verdict.message and "opened with" in verdict.message


# --- the successor merged with its nodes (kvproto trace merge) ------------------


def copied(path: Path, out: Path, change) -> tuple[Path, Path, object]:
    """``path`` and its node files copied to ``out`` (and ``out.storage-*``),
    the first node file's lines edited in place by ``change`` (a line it marks
    ``drop`` left out): the copies of the master's and that node's file, and
    what ``change`` returned."""
    shutil.copy(path, out)
    node, hit = None, None
    for f in nodetrace.node_files(path):
        lines = rows(f)
        target = Path(f"{out}.storage-{f.name.split('storage-')[1]}")
        if node is None:
            node, hit = target, change(lines)
        target.write_text("".join(json.dumps(r) + "\n" for r in lines if not r.get("drop")))
    return out, node, hit


def node_event(lines: list, kind: str, **fields) -> dict:
    """The first step of ``kind`` whose event has ``fields``."""
    return next(r for r in lines if r.get("event", {}).get("type") == kind
                and all(r["event"].get(k) == v for k, v in fields.items()))


@needs_java
def test_the_successor_merged_with_its_nodes_is_a_behaviour_of_the_spec(successor, capsys):
    """Each node's steps under the successor's term (its purge of ``p``'s
    region, ``d``'s assign and write, ``c``'s free) from the region table it
    held at its fence: ``a``'s and ``c``'s regions written, ``p``'s not."""
    header = rows(successor)[0]["opened"]
    for f in nodetrace.node_files(successor):
        node = nodetrace.read_node(f, header["term"])
        p = node_event(rows(f), "StampedAllocate", key="p")["event"]["token"]
        (table,) = node.table.values()
        assert sorted(table.values()) == sorted(
            [(header["directory"][k]["token"], True) for k in ("a", "c")] + [(p, False)])
        (purge,) = [s for _, s in node.steps if s.get("purge")]
        assert purge["event"]["token"] == p
        assert {s["event"]["type"] for _, s in node.steps} >= {"AssignRegion", "WriteReplica",
                                                               "FreeRegion"}
    assert cli.main(["trace", "merge", "--run", "1", str(successor)]) == 0
    assert "of the master and 2 node(s) are steps of spec/Publish.tla" in capsys.readouterr().out
    assert cli.main(["trace", "merge", "--run", "2", str(successor)]) == 2
    assert "holds 1 run(s); there is no run 2" in capsys.readouterr().err


def _write_under_the_purged_token(lines: list) -> int:
    """The node accepts ``d``'s write under ``p``'s token: an attempt the old
    master granted and the successor never did."""
    p = node_event(lines, "StampedAllocate", key="p")["event"]["token"]
    d = node_event(lines, "StampedAllocate", key="d")["event"]["token"]
    write = node_event(lines, "WriteReplica", token=d)
    write["event"]["token"] = write["effects"][0]["token"] = p
    return write["n"]


def _purge_a_listed_region(lines: list) -> int:
    """The node's index held ``p`` at ``a``'s region: its purge frees that
    region, which the recovered directory lists."""
    a = node_event(lines, "StampedAllocate", key="a")["event"]
    p = node_event(lines, "StampedAllocate", key="p")["event"]
    free = node_event(lines, "FreeRegion", token=p["token"])
    for ev in (p, free["event"]):
        ev["offset"], ev["token"] = a["offset"], a["token"]
    return free["n"]


@needs_java
@pytest.mark.parametrize("change", [_write_under_the_purged_token, _purge_a_listed_region])
def test_a_successors_node_step_changed_by_hand_is_rejected_at_that_step(successor, tmp_path,
                                                                         change):
    path, node, n = copied(successor, tmp_path / "t.trace", change)
    verdict = mergetrace.check(path)
    assert not verdict.ok and verdict.failed_step == n, verdict.message
    assert f"{node.name} step {n} " in verdict.message


@needs_java
def test_a_free_the_recovery_sent_itself_is_a_command_in_flight(successor, tmp_path):
    """A node's free of ``p``'s region recorded as the recovery's own (the
    ``opened`` line's ``frees``, as for a replica left out for its checksum;
    the node's purge line left out): the head of its segment's commands."""
    def unpurged(lines: list) -> dict:
        purge = node_event(lines, "PurgeUnpublished")
        purge["drop"] = True
        ev = lines[lines.index(purge) + 1]["event"]
        return {k: ev[k] for k in ("segment", "offset", "token", "length")}

    path, _, free = copied(successor, tmp_path / "t.trace", unpurged)
    lines = rows(path)
    lines[0]["opened"]["frees"] = [free]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    verdict = mergetrace.check(path)
    assert verdict.ok, verdict.message


@needs_java
def test_a_listed_replica_its_node_never_wrote_is_rejected_where_the_run_starts(successor,
                                                                              tmp_path):
    def unwritten(lines: list) -> None:
        a = node_event(lines, "StampedAllocate", key="a")["event"]
        node_event(lines, "WriteReplica", token=a["token"])["drop"] = True

    path, _, _ = copied(successor, tmp_path / "t.trace", unwritten)
    verdict = mergetrace.check(path)
    assert not verdict.ok and verdict.failed_step is None, verdict.message
    assert "invariant OpenedOnNodes is violated where the run starts" in verdict.message
