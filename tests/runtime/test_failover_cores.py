"""Master failover on the running code: :class:`MasterCore` and real
:class:`StorageCore`\\ s (no sockets), driven through crashes, pauses and
takeovers (spec/Failover.tla, docs/protocols/failover.md, section Runtime).

A coordinator term counter, a list of master cores (the active one, and old
ones that were paused and may wake up still believing they serve), two or
three storage nodes that may be lost during a switch, and writers and readers
throughout. Commands are delivered synchronously; a lost node never answers.
After every step the spec's invariants are checked on the cores' state:
``NoSplitBrainAllocation``, ``DirectoryOnlyListsLiveBytes``,
``UnpublishedPurgedAfterRecovery``, ``ReadsReturnPublishedBytesOrMiss`` (on
every read, and on same-host reads of cached descriptors, which carry no term),
``NoStaleTermWriteAccepted`` (every command and write stamped with a fenced
term is refused), that no token is issued twice (across terms too: each grant
is above every token a live node ever carried), and that every acknowledged
put with a live replica is listed by the active master, with its writer's
checksum (across takeovers: the nodes' indexes carry it), and reads back its
bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Optional

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from kvproto import errors
from kvproto.runtime import tracing, wire
from kvproto.runtime.datapath import checksum
from kvproto.runtime.master import MasterCore
from kvproto.runtime.shm import LocalSegment, SegmentMemory, gen_word
from kvproto.runtime.storage import StorageCore
from kvproto.statemachines import failover as fm
from kvproto.statemachines import lease as lm
from kvproto.statemachines.publish import Status

PAGE = 512
CAPACITY = 64 * PAGE
FENCE_TIMEOUT = 5.0
KEYS = [b"k%d" % i for i in range(6)]
LENGTHS = st.integers(1, 3 * PAGE)
OPEN = fm.Phase.OPEN
STANDBY = fm.Phase.STANDBY

#: a read that is a miss, not a wrong answer (spec ``Miss``)
MISSES = (errors.StaleTerm, errors.MasterNotOpen, errors.KeyNotFound, errors.RegionMismatch,
          errors.StaleToken)


def value(key: bytes, version: int, length: int) -> bytes:
    """The bytes of one version of ``key``: a reader can tell every version apart."""
    seed = hashlib.sha256(key + b"/%d" % version).digest()
    return (seed * (length // len(seed) + 1))[:length]


class Clock:
    """The masters' clock, advanced by hand (nothing sleeps)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Cluster:
    """Master cores and storage cores wired by hand: commands go from a core's
    outbox to the node, replies (with the fence's index frame) back."""

    def __init__(self, nodes: int, capacity: int = CAPACITY) -> None:
        self.clock = Clock()
        self.coord = 1
        self.active = self.new_core(term=1)
        self.nodes: dict[str, StorageCore] = {}
        self.memories: list[SegmentMemory] = []
        self.live: set[str] = set()
        self.endpoints: dict[str, str] = {}
        self._rid = itertools.count(1)
        self._mapped: dict[str, LocalSegment] = {}
        try:
            for i in range(nodes):
                self.add_node(f"n{i}", capacity)
        except BaseException:
            self.close()
            raise

    def new_core(self, term: Optional[int] = None) -> MasterCore:
        """A master core on this cluster's clock; no eviction (a full segment stays full)."""
        return MasterCore(writer_timeout=1e6, storage_timeout=1e6, clock=self.clock,
                          fence_timeout=FENCE_TIMEOUT, term=term, high_watermark=1.0)

    def close(self) -> None:
        for local in self._mapped.values():
            local.close()
        self._mapped = {}
        for m in self.memories:
            m.close()
        self.memories = []

    def registration(self, seg: str) -> dict:
        mem = self.nodes[seg].memory
        return {"segment": seg, "capacity": mem.capacity, "endpoint": self.endpoints[seg],
                "host": "h", "shm": mem.name, "gen_shm": mem.gen_name, "nonce": mem.nonce,
                "page_size": mem.page_size}

    def add_node(self, seg: str, capacity: int) -> None:
        mem = SegmentMemory(capacity, PAGE, prefix="kvpf")
        self.memories.append(mem)
        self.nodes[seg] = StorageCore(mem, seg)
        self.endpoints[seg] = f"tcp://127.0.0.1:{7000 + len(self.nodes)}"
        status, body = self.active.handle("register", self.registration(seg))
        assert status == 0 and self.nodes[seg].fence_to(body["term"])
        self.live.add(seg)
        self.active.opened.clear()

    def deliver(self, core: MasterCore) -> list[tuple[str, str, dict, Optional[int]]]:
        """Carry ``core``'s commands to the live nodes and their replies back, until
        the outbox is empty: ``(segment, op, body, status)``, status None when
        the node is lost (no answer)."""
        done = []
        while core.outbox:
            seg, op, cmd_id, body = core.outbox.pop(0)
            if seg not in self.live:
                done.append((seg, op, body, None))
                continue
            try:
                rbody, frames = self.nodes[seg].handle(op, body, [])
                if op == "fence":
                    rbody = {**rbody, **self.registration(seg)}
                reply = wire.Reply(0, cmd_id, rbody, [bytes(f) for f in frames])
            except errors.KvError as err:
                reply = wire.Reply(err.code, cmd_id, {"message": err.message}, [])
            done.append((seg, op, body, reply.status))
            core.storage_reply(seg, reply)
        core.opened.clear()
        core.closed.clear()
        return done

    def call(self, core: MasterCore, op: str, body: dict) -> tuple[Optional[tuple[int, dict]], list]:
        """One client request to ``core``, its commands delivered: ``(reply or
        None while still parked, commands delivered)``."""
        rid = next(self._rid)
        try:
            result = core.handle(op, body, reply_to="c", request_id=rid)
        except errors.KvError as err:
            result = (err.code, {"message": err.message})
        delivered = self.deliver(core)
        mine = [r for r in core.ready if r[1] == rid]
        core.ready[:] = [r for r in core.ready if r[1] != rid]
        if result is None and mine:
            result = (mine[0][2], mine[0][3])
        return result, delivered

    def write(self, grant: dict, data: bytes, term: int, only=None) -> list:
        """The writer's data path: ``data`` to each replica (``only``: a subset);
        the errors met, in order."""
        failed = []
        for seg, off, length in grant["replicas"]:
            if only is not None and seg not in only:
                continue
            if seg not in self.live:
                continue
            try:
                self.nodes[seg].handle("write", {"segment": seg, "offset": off, "token": grant["token"],
                                                 "term": term}, [memoryview(data)])
            except errors.KvError as err:
                failed.append(err)
        return failed

    def read(self, seg: str, off: int, length: int, token: int, term: int):
        """A network read stamped with ``term``: the bytes, or the miss's error."""
        if seg not in self.live:
            return errors.SegmentUnavailable(seg)
        try:
            _, frames = self.nodes[seg].handle("read", {"segment": seg, "offset": off, "token": token,
                                                        "term": term, "length": length}, [])
        except errors.KvError as err:
            return err
        return bytes(frames[0])

    def read_same_host(self, seg: str, off: int, length: int, token: int):
        """A same-host read (no term, no node in the loop: the generation word
        and the nonce decide): the bytes, or None."""
        if seg not in self.live:
            return None
        if seg not in self._mapped:
            mem = self.nodes[seg].memory
            self._mapped[seg] = LocalSegment(mem.name, mem.gen_name, mem.capacity, mem.page_size)
        got = self._mapped[seg].read(off, length, token, self.nodes[seg].memory.nonce)
        return None if got is None else bytes(got)

    def put(self, key: bytes, data: bytes, replicas: int = 1, core=None):
        """A whole put on ``core`` (the active one): ``(error, grant)``."""
        core = core or self.active
        (status, body), _ = self.call(core, "put_start", {"client": "w", "replicas": replicas,
                                                          "items": [[key, len(data)]]})
        assert status == 0, body
        err, grant = wire.item_result(body["items"][0])
        if err is not None:
            return err, None
        assert self.write(grant, data, body["term"]) == []
        (status, body), _ = self.call(core, "put_end", {"client": "w", "items": [
            [key, grant["token"], checksum(data)]]})
        assert status == 0, body
        err, _ = wire.item_result(body["items"][0])
        return err, grant

    def failover(self, listed, lose_during=()) -> MasterCore:
        """A new master takes the next term: it fences the ``listed`` nodes, the
        ``lose_during`` ones die before their fence arrives, the rest answer;
        past ``fence_timeout`` it recovers without the silent ones, then purges.
        Returns the new core (now the active one)."""
        self.coord += 1
        core = self.new_core()
        core.take_term(self.coord, {s: self.endpoints[s] for s in listed})
        self.live -= set(lose_during)
        self.deliver(core)
        if core.failover.phase is not OPEN:
            assert core.failover.phase is fm.Phase.FENCING
            (status, _), _ = self.call(core, "read_begin", {"client": "r", "keys": [KEYS[0]]})
            assert status == errors.MasterNotOpen.code
            self.clock.t += FENCE_TIMEOUT / 2
            core.tick()
            assert core.failover.phase is fm.Phase.FENCING     # not before the deadline
            self.clock.t += FENCE_TIMEOUT
            core.tick()
            self.deliver(core)
        assert core.failover.phase is OPEN and core.failover.term == self.coord
        self.active = core
        return core


class Acked:
    """An acknowledged put: its version, token and replicas' segments."""

    __slots__ = ("version", "token", "length", "segments")

    def __init__(self, version: int, token: int, length: int, segments: frozenset) -> None:
        self.version, self.token, self.length, self.segments = version, token, length, segments


class Pending:
    """A put started and never ended (an allocation recovery must purge)."""

    __slots__ = ("core", "key", "token", "version", "length", "term", "grant", "written")

    def __init__(self, core, key, version, length, term, grant, written) -> None:
        self.core, self.key, self.version, self.length = core, key, version, length
        self.term, self.grant, self.written = term, grant, written
        self.token = grant["token"]


class FailoverCores(RuleBasedStateMachine):
    """Writers, readers, crashes, pauses and takeovers on the cores; the
    model: the coordinator's term, which puts were acknowledged, their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.c: Optional[Cluster] = None
        self.paused: list[MasterCore] = []
        self.versions = itertools.count(1)
        self.acked: dict[bytes, Acked] = {}
        self.ever: dict[bytes, set[bytes]] = {}          # key -> bytes of every acknowledged version
        self.pending: list[Pending] = []
        self.descriptors: list[tuple] = []               # (key, seg, off, length, token, term)
        self.tokens_on: dict[str, int] = {}              # node -> highest token granted there
        self.takeovers = self.lost = self.step_downs = self.hits = self.purged = 0

    @initialize(nodes=st.integers(2, 3))
    def start(self, nodes):
        self.c = Cluster(nodes)
        self.inherited_refused = 0

    def teardown(self):
        if self.c is not None:
            self.c.close()
        event(f"takeovers={min(self.takeovers, 3)}")
        event(f"stale master stepped down={min(self.step_downs, 2)}")
        event(f"nodes lost={self.lost}")
        event(f"hits={min(self.hits, 3)}")
        event(f"purged>0={self.purged > 0}")
        event(f"remove refused while inherited={min(self.inherited_refused, 1)}")

    def cores(self) -> list[MasterCore]:
        return [self.c.active, *self.paused]

    def allowed(self, key: bytes) -> set[bytes]:
        return self.ever.get(key, set())

    def granted(self, grant: dict) -> None:
        """A token is never issued twice, across terms too: each grant is above
        every token a live node was ever assigned (freed ones included), which
        is what a same-host read, with no term to check, relies on."""
        c = self.c
        floor = max((self.tokens_on.get(s, 0) for s in c.live), default=0)
        assert grant["token"] > floor, f"token {grant['token']} issued again (floor {floor})"
        for seg, _, _ in grant["replicas"]:
            self.tokens_on[seg] = max(self.tokens_on.get(seg, 0), grant["token"])

    # -- writers ---------------------------------------------------------------

    @rule(key=st.sampled_from(KEYS), length=LENGTHS, replicas=st.integers(1, 2))
    def put(self, key, length, replicas):
        c = self.c
        version = next(self.versions)
        data = value(key, version, length)
        err, grant = c.put(key, data, replicas)
        if err is not None:
            assert isinstance(err, (errors.KeyExists, errors.NoSpace)), err
            if isinstance(err, errors.KeyExists):
                assert key in c.active.directory.objects
            else:
                assert replicas > len(c.live)
            return
        self.granted(grant)
        self.acked[key] = Acked(version, grant["token"], length,
                                frozenset(seg for seg, _, _ in grant["replicas"]))
        self.ever.setdefault(key, set()).add(data)

    @rule(key=st.sampled_from(KEYS), length=LENGTHS, replicas=st.integers(1, 2), write=st.booleans())
    def start_put_no_end(self, key, length, replicas, write):
        c = self.c
        core = c.active
        (status, body), _ = c.call(core, "put_start", {"client": "w", "replicas": replicas,
                                                       "items": [[key, length]]})
        assert status == 0
        err, grant = wire.item_result(body["items"][0])
        if err is not None:
            assert isinstance(err, (errors.KeyExists, errors.NoSpace)), err
            return
        self.granted(grant)
        version = next(self.versions)
        if write:
            assert c.write(grant, value(key, version, length), body["term"]) == []
        self.pending.append(Pending(core, key, version, length, body["term"], grant, write))

    @precondition(lambda self: any(not p.written for p in self.pending))
    @rule(data=st.data())
    def late_write(self, data):
        """A writer holding a grant writes now: accepted only while its master's
        term is the nodes' term (``NoStaleTermWriteAccepted`` on the data path)."""
        c = self.c
        p = data.draw(st.sampled_from([p for p in self.pending if not p.written]))
        p.written = True
        failed = c.write(p.grant, value(p.key, p.version, p.length), p.term)
        for seg, _, _ in p.grant["replicas"]:
            if seg not in c.live:
                continue
            if c.nodes[seg].node.term > p.term:
                assert failed and isinstance(failed.pop(0), errors.StaleTerm)
        assert failed == []

    @precondition(lambda self: any(p.written and p.core is self.c.active for p in self.pending))
    @rule(data=st.data())
    def finish_pending(self, data):
        """The active master's writer ends a put it started in an earlier step."""
        c = self.c
        p = data.draw(st.sampled_from([p for p in self.pending if p.written and p.core is c.active]))
        self.pending.remove(p)
        (status, body), _ = c.call(c.active, "put_end", {"client": "w", "items": [
            [p.key, p.token, checksum(value(p.key, p.version, p.length))]]})
        assert status == 0
        err, _ = wire.item_result(body["items"][0])
        assert err is None, err
        self.acked[p.key] = Acked(p.version, p.token, p.length,
                                  frozenset(seg for seg, _, _ in p.grant["replicas"]))
        self.ever.setdefault(p.key, set()).add(value(p.key, p.version, p.length))

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        c = self.c
        (status, body), delivered = c.call(c.active, "remove", {"keys": [key]})
        assert status == 0
        err, _ = wire.item_result(body["items"][0])
        if err is None:
            assert key in self.acked
            del self.acked[key]
            assert {op for _, op, _, _ in delivered} == {"free"}
            assert all(status == 0 for _, _, _, status in delivered)
        elif isinstance(err, errors.KeyNotFound):
            assert key not in self.acked
        elif isinstance(err, errors.ObjectLeased):
            # recovered at a takeover: the old master may have leased it
            assert key in self.acked and lm.is_inherited(c.active.leases, key), err
            self.inherited_refused += 1
        else:
            assert isinstance(err, errors.NotPublished), err
            assert c.active.directory.objects[key].status is Status.PENDING

    @rule(seconds=st.sampled_from([0.5, 3.0, 8.0]))
    def time_passes(self, seconds):
        """The clock moves on: past the lease TTL, a new master's inherited
        objects may be removed."""
        self.c.clock.t += seconds

    # -- readers ---------------------------------------------------------------

    @rule(data=st.data())
    def read(self, data):
        """A lookup at some master (the active one or a paused one), then a read
        stamped with that master's term: published bytes of ``key``, or a miss."""
        c = self.c
        keys = st.sampled_from(KEYS)
        key = data.draw(st.sampled_from(sorted(self.acked)) | keys if self.acked else keys)
        core = data.draw(st.sampled_from(self.cores()))
        (status, body), delivered = c.call(core, "read_begin", {"client": "r", "keys": [key]})
        assert delivered == []
        if status:
            assert status == errors.MasterNotOpen.code and core is not c.active
            return
        err, grant = wire.item_result(body["items"][0])
        if err is not None:
            assert isinstance(err, errors.KeyNotFound), err
            assert core is not c.active or key not in self.acked
            return
        term = body["term"]
        for seg, off, length in grant["replicas"]:
            self.descriptors.append((key, seg, off, length, grant["token"], term))
            got = c.read(seg, off, length, grant["token"], term)
            if core is c.active:
                a = self.acked[key]
                assert got == value(key, a.version, a.length), got
            self.check_read(key, got)
        if core is c.active:
            (status, body), _ = c.call(core, "read_end", {"client": "r", "items": [[key, grant["token"]]]})
            assert status == 0 and wire.item_result(body["items"][0])[0] is None

    def check_read(self, key: bytes, got) -> None:
        """``ReadsReturnPublishedBytesOrMiss``."""
        if isinstance(got, bytes):
            assert got in self.allowed(key), f"read of {key!r} returned bytes never acknowledged"
            self.hits += 1
        else:
            assert isinstance(got, MISSES + (errors.SegmentUnavailable,)), got

    @precondition(lambda self: self.descriptors)
    @rule(data=st.data())
    def replay_descriptor(self, data):
        """A client reads again with a descriptor it cached (maybe from a master
        since replaced, maybe of an object since removed)."""
        key, seg, off, length, token, term = data.draw(st.sampled_from(self.descriptors))
        got = self.c.read(seg, off, length, token, term)
        self.check_read(key, got)
        local = self.c.read_same_host(seg, off, length, token)
        if local is not None:                            # same host: a hit or a miss, never other bytes
            self.check_read(key, local)
        if seg in self.c.live and term < self.c.nodes[seg].node.term:
            assert isinstance(got, errors.StaleTerm)

    # -- masters -----------------------------------------------------------------

    @rule(pause=st.booleans(), data=st.data())
    def crash_and_failover(self, pause, data):
        """The active master crashes (or is paused: it stays, believing it
        serves); a new one takes the next term, fences, recovers and opens.
        Some nodes may be lost: dead before the term (listed by the coordinator
        or not), or during the fence."""
        c = self.c
        if pause:
            self.paused.append(c.active)
        live = sorted(c.live)
        lose = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=len(live) - 1))
        how = data.draw(st.sampled_from(["before_unlisted", "before_listed", "during"]))
        listed = [s for s in live if not (how == "before_unlisted" and s in lose)]
        if how != "during":
            c.live -= set(lose)
        survivors = [s for s in live if s not in lose]
        purge_count = len([e for s in survivors for e in c.nodes[s].node.index.values()
                           if not e.published])
        new = c.failover(listed, lose if how == "during" else ())
        # an object whose every replica was lost is gone (a miss from now on)
        self.acked = {k: a for k, a in self.acked.items() if a.segments & c.live}
        self.takeovers += 1
        self.lost += len(lose)
        self.purged += purge_count
        stats = new.stats()["failover"]
        last = stats["last"]
        assert (stats["term"], stats["phase"]) == (c.coord, "open")
        assert last["nodes_fenced"] == len(survivors)
        assert last["nodes_lost"] == len([s for s in listed if s in lose])
        assert last["purged"] == purge_count
        assert last["recovered"] == len(new.directory.objects)
        assert set(new.segments) == set(survivors)
        for s in survivors:
            assert c.nodes[s].node.term == c.coord

    @precondition(lambda self: self.paused)
    @rule(data=st.data(), key=st.sampled_from(KEYS), length=LENGTHS)
    def paused_master_acts(self, data, key, length):
        """A paused master wakes and acts on its old term and directory: every
        command it sends is refused ``StaleTerm`` by the fenced nodes, and the
        first refusal makes it step down."""
        c = self.c
        core = data.draw(st.sampled_from(self.paused))
        was_open = core.failover.phase is OPEN
        term = core.failover.term
        mine = [p for p in self.pending if p.core is core]
        ops = ["put_start", "remove", "read_begin"] + (["put_end"] if mine else [])
        op = data.draw(st.sampled_from(ops))
        if op == "put_start":
            body = {"client": "w", "replicas": 1, "items": [[key, length]]}
        elif op == "remove":
            body = {"keys": [key]}
        elif op == "read_begin":
            body = {"client": "r", "keys": [key]}
        else:
            p = data.draw(st.sampled_from(mine))
            body = {"client": "w", "items": [[p.key, p.token]]}
        result, delivered = c.call(core, op, body)
        if not was_open:
            assert result[0] == errors.MasterNotOpen.code and delivered == []
            return
        refused = False
        for seg, cop, cbody, status in delivered:
            assert cbody["term"] == term
            if status is not None:
                assert term < c.nodes[seg].node.term
                assert status == errors.StaleTerm.code, (cop, status)
                refused = True
        if refused:
            assert core.failover.phase is STANDBY
            self.step_downs += 1
        if op in ("put_end", "remove") and refused:
            # spec AcknowledgedChangesSurvive: a change a fenced node refused is
            # never acknowledged (the new master lists the object, or never did);
            # a reply still waiting on a silent node is answered MasterNotOpen
            # by the server when its core steps down
            if result is None:
                assert core.failover.phase is STANDBY and core.parked()
            else:
                assert result[0] != 0 or wire.item_result(result[1]["items"][0])[0] is not None
        if op == "read_begin" and result is not None and result[0] == 0:
            err, grant = wire.item_result(result[1]["items"][0])
            if err is None:
                for seg, off, ln in grant["replicas"]:
                    got = c.read(seg, off, ln, grant["token"], term)
                    self.check_read(key, got)
                    assert not isinstance(got, bytes)

    # -- invariants --------------------------------------------------------------

    @invariant()
    def no_split_brain_allocation(self):
        c = self.c
        if c is None:
            return
        terms = [c.nodes[s].node.term for s in c.live]
        able = [m for m in self.cores()
                if m.failover.phase is OPEN and any(m.failover.term >= t for t in terms)]
        assert able == [c.active]

    @invariant()
    def directory_only_lists_live_bytes(self):
        c = self.c
        if c is None:
            return
        core = c.active
        for key, rec in core.directory.objects.items():
            for r in rec.replicas:
                assert r.segment in c.live and r.segment in core.segments
                if rec.status is not Status.PUBLISHED:
                    continue
                node = c.nodes[r.segment]
                entry = node.node.index.get(key)
                assert entry is not None and entry.published and entry.token == rec.token, (key, entry)
                assert entry.offset == r.offset
                region = node.node.regions.get(r.offset)
                assert region is not None and region.token == rec.token and region.done

    @invariant()
    def unpublished_purged_after_recovery(self):
        c = self.c
        if c is None:
            return
        term = c.active.failover.term
        for s in c.live:
            for key, e in c.nodes[s].node.index.items():
                assert e.published or e.term == term, (s, key, e)

    @invariant()
    def acknowledged_puts_survive(self):
        c = self.c
        if c is None:
            return
        objects = c.active.directory.objects
        published = {k for k, rec in objects.items() if rec.status is Status.PUBLISHED}
        expected = {k for k, a in self.acked.items() if a.segments & c.live}
        assert published == expected
        for key in expected:
            a, rec = self.acked[key], objects[key]
            assert rec.token == a.token
            assert rec.checksum == checksum(value(key, a.version, a.length))
            assert {r.segment for r in rec.replicas} == a.segments & c.live
            for r in rec.replicas:
                got = c.read(r.segment, r.offset, r.length, rec.token, c.active.failover.term)
                assert got == value(key, a.version, a.length)

    @invariant()
    def nodes_agree_with_themselves_and_the_directory(self):
        """Each live node's index and region table list the same allocations;
        they are exactly the active directory's regions on that segment; the
        allocator's free space is the ledger's."""
        c = self.c
        if c is None:
            return
        core = c.active
        assert core.counters["storage_refusals"] == 0
        assert core.counters["evictions"] == 0
        for s in c.live:
            node = c.nodes[s]
            regions = {off: (r.key, r.token) for off, r in node.node.regions.items()}
            index = {e.offset: (k, e.token) for k, e in node.node.index.items()}
            assert regions == index, s
            for off, r in node.node.regions.items():
                assert node.memory.word(off) == gen_word(r.token, r.done)
                entry = node.node.index[r.key]
                if entry.published:
                    assert r.done
                    assert entry.checksum == core.directory.objects[r.key].checksum
            listed = {r.offset: (k, rec.token) for k, rec in core.directory.objects.items()
                      for r in rec.replicas if r.segment == s}
            assert regions == listed, s
            alloc = core.placer.allocators[s]
            assert alloc.free_bytes == core.directory.segments[s].free


TestFailoverCores = FailoverCores.TestCase
# the profile's examples (so ``--soak`` gives the soak size), of half its steps:
# each step here runs a whole master and its nodes
TestFailoverCores.settings = settings(
    max_examples=settings.default.max_examples,
    stateful_step_count=settings.default.stateful_step_count // 2)


# --------------------------------------------------------------------------
# Corner cases
# --------------------------------------------------------------------------


@pytest.fixture
def cluster():
    made = []

    def make(nodes: int = 2, capacity: int = CAPACITY) -> Cluster:
        c = Cluster(nodes, capacity)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def test_failover_with_no_objects_opens_and_serves(cluster):
    c = cluster(2)
    new = c.failover(["n0", "n1"])
    last = new.stats()["failover"]["last"]
    assert (last["recovered"], last["purged"], last["nodes_fenced"], last["nodes_lost"]) == (0, 0, 2, 0)
    assert len(new.directory.objects) == 0 and new.directory.next_token == 1
    err, grant = c.put(b"k", value(b"k", 1, 700), replicas=2)
    assert err is None
    for seg, off, length in grant["replicas"]:
        assert c.read(seg, off, length, grant["token"], 2) == value(b"k", 1, 700)


def test_purge_frees_the_space_for_a_put_of_the_same_size(cluster):
    c = cluster(1, capacity=8 * PAGE)
    (status, body), _ = c.call(c.active, "put_start", {"client": "w", "replicas": 1,
                                                       "items": [[b"big", 8 * PAGE]]})
    err, grant = wire.item_result(body["items"][0])
    assert err is None and grant["replicas"] == [["n0", 0, 8 * PAGE]]
    assert c.write(grant, value(b"big", 1, 8 * PAGE), 1) == []
    # the segment is full: nothing else fits
    (status, body), _ = c.call(c.active, "put_start", {"client": "w", "replicas": 1,
                                                       "items": [[b"other", 1]]})
    assert isinstance(wire.item_result(body["items"][0])[0], errors.NoSpace)
    new = c.failover(["n0"])
    last = new.stats()["failover"]["last"]
    assert (last["purged"], last["bytes_purged"], last["recovered"]) == (1, 8 * PAGE, 0)
    node = c.nodes["n0"]
    assert len(node.node.regions) == 0 and len(node.node.index) == 0 and node.memory.word(0) == 0
    err, grant2 = c.put(b"big", value(b"big", 2, 8 * PAGE))
    assert err is None and grant2["replicas"] == [["n0", 0, 8 * PAGE]]
    assert grant2["token"] > grant["token"]
    # the old grant's writer is refused for its term, and its descriptor misses
    assert isinstance(c.read("n0", 0, 8 * PAGE, grant["token"], 1), errors.StaleTerm)
    assert c.read("n0", 0, 8 * PAGE, grant2["token"], 2) == value(b"big", 2, 8 * PAGE)


def test_a_replica_lost_during_the_fence_leaves_the_other_one_listed(cluster):
    c = cluster(2)
    data = value(b"k", 1, 1000)
    err, grant = c.put(b"k", data, replicas=2)
    assert err is None
    old = c.active
    new = c.failover(["n0", "n1"], lose_during=["n1"])
    last = new.stats()["failover"]["last"]
    assert (last["nodes_fenced"], last["nodes_lost"], last["recovered"]) == (1, 1, 1)
    rec = new.directory.objects[b"k"]
    assert [r.segment for r in rec.replicas] == ["n0"] and rec.token == grant["token"]
    # the paused old master still lists both replicas and grants a read: a miss
    (status, body), _ = c.call(old, "read_begin", {"client": "r", "keys": [b"k"]})
    err, stale = wire.item_result(body["items"][0])
    assert status == 0 and err is None and body["term"] == 1
    assert isinstance(c.read("n0", *stale["replicas"][0][1:], stale["token"], 1), errors.StaleTerm)
    (status, body), _ = c.call(old, "read_end", {"client": "r", "items": [[b"k", stale["token"]]]})
    assert status == 0 and wire.item_result(body["items"][0])[0] is None
    # its remove is refused by the fenced node, and it steps down; the remove
    # is not acknowledged (the server answers a parked request MasterNotOpen)
    result, delivered = c.call(old, "remove", {"keys": [b"k"]})
    assert [(s, op, st_) for s, op, _, st_ in delivered] == [("n0", "free", errors.StaleTerm.code),
                                                             ("n1", "free", None)]
    assert old.failover.phase is STANDBY and result is None and old.parked()
    # the object is intact; the new master keeps it while the old master's
    # leases may run, then removes it from the live node only
    off = rec.replicas[0].offset
    assert c.read("n0", off, 1000, rec.token, 2) == data
    (status, body), delivered = c.call(new, "remove", {"keys": [b"k"]})
    assert isinstance(wire.item_result(body["items"][0])[0], errors.ObjectLeased) and delivered == []
    c.clock.t += new.leases.ttl * 1.1 + 1
    (status, body), delivered = c.call(new, "remove", {"keys": [b"k"]})
    assert wire.item_result(body["items"][0])[0] is None
    assert [(s, op, st_) for s, op, _, st_ in delivered] == [("n0", "free", 0)]
    assert len(c.nodes["n0"].node.index) == 0 and len(c.nodes["n0"].node.regions) == 0


def test_the_checksum_survives_a_takeover_and_a_disagreeing_replica_is_left_out(
        cluster, monkeypatch, tmp_path):
    """Each replica's index records the writer's checksum with the publish;
    the next master lists the object with it. An index that records another
    checksum for the same allocation (damaged behind the protocol) is a
    mismatch: that replica is not listed, and it is counted; its free, which
    the recovery sends itself, is in the master's trace (``frees`` of its
    ``opened`` line)."""
    c = cluster(2)
    data, other = value(b"k", 1, 1000), value(b"j", 1, 700)
    assert c.put(b"k", data, replicas=2)[0] is None
    assert c.put(b"j", other, replicas=2)[0] is None
    for s in ("n0", "n1"):
        assert c.nodes[s].node.index[b"k"].checksum == checksum(data)
    second = c.failover(["n0", "n1"])
    rec = second.directory.objects[b"k"]
    assert rec.checksum == checksum(data) and [r.segment for r in rec.replicas] == ["n0", "n1"]
    assert second.counters["checksum_mismatches"] == 0
    (_, body), _ = c.call(second, "read_begin", {"client": "r", "keys": [b"k"], "lease": True})
    assert wire.item_result(body["items"][0])[1]["checksum"] == checksum(data)
    index = c.nodes["n1"].node
    index._i_sum[index._idx.index[b"k"]] ^= 1          # n1's index damaged
    left_out = index.index[b"k"]
    monkeypatch.setenv(tracing.ENV, str(tmp_path / "third.trace"))
    third = c.failover(["n0", "n1"])
    monkeypatch.delenv(tracing.ENV)
    opened = json.loads((tmp_path / "third.trace").read_text().splitlines()[0])["opened"]
    assert opened["frees"] == [{"segment": "n1", "offset": left_out.offset,
                                "token": left_out.token, "length": 1000}]
    rec = third.directory.objects[b"k"]
    assert rec.checksum == checksum(data) and [r.segment for r in rec.replicas] == ["n0"]
    assert [r.segment for r in third.directory.objects[b"j"].replicas] == ["n0", "n1"]
    assert third.counters["checksum_mismatches"] == 1
    assert third.stats()["failover"]["last"]["checksum_mismatches"] == 1
    # n1 freed the left-out replica's region and index entry; its space is free again
    assert b"k" not in index.index and b"k" not in {r.key for r in index.regions.values()}
    assert third.counters["storage_refusals"] == 0
    assert third.placer.allocators["n1"].free_bytes == third.directory.segments["n1"].free
    assert c.put(b"k2", value(b"k2", 1, 1000), replicas=2)[0] is None


def test_an_object_lost_with_its_segment_while_inherited_leaves_the_lease_table(cluster):
    """A segment lost while the objects a new master inherited still count as
    leased: the bytes are gone, so the lease table drops them with the
    directory (they stop counting as inherited first), and the two tables
    agree; nothing of them is left counted as used."""
    c = cluster(2)
    assert c.put(b"lost", value(b"lost", 1, 700))[0] is None
    new = c.failover(["n0", "n1"])
    assert new.leases.is_inherited(b"lost")
    (seg,) = {r.segment for r in new.directory.objects[b"lost"].replicas}
    new.segment_lost(seg)
    assert b"lost" not in new.directory.objects and b"lost" not in new.leases.objects
    assert new.leases.used == sum(new.leases.objects[k].size for k in new.leases.objects)


def test_a_freed_token_is_never_issued_again_by_the_next_master(cluster):
    """A same-host reader holding the token of a removed object must miss after
    a failover: the new master's tokens start above every token the nodes'
    regions ever carried, not only above those still indexed."""
    from kvproto.runtime.shm import LocalSegment
    c = cluster(1)
    m1 = c.active
    err, _ = c.put(b"a", value(b"a", 1, 1000))
    assert err is None
    (_, body), _ = c.call(m1, "read_begin", {"client": "r", "keys": [b"a"], "lease": True})
    _, held = wire.item_result(body["items"][0])
    nonce = body["segments"]["n0"][4]
    (_, body), _ = c.call(m1, "release", {"client": "r", "leases": [held["lease"]]})
    (_, body), _ = c.call(m1, "remove", {"keys": [b"a"]})
    assert wire.item_result(body["items"][0])[0] is None
    new = c.failover(["n0"])
    assert new.directory.next_token > held["token"]
    err, grant = c.put(b"c", value(b"c", 1, 1000))
    assert err is None and grant["token"] > held["token"]
    info = new.segments["n0"]
    local = LocalSegment(info.shm, info.gen_shm, info.capacity, info.page_size)
    try:
        seg, off, length = held["replicas"][0]
        assert local.read(off, length, held["token"], nonce) is None
    finally:
        local.close()


def test_the_requested_count_survives_a_takeover_and_the_new_master_repairs_to_it(cluster):
    """A node of a two-replica object dies during a takeover: the new master
    recovers the object with its requested count (the nodes' indexes carry
    it), repairs it onto the third node, lists the new replica only on its
    copier's report, and refuses the late report of a copy it cancelled."""
    c = cluster(3)
    data = value(b"k", 1, 1000)
    err, grant = c.put(b"k", data, replicas=2)
    assert err is None
    held = [seg for seg, _, _ in grant["replicas"]]
    for s in held:
        assert c.nodes[s].node.index[b"k"].requested == 2
    new = c.failover(["n0", "n1", "n2"], lose_during=[held[0]])
    rec = new.directory.objects[b"k"]
    assert rec.requested == 2 and [r.segment for r in rec.replicas] == [held[1]]
    (dst,) = set(c.nodes) - set(held)

    def start_repair():
        c.clock.t += 2e5          # past the master's tick interval
        new.tick()
        c.deliver(new)
        (copy, term), = c.nodes[dst].copies
        c.nodes[dst].copies.clear()
        return copy, term

    def listed():
        (_, body), _ = c.call(new, "read_begin", {"client": "r", "keys": [b"k"], "lease": True})
        return [seg for seg, _, _ in wire.item_result(body["items"][0])[1]["replicas"]]

    # the first copy fails (reported with its error): cancelled, its region
    # freed, and the next repair started at once
    first, term = start_repair()
    assert listed() == [held[1]]
    (status, _), delivered = c.call(new, "repair_done", {
        "segment": dst, "key": b"k", "repair": first.repair,
        "error": [errors.RequestTimeout.code, "slow"]})
    assert status == 0 and new.counters["repairs_cancelled"] == 1
    assert [(s, op, st) for s, op, _, st in delivered] == [
        (dst, "free", 0), (dst, "assign", 0), (dst, "repair", 0)]
    # the second copies from the live replica; a late success report of the
    # first is refused and lists nothing
    (second, term), = c.nodes[dst].copies
    assert second.repair != first.repair and second.source_segment == held[1]
    c.nodes[dst].copied(second, memoryview(c.read(second.source_segment, second.source_offset,
                                                  second.length, second.token, term)))
    (status, _), _ = c.call(new, "repair_done", {"segment": dst, "key": b"k", "repair": first.repair})
    assert status == errors.StaleToken.code and listed() == [held[1]]
    (status, _), delivered = c.call(new, "repair_done", {"segment": dst, "key": b"k",
                                                         "repair": second.repair})
    assert status == 0 and [(s, op, st) for s, op, _, st in delivered] == [(dst, "publish", 0)]
    assert listed() == [held[1], dst]
    rec = new.directory.objects[b"k"]
    assert c.read(dst, rec.replicas[1].offset, 1000, rec.token, new.failover.term) == data
    entry = c.nodes[dst].node.index[b"k"]
    assert entry.published and entry.requested == 2 and entry.checksum == rec.checksum
    assert new.counters["repairs_listed"] == 1 and new.counters["repair_reports_refused"] == 1
    assert new.placer.allocators[dst].free_bytes == new.directory.segments[dst].free


def _repaired_after_a_loss(c):
    """``k`` put with two replicas in term 1; one lost during the takeover of
    term 2, whose master repairs it onto the third node, the copy made:
    ``(held, dst, master, copy, data)``."""
    data = value(b"k", 1, 1000)
    err, grant = c.put(b"k", data, replicas=2)
    assert err is None
    held = [seg for seg, _, _ in grant["replicas"]]
    master = c.failover(["n0", "n1", "n2"], lose_during=[held[0]])
    (dst,) = set(c.nodes) - set(held)
    c.clock.t += 2e5
    master.tick()
    c.deliver(master)
    (copy, term), = c.nodes[dst].copies
    assert term == 2
    c.nodes[dst].copied(copy, memoryview(c.read(copy.source_segment, copy.source_offset,
                                                copy.length, copy.token, term)))
    return held, dst, master, copy, data


def test_a_refused_mark_of_a_repaired_replica_keeps_the_object(cluster, monkeypatch):
    """A node that refuses the publish mark of a replica repaired into it: the
    object keeps its replicas (the other one is recorded) and is not removed,
    as a put whose mark is refused would be."""
    c = cluster(3)
    held, dst, new, copy, _ = _repaired_after_a_loss(c)
    refuse = lambda body, payloads: ({"results": [wire.error_item(errors.StaleToken("no"))]}, [])
    monkeypatch.setattr(c.nodes[dst], "_op_publish", refuse)
    (status, _), delivered = c.call(new, "repair_done", {"segment": dst, "key": b"k",
                                                         "repair": copy.repair})
    assert status == 0 and [(s, op, st) for s, op, _, st in delivered] == [(dst, "publish", 0)]
    rec = new.directory.objects[b"k"]
    assert [r.segment for r in rec.replicas] == [held[1], dst]
    assert new.counters["publish_mark_refusals"] == 1 and new.counters["removes"] == 0


def test_a_repaired_replica_and_its_original_are_both_listed_after_the_next_takeover(cluster):
    """Published in term 1 on two nodes; one is lost during the takeover of
    term 2, whose master repairs the object onto the third node. The copy's
    publish mark carries the object's publishing term, so its node records
    term 1 (spec/Failover.tla ``Repair``, ``RepairedEntry``), and the master
    of term 3 lists the original and the copy alike: no region is left held
    at a node and free in the master's ledger."""
    c = cluster(3)
    held, dst, second, copy, data = _repaired_after_a_loss(c)
    assert c.nodes[held[1]].node.index[b"k"].by == 1
    (status, _), delivered = c.call(second, "repair_done", {"segment": dst, "key": b"k",
                                                            "repair": copy.repair})
    assert status == 0 and [(s, op, st) for s, op, _, st in delivered] == [(dst, "publish", 0)]
    # the node registered with columns: the publishing term is the sixth column
    assert delivered[0][2]["term"] == 2 and delivered[0][2]["columns"][5] == [1]
    original, repaired = c.nodes[held[1]].node.index[b"k"], c.nodes[dst].node.index[b"k"]
    assert repaired.published and (repaired.term, repaired.by) == (1, 1)
    assert (repaired.token, repaired.checksum) == (original.token, original.checksum)
    third = c.failover(sorted(c.live))
    rec = third.directory.objects[b"k"]
    assert sorted(r.segment for r in rec.replicas) == sorted([held[1], dst])
    assert third.counters["checksum_mismatches"] == 0
    for seg in (held[1], dst):
        r = next(r for r in rec.replicas if r.segment == seg)
        assert c.read(seg, r.offset, 1000, rec.token, third.failover.term) == data
        # every region the node holds is one the master's ledger counts taken
        assert third.placer.allocators[seg].free_bytes == third.directory.segments[seg].free
        assert sum(reg.length for reg in c.nodes[seg].node.regions.values()) == \
            c.nodes[seg].memory.capacity - third.directory.segments[seg].free
