"""The master's read handlers (:class:`MasterReads`, a part of
:class:`~kvproto.runtime.master.MasterCore` beside
:class:`~kvproto.runtime.master_requests.MasterRequests`): ``read_begin``,
``read_end``, the lease requests ``renew`` and ``release``, and ``exists``.
Each becomes steps of the directory (``ReadBegin``, ``ReadEnd``) and the lease
table (``Grant``, ``Renew``, ``Release``). A batched ``read_begin`` takes the
cores' batch steps where it may, one key at a time otherwise (with tenants or
a trace), with the same replies and state either way
(``tests/runtime/test_master_batches.py``).
"""

from __future__ import annotations

import logging

from kvproto import errors
from kvproto.cores.leases import Refusal
from kvproto.runtime import wire
from kvproto.statemachines import lease as lm
from kvproto.statemachines.publish import ReadBegin, ReadEnd

log = logging.getLogger("kvproto.master")


class MasterReads:
    """The read handlers of :class:`~kvproto.runtime.master.MasterCore`; they
    use its state, its stepping and :meth:`~kvproto.runtime.master_requests.
    MasterRequests._session`."""

    def _op_read_begin(self, body, reply_to, request_id):
        """A read: ``ReadBegin`` (only a published object is readable; its
        effect is the descriptors). Without ``lease`` the read is pinned until
        ``read_end`` (publish). With ``lease`` the lease replaces the pin: the
        pin is ended in the same request (``ReadEnd``; the spec allows it at any
        time) and the lease machine grants (``Grant``) a time-bounded lease, which
        ``Remove`` and eviction respect and the reader checks after the transfer."""
        client = body["client"]
        leased = body.get("lease", False)
        if body.get("release"):
            self._release(client, body["release"])
        session = self._session(client, create=True)
        # one tick for the request: each grant expires at its time plus the
        # TTL, which is after the reader sent it (what the reader's check
        # counts from), so no later than a tick per key would make it
        self._ltick()
        columns = {"errors": [], "token": [], "length": [], "checksum": [], "replicas": [],
                   "segment": [], "offset": []}
        if leased:
            columns["lease"], columns["ttl"] = [], self.leases.ttl
        if self._batched():
            segments = self._read_batch(body["keys"], client, leased, session, columns)
        else:
            segments = self._read_items(body, client, leased, session, columns)
        if session.empty():
            del self.sessions[client]
        reply = {"columns": columns} if body.get("columns") else {"items": wire.read_items(columns)}
        reply.update(segments=segments, heartbeat=self.writer_timeout / 4, term=self.failover.term)
        return 0, reply

    def _read_items(self, body, client, leased, session, columns) -> dict:
        """The reads of :meth:`_op_read_begin` one key at a time, into the
        reply's ``columns`` (:data:`~kvproto.runtime.wire.READ_COLUMNS`);
        returns the segments they name."""
        segments: dict = {}
        tenants, step, counters, touch = self.tenants, self._step, self.counters, self.leases.touch
        infos = self.segments
        refused, tokens, lengths, sums = (columns["errors"], columns["token"], columns["length"],
                                          columns["checksum"])
        counts, segs, offsets, lease_ids = (columns["replicas"], columns["segment"],
                                            columns["offset"], columns.get("lease"))
        if tenants is not None:
            columns["tickets"] = []

        def refuse(i, err):
            refused.append([i, *err.to_wire()])
            for column in (tokens, lengths, sums, counts, lease_ids, columns.get("tickets")):
                if column is not None:
                    column.append([] if column is columns.get("tickets") else 0)

        for i, key in enumerate(body["keys"]):
            read = None
            if tenants is not None:
                # spec Begin before ReadBegin: the grant, the object in the
                # read's own namespace, the in-flight quota (a pinned read is
                # checked, not counted in flight)
                try:
                    read = tenants.begin((client, self._next_lease), body["tenant"], key)
                except errors.KvError as err:
                    self.counters["misses" if isinstance(err, errors.KeyNotFound) else "refused"] += 1
                    refuse(i, err)
                    continue
            err, effects = step(ReadBegin(key))
            if err is not None:
                counters["misses" if isinstance(err, errors.KeyNotFound) else "refused"] += 1
                refuse(i, err)
                continue
            grant = effects[0]
            counters["reads"] += 1
            if not leased:
                touch(key)      # a leased read's Grant marks it used itself
            replicas = grant.replicas
            if tenants is not None:   # one per replica, for the nodes (NodeAdmits)
                tickets = tenants.read_tickets(body["tenant"], grant.token, grant.replicas)
            if leased:
                step(ReadEnd(key, grant.token))
                lease_id = self._next_lease
                lerr, leffects = self._lstep(lm.Grant((client, lease_id), key), tick=False)
                if lerr is not None:   # the tables disagree: a bug; answer it typed
                    touch(key)
                    log.error("lease grant of %r refused: %s", key, lerr)
                    refuse(i, lerr)
                    continue
                self._next_lease += 1
                counters["lease_grants"] += 1
                if read is not None:
                    tenants.commit(read)
                lease_ids.append(lease_id)
            else:
                pin = (key, grant.token)
                session.pins[pin] = session.pins.get(pin, 0) + 1
            if tenants is not None:
                columns["tickets"].append(tickets)
            tokens.append(grant.token)
            lengths.append(grant.length)
            sums.append(grant.checksum or 0)
            counts.append(len(replicas))
            for r in replicas:
                segs.append(r.segment)
                offsets.append(r.offset)
                if r.segment not in segments:
                    info = infos.get(r.segment)
                    if info is not None:
                        segments[r.segment] = info.wire()
        return segments

    def _read_batch(self, keys, client, leased, session, columns) -> dict:
        """:meth:`_read_items` with the cores' batch steps: the directory's
        ``read_many`` (a leased read's pin ended at once; its columns are the
        reply's) and the lease table's ``grant_many``. Lease ids are taken in
        order by the reads granted (a grant the lease table refuses, which
        the tables' agreement rules out, leaves its id unused)."""
        got = self.directory.read_many(keys, pin=not leased)
        refused = got.refused
        hits = keys if not refused else [keys[i] for i in range(len(keys))
                                         if i not in dict(refused)]
        counters = self.counters
        counters["reads"] += len(hits)
        counters["misses"] += len(refused)
        counters["refused"] += len(refused)
        columns.update(token=got.token, length=got.length, checksum=got.checksum,
                       replicas=got.replicas, segment=got.segment, offset=got.offset)
        if leased:
            leases, first = self.leases, self._next_lease
            ids = range(first, first + len(hits))
            grants = leases.grant_many(zip([(client, n) for n in ids], hits))
            self._next_lease = first + len(hits)
            if refused:
                ids, lost = iter(ids), dict(refused)
                columns["lease"] = [0 if i in lost else next(ids) for i in range(len(keys))]
            else:
                columns["lease"] = list(ids)
            # the leases granted share one expiry; anything else is a refusal
            refusals = len(grants) - grants.count(leases.now + leases.ttl)
            if refusals:
                # a grant refused: the tables disagree, a bug; answer it typed
                refused = list(refused)
                at = (i for i, lease in enumerate(columns["lease"]) if lease)
                for i, granted in zip(list(at), grants):
                    if isinstance(granted, errors.KvError):
                        self.leases.touch(keys[i])
                        log.error("lease grant of %r refused: %s", keys[i], granted)
                        refused.append((i, granted))
                        _drop_read(columns, i)
                refused.sort(key=lambda r: r[0])
            counters["lease_grants"] += len(grants) - refusals
        else:
            touch, pins, lost = self.leases.touch, session.pins, dict(refused)
            for i, (key, token) in enumerate(zip(keys, got.token)):
                if i not in lost:
                    touch(key)
                    pin = (key, token)
                    pins[pin] = pins.get(pin, 0) + 1
        columns["errors"] = [[i, *err.to_wire()] for i, err in refused]
        infos = self.segments
        return {segment: infos[segment].wire() for segment in dict.fromkeys(got.segment)
                if segment in infos}

    def _op_read_end(self, body, reply_to, request_id):
        client = body["client"]
        session = self._session(client)
        items = []
        for key, token in body["items"]:
            pin = (key, token)
            held = session.pins.get(pin, 0) if session is not None else 0
            if not held:
                # Not a pin this client holds (already reclaimed): feeding ReadEnd
                # would unpin some other reader's read.
                items.append(wire.error_item(errors.StaleToken(f"no read of {key!r} with token {token}")))
                continue
            if held == 1:
                del session.pins[pin]
            else:
                session.pins[pin] = held - 1
            err, _ = self._step(ReadEnd(key, token))
            self.counters["read_ends"] += 1
            items.append(wire.ok_item() if err is None else wire.error_item(err))
        if session is not None and session.empty():
            del self.sessions[client]
        return 0, {"items": items}

    def _op_renew(self, body, reply_to, request_id):
        client, items = body["client"], []
        self._ltick()     # once: every renewal runs from the request's time
        for lease_id in body["leases"]:
            renewal = None
            if self.tenants is not None:
                # spec Renew: a revoked grant's lease is not renewed
                try:
                    renewal = self.tenants.renew((client, lease_id), body["tenant"])
                except errors.KvError as err:
                    self.counters["lease_renewals_refused"] += 1
                    items.append(wire.error_item(err))
                    continue
            err, effects = self._lstep(lm.Renew((client, lease_id)), tick=False)
            renewed = {"ttl": self.leases.ttl}
            if err is None and renewal is not None:
                self.tenants.commit(renewal)
                renewed["tickets"] = self.tenants.renewed_tickets((client, lease_id),
                                                                  self.directory.objects)
            if err is None:
                self.counters["lease_renewals"] += 1
                items.append(wire.ok_item(renewed))
            else:
                self.counters["lease_renewals_refused"] += 1
                items.append(wire.error_item(err))
        return 0, {"items": items}

    def _op_release(self, body, reply_to, request_id):
        ok = wire.ok_item()        # one item for every release accepted
        return 0, {"items": [ok if err is None else wire.error_item(err)
                             for err in self._release(body["client"], body["leases"])]}

    def _release(self, client, lease_ids) -> list:
        """``Release`` of each of ``client``'s leases: per lease None, or the
        error its step is refused with."""
        self._ltick()     # once: the releases are at the request's time
        if self._batched():
            leases = self.leases
            held = len(leases.leases)
            results = leases.release_many([(client, lease_id) for lease_id in lease_ids])
            released = held - len(leases.leases)
            self.counters["lease_releases"] += released
            if released == len(results):
                return [None] * released
            return [None if type(r) is not Refusal else r.error for r in results]
        out = []
        for lease_id in lease_ids:
            err, _ = self._lstep(lm.Release((client, lease_id)), tick=False)
            if err is None:
                self.counters["lease_releases"] += 1
                if self.tenants is not None:
                    self.tenants.release((client, lease_id))
            out.append(err)
        return out

    def _op_exists(self, body, reply_to, request_id):
        """Which keys name a published object (a read of the directory; nothing
        changes): one byte per key if asked with ``found``, else an item each."""
        found = self.directory.published_many(body["keys"])
        if body.get("found"):
            return 0, {"found": found}
        return 0, {"items": [[0, bool(b)] for b in found]}


def _drop_read(columns: dict, i: int) -> None:
    """Answer key ``i`` of a ``read_begin``'s columns as refused: its token,
    length, checksum and lease 0, its replicas none."""
    at, n = sum(columns["replicas"][:i]), columns["replicas"][i]
    del columns["segment"][at:at + n], columns["offset"][at:at + n]
    for name in ("token", "length", "checksum", "replicas", "lease"):
        columns[name][i] = 0
