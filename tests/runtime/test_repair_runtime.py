"""Replica repair with real processes (spec/Publish.tla RepairStart ..
ListReplica): a master, three storage nodes and objects of two replicas; one
node is killed, and the objects it held are copied from their live replica
onto the third node, listed only once their copy is complete, and read back
with their checksums. The same under a tenants file with a ticket key: the
copier's read of the source carries the read ticket the master issued for it
(to the repair reader), and the owner's usage is what it was before the loss."""

from __future__ import annotations

import functools
import json
import shutil
import signal
import time
from typing import Optional

import numpy as np
import pytest

import kvproto
from kvproto import errors
from kvproto.checking import traces

from runtime_helpers import wait_for

pytestmark = pytest.mark.runtime

STORAGE_TIMEOUT = 1.5
SEGMENT = 16 << 20
OBJECTS = 12
SIZE = 96 << 10
#: how long each node holds its read replies while the repairs run, so the
#: copies stay in flight long enough to be looked at
READ_DELAY_MS = 300
#: repair bytes a second per source node: two objects (the burst: half of one)
RATE = 2 * SIZE


#: a tenant's credential and the store's ticket key (the tenanted run)
TOKEN = "repair-owner-token-5Kq8sWz"
TICKET_KEY = "c3" * 32


def tenancy_args(tmp_path) -> str:
    """The keyword arguments giving a master or node the tenants file (one
    tenant, ``owner``, with a stored-bytes quota) and the ticket key."""
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.owner]\ntokens = ["{TOKEN}"]\nstored = {4 * OBJECTS * SIZE}\n')
    return f"tenants=load_tenants({str(path)!r}), ticket_key={TICKET_KEY.encode()!r}"


def start_master(spawn, rate: int, extra: str = "", trace: str = ""):
    m = spawn(f"""
        import logging; logging.basicConfig(level=logging.WARNING)
        from kvproto.ops.tenants import load_tenants
        from kvproto.runtime.embedded import run_master
        run_master("tcp://127.0.0.1:*", writer_timeout=5.0, storage_timeout={STORAGE_TIMEOUT},
                   repair_rate={rate}, max_repairs=2, trace={trace or None!r}, {extra})
    """)
    line = m.readline()
    assert line.startswith("kvproto master listening on tcp://127.0.0.1:"), line
    return m, line.rsplit(" ", 1)[1]


def start_storage(spawn, master, extra: str = ""):
    s = spawn(f"""
        from kvproto.ops.tenants import load_tenants
        from kvproto.runtime.embedded import run_storage
        run_storage({master!r}, "{SEGMENT}", debug=True, {extra})
    """)
    assert s.readline().startswith("kvproto storage listening on tcp://127.0.0.1:")
    return s


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def listed(raw, master: str, keys: list, cred: Optional[dict] = None,
           tickets: Optional[dict] = None) -> dict:
    """key -> the segments the master hands readers now (a leased read, so no
    pin is left behind), or None for a miss; with ``tickets``, each replica's
    read ticket is put there (a store with tenants)."""
    reply = raw(master).call("read_begin", {"client": "repair-probe", "keys": keys,
                                            "lease": True, **(cred or {})})
    assert reply.status == 0, reply.body
    out = {}
    for key, (code, item) in zip(keys, reply.body["items"]):
        out[key] = [(seg, off, item["token"]) for seg, off, _ in item["replicas"]] if code == 0 \
            else None
        if tickets is not None and code == 0:
            tickets.update(zip(out[key], item["tickets"]))
    return out, reply.body["segments"]


@pytest.mark.parametrize("tenanted", [False, True], ids=["plain", "tenants"])
def test_the_objects_of_a_killed_node_are_repaired_to_their_count(children, raw, tmp_path,
                                                                   tenanted):
    raw = functools.cache(raw)      # one socket per endpoint, however long the repairs take
    extra = tenancy_args(tmp_path) if tenanted else ""
    cred = {"cred": TOKEN.encode()} if tenanted else {}
    tickets = {} if tenanted else None
    master, address = start_master(children, rate=RATE, extra=extra)
    nodes = [start_storage(children, address, extra) for _ in range(3)]
    client = kvproto.Client(master=address, timeout=10.0, local_reads=False,
                            token=TOKEN if tenanted else None)
    try:
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 3,
                 timeout=30.0, what="three storage nodes")
        keys = [b"obj-%02d" % i for i in range(OBJECTS)]
        for i, key in enumerate(keys):
            client.put(key, payload(i), replicas=2)
        before, endpoints = listed(raw, address, keys, cred)
        assert all(len(r) == 2 for r in before.values())
        held = _held(client.stats())
        assert held == ({"held": OBJECTS * 2 * SIZE, "namespaces": {"default": OBJECTS * 2 * SIZE}}
                        if tenanted else None)
        segments = {s: info for s, info in client.stats()["segments"].items() if info["live"]}
        # the node holding the most replicas dies; every source left is slowed
        on = {s: sum(any(seg == s for seg, _, _ in r) for r in before.values()) for s in segments}
        victim = max(on, key=on.get)
        hit = [k for k, r in before.items() if any(seg == victim for seg, _, _ in r)]
        assert hit
        for s, info in segments.items():
            if s != victim:
                assert raw(info["endpoint"]).call(
                    "debug", {"read_delay_ms": READ_DELAY_MS, **cred}).status == 0
        _child_of(nodes, segments, victim, raw, cred).stop(signal.SIGKILL)

        # while the repairs run: every replica the master lists is complete at
        # its node (a node refuses a read of an unwritten region) with the
        # object's bytes, looked at as soon as it is listed
        seen_in_flight, checked, first = 0, set(), None
        deadline = time.monotonic() + 60
        while True:
            stats = client.stats()
            in_flight = stats["repairs"]["in_flight"]
            if in_flight and first is None:
                first = time.monotonic()
            now, endpoints = listed(raw, address, keys, cred, tickets)
            for key, replicas in now.items():
                assert replicas, f"{key!r} was lost"
                for seg, off, token in replicas:
                    if (seg, off, token) in before[key] or (seg, off, token) in checked:
                        continue     # an original replica (or the victim's, until noticed)
                    ticket = {"ticket": tickets[(seg, off, token)]} if tenanted else {}
                    reply = raw(endpoints[seg][0]).call(
                        "read", {"segment": seg, "offset": off, "token": token,
                                 "term": stats["failover"]["term"], "length": SIZE,
                                 **cred, **ticket},
                        timeout=10.0)
                    assert reply.status == 0, (key, seg, reply.body)
                    assert bytes(reply.payloads[0]) == payload(keys.index(key))
                    checked.add((seg, off, token))
            seen_in_flight += in_flight > 0
            if all(len(r) == 2 and all(seg != victim for seg, _, _ in r) for r in now.values()):
                break
            assert time.monotonic() < deadline, (stats["counters"], stats["repairs"])
            time.sleep(0.01)
        assert seen_in_flight, "no repair was seen in flight: the check above proved nothing"
        took = time.monotonic() - first
        stats = client.stats()
        assert len(checked) == len(hit)
        # the rate limit: two sources, each at most RATE a second plus its burst
        # (a take may overdraw a bucket by one object)
        assert took >= 0.8 * (len(hit) * SIZE / 2 - SIZE) / RATE, took
        assert stats["counters"]["repairs_listed"] == len(hit)
        assert stats["counters"]["bytes_repaired"] == len(hit) * SIZE
        assert stats["counters"]["repair_reports_refused"] == 0
        # a repaired replica restores one its owner was charged for: its usage
        # is what it was before the loss (spec/Tenancy.tla: an object's bytes
        # are held from WriteStart until it is gone, whatever its replicas do)
        assert _held(stats) == held
        # every object back at two replicas on two live, distinct segments, and
        # its bytes right (checked against the writer's checksum) from each
        after, _ = listed(raw, address, keys, cred)
        for key in keys:
            segs = [seg for seg, _, _ in after[key]]
            assert len(set(segs)) == 2 and victim not in segs
        for s, info in client.stats()["segments"].items():
            if info["live"]:
                raw(info["endpoint"]).call("debug", {"read_delay_ms": 0, **cred})
        for i, key in enumerate(keys):
            assert client.get(key, verify=True) == payload(i)
        # a copier's report naming no repair in flight (a late report of a
        # cancelled copy) is refused and lists nothing
        seg = after[keys[0]][-1][0]
        late = raw(address).call("repair_done", {"segment": seg, "key": keys[0], "repair": 1})
        assert late.status == errors.StaleToken.code, late.body
        assert listed(raw, address, keys[:1], cred)[0] == {keys[0]: after[keys[0]]}
        assert client.stats()["counters"]["repair_reports_refused"] == 1
    finally:
        client.close()


def _held(stats):
    """The owner's bytes held, in all and per namespace (a store with tenants)."""
    usage = stats.get("tenants", {}).get("owner")
    return usage and {"held": usage["held"], "namespaces": usage["namespaces"]}


def _child_of(nodes, segments, victim, raw, cred):
    """The child process serving segment ``victim``."""
    assert raw(segments[victim]["endpoint"]).call("stats", cred).body["segment"] == victim
    # the segment id is host:pid:nonce (runtime/storage_server.py new_segment_id)
    pid = int(victim.split(":")[-2])
    (child,) = [c for c in nodes if c.proc.pid == pid]
    return child


needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")


def traced_repairs(children, raw, path) -> None:
    """A master recording its steps to ``path`` and three nodes; four objects
    of two replicas; the node holding most of them killed, and every object
    repaired back to two replicas."""
    _, address = start_master(children, rate=64 << 20, trace=str(path))
    nodes = [start_storage(children, address) for _ in range(3)]
    client = kvproto.Client(master=address, timeout=10.0, local_reads=False)
    try:
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 3,
                 timeout=30.0, what="three storage nodes")
        keys = [b"obj-%02d" % i for i in range(4)]
        for i, key in enumerate(keys):
            client.put(key, payload(i)[:8192], replicas=2)
        before, _ = listed(raw, address, keys)
        segments = {s: info for s, info in client.stats()["segments"].items() if info["live"]}
        on = {s: sum(any(seg == s for seg, _, _ in r) for r in before.values()) for s in segments}
        victim = max(on, key=on.get)
        _child_of(nodes, segments, victim, raw, {}).stop(signal.SIGKILL)
        wait_for(lambda: client.stats()["counters"]["repairs_listed"] == on[victim],
                 timeout=60.0, interval=0.2, what="every object repaired")
        assert all(len(r) == 2 and all(seg != victim for seg, _, _ in r)
                   for r in listed(raw, address, keys)[0].values())
        assert client.get(keys[0], verify=True) == payload(0)[:8192]
    finally:
        client.close()


@pytest.mark.tlc
@needs_java
def test_a_traced_run_with_repairs_is_a_behaviour_of_the_spec(children, raw, tmp_path):
    """TLC walks the master's recorded steps, repairs included: each
    ``RepairStart`` names the next id and a joined segment, each
    ``ListReplica`` follows its copier's report of a complete copy (the
    spec's ``CopyReplica``), and a hand-made ``ListReplica`` with no report
    is rejected at its step."""
    path = tmp_path / "repairs.trace"
    traced_repairs(children, raw, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {r["event"]["type"] for r in rows if "event" in r}
    assert {"RepairStart", "ListReplica", "SegmentLost"} <= kinds
    verdicts = traces.check(path)
    assert verdicts["publish"].ok, verdicts["publish"].message
    assert verdicts["lease"].ok, verdicts["lease"].message
    # the same run with one repair step changed: rejected at that step
    for kind, change in CHANGES:
        changed = json.loads(json.dumps(rows))
        step = next(r for r in changed if r.get("event", {}).get("type") == kind)
        change(step)
        bad = tmp_path / "changed.trace"
        bad.write_text("".join(json.dumps(r) + "\n" for r in changed))
        verdict = traces.check_run(*traces.publish_run(traces.read(bad)["publish"]))
        assert not verdict.ok and verdict.failed_step == step["n"], (change, verdict.message)
        assert kind in verdict.message


def _holder(step):
    """The repair's destination made a segment that holds the object already."""
    step["event"]["replica"]["segment"] = \
        step["after"]["objects"][step["event"]["key"]]["replicas"][0]["segment"]


#: hand-made changes of a repair step that the trace check must reject
CHANGES = [
    ("ListReplica", lambda s: s.pop("report")),                            # listed unreported
    ("ListReplica", lambda s: s.update(report={"copied": False, "error": 1})),  # a failed copy
    ("ListReplica", lambda s: s["event"].update(repair=s["event"]["repair"] + 1)),
    ("RepairStart", lambda s: s["effects"][0].update(repair=s["effects"][0]["repair"] + 1)),
    ("RepairStart", _holder),
]
