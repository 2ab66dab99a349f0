"""A storage node's process: :class:`StorageServer`, the single-threaded ZeroMQ
loop around a :class:`~kvproto.runtime.storage.StorageCore` (the node's logic,
no sockets); test-only faults are described on it. Its sockets:

* one ROUTER (``endpoint``) serves clients (``write``, ``read``, ``load``,
  ``cancel``, ``stats``) and
  the master's control DEALER (``assign``, ``free``). The master sends its
  commands on one connection, so they are applied in the master's order;
* one DEALER to the master for ``register``, ``storage_heartbeat`` and
  ``deregister``.

Registration: the node picks a fresh segment id, registers it, and heartbeats
every ``heartbeat`` seconds (the master says how often). If the master answers
a heartbeat (or a command) with ``SegmentUnavailable`` — it declared the segment
lost, or it restarted — the node *starts over*: new segment id, empty region
table, new nonce in the generation table; its old bytes are gone as far as the
protocol is concerned, exactly as ``SegmentLost`` says. An unanswered
``register`` is retried the same way after ``register_timeout`` (and logged,
naming the master's address). A register refused for good — the master finds
the registration itself invalid (``InvalidArgument``, a malformed or
unsupported frame), so every retry would be refused the same way — stops the
node: :attr:`StorageServer.refused` holds the reason and ``serve_forever``
returns. ``on_registered`` (if set) is called each time the node registers.

Tracing: with ``trace=FILE`` (``kvproto storage --trace FILE``), or with
``KVPROTO_TRACE`` naming the master's file (then the node's is
:func:`~kvproto.runtime.tracing.node_path` of it), every step of the node's
core is recorded as a JSON line (:class:`~kvproto.runtime.tracing.StorageRecorder`),
for ``kvproto trace merge``; off, a step pays one ``if``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from kvproto import errors
from kvproto.ops.tenants import REPAIR_READER, Credentials, Tickets
from kvproto.runtime import tracing, wire
from kvproto.runtime.copier import Copier
from kvproto.runtime.endpoints import check_listen, check_master, coordinator_url
from kvproto.runtime.shm import SegmentMemory
from kvproto.runtime.storage import StorageCore
from kvproto.runtime.units import parse_size

log = logging.getLogger("kvproto.storage")

_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)

#: a register refused with one of these is refused for good: the node stops
PERMANENT_REFUSALS = (errors.InvalidArgument, errors.MalformedFrame, errors.UnsupportedVersion,
                      errors.UnknownMessage, errors.FrameTooLarge)


def new_segment_id() -> str:
    return f"{socket.gethostname()[:40]}:{os.getpid()}:{secrets.token_hex(4)}"


class StorageServer:
    """A storage node's ZeroMQ loop (construct it in the thread that serves).

    Test-only faults (all 0, i.e. off, by default; set them through the
    ``debug`` op, which only a node built with ``debug=True`` accepts, or, in an
    embedded cluster, by assigning ``server.faults[name]``):

    * ``delay_ms``: hold every tracked data-path request (``load``, tracked
      ``write``) this long before it runs. The transfer is *running* meanwhile,
      so a ``cancel`` (never delayed) stops it: it then never lands.
    * ``reply_delay_ms``: hold data replies (``load``/``write`` answers) this
      long after the transfer ran: it *landed*, the bytes are late on the
      network, and a cancel acknowledgement (not delayed) can overtake them.
    * ``read_delay_ms``: hold replies to plain network ``read`` requests this
      long (the bytes are snapshotted when the read ran, as with
      ``reply_delay_ms``): a read slower than its lease, for the lease tests.
    * ``drop``: drop the next N data replies.
    * ``duplicate``: send the next N data replies twice, the copy
      ``duplicate_delay_ms`` after the original.
    """

    BURST = 64
    #: how long a write waits for its region's ``assign`` (StorageCore.awaits_assign)
    #: before it is judged (and refused, if the assign never came), and how
    #: many may wait at once
    ASSIGN_WAIT = 2.0
    MAX_AWAITING = 4096
    #: the master's commands: not a tenant's, carrying no tenant credential
    CONTROL_OPS = frozenset({"assign", "free", "publish", "fence", "purge", "repair"})
    #: the reads a tenant makes only under its read ticket (a node with tenants)
    TICKET_OPS = frozenset({"read", "load"})
    FAULTS = ("delay_ms", "reply_delay_ms", "drop", "duplicate", "duplicate_delay_ms",
              "read_delay_ms")

    def __init__(self, master: str, size: "int | str", *, listen: str = "tcp://127.0.0.1:*",
                 advertise: Optional[str] = None, page_size: int = 4096,
                 max_header_bytes: int = wire.STORAGE_MAX_HEADER, register_timeout: float = 2.0,
                 context: Optional[zmq.Context] = None, debug: bool = False,
                 tenants: Sequence = (), ticket_key: Optional[bytes] = None,
                 trace: Optional[str] = None) -> None:
        if tenants and not ticket_key:
            raise errors.InvalidArgument("a storage node with tenants needs the ticket key its "
                                         "master issues read tickets under (--ticket-key FILE)")
        if type(page_size) is not int or page_size < 512 or page_size & (page_size - 1):
            raise errors.InvalidArgument(f"page size {page_size!r} is not a power of two >= 512")
        try:
            capacity = parse_size(size) // page_size * page_size
        except ValueError as e:
            raise errors.InvalidArgument(f"segment size: {e}") from None
        if capacity <= 0:
            raise errors.InvalidArgument(f"segment size {size!r} is smaller than a page "
                                         f"({page_size} bytes)")
        check_master(master)
        check_listen(listen)
        if advertise is not None and coordinator_url(check_master(advertise)):
            raise errors.InvalidArgument(f"advertise {advertise!r}: use tcp://host:port or ipc://path")
        #: where the master is: a fixed ``tcp://``/``ipc://`` address, or a
        #: coordinator URL (``file://``, ``etcd://``) through which the node
        #: registers itself and follows the current master
        self.coordinator = None
        if coordinator_url(master):
            from kvproto.runtime.coordinator import connect
            self.coordinator = connect(master)
            self.master = None
        else:
            self.master = master
        self._next_coord = 0.0
        self.max_header_bytes = max_header_bytes
        self.register_timeout = register_timeout
        if trace is None and os.environ.get(tracing.ENV):
            trace = tracing.node_path(os.environ[tracing.ENV])
        recorder = tracing.StorageRecorder(trace) if trace else None
        self.memory = SegmentMemory(capacity, page_size)
        self.core = StorageCore(self.memory, new_segment_id())
        if recorder is not None:
            self.core.record_to(recorder)
        self._own_context = context is None
        self.ctx = context or zmq.Context()
        try:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.linger = 0
            self.router.rcvhwm = 256  # back-pressure writers through TCP
            self.router.sndhwm = 0    # never drop a reply (read payloads are views, not copies)
            self.router.setsockopt(zmq.MAXMSGSIZE, capacity + max_header_bytes)
            self.router.bind(listen)
        except BaseException:
            self.memory.close()
            raise
        bound = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.endpoint = advertise or bound.replace("0.0.0.0", socket.gethostname())
        self.core.endpoint = self.endpoint
        self.dealer: Optional[zmq.Socket] = None
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.registered = threading.Event()
        #: the master's refusal that stopped this node (see the module docstring)
        self.refused: Optional[errors.KvError] = None
        #: called with this server each time it registers with a master
        self.on_registered: Optional[Callable[["StorageServer"], None]] = None
        self.heartbeat = 1.0
        self._next_rid = 1
        self._register_rid: Optional[int] = None
        self._register_sent = 0.0
        self._next_heartbeat = 0.0
        self._retry_at = 0.0
        self._backoff = 0.1
        self._stopping = False  # a plain flag: stop() takes no lock (signal-handler safe)
        # test-only fault injection (see Faults); the ``debug`` op exists only with debug=True
        self.debug = debug
        self.ops = {**wire.STORAGE_OPS, **wire.DEBUG_OPS} if debug else wire.STORAGE_OPS
        #: with a tenants file: the tenants' credentials (digests only); every
        #: request but the master's commands (``CONTROL_OPS``) must carry one,
        #: and a ``read`` or ``load`` the requesting tenant's read ticket for
        #: that location, under the ticket key the master shares (spec/Tenancy.tla
        #: ``NodeAdmits``)
        self.credentials: Optional[Credentials] = Credentials(tenants) if tenants else None
        self.tickets: Optional[Tickets] = Tickets(ticket_key) if tenants else None
        self.faults = dict.fromkeys(self.FAULTS, 0)
        self._held: list = []      # (due, seq, identity, request): delayed data-path requests
        self._outq: list = []      # (due, seq, frames): delayed data replies
        self._awaiting: list = []  # (due, identity, request): writes before their assign
        self._seq = itertools.count()
        #: ``observe(op, seconds)`` after each request is served (metrics; None: off)
        self.observe = None
        #: pulls the repair copies the master asks for (runtime/copier.py)
        self.copier = Copier(self.ctx, self.poller)

    @property
    def segment(self) -> str:
        return self.core.segment

    # ------------------------------------------------------------------ master link

    def _connect_master(self) -> None:
        if self.dealer is not None:
            self.poller.unregister(self.dealer)
            self.dealer.close(linger=0)
            self.dealer = None
        if self.master is None:
            return
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.linger = 0
        self.dealer.connect(self.master)
        self.poller.register(self.dealer, zmq.POLLIN)

    def _to_master(self, op: str, body: dict) -> int:
        rid = self._next_rid
        self._next_rid += 1
        if self.dealer is None:
            return rid  # no master known yet: the timers retry
        try:
            self.dealer.send(wire.encode_request(op, rid, body), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # queue full (master away): the timers retry
        return rid

    def _register(self) -> None:
        self.registered.clear()
        self._register_rid = self._to_master("register", self.core.registration())
        self._register_sent = time.monotonic()

    def _follow(self) -> None:
        """With a coordinator: keep this node's membership fresh, and connect
        (keeping the segment) to a new master once the coordinator names one."""
        now = time.monotonic()
        if self.coordinator is None or now < self._next_coord:
            return
        self._next_coord = now + self.coordinator.ttl / 4
        try:
            self.coordinator.register_node(self.segment, self.endpoint)
            leader = self.coordinator.leader()
        except errors.KvError as err:
            log.warning("coordinator: %s", err)
            return
        if leader is not None and leader[1] != self.master:
            log.info("segment %s: master is now %s (term %d)", self.segment, leader[1], leader[0])
            self.master = leader[1]
            self._connect_master()
            self._register()

    def _start_over(self, why: str) -> None:
        old = self.segment
        if self.coordinator is not None:
            try:
                self.coordinator.drop_node(old)
            except errors.KvError:
                pass
            self._next_coord = 0.0
        self.core.restart(new_segment_id())
        log.warning("segment %s: %s; starting over as %s", old, why, self.segment)
        self.registered.clear()
        self._register_rid = None
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)

    def _on_master_reply(self, frames: list) -> None:
        try:
            reply = wire.decode_reply(frames)
        except errors.KvError as err:
            log.error("bad reply from master: %s", err)
            return
        if reply.request_id == self._register_rid:
            self._register_rid = None
            term = reply.body.get("term", 0) if reply.status == 0 else 0
            if reply.status == errors.MasterNotOpen.code or (
                    reply.status == 0 and not (type(term) is int and self.core.fence_to(term))):
                # a master still recovering, or one whose term is stale: try later
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 1.0)
            elif reply.status == 0:
                hb = reply.body.get("heartbeat")
                self.heartbeat = float(hb) if isinstance(hb, (int, float)) and hb > 0 else 1.0
                self._next_heartbeat = time.monotonic() + self.heartbeat
                self.registered.set()
                self._backoff = 0.1
                log.info("segment %s registered at %s", self.segment, self.master)
                if self.on_registered is not None:
                    self.on_registered(self)
            elif isinstance(reply.error(), PERMANENT_REFUSALS):
                err = reply.error()
                self.refused = type(err)(f"the master at {self.master} refused this node: {err}")
                log.info("segment %s: %s; stopping", self.segment, self.refused)
                self.stop()
            else:
                self._start_over(f"register refused by {self.master}: {reply.error()}")
        elif reply.status == errors.SegmentUnavailable.code and self.registered.is_set():
            self._start_over("the master does not know the segment")

    def _timers(self) -> None:
        if self.refused is not None:
            return
        if self.core.draining:
            drained = self.core.drain()
            if drained and self.registered.is_set():
                self._to_master("storage_drained", {"segment": self.segment, "offsets": drained})
        self._follow()
        now = time.monotonic()
        if self.registered.is_set():
            if now >= self._next_heartbeat:
                self._to_master("storage_heartbeat", {"segment": self.segment})
                self._next_heartbeat = now + self.heartbeat
        elif self._register_rid is None:
            if now >= self._retry_at:
                self._register()
        elif now - self._register_sent > self.register_timeout:
            silent = f"no answer from the master at {self.master} for {now - self._register_sent:.1f} s"
            self._connect_master()
            if self.coordinator is not None:
                # the named master may be dead: keep the segment (a new master
                # fences and recovers it) and ask again
                if self.master is None:
                    silent = "no master named yet"
                log.warning("segment %s: %s; asking %s again", self.segment, silent,
                            self.coordinator.url)
                self._register_rid = None
                self._next_coord = 0.0
            else:
                # no answer: the master may be down or restarted; try again afresh
                self._start_over(silent)

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stopping = True

    def serve_forever(self, poll_ms: int = 20) -> None:
        try:
            self._connect_master()
            self._register()
            while not self._stopping:
                wait = poll_ms
                if self._held or self._outq or self._awaiting:
                    due = min(q[0][0] for q in (self._held, self._outq, self._awaiting) if q)
                    wait = max(0, min(poll_ms, int((due - time.monotonic()) * 1000) + 1))
                events = dict(self.poller.poll(wait))
                if self._held or self._outq:
                    self._due()
                if events.get(self.router):
                    self._drain_router()
                if self._awaiting:
                    self._serve_assigned()
                if self.dealer is not None and events.get(self.dealer):
                    for frames in wire.waiting(self.dealer, self.BURST, polled=True):
                        self._on_master_reply(frames)
                if self.core.copies or len(self.copier):
                    self._copy()
                self._timers()
            self._deregister()
        finally:
            self.close()

    def _copy(self) -> None:
        """Start the repair copies the master asked for; write those whose
        bytes came and report every finished one (``repair_done``)."""
        core = self.core
        for copy, term in core.copies:
            self.copier.start(copy, term)
        core.copies.clear()
        for copy, data, err in self.copier.answered():
            if err is None:
                try:
                    core.copied(copy, data)
                except errors.KvError as e:
                    err = e
            body = {"segment": self.segment, "key": copy.key, "repair": copy.repair}
            if err is not None:
                core.counters["repairs_failed"] += 1
                log.warning("segment %s: repair %d of %r from %s failed: %s", self.segment,
                            copy.repair, copy.key, copy.source_segment, err)
                body["error"] = [err.code, str(err)[:4000]]
            self._to_master("repair_done", body)

    def _deregister(self, wait: float = 0.5) -> None:
        if not self.registered.is_set() or self.dealer is None:
            return
        rid = self._to_master("deregister", {"segment": self.segment})
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not self.dealer.poll(int(max(deadline - time.monotonic(), 0) * 1000) + 1):
                break
            try:
                reply = wire.decode_reply(self.dealer.recv_multipart(copy=False))
            except errors.KvError:
                continue
            if reply.request_id == rid:
                break
        self.registered.clear()

    def _drain_router(self) -> None:
        """Serve the requests waiting (up to ``BURST``; the poll said one does)."""
        for frames in wire.waiting(self.router, self.BURST, polled=True):
            self._on_request(frames)

    def _on_request(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            req = wire.decode_request(frames[1:], self.max_header_bytes, self.memory.capacity,
                                      self.ops)
        except errors.KvError as err:
            self.core.counters["rejected"] += 1
            self._send([identity, wire.encode_error(getattr(err, "request_id", 0), err)])
            return
        del frames  # release the received payload frame before the next message
        if self.credentials is not None and req.op not in self.CONTROL_OPS:
            try:
                if req.op == "read" and req.body.get("cred") is None:
                    tenant = REPAIR_READER      # a repair copier's read: its ticket alone
                else:
                    tenant = self.credentials.authenticate(req.body.get("cred"))
                if req.op in self.TICKET_OPS:   # spec NodeAdmits, before anything runs
                    self.tickets.admit(tenant, req.body, int(time.time() * 1000))
            except (errors.Unauthorized, errors.TicketRefused) as err:
                self.core.counters["unauthorized" if isinstance(err, errors.Unauthorized)
                                   else "tickets_refused"] += 1
                self._send([identity, wire.encode_error(req.request_id, err)])
                return
        if req.op == "debug":
            self.faults.update({k: v for k, v in req.body.items() if k in self.FAULTS})
            self._send([identity, wire.encode_reply(req.request_id, 0, dict(self.faults))])
            return
        if self.core.tracked(req.op, req.body):
            try:
                self.core.start(req.op, req.body)
            except errors.KvError as err:
                self._send([identity, wire.encode_error(req.request_id, err)])
                return
            if self.faults["delay_ms"]:
                heapq.heappush(self._held, (time.monotonic() + self.faults["delay_ms"] / 1000,
                                            next(self._seq), identity, req))
                return
        if req.op in ("write", "writes") and len(self._awaiting) < self.MAX_AWAITING \
                and self.core.awaits_assign(req.body):
            self._awaiting.append((time.monotonic() + self.ASSIGN_WAIT, identity, req))
            return
        self._serve(identity, req)

    def _serve_assigned(self) -> None:
        """Serve the waiting writes whose assign has arrived, and those that
        waited ``ASSIGN_WAIT`` (judged now: refused if still unassigned)."""
        now, waiting = time.monotonic(), self._awaiting
        self._awaiting = []
        for due, identity, req in waiting:
            if due > now and self.core.awaits_assign(req.body):
                self._awaiting.append((due, identity, req))
            else:
                self._serve(identity, req)

    def _serve(self, identity: bytes, req: wire.Request) -> None:
        rid = req.request_id
        out: list = []
        observe = self.observe
        started = time.perf_counter() if observe is not None else 0.0
        try:
            result = self.core.handle(req.op, req.body, req.payloads)
            if result is None:
                return  # a cancelled load: its bytes are never sent
            body, out = result
            header = wire.encode_reply(rid, 0, body)
        except errors.KvError as err:
            header = wire.encode_error(rid, err)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("storage failed on %s", req.op)
            header = wire.encode_error(rid, errors.InternalError(f"{req.op}: {exc}"))
        if observe is not None:
            observe(req.op, time.perf_counter() - started)
        frames = [identity, header, *out]
        if req.op == "read" and self.faults["read_delay_ms"]:
            self.core.counters["reads_delayed"] += 1
            frames = _snapshot(frames)
            heapq.heappush(self._outq, (time.monotonic() + self.faults["read_delay_ms"] / 1000,
                                        next(self._seq), frames))
        elif req.op in ("load", "write") and any(self.faults[f] for f in self.FAULTS):
            self._faulty_reply(frames)
        else:
            self._send(frames)

    def _faulty_reply(self, frames: list) -> None:
        f = self.faults
        if f["drop"]:
            f["drop"] -= 1
            self.core.counters["dropped"] += 1
            return
        copies = [f["reply_delay_ms"]]
        if f["duplicate"]:
            f["duplicate"] -= 1
            self.core.counters["duplicated"] += 1
            copies.append(f["reply_delay_ms"] + f["duplicate_delay_ms"])
        frames = _snapshot(frames) if max(copies) else frames
        for delay in copies:
            if delay:
                heapq.heappush(self._outq, (time.monotonic() + delay / 1000, next(self._seq), frames))
            else:
                self._send(frames)

    def _due(self) -> None:
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            _, _, identity, req = heapq.heappop(self._held)
            self._serve(identity, req)
        while self._outq and self._outq[0][0] <= now:
            self._send(heapq.heappop(self._outq)[2])

    def _send(self, frames: list) -> None:
        send, last = self.router.send, len(frames) - 1
        try:
            # payloads are views of the segment: zero-copy (pyzmq copies < 64 KiB);
            # plain sends: send_multipart's checks cost more than a reply's sends
            for i, frame in enumerate(frames):
                send(frame, _LAST if i == last else _MORE, copy=False)
        except zmq.ZMQError:
            pass  # peer gone or its queue full: the reply is dropped

    def close(self) -> None:
        if self.coordinator is not None:
            try:
                self.coordinator.drop_node(self.segment)
            except errors.KvError:
                pass
            self.coordinator.close()
            self.coordinator = None
        self.copier.close()
        if self.dealer is not None and not self.dealer.closed:
            self.dealer.close(linger=0)
        if not self.router.closed:
            self.router.close(linger=0)
        if self._own_context:
            self.ctx.term()
        self.memory.close()
        if self.core.trace is not None:
            self.core.trace.close()


def _snapshot(frames: list) -> list:
    """A reply held back by a test fault keeps the bytes it would have sent
    (the segment may change meanwhile)."""
    return [frames[0], frames[1], *(bytes(p) for p in frames[2:])]
