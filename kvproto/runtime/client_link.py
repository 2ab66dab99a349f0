"""The connections of a :class:`~kvproto.runtime.client.Client`: its requests
to the master and their replies, the master found again through the
coordinator after a switch, the sockets to the storage nodes, and the
heartbeats that keep a put's or a read's attempt alive at the master.
:class:`ClientLink` is a part of :class:`~kvproto.runtime.client.Client`, as
:class:`~kvproto.runtime.master_requests.MasterRequests` is of the master's
core: it uses the client's state (set up in ``Client.__init__``).

No such key, or no master: what a call that no master served raises, and
when a lookup is a miss instead, is described in :mod:`kvproto.runtime.client`
(:meth:`ClientLink._not_served`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
import time
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

import zmq

from kvproto import errors
from kvproto.runtime import wire

if TYPE_CHECKING:
    from kvproto.runtime.client import Client

#: errors that mean "the master may be switching": a lookup answered so is a
#: miss (within the switch window; past it the client raises MasterUnreachable)
SWITCHING = (errors.MasterNotOpen, errors.RequestTimeout)


def _heartbeats(ref: "weakref.ref[Client]", stop: threading.Event) -> None:
    """The heartbeat thread: while the client has a put or read in flight, tell
    the master it is alive every ``heartbeat`` seconds (the master says how
    often: a quarter of its writer timeout); and while no call runs, release
    the leases the client held back (so a read's protection ends within a
    tick of its last get even if the client goes quiet). Holds the client only
    weakly, so a client dropped without ``close()`` still goes away, and so
    does the thread."""
    client = ref()
    if client is None:
        return
    client_id = client.client_id
    auth = client._stamped("heartbeat", {})
    del client
    address, sock = "", None     # follows the client's master (it changes on failover)
    rid, last_sent = 0, 0.0
    try:
        while not stop.wait(0.05):
            client = ref()
            if client is None:
                return
            active, interval, master = client._active, client._hb_interval, client.master
            tokens = client._in_flight
            if client._unreleased and client._lock.acquire(blocking=False):
                try:     # on the client's own connection: its next request comes after
                    client._release_now()
                finally:
                    client._lock.release()
            if master != address:
                if sock is not None:
                    sock.close(linger=0)
                address = master
                sock = client._socket(address) if address else None
            del client
            if sock is None:
                continue
            now = time.monotonic()
            if active and now - last_sent >= interval:
                rid += 1
                last_sent = now
                body = {**auth, "client": client_id}
                if tokens:
                    body["tokens"] = list(tokens)
                try:
                    sock.send(wire.encode_request("heartbeat", rid, body), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            while sock.poll(0):  # drop the answers
                sock.recv_multipart()
    finally:
        if sock is not None:
            sock.close(linger=0)


class ClientLink:
    """The connections of :class:`~kvproto.runtime.client.Client` (see the
    module docstring); they use its state and its lock."""

    # ------------------------------------------------------------------ sockets

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0  # queue, never block: deadlines are enforced on replies
        sock.rcvhwm = 0
        sock.connect(endpoint)
        return sock

    def _master(self) -> zmq.Socket:
        if self._closed:
            raise errors.ServerUnavailable("the client is closed")
        if self._master_sock is None:
            self._master_sock = self._socket(self.master)
        return self._master_sock

    def _reset_master(self) -> None:
        if self._master_sock is not None:
            self._pollers.clear()
            self._master_sock.close(linger=0)
            self._master_sock = None

    def _data_sock(self, endpoint: str) -> zmq.Socket:
        sock = self._data.get(endpoint)
        if sock is None:
            sock = self._data[endpoint] = self._socket(endpoint)
        return sock

    def _reset_data(self, endpoint: str) -> None:
        sock = self._data.pop(endpoint, None)
        if sock is not None:
            self._pollers.clear()
            sock.close(linger=0)

    def _send(self, sock: zmq.Socket, op: str, body: dict, payloads: Sequence = ()) -> int:
        body = self._stamped(op, body)
        self._rid += 1
        rid = self._rid
        if payloads:
            # copy=False: payload frames reference the caller's buffer (pyzmq
            # copies frames under zmq.COPY_THRESHOLD = 64 KiB itself)
            sock.send_multipart([wire.encode_request(op, rid, body), *payloads], copy=False)
        else:
            sock.send(wire.encode_request(op, rid, body))
        return rid

    def _gather(self, pending: dict[int, zmq.Socket], deadline: float) -> dict[int, wire.Reply]:
        """Replies to the request ids in ``pending`` that arrive before ``deadline``.
        One socket (the common case) is read with blocking receives bounded by
        the deadline; several are polled with a poller kept per socket set."""
        got: dict[int, wire.Reply] = {}
        early = self._early
        if early:       # read while another request was awaited (_take)
            for rid in pending:
                if early.get(rid) is not None:
                    got[rid] = early.pop(rid)
        socks = set(pending.values())
        one = next(iter(socks)) if len(socks) == 1 else None
        poller = None if one is not None else self._poller(socks)
        while len(got) < len(pending):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if one is not None:
                one.setsockopt(zmq.RCVTIMEO, max(1, int(remaining * 1000)))
                try:
                    frames = one.recv_multipart(copy=False)
                except zmq.Again:
                    break
                self._take(frames, one, pending, got)
                if len(got) < len(pending):     # else what waits is read by the next call
                    for frames in wire.waiting(one):
                        self._take(frames, one, pending, got)
                continue
            for sock, _ in poller.poll(max(1, int(remaining * 1000))):
                for frames in wire.waiting(sock, polled=True):
                    self._take(frames, sock, pending, got)
        return got

    def _take(self, frames: list, sock: zmq.Socket, pending: dict, got: dict) -> None:
        try:
            reply = wire.decode_reply(frames)
        except errors.KvError:
            return
        rid = reply.request_id
        if pending.get(rid) is sock:
            got[rid] = reply
        elif rid in self._early:        # a request sent ahead, awaited later
            self._early[rid] = reply

    def _poller(self, socks: set) -> zmq.Poller:
        """A poller over ``socks``, kept while the same set is asked for again."""
        key = frozenset(socks)
        cached = self._pollers.get(key)
        if cached is None:
            if len(self._pollers) > 16:
                self._pollers.clear()
            cached = self._pollers[key] = zmq.Poller()
            for sock in socks:
                cached.register(sock, zmq.POLLIN)
        return cached

    def _call_master(self, op: str, body: dict, deadline: float,
                     started: Optional[float] = None,
                     meanwhile: Optional[Callable[[], None]] = None) -> wire.Reply:
        """One request to the master. With a coordinator, a master that is not
        open, or is silent for ``LEADER_RECHECK``, makes the client ask the
        coordinator again, and the request goes to the master it names if that
        changed (a few times at most, within ``deadline``). A call no master
        served raises one of :data:`SWITCHING` while a switch may be under
        way, and :class:`~kvproto.errors.MasterUnreachable` (or
        ``CoordinatorUnavailable``) past the window (see :meth:`_not_served`);
        ``started`` (default: now) is when the call began; ``meanwhile`` (the
        caller's own work) runs once, after the request is first sent and
        before its answer is awaited."""
        started = time.monotonic() if started is None else started
        if self._coordinator is not None and started - self._leader_checked > self.LEADER_RECHECK:
            self._find_master()
        if self._unreleased and op != "read_begin":
            self._release_now()         # ordered before this request on the connection
        try:
            reply = self._ask_master(op, body, deadline, started, meanwhile)
        except (*SWITCHING, errors.CoordinatorUnavailable) as err:
            raise self._not_served(err, started) from None
        self._unserved_since = None
        return reply.raise_for_status()

    def _ask_master(self, op: str, body: dict, deadline: float, started: float,
                    meanwhile: Optional[Callable[[], None]] = None) -> wire.Reply:
        """The reply of a master that served the request (any status but
        ``MasterNotOpen``), or the reason none did."""
        for _ in range(4):
            if not self.master:
                err = self._find_master()
                if not self.master:
                    raise err or errors.MasterNotOpen(f"the coordinator {self._coordinator.url} "
                                                      "names no master")
            asked = self.master
            sock = self._master()
            sent_at = time.perf_counter()
            rid = self._send(sock, op, body)
            if meanwhile is not None:
                meanwhile()
                meanwhile = None
            reply = self._await_master(sock, rid, deadline, started)
            if self.observe is not None:
                self.observe(op, time.perf_counter() - sent_at)
            if reply is not None and reply.status != errors.MasterNotOpen.code:
                return reply
            if self.master == asked:        # no other master named while waiting
                if reply is None:
                    self._reset_master()
                self._find_master()
            if self.master == asked or not self.master or time.monotonic() >= deadline:
                break
        if reply is None:
            raise errors.RequestTimeout(f"master {asked} did not answer {op} in time")
        raise reply.error()

    def _await_master(self, sock: zmq.Socket, rid: int, deadline: float,
                      started: float) -> Optional[wire.Reply]:
        """The master's reply to ``rid``; ``None`` at ``deadline``, once the
        master has answered nothing for the switch window (nor a ``heartbeat``
        probe, sent every quarter of it: a master whose reply is parked on
        storage nodes still answers those), or, with a coordinator, as soon as
        it (asked every ``LEADER_RECHECK``) names another master."""
        asked, window = self.master, self._window()
        heard = started                      # the master last showed it serves
        probes: dict[int, zmq.Socket] = {}
        next_probe = started + window / 4
        while True:
            unserved = self._unserved_since if self._unserved_since is not None else heard
            silent_until = max(heard + self.lookup_timeout, unserved + window)
            until = min(deadline, silent_until, next_probe)
            if self._coordinator is not None:
                until = min(until, time.monotonic() + self.LEADER_RECHECK)
            got = self._gather({rid: sock, **probes}, until)
            if rid in got:
                return got[rid]
            now = time.monotonic()
            for probe, reply in got.items():
                del probes[probe]
                if reply.status != errors.MasterNotOpen.code:
                    heard, self._unserved_since = now, None
            if now >= deadline or now >= silent_until:
                return None
            if now >= next_probe:
                probes[self._send(sock, "heartbeat", {"client": self.client_id})] = sock
                next_probe = now + window / 4
            if self._coordinator is not None and now - self._leader_checked >= self.LEADER_RECHECK:
                self._find_master()
                if self.master != asked:
                    return None

    def _window(self) -> float:
        return self.switch_window if self._coordinator is not None else self.lookup_timeout

    def _not_served(self, err: errors.KvError, started: float) -> errors.KvError:
        """What a call that no master served raises. The client counts the time
        since the first such call after the last served one: within the window
        it may be a switch (``err``, one of :data:`SWITCHING`; a lookup misses);
        past it, :class:`~kvproto.errors.MasterUnreachable`. A coordinator that
        cannot be reached while no master is known is
        ``CoordinatorUnavailable``: at once if this client never reached it (a
        wrong or dead address is not a switch), else past the window."""
        if self._unserved_since is None:
            self._unserved_since = started
        unserved = time.monotonic() - self._unserved_since
        cut_off = isinstance(err, errors.CoordinatorUnavailable)
        if unserved < self._window() and not (cut_off and not self._coordinator_reached):
            if cut_off:
                return errors.MasterNotOpen(f"no master known: {err.message}")
            return err
        self.failover_counters["unreachable"] += 1
        if cut_off:
            return err
        if self._coordinator is None:
            return errors.MasterUnreachable(
                f"the master at {self.master} has answered nothing for {unserved:.1f} s; is it "
                "running? (without a coordinator no failover can be under way)")
        return errors.MasterUnreachable(
            f"no master named by {self._coordinator.url} has served this client for "
            f"{unserved:.1f} s, longer than a switch takes (switch_window {self.switch_window:g} s): "
            f"{err.message}")

    def _lookup(self, op: str, body: dict, keys: int, deadline: float) -> Optional[wire.Reply]:
        """A lookup of ``keys`` keys at the master, or ``None`` (all misses)
        when the master is switching: not open, or silent for ``lookup_timeout``."""
        started = time.monotonic()
        try:
            return self._call_master(op, body, min(deadline, started + self.lookup_timeout), started)
        except SWITCHING:
            self.failover_counters["switch_misses"] += keys
            return None

    def _send_ahead(self, op: str, body: dict) -> tuple:
        """Send ``op`` to the master now, its answer awaited later
        (:meth:`_await_ahead`; answers read meanwhile are kept in ``_early``):
        ``(op, request id, socket, master, sent)``. The held-back lease
        releases go first, as with :meth:`_call_master`."""
        if self._unreleased and op != "read_begin":
            self._release_now()
        sock, sent = self._master(), time.monotonic()
        rid = self._send(sock, op, body)
        self._early[rid] = None
        return op, rid, sock, self.master, sent

    def _await_ahead(self, ahead: tuple, deadline: float) -> tuple[Optional[wire.Reply], bool]:
        """The answer to a request of :meth:`_send_ahead` if the master served
        it (a refusal raises, as from :meth:`_call_master`), else ``None``;
        and whether it went unanswered (silent, or its connection replaced
        since) rather than answered ``MasterNotOpen``."""
        op, rid, sock, asked, sent = ahead
        reply = None
        if sock is self._master_sock and self.master == asked:
            reply = self._await_master(sock, rid, deadline, sent)
        self._early.pop(rid, None)
        if reply is None:
            return None, True
        if reply.status == errors.MasterNotOpen.code:
            return None, False
        if self.observe is not None:
            self.observe(op, time.monotonic() - sent)
        self._unserved_since = None
        return reply.raise_for_status(), False

    def _lookups(self, op: str, bodies: Iterable[tuple[dict, int]], deadline: float
                 ) -> Iterator[tuple[Optional[wire.Reply], float]]:
        """What :meth:`_lookup` answers for each ``(body, keys)`` of ``bodies``,
        in order, each with the time its request was sent; up to ``window``
        requests are in flight on the master's connection (:meth:`_send_ahead`),
        so the master serves the next ones while the caller works on an
        answer. A body is taken from ``bodies`` only as its request is sent (a
        caller stops further requests by ending ``bodies``). A request the
        master did not serve (:meth:`_await_ahead`) is asked again on its own
        through :meth:`_lookup`, which finds the master anew. A request the
        master refused raises, as from :meth:`_lookup`."""
        if self._coordinator is not None and \
                time.monotonic() - self._leader_checked > self.LEADER_RECHECK:
            self._find_master()
        source = iter(bodies)
        flight: deque = deque()         # (what _send_ahead returned, or None; body, keys)

        def send() -> None:
            while len(flight) < self.window:
                item = next(source, None)
                if item is None:
                    return
                body, keys = item       # without a master, _lookup finds one first
                flight.append((self._send_ahead(op, body) if self.master else None, body, keys))
        try:
            send()
            while flight:
                ahead, body, keys = flight.popleft()
                reply = None
                if ahead is not None:
                    sent = ahead[-1]
                    reply, _ = self._await_ahead(ahead, min(deadline, sent + self.lookup_timeout))
                if reply is None:
                    sent = time.monotonic()
                    reply = self._lookup(op, body, keys, deadline)
                send()                  # the next request, before the caller reads this answer
                yield reply, sent
        finally:
            for ahead, _, _ in flight:
                if ahead is not None:
                    self._early.pop(ahead[1], None)

    def _find_master(self) -> Optional[errors.KvError]:
        """Ask the coordinator (if any) who the master is now; reconnect if it
        changed. Returns the coordinator's error if it could not be asked (the
        master known so far is kept)."""
        if self._coordinator is None:
            return None
        self._leader_checked = time.monotonic()
        try:
            leader = self._coordinator.leader()
        except errors.KvError as err:
            return err
        self._coordinator_reached = True
        address = leader[1] if leader is not None else ""
        if address != self.master:
            self._reset_master()
            self.master = address
            if address:
                self.failover_counters["masters_found"] += 1

    def _deadline(self, timeout: Optional[float]) -> float:
        return time.monotonic() + (self.timeout if timeout is None else float(timeout))

    # ------------------------------------------------------------------ heartbeats

    def _hold(self) -> None:
        """Count one more put or read in flight (heartbeats run while any is)."""
        with self._active_lock:
            self._active += 1
            if self._hb_thread is None and not self._closed:
                self._hb_thread = threading.Thread(
                    target=_heartbeats, args=(weakref.ref(self), self._hb_stop), daemon=True,
                    name=f"kvproto-heartbeat-{self.client_id}")
                self._hb_thread.start()

    def _unhold(self) -> None:
        with self._active_lock:
            self._active -= 1

    @contextlib.contextmanager
    def _activity(self):
        """Heartbeat the master while a put or a read is in flight."""
        self._hold()
        try:
            yield
        finally:
            self._unhold()

    def _note_interval(self, reply: wire.Reply) -> None:
        hb = reply.body.get("heartbeat")
        if isinstance(hb, (int, float)) and hb > 0:
            self._hb_interval = float(hb)
