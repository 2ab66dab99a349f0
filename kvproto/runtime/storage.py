"""A storage node: one segment, one :class:`~kvproto.cores.storage.StorageNodeCore`.

:class:`StorageCore` keeps the segment's region table (``spec/Publish.tla``)
and its term fence and object index (``spec/Failover.tla``) in one fast core,
:class:`~kvproto.cores.storage.StorageNodeCore`, held to the reference machines
``publish.storage_step`` and ``failover.storage_step`` (``docs/cores.md``), and
changes them only by stepping it; the regions granted to direct writers
(``spec/DirectWrite.tla``) are a second fast core,
:class:`~kvproto.cores.direct.DirectCore`, held to ``directwrite.node_step``.
Every ``assign``, ``free``, ``write`` and
``read`` is first stepped; only an accepted event touches memory: a write's
bytes are copied into the segment (one memcpy from the received frame) after
``WriteReplica`` was accepted, and a read is answered with a zero-copy frame of
the segment after ``ReadReplica`` was accepted. A refused event answers the
typed error and changes nothing (no byte is written). The core commits every
event it accepts, so where one request is several events that hold together
(an ``assign`` is ``StampedAllocate``, ``AssignRegion`` and maybe
``GrantDirect``; a direct writer's ``publish`` is ``PublishDirect``,
``WriteReplica`` and ``StampedPublish``), the node first asks the core whether
each would be accepted (their ``regions``, ``index`` and ``term``), steps a
refused one alone for its error, and steps them all only when none can be
refused.
Segment bytes live in POSIX shared memory with a generation table for
lock-free same-host reads (:mod:`kvproto.runtime.shm`).

Tracked transfers (``spec/Timeout.tla``): a ``load`` (a read into a client's
destination buffer) and a ``write`` naming ``owner``/``xfer`` are ``Start``-ed
in the node's transfer table (:func:`~kvproto.statemachines.timeout.node_step`,
one table per owner, i.e. per client transfer engine) on arrival, before any
check, and ``Land`` when they run, whether their checks pass or they are
answered with an error (either way they are finished and write nothing
more); ``cancel`` is ``StorageCancel``: a running transfer is stopped, then
acknowledged, so a stopped load's bytes are never sent and a stopped write is
discarded. ``Land`` and a stopping ``StorageCancel`` forget the transfer, so a
table holds only transfers that arrived and have not run yet (held by the
``delay_ms`` fault, in practice none), and an owner whose table is empty is
dropped: the node's memory is bounded by the transfers in flight, not by the
transfers it ever served. A cancel of a generation the node does not know (it
ran and was forgotten, or its load was lost) is acknowledged without effect:
the cancel comes after its load on the same connection, so no load of that
generation can still arrive.

The node's process, its ZeroMQ loop around this core, registration with the
master, test-only faults and tracing, is
:class:`~kvproto.runtime.storage_server.StorageServer`.
"""

from __future__ import annotations

import logging
from typing import Optional

from kvproto import errors
from kvproto.cores.direct import DirectCore
from kvproto.cores.storage import StorageNodeCore
from kvproto.runtime import tracing, wire
from kvproto.runtime.copier import Copy
from kvproto.runtime.datapath import checksum
from kvproto.runtime.shm import SegmentMemory, gen_word, host_id, writer_alive
from kvproto.statemachines import directwrite as dw
from kvproto.statemachines import failover as fm
from kvproto.statemachines.publish import (
    AssignRegion, FreeRegion, ReadReplica, Refused, WriteReplica,
)
from kvproto.statemachines.timeout import (
    Land, NodeTransfers, Start, StorageCancel, node_step,
)
from kvproto.statemachines.timeout import Refused as XferRefused

log = logging.getLogger("kvproto.storage")

#: a request item's success (``wire.ok_item()``), shared: packed, never changed
OK = wire.ok_item()
#: an assign, publish or free of at least this many regions goes through the
#: cores' batch steps; fewer are stepped one by one, which costs less than the batch
#: steps' array calls at batch 1 (both are held to the same reference steps)
BATCH_STEP_FROM = 32


def _answer(body: dict, accepted: int, results: Optional[list] = None) -> dict:
    """The reply to an ``assign`` or ``publish`` whose ``accepted`` regions
    were (``results``: each region's item; None: every one): ``{"accepted":
    n}`` when every one was and the master asked with ``tally``, else the items."""
    if results is None:
        return {"accepted": accepted} if body.get("tally") else {"results": [OK] * accepted}
    if accepted == len(results) and body.get("tally"):
        return {"accepted": accepted}
    return {"results": results}


class StorageCore:
    """The node's logic without sockets."""

    COUNTERS = ("assigned", "freed", "writes", "reads", "refused", "rejected", "bytes_written",
                "bytes_read", "loads", "cancels", "discarded", "dropped", "duplicated",
                "stale_reads", "reads_delayed", "published", "fences", "stale_terms", "purged",
                "bytes_purged", "direct_granted", "direct_published", "draining", "drained",
                "unauthorized", "tickets_refused",
                # repair copies into this segment (runtime/copier.py): started,
                # written and reported, failed (reported with their error)
                "repairs_started", "repairs_copied", "repairs_failed", "bytes_repaired")

    def __init__(self, memory: SegmentMemory, segment: str) -> None:
        self.memory = memory
        #: the region table (``spec/Publish.tla``: which token owns which region)
        #: and the failover fence and object index (``spec/Failover.tla``: the
        #: highest term seen, and per key the allocation's term, token, region,
        #: and whether, and in which term, it was published), changed only by
        #: its ``step``
        self.node = StorageNodeCore(segment)
        #: the highest token any region of this segment carried: its
        #: generation words name tokens, so a new master issues only higher
        #: ones (a same-host reader holding a freed region's token must miss)
        self.tokens_seen = 0
        #: where clients reach this node (set by the server once it is bound)
        self.endpoint = ""
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        #: the Timeout protocol's transfer table (``node_step``), one per owner:
        #: an owner is one client transfer engine, whose generations are unique.
        #: Only transfers in progress are kept, and only owners that have some.
        self.xfers: dict[str, NodeTransfers] = {}
        #: regions granted to direct writers (``spec/DirectWrite.tla``), changed
        #: only by its ``step``: the fast core held to ``directwrite.node_step``;
        #: a region freed while its writer may still write it stays here,
        #: draining, until the writer reports or dies
        self.direct = DirectCore()
        #: offset -> length of the draining regions (what the master must keep out)
        self.draining: dict[int, int] = {}
        #: repair copies the master asked for, to start (``repair``; the server's
        #: :class:`~kvproto.runtime.copier.Copier` pulls them): ``(copy, term)``
        self.copies: list[tuple[Copy, int]] = []
        #: records every step of ``node`` when set (:meth:`record_to`)
        self.trace: Optional[tracing.StorageRecorder] = None

    def record_to(self, trace: tracing.StorageRecorder) -> None:
        """Record every step of the core to ``trace`` from now on."""
        self.trace = trace
        trace.opened(self.node.segment, self.node.term)

    @property
    def segment(self) -> str:
        return self.node.segment

    def restart(self, segment: str) -> None:
        """Start over under a new segment id (the old segment is lost); the
        fence keeps the highest term seen, the index is emptied with the bytes."""
        self.memory.reset()
        self.node.restart(segment)
        if self.trace is not None:
            self.trace.opened(segment, self.node.term)
        self.direct = DirectCore()
        self.draining.clear()

    @property
    def term(self) -> int:
        return self.node.term

    def registration(self) -> dict:
        """What a master needs to know of this node's segment (``register``,
        and the answer to a new master's ``fence``)."""
        mem = self.memory
        return {"segment": self.segment, "capacity": mem.capacity, "endpoint": self.endpoint,
                "host": host_id(), "shm": mem.name, "gen_shm": mem.gen_name, "nonce": mem.nonce,
                "page_size": mem.page_size, "held": self.held(), "columns": True}

    def held(self) -> int:
        """Allocations this segment still holds (regions, index entries, regions
        draining for direct writers): a master that did not fence it does not
        know them, so the node must start over before it joins such a master."""
        return len(self.node.regions) + len(self.node.index) + len(self.direct.regions)

    def _step(self, event):
        """Step the core (an accepted event is committed): ``(effects, error)``;
        a refusal is counted (``stale_terms`` or ``refused``) and changes nothing."""
        effects = self.node.step(event)
        if self.trace is not None:
            self.trace.step(self.node.segment, event, effects)
        if effects and isinstance(effects[0], Refused):
            err = effects[0].error
            self.counters["stale_terms" if isinstance(err, errors.StaleTerm) else "refused"] += 1
            return effects, err
        return effects, None

    def _refusal(self, event) -> errors.KvError:
        """Step ``event``, which the core's views say it refuses: its error
        (counted); nothing changes."""
        _, err = self._step(event)
        if err is None:
            raise errors.InternalError(f"{type(event).__name__} was accepted where refused")
        return err

    def _commit(self, event) -> tuple:
        """Step ``event``, which the core's views say it accepts: its effects."""
        effects, err = self._step(event)
        if err is not None:
            raise errors.InternalError(f"{type(event).__name__} was refused where accepted: {err}")
        return effects

    def _check_term(self, op: str, body: dict) -> None:
        """Spec ``NodeAccepts``: a request stamped below the fence is refused
        (before any step of the core; recorded as a ``StaleRequest``)."""
        if not fm.node_accepts(self.node, body["term"]):
            self.counters["stale_terms"] += 1
            err = errors.StaleTerm(f"term {body['term']} is below {self.node.term}")
            if self.trace is not None:
                self.trace.stale(self.node.segment, op, body["term"], err)
            raise err

    def fence_to(self, term: int) -> bool:
        """Spec ``Fence`` (node side): learn ``term``; False if it is below the fence."""
        _, err = self._step(fm.Fence(term))
        if err is not None:
            return False
        self.counters["fences"] += 1
        return True

    def _check_segment(self, body: dict) -> None:
        if body["segment"] != self.node.segment:
            raise errors.SegmentUnavailable(f"this node serves segment {self.node.segment!r}, "
                                            f"not {body['segment']!r}")

    # ------------------------------------------------------------------ tracked transfers

    @staticmethod
    def tracked(op: str, body: dict) -> bool:
        """Whether the request is a tracked transfer of the Timeout protocol
        (``writes`` carries one per region)."""
        return op in ("load", "writes") or (op == "write" and "xfer" in body)

    def _xfer_step(self, owner: str, event):
        """``node_step`` on ``owner``'s table without committing: ``(table, effects)``."""
        return node_step(self.xfers.get(owner, NodeTransfers()), event)

    def _xfer_commit(self, owner: str, table: NodeTransfers) -> None:
        """Store ``owner``'s table; an owner with no transfer in progress is dropped."""
        if table.transfers:
            self.xfers[owner] = table
        else:
            self.xfers.pop(owner, None)

    def xfer_records(self) -> int:
        """Transfer records held, over all owners (the transfers in progress)."""
        return sum(len(t.transfers) for t in list(self.xfers.values()))

    def start(self, op: str, body: dict) -> None:
        """``Start``: record a tracked transfer as running as soon as it arrives,
        before anything about it is checked, so that a cancel of it is always
        acknowledged (a transfer that fails its checks never lands)."""
        if op == "write" and "owner" not in body:
            raise errors.MalformedFrame("write: xfer without owner")
        owner = body["owner"]
        if op == "writes":
            started = [(xfer, f"{body['segment']}@{offset}") for offset, _, xfer in body["regions"]]
        else:
            started = [(body["xfer"], body["buffer"] if op == "load"
                        else f"{body['segment']}@{body['offset']}")]
        table = self.xfers.get(owner, NodeTransfers())
        for xfer, buffer in started:           # all or none
            table, effects = node_step(table, Start(xfer, buffer))
            if effects and isinstance(effects[0], XferRefused):
                raise effects[0].error
        self._xfer_commit(owner, table)

    def _land(self, owner: str, xfer: int) -> bool:
        """``Land`` of a tracked transfer about to run: it is finished and
        forgotten (whether its checks then pass or not, it writes nothing after
        this step). False when a cancel stopped it (it must not write)."""
        table, effects = self._xfer_step(owner, Land(xfer))
        if effects and isinstance(effects[0], XferRefused):
            self.counters["discarded"] += 1
            return False
        self._xfer_commit(owner, table)
        return True

    def _op_cancel(self, body, payloads):
        """``StorageCancel``: stop (and forget) the transfer if it still runs,
        then acknowledge; a generation the node does not know is acknowledged
        without effect (it ran, or its load was lost; it cannot still arrive)."""
        owner, gen = body["owner"], body["xfer"]
        table, effects = self._xfer_step(owner, StorageCancel(gen))
        if effects and isinstance(effects[0], XferRefused):
            raise effects[0].error
        self._xfer_commit(owner, table)
        self.counters["cancels"] += 1
        return {"xfer": gen, "acked": True}, []

    def handle(self, op: str, body: dict, payloads: list) -> Optional[tuple[dict, list]]:
        """Handle a validated request: ``(reply body, payload frames)`` or raise;
        ``None`` (send nothing) for a tracked load a cancel stopped."""
        if op == "stats":
            return self.stats(), []
        if op == "cancel":
            return self._op_cancel(body, payloads)
        if op == "writes":
            return self._op_writes(body, payloads)
        if self.tracked(op, body) and not self._land(body["owner"], body["xfer"]):
            if op == "load":
                return None
            raise errors.StaleGeneration(f"write transfer {body['xfer']} was cancelled; discarded")
        self._check_segment(body)
        self._check_term(op, body)
        if op == "load":
            result = self._op_read(body, payloads)
            self.counters["loads"] += 1
            return {"xfer": body["xfer"], "buffer": body["buffer"]}, result[1]
        return getattr(self, "_op_" + op)(body, payloads)

    def _dstep(self, event) -> tuple[tuple, Optional[errors.KvError]]:
        """Step the direct-write core: ``(effects, error)``; a refusal changes
        nothing. Where a direct step holds together with steps of the node
        core, the node judges it first from the core's view and steps it
        when all are accepted (or alone, for its error)."""
        effects = self.direct.step(event)
        if effects and isinstance(effects[0], dw.Refused):
            return effects, effects[0].error
        return effects, None

    def _observe(self, offset: int, token: int) -> None:
        """``WriteReported`` once a direct writer's report shows in the region's
        generation word (it sets ``token << 1 | 1`` after its copy)."""
        if self.direct.unreported(offset, token) \
                and self.memory.word(offset) == gen_word(token, True):
            self.direct.report(offset, token)

    def _op_assign(self, body, payloads):
        """``AssignRegion`` (publish) and ``StampedAllocate`` (failover index),
        and ``GrantDirect`` for a region named in ``direct`` or with a writer
        in ``columns`` (its writer writes it itself), all or none. A region
        still draining for an earlier direct writer is refused."""
        mem, term = self.memory, body["term"]
        direct = dict(body.get("direct", ()))
        rows, columns = body.get("regions"), body.get("columns")
        if columns is not None:                   # the fifth column: each region's direct writer
            offsets, writers = columns[0], columns[4]
            if any(writers):
                direct.update((o, w) for o, w in zip(offsets, writers) if w)
            columns = columns[:4]
        count = len(rows if rows is not None else columns[0])
        if self.trace is None and count >= BATCH_STEP_FROM and self._assign_all(
                term, columns if rows is None else list(map(list, zip(*rows))), direct):
            return _answer(body, count), []
        node, segment, counters = self.node, self.segment, self.counters
        page, capacity, set_word = mem.page_size, mem.capacity, mem.set_word
        index, regions, granted = node.index, node.regions, self.direct.regions
        grant, traced = self.direct.grant, self.trace is not None
        results, assigned = [], 0
        for offset, length, key, token in (zip(*columns) if rows is None else rows):
            if offset % page or offset + length > capacity:
                results.append(wire.error_item(errors.InvalidArgument(
                    f"region {offset}+{length} is not a page-aligned part of the segment")))
                continue
            err = None
            # asked of the core, stepped only if every step is accepted: a
            # refused one is stepped alone, for its error (it changes nothing)
            if key in index or term < node.term:           # held here, or a stale term
                err = self._refusal(fm.StampedAllocate(segment, key, term, offset, length, token))
            elif offset in regions:                        # already owned
                err = self._refusal(AssignRegion(segment, offset, length, key, token))
            elif offset in direct:
                # the last check: once accepted, the two steps below are too
                err = grant(offset, token, direct[offset])
                counters["direct_granted"] += err is None
            elif offset in granted:
                err = errors.RegionMismatch(f"region {offset} is still draining for a direct writer")
            if err is not None:
                results.append(wire.error_item(err))
                continue
            if traced:
                self._commit(fm.StampedAllocate(segment, key, term, offset, length, token))
                self._commit(AssignRegion(segment, offset, length, key, token))
            elif node.allocate_region(term, offset, length, key, token) is not None:
                raise errors.InternalError(f"the assign of {offset} was refused where accepted")
            set_word(offset, gen_word(token, False))
            if token > self.tokens_seen:     # at once: a later refusal may raise
                self.tokens_seen = token
            assigned += 1
            results.append(OK)
        counters["assigned"] += assigned
        return _answer(body, assigned, results), []

    def _assign_all(self, term: int, columns: list, direct: dict) -> bool:
        """The regions of an ``assign`` (as columns) at once, ``direct`` the
        writer of each offset granted to a direct writer, when every step of
        every one is accepted (the cores' batch steps, equal to stepping them
        in turn): True, all assigned; else False and nothing changed."""
        mem = self.memory
        offsets, lengths, keys, tokens = columns
        if max(map(int.__add__, offsets, lengths)) > mem.capacity \
                or any(offset % mem.page_size for offset in offsets) \
                or not self.direct.vacant(offsets) \
                or not self.node.allocate_regions(term, offsets, lengths, keys, tokens):
            return False
        # the direct table has no row at any offset: every grant is accepted
        mine = [(offset, token, direct[offset])
                for offset, token in zip(offsets, tokens) if offset in direct]
        if mine and not self.direct.grant_many(*map(list, zip(*mine))):
            raise errors.InternalError("GrantDirect was refused where accepted")
        mem.set_words(offsets, [token << 1 for token in tokens])   # gen_word(token, False)
        self.tokens_seen = max(self.tokens_seen, *tokens)
        self.counters["assigned"] += len(offsets)
        self.counters["direct_granted"] += len(mine)
        return True

    def _free_region(self, offset: int, token: int, length: int,
                     keep_word: bool = False) -> Optional[errors.KvError]:
        _, err = self._step(FreeRegion(self.segment, offset, token, length))
        if err is not None:
            return err
        if not keep_word:
            self.memory.set_word(offset, 0)
        self.counters["freed"] += 1
        return None

    def _op_free(self, body, payloads):
        """``FreeRegion`` (publish); the index entry of that allocation goes with
        it (``StampedFree``). A direct writer's region whose writer may still
        write it drains instead (``FreeDirect``): its item is ``[0, "draining"]``,
        and the master keeps it out until this node reports it drained."""
        node, term, results = self.node, body["term"], []
        rows = body["regions"]
        if self.trace is None and len(rows) >= BATCH_STEP_FROM and self._free_all(term, rows):
            return {"results": [OK] * len(rows)}, []
        alive: dict = {}
        for offset, token, length in rows:
            region = node.region(offset)
            free = None
            if region is not None and region.token == token:
                free = fm.StampedFree(self.segment, region.key, term, token)
                entry = node.entry(region.key)
                if entry is None or entry.token != token or term < node.term:
                    self._refusal(free)   # not held here with that token, or a stale term
                    free = None
            err, draining = self._release(offset, token, length, alive)
            if err is None and free is not None:
                self._commit(free)
            results.append(wire.error_item(err) if err is not None
                           else wire.ok_item("draining" if draining else None))
        return {"results": results}, []

    def _free_all(self, term: int, rows: list) -> bool:
        """The regions of a ``free`` at once, when each one's steps are
        accepted and none drains (the cores' batch steps, equal to stepping
        them in turn): ``StorageNodeCore.free_regions`` and, for a direct
        writer's region whose write was reported, ``DirectCore.free_many``.
        True, all freed; else False and nothing changed."""
        offsets, tokens, _ = map(list, zip(*rows))
        if max(offsets) >= self.memory.capacity:
            return False
        # a direct writer's region frees at once only once its write was
        # reported (else it may drain: step by step, asking after the writer)
        freeable = self.direct.freeable(offsets, tokens)
        if False in freeable:
            return False
        mine = [(offset, token) for offset, token, f in zip(offsets, tokens, freeable)
                if f is not None]
        if not self.node.free_regions(term, offsets, tokens):
            return False
        if mine and not self.direct.free_many(*map(list, zip(*mine))):
            raise errors.InternalError("FreeDirect was refused where accepted")
        self.memory.set_words(offsets, [0] * len(offsets))
        self.counters["freed"] += len(offsets)
        return True

    def _release(self, offset: int, token: int, length: int,
                 alive: dict) -> tuple[Optional[errors.KvError], bool]:
        """Free a region (``FreeRegion``), through ``FreeDirect`` when a direct
        writer holds it: ``(error, draining)``. A draining region leaves the
        region table (it holds no object) but keeps its generation word, where
        its writer's report will show. ``alive`` keeps, for the regions of one
        command, whether each writer lived when first asked (three system
        calls a look): a writer seen alive is taken as alive for the rest of
        the command, the safe side (its regions drain), and a dead one stays
        dead."""
        region = self.direct.regions.get(offset)
        draining, free = False, None
        if region is not None and region.token == token:
            self._observe(offset, token)
            region = self.direct.regions[offset]
            lives = alive.get(region.writer)
            if lives is None:
                lives = alive[region.writer] = writer_alive(region.writer)
            free = dw.FreeDirect(offset, token, lives)
            if region.state is dw.RegionState.DRAINING:   # refused: stepped for its error
                return self._dstep(free)[1], False
            draining = region.state is dw.RegionState.GRANTED and not region.wrote \
                and free.writer_alive
        err = self._free_region(offset, token, length, keep_word=draining)
        if err is None and free is not None:
            effects, derr = self._dstep(free)
            if derr is not None or isinstance(effects[0], dw.Draining) != draining:
                raise errors.InternalError(f"FreeDirect({offset}) was not as judged: {effects}")
            if draining:
                self.draining[offset] = length
                self.counters["draining"] += 1
        return err, draining

    def drain(self) -> list[int]:
        """``Drain`` every draining region whose writer reported or died: they are
        free now; returns their offsets (to report to the master)."""
        done = []
        for offset, region in list(self.direct.regions.items()):
            if region.state is not dw.RegionState.DRAINING:
                continue
            self._observe(offset, region.token)
            _, err = self._dstep(dw.Drain(offset, writer_alive(region.writer)))
            if err is None:
                self.memory.set_word(offset, 0)
                self.draining.pop(offset, None)
                self.counters["drained"] += 1
                done.append(offset)
        return done

    def _op_publish(self, body, payloads):
        """``StampedPublish``: the master published the object; its region must
        hold that allocation, completely written. The index records the
        object's checksum and requested replica count with the publish (when
        the master sends them), and for a repaired replica the object's
        publishing term (spec Failover ``Repair``)."""
        rows, columns = body.get("regions"), body.get("columns")
        count = len(rows if rows is not None else columns[0])
        if self.trace is None and count >= BATCH_STEP_FROM:
            batch = columns
            if rows is not None:                  # rows of one width: the batch step may take them
                batch = list(map(list, zip(*rows))) if len(set(map(len, rows))) == 1 else None
            if batch is not None and self._publish_all(body["term"], batch):
                return _answer(body, count), []
        node, term, results = self.node, body["term"], []
        segment, counters, direct = self.segment, self.counters, self.direct
        owner_of, held_by, traced = node.owner, direct.held, self.trace is not None
        word, published, direct_published = self.memory.word, 0, 0
        for offset, key, token, *recorded in (zip(*columns) if rows is None else rows):
            owner = owner_of(offset)
            ours = owner is not None and owner[1] == token and owner[0] == key
            held = held_by(offset, token)
            write = False
            if held is not None and ours:
                # a direct write: published only once its writer reported it
                if not held[1] and word(offset) == gen_word(token, True):
                    # WriteReported (as _observe): its report shows in the word
                    if direct.report(offset, token) is not None:
                        raise errors.InternalError(f"WriteReported({offset}) was refused")
                    held = (held[0], True)
                if held[0] is not dw.RegionState.GRANTED or not held[1]:
                    # refused: stepped alone, for its error
                    counters["refused"] += 1
                    results.append(wire.error_item(self._dstep(dw.PublishDirect(offset, token))[1]))
                    continue
                # WriteReplica by the token that owns the unwritten region: accepted
                write = not owner[2]
            if not ours or not (owner[2] or write):
                counters["refused"] += 1
                results.append(wire.error_item(errors.StaleToken(
                    f"region {offset} does not hold a written {key!r} with token {token}")))
                continue
            if not node.open_allocation(key) or term < node.term \
                    or (len(recorded) > 2 and recorded[2] > term):
                # not an open allocation here, a stale term, or a publishing
                # term above the command's
                results.append(wire.error_item(self._refusal(
                    fm.StampedPublish(segment, key, term, *recorded))))
                continue
            if traced:
                if write:
                    self._commit(WriteReplica(segment, offset, token))
                self._commit(fm.StampedPublish(segment, key, term, *recorded))
            elif node.publish_region(term, offset, token, key, *recorded, write=write) is not None:
                raise errors.InternalError(f"the publish of {offset} was refused where accepted")
            if held is not None:
                err = direct.publish(offset, token)
                if err is not None:
                    raise errors.InternalError(f"PublishDirect was refused where accepted: {err}")
                direct_published += 1
            published += 1
            results.append(OK)
        counters["published"] += published
        counters["direct_published"] += direct_published
        return _answer(body, published, results), []

    def _publish_all(self, term: int, columns: list) -> bool:
        """The regions of a ``publish`` (as columns, those after the token
        optional) at once, when every step of every one is accepted (the
        cores' batch steps, equal to stepping them in turn): True, all
        published; else False and nothing changed."""
        offsets, keys, tokens, *recorded = columns
        if max(offsets) >= self.memory.capacity:
            return False
        zeros = [0] * len(offsets)
        checksums, requested, bys = recorded + [zeros] * (3 - len(recorded))
        # a direct writer's region: its write shows done in the region's word
        shown = [word == token << 1 | 1 for word, token in zip(self.memory.words(offsets), tokens)]
        held = self.direct.publishable(offsets, tokens, shown)
        if False in held:
            return False
        direct = [h is not None for h in held]
        if not self.node.publish_regions(term, offsets, keys, tokens, checksums, requested, bys,
                                         direct):
            return False
        mine = [(offset, token, seen) for offset, token, seen, d
                in zip(offsets, tokens, shown, direct) if d]
        if mine and not self.direct.publish_many(*map(list, zip(*mine))):
            raise errors.InternalError("PublishDirect was refused where accepted")
        self.counters["published"] += len(offsets)
        self.counters["direct_published"] += len(mine)
        return True

    def _op_repair(self, body, payloads):
        """A repair copy into a region assigned to the object's token for it:
        accepted when the region is assigned to that token, unwritten, and
        holds that key; the copy runs after the reply (``repair_done``)."""
        results = []
        for offset, key, token, length, repair, source, segment, src_offset, checksum, *ticket \
                in body["regions"]:
            region = self.node.region(offset)
            if region is None or region.token != token or region.key != key or region.done \
                    or region.length != length:
                self.counters["refused"] += 1
                results.append(wire.error_item(errors.RegionMismatch(
                    f"region {offset} is not an unwritten region of {key!r} with token {token}")))
                continue
            self.copies.append((Copy(repair, key, token, offset, length, source, segment,
                                     src_offset, checksum, ticket[0] if ticket else None),
                                body["term"]))
            self.counters["repairs_started"] += 1
            results.append(wire.ok_item())
        return {"results": results}, []

    def copied(self, copy: Copy, data: Optional[memoryview]) -> None:
        """Write a repair copy's bytes into its region (``WriteReplica``), after
        checking them against the object's checksum; raises the typed error
        that fails the copy."""
        if copy.checksum and checksum(data) != copy.checksum:
            raise errors.ChecksumMismatch(f"{copy.key!r} from {copy.source_segment} does not "
                                          f"match its checksum")
        self._asked("write", copy.offset, copy.token)
        self._write_region(copy.offset, copy.token, data)
        self.counters["writes"] -= 1          # counted as a repair, not a client's write
        self.counters["bytes_written"] -= copy.length
        self.counters["repairs_copied"] += 1
        self.counters["bytes_repaired"] += copy.length

    def _op_fence(self, body, payloads):
        """``Fence`` then ``IndexRequest``: learn the new term, answer the index
        as columns (:class:`~kvproto.cores.recovery.IndexColumns`, one payload
        frame each), read from the core's columns: an accepted ``IndexRequest``
        changes nothing, so only a refused one is stepped, for its error."""
        if not self.fence_to(body["term"]):
            raise errors.StaleTerm(f"term {body['term']} is below {self.node.term}")
        if not fm.node_accepts(self.node, body["term"]):
            _, err = self._step(fm.IndexRequest(body["term"]))
            raise err
        index = self.node.index_columns()
        return {**self.registration(), "term": self.node.term, "objects": len(index),
                "next_token": self.tokens_seen + 1,
                "draining": self._draining_after_purge(body["term"])}, index.frames()

    def _draining_after_purge(self, below: int) -> list:
        """``[offset, length]`` of the regions draining for a direct writer, and
        of those the purge of allocations below ``below`` may leave draining
        (granted to a direct writer that has not written): the new master keeps
        them all out until this node reports them drained, or its purge's
        answer no longer lists them."""
        regions = dict(self.draining)
        for _, entry in self.node.unpublished(below):
            region = self.direct.regions.get(entry.offset)
            if region is not None and region.token == entry.token \
                    and region.state is dw.RegionState.GRANTED and not region.wrote:
                regions[entry.offset] = entry.length
        return [[off, n] for off, n in sorted(regions.items())]

    def _op_purge(self, body, payloads):
        """``PurgeUnpublished``: drop unpublished allocations of older terms and
        free their regions (a direct writer's that it may still write drains);
        the answer lists the regions draining after it."""
        # the entries the purge drops (it answers only their keys): their regions go after
        doomed = dict(self.node.unpublished(body["below"]))
        effects, err = self._step(fm.PurgeUnpublished(self.segment, body["below"]))
        if err is not None:
            raise err
        purged = effects[0]
        alive: dict = {}
        for key in purged.keys:
            e = doomed[key]
            self._release(e.offset, e.token, e.length, alive)
        self.counters["purged"] += len(purged.keys)
        self.counters["bytes_purged"] += purged.freed
        return {"purged": len(purged.keys), "freed": purged.freed,
                "draining": [[off, n] for off, n in sorted(self.draining.items())]}, []

    def awaits_assign(self, body: dict) -> bool:
        """A write whose region is not (yet) assigned to its token, for a token
        above every one this node has been assigned, under a term it accepts:
        its ``assign`` may still be on its way (the master does not wait for
        the node before granting; it sends the assign first, on its own
        connection). Any other write is judged at once (``WriteReplica``)."""
        node = self.node
        if not fm.node_accepts(node, body["term"]):
            return False
        for offset, token in (((r[0], r[1]) for r in body["regions"]) if "regions" in body
                              else ((body["offset"], body["token"]),)):
            if token > self.tokens_seen:
                region = node.region(offset)
                if region is None or region.token != token:
                    return True
        return False

    def _op_writes(self, body, payloads):
        """Several ``WriteReplica`` in one message (a batch's writes to this
        node), each a tracked transfer of its own: ``{"results": [item per
        region]}``; a region's refusal does not stop the others."""
        owner, results = body["owner"], []
        landed = [self._land(owner, xfer) for _, _, xfer in body["regions"]]
        self._check_segment(body)
        self._check_term("writes", body)
        for (offset, token, xfer), ran, payload in zip(body["regions"], landed, payloads):
            try:
                if not ran:
                    raise errors.StaleGeneration(f"write transfer {xfer} was cancelled; discarded")
                self._asked("write", offset, token)
                self._write_region(offset, token, payload)
                results.append(wire.ok_item())
            except errors.KvError as err:
                results.append(wire.error_item(err))
        return {"results": results}, []

    def _op_write(self, body, payloads):
        self._asked("write", body["offset"], body["token"])
        self._write_region(body["offset"], body["token"], payloads[0])
        return {}, []

    def _asked(self, op: str, offset: int, token: int) -> None:
        """Record (with a trace) the region and token a write or read asks for,
        as the request names them, before the steps it causes."""
        if self.trace is not None:
            self.trace.asked(op, self.segment, offset, token)

    def _write_region(self, offset: int, token: int, payload: memoryview) -> None:
        """``WriteReplica`` and the one memcpy from the received frame; a
        payload of the wrong length is refused before the step (nothing changes)."""
        region = self.node.region(offset)
        if region is None or region.token != token or region.done:   # not owned, or written
            raise self._refusal(WriteReplica(self.segment, offset, token))
        if len(payload) != region.length:
            raise errors.InvalidArgument(f"write of {len(payload)} bytes to a region of {region.length}")
        mem = self.memory
        mem.set_word(offset, gen_word(token, False))   # seqlock: in flux
        mem.data[offset:offset + region.length] = payload  # the one memcpy
        mem.set_word(offset, gen_word(token, True))
        if self.trace is not None:
            self._commit(WriteReplica(self.segment, offset, token))
        elif self.node.write(offset, token) is not None:
            raise errors.InternalError(f"WriteReplica({offset}) was refused where accepted")
        self._observe(offset, token)   # a direct writer's region written over the network
        self.counters["writes"] += 1
        self.counters["bytes_written"] += region.length

    def _op_read(self, body, payloads):
        offset, token = body["offset"], body["token"]
        self._asked("read", offset, token)
        _, err = self._step(ReadReplica(self.segment, offset, token))
        if err is not None:
            raise err
        region = self.node.region(offset)
        if body["length"] != region.length:
            raise errors.InvalidArgument(f"read of {body['length']} bytes of a region of {region.length}")
        # defence in depth: the region's reuse generation (the per-page word the
        # same-host path checks) must name this token, written and complete
        if self.memory.word(offset) != gen_word(token, True):
            self.counters["stale_reads"] += 1
            raise errors.StaleToken(f"region {offset} no longer holds token {token}")
        self.counters["reads"] += 1
        self.counters["bytes_read"] += region.length
        return {}, [self.memory.view(offset, region.length)]

    def stats(self) -> dict:
        node = self.node
        return {"segment": self.segment, "capacity": self.memory.capacity, "term": node.term,
                "indexed": len(node.index),
                "published": sum(1 for e in node.index.values() if e.published),
                "regions": len(node.regions),
                "used": sum(r.length for r in node.regions.values()),
                "counters": dict(self.counters)}
