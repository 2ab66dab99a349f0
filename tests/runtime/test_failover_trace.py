"""The fence, index and purge steps of a master takeover checked by TLC against
``spec/Failover.tla`` (``kvproto trace failover``, :mod:`kvproto.checking.failtrace`).

A real run of two masters and two storage nodes as processes, every one
recording (puts with one and two replicas, a remove, an attempt left
unpublished, the first master killed, the second fencing, recovering,
purging and serving, and a late assign and a read of the old term refused
by a node) is a behaviour of the spec, and what the new master says it recovered is
what the fenced nodes' indexes held. Steps changed by hand are rejected at
the step that breaks the rules: a node that accepts the old term's
allocation after its fence, refuses the new term's allocation or read, or
purges less than
the recovery did, and a master that recovers another directory (one object
or one replica fewer)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import kvproto
from kvproto import cli, errors
from kvproto.checking import failtrace
from kvproto.runtime import tracing

import test_master_failover as failover
from runtime_helpers import Processes, wait_for

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc, pytest.mark.runtime]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def start(children, url: str, env: str, what):
    """Start ``what`` (a master or a storage node) recording beside ``env``."""
    old = os.environ.get(tracing.ENV)
    os.environ[tracing.ENV] = env
    try:
        return what(children, url)
    finally:
        if old is None:
            os.environ.pop(tracing.ENV, None)
        else:
            os.environ[tracing.ENV] = old


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The directory of a takeover run's trace files (see the module docstring)."""
    out = tmp_path_factory.mktemp("failover")
    url = f"file://{out}/coordinator"
    procs = Processes()
    children, raw = procs.child, procs.raw
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    try:
        a, a_addr = start(children, url, str(out / "first.trace"), failover.start_master)
        wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
        b, b_addr = start(children, url, str(out / "second.trace"), failover.start_master)
        nodes = [start(children, url, str(out / "nodes.trace"), failover.start_storage)[1]
                 for _ in range(2)]
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 2,
                 what="the storage nodes registered")
        client.put(b"a", failover.value(b"a"), replicas=2)
        client.put(b"b", failover.value(b"b"))
        client.remove(b"b")
        client.put(b"c", failover.value(b"c"))
        # an attempt that is never published: the new master purges it
        rep = client._call_master("put_start", {"client": "stalled", "replicas": 1,
                                                "items": [[b"pending", 3000]]},
                                  time.monotonic() + 5)
        assert rep.body["items"][0][0] == 0
        old = rep.body["term"]
        a.stop(signal.SIGKILL)
        wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20,
                 what="the standby open")
        assert bytes(client.get(b"a")) == failover.value(b"a")
        # and over the network: a read a node serves (and records)
        remote = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0, local_reads=False)
        try:
            assert bytes(remote.get(b"a")) == failover.value(b"a")
        finally:
            remote.close()
        # a third node joins the new master
        start(children, url, str(out / "nodes.trace"), failover.start_storage)
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 3,
                 what="the third storage node registered")
        client.put(b"f", failover.value(b"f"), replicas=3)
        client.put(b"d", failover.value(b"d"))
        client.put(b"e", failover.value(b"e"))
        client.remove(b"d")
        # the old master's late assign reaches a fenced node: refused
        node = raw(nodes[0])
        seg = node.call("stats", {}).body["segment"]
        late = node.call("assign", {"segment": seg, "term": old,
                                    "regions": [[1 << 20, 4096, b"late", 99]]})
        assert late.status == errors.StaleTerm.code
        # and a reader's read with a descriptor of the old term: a miss
        read = node.call("read", {"segment": seg, "term": old, "offset": 0, "token": 1,
                                  "length": 1})
        assert read.status == errors.StaleTerm.code
    finally:
        client.close()
        procs.close()
    return out


def files(run: Path) -> tuple[list[Path], list[Path]]:
    nodes = sorted(run.glob("nodes.trace.storage-*"))
    return nodes, [run / "first.trace", run / "second.trace"]


def test_every_node_records_the_takeover_steps(run):
    nodes, masters = files(run)
    assert len(nodes) == 3
    kinds = {r["event"]["type"] for f in nodes for r in rows(f) if "event" in r}
    assert kinds >= {"Fence", "StampedAllocate", "StampedPublish", "StampedFree",
                     "PurgeUnpublished", "StaleRequest"}
    stale = [r["event"]["op"] for f in nodes for r in rows(f)
             if r.get("event", {}).get("type") == "StaleRequest"]
    assert stale == ["assign", "read"]
    served = [r for f in nodes for r in rows(f)
              if r.get("event", {}).get("type") == "ReadReplica" and r["effects"][0]["type"] != "Refused"]
    assert served, "no read served"       # the get of a after the takeover
    purged = [k for f in nodes for r in rows(f)
              if r.get("event", {}).get("type") == "PurgeUnpublished"
              for k in r["effects"][0]["keys"]]
    assert purged == ["pending"]
    openings = [failtrace.read_master(m) for m in masters]
    assert [[o["term"] for o in m] for m in openings] == [[1], [2]]
    assert openings[1][0]["keys"] == {"a", "c"}
    segments = [rows(f)[0]["opened"]["segment"] for f in nodes]
    assert {k for k, s in openings[1][0]["replicas"] if s in segments} == {"a", "c"}
    assert sorted(k for k, _ in openings[1][0]["replicas"]) == ["a", "a", "c"]


@needs_java
def test_a_takeover_run_is_a_behaviour_of_the_spec(run, tmp_path, capsys):
    nodes, masters = files(run)
    args = ["trace", "failover", "--keep", str(tmp_path), *map(str, nodes)] + \
        [a for m in masters for a in ("--master", str(m))]
    assert cli.main(args) == 0, capsys.readouterr()      # failtrace.check's verdict: ok
    assert "of 3 segment(s) and 2 term(s) are steps of spec/Failover.tla" in capsys.readouterr().out
    assert "EXTENDS Failover" in (tmp_path / "FailoverTrace.tla").read_text()


def edit(run: Path, out: Path, change) -> tuple[list[Path], list[Path], tuple]:
    """The run's files copied to ``out`` with ``change`` applied to the first
    recorded line it accepts (returns True): the files and ``(file, n)`` of that line."""
    out.mkdir()
    nodes, masters = files(run)
    hit = None
    for f in nodes + masters:
        kept = []
        for r in rows(f):
            if hit is None and change(r):
                hit = (out / f.name, r.get("n"))
            kept.append(r)
        (out / f.name).write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert hit is not None
    return [out / f.name for f in nodes], [out / f.name for f in masters], hit


def _accept_stale(r):
    """The fenced node accepts the old master's late allocation."""
    ev = r.get("event", {})
    if ev.get("type") != "StaleRequest" or ev["op"] != "assign":
        return False
    r["event"] = {"type": "StampedAllocate", "node": r["segment"], "key": "late",
                  "term": ev["term"], "offset": 1 << 20, "length": 4096, "token": 99}
    r["effects"] = [{"type": "StorageAccepted", "key": "late", "term": ev["term"]}]
    return True


def _refuse_current(r):
    """A node refuses the new master's allocation as stale."""
    ev = r.get("event", {})
    if ev.get("type") != "StampedAllocate" or ev["term"] != 2:
        return False
    r["effects"] = [{"type": "Refused", "error": {"type": "StaleTerm", "message": "x"}}]
    return True


def _refuse_current_read(r):
    """A node refuses a read stamped with the new term as stale."""
    ev = r.get("event", {})
    if ev.get("type") != "StaleRequest" or ev["op"] != "read":
        return False
    ev["term"] = 2
    return True


def _purge_less(r):
    """A node keeps the older term's unpublished allocation at the purge."""
    ev = r.get("event", {})
    if ev.get("type") != "PurgeUnpublished" or not r["effects"][0]["keys"]:
        return False
    r["effects"][0]["keys"] = []
    return True


def _serve_an_unheld_region(r):
    """A node serves a read of a region under a token no allocation of its
    index holds (the spec's Read of it is a miss)."""
    ev = r.get("event", {})
    if ev.get("type") != "ReadReplica" or r["effects"][0]["type"] == "Refused":
        return False
    ev["token"] = r["effects"][0]["token"] = 99
    return True


@needs_java
@pytest.mark.parametrize("change", [_accept_stale, _refuse_current, _refuse_current_read,
                                    _purge_less, _serve_an_unheld_region])
def test_a_node_step_changed_by_hand_is_rejected_at_that_step(run, tmp_path, change):
    nodes, masters, (where, n) = edit(run, tmp_path / "bad", change)
    verdict = failtrace.check(nodes, masters)
    assert not verdict.ok
    assert verdict.failed_step == n, verdict.message
    assert verdict.message.startswith(f"{where.name} step {n} "), verdict.message


def _recover_less(r):
    """The new master says it recovered one object fewer than the nodes held."""
    opened = r.get("opened", {})
    if r.get("machine") != "publish" or opened.get("term") != 2:
        return False
    opened["objects"] -= 1
    return True


def _recover_one_replica(r):
    """The new master lists one replica of an object the nodes hold two of."""
    opened = r.get("opened", {})
    if r.get("machine") != "publish" or opened.get("term") != 2:
        return False
    for item in opened["recovered"]:
        if len(item[1]) == 2:
            item[1] = item[1][:1]
            return True
    return False


@needs_java
@pytest.mark.parametrize("change", [_recover_less, _recover_one_replica])
def test_a_master_that_recovers_another_directory_is_rejected_at_its_recovery(
        run, tmp_path, change):
    nodes, masters, _ = edit(run, tmp_path / "bad", change)
    verdict = failtrace.check(nodes, masters)
    assert not verdict.ok and verdict.failed_step is None
    assert verdict.message.startswith("Recover of the master of term 2 "), verdict.message
    # without the masters' files the nodes' steps alone are a behaviour of the spec
    assert failtrace.check(nodes).ok


def _lines(*steps) -> str:
    return "".join(json.dumps({"machine": "storage", **step}) + "\n" for step in steps)


def _step(n: int, ev: dict, effects: list) -> dict:
    return {"n": n, "segment": "s", "event": ev, "effects": effects}


def _fence(n: int, term: int) -> dict:
    return _step(n, {"type": "Fence", "term": term}, [{"type": "FenceAck", "term": term}])


def _alloc(n: int, key: str, term: int) -> dict:
    return _step(n, {"type": "StampedAllocate", "key": key, "term": term},
                 [{"type": "StorageAccepted", "key": key, "term": term}])


def _publish(n: int, key: str, term: int) -> dict:
    return _step(n, {"type": "StampedPublish", "key": key, "term": term},
                 [{"type": "StorageAccepted", "key": key, "term": term}])


def _read(n: int, offset: int, token: int) -> dict:
    return _step(n, {"type": "ReadReplica", "segment": "a1", "offset": offset, "token": token},
                 [{"type": "Accepted", "segment": "a1", "offset": offset, "token": token}])


@needs_java
@pytest.mark.parametrize("where, rejected", [("published", False), ("before its publish", True),
                                             ("after its free", True), ("after a takeover", True)])
def test_a_read_the_node_served_is_a_read_of_the_spec(tmp_path, where, rejected):
    """A read node A served of ``x`` (its region at offset 0, token 1) is the
    spec's lookup and read of that replica: served once ``x`` is published,
    it is; served before ``x`` is published, after its free, or after a
    master took over and purged ``x`` (never published) it is not, and the
    run is rejected at the read."""
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    alloc = _step(2, {"type": "StampedAllocate", "key": "x", "term": 1, "offset": 0,
                      "length": 100, "token": 1},
                  [{"type": "StorageAccepted", "key": "x", "term": 1}])
    free = _step(5, {"type": "StampedFree", "key": "x", "term": 1, "token": 1},
                 [{"type": "StorageAccepted", "key": "x", "term": 1}])
    steps = {"published": [alloc, _publish(3, "x", 1), _read(4, 0, 1), free],
             "before its publish": [alloc, _read(4, 0, 1), _publish(3, "x", 1), free],
             "after its free": [alloc, _publish(3, "x", 1), free, _read(4, 0, 1)],
             "after a takeover": [alloc, _fence(3, 2),
                                  _step(5, {"type": "PurgeUnpublished", "below": 2},
                                        [{"type": "Purged", "keys": ["x"], "freed": 100}]),
                                  _read(4, 0, 1)]}[where]
    a.write_text(_lines({"opened": {"segment": "a1", "term": 0}}, _fence(1, 1), *steps))
    b.write_text(_lines({"opened": {"segment": "b", "term": 0}}, _fence(1, 1)))
    verdict = failtrace.check([a, b])
    if not rejected:
        assert verdict.ok, verdict.message
        return
    assert not verdict.ok and verdict.failed_step == 4, verdict.message
    assert verdict.message.startswith("a.trace step 4 "), verdict.message
    assert "Read(key='x'" in verdict.message, verdict.message


@needs_java
@pytest.mark.parametrize("restarted", [True, False])
def test_a_node_lost_at_a_takeover_is_left_out_and_may_start_over(tmp_path, capsys, restarted):
    """Node A holds ``x`` and is lost while the master of term 2 fences: it
    is not fenced, so the new master recovers without it; A starts over
    under a new segment and joins the new master. The same run where A, never
    fenced by term 2, takes an allocation of term 2 is rejected at the
    takeover: the new master recovered with a live node unfenced."""
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    later = [{"opened": {"segment": "a2", "term": 1}}, _fence(4, 2), _alloc(5, "y", 2)] \
        if restarted else [_alloc(4, "y", 2)]
    a.write_text(_lines({"opened": {"segment": "a1", "term": 0}}, _fence(1, 1),
                        _alloc(2, "x", 1), _publish(3, "x", 1), *later))
    b.write_text(_lines({"opened": {"segment": "b", "term": 0}}, _fence(1, 1), _fence(2, 2),
                        _step(3, {"type": "PurgeUnpublished", "below": 2},
                              [{"type": "Purged", "keys": [], "freed": 0}]),
                        _alloc(4, "z", 2)))
    if restarted:                   # failtrace.check's verdict: ok (status 0)
        assert cli.main(["trace", "failover", str(a), str(b)]) == 0, capsys.readouterr()
        assert "of 3 segment(s) and 2 term(s)" in capsys.readouterr().out
        return
    verdict = failtrace.check([a, b])
    assert not verdict.ok
    assert verdict.message.startswith("Recover of the master of term 2 "), verdict.message


@needs_java
@pytest.mark.parametrize("listed", [["b"], ["a1", "b"]])
def test_a_node_whose_fence_answer_came_late_is_lost_after_its_fence(tmp_path, listed):
    """Node A holds ``x`` and takes the fence of term 2, but its answer
    comes after the fence timeout: the new master recovers from B alone (its
    file lists only B's segment) and A starts over under a new segment. The
    same run where the master's file lists A's segment among those it
    recovered from, and recovers nothing of it, is rejected at the recovery."""
    a, b, m = tmp_path / "a.trace", tmp_path / "b.trace", tmp_path / "m2.trace"
    a.write_text(_lines({"opened": {"segment": "a1", "term": 0}}, _fence(1, 1),
                        _alloc(2, "x", 1), _publish(3, "x", 1), _fence(4, 2),
                        {"opened": {"segment": "a2", "term": 2}}, _fence(5, 2),
                        _alloc(6, "y", 2)))
    b.write_text(_lines({"opened": {"segment": "b", "term": 0}}, _fence(1, 1), _fence(2, 2),
                        _step(3, {"type": "PurgeUnpublished", "below": 2},
                              [{"type": "Purged", "keys": [], "freed": 0}]),
                        _alloc(4, "z", 2)))
    m.write_text(json.dumps({"machine": "publish", "opened": {
        "next_token": 5, "objects": 0, "segments": {s: 1 << 20 for s in listed}, "term": 2}}) + "\n")
    verdict = failtrace.check([a, b], [m])
    if listed == ["b"]:
        assert verdict.ok, verdict.message
    else:
        assert not verdict.ok
        assert verdict.message.startswith("Recover of the master of term 2 "), verdict.message


def test_a_node_file_that_is_not_a_trace_is_a_one_line_error(tmp_path, capsys):
    f = tmp_path / "node.trace"
    f.write_text('{"machine":"publish","opened":{"next_token":1}}\n')
    assert cli.main(["trace", "failover", str(f)]) == 2
    err = capsys.readouterr().err
    assert "does not start where a storage node opened its segment" in err
    assert err.count("\n") == 1


def test_a_replica_repaired_by_a_later_master_is_listed_with_its_original_and_traced(
        children, raw, tmp_path):
    """Three masters and three storage nodes recording: puts of two replicas
    in the first term, a node killed with the first master, the second
    master repairing the objects onto the third node, the third taking over.
    The repaired replicas' nodes recorded the objects' publishing term
    (spec ``Repair``, mapped to ``PublishCopy``), so the third master lists
    every original and every copy: each object has its two replicas at once,
    nothing is repaired again, and every published entry the nodes hold is
    listed (none leaked). The run, with what the third master recovered, is
    a behaviour of the spec."""
    url = f"file://{tmp_path}/coordinator"
    masters = [tmp_path / f"master{i}.trace" for i in (1, 2, 3)]
    a, a_addr = start(children, url, str(masters[0]), failover.start_master)
    wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
    b, b_addr = start(children, url, str(masters[1]), failover.start_master)
    storage = [start(children, url, str(tmp_path / "nodes.trace"), failover.start_storage)
               for _ in range(3)]
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    try:
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 3,
                 what="the storage nodes registered")
        keys = [f"r{i}".encode() for i in range(12)]
        for k in keys:
            client.put(k, failover.value(k), replicas=2)
        first = failover.open_at(url, a_addr, raw)["term"]
        victim, victim_ep = storage[0]
        victim_seg = failover.node_stats(raw, victim_ep)["segment"]
        hit = [lease.key for lease in client.read_begin(keys)
               if victim_seg in [seg for seg, *_ in lease.replicas]]
        assert hit, "no object had a replica on the node to lose"
        live = storage[1:]
        victim.stop(signal.SIGKILL)
        a.stop(signal.SIGKILL)
        second = wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20,
                          what="the second master open")
        # (the lost node is left out of the fence, or counted lost: its
        # registration may run out first)
        assert second["term"] > first and second["nodes_lost"] <= 1

        def repaired() -> bool:
            stats = [failover.node_stats(raw, ep) for _, ep in live]
            return all(s["indexed"] == s["published"] for s in stats) \
                and sum(s["published"] for s in stats) == 2 * len(keys)

        wait_for(repaired, timeout=30, what="the objects repaired to two replicas and marked")
        assert raw(b_addr).call("stats", {}).body["counters"]["repairs_listed"] == len(hit)
        c, c_addr = start(children, url, str(masters[2]), failover.start_master)
        b.stop(signal.SIGKILL)
        third = wait_for(lambda: failover.open_at(url, c_addr, raw), timeout=20,
                         what="the third master open")
        assert third["term"] > second["term"]
        stats = raw(c_addr).call("stats", {}).body
        assert stats["objects"] == len(keys) and stats["counters"]["checksum_mismatches"] == 0
        leases = client.read_begin(keys)
        assert all(len(lease.replicas) == 2 for lease in leases), \
            [(lease.key, lease.replicas) for lease in leases if len(lease.replicas) != 2]
        client.release(leases)
        for k, got in zip(keys, client.get_many(keys)):
            assert got is not None and bytes(got) == failover.value(k), k
        assert raw(c_addr).call("stats", {}).body["counters"]["repairs_started"] == 0
    finally:
        client.close()
    nodes = sorted(tmp_path.glob("nodes.trace.storage-*"))
    copies = [r["event"] for f in nodes for r in rows(f)
              if r.get("event", {}).get("type") == "StampedPublish"
              and 0 < r["event"].get("by", 0) < r["event"]["term"]]
    assert copies and all(ev["by"] == 1 for ev in copies)
    if shutil.which("java") is None:
        pytest.skip("TLC needs Java (the run's other checks passed)")
    verdict = failtrace.check(nodes, masters)
    assert verdict.ok, verdict.message
