"""The allocator, and the master/storage cores carrying out the machine's effects.

The second half drives :class:`MasterCore` and real :class:`StorageCore`\\ s (no
sockets) through random puts, writes, publishes, revokes, reclaims, reads,
removes and segment losses, and checks after every step that

* each live segment's allocator counts exactly the ledger's free bytes
  (``SegmentLedger.free``) and its free extents plus the directory's regions
  tile the segment;
* every storage node's region table (and its generation words) agrees with
  the directory, so every Assign/Free effect reached the right node in order;
* the session bookkeeping holds exactly the PENDING tokens.
"""

from __future__ import annotations

import random

import pytest

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.allocator import AllocatorCorrupt, Placer, SegmentAllocator
from kvproto.runtime.master import MasterCore
from kvproto.runtime.shm import SegmentMemory, gen_word
from kvproto.runtime.storage import StorageCore
from kvproto.statemachines import publish as P
from kvproto.statemachines.publish import Status

PAGE = 512


def test_first_fit_and_coalescing():
    a = SegmentAllocator(16 * PAGE, PAGE)
    offs = [a.allocate(PAGE) for _ in range(3)] + [a.allocate(1)]  # 1 byte takes a page
    assert offs == [0, PAGE, 2 * PAGE, 3 * PAGE]
    assert a.free_bytes == 13 * PAGE - 1 and a.free_extent_bytes == 12 * PAGE
    a.free(PAGE, PAGE)
    a.free(3 * PAGE, 1)
    assert a.extents() == [(PAGE, PAGE), (3 * PAGE, 13 * PAGE)]
    assert a.allocate(PAGE + 1) == 3 * PAGE   # first fit skips the one-page hole
    a.free(2 * PAGE, PAGE)       # merges with the previous hole
    assert a.extents() == [(PAGE, 2 * PAGE), (5 * PAGE, 11 * PAGE)]
    a.free(0, PAGE)
    a.free(3 * PAGE, PAGE + 1)   # merges on both sides
    assert a.extents() == [(0, 16 * PAGE)]
    assert a.free_bytes == a.free_extent_bytes == 16 * PAGE
    with pytest.raises(AllocatorCorrupt):
        a.free(0, PAGE)          # double free
    assert a.allocate(17 * PAGE) is None


def test_random_against_bitmap():
    rng = random.Random(7)
    pages = 64
    a = SegmentAllocator(pages * PAGE, PAGE)
    used = [False] * pages
    live: dict[int, int] = {}
    exact_free = pages * PAGE
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            length = live.pop(off)
            a.free(off, length)
            for p in range(off // PAGE, (off + a.rounded(length)) // PAGE):
                used[p] = False
            exact_free += length
        else:
            length = rng.randint(1, 6 * PAGE)
            need = a.rounded(length) // PAGE
            off = a.allocate(length)
            first = next((i for i in range(pages - need + 1) if not any(used[i:i + need])), None)
            assert (off // PAGE if off is not None else None) == first  # first fit
            if off is not None:
                for p in range(off // PAGE, off // PAGE + need):
                    used[p] = True
                live[off] = length
                exact_free -= length
        assert a.free_bytes == exact_free
        assert a.free_extent_bytes == used.count(False) * PAGE


def test_placer_prefers_free_space_and_gives_back():
    p = Placer()
    p.add("a", 8 * PAGE, PAGE)
    p.add("b", 8 * PAGE, PAGE)
    p.add("c", 8 * PAGE, PAGE)
    p.allocators["a"].allocate(4 * PAGE)
    p.allocators["b"].allocate(2 * PAGE)
    placement = p.place(PAGE, 2)
    assert [r.segment for r in placement] == ["c", "b"]
    assert p.place(7 * PAGE, 2) is None          # only c fits: nothing kept
    assert p.allocators["c"].free_extent_bytes == 7 * PAGE
    assert p.place(PAGE, 4) is None



def test_placer_one_replica_as_the_sort_chooses():
    """One replica: the segment with the most free space, the first added
    among equals; the others in that order when its extents cannot fit it."""
    p = Placer()
    for segment in "abc":
        p.add(segment, 8 * PAGE, PAGE)
    assert p.place(PAGE, 1)[0].segment == "a"
    assert p.place(PAGE, 1)[0].segment == "b"
    a = p.allocators["a"]
    for _ in range(7):
        a.allocate(PAGE)
    for offset in (0, 2, 4, 6):
        a.free(offset * PAGE, PAGE)            # a: 4 free pages, none adjacent
    p.allocators["b"].allocate(4 * PAGE)       # b: 3 pages in one extent
    p.allocators["c"].allocate(6 * PAGE)       # c: 2 pages
    assert p.place(2 * PAGE, 1)[0].segment == "b"
    assert p.place(PAGE, 1)[0].segment == "a"
    assert p.place(4 * PAGE, 1) is None
    assert [p.allocators[s].free_extent_bytes for s in "abc"] == [3 * PAGE, PAGE, 2 * PAGE]
    assert p.place(PAGE, 1, exclude=("a",))[0].segment == "c"


# --------------------------------------------------------------------------
# MasterCore + StorageCore, no sockets
# --------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Harness:
    CAPACITY = 48 * PAGE

    def __init__(self, writer_timeout=5.0):
        self.clock = Clock()
        self.core = MasterCore(writer_timeout=writer_timeout, storage_timeout=1e9, clock=self.clock)
        self.nodes: dict[str, StorageCore] = {}
        self.memories: list[SegmentMemory] = []
        self.n = 0

    def close(self):
        for m in self.memories:
            m.close()

    def add_segment(self):
        self.n += 1
        name = f"seg{self.n}"
        mem = SegmentMemory(self.CAPACITY, PAGE, prefix="kvpt")
        self.memories.append(mem)
        self.nodes[name] = StorageCore(mem, name)
        status, _ = self.core.handle("register", {
            "segment": name, "capacity": self.CAPACITY, "endpoint": "tcp://x:1", "host": "h",
            "shm": mem.name, "gen_shm": mem.gen_name, "nonce": mem.nonce, "page_size": PAGE})
        assert status == 0
        self.core.opened.clear()

    def deliver(self) -> list:
        core = self.core
        while core.outbox:
            seg, op, cmd_id, body = core.outbox.pop(0)
            node = self.nodes.get(seg)
            if node is None:
                continue
            try:
                rbody, _ = node.handle(op, body, [])
                reply = wire.Reply(0, cmd_id, rbody, [])
            except errors.KvError as err:
                reply = wire.Reply(err.code, cmd_id, {"message": err.message}, [])
            core.storage_reply(seg, reply)
        core.closed.clear()
        ready = list(core.ready)
        core.ready.clear()
        return ready

    def call(self, op, body):
        result = self.core.handle(op, body, reply_to="r", request_id=1)
        ready = self.deliver()
        if result is None:
            assert len(ready) == 1
            return ready[0][2], ready[0][3]
        return result

    def check(self):
        core = self.core
        d = core.directory
        assert core.counters["storage_refusals"] == 0
        for seg, ledger in d.segments.items():
            if not ledger.live:
                assert seg not in core.placer.allocators
                continue
            alloc = core.placer.allocators[seg]
            assert alloc.free_bytes == ledger.free, seg
            # replicas and repair regions in flight (spec SlotsOf)
            held = [(k, rec, off) for k, rec in d.objects.items()
                    for s, off in P._held(rec) if s == seg]
            regions = [(off, alloc.rounded(rec.length)) for _, rec, off in held]
            pos = 0
            for off, length in sorted(regions + alloc.extents()):
                assert off == pos, (seg, off, pos)
                pos += length
            assert pos == alloc.capacity
            node = self.nodes[seg]
            stored = {off: (reg.key, reg.token) for off, reg in node.node.regions.items()}
            expected = {off: (k, rec.token) for k, rec, off in held}
            assert stored == expected, seg
            for off, reg in node.node.regions.items():
                assert node.memory.word(off) == gen_word(reg.token, reg.done)
                rec = d.objects[reg.key]
                if rec.status is Status.PUBLISHED and any(r.segment == seg and r.offset == off
                                                          for r in rec.replicas):
                    assert reg.done
        pending = {rec.token for rec in d.objects.values() if rec.status is Status.PENDING}
        assert set(core._owner) == pending
        assert {t for session in core.sessions.values() for t in session.tokens} == pending


@pytest.mark.parametrize("seed", range(12))
def test_cores_keep_allocator_ledger_and_tables_in_step(seed):
    rng = random.Random(seed)
    h = Harness()
    try:
        for _ in range(3):
            h.add_segment()
        clients = ["w1", "w2", "w3"]
        attempts: list[dict] = []       # in-flight puts
        pins: list[tuple[str, bytes, int]] = []
        keys = [b"k%d" % i for i in range(12)]
        for step in range(250):
            r = rng.random()
            live = sum(1 for l in h.core.directory.segments.values() if l.live)
            if r < 0.30:
                client = rng.choice(clients)
                batch = [[rng.choice(keys), rng.randint(1, 5 * PAGE)] for _ in range(rng.randint(1, 3))]
                status, body = h.call("put_start", {"client": client, "replicas": rng.randint(1, 2),
                                                    "items": batch})
                assert status == 0
                for (key, length), item in zip(batch, body["items"]):
                    err, grant = wire.item_result(item)
                    if err is None:
                        attempts.append({"client": client, "key": key, "length": length,
                                         "token": grant["token"], "replicas": grant["replicas"]})
                    else:
                        assert isinstance(err, (errors.KeyExists, errors.NoSpace)), err
            elif r < 0.55 and attempts:
                a = rng.choice(attempts)
                for seg, off, length in a["replicas"]:
                    node = h.nodes.get(seg)
                    if node is None:
                        continue
                    try:
                        node.handle("write", {"segment": seg, "offset": off, "token": a["token"], "term": 1},
                                    [memoryview(bytes([step % 251]) * length)])
                    except errors.RegionMismatch:
                        pass    # reclaimed or revoked meanwhile
                    except errors.SegmentUnavailable:
                        pass
                op = "put_end" if rng.random() < 0.8 else "put_revoke"
                status, body = h.call(op, {"client": a["client"], "items": [[a["key"], a["token"]]]})
                attempts.remove(a)
            elif r < 0.62 and attempts:
                # one client falls silent past the writer timeout; the others heartbeat
                victim = rng.choice(clients)
                h.clock.t += 3
                for c in clients:
                    if c != victim:
                        h.call("heartbeat", {"client": c})
                h.clock.t += 3
                for c in clients:
                    if c != victim:
                        h.call("heartbeat", {"client": c})
                h.core.tick()
                h.deliver()
                attempts = [a for a in attempts if a["client"] != victim]
                pins = [p for p in pins if p[0] != victim]
            elif r < 0.74:
                client = rng.choice(clients)
                key = rng.choice(keys)
                status, body = h.call("read_begin", {"client": client, "keys": [key]})
                err, grant = wire.item_result(body["items"][0])
                if err is None:
                    pins.append((client, key, grant["token"]))
                    for seg, off, length in grant["replicas"]:
                        out, payloads = h.nodes[seg].handle(
                            "read", {"segment": seg, "offset": off, "token": grant["token"], "term": 1,
                                     "length": length}, [])
                        assert len(payloads[0]) == length
            elif r < 0.84 and pins:
                client, key, token = pins.pop(rng.randrange(len(pins)))
                h.call("read_end", {"client": client, "items": [[key, token]]})
            elif r < 0.95:
                h.call("remove", {"keys": [rng.choice(keys)]})
            elif r < 0.975 and live > 1:
                seg = rng.choice([s for s, l in h.core.directory.segments.items() if l.live])
                h.core.segment_lost(seg)
                h.deliver()
                del h.nodes[seg]
            elif live < 4:
                h.add_segment()
            h.check()
    finally:
        h.close()


def test_assign_refused_by_storage_revokes_the_put():
    """The grant does not wait for the assign; a node that refuses the assign
    makes the master revoke the attempt, so the writer's write is refused at
    the node and its put_end is StaleToken: nothing is published."""
    h = Harness()
    try:
        h.add_segment()
        node = h.nodes["seg1"]
        # the node already holds a region the master thinks is free
        node.handle("assign", {"segment": "seg1", "term": 1, "regions": [[0, 10, b"ghost", 99]]}, [])
        status, body = h.call("put_start", {"client": "c", "replicas": 1, "items": [[b"k", 10]]})
        err, grant = wire.item_result(body["items"][0])
        assert err is None
        assert b"k" not in h.core.directory.objects            # revoked on the refusal
        assert h.core.placer.allocators["seg1"].free_bytes == h.core.directory.segments["seg1"].free
        assert h.core.counters["storage_refusals"] >= 1
        (seg, off, length), = grant["replicas"]
        with pytest.raises((errors.RegionMismatch, errors.StaleToken)):
            node.handle("write", {"segment": seg, "offset": off, "token": grant["token"], "term": 1},
                        [memoryview(b"x" * length)])
        status, body = h.call("put_end", {"client": "c", "items": [[b"k", grant["token"]]]})
        assert isinstance(wire.item_result(body["items"][0])[0], errors.StaleToken)
    finally:
        h.close()


def test_unanswered_assign_loses_the_segment():
    """A node that heartbeats but leaves an assign unanswered is lost (its
    attempt revoked); the grant itself was not held back."""
    h = Harness(writer_timeout=100.0)
    h.core.storage_timeout = 10.0
    try:
        h.add_segment()
        h.add_segment()
        status, body = h.core.handle("put_start", {"client": "c", "replicas": 2,
                                                   "items": [[b"k", 10]]}, reply_to="w", request_id=7)
        assert status == 0 and wire.item_result(body["items"][0])[0] is None
        # seg1 answers, seg2 never does (but keeps heartbeating)
        for seg, op, cmd_id, body in list(h.core.outbox):
            if seg == "seg1":
                rbody, _ = h.nodes[seg].handle(op, body, [])
                h.core.storage_reply(seg, wire.Reply(0, cmd_id, rbody, []))
        h.core.outbox.clear()
        h.clock.t += 11
        for seg in ("seg1", "seg2"):
            h.core.handle("storage_heartbeat", {"segment": seg})
        h.core.tick()
        h.deliver()
        assert not h.core.directory.segments["seg2"].live
        assert b"k" not in h.core.directory.objects
        del h.nodes["seg2"]
        h.check()
    finally:
        h.close()
