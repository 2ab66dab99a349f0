"""The storage node runs on the fast core (``StorageNodeCore``), without sockets.

The core commits every event it accepts, so a request made of several events
(``assign``: ``StampedAllocate`` + ``AssignRegion`` + ``GrantDirect``; a direct
writer's ``publish``: ``PublishDirect`` + ``WriteReplica`` + ``StampedPublish``)
must step none of them when one is refused. Each refused request here leaves
``core.reference()`` as it was, and the accepted ones leave it equal to the
frozen reference machines stepped with the same events.
"""

from __future__ import annotations

import pytest

from kvproto import errors
from kvproto.cores.storage import StorageNodeCore
from kvproto.runtime.shm import SegmentMemory, WriterLock, gen_word
from kvproto.runtime import storage
from kvproto.runtime.storage import StorageCore
from kvproto.statemachines import failover as F
from kvproto.statemachines import publish as P

SEG, PAGE = "seg", 4096
A, B, C, D = 0, PAGE, 2 * PAGE, 3 * PAGE


@pytest.fixture(params=["batch steps", "one by one"])
def node(request, monkeypatch):
    """A node of 256 pages; every test runs with requests of any size taken
    by the cores' batch steps, and with all of them stepped one by one."""
    monkeypatch.setattr(storage, "BATCH_STEP_FROM", 1 if request.param == "batch steps" else 1 << 30)
    memory = SegmentMemory(1 << 20, PAGE)
    node = StorageCore(memory, SEG)
    assert node.fence_to(1)
    try:
        yield node
    finally:
        memory.close()


def call(node, op, payloads=(), **body):
    return node.handle(op, {"segment": SEG, "term": 1, **body}, list(payloads))


def item_code(reply) -> int:
    (item,) = reply[0]["results"]
    return item[0]


def write(node, offset, token, data):
    return call(node, "write", [memoryview(data)], offset=offset, token=token)


class Reference:
    """The frozen machines the core is held to, stepped with the node's events."""

    def __init__(self) -> None:
        self.table, self.node = P.RegionTable(SEG), F.StorageNode()

    def step(self, *events) -> None:
        for ev in events:
            if isinstance(ev, (P.AssignRegion, P.FreeRegion, P.WriteReplica)):
                self.table, _ = P.storage_step(self.table, ev)
            else:
                self.node, _ = F.storage_step(self.node, ev)

    def state(self):
        return self.table, self.node


def test_the_node_state_is_the_fast_core_and_equals_the_reference_machines(node):
    assert type(node.node) is StorageNodeCore
    assert not hasattr(node, "table") and not hasattr(node, "fence")
    ref = Reference()
    ref.step(F.Fence(1))
    assert call(node, "assign", regions=[[A, 10, b"a", 7], [B, 20, b"b", 8]])[0]["results"] == \
        [[0, None], [0, None]]
    ref.step(F.StampedAllocate(SEG, b"a", 1, A, 10, 7), P.AssignRegion(SEG, A, 10, b"a", 7),
             F.StampedAllocate(SEG, b"b", 1, B, 20, 8), P.AssignRegion(SEG, B, 20, b"b", 8))
    write(node, A, 7, b"x" * 10)
    write(node, B, 8, b"y" * 20)
    ref.step(P.WriteReplica(SEG, A, 7), P.WriteReplica(SEG, B, 8))
    assert item_code(call(node, "publish", regions=[[A, b"a", 7]])) == 0
    ref.step(F.StampedPublish(SEG, b"a", 1))
    assert item_code(call(node, "free", regions=[[B, 8, 20]])) == 0
    ref.step(P.FreeRegion(SEG, B, 8, 20), F.StampedFree(SEG, b"b", 1, 8))
    assert node.node.reference() == ref.state()
    stats = node.stats()
    assert (stats["indexed"], stats["published"], stats["regions"], stats["used"]) == (1, 1, 1, 10)


def test_refused_requests_leave_the_core_unchanged(node):
    assert call(node, "assign", regions=[[A, 10, b"a", 7], [B, 20, b"b", 8]])[0]["results"] == \
        [[0, None], [0, None]]
    write(node, A, 7, b"x" * 10)
    assert item_code(call(node, "publish", regions=[[A, b"a", 7]])) == 0
    before = node.node.reference()

    # assign: a key held here; an owned offset (its StampedAllocate, which
    # alone would be accepted, is not stepped either)
    assert item_code(call(node, "assign", regions=[[C, 10, b"a", 9]])) == errors.KeyExists.code
    assert item_code(call(node, "assign", regions=[[A, 10, b"c", 9]])) == errors.RegionMismatch.code
    assert b"c" not in node.node.index
    # write: a wrong token, a wrong length (WriteReplica alone would be
    # accepted), a second write
    for offset, token, data, error in ((B, 9, b"y" * 20, errors.RegionMismatch),
                                       (B, 8, b"y" * 19, errors.InvalidArgument),
                                       (A, 7, b"x" * 10, errors.RegionMismatch)):
        with pytest.raises(error):
            write(node, offset, token, data)
    assert not node.node.region(B).done
    # publish: an unwritten region, a published one, a wrong token
    for regions, error in (([B, b"b", 8], errors.StaleToken), ([A, b"a", 7], errors.NotPublished),
                           ([A, b"a", 9], errors.StaleToken)):
        assert item_code(call(node, "publish", regions=[regions])) == error.code
    # free: a wrong token; read: an unwritten region
    assert item_code(call(node, "free", regions=[[A, 9, 10]])) == errors.RegionMismatch.code
    with pytest.raises(errors.RegionMismatch):
        call(node, "read", offset=B, token=8, length=20)
    assert node.node.reference() == before
    assert node.counters["refused"] == 9


def test_a_draining_region_refuses_an_assign_that_the_core_alone_would_accept(node):
    """``StampedAllocate`` and ``AssignRegion`` of the new key would both be
    accepted; the region is still draining for a direct writer, so neither is
    stepped."""
    lock = WriterLock()
    try:
        assert item_code(call(node, "assign", regions=[[D, 10, b"d", 20]],
                              direct=[[D, lock.name]])) == 0
        # the writer has not reported: its publish is refused, the region stays unwritten
        assert item_code(call(node, "publish", regions=[[D, b"d", 20]])) == errors.StaleToken.code
        assert not node.node.region(D).done
        (item,) = call(node, "free", regions=[[D, 20, 10]])[0]["results"]
        assert item == [0, "draining"] and node.draining == {D: 10}
        before = node.node.reference()
        assert D not in node.node.regions and b"d" not in node.node.index
        assert item_code(call(node, "assign", regions=[[D, 10, b"e", 21]])) == \
            errors.RegionMismatch.code
        assert item_code(call(node, "assign", regions=[[D, 10, b"e", 21]],
                              direct=[[D, lock.name]])) == errors.RegionMismatch.code
        assert node.node.reference() == before and b"e" not in node.node.index
    finally:
        lock.close()
    assert node.drain() == [D]
    assert item_code(call(node, "assign", regions=[[D, 10, b"e", 21]])) == 0


def test_a_takeover_keeps_out_the_regions_its_purge_leaves_draining(node):
    """Two direct writers' regions granted under term 1, unwritten: the fence
    answer of term 2 lists both as draining (the purge will drop their
    allocations while their writers may still write them). One writer dies
    before the purge, whose answer then lists only the other's region, still
    draining: the new master frees the first and keeps the second out until
    it drains."""
    locks = [WriterLock(), WriterLock()]
    try:
        for offset, key, token, lock in ((C, b"c", 30, locks[0]), (D, b"d", 40, locks[1])):
            assert item_code(call(node, "assign", regions=[[offset, 10, key, token]],
                                  direct=[[offset, lock.name]])) == 0
        body, _ = node.handle("fence", {"segment": SEG, "term": 2}, [])
        assert body["draining"] == [[C, 10], [D, 10]]
        locks[0].close()
        body, _ = node.handle("purge", {"segment": SEG, "term": 2, "below": 2}, [])
        assert body["purged"] == 2 and body["draining"] == [[D, 10]]
        assert C not in node.node.regions and D not in node.node.regions
        assert node.drain() == []
    finally:
        locks[0].close()
        locks[1].close()
    assert node.drain() == [D]


def test_a_reported_direct_write_is_written_and_published_in_one_request(node):
    lock = WriterLock()
    try:
        assert item_code(call(node, "assign", regions=[[C, 10, b"c", 30]],
                              direct=[[C, lock.name]])) == 0
        node.memory.data[C:C + 10] = b"z" * 10
        node.memory.set_word(C, gen_word(30, True))    # the writer's report
        assert item_code(call(node, "publish", regions=[[C, b"c", 30]])) == 0
        assert node.node.region(C).done and node.node.entry(b"c").published
        assert node.counters["direct_published"] == 1
        body, frames = call(node, "read", offset=C, token=30, length=10)
        assert bytes(frames[0]) == b"z" * 10
    finally:
        lock.close()


def test_a_purge_frees_the_regions_of_the_entries_it_drops(node):
    assert call(node, "assign", regions=[[A, 10, b"a", 7], [B, 20, b"b", 8]])[0]["results"] == \
        [[0, None], [0, None]]
    write(node, A, 7, b"x" * 10)
    assert item_code(call(node, "publish", regions=[[A, b"a", 7]])) == 0
    body, _ = node.handle("fence", {"segment": SEG, "term": 2}, [])
    assert body["term"] == 2
    assert node.handle("purge", {"segment": SEG, "term": 2, "below": 2}, [])[0] == \
        {"purged": 1, "freed": 20, "draining": []}
    assert list(node.node.regions) == [A] and list(node.node.index) == [b"a"]
    assert node.memory.word(B) == 0


def _as_columns(rows: list, fill: list) -> list:
    return [list(c) for c in zip(*(r + fill[len(r):] for r in rows))]


@pytest.mark.parametrize("traced", [False, True])
def test_assign_and_publish_as_columns_answer_and_step_as_rows(node, traced, tmp_path):
    """The same assigns and publishes sent as rows to one node and as columns
    to another: the same answers, the same state; all accepted (the batch
    steps), and with one region refused (stepped in turn)."""
    from kvproto.runtime.tracing import StorageRecorder
    other = StorageCore(SegmentMemory(1 << 20, PAGE), SEG)
    assert other.fence_to(1)
    if traced:
        node.record_to(StorageRecorder(str(tmp_path / "rows")))
        other.record_to(StorageRecorder(str(tmp_path / "columns")))
    lock = WriterLock()
    try:
        batches = [[[A, 10, b"a", 7], [B, 20, b"b", 8, lock.name]],       # accepted
                   [[C, 10, b"c", 9], [D, 10, b"a", 10]],                 # b"a" held: refused
                   [[4 * PAGE, 10, b"e", 11, lock.name],                  # each to its writer
                    [5 * PAGE, 10, b"f", 12, lock.name]]]
        publishes = [[[A, b"a", 7, 5, 1], [B, b"b", 8]],                  # B not reported: refused
                     [[C, b"c", 9, 0, 2, 1]]]
        for rows in batches:
            direct = [[r[0], r[4]] for r in rows if len(r) > 4]
            extra = {"direct": direct} if direct else {}
            answer = call(node, "assign", regions=[r[:4] for r in rows], **extra)
            assert call(other, "assign", columns=_as_columns(rows, [0, 0, b"", 0, ""])) == answer
        for n in (node, other):
            write(n, A, 7, b"x" * 10)
            write(n, C, 9, b"z" * 10)
        for rows in publishes:
            answer = call(node, "publish", regions=rows)
            assert call(other, "publish", columns=_as_columns(rows, [0, b"", 0, 0, 0, 0])) == answer
        assert other.node.reference() == node.node.reference()
        assert other.direct.regions == node.direct.regions and B in other.direct.regions
        assert other.counters == node.counters and node.counters["refused"] >= 2
        if traced:
            steps = (tmp_path / "rows").read_text()
            assert steps.count("StampedPublish") >= 2 and (tmp_path / "columns").read_text() == steps
    finally:
        lock.close()
        other.memory.close()


def test_an_assign_or_publish_asked_with_tally_is_answered_with_a_count_when_all_are_accepted(node):
    """``tally``: ``{"accepted": n}`` when every region is accepted; the items
    otherwise, as without it."""
    assert call(node, "assign", columns=_as_columns([[A, 10, b"a", 7], [B, 20, b"b", 8]],
                                                    [0, 0, b"", 0, ""]), tally=True) == \
        ({"accepted": 2}, [])
    refused, _ = call(node, "assign", regions=[[C, 10, b"c", 9], [D, 10, b"a", 10]], tally=True)
    assert [item[0] for item in refused["results"]] == [0, errors.KeyExists.code]
    write(node, A, 7, b"x" * 10)
    write(node, C, 9, b"z" * 10)
    assert call(node, "publish", regions=[[A, b"a", 7], [C, b"c", 9]], tally=True) == \
        ({"accepted": 2}, [])
    refused, _ = call(node, "publish", columns=_as_columns([[B, b"b", 8]], [0, b"", 0, 0, 0, 0]),
                      tally=True)
    assert [item[0] for item in refused["results"]] == [errors.StaleToken.code]
