"""Fuzzed frames at the master and the storage nodes (kvproto/checking/fuzz.py).

A seeded short run in CI; soak: ``kvproto fuzz --frames 1000000``. The last
tests show that each property can fail: cores broken on purpose are caught."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from kvproto import errors
from kvproto.checking import frames, fuzz
from kvproto.checking.snapshot import differences, master_snapshot, storage_snapshot
from kvproto.runtime import wire

pytestmark = pytest.mark.faults

SEED = 16


def test_every_field_of_every_op_has_a_fuzzing_rule():
    for table in (wire.MASTER_OPS, wire.STORAGE_OPS):
        ops = frames.ops_of(table)
        assert [op.name for op in ops] == list(table)


@pytest.mark.parametrize("table", ["MASTER_OPS", "STORAGE_OPS"])
def test_valid_bodies_pass_the_wire_and_each_wrong_field_is_refused(table):
    ops, src = getattr(wire, table), frames.Source(random.Random(SEED))
    for op in frames.ops_of(ops):
        for _ in range(30):
            body = frames.body_of(src, op, {})
            valid = [wire.encode_request(op.name, 7, body), *[b"x"] * frames.payload_count(op, body)]
            assert wire.decode_request(valid, 1 << 24, 1 << 20, ops).body.keys() <= body.keys()
            for name, field in {**op.fields, **op.optional}.items():
                bad = {**body, name: frames.wrong(src, field)}
                with pytest.raises((errors.MalformedFrame, errors.InvalidArgument)):
                    wire.decode_request([wire.encode_request(op.name, 7, bad),
                                         *[b"x"] * frames.payload_count(op, body)], 1 << 24, 1 << 20, ops)


def test_every_wrong_value_is_a_frame_the_wire_can_carry():
    # A value outside msgpack's integer range (a uint field bounded at 2**64 - 1
    # given its bound plus one) cannot be sent at all: the fuzzer must never draw it.
    def within(field):
        yield field
        for inner in (field.item, *field.items):
            if inner is not None:
                yield from within(inner)

    src = frames.Source(random.Random(SEED))
    for table in (wire.MASTER_OPS, wire.STORAGE_OPS):
        for op in frames.ops_of(table):
            for top in {**op.fields, **op.optional}.values():
                for field in within(top):
                    for _ in range(40):
                        wire.pack(frames.wrong(src, field))


def test_a_seeded_run_of_every_kind_at_both_cores():
    report = fuzz.fuzz(4000, seed=SEED)
    assert report.failures == 0, report.summary()
    assert all(n > 600 for n in report.by_kind.values()), report.by_kind
    assert report.accepted > 300, report.summary()
    # the frames reach the protocol machines, not only the decoder
    for refusal in ("MalformedFrame", "InvalidArgument", "UnknownMessage", "UnsupportedVersion",
                    "FrameTooLarge", "SegmentUnavailable", "StaleTerm"):
        assert report.rejected.get(refusal, 0) > 0, (refusal, report.summary())


def test_a_seeded_run_at_a_master_with_tenants():
    report = fuzz.fuzz(3000, seed=SEED, targets=("master-tenants",))
    assert report.failures == 0, report.summary()
    assert report.accepted > 100, report.summary()
    # refused for the credential, the namespace and the grant, changing nothing
    for refusal in ("Unauthorized", "UnknownNamespace", "AccessDenied"):
        assert report.rejected.get(refusal, 0) > 0, (refusal, report.summary())


@pytest.mark.parametrize("name", list(fuzz.TARGETS))
@settings(max_examples=150, derandomize=True, deadline=None)
@given(data=st.data())
def test_hypothesis_frames(name, data):
    target = fuzz.TARGETS[name]()      # a fresh core: the same pools for the same draws
    try:
        report = fuzz.Report()
        fuzz.check(target, data.draw(fuzz.frames(target)), report)
        assert report.failures == 0, report.summary()
    finally:
        target.close()


@pytest.mark.runtime
def test_real_servers_over_their_sockets():
    report = fuzz.fuzz_servers(150, seed=SEED)
    assert report.failures == 0, report.summary()
    assert report.accepted > 0 and sum(report.rejected.values()) > 75, report.summary()


# ---------------------------------------------------------------- the checks can fail

def _run(target, n, report=None):
    report = report or fuzz.Report()
    src = frames.Source(random.Random(SEED))
    for _ in range(n):
        fuzz.check(target, frames.make_frame(src, target.ops, target.pools()), report)
    return report


def test_a_master_that_changes_its_directory_before_refusing_is_caught():
    target = fuzz.MasterTarget()
    handle = target.core.handle

    def leaky(op, body, *rest):
        if op == "storage_heartbeat":     # refused for an unknown segment, after a change
            target.core.directory.next_token += 1
        return handle(op, body, *rest)
    target.core.handle = leaky
    report = _run(target, 800)
    assert report.changed and "directory" in report.changed[0], report.summary()


def test_the_master_runs_on_the_fast_cores_and_a_change_in_a_column_is_seen():
    """The runtime master's directory and lease table are the fast cores on
    shared rows; a snapshot sees inside them (as their reference values), so
    a rejected frame that changed one entry of one column would be reported."""
    from kvproto.cores.directory import DirectoryCore
    from kvproto.cores.leases import LeaseCore
    target = fuzz.MasterTarget()
    d, leases = target.core.directory, target.core.leases
    assert type(d) is DirectoryCore and type(leases) is LeaseCore and leases.rows is d.rows
    before = master_snapshot(target.core)
    row = d.rows.index[target.keys[0]]
    d._len[row] += 1
    assert any("directory" in where for where in differences(before, master_snapshot(target.core)))
    d._len[row] -= 1
    leases._size[row] += 1
    assert any("leases" in where for where in differences(before, master_snapshot(target.core)))


def test_a_storage_node_that_writes_before_refusing_is_caught():
    target = fuzz.StorageTarget()
    try:
        handle = target.core.handle

        def leaky(op, body, payloads):
            if op == "write" and payloads:
                target.memory.data[0] ^= 0xFF   # bytes changed, then the checks refuse
            return handle(op, body, payloads)
        target.core.handle = leaky
        report = _run(target, 800)
        assert report.changed, report.summary()
    finally:
        target.close()


@pytest.mark.parametrize("raised, where", [(ValueError("bug"), "crashes"),
                                           (errors.KvError("no type"), "untyped")])
def test_a_crash_and_an_untyped_error_are_caught(raised, where):
    target = fuzz.MasterTarget()

    def broken(op, body, *rest):
        raise raised
    target.core.handle = broken
    target.serving = lambda: None
    report = _run(target, 100)
    assert getattr(report, where), report.summary()


def test_a_master_that_stops_serving_after_a_refusal_is_caught():
    target = fuzz.MasterTarget()
    handle = target.core.handle

    def wedged(op, body, *rest):
        if op == "deregister":
            target.core.step_down(errors.MasterNotOpen("wedged"))
        return handle(op, body, *rest)
    target.core.handle = wedged
    report = _run(target, 800)
    assert report.stopped_serving, report.summary()


# ---------------------------------------------------------------- snapshots

def test_the_master_snapshot_sees_directory_leases_sessions_and_allocators():
    target = fuzz.MasterTarget()
    core = target.core
    before = master_snapshot(core)
    core.handle("read_begin", {"client": "reader", "keys": [b"k-0"]})              # a pin, a session
    changed = " ".join(differences(before, master_snapshot(core), limit=20))
    assert "sessions" in changed and "directory" in changed
    before = master_snapshot(core)
    core.handle("read_begin", {"client": "reader", "keys": [b"k-1"], "lease": True})  # a lease
    assert "leases" in " ".join(differences(before, master_snapshot(core), limit=20))
    before = master_snapshot(core)
    core.handle("put_start", {"client": "w", "replicas": 1, "items": [[b"new", 5000]]})
    assert "placer" in " ".join(differences(before, master_snapshot(core), limit=20))


def test_the_storage_snapshot_sees_table_fence_transfers_and_bytes():
    target = fuzz.StorageTarget()
    core = target.core
    try:
        steps = [
            lambda: core.handle("assign", {"segment": core.segment, "term": 1,
                                           "regions": [[40 * 512, 10, b"n", 99]]}, []),
            lambda: core.handle("fence", {"segment": core.segment, "term": 5}, []),
            lambda: core.start("load", {"segment": core.segment, "offset": 0, "token": 10,
                                        "term": 5, "length": 300, "owner": "o", "xfer": 1,
                                        "buffer": "b"}),
        ]
        # the node's StorageNodeCore is seen as its reference: (RegionTable, StorageNode)
        for step, part in zip(steps, ("RegionTable(", "StorageNode(term=1", "xfers")):
            before = storage_snapshot(core)
            step()
            assert part in " ".join(differences(before, storage_snapshot(core), limit=20)), part
        before = storage_snapshot(core)
        target.memory.data[100] ^= 1
        assert storage_snapshot(core) != before
    finally:
        target.close()
