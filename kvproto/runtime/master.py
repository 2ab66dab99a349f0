"""The master: one directory and one lease table, changed only by stepping them.

They are the fast cores :class:`~kvproto.cores.directory.DirectoryCore` and
:class:`~kvproto.cores.leases.LeaseCore` (mutable, columnar), held to the frozen
reference machines :func:`~kvproto.statemachines.publish.master_step` and
:func:`~kvproto.statemachines.lease.master_step` by the conformance graphs and
a differential test (docs/cores.md).

Split in parts:

* :class:`MasterCore` — no sockets. It owns the directory, the allocators
  (:class:`~kvproto.runtime.allocator.Placer`), the registered storage nodes and
  the client sessions. Each request becomes machine events; the effects the
  machine returns are carried out: ``AssignRegion``/``FreeRegion`` become
  commands for the storage nodes (queued in effect order in :attr:`MasterCore.outbox`),
  ``FreeRegion`` also returns the region to the allocator, ``PutGranted``/
  ``Published``/``Revoked`` maintain the session bookkeeping, and ``Refused``
  answers the requester with its typed error and changes nothing. Its request
  handlers are in :mod:`kvproto.runtime.master_requests` and
  :mod:`kvproto.runtime.master_reads`, its takeover (fence,
  recover, purge) in :mod:`kvproto.runtime.master_takeover`, the records it
  keeps in :mod:`kvproto.runtime.master_records`.
* :class:`~kvproto.runtime.master_server.MasterServer` — the single-threaded
  ZeroMQ loop around it (:mod:`kvproto.runtime.master_server`).

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
the client is told the change failed; the server answers nothing but
``MasterNotOpen`` once it cannot prove that it still holds its term
(:mod:`kvproto.runtime.master_server`). A takeover's leases: see
:mod:`kvproto.runtime.master_takeover`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

from kvproto import errors
from kvproto.runtime import tracing, wire
from kvproto.runtime.allocator import Placer
from kvproto.runtime.tenanted import Losses, Tenants
from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.statemachines.publish import (
    AssignRegion, FreeRegion, MasterEvent, PutRevoke, Published, ReadEnd, ReclaimAbandoned,
    Refused, Remove, Removed, RepairCancel, RepairCancelled, RepairStart, RepairStarted,
    Replica, ReplicaListed, Revoked, SegmentLost, Status,
)
from kvproto.runtime.master_records import ClientSession, Command, Parked, ReplyTo, SegmentInfo
from kvproto.runtime.master_reads import MasterReads
from kvproto.runtime.master_requests import MasterRequests
from kvproto.runtime.master_takeover import FenceRound, MasterTakeover
from kvproto.runtime.repairs import PublishTerms, RepairScheduler
from kvproto.statemachines import failover as fm

from kvproto.statemachines import lease as lm

log = logging.getLogger("kvproto.master")


#: a full row of an ``assign`` and a ``publish`` as columns, each field's value
#: where a row leaves it out (no direct writer; no checksum, requested count
#: or publishing term)
_FILL = {"assign": [0, 0, b"", 0, ""], "publish": [0, b"", 0, 0, 0, 0]}


def _columns(rows: list, fill: list) -> list:
    """A command's ``rows`` as columns, one per field of ``fill``, a row's
    trailing fields left out taken from ``fill``."""
    widths = set(map(len, rows))
    if len(widths) > 1:
        rows = [r + fill[len(r):] for r in rows]
    columns = list(map(list, zip(*rows)))
    return columns + [[f] * len(rows) for f in fill[len(columns):]]


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


class MasterCore(MasterRequests, MasterReads, MasterTakeover):
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
        self._forget_pending((e.token,))
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
        self._forget_pending((e.token,))
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

    def _forget_pending(self, tokens) -> None:
        """The put attempts ``tokens`` (published or revoked) leave their
        clients' sessions; a session left empty goes."""
        owner_of, sessions, touched = self._owner.pop, self.sessions, {}
        for token in tokens:
            client = owner_of(token, None)
            session = sessions.get(client) if client is not None else None
            if session is not None:
                session.tokens.pop(token, None)
                touched[client] = session
        for client, session in touched.items():
            if session.empty():
                del sessions[client]

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
            info = self.segments.get(segment)
            if info is None:
                continue  # lost: nothing to tell
            for op, regions, _ in runs:
                cmd_id = self._next_cmd
                self._next_cmd += 1
                owner = parked if parked is not None and Parked.WAITS_FOR[parked.op] == op else None
                if info.columns and op in _FILL:
                    # one list per field: the node judges each list at once,
                    # and answers a count when it accepts every region
                    body = {"segment": segment, "columns": _columns(regions, _FILL[op]),
                            "term": self.failover.term, "tally": True}
                else:
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
            every = results is None and reply.status == 0 and \
                type(accepted := reply.body.get("accepted")) is int and accepted == len(cmd.regions)
            if every:       # the node accepted every region (asked with ``tally``)
                results = [wire.ok_item()] * accepted
            elif type(results) is not list or len(results) != len(cmd.regions):
                results = [[reply.status or errors.MalformedFrame.code, "bad reply"]] * len(cmd.regions)
            op, item_result = cmd.op, wire.item_result
            # an accepted assign or publish, while no repaired replica's mark is
            # out, needs nothing but counting
            plain = not self._repair_marks and op in ("assign", "publish")
            if plain and (every or all(type(r) is list and len(r) == 2 and type(r[0]) is int
                                       and not r[0] for r in results)):
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

    def parked(self) -> list[Parked]:
        """The requests still waiting for storage nodes (once each)."""
        return list({id(c.parked): c.parked for c in self._commands.values()
                     if c.parked is not None}.values())

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
                self._forget_pending((token,))
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
