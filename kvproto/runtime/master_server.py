"""The master's process: :class:`MasterServer`, a single-threaded ZeroMQ loop
around a :class:`~kvproto.runtime.master.MasterCore`: a ROUTER for clients
and storage nodes, and one DEALER per storage node (connected to the node's
endpoint) that carries ``assign``/``free`` commands in order, so a free always
reaches the node before a later assign of the same region.

With a coordinator it campaigns, takes the term it wins, renews it from a
thread of its own (:class:`_Renewer`) and steps down when it cannot. It
answers nothing but ``MasterNotOpen`` once it cannot prove that it still
holds its term (a renewal less than ``HELD_FRACTION`` of the coordinator's
TTL ago): checked before it handles a request and again before it sends each
reply (``spec/Failover.tla``, ``AcknowledgedChangesSurvive``).

Payload bytes never reach the master: its ROUTER accepts no payload frames.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.master import MasterCore
from kvproto.statemachines import failover as fm

log = logging.getLogger("kvproto.master")

_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


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
        for sock, _ in self.poller.poll(poll_ms):    # the router first: registered first
            if sock is self.router:
                self._drain_router()
            else:
                segment = self._segment_of.get(sock)
                if segment is not None:
                    self._drain_dealer(sock, segment)
        self.core.tick()
        self._send_out()
        if self._term and self.core.failover.phase is fm.Phase.STANDBY:
            self._step_down("a storage node refused this master's term")

    def _drain_router(self) -> None:
        """Serve the requests waiting (up to ``BURST``; the poll said one does)."""
        for frames in wire.waiting(self.router, self.BURST, polled=True):
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
        header = wire.encode_reply(request_id, status, body)
        try:    # two plain sends: send_multipart's checks cost more than the sends
            self.router.send(identity, _MORE)
            self.router.send(header, _LAST)
        except zmq.ZMQError:  # peer gone or its queue full: the reply is dropped
            pass

    def _drain_dealer(self, sock: zmq.Socket, segment: str) -> None:
        for frames in wire.waiting(sock, self.BURST, polled=True):
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
        if not (core.ready or core.outbox or core.opened or core.closed):
            return      # the common case after a request answered at once
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
