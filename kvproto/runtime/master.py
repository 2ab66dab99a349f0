"""The master: one directory and one lease table, changed only by stepping them.

They are the fast cores :class:`~kvproto.cores.directory.DirectoryCore` and
:class:`~kvproto.cores.leases.LeaseCore` (mutable, columnar), held to the frozen
reference machines :func:`~kvproto.statemachines.publish.master_step` and
:func:`~kvproto.statemachines.lease.master_step` by the conformance graphs and
a differential test (docs/cores.md).

Split in two:

* :class:`MasterCore` — no sockets. It owns the directory, the allocators
  (:class:`~kvproto.runtime.allocator.Placer`), the registered storage nodes and
  the client sessions. Each request becomes machine events; the effects the
  machine returns are carried out: ``AssignRegion``/``FreeRegion`` become
  commands for the storage nodes (queued in effect order in :attr:`MasterCore.outbox`),
  ``FreeRegion`` also returns the region to the allocator, ``PutGranted``/
  ``Published``/``Revoked`` maintain the session bookkeeping, and ``Refused``
  answers the requester with its typed error and changes nothing.
* :class:`MasterServer` — a single-threaded ZeroMQ loop: a ROUTER for clients and
  storage nodes, and one DEALER per storage node (connected to the node's
  endpoint) that carries ``assign``/``free`` commands in order, so a free always
  reaches the node before a later assign of the same region.

A put's grant leaves after the ``assign`` commands it needs, which go first on
each node's own connection (a write that reaches a node before its assign waits
for it there); a node that refuses an assign gets the attempt revoked
(``PutRevoke``) and the writer's write and ``put_end`` are refused. Replies to
``put_end`` and ``remove`` are *parked* until the nodes acknowledged the
``publish`` or ``free`` (the loop never blocks on them).

Client sessions. A client that holds pending allocations or read pins has one.
Each pending allocation (put attempt) has a deadline of its own: it is
refreshed only by a request naming its token (``put_end``, ``put_revoke``) or
by a ``heartbeat`` listing it among the client's attempts in flight, and when
it lapses (``writer_timeout``) the master feeds ``ReclaimAbandoned(key,
token)``. So an attempt whose token its client never received (its
``put_start`` timed out) ends on its own even while the client keeps working;
the client may also end it at once with ``put_abandon`` (its own pending
attempts on the keys it names). A session silent for ``writer_timeout`` has
``ReadEnd(key, token)`` fed for each pin it still holds (so a crashed reader
cannot pin an object forever). The session only remembers what is *in
flight*; it is dropped when empty. A storage node silent for
``storage_timeout`` (or that deregisters, or answers a command with
``SegmentUnavailable``) becomes ``SegmentLost``.

Acknowledgements (``spec/Failover.tla``, ``AcknowledgedChangesSurvive``): the
reply to ``put_end`` waits until every replica's node recorded the publish,
and the reply to ``remove`` until every replica's node recorded the free, each
stamped with this master's term; a node fenced by a newer master refuses, and
the client is told the change failed. Besides, :class:`MasterServer` answers
nothing but ``MasterNotOpen`` once it cannot prove that it still holds its
term (a renewal less than ``HELD_FRACTION`` of the coordinator's TTL ago):
checked before it handles a request and again before it sends each reply.

Leases across a takeover (``spec/Lease.tla``, ``Takeover``): a new master
knows none of the old master's leases, so every object it recovers counts as
leased for one lease TTL plus a margin after it opens (``Remove`` and eviction
refuse it); lease ids carry the term, so a renewal of an older term's lease is
refused instead of extending another lease.

Payload bytes never reach the master: its ROUTER accepts no payload frames.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np
import zmq

from kvproto import errors
from kvproto.runtime import tracing, wire
from kvproto.runtime.allocator import Placer
from kvproto.runtime.tenanted import Losses, Tenants
from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.recovery import IndexColumns, Rebuild
from kvproto.statemachines.publish import (
    AssignRegion, FreeRegion, MasterEvent, PutRevoke, Published, ReadEnd, ReclaimAbandoned,
    Refused, Remove, Removed, RepairCancel, RepairCancelled, RepairStart, RepairStarted,
    Replica, ReplicaListed, Revoked, SegmentLost, Status,
)
from kvproto.runtime.master_requests import ClientSession, MasterRequests, Parked, SegmentInfo
from kvproto.runtime.repairs import PublishTerms, RepairScheduler
from kvproto.statemachines import failover as fm

from kvproto.statemachines import lease as lm

log = logging.getLogger("kvproto.master")

ReplyTo = Any  # opaque: the server's routing identity


class FenceRound:
    """A new master's fence: the nodes the coordinator listed, their answers."""

    __slots__ = ("started", "deadline", "nodes", "infos", "rebuild", "failed")

    def __init__(self, nodes: dict, now: float, timeout: float) -> None:
        self.started = now
        self.deadline = now + timeout
        self.nodes = dict(nodes)                     # segment -> endpoint
        self.infos: dict[str, dict] = {}             # segment -> registration body
        self.rebuild = Rebuild()                     # the indexes, joined as they come
        self.failed: set[str] = set()

    def answered(self) -> bool:
        return len(self.infos) + len(self.failed) >= len(self.nodes)


class Command:
    """A command sent to a storage node (``assign``, ``free``, ``publish``,
    ``fence``, ``purge``); ``id`` is its request id."""

    __slots__ = ("id", "segment", "op", "regions", "parked", "sent_at")

    def __init__(self, cmd_id: int, segment: str, op: str, regions: list,
                 parked: Optional[Parked], sent_at: float) -> None:
        self.id = cmd_id
        self.sent_at = sent_at
        self.segment = segment
        self.op = op
        self.regions = regions
        self.parked = parked


COUNTERS = ("puts_started", "puts_published", "puts_revoked", "reclaimed", "reads", "misses",
            "read_ends", "reads_reclaimed", "removes", "segments_joined", "segments_lost",
            "storage_refusals", "rejected", "refused",
            # read leases (spec/Lease.tla) and the eviction policy
            "lease_grants", "lease_renewals", "lease_renewals_refused", "lease_releases",
            "lease_expiries", "leased_refusals", "removes_forced", "evictions", "eviction_short",
            # failover (spec/Failover.tla)
            "publish_marks", "publish_mark_refusals", "stale_term_refusals", "not_open",
            "abandoned",
            # replicas a takeover left out: their node's index records another
            # checksum than the replica listed (failover.checksum_mismatches)
            "checksum_mismatches",
            # copies of a request delivered twice on one connection (MasterServer)
            "duplicates_dropped",
            # tenancy (spec/Tenancy.tla): requests refused for their credential,
            # objects of retiring namespaces aged out
            "unauthorized", "aged_out",
            # replica repair (spec/Publish.tla RepairStart .. ListReplica): repairs
            # started, listed, cancelled (their copy failed, timed out, or their
            # object or segment went), copier reports refused (a repair no
            # longer in flight), and the bytes of the replicas listed
            "repairs_started", "repairs_listed", "repairs_cancelled", "repairs_failed",
            "repairs_timed_out", "repair_reports_refused", "bytes_repaired")


class MasterCore(MasterRequests):
    """The master's logic without sockets (see the module docstring)."""

    #: bounds on one ``assign``/``free`` command, so it always fits a storage
    #: node's header limit (:data:`~kvproto.runtime.wire.STORAGE_MAX_HEADER`)
    COMMAND_MAX_REGIONS = 1024
    COMMAND_MAX_BYTES = 256 << 10
    #: keys of objects forgotten in bulk (a lost segment's) taken out of the
    #: row index per tick (``Rows.sweep``): a bounded slice of the loop's time
    SWEEP_ROWS = 1 << 15
    #: tenants' accounting of a lost segment's objects: up to this many in
    #: one bulk step (``Tenants.removed_many``, ``TenancyCore.drop_many``,
    #: about a microsecond an object), more a slice per turn of the loop
    TENANT_SLICE = 1 << 15
    #: a lease id is ``term << LEASE_ID_BITS | n``
    LEASE_ID_BITS = 32
    #: on top of one lease TTL, how long a new master keeps what it recovered
    #: as leased (spec ``Takeover``): covers the clock-rate difference between
    #: the old master, the readers and this one over one TTL
    INHERIT_MARGIN_S = 0.1
    INHERIT_MARGIN_FRACTION = 0.02

    def __init__(self, writer_timeout: float = 10.0, storage_timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, *, lease_ttl: float = 5.0,
                 high_watermark: float = 0.90, free_fraction: float = 0.05,
                 fence_timeout: float = 5.0, term: Optional[int] = 1,
                 tenants: Sequence = (), trace: Optional[str] = None,
                 ticket_key: Optional[bytes] = None,
                 repair_rate: float = 256 << 20, max_repairs: int = 4) -> None:
        if writer_timeout <= 0 or storage_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if lease_ttl <= 0:
            raise ValueError("lease_ttl must be positive")
        if not 0 <= free_fraction <= high_watermark <= 1:
            raise ValueError("need 0 <= free_fraction <= high_watermark <= 1")
        #: the directory (spec/Publish.tla), changed only by its ``step``: the
        #: fast core held to ``publish.master_step`` (docs/cores.md)
        self.directory = DirectoryCore()
        #: the lease table (spec/Lease.tla) on the directory's rows, changed only
        #: by its ``step`` (held to ``lease.master_step``); its clock is this
        #: master's clock, fed as ``Tick`` events; it also keeps the eviction
        #: recency (last put, grant, renewal or read)
        self.leases = LeaseCore(float(lease_ttl), rows=self.directory.rows)
        #: with ``trace`` (or $KVPROTO_TRACE): every step of the directory and
        #: of the lease table is recorded as a JSON line, for ``kvproto trace
        #: check`` (runtime/tracing.py)
        trace = trace or os.environ.get(tracing.ENV)
        self.trace: Optional[tracing.Recorder] = tracing.Recorder(trace) if trace else None
        self.high_watermark = float(high_watermark)
        self.free_fraction = float(free_fraction)
        self._next_lease = 1   # re-based on the term in take_term: ids unique across terms
        self._evicting = False
        self.writer_timeout = float(writer_timeout)
        self.storage_timeout = float(storage_timeout)
        self.clock = clock
        self.placer = Placer()
        self.segments: dict[str, SegmentInfo] = {}
        self.sessions: dict[str, ClientSession] = {}
        self._owner: dict[int, str] = {}                  # pending token -> client
        self._commands: dict[int, Command] = {}
        self._next_cmd = 1
        self._queue: list[tuple[str, str, list]] = []     # (segment, op, region) in effect order
        #: (segment, offset) -> token of the regions granted to direct writers
        #: (spec/DirectWrite.tla): freed only when their node says so
        self._direct: dict[tuple[str, int], int] = {}
        #: segment -> offset -> length: regions draining for a direct writer
        #: that may still write them; not free until the node reports them drained
        self.draining: dict[str, dict[int, int]] = defaultdict(dict)
        self._writing: Optional[tuple[str, str]] = None   # (writer, host) of the put being granted
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        #: with a tenants file (``TenantConfig``s): the tenancy machine and its
        #: checks (spec/Tenancy.tla, :mod:`kvproto.runtime.tenanted`); none:
        #: one shared key space, no credentials
        #: and the read tickets it issues under ``ticket_key``
        self.tenants: Optional[Tenants] = (Tenants(tenants, ttl=float(lease_ttl), clock=clock,
                                                   ticket_key=ticket_key)
                                           if tenants else None)
        #: the failover phase machine (spec/Failover.tla), replaced only by
        #: ``failover.master_step``: standby -> fencing -> recovered -> open
        self.failover = fm.Master()
        self.fence_timeout = float(fence_timeout)
        #: which objects below their requested count to repair next, from which
        #: source, how fast (bytes a second per source node) and for how long
        self.repairs = RepairScheduler(repair_rate, max_in_flight=max_repairs,
                                       timeout=3 * self.storage_timeout)
        #: (segment, offset, token) of the publish marks sent for repaired replicas
        self._repair_marks: set[tuple[str, int, int]] = set()
        #: each object's publishing term by its token, sent with a repaired
        #: replica's publish mark (set at each takeover)
        self.publish_terms = PublishTerms()
        #: lost objects whose tenants' accounting is still to be carried
        #: out, in order (a put of one of them carries it out first)
        self._tenant_drops = Losses(self.tenants)
        self._round: Optional[FenceRound] = None
        self.opened_at = 0.0   # when this master last opened (its clock)
        #: the last takeover: term, seconds in each phase, objects recovered/purged
        self.last_failover: dict = {}
        #: ``(segment, op, command_id, body)`` to send, in order (drained by the server)
        self.outbox: list[tuple[str, str, int, dict]] = []
        #: parked replies now complete: ``(reply_to, request_id, status, body)``
        self.ready: list[tuple[ReplyTo, int, int, dict]] = []
        #: storage connections to open ``(segment, endpoint)`` / close ``segment``
        self.opened: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self._next_tick = 0.0
        if term is not None:
            # a master without a coordinator: the only one, at a fixed term
            self.take_term(term, {})

    # ------------------------------------------------------------------ stepping

    def _step(self, event: MasterEvent, report: Optional[dict] = None
              ) -> tuple[Optional[errors.KvError], tuple]:
        """Feed one event; carry out its effects. Refused -> (error, effects), no change.
        ``report``: the copier's report the event is taken on (for the trace)."""
        effects = self.directory.step(event)
        if self.trace is not None:
            self.trace.publish(event, effects, self.directory, report)
        if effects and isinstance(effects[0], Refused):
            self.counters["refused"] += 1
            return effects[0].error, effects
        if effects:
            self._carry_out(effects)
        return None, effects

    def _carry_out(self, effects: tuple) -> None:
        """Carry out accepted effects in order (one handler per effect type;
        a grant, ``PutGranted`` or ``ReadGranted``, is the caller's)."""
        handlers = self._effect_handlers
        for e in effects:
            handler = handlers.get(type(e))
            if handler is not None:
                handler(self, e)

    def _assigned(self, e: AssignRegion) -> None:
        region = [e.offset, e.length, e.key, e.token]
        writing = self._writing
        if writing is not None and self._same_host(e.segment, writing[1]):
            # its writer writes it itself (spec/DirectWrite.tla Grant)
            region.append(writing[0])
            self._direct[(e.segment, e.offset)] = e.token
        self._queue.append((e.segment, "assign", region))

    def _freed(self, e: FreeRegion) -> None:
        if self._direct.get((e.segment, e.offset)) != e.token:
            self.placer.release([Replica(e.segment, e.offset, e.length)])
        # else: free once the node says so; it may drain for its writer first
        self._queue.append((e.segment, "free", [e.offset, e.token, e.length]))

    def _published(self, e: Published) -> None:
        self._forget_pending(e.token)
        self.counters["puts_published"] += 1
        if self.tenants is not None:
            self.tenants.published(e.key)
        length, checksum, requested, placed = self.directory.placed(e.key)
        self._lease_put(e.key, e.token, length * max(len(placed), 1))
        # the storage nodes' index learns the publish (StampedPublish),
        # with the object's checksum and requested replica count, so a
        # new master recovers them
        queue = self._queue
        for segment, offset in placed:
            queue.append((segment, "publish", [offset, e.key, e.token, checksum, requested]))

    def _revoked(self, e: Revoked) -> None:
        self._forget_pending(e.token)
        if self.tenants is not None:
            self.tenants.abandoned(e.key)

    def _repair_started(self, e: RepairStarted) -> None:
        self.counters["repairs_started"] += 1

    def _replica_listed(self, e: ReplicaListed) -> None:
        # listed on its copier's report; its node's index learns the
        # publish, so a new master recovers the replica too
        self.counters["repairs_listed"] += 1
        self.counters["bytes_repaired"] += e.replica.length
        self.repairs.ended(e.repair)
        record = self.directory.objects[e.key]
        self._repair_marks.add((e.replica.segment, e.replica.offset, e.token))
        # a copy of the object's allocation: its node records the object's
        # publishing term, not ours (spec/Failover.tla Repair, RepairedEntry)
        self._queue.append((e.replica.segment, "publish", [
            e.replica.offset, e.key, e.token, record.checksum, record.requested,
            self.publish_terms.of(e.token)]))

    def _repair_cancelled(self, e: RepairCancelled) -> None:
        self.counters["repairs_cancelled"] += 1
        self.repairs.ended(e.repair)
        self.repairs.stale = True

    def _removed(self, e: Removed) -> None:
        self.counters["evictions" if self._evicting else "removes"] += 1
        self._lease_drop(e.key)
        if self.tenants is not None:
            self.tenants.removed(e.key)

    _effect_handlers = {
        AssignRegion: _assigned, FreeRegion: _freed, Published: _published, Revoked: _revoked,
        RepairStarted: _repair_started, ReplicaListed: _replica_listed,
        RepairCancelled: _repair_cancelled, Removed: _removed,
    }

    def _forget_pending(self, token: int) -> None:
        client = self._owner.pop(token, None)
        if client is None:
            return
        session = self.sessions.get(client)
        if session is not None:
            session.tokens.pop(token, None)
            if session.empty():
                del self.sessions[client]

    def _flush(self, parked: Optional[Parked] = None) -> None:
        """Turn queued storage effects into commands, one per run of same-op
        effects per segment, preserving order per segment."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        per_segment: dict[str, list] = {}    # segment -> runs [op, regions, bytes left]
        most, full = self.COMMAND_MAX_REGIONS, self.COMMAND_MAX_BYTES
        for segment, op, region in queue:
            cost = 48 + (len(region[2]) if op == "assign" else len(region[1]) if op == "publish" else 0)
            runs = per_segment.get(segment)
            if runs is None:
                per_segment[segment] = [[op, [region], full - cost]]
                continue
            run = runs[-1]
            if run[0] == op and run[2] >= cost and len(run[1]) < most:
                run[1].append(region)
                run[2] -= cost
            else:
                runs.append([op, [region], full - cost])
        now = self.clock()
        for segment, runs in per_segment.items():
            if segment not in self.segments:
                continue  # lost: nothing to tell
            for op, regions, _ in runs:
                cmd_id = self._next_cmd
                self._next_cmd += 1
                owner = parked if parked is not None and Parked.WAITS_FOR[parked.op] == op else None
                body = {"segment": segment, "regions": regions, "term": self.failover.term}
                if op == "assign" and any(len(r) > 4 for r in regions):
                    body["direct"] = [[r[0], r[4]] for r in regions if len(r) > 4]
                    body["regions"] = regions = [r[:4] for r in regions]
                self._commands[cmd_id] = Command(cmd_id, segment, op, regions, owner, now)
                if owner is not None:
                    owner.waiting.add(cmd_id)
                self.outbox.append((segment, op, cmd_id, body))

    # ------------------------------------------------------------------ leases

    def _lstep(self, event, by: Optional[str] = None,
               tick: bool = True) -> tuple[Optional[errors.KvError], tuple]:
        """Feed the master's clock (``Tick``; not with ``tick=False``, for the
        steps after the first of one object's), then ``event``, to the lease
        machine; commit only an accepted step. ``by``: why the master feeds a
        ``Release`` itself (recorded with ``trace``)."""
        if tick:
            self._ltick()
        effects = self.leases.step(event) if self.trace is None \
            else self.trace.lease(self.leases, event, by)
        if effects and isinstance(effects[0], lm.Refused):
            return effects[0].error, effects
        return None, effects

    def _ltick(self) -> None:
        now = self.clock()
        if now <= self.leases.now:
            return
        effects = self.leases.step(lm.Tick(now)) if self.trace is None \
            else self.trace.lease(self.leases, lm.Tick(now))
        if effects and isinstance(effects[0], lm.Refused):
            return
        self.counters["lease_expiries"] += len(effects)
        if self.tenants is not None:
            for ended in effects:
                self.tenants.release(ended.holder)

    def _lease_put(self, key: bytes, token: int, size: int) -> None:
        """``Put`` the just published object ``key`` (``size`` bytes over its
        replicas) into the lease table, at the time of the request's tick."""
        err, _ = self._lstep(lm.Put(key, (key, token), size), tick=False)
        if err is not None:  # cannot happen while the tables agree
            log.error("lease table refused Put(%r): %s", key, err)

    def _lease_drop(self, key: bytes) -> None:
        """The object is gone from the directory (removed, evicted or lost with
        its segments): end its leases (``Release``; the bytes are gone), stop
        counting it as inherited (``Disown``: a remove or an eviction checked
        that already, an object lost with its segments cannot wait for the
        quiet period) and ``Remove`` it from the lease table, so the two
        tables agree."""
        if key not in self.leases.objects:
            return
        self._ltick()     # once: the steps below are one object's, at one time
        for holder in self.leases.holders(key):
            self._lstep(lm.Release(holder), by="dropped", tick=False)
        if self.leases.is_inherited(key):
            self._lstep(lm.Disown(key), tick=False)
        err, _ = self._lstep(lm.Evict(key) if self._evicting else lm.Remove(key), tick=False)
        if err is not None:
            log.error("lease table refused to drop %r: %s", key, err)

    def _ledger_usage(self) -> tuple[int, int]:
        used = capacity = 0
        for ledger in self.directory.segments.values():
            if ledger.live:
                capacity += ledger.capacity
                used += ledger.capacity - ledger.free
        return used, capacity

    def evict(self) -> int:
        """The eviction policy: past the high watermark of the ledger's used
        space, remove published, unleased objects, least recently used first
        (``plan_eviction``), each through the publish machine's ``Remove``
        after the lease machine accepted its ``Evict``. Returns the count."""
        used, capacity = self._ledger_usage()
        if capacity <= 0 or not lm.over_watermark(used, capacity, self.high_watermark):
            return 0
        self._ltick()
        if self.tenants is None:
            plan = lm.plan_eviction(used, capacity, self.leases.eviction_candidates(), high_watermark=self.high_watermark,
                                    free_fraction=self.free_fraction)
        else:   # FairEviction: only objects of tenants above their reserve
            plan = lm.plan_eviction(used, capacity, self.tenants.fair(self.leases.eviction_candidates()),
                                    high_watermark=self.high_watermark, free_fraction=self.free_fraction)
        done = 0
        for key in plan.keys:
            # the lease machine must agree (Evict refused under a lease) ...
            if self.leases.reclaimable(key) is not None:
                continue
            # ... and, with tenants, FairEviction (never a tenant within its reserve)
            if self.tenants is not None and not self.tenants.may_evict(key):
                continue
            # ... and so must the publish machine (a pinned object is busy)
            self._evicting = True
            try:
                err, _ = self._step(Remove(key))
            finally:
                self._evicting = False
            if err is None:
                done += 1
        if plan.short:
            self.counters["eviction_short"] += 1
        if done:
            log.info("evicted %d object(s): %d of %d bytes used", done, *self._ledger_usage())
        self._flush()
        return done

    def _repair(self) -> None:
        """Start repairs of the objects below their requested count (``RepairStart``)
        within the scheduler's limits (copies in flight, each source node's
        bytes a second); cancel copies not reported in time (``RepairCancel``).
        With tenants, the command carries the source read's ticket, issued to
        the repair reader and expiring with the repair's timeout."""
        sched = self.repairs
        now = self.clock()
        for repair, r in sched.overdue(now):
            self.counters["repairs_timed_out"] += 1
            self._step(RepairCancel(r.key, r.segment, repair))
            sched.ended(repair)
        if sched.room() <= 0 or len(self.segments) < 2:
            return
        if sched.stale:
            sched.rescan(self.directory.below())
        deferred: list = []
        while sched.queue and sched.room() > 0:
            key = sched.queue.popleft()
            record = self.directory.objects.get(key)
            if record is None or record.status is not Status.PUBLISHED or not record.below():
                continue
            sources = [r for r in record.replicas if r.segment in self.segments]
            source = sched.source([r.segment for r in sources], record.length, now)
            if source is None:
                deferred.append(key)     # its sources' buckets are empty: later
                continue
            held = {r.segment for r in record.replicas} | {p.segment for p in record.repairs}
            dst = self.placer.place(record.length, 1, exclude=held)
            if dst is None:
                sched.stale = True       # no live segment without it has room: scan again later
                continue
            err, effects = self._step(RepairStart(key, record.token, dst[0]))
            if err is not None:
                self.placer.release(dst)
                continue
            started, src = effects[0], next(r for r in sources if r.segment == source)
            sched.started(started.repair, key, dst[0].segment, source, record.length, now)
            command = [dst[0].offset, key, record.token, record.length, started.repair,
                       self.segments[source].endpoint, source, src.offset, record.checksum]
            if self.tenants is not None:
                command.append(self.tenants.repair_ticket(source, src.offset, record.token,
                                                          sched.timeout))
            self._queue.append((dst[0].segment, "repair", command))
            if self.directory.objects[key].below():
                deferred.append(key)
        sched.queue.extend(deferred)

    def age_out(self) -> int:
        """Spec ``AgeOut``: remove the unleased objects of retiring namespaces,
        and recovered objects no tenant can reach (``Tenants.recovered``), a
        batch per call; the lease machine must agree, then the publish
        machine's ``Remove``. Returns the count."""
        if self.tenants is None or not (self.tenants.aging or self.tenants.orphans):
            return 0
        self._ltick()
        done = 0
        for key in self.tenants.aged(self.directory.objects.__contains__):
            if key in self.leases.objects and self.leases.reclaimable(key) is not None:
                continue
            err, _ = self._step(Remove(key))
            done += err is None
        if done:
            self.counters["aged_out"] += done
            self._flush()
        return done

    def stats(self) -> dict:
        segments = {}
        for seg, ledger in self.directory.segments.items():
            alloc = self.placer.allocators.get(seg)
            info = self.segments.get(seg)
            segments[seg] = {
                "live": ledger.live, "capacity": ledger.capacity, "free": ledger.free,
                "used": ledger.capacity - ledger.free if ledger.live else 0,
                "allocator_free": alloc.free_bytes if alloc else 0,
                "free_extent_bytes": alloc.free_extent_bytes if alloc else 0,
                # freed, but held for a direct writer that may still write them
                "draining": sum(self.draining.get(seg, {}).values()),
                "endpoint": info.endpoint if info else None,
            }
        used, capacity = self._ledger_usage()
        leases = {"ttl": self.leases.ttl, "held": len(self.leases.leases),
                  "objects": len(self.leases.objects), "used": used, "capacity": capacity,
                  "high_watermark": self.high_watermark, "free_fraction": self.free_fraction}
        failover = {"term": self.failover.term, "phase": self.failover.phase.value,
                    "last": dict(self.last_failover)}
        sched = self.repairs
        repairs = {"in_flight": len(sched.in_flight), "queued": len(sched.queue),
                   "max_in_flight": sched.max_in_flight, "rate": sched.rate,
                   "burst": sched.burst}
        return {"counters": dict(self.counters), "objects": len(self.directory.objects),
                "failover": failover,
                "leases": leases, "repairs": repairs,
                "pending": len(self._owner), "clients": len(self.sessions),
                "next_token": self.directory.next_token, "segments": segments,
                **({"tenants": self.tenants.usage()} if self.tenants is not None else {})}

    # ------------------------------------------------------------------ storage replies

    def storage_reply(self, segment: str, reply: wire.Reply) -> None:
        """A storage node answered command ``reply.request_id``."""
        cmd = self._commands.pop(reply.request_id, None)
        if cmd is None or cmd.segment != segment:
            return
        if reply.status == errors.StaleTerm.code:
            # a newer master fenced this node: step down (HigherTermSeen); a
            # request waiting on this command is answered with the refusal
            self.counters["stale_term_refusals"] += 1
            if cmd.parked is not None:
                refused = wire.error_item(reply.error())
                cmd.parked.items[:] = [refused if item[0] == 0 else item for item in cmd.parked.items]
                self._settle(cmd)
            self.step_down(reply.error())
            return
        if cmd.op in ("fence", "purge"):
            self._fence_or_purge_reply(cmd, reply)
            return
        try:
            if reply.status == errors.SegmentUnavailable.code:
                self.segment_lost(segment, "the node no longer serves it")
                return
            results = reply.body.get("results") if reply.status == 0 else None
            if type(results) is not list or len(results) != len(cmd.regions):
                results = [[reply.status or errors.MalformedFrame.code, "bad reply"]] * len(cmd.regions)
            op, item_result = cmd.op, wire.item_result
            # an accepted assign or publish, while no repaired replica's mark is
            # out, needs nothing but counting
            plain = not self._repair_marks and op in ("assign", "publish")
            if plain and all(type(r) is list and len(r) == 2 and type(r[0]) is int and not r[0]
                             for r in results):
                if op == "publish":
                    self.counters["publish_marks"] += len(results)
                return
            for region, result in zip(cmd.regions, results):
                err, value = item_result(result)
                if plain and err is None:
                    if op == "publish":
                        self.counters["publish_marks"] += 1
                    continue
                if cmd.op == "free" and self._direct.get((segment, region[0])) == region[1]:
                    # a direct writer's region: free, or draining until it reports
                    del self._direct[(segment, region[0])]
                    if err is None and value == "draining":
                        self.draining[segment][region[0]] = region[2]
                    else:
                        self.placer.release([Replica(segment, region[0], region[2])])
                marks = self._repair_marks
                repaired = cmd.op == "publish" and (segment, region[0], region[2]) in marks
                marks.discard((segment, region[0], region[2]))
                if err is None:
                    if cmd.op == "publish":
                        self.counters["publish_marks"] += 1
                    continue
                self.counters["storage_refusals"] += 1
                log.error("segment %s refused %s %r: %s", segment, cmd.op, region, err)
                if repaired:
                    # a repaired replica's mark: the object's other replicas
                    # are recorded, so it stays; a new master would not list
                    # this replica, and repairs it again
                    self.counters["publish_mark_refusals"] += 1
                elif cmd.op == "publish":
                    # not recorded at the node: a new master would not recover
                    # it, so it is not acknowledged, and it is taken back
                    self.counters["publish_mark_refusals"] += 1
                    self._unpublish(cmd.parked, region[1], err)
                if cmd.op == "assign":
                    # the writer's write to that node is refused too (its region
                    # was never assigned), and its put_end is StaleToken
                    self._step(PutRevoke(region[2], region[3]))
                if cmd.op == "repair":
                    # the node would not copy into the region: the repair ends
                    self._step(RepairCancel(region[1], segment, region[4]))
        finally:
            self._settle(cmd)
            self._flush()

    def _unpublish(self, parked: Optional[Parked], key: bytes, err: errors.KvError) -> None:
        """A publish a node refused (e.g. a direct write never reported): the
        writer is told (its item becomes the error) and the object is removed
        again, so that no master lists what no node recorded."""
        if parked is not None and parked.keys is not None and key in parked.keys:
            parked.items[parked.keys.index(key)] = wire.error_item(err)
        self._step(Remove(key))

    def _settle(self, cmd: Command) -> None:
        parked = cmd.parked
        if parked is None:
            return
        parked.waiting.discard(cmd.id)
        if not parked.waiting:
            status, body = self._complete(parked)
            self.ready.append((parked.reply_to, parked.request_id, status, body))

    # ------------------------------------------------------------------ failover

    def take_term(self, term: int, nodes: dict[str, str]) -> None:
        """Spec ``ObtainTerm`` (this master won ``term``), then ``Fence``: send
        ``fence`` to every storage node the coordinator lists (``segment ->
        endpoint``). Each answers with its index; recovery follows when all
        answered or ``fence_timeout`` passed (:meth:`_maybe_recover`). Without
        a coordinator a master takes term 1 with no nodes and opens at once."""
        new, effects = fm.master_step(self.failover, fm.ObtainTerm(term))
        if effects and isinstance(effects[0], fm.Refused):
            raise effects[0].error
        self.failover = new
        # lease ids carry the term: a renewal of an older master's lease id
        # names no lease here (LeaseExpired), never another client's
        self._next_lease = (term << self.LEASE_ID_BITS) + 1
        now = self.clock()
        self._round = FenceRound(nodes, now, self.fence_timeout)
        log.info("term %d: fencing %d storage node(s)", term, len(nodes))
        for segment, endpoint in sorted(nodes.items()):
            self.opened.append((segment, endpoint))
            cmd_id = self._next_cmd
            self._next_cmd += 1
            self._commands[cmd_id] = Command(cmd_id, segment, "fence", [], None, now)
            self.outbox.append((segment, "fence", cmd_id, {"segment": segment, "term": term}))
        self._maybe_recover()

    def _drained_by_purge(self, segment: str, draining) -> None:
        """The purge's answer lists the regions draining at its node after it:
        those the fence answer listed as draining, or as about to drain in the
        purge, that it no longer lists are free again (drained, or freed
        outright: their writer had written or died)."""
        if type(draining) is not list or not all(
                type(d) is list and len(d) == 2 and type(d[0]) is int for d in draining):
            log.error("segment %s: purge reply: draining regions are not [offset, length] "
                      "pairs", segment)
            return
        still = {d[0] for d in draining}
        held = self.draining.get(segment, {})
        for offset in [o for o in held if o not in still]:
            length = held.pop(offset)
            if segment in self.segments:
                self.placer.release([Replica(segment, offset, length)])

    def _fence_or_purge_reply(self, cmd: Command, reply: wire.Reply) -> None:
        segment = cmd.segment
        if cmd.op == "purge":
            if reply.status == 0:
                self.last_failover["purged"] = self.last_failover.get("purged", 0) + reply.body.get("purged", 0)
                self.last_failover["bytes_purged"] = (self.last_failover.get("bytes_purged", 0)
                                                      + reply.body.get("freed", 0))
                if "draining" in reply.body:
                    self._drained_by_purge(segment, reply.body["draining"])
            else:
                log.error("segment %s refused the purge: %s", segment, reply.error())
            return
        rnd = self._round
        if rnd is None or self.failover.phase is not fm.Phase.FENCING or segment not in rnd.nodes:
            return
        try:
            if reply.status != 0:
                raise reply.error()
            info = {k: reply.body[k] for k in ("segment", "capacity", "endpoint", "host", "shm",
                                               "gen_shm", "nonce", "page_size", "next_token")}
            draining = reply.body.get("draining", [])
            if type(draining) is not list or not all(
                    type(d) is list and len(d) == 2 and all(type(x) is int for x in d) for d in draining):
                raise errors.MalformedFrame("fence reply: draining regions are not [offset, length] pairs")
            info["draining"] = draining
            objects = reply.body.get("objects")
            if info["segment"] != segment or type(objects) is not int or objects < 0 \
                    or type(info["next_token"]) is not int or info["next_token"] < 1:
                raise errors.MalformedFrame("fence reply for another segment, without its index "
                                            "or without a next token")
            # decoded and joined (a key listed twice refuses the node) as it comes
            rnd.rebuild.add(segment, IndexColumns.from_frames(reply.payloads, objects))
        except (errors.KvError, KeyError, ValueError, TypeError) as err:
            log.warning("segment %s not fenced (%s): its objects are lost", segment, err)
            rnd.failed.add(segment)
        else:
            self.failover, _ = fm.master_step(self.failover, fm.FenceAcked(segment))
            rnd.infos[segment] = info
        if rnd.answered():
            self._maybe_recover()

    def _maybe_recover(self) -> None:
        """Spec ``Recover`` then ``Open``, once the fence round settled: the
        directory is rebuilt from the fenced nodes' indexes (published objects
        only); a node that did not answer is lost, with its objects; every
        fenced node purges unpublished allocations of older terms (sent before
        any allocation of this term on the same connection)."""
        rnd = self._round
        now = self.clock()
        if rnd is None or self.failover.phase is not fm.Phase.FENCING:
            return
        if not rnd.answered() and now < rnd.deadline:
            return
        self._recover(rnd, now)

    def _recover(self, rnd: FenceRound, now: float) -> None:
        fenced_at, term = now, self.failover.term
        live = frozenset(rnd.infos)
        for segment in set(rnd.nodes) - live:
            self.closed.append(segment)
        for cmd_id, cmd in list(self._commands.items()):
            if cmd.op == "fence":
                del self._commands[cmd_id]
        # the phase machine steps Recover (its effects are the purges); the
        # directory it would rebuild from the indexes (rebuild_directory) is
        # rebuilt on columns by its checked twin, cores.recovery.Rebuild
        new, effects = fm.master_step(self.failover, fm.Recover(live, {}))
        if effects and isinstance(effects[0], fm.Refused):
            raise effects[0].error  # cannot happen: live is exactly the acked nodes
        self.failover = new
        # tokens continue above every token a fenced node's regions ever
        # carried (freed ones included: a same-host reader may still hold one)
        next_token = max((rnd.infos[s]["next_token"] for s in live), default=1)
        mismatches: list = []
        terms: dict = {}
        self.directory = rnd.rebuild.directory({s: rnd.infos[s]["capacity"] for s in live},
                                               next_token, mismatches=mismatches, terms=terms)
        # the recovered objects' publishing terms by token, ours from here on
        self.publish_terms = PublishTerms(term, self.directory.next_token, terms)
        rnd.rebuild = None
        # a replica whose index records another checksum than the one listed
        # is not listed: its region is freed at its node (after the purge,
        # before any assign of this term: one connection)
        frees = [(node, offset, self.directory.objects[key].token,
                  self.directory.objects[key].length) for key, node, offset in mismatches]
        if self.trace is not None:
            self.trace.opened(self.directory, term, frees)
        if mismatches:
            self.counters["checksum_mismatches"] += len(mismatches)
            log.warning("term %d: %d replica(s) left out, their checksum differs from the "
                        "replica listed: %s", term, len(mismatches),
                        ", ".join(f"{key!r} on {node}" for key, node, _ in mismatches[:10]))
            for node, offset, token, length in frees:
                self._queue.append((node, "free", [offset, token, length]))
        used = self.directory.regions()
        # regions still draining for a direct writer of an older term are not free
        self.draining = defaultdict(dict)
        for s in live:
            draining = rnd.infos[s].get("draining", ())
            if draining:
                used[s] = np.concatenate((used[s], np.array(draining, np.int64).reshape(-1, 2)))
            for offset, length in draining:
                self.draining[s][offset] = length
        self.placer = Placer()
        self.repairs.in_flight.clear()   # a new directory has no repairs in flight
        self.repairs.stale = True
        for s in live:
            info = rnd.infos[s]
            self.placer.add(s, info["capacity"], info["page_size"], used[s])
            self.segments[s] = SegmentInfo(info, now)   # seen: at the end of recovery, below
        # the lease table caches every recovered object, with no lease known
        # (spec Takeover): each counts as leased for one TTL and a margin, the
        # longest an old master's lease may still run; all equally recent (ties
        # by row)
        ttl = self.leases.ttl
        self.leases = LeaseCore.inherit(self.directory, ttl, max(self.leases.now, self.clock()),
                                        quiet=ttl * (1 + self.INHERIT_MARGIN_FRACTION)
                                        + self.INHERIT_MARGIN_S)
        if self.tenants is not None:   # each tenant's objects, named by their keys
            self._tenant_drop(len(self._tenant_drops))
            self.tenants.recovered(*self.directory.requested_bytes())
        # a large recovery takes a while: the nodes count as heard from now
        recovered_at = self.clock()
        for s in live:
            self.segments[s].last_seen = recovered_at
        for purge in effects:
            cmd_id = self._next_cmd
            self._next_cmd += 1
            self._commands[cmd_id] = Command(cmd_id, purge.node, "purge", [], None, recovered_at)
            self.outbox.append((purge.node, "purge", cmd_id, {"segment": purge.node, "term": term,
                                                              "below": purge.below}))
        self._flush()      # the frees of replicas left out for their checksum
        self.failover, _ = fm.master_step(self.failover, fm.Open())
        self.opened_at = self.clock()
        lost = sum(1 for s in rnd.nodes if s not in live)
        self.last_failover = {
            "term": term, "fence_s": fenced_at - rnd.started,
            "recover_s": recovered_at - fenced_at, "open_s": self.clock() - rnd.started,
            "nodes_fenced": len(live), "nodes_lost": lost,
            "recovered": len(self.directory.objects), "purged": 0, "bytes_purged": 0,
            "checksum_mismatches": len(mismatches)}
        if rnd.nodes:
            log.info("term %d open: %d object(s) recovered from %d node(s), %d node(s) lost, "
                     "in %.3fs", term, len(self.directory.objects), len(live), lost,
                     self.last_failover["open_s"])
        self._round = None

    def parked(self) -> list[Parked]:
        """The requests still waiting for storage nodes (once each)."""
        return list({id(c.parked): c.parked for c in self._commands.values()
                     if c.parked is not None}.values())

    def step_down(self, why: errors.KvError) -> None:
        """Spec: a master refused for a higher term steps down (``HigherTermSeen``);
        it serves nothing more. The server replaces this core with a standby one."""
        if self.failover.phase is fm.Phase.STANDBY:
            return
        term = self.failover.term
        new, _ = fm.master_step(self.failover, fm.HigherTermSeen(term + 1))
        self.failover = new
        log.warning("term %d: stepping down (%s)", term, why)

    # ------------------------------------------------------------------ time

    def segment_lost(self, segment: str, why: str = "silent") -> None:
        err = self._lose(SegmentLost(segment))
        if err is None:
            self.counters["segments_lost"] += 1
            log.log(logging.INFO if why == "deregistered" else logging.WARNING,
                    "segment %s lost (%s)", segment, why)
        self.placer.drop(segment)
        self.repairs.forget_segment(segment)
        self._repair_marks = {m for m in self._repair_marks if m[0] != segment}
        self.draining.pop(segment, None)
        for where in [w for w in self._direct if w[0] == segment]:
            del self._direct[where]
        if self.segments.pop(segment, None) is not None:
            self.closed.append(segment)
        for cmd_id, cmd in list(self._commands.items()):
            if cmd.segment == segment:
                del self._commands[cmd_id]
                self._settle(cmd)
        self.outbox = [c for c in self.outbox if c[0] != segment]
        self._flush()

    def _lose(self, event: SegmentLost) -> Optional[errors.KvError]:
        """Step the directory with ``event`` and carry out its effects, as
        :meth:`_step` does; the published objects forgotten whole (``Removed``,
        nothing else: :meth:`DirectoryCore.lose`) are carried out in bulk
        (:meth:`_removed_many`). With ``trace``: one by one, each step recorded."""
        if self.trace is not None:
            return self._step(event)[0]
        loss = self.directory.lose(event)
        if loss.refused:
            self.counters["refused"] += 1
            return loss.refused[0].error
        for _, run in loss.runs:
            self._carry_out(run)
        self._removed_many(loss.keys, loss.rows)
        return None

    def _removed_many(self, keys, rows) -> None:
        """:meth:`_removed` of each of ``keys`` (their rows ``rows``), in bulk."""
        if not len(keys):
            return
        self.counters["evictions" if self._evicting else "removes"] += len(keys)
        self._ltick()
        self.leases.drop_many(keys, rows, evicted=self._evicting)
        if self.tenants is not None:
            if len(keys) <= self.TENANT_SLICE and not self._tenant_drops:
                self.tenants.removed_many(keys.tolist())
            else:     # a slice a turn (tick): the loop keeps serving meanwhile
                self._tenant_drops.add(keys)

    def _tenant_drop(self, limit: int) -> None:
        """Carry out the tenants' accounting of up to ``limit`` lost objects
        (one ``Tenants.removed_many``)."""
        self._tenant_drops.carry_out(limit)

    def tick(self) -> None:
        """Expire silent clients and storage nodes (cheap when nothing is due);
        carry out a slice of the tenants' accounting of lost objects (each turn)."""
        if self._tenant_drops:
            self._tenant_drop(self.TENANT_SLICE)
        if self.failover.phase is not fm.Phase.OPEN:
            self._maybe_recover()
            return
        now = self.clock()
        if now < self._next_tick:
            return
        self._next_tick = now + min(self.writer_timeout, self.storage_timeout) / 8
        self.directory.rows.sweep(self.SWEEP_ROWS)
        for client, session in list(self.sessions.items()):
            lapsed = [(token, key) for token, (key, seen) in session.tokens.items()
                      if now - seen > self.writer_timeout]
            if lapsed:
                log.warning("client %s: %d put attempt(s) not refreshed for %.1fs: reclaiming",
                            client, len(lapsed), self.writer_timeout)
            for token, key in lapsed:
                err, _ = self._step(ReclaimAbandoned(key, token))
                if err is None:
                    self.counters["reclaimed"] += 1
                self._forget_pending(token)
            if now - session.last_seen <= self.writer_timeout:
                continue
            if session.pins:
                log.warning("client %s silent for %.1fs: ending %d pin(s)",
                            client, now - session.last_seen, len(session.pins))
            for (key, token), n in list(session.pins.items()):
                for _ in range(n):
                    err, _ = self._step(ReadEnd(key, token))
                    if err is None:
                        self.counters["reads_reclaimed"] += 1
            session.pins.clear()
            if session.empty():
                self.sessions.pop(client, None)
        for segment, info in list(self.segments.items()):
            if now - info.last_seen > self.storage_timeout:
                self.segment_lost(segment, f"silent for {now - info.last_seen:.1f}s")
        # a node that heartbeats but leaves a command unanswered is broken too
        # (and a parked grant must not wait forever)
        late = {c.segment for c in self._commands.values() if now - c.sent_at > self.storage_timeout}
        for segment in late:
            if segment in self.segments:
                self.segment_lost(segment, "a command went unanswered")
        self._ltick()
        self.evict()
        self.age_out()
        self._repair()
        self._flush()


class _Renewer:
    """Renews an active master's leadership every ``ttl/4`` from its own
    thread, and is the only user of the coordinator while the term lasts.
    ``renewed`` is the start of the last successful renewal (the lease runs
    from there); ``ended`` is set once the coordinator refused a renewal. A
    paused process pauses this thread too, so a woken master finds
    ``renewed`` too old and steps down. ``serving()`` says whether the
    master's loop is making progress (or recovering): a wedged loop is not
    renewed for, so its lease runs out and a standby takes over."""

    def __init__(self, coordinator, term: int, now: float, serving: Callable[[], bool]) -> None:
        self.coordinator = coordinator
        self.serving = serving
        self.term = term
        self.renewed = now
        self.ended = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvproto-lease-{term}")
        self._thread.start()

    def _run(self) -> None:
        every = self.coordinator.ttl / 4
        while not self._stop.wait(every):
            started = time.monotonic()
            if not self.serving():
                log.error("term %d: the master's loop is stuck; letting the lease run out", self.term)
                continue
            try:
                if not self.coordinator.keepalive(self.term):
                    self.ended = True
                    return
            except errors.KvError as err:   # unreachable: the lease runs out unless it answers
                log.warning("coordinator: %s", err)
                continue
            self.renewed = started

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.coordinator.ttl, 1.0) * 2)


class MasterServer:
    """The master's ZeroMQ loop around a :class:`MasterCore` (one thread).

    Construct it in the thread that will run :meth:`serve_forever`; ``address``
    is the bound endpoint (``tcp://127.0.0.1:*`` picks a free port).
    """

    #: how many messages to take from one socket before looking at the others
    BURST = 256
    #: how long a request id is remembered per connection: a copy of a request
    #: arriving within it is not served again (see :meth:`_duplicate`)
    DUPLICATE_WINDOW_S = 30.0

    def __init__(self, listen: str = "tcp://127.0.0.1:*", *, writer_timeout: float = 10.0,
                 storage_timeout: float = 10.0, max_header_bytes: int = wire.MASTER_MAX_HEADER,
                 context: Optional[zmq.Context] = None, lease_ttl: float = 5.0,
                 high_watermark: float = 0.90, free_fraction: float = 0.05,
                 coordinator=None, advertise: Optional[str] = None,
                 fence_timeout: float = 5.0, tenants: Sequence = (),
                 trace: Optional[str] = None, ticket_key: Optional[bytes] = None,
                 repair_rate: float = 256 << 20, max_repairs: int = 4) -> None:
        #: with a coordinator (which the server then owns and closes) this
        #: master campaigns, takes the term it wins, renews it, and steps down
        #: (a fresh standby core) when it cannot
        self.coordinator = coordinator
        self._core_args = dict(writer_timeout=writer_timeout, storage_timeout=storage_timeout,
                               lease_ttl=lease_ttl, high_watermark=high_watermark,
                               free_fraction=free_fraction, fence_timeout=fence_timeout,
                               tenants=tuple(tenants), trace=trace, ticket_key=ticket_key,
                               repair_rate=repair_rate, max_repairs=max_repairs)
        self.core = MasterCore(**self._core_args, term=None if coordinator is not None else 1)
        self._term = 0                 # the term this process holds (0: standby)
        self._renewer: Optional[_Renewer] = None
        self._turned = time.monotonic()   # the serving loop's last turn
        self._next_lead = 0.0
        self._waiting_for: Optional[tuple[int, str]] = None   # the leader a standby last named
        self.terms_held: list[int] = []
        self.max_header_bytes = max_header_bytes
        self._own_context = context is None
        self.ctx = context or zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.sndhwm = 100_000  # replies are small; a ROUTER drops beyond this
        # frames a little over the limit still get a typed FrameTooLarge; far
        # larger ones make ZeroMQ drop the peer before buffering them
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * max_header_bytes + (1 << 20))
        self.router.bind(listen)
        self.address: str = advertise or self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.dealers: dict[str, zmq.Socket] = {}
        self._segment_of: dict[zmq.Socket, str] = {}
        self._stopping = False  # a plain flag: stop() takes no lock (signal-handler safe)
        #: (connection, request id) -> when it arrived, for the duplicate filter
        self._seen: dict[tuple[bytes, int], float] = {}
        self._seen_pruned = time.monotonic()
        #: ``observe(op, seconds)`` after each request is handled (metrics; None: off)
        self.observe: Optional[Callable[[str, float], None]] = None

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stopping = True

    def serve_forever(self, poll_ms: int = 20) -> None:
        try:
            while not self._stopping:
                try:
                    self._once(poll_ms)
                except Exception:  # a bug: log it, keep serving
                    log.exception("master loop")
        finally:
            self.close()

    def _lead(self) -> None:
        """Coordinator duty, before any request is served. A standby campaigns
        every ``ttl/4``; on winning it starts a :class:`_Renewer` thread and
        fences. The active master steps down when the coordinator ended its
        term, or when its leadership was not renewed for a whole ``ttl`` (the
        process was paused or cut off: on waking it serves nothing before
        stepping down). Renewing from a thread keeps the lease while the loop
        is busy for longer than ``ttl`` (recovering a large directory)."""
        coord = self.coordinator
        if coord is None:
            return
        now = time.monotonic()
        if self._term:
            if not self._held():
                self._step_down(self._why_not_held())
            return
        if now < self._next_lead:
            return
        self._next_lead = now + coord.ttl / 4
        try:
            term = coord.campaign(self.address)
            if term is None:
                self._waiting(coord.leader())
                return
            nodes = coord.nodes()
        except errors.KvError as err:
            log.warning("coordinator: %s", err)
            return
        self._term = term
        self.terms_held.append(term)
        self._renewer = _Renewer(coord, term, now, self._serving)
        log.info("won term %d at %s", term, self.address)
        self.core.take_term(term, nodes)

    def _waiting(self, leader: Optional[tuple[int, str]]) -> None:
        """A standby says once per leader that it waits, and for whom."""
        if leader is not None and leader != self._waiting_for:
            log.info("standby at %s: waiting while term %d is held by %s", self.address, *leader)
        self._waiting_for = leader

    #: seconds without a turn of the serving loop (outside a recovery) after
    #: which the master stops renewing its leadership
    STUCK_AFTER = 10.0
    #: the term counts as held while the last successful renewal started less
    #: than this fraction of the coordinator's TTL ago (the coordinator's lease
    #: runs a whole TTL from when it received the renewal, later still); the
    #: rest is the margin against the two clocks drifting apart
    HELD_FRACTION = 0.9

    def _held(self) -> bool:
        """Whether this master provably still holds its term (always, without
        a coordinator). Checked before a request is handled and before every
        reply: a master woken from a pause answers nothing but ``MasterNotOpen``."""
        if self.coordinator is None:
            return True
        renewer = self._renewer
        return bool(self._term) and not renewer.ended and \
            time.monotonic() - renewer.renewed < self.HELD_FRACTION * self.coordinator.ttl

    def _why_not_held(self) -> str:
        renewer = self._renewer
        if renewer.ended:
            return f"the coordinator ended term {self._term}"
        return (f"leadership of term {self._term} not renewed for "
                f"{time.monotonic() - renewer.renewed:.1f}s")

    def _serving(self) -> bool:
        """Whether the loop turned recently, or is recovering (one long step)."""
        core = self.core
        last = max(self._turned, core.opened_at)   # a recovery ends inside one turn
        return core.failover.phase in (fm.Phase.FENCING, fm.Phase.RECOVERED) \
            or time.monotonic() - last < max(self.STUCK_AFTER, 4 * self.coordinator.ttl)

    def _step_down(self, why: str) -> None:
        """Answer every parked request ``MasterNotOpen``, drop the core and
        its storage connections, and wait as a standby."""
        core = self.core
        core.step_down(errors.MasterNotOpen(why))
        log.warning("stepping down: %s", why)
        for p in core.parked():
            self._send_reply(p.reply_to, p.request_id, errors.MasterNotOpen.code, {"message": why})
        for segment in list(self.dealers):
            sock = self.dealers.pop(segment)
            self.poller.unregister(sock)
            self._segment_of.pop(sock, None)
            sock.close(linger=0)
        if self.coordinator is not None and self._term:
            self._renewer.stop()
            try:
                self.coordinator.resign(self._term)
            except errors.KvError:
                pass
        self._term = 0
        self._next_lead = time.monotonic() + (self.coordinator.ttl if self.coordinator else 0)
        self.core = MasterCore(**self._core_args, term=None)

    def _once(self, poll_ms: int) -> None:
        self._turned = time.monotonic()
        self._lead()
        events = dict(self.poller.poll(poll_ms))
        if events.get(self.router):
            self._drain_router()
        for sock in [s for s in events if s is not self.router]:
            segment = self._segment_of.get(sock)
            if segment is not None:
                self._drain_dealer(sock, segment)
        self.core.tick()
        self._send_out()
        if self._term and self.core.failover.phase is fm.Phase.STANDBY:
            self._step_down("a storage node refused this master's term")

    def _drain_router(self) -> None:
        for frames in wire.waiting(self.router, self.BURST):
            self._on_request(frames)
            self._send_out()

    def _on_request(self, frames: list) -> None:
        identity = frames[0].bytes
        if self._term and not self._held():
            self._step_down(self._why_not_held())
        try:
            req = wire.decode_request(frames[1:], self.max_header_bytes, 0, wire.MASTER_OPS)
        except errors.KvError as err:
            self.core.counters["rejected"] += 1
            self._reply(identity, getattr(err, "request_id", 0), err.code, {"message": err.message})
            return
        if self._duplicate(identity, req):
            return
        observe = self.observe
        started = time.perf_counter() if observe is not None else 0.0
        try:
            result = self.core.handle(req.op, req.body, identity, req.request_id)
        except errors.KvError as err:
            result = (err.code, {"message": err.message})
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("master failed on %s", req.op)
            err = errors.InternalError(f"{req.op}: {exc.__class__.__name__}: {exc}")
            result = (err.code, {"message": err.message})
        if observe is not None:
            observe(req.op, time.perf_counter() - started)
        if result is not None:
            # sent by _send_out after the commands this request queued: a grant
            # leaves after the assigns its writer's writes need
            self.core.ready.append((identity, req.request_id, *result))

    def _duplicate(self, identity: bytes, req: wire.Request) -> bool:
        """Whether ``req`` is a copy of a request already served on this
        connection: a request id names one request on its connection (the
        client numbers its requests, a retry included, afresh), so a second
        frame with the same id is a copy the network delivered twice. Serving
        it would apply a ``remove`` or ``put_start`` again, possibly to a later
        generation of the key; it is answered ``DuplicateRequest`` (which the
        client, done with that id, ignores) and counted. Ids 0 (requests that
        want no reply) and ``stats`` are not filtered."""
        if req.request_id == 0 or req.op == "stats":
            return False
        now = time.monotonic()
        seen = self._seen
        if (identity, req.request_id) in seen:
            self.core.counters["duplicates_dropped"] += 1
            err = errors.DuplicateRequest(f"request id {req.request_id} was already used on "
                                          f"this connection ({req.op})")
            self._send_reply(identity, req.request_id, err.code, {"message": err.message})
            return True
        seen[(identity, req.request_id)] = now
        if now - self._seen_pruned > self.DUPLICATE_WINDOW_S / 2:
            self._seen_pruned = now
            cutoff = now - self.DUPLICATE_WINDOW_S
            self._seen = {k: t for k, t in seen.items() if t >= cutoff}
        return False

    def _reply(self, identity: bytes, request_id: int, status: int, body: dict) -> None:
        """Answer, but only while the term is provably held: otherwise step down
        and answer ``MasterNotOpen`` (what was done may not be acknowledged)."""
        if self._term and not self._held():
            why = self._why_not_held()
            self._step_down(why)
            status, body = errors.MasterNotOpen.code, {"message": why}
        self._send_reply(identity, request_id, status, body)

    def _send_reply(self, identity: bytes, request_id: int, status: int, body: dict) -> None:
        try:
            self.router.send_multipart([identity, wire.encode_reply(request_id, status, body)],
                                       flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone or its queue full: the reply is dropped
            pass

    def _drain_dealer(self, sock: zmq.Socket, segment: str) -> None:
        for frames in wire.waiting(sock, self.BURST):
            try:
                reply = wire.decode_reply(frames)
            except errors.KvError as err:
                log.error("bad reply from segment %s: %s", segment, err)
                continue
            self.core.storage_reply(segment, reply)
            if segment not in self.dealers:
                return

    def _send_out(self) -> None:
        core = self.core
        opened, core.opened = core.opened, []
        for segment, endpoint in opened:
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 0  # commands are never dropped or blocked on
            sock.rcvhwm = 0
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                log.error("cannot connect to segment %s at %s: %s", segment, endpoint, exc)
                core.segment_lost(segment, "unreachable endpoint")
                continue
            self.dealers[segment] = sock
            self._segment_of[sock] = segment
            self.poller.register(sock, zmq.POLLIN)
        for segment, op, cmd_id, body in core.outbox:
            sock = self.dealers.get(segment)
            if sock is not None:
                sock.send(wire.encode_request(op, cmd_id, body))
        core.outbox.clear()
        for reply_to, request_id, status, body in core.ready:
            self._reply(reply_to, request_id, status, body)
        core.ready.clear()
        for segment in core.closed:
            sock = self.dealers.pop(segment, None)
            if sock is not None:
                self.poller.unregister(sock)
                self._segment_of.pop(sock, None)
                sock.close(linger=0)
        core.closed.clear()

    def close(self) -> None:
        if self.core.trace is not None:
            self.core.trace.close()
        if self.coordinator is not None:
            if self._term:
                self._renewer.stop()
                try:
                    self.coordinator.resign(self._term)
                except errors.KvError:
                    pass
            self.coordinator.close()
        for sock in list(self.dealers.values()):
            sock.close(linger=0)
        self.dealers.clear()
        self._segment_of.clear()
        if not self.router.closed:
            self.router.close(linger=0)
        if self._own_context:
            self.ctx.term()
