"""The master's request handlers: each client or storage-node request becomes
steps of the directory and the lease table (:class:`MasterRequests`, a part
of :class:`~kvproto.runtime.master.MasterCore`); the records they keep per
storage node, per client and per reply waiting for the nodes are in
:mod:`kvproto.runtime.master_records`.

The reads (``read_begin``, ``read_end``, ``renew``, ``release``, ``exists``)
are in :mod:`kvproto.runtime.master_reads`. A batched request (``put_start``,
``put_end``, ``remove``) is handled with the cores' batch steps
(:meth:`~kvproto.cores.directory.DirectoryCore.put_start_many` and the
others, each the fold of the single steps, held to the reference machines by
the differential test): the request's checks and the clock tick once per
request, no effect object per key, the storage commands built per node from
the results. With tenants or a trace the same request is handled one key at a
time, each key's steps as the spec takes them (tenancy checks interleave with
them; a trace records every step); the two paths give the same replies, the
same state and the same commands in the same order
(``tests/runtime/test_master_batches.py``).
"""

from __future__ import annotations

import functools
import heapq
import logging
import re
from typing import Optional

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.allocator import Region
from kvproto.runtime.master_records import ClientSession, Parked, ReplyTo, SegmentInfo
from kvproto.statemachines import failover as fm, lease as lm
from kvproto.statemachines.publish import (
    AddSegment, ListReplica, PutEnd, PutRevoke, PutStart, Remove,
    RepairCancel, Replica, Status,
)

log = logging.getLogger("kvproto.master")

_ENDPOINT = re.compile(r"^(tcp://\S+:\d{1,5}|ipc://\S+)$")


class MasterRequests:
    """The request handlers of :class:`~kvproto.runtime.master.MasterCore`
    (``handle`` and one ``_op_<request>`` each); they use its state and its
    stepping (``_step``, ``_lstep``, ``_ltick``, ``_flush``)."""

    #: batched requests take the cores' batch steps where they may
    #: (:meth:`_batched`); off, every request is handled one key at a time
    batched = True

    def _session(self, client: str, create: bool = False) -> Optional[ClientSession]:
        session = self.sessions.get(client)
        now = self.clock()
        if session is None and create:
            session = self.sessions[client] = ClientSession(now)
        if session is not None:
            session.last_seen = now
        return session


    # ------------------------------------------------------------------ requests

    def handle(self, op: str, body: dict, reply_to: ReplyTo = None,
               request_id: int = 0) -> Optional[tuple[int, dict]]:
        """Handle a validated request. Returns ``(status, body)``, or ``None`` when
        the reply is parked (it will appear in :attr:`ready`)."""
        try:
            if self.tenants is not None:
                try:
                    body = self.tenants.admit(op, body)
                except errors.Unauthorized:
                    self.counters["unauthorized"] += 1
                    raise
            elif body.get("ns", "default") != "default" or op in wire.TENANT_OPS:
                raise errors.InvalidArgument("this master has no tenants (kvproto master "
                                             "--tenants FILE): no namespaces nor grants")
            if self.failover.phase is not fm.Phase.OPEN and op != "stats":
                self.counters["not_open"] += 1
                raise errors.MasterNotOpen(f"master is {self.failover.phase.value} "
                                           f"(term {self.failover.term})")
            handler = getattr(self, "_op_" + op)
            return handler(body, reply_to, request_id)
        finally:
            self._flush()

    def _op_register(self, body, reply_to, request_id):
        page, capacity = body["page_size"], body["capacity"]
        if page & (page - 1) or page < 512:
            raise errors.InvalidArgument("page_size must be a power of two >= 512")
        if capacity % page:
            raise errors.InvalidArgument("capacity must be a multiple of page_size")
        if not _ENDPOINT.match(body["endpoint"]):
            raise errors.InvalidArgument(f"endpoint {body['endpoint']!r} is not tcp://host:port or ipc://path")
        known = self.segments.get(body["segment"])
        if known is not None and known.endpoint == body["endpoint"] and known.nonce == body["nonce"]:
            # a node this master fenced and recovered, now following it
            known.last_seen = self.clock()
            return 0, {"heartbeat": self.storage_timeout / 4, "term": self.failover.term}
        if body.get("held", 0):
            # a segment this master did not recover (it fenced it out, or never
            # listed it) counts as lost with its bytes (spec NodeLost): it must
            # not join with what it holds, or those objects (removed ones too)
            # would come back at the next takeover. The node starts over empty.
            raise errors.SegmentUnavailable(
                f"segment {body['segment']!r} holds {body['held']} allocation(s) this master did "
                "not recover; it must start over empty")
        err, _ = self._step(AddSegment(body["segment"], capacity))
        if err is not None:
            raise err
        info = SegmentInfo(body, self.clock())
        self.segments[info.segment] = info
        self.placer.add(info.segment, capacity, page)
        self.opened.append((info.segment, info.endpoint))
        self.counters["segments_joined"] += 1
        log.info("segment %s joined: %d bytes at %s", info.segment, capacity, info.endpoint)
        return 0, {"heartbeat": self.storage_timeout / 4, "term": self.failover.term}

    def _op_storage_heartbeat(self, body, reply_to, request_id):
        info = self.segments.get(body["segment"])
        if info is None:
            raise errors.SegmentUnavailable(f"segment {body['segment']!r} is not live")
        info.last_seen = self.clock()
        return 0, {}

    def _op_storage_drained(self, body, reply_to, request_id):
        """Regions that drained for their direct writer (spec/DirectWrite.tla
        ``Drain``): free again."""
        draining = self.draining.get(body["segment"], {})
        for offset in body["offsets"]:
            length = draining.pop(offset, None)
            if length is not None and body["segment"] in self.segments:
                self.placer.release([Replica(body["segment"], offset, length)])
        return 0, {}

    def _op_repair_done(self, body, reply_to, request_id):
        """A repair copier's report (runtime/copier.py): ``ListReplica``, or
        ``RepairCancel`` when its copy failed. A report of a repair no longer
        in flight is refused (``StaleToken``) and changes nothing."""
        key, segment, repair = body["key"], body["segment"], body["repair"]
        if "error" in body:
            err, _ = self._step(RepairCancel(key, segment, repair),
                                {"copied": False, "error": body["error"][0]})
            self.counters["repairs_failed"] += err is None
        else:
            err, _ = self._step(ListReplica(key, segment, repair), {"copied": True})
        if err is not None:
            self.counters["repair_reports_refused"] += 1
            raise err
        self._repair()     # its slot is free: the next repair need not wait for a tick
        return 0, {}

    def _op_deregister(self, body, reply_to, request_id):
        if body["segment"] not in self.segments:
            raise errors.SegmentUnavailable(f"segment {body['segment']!r} is not live")
        self.segment_lost(body["segment"], "deregistered")
        return 0, {}

    def _op_heartbeat(self, body, reply_to, request_id):
        """The client is alive (its pins stay); the attempts it lists in
        ``tokens`` are still being written (each one's deadline restarts)."""
        session = self._session(body["client"])
        if session is not None:
            self._refresh(session, body.get("tokens", ()))
        return 0, {"known": session is not None}

    def _refresh(self, session: ClientSession, tokens) -> None:
        now = self.clock()
        for token in tokens:
            attempt = session.tokens.get(token)
            if attempt is not None:
                attempt[1] = now

    def _same_host(self, segment: str, host: str) -> bool:
        info = self.segments.get(segment)
        return info is not None and info.host == host

    def _op_put_start(self, body, reply_to, request_id):
        """``PutStart`` per item. With ``writer`` and ``host``, a replica on a
        segment of the client's host is granted to it as a direct writer
        (spec/DirectWrite.tla): the grant lists those segments in ``direct``.
        The grants are gathered as columns (:data:`~kvproto.runtime.wire.PUT_COLUMNS`),
        sent as they are when asked with ``columns``, else as items."""
        client, replicas = body["client"], body["replicas"]
        grants, session = {"token": [0] * len(body["items"]), "errors": [], "segment": [],
                           "offset": [], "direct": bytearray()}, self._session(client, create=True)
        self._writing = (body["writer"], body["host"]) if "writer" in body and "host" in body else None
        try:
            fill = self._put_start_batch if self._batched() else self._put_start_items
            fill(body, client, replicas, grants, session)
        finally:
            self._writing = None
        if session.empty():
            del self.sessions[client]
        self._flush()     # a put_start does not wait for its assigns' acks
        grants["direct"] = bytes(grants["direct"])
        segments = {seg: info.wire() for seg in set(grants["segment"])
                    if (info := self.segments.get(seg)) is not None}
        return 0, {**({"columns": grants} if body.get("columns") else
                      {"items": wire.put_items(grants, body["items"], replicas)}),
                   "segments": segments, "heartbeat": self.writer_timeout / 4,
                   "term": self.failover.term}

    def _put_start_items(self, body, client, replicas, grants, session) -> None:
        tenants, now, direct_of = self.tenants, self.clock(), self._direct.get
        refused, granted_tokens = grants["errors"], grants["token"]
        place, step, owner, tokens = self.placer.place, self._step, self._owner, session.tokens
        counters = self.counters
        for i, (key, length) in enumerate(body["items"]):
            write = None
            if tenants is not None:
                if self._tenant_drops:    # lost, its accounting owed: carried out first
                    self._tenant_drops.settle(key, self.directory.objects)
                # the quotas are checked before the allocation (spec WriteStart;
                # Tenancy_Weak_QuotaAfterAllocation); committed with PutStart
                try:
                    write = tenants.write_start(body["tenant"], key, length * replicas)
                except errors.KvError as err:
                    refused.append([i, *err.to_wire()])
                    continue
            placement = place(length, replicas)
            if placement is None:
                refused.append([i, *self._unplaced(key, length, replicas).to_wire()])
                continue
            err, effects = step(PutStart(key, length, placement))
            if err is not None:
                self.placer.release(placement)
                refused.append([i, *err.to_wire()])
                continue
            grant = effects[0]
            if write is not None:
                tenants.commit(write)
            counters["puts_started"] += 1
            token = grant.token
            tokens[token] = [key, now]
            owner[token] = client
            granted_tokens[i] = token
            for r in grant.replicas:
                grants["segment"].append(r.segment)
                grants["offset"].append(r.offset)
                grants["direct"].append(direct_of((r.segment, r.offset)) == token)

    def _put_start_batch(self, body, client, replicas, grants, session) -> None:
        """:meth:`_put_start_items` with the directory's batch step
        (``put_start_many``): each key placed, then stepped, a refused
        placement given back before the next key is placed; the assigns
        queued as the effects' ``AssignRegion`` would be, in order."""
        now, place, release, owner, tokens = (self.clock(), self.placer.place,
                                              self.placer.release, self._owner, session.tokens)
        taken: list = []
        refused = grants["errors"]

        def placed():
            for i, (key, length) in enumerate(body["items"]):
                placement = place(length, replicas, (), Region)
                if placement is None:
                    refused.append([i, *self._unplaced(key, length, replicas).to_wire()])
                    continue
                item = (key, length, placement)
                taken.append((i, item))
                yield item

        results = self.directory.put_start_many(placed(), lambda item: release(item[2]))
        writing, direct, queue, started = self._writing, self._direct, self._queue, 0
        # a direct writer writes its replicas on its own host's segments
        # itself (spec/DirectWrite.tla Grant)
        near = {s for s, info in self.segments.items() if info.host == writing[1]} \
            if writing is not None else ()
        append, assign = queue.append, "assign"
        granted, segments, offsets, mine = (grants["token"], grants["segment"], grants["offset"],
                                            grants["direct"])
        for (i, (key, length, placement)), token in zip(taken, results):
            if type(token) is not int:
                refused.append([i, *token.to_wire()])
                continue
            started += 1
            tokens[token] = [key, now]
            owner[token] = client
            granted[i] = token
            for r in placement:
                segment, offset = r.segment, r.offset
                segments.append(segment)
                offsets.append(offset)
                if segment in near:
                    direct[(segment, offset)] = token
                    append((segment, assign, [offset, length, key, token, writing[0]]))
                    mine.append(1)
                else:
                    append((segment, assign, [offset, length, key, token]))
                    mine.append(0)
        refused.sort()     # in the request's order, as the single steps refuse
        self.counters["puts_started"] += started
        self.counters["refused"] += len(taken) - started

    def _unplaced(self, key, length: int, replicas: int) -> errors.KvError:
        """Why no placement: the allocator refuses before the machine sees
        anything, so name the error the machine would have given for a taken key."""
        live = len(self.segments)
        if key in self.directory.objects:
            return errors.KeyExists(f"key {key!r} exists or is being put")
        if not live:
            return errors.NoStorage("no storage node has registered with this master")
        if replicas > live:
            return errors.NoSpace(f"{replicas} replicas need {replicas} live storage nodes; "
                                  f"only {live} registered")
        return errors.NoSpace(f"no {replicas} live segment(s) can hold {length} bytes")

    def _batched(self) -> bool:
        """Whether a batched request takes the cores' batch steps (not with
        tenants, whose checks interleave with each key's steps, nor while
        every step is traced)."""
        return self.batched and self.tenants is None and self.trace is None

    def _complete(self, parked: Parked) -> tuple[int, dict]:
        if parked.columns:     # a put_end asked with ``columns``: its refused keys by index
            return 0, {"errors": [[i, *item] for i, item in enumerate(parked.items) if item[0]]}
        return 0, {"items": parked.items}

    def _end_or_revoke(self, body, event_type):
        """``PutEnd`` or ``PutRevoke`` per ``[key, token]`` item (a put_end's
        item may add the object's checksum)."""
        session = self._session(body["client"])
        if session is not None:
            self._refresh(session, [item[1] for item in body["items"]])
        self._ltick()     # once: a publish's lease Put is at the request's time
        if event_type is PutEnd and self._batched():
            return 0, {"items": self._put_end_batch(body["items"])}
        items = []
        for key, token, *checksum in body["items"]:
            err, _ = self._step(event_type(key, token, *checksum))
            if err is None and event_type is PutRevoke:
                self.counters["puts_revoked"] += 1
            items.append(wire.ok_item() if err is None else wire.error_item(err))
        return 0, {"items": items}

    def _put_end_batch(self, given: list) -> list:
        """``PutEnd`` of each ``[key, token, checksum?]`` with the directory's
        batch step (``put_end_many``); each publish carried out as its
        ``Published`` effect is, in bulk: the lease table's ``Put``
        (``put_many``), the publish marks queued in order. The reply's items."""
        ends = given if all(len(item) == 3 for item in given) else \
            [(key, token, checksum[0] if checksum else 0) for key, token, *checksum in given]
        results = self.directory.put_end_many(ends)
        items, puts, queue = [], [], self._queue
        append, publish = queue.append, "publish"
        for (key, token, _), r in zip(ends, results):
            if type(r) is not tuple:
                items.append(wire.error_item(r))
                continue
            length, checksum, requested, placed = r
            puts.append((key, (key, token), length * (len(placed) or 1)))
            # the storage nodes' index learns the publish (StampedPublish)
            for segment, offset in placed:
                append((segment, publish, [offset, key, token, checksum, requested]))
            items.append([0, None])
        self._forget_pending([holder[1] for _, holder, _ in puts])
        self.counters["puts_published"] += len(puts)
        self.counters["refused"] += len(ends) - len(puts)
        for (key, _, _), err in zip(puts, self.leases.put_many(puts)):
            if err is not None:   # cannot happen while the tables agree
                log.error("lease table refused Put(%r): %s", key, err)
        return items

    def _op_put_end(self, body, reply_to, request_id):
        """``PutEnd``; the reply waits until every replica's node has recorded
        the publish in its index (``publish``), so a published object survives
        a failover."""
        _, ended = self._end_or_revoke(body, PutEnd)
        parked = Parked(reply_to, request_id, ended["items"], "put_end")
        parked.keys = [item[0] for item in body["items"]]
        parked.columns = body.get("columns", False)
        self._flush(parked)
        self.evict()
        if parked.waiting:
            return None
        return self._complete(parked)

    def _op_put_revoke(self, body, reply_to, request_id):
        return self._end_or_revoke(body, PutRevoke)

    def _op_put_abandon(self, body, reply_to, request_id):
        """``PutRevoke`` of this client's own pending attempt on each key, by
        the token the master holds for it: for a client whose ``put_start``
        failed before it learned its tokens (e.g. it timed out), so that its
        retry is not refused with ``KeyExists`` until the attempt lapses. A key
        with no pending attempt of this client gets ``StaleToken``."""
        client, items = body["client"], []
        session = self._session(client)
        mine = {key: token for token, (key, _) in session.tokens.items()} if session else {}
        for key in body["keys"]:
            token = mine.get(key)
            if token is None:
                items.append(wire.error_item(errors.StaleToken(
                    f"{client} has no pending attempt on {key!r}")))
                continue
            err, _ = self._step(PutRevoke(key, token))
            if err is None:
                self.counters["abandoned"] += 1
            items.append(wire.ok_item() if err is None else wire.error_item(err))
        return 0, {"items": items}

    def _op_list(self, body, reply_to, request_id):
        """Published keys in key order (a read of the directory; nothing changes):
        those after ``after`` that start with ``prefix``, at most ``limit``, and
        whether more follow."""
        prefix, after, limit = body.get("prefix", b""), body.get("after", b""), body["limit"]
        keys = heapq.nsmallest(limit + 1, (
            k for k, record in self.directory.objects.items()
            if record.status is Status.PUBLISHED and k > after and k.startswith(prefix)))
        more = len(keys) > limit
        keys = keys[:limit]
        if self.tenants is not None:   # in the tenant's own words
            keys = self.tenants.strip(body["namespace"], keys)
        return 0, {"keys": keys, "more": more}

    def _op_remove(self, body, reply_to, request_id):
        """``Remove``: the lease machine first (``ObjectLeased`` under an
        unexpired lease, or while an object recovered at a takeover may still
        be leased by the old master), then the publish machine. ``force``
        (operators) ends the object's leases (``Release``, and ``Disown`` of an
        inherited one) first, and is logged. The reply waits until every
        replica's node recorded the free under this term (spec ``Remove``)."""
        force = body.get("force", False)
        if self._batched() and not force:
            items = self._remove_batch(body["keys"])
        else:
            items = self._remove_items(body["keys"], body, force)
        parked = Parked(reply_to, request_id, items, "remove")
        self._flush(parked)
        if parked.waiting:
            return None
        return self._complete(parked)

    def _remove_items(self, keys, body, force: bool) -> list:
        """The removes of :meth:`_op_remove` one key at a time: the reply's items."""
        items = []
        for key in keys:
            self._ltick()
            if self.tenants is not None:
                # spec Remove by the owner, before the lease machine's
                try:
                    self.tenants.may_remove(body["tenant"], key, force)
                except errors.KvError as err:
                    items.append(wire.error_item(err))
                    continue
            if key in self.leases.objects:
                err = self.leases.reclaimable(key)
                if err is not None:
                    if not force or not isinstance(err, errors.ObjectLeased):
                        self.counters["leased_refusals"] += 1
                        items.append(wire.error_item(err))
                        continue
                    log.warning("forced remove of %r ends %d unexpired lease(s)%s",
                                key, len(self.leases.holders(key)),
                                " and the previous master's" if self.leases.is_inherited(key) else "")
                    for holder in self.leases.holders(key):
                        self._lstep(lm.Release(holder), by="forced")
                        if self.tenants is not None:
                            self.tenants.release(holder)
                    self._lstep(lm.Disown(key))
                    self.counters["removes_forced"] += 1
            err, _ = self._step(Remove(key))
            items.append(wire.ok_item() if err is None else wire.error_item(err))
        return items

    def _remove_batch(self, keys) -> list:
        """:meth:`_remove_items` with the cores' batch steps: the lease table
        asked first for each key, the directory's ``remove_many`` of the
        others, each removal carried out as its effects are (``Removed``: the
        lease table's ``drop_many``, one step for all; ``FreeRegion``: the
        region back to the allocator unless a direct writer's, and a ``free``
        queued; ``RepairCancelled``: the repair ended). No key, no tick of the
        lease clock, as one key at a time."""
        if not keys:
            return []
        self._ltick()
        leases, counters = self.leases, self.counters
        cached, reclaimable = leases.objects, leases.reclaimable
        items: list = [None] * len(keys)
        asked, taken = [], []
        for i, key in enumerate(keys):
            if key in cached:
                err = reclaimable(key)
                if err is not None:
                    counters["leased_refusals"] += 1
                    items[i] = wire.error_item(err)
                    continue
            asked.append(i)
            taken.append(key)
        queue, direct, free, gone = self._queue, self._direct, self.placer.free, []
        for i, key, r in zip(asked, taken, self.directory.remove_many(taken)):
            if type(r) is not tuple:
                items[i] = wire.error_item(r)
                continue
            token, length, freed, repairs = r
            gone.append(key)
            for segment, offset, rid, was in repairs:
                counters["repairs_cancelled"] += 1
                self.repairs.ended(rid)
                self.repairs.stale = True
                if was:
                    freed.append((segment, offset))
            for segment, offset in freed:
                if direct.get((segment, offset)) != token:
                    free(segment, offset, length)
                queue.append((segment, "free", [offset, token, length]))
            items[i] = [0, None]
        counters["refused"] += len(taken) - len(gone)
        counters["evictions" if self._evicting else "removes"] += len(gone)
        if gone:
            leases.drop_many(gone, evicted=self._evicting)
        return items

    def _op_stats(self, body, reply_to, request_id):
        stats = self.stats()
        if self.tenants is not None:   # a tenant sees its own usage only
            stats["tenants"] = self.tenants.usage(body["tenant"])
        return 0, stats

    def _op_grant(self, body, reply_to, request_id):
        """Spec ``GrantRead`` by the namespace's owner (a tenants file only)."""
        self.tenants.grant(body)
        return 0, {}

    def _op_revoke(self, body, reply_to, request_id):
        """Spec ``RevokeRead``: the grantee's next read or renewal is refused;
        a read already granted ends with its lease."""
        self.tenants.grant(body, revoke=True)
        return 0, {}

    def _op_ns_create(self, body, reply_to, request_id):
        """Spec ``Create``: a canary namespace next to the owner's live one."""
        self.tenants.create(body)
        return 0, {}

    def _lifecycle(self, op, body, reply_to=None, request_id=0):
        """Spec ``PreWarm``, ``Switch``, ``RouteBack`` or ``Drop`` by the
        namespace's owner. ``RouteBack`` abandons the namespace's writes in
        progress: each pending attempt is revoked (``PutRevoke``, mirrored as
        ``WriteAbort``) before the step is committed. A namespace that retires
        ages out (:meth:`age_out`)."""
        event = self.tenants.lifecycle(op, body)
        if op == "ns_route_back":
            prefix = self.tenants.prefix(event.ns)
            for key, record in list(self.directory.objects.items()):
                if record.status is Status.PENDING and key.startswith(prefix):
                    self._step(PutRevoke(key, record.token))
        self.tenants.advance(event)
        self.age_out()
        return 0, {}

    _op_ns_prewarm = functools.partialmethod(_lifecycle, "ns_prewarm")
    _op_ns_switch = functools.partialmethod(_lifecycle, "ns_switch")
    _op_ns_route_back = functools.partialmethod(_lifecycle, "ns_route_back")
    _op_ns_drop = functools.partialmethod(_lifecycle, "ns_drop")

    def _op_ns_list(self, body, reply_to, request_id):
        return 0, {"namespaces": self.tenants.namespaces(body["tenant"])}
