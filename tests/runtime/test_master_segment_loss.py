"""A master that loses a segment holding many objects (no sockets).

The published objects whose only replica was on the lost segment leave the
directory, the lease table and the tenants' accounting in bulk
(``DirectoryCore.lose``, ``LeaseCore.drop_many``): the lease table is stepped
once (its clock), not once or more per object, and the outcome is the one the
master reaches one object at a time (the path it takes while recording a
trace): the same directory, lease table, tenants' state, counters, sessions
and commands. Objects with a replica left keep it; pending ones are revoked;
leased, pinned and inherited objects go too. The keys of the objects forgotten
in bulk leave the row index a slice per tick.
"""

from __future__ import annotations

import pytest

from kvproto.cores.leases import LeaseCore
from kvproto.ops.tenants import parse_tenants
from kvproto.runtime import wire
from kvproto.runtime.master import MasterCore
from kvproto.statemachines.publish import Status
from kvproto.statemachines.tenancy_system import INVARIANTS, System

PAGE = 512
OBJECTS = 900
SEGMENTS = ("seg-0", "seg-1", "seg-2")
TOKEN = "segment-loss-owner-Zq81kPd"
TICKET_KEY = b"5e" * 32


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def deliver(core: MasterCore) -> None:
    """Every command acknowledged, as a node that accepts them would."""
    while core.outbox:
        segment, op, cmd_id, body = core.outbox.pop(0)
        core.storage_reply(segment, wire.Reply(0, cmd_id, {
            "results": [wire.ok_item()] * len(body["regions"])}, []))


def call(core: MasterCore, op: str, body: dict):
    if core.tenants is not None:
        body = {"cred": TOKEN, **body}
    result = core.handle(op, body, reply_to="r", request_id=1)
    deliver(core)
    ready, core.ready[:] = list(core.ready), []
    if result is None:
        assert len(ready) == 1
        return ready[0][2], ready[0][3]
    return result


def items(body: dict) -> list:
    out = []
    for item in body["items"]:
        err, value = wire.item_result(item)
        assert err is None, err
        out.append(value)
    return out


def loaded_master(path, traced: bool, tenants: bool = True, quiet: bool = False) -> MasterCore:
    """A master (with tenants) holding ``OBJECTS`` published objects, two
    thirds with one replica, a third with two; some pending, some leased, some
    pinned. ``quiet``: its lease table as a takeover leaves it (every object
    inherited, no lease known) inside the quiet period."""
    clock = Clock()
    config = parse_tenants({"tenants": {"owner": {"tokens": [TOKEN], "stored": 1 << 40}}})
    path.mkdir(exist_ok=True)
    core = MasterCore(writer_timeout=600.0, storage_timeout=600.0, clock=clock,
                      tenants=config if tenants else (), ticket_key=TICKET_KEY,
                      trace=str(path / "trace.jsonl") if traced else None)
    for segment in SEGMENTS:
        status, _ = core.handle("register", {
            "segment": segment, "capacity": 4 * OBJECTS * PAGE, "endpoint": "tcp://127.0.0.1:1",
            "host": "h", "shm": "s", "gen_shm": "g", "nonce": 1, "page_size": PAGE})
        assert status == 0
    core.opened.clear()
    for first in range(0, OBJECTS, 100):
        replicas = 2 if first % 300 == 0 else 1
        batch = [[b"obj-%06d" % i, PAGE - i % 7] for i in range(first, first + 100)]
        status, body = call(core, "put_start", {"client": "w", "replicas": replicas,
                                                "items": batch})
        assert status == 0
        grants = items(body)
        done = [[key, g["token"]] for (key, _), g in zip(batch, grants)][:90]   # 10 stay pending
        status, body = call(core, "put_end", {"client": "w", "items": done})
        assert status == 0 and len(items(body)) == 90
    clock.t += 1.0
    leased = [b"obj-%06d" % i for i in range(0, OBJECTS, 7)]
    status, body = call(core, "read_begin", {"client": "r1", "keys": leased, "lease": True})
    assert status == 0
    status, body = call(core, "read_begin", {"client": "r2", "keys": leased[::3], "lease": True})
    status, body = call(core, "read_begin", {"client": "r3", "keys": leased[1::5]})  # pinned
    clock.t += 1.0
    core.tick()
    deliver(core)
    if quiet:
        core.leases = LeaseCore.inherit(core.directory, core.leases.ttl, clock(), quiet=60.0)
        assert core.leases.inherited_quiet()
    return core


def state(core: MasterCore) -> dict:
    return {
        "directory": core.directory.reference(), "leases": core.leases.reference(),
        "tenants": core.tenants.registry.state.reference(), "counters": dict(core.counters),
        "sessions": {c: (dict(s.tokens), dict(s.pins)) for c, s in core.sessions.items()},
        "owner": dict(core._owner),
        "outbox": [(s, op, body) for s, op, _, body in core.outbox],
        "free": {s: a.free_bytes for s, a in core.placer.allocators.items()},
    }


@pytest.mark.parametrize("quiet", [False, True], ids=["leased", "inherited"])
@pytest.mark.parametrize("lost", SEGMENTS)
def test_a_lost_segment_leaves_in_bulk_as_one_by_one(tmp_path, monkeypatch, lost, quiet):
    bulk = loaded_master(tmp_path / "bulk", traced=False, quiet=quiet)
    one = loaded_master(tmp_path / "one", traced=True, quiet=quiet)
    assert state(bulk) == state(one)
    before = bulk.directory.reference()
    on_it = {k: r for k, r in before.objects.items() if any(p.segment == lost for p in r.replicas)}
    gone = {k for k, r in on_it.items() if r.status is Status.PENDING or len(r.replicas) == 1}
    assert sum(r.status is Status.PUBLISHED and len(r.replicas) == 1 for r in on_it.values()) > 100
    assert any(len(r.replicas) == 2 for r in on_it.values())
    assert quiet or any(bulk.leases.holders(k) for k in gone)

    lease_steps: list = []
    step = LeaseCore.step
    monkeypatch.setattr(LeaseCore, "step",
                        lambda self, ev: lease_steps.append(ev) or step(self, ev))
    bulk.segment_lost(lost, "deregistered")
    assert len(lease_steps) <= 1, lease_steps[:5]       # its clock at most: the drops are one step
    monkeypatch.setattr(LeaseCore, "step", step)
    one.segment_lost(lost, "deregistered")
    assert state(bulk) == state(one)

    # the two tables agree; what was on the lost segment is gone, or kept elsewhere
    after = bulk.directory.reference()
    published = {k for k, r in after.objects.items() if r.status is Status.PUBLISHED}
    assert set(bulk.leases.objects) == published
    assert set(after.objects) == set(before.objects) - gone
    assert all(lost not in [p.segment for p in r.replicas] for r in after.objects.values())
    assert bulk.counters["removes"] == sum(on_it[k].status is Status.PUBLISHED for k in gone)
    # the tenants' state keeps the spec's invariants: no read is left on a lost object
    # (NoReclaimUnderLease), the sums and the readers' index agree (TypeOK)
    tenancy = System(bulk.tenants.registry.state.reference())
    assert any(r.expires > tenancy.table.now for r in tenancy.table.reads.values())
    assert all(check(tenancy) for check in INVARIANTS.values())


def test_the_lost_keys_leave_the_index_a_slice_per_tick_and_can_be_put_again(tmp_path):
    core = loaded_master(tmp_path, traced=False, tenants=False)
    core.SWEEP_ROWS = 50
    lost = [k for k, r in core.directory.reference().objects.items()
            if r.status is Status.PUBLISHED and [p.segment for p in r.replicas] == ["seg-1"]]
    core.segment_lost("seg-1", "deregistered")
    rows = core.directory.rows
    assert len(rows.stale) == len(lost) > 100
    again = lost[0]      # put again before its key left the index: its row is held again
    status, body = call(core, "put_start", {"client": "w", "replicas": 1, "items": [[again, 100]]})
    (grant,) = items(body)
    status, body = call(core, "put_end", {"client": "w", "items": [[again, grant["token"]]]})
    assert status == 0 and core.directory.published(again) and again in core.leases.objects
    ticks = 0
    while rows.stale:
        left = len(rows.stale)
        core.clock.t += core.storage_timeout / 4      # a tick is due; nothing times out
        for segment in core.segments:
            core.handle("storage_heartbeat", {"segment": segment})
        call(core, "heartbeat", {"client": "w"})
        core.tick()
        ticks += 1
        assert left - core.SWEEP_ROWS <= len(rows.stale) < left
    assert ticks >= (len(lost) - 2) // 50
    objects = core.directory.reference().objects
    assert set(rows.index) == set(objects)
    assert all(rows.keys[row] == key for key, row in rows.index.items())
    assert set(core.leases.objects) == {k for k, r in objects.items()
                                        if r.status is Status.PUBLISHED}


def test_the_tenants_accounting_of_a_large_loss_is_carried_out_a_slice_per_turn(tmp_path):
    """Past ``TENANT_SLICE`` objects, the tenancy machine's steps for a lost
    segment's objects are taken a slice per turn of the loop (``tick``); a put
    of one of those keys takes its step first; once done, the master is where
    the one-by-one path left it."""
    bulk = loaded_master(tmp_path / "bulk", traced=False)
    one = loaded_master(tmp_path / "one", traced=True)
    bulk.TENANT_SLICE = 40
    for core in (bulk, one):
        core.segment_lost("seg-1", "deregistered")
    owed = len(bulk._tenant_drops)
    assert owed > 100 and \
        bulk.tenants.registry.state.reference() != one.tenants.registry.state.reference()
    last = bulk._tenant_drops._queue[-1][0][-1]      # owed, reached last
    again = next(k for k in (b"obj-%06d" % i for i in range(OBJECTS)) if last.endswith(k))
    for core in (bulk, one):
        status, body = call(core, "put_start", {"client": "w", "replicas": 1,
                                                "items": [[again, 100]]})
        (grant,) = items(body)
        status, body = call(core, "put_end", {"client": "w", "items": [[again, grant["token"]]]})
        assert status == 0 and len(items(body)) == 1
    turns = 0
    while bulk._tenant_drops:
        left = len(bulk._tenant_drops)
        bulk.tick()
        turns += 1
        assert left - bulk.TENANT_SLICE <= len(bulk._tenant_drops) < left
    assert turns >= owed // bulk.TENANT_SLICE and not bulk._tenant_drops._ahead
    one.tick()
    assert state(bulk) == state(one)


def test_a_key_lost_again_while_its_first_loss_is_owed_is_settled_by_each_put(tmp_path):
    """A key lost, put again, lost again (with the segment its new replica
    went to) while the tenants' accounting of the first loss is still owed,
    and put a third time: each put carries out what is owed of it first, and
    each loss's turn passes over the entry a put settled; once done, the
    master is where the one-by-one path left it, the key published."""
    bulk = loaded_master(tmp_path / "bulk", traced=False)
    one = loaded_master(tmp_path / "one", traced=True)
    bulk.TENANT_SLICE = 40
    for core in (bulk, one):
        core.segment_lost("seg-1", "deregistered")
    last = bulk._tenant_drops._queue[-1][0][-1]
    again = next(k for k in (b"obj-%06d" % i for i in range(OBJECTS)) if last.endswith(k))

    def put(core):
        status, body = call(core, "put_start", {"client": "w", "replicas": 1,
                                                "items": [[again, 100]]})
        (grant,) = items(body)
        status, body = call(core, "put_end", {"client": "w", "items": [[again, grant["token"]]]})
        assert status == 0 and len(items(body)) == 1

    for core in (bulk, one):
        put(core)
    (segment,) = {core.directory.record(last).replicas[0].segment for core in (bulk, one)}
    for core in (bulk, one):
        core.segment_lost(segment, "deregistered")
    assert len(bulk._tenant_drops._queue) == 2 and not bulk.directory.published(last)
    for core in (bulk, one):
        put(core)
    while bulk._tenant_drops:
        bulk.tick()
    one.tick()
    assert not bulk._tenant_drops._ahead and bulk.directory.published(last)
    assert state(bulk) == state(one)


def test_kvproto_bench_runs_its_segment_loss_section():
    """A short run of ``kvproto bench --only segment-loss`` end to end (it
    checks that both tables are left with what was not lost)."""
    import subprocess
    import sys
    from runtime_helpers import REPO, child_env
    out = subprocess.run([sys.executable, "-m", "kvproto", "bench", "--only", "segment-loss",
                          "--loss-objects", "3000", "--loss-repeat", "1"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "segment loss: 3,000 objects" in out.stdout
    assert "its only replica: segment_lost" in out.stdout
    assert "one of 2 replicas: segment_lost" in out.stdout and "longest pause" in out.stdout
    assert "with tenants: segment_lost" in out.stdout
    assert "the tenants' accounting settled after" in out.stdout
