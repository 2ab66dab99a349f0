"""A fault-injecting ZeroMQ proxy: the network between the fault matrix's processes.

Each *route* is a ROUTER bound on a front-end address (what a server
advertises: a storage node's ``--advertise``, a master's address in the
coordinator) and, per peer that connects to it, a DEALER connected to the real
server. A request ``[header, payload...]`` from a peer goes out on that peer's
DEALER; the server's reply comes back on it and returns to the peer. The
servers see one ordinary DEALER per peer, so nothing in the runtime knows the
proxy is there.

The proxy reads each frame's msgpack header (``[version, op, request_id,
body]``; a reply's op is the op of the request it answers, matched by the
peer and request id), so a *rule* can pick a protocol phase: "the 3rd
``write`` request", "the first ``put_end``", "a ``read`` reply", "every
``fence``". A rule that fires acts on that one frame:

* ``drop``: never delivered;
* ``delay``: delivered ``delay_ms`` later;
* ``duplicate``: delivered now and again ``delay_ms`` later;
* ``reorder``: held until a frame of *another* peer of the same route and
  direction has passed (at most ``delay_ms``), then delivered after it;
* ``kill``: SIGKILL to ``target``, then the frame is delivered if ``forward``;
* ``stop``: SIGSTOP to ``target`` for ``stop_ms``, then SIGCONT; the frame is
  delivered at once (``forward``), after the SIGCONT (``hold``), or never;
* ``corrupt``: one byte of the last frame flipped (no real network delivers
  that past TCP's checksum: it is there to show that the checks catch it).

Each connection keeps its order, as ZeroMQ over TCP does: a frame held
(delayed, reordered, held for a stopped sender) holds back the later frames
of its connection and direction, which follow it when it goes. Frames of
different connections are what overtake each other. (Only ``duplicate``
breaks this on purpose: its copy comes late.)

``target`` is ``"sender"`` or ``"receiver"`` (the client process on the other
end, known from the ``client``/``owner`` fields of its requests, which carry
its pid, and for a ``read`` from the ``read_begin`` that handed out its
token), or a pid. Signals go only to pids the harness listed with ``allow``.

The proxy also records where each acknowledged put's replicas are (from
``put_start`` grants and ``put_end`` acknowledgements), so a checker can tell
an object lost with its storage nodes from one the protocol lost.

Run as ``python -m kvproto.checking.chaos.proxy CONTROL_ENDPOINT [SEED]``; the
harness talks to the control endpoint with :class:`ProxyControl`.
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import signal
import sys
import time
import traceback
from collections import OrderedDict, defaultdict
from typing import Any, Optional

import msgpack
import zmq

REQUEST, REPLY = "request", "reply"
ACTIONS = ("drop", "delay", "duplicate", "reorder", "kill", "stop", "corrupt")
#: at most this many put grants / pending requests are remembered
MEMORY = 200_000


def pid_of(client_id: Any) -> Optional[int]:
    """The pid inside a client id ``host:pid:uuid`` (or an owner ``host:pid:uuid/...``)."""
    if type(client_id) is not str:
        return None
    parts = client_id.split(":")
    if len(parts) < 3 or not parts[-2].isdigit():
        return None
    return int(parts[-2])


class Rule:
    """When to act (route, direction, ops, body fields, which match) and how."""

    FIELDS = ("route", "direction", "ops", "except_ops", "where", "nth", "count", "probability", "until",
              "action", "delay_ms", "target", "stop_ms", "forward", "hold", "name")

    def __init__(self, spec: dict, rule_id: int, now: float) -> None:
        unknown = set(spec) - set(self.FIELDS) - {"for_ms"}
        if unknown:
            raise ValueError(f"unknown rule fields {sorted(unknown)}")
        self.id = rule_id
        self.name: str = spec.get("name") or f"rule-{rule_id}"
        #: route names (prefix match: "storage" matches "storage-0"); None: all
        route = spec.get("route")
        self.routes: Optional[tuple] = None if route is None else tuple(
            [route] if isinstance(route, str) else route)
        self.direction: Optional[str] = spec.get("direction")
        ops = spec.get("ops")
        self.ops: Optional[frozenset] = None if ops is None else frozenset(
            [ops] if isinstance(ops, str) else ops)
        self.except_ops: frozenset = frozenset(spec.get("except_ops") or ())
        self.where: dict = dict(spec.get("where") or {})
        self.nth = int(spec.get("nth", 1))
        self.count = int(spec.get("count", 1))          # fires at most this often (0: no limit)
        self.probability = float(spec.get("probability", 1.0))
        self.until = now + spec["for_ms"] / 1000 if spec.get("for_ms") else spec.get("until")
        self.action: str = spec["action"]
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")
        self.delay_ms = float(spec.get("delay_ms", 0))
        self.target = spec.get("target", "sender")
        self.stop_ms = float(spec.get("stop_ms", 0))
        self.forward = bool(spec.get("forward", self.action not in ("drop", "kill")))
        self.hold = bool(spec.get("hold", False))
        self.matched = 0
        self.fired = 0

    def spent(self, now: float) -> bool:
        return (self.count and self.fired >= self.count) or (self.until is not None and now > self.until)

    def matches(self, route: str, direction: str, op: Optional[str], body: Any) -> bool:
        if self.direction is not None and direction != self.direction:
            return False
        if self.routes is not None and not any(route.startswith(r) for r in self.routes):
            return False
        if (self.ops is not None and op not in self.ops) or op in self.except_ops:
            return False
        if self.where:
            if type(body) is not dict:
                return False
            for field, value in self.where.items():
                if body.get(field) != value:
                    return False
        return True


class Route:
    __slots__ = ("name", "front", "backend", "frontend")

    def __init__(self, name: str, front: zmq.Socket, backend: str, frontend: str) -> None:
        self.name = name
        self.front = front
        self.backend = backend
        self.frontend = frontend


class Peer:
    """One connected peer of a route, with its own DEALER to the server."""

    __slots__ = ("route", "identity", "dealer", "pid", "requests", "last")

    def __init__(self, route: Route, identity: bytes, dealer: zmq.Socket, now: float) -> None:
        self.route = route
        self.identity = identity
        self.dealer = dealer
        self.pid: Optional[int] = None
        #: request id -> (op, pid, body summary) of requests not yet answered
        self.requests: "OrderedDict[int, tuple]" = OrderedDict()
        self.last = now


class Proxy:
    IDLE_S = 120.0
    #: how long after the frame that overtook them reordered frames follow
    OVERTAKE_S = 0.01

    def __init__(self, control: str, seed: int = 0) -> None:
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.linger = 0
        self.control.bind(control)
        self.control_address = self.control.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.rng = random.Random(seed)
        self.routes: dict[str, Route] = {}
        self.fronts: dict[zmq.Socket, Route] = {}
        self.peers: dict[tuple[str, bytes], Peer] = {}
        self.dealers: dict[zmq.Socket, Peer] = {}
        self.rules: list[Rule] = []
        self._rule_ids = itertools.count(1)
        self.allowed: set[int] = set()
        self.stopped: set[int] = set()
        #: (due, seq, kind, payload): frames to deliver, SIGCONTs to send
        self.timers: list = []
        self._seq = itertools.count()
        #: (route, peer, direction) -> [due, socket, frames] held, in the
        #: connection's order; a frame with due 0 goes as soon as those before it
        self.gates: dict[tuple, list] = {}
        #: (route, direction) -> streams whose head waits for another peer's frame
        self.overtake: dict[tuple, set] = defaultdict(set)
        self.events: list[dict] = []
        self.forwarded: dict[str, int] = defaultdict(int)
        self.fired: dict[str, int] = defaultdict(int)
        #: read token -> pid of the reader that was granted it
        self.token_pid: "OrderedDict[int, int]" = OrderedDict()
        #: put token -> (key, segments) from put_start grants
        self.grants: "OrderedDict[int, tuple]" = OrderedDict()
        #: key -> segments of its last acknowledged put
        self.placements: dict[bytes, list] = {}
        self.running = True

    # ------------------------------------------------------------------ control

    def add_route(self, name: str, frontend: str, backend: str) -> str:
        if name in self.routes:
            self.drop_route(name)
        front = self.ctx.socket(zmq.ROUTER)
        front.linger = 0
        front.sndhwm = 0
        front.rcvhwm = 0
        front.bind(frontend)
        bound = front.getsockopt(zmq.LAST_ENDPOINT).decode()
        route = Route(name, front, backend, bound)
        self.routes[name] = route
        self.fronts[front] = route
        self.poller.register(front, zmq.POLLIN)
        return bound

    def drop_route(self, name: str) -> None:
        route = self.routes.pop(name, None)
        if route is None:
            return
        for key in [k for k in self.peers if k[0] == name]:
            self._close_peer(self.peers[key])
        self.fronts.pop(route.front, None)
        self.poller.unregister(route.front)
        route.front.close(linger=0)

    def _close_peer(self, peer: Peer) -> None:
        self.peers.pop((peer.route.name, peer.identity), None)
        self.dealers.pop(peer.dealer, None)
        self.poller.unregister(peer.dealer)
        peer.dealer.close(linger=0)

    def _on_control(self, frames: list) -> None:
        identity, raw = frames[0], frames[-1]
        try:
            cmd = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            result = self._command(cmd)
            reply = {"ok": True, **result}
        except Exception as exc:   # a harness mistake: answer it, keep serving
            reply = {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}
        self.control.send_multipart([identity, msgpack.packb(reply, use_bin_type=True)])

    def _command(self, cmd: dict) -> dict:
        what = cmd["cmd"]
        now = time.monotonic()
        if what == "route":
            return {"frontend": self.add_route(cmd["name"], cmd["frontend"], cmd["backend"])}
        if what == "unroute":
            self.drop_route(cmd["name"])
            return {}
        if what == "allow":
            self.allowed.update(int(p) for p in cmd["pids"])
            return {}
        if what == "rule":
            rule = Rule(cmd["rule"], next(self._rule_ids), now)
            self.rules.append(rule)
            return {"id": rule.id}
        if what == "clear":
            # heal: no more faults; what is in flight is delivered now. The
            # answer counts the faults fired since the last clear, per rule name
            fired, self.fired = dict(self.fired), defaultdict(int)
            self.rules.clear()
            self._release_all()
            return {"fired": fired}
        if what == "stats":
            return {"rules": [{"id": r.id, "name": r.name, "matched": r.matched, "fired": r.fired}
                              for r in self.rules],
                    "fired": dict(self.fired), "forwarded": dict(self.forwarded),
                    "held": sum(len(v) for v in self.gates.values()),
                    "stopped": sorted(self.stopped), "peers": len(self.peers)}
        if what == "events":
            events, self.events = self.events, []
            return {"events": events}
        if what == "placements":
            return {"placements": self.placements}
        if what == "quit":
            self.running = False
            return {}
        raise ValueError(f"unknown command {what!r}")

    def _release_all(self) -> None:
        """Deliver every held frame now and resume every stopped process."""
        for pid in list(self.stopped):
            self._signal(pid, signal.SIGCONT)
        self.stopped.clear()
        timers, self.timers = sorted(self.timers), []
        for _, _, kind, payload in timers:
            if kind == "send":
                self._send(*payload)
        for key in list(self.gates):
            self._flush(key, force=True)
        self.overtake.clear()

    # ------------------------------------------------------------------ frames

    @staticmethod
    def _header(frame: zmq.Frame) -> Any:
        try:
            return msgpack.unpackb(frame.buffer, raw=False, strict_map_key=False)
        except Exception:
            return None

    def _peer(self, route: Route, identity: bytes, now: float) -> Peer:
        peer = self.peers.get((route.name, identity))
        if peer is None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.sndhwm = 0
            dealer.rcvhwm = 0
            dealer.connect(route.backend)
            peer = self.peers[(route.name, identity)] = Peer(route, identity, dealer, now)
            self.dealers[dealer] = peer
            self.poller.register(dealer, zmq.POLLIN)
        peer.last = now
        return peer

    def _on_request(self, route: Route, frames: list, now: float) -> None:
        identity = frames[0].bytes
        peer = self._peer(route, identity, now)
        header = self._header(frames[1]) if len(frames) > 1 else None
        op = body = None
        pid = peer.pid
        if type(header) is list and len(header) == 4:
            _, op, rid, body = header
            if type(body) is dict:
                found = pid_of(body.get("client")) or pid_of(body.get("owner"))
                if found is None and op in ("read", "load"):
                    found = self.token_pid.get(body.get("token"))
                if found is not None:
                    pid = found
                    if op not in ("read", "load"):
                        peer.pid = found
            if type(rid) is int:
                peer.requests[rid] = (op, pid, self._summary(op, body))
                if len(peer.requests) > MEMORY // 10:
                    peer.requests.popitem(last=False)
        if not isinstance(op, str):
            op = None
        self._route_frame(route, REQUEST, op, body, pid, (peer.dealer, frames[1:]), peer, now)

    def _on_reply(self, peer: Peer, frames: list, now: float) -> None:
        peer.last = now
        header = self._header(frames[0])
        op = body = None
        pid = peer.pid
        if type(header) is list and len(header) == 4:
            _, status, rid, body = header
            asked = peer.requests.pop(rid, None) if type(rid) is int else None
            if asked is not None:
                op, pid, summary = asked
                pid = pid or peer.pid
                if status == 0 and type(body) is dict:
                    self._learn(op, pid, summary, body)
        route = peer.route
        self._route_frame(route, REPLY, op, body, pid,
                          (route.front, [peer.identity, *frames]), peer, now)

    @staticmethod
    def _summary(op: Any, body: Any) -> Any:
        if type(body) is not dict:
            return None
        if op == "put_start" or op == "put_end":
            # put_start: [key, length] per item; put_end: [key, token]
            items = body.get("items")
            return [it[:2] for it in items] if type(items) is list and \
                all(type(it) is list and len(it) >= 2 for it in items) else None
        if op == "read_begin":
            return True
        return None

    def _learn(self, op: str, pid: Optional[int], summary: Any, body: dict) -> None:
        """Remember read tokens' readers and acknowledged puts' placements."""
        items = body.get("items")
        columns = body.get("columns")
        if op == "read_begin" and pid is not None and type(columns) is dict \
                and type(columns.get("token")) is list:
            for token in columns["token"]:     # a read_begin answered as columns
                if token:
                    self.token_pid[token] = pid
            while len(self.token_pid) > MEMORY:
                self.token_pid.popitem(last=False)
            return
        if op == "put_start" and type(summary) is list and type(columns) is dict:
            tokens, segments = columns.get("token"), columns.get("segment")
            if type(tokens) is list and type(segments) is list and len(tokens) == len(summary):
                # a put_start answered as columns: each granted key's replicas in turn
                granted = [(key, token) for (key, _), token in zip(summary, tokens) if token]
                n = len(segments) // len(granted) if granted else 0
                for at, (key, token) in enumerate(granted):
                    self.grants[token] = (key, segments[at * n:(at + 1) * n])
                while len(self.grants) > MEMORY:
                    self.grants.popitem(last=False)
            return
        if op == "put_end" and type(summary) is list and items is None \
                and type(refused := body.get("errors")) is list:
            # a put_end asked with ``columns``: every key not listed was published
            items = [[0, None]] * len(summary)
            for error in refused:
                if type(error) is list and error and type(error[0]) is int \
                        and 0 <= error[0] < len(items):
                    items[error[0]] = [1, None]
        if type(items) is not list:
            return
        if op == "read_begin" and pid is not None:
            for item in items:
                if type(item) is list and len(item) == 2 and item[0] == 0 and type(item[1]) is dict:
                    self.token_pid[item[1].get("token")] = pid
            while len(self.token_pid) > MEMORY:
                self.token_pid.popitem(last=False)
        elif op == "put_start" and type(summary) is list:
            for (key, _), item in zip(summary, items):
                if type(item) is list and len(item) == 2 and item[0] == 0 and type(item[1]) is dict:
                    replicas = item[1].get("replicas") or []
                    self.grants[item[1].get("token")] = (key, [r[0] for r in replicas
                                                               if type(r) is list and r])
            while len(self.grants) > MEMORY:
                self.grants.popitem(last=False)
        elif op == "put_end" and type(summary) is list:
            for (key, token), item in zip(summary, items):
                grant = self.grants.pop(token, None) if type(token) is int else None
                if type(item) is list and item and item[0] == 0 and grant is not None:
                    self.placements[key] = grant[1]

    def _route_frame(self, route: Route, direction: str, op: Optional[str], body: Any,
                     pid: Optional[int], out: tuple, peer: Peer, now: float) -> None:
        sock, frames = out
        for rule in self.rules:
            if rule.spent(now) or not rule.matches(route.name, direction, op, body):
                continue
            rule.matched += 1
            if rule.matched < rule.nth or (rule.probability < 1 and self.rng.random() >= rule.probability):
                continue
            if self._act(rule, route, direction, op, pid, sock, frames, peer, now):
                return
        self._deliver(sock, frames, (route.name, peer.identity, direction))

    def _act(self, rule: Rule, route: Route, direction: str, op: Optional[str],
             pid: Optional[int], sock: zmq.Socket, frames: list, peer: Peer, now: float) -> bool:
        """Carry out ``rule`` on the frame; True if the frame was dealt with."""
        target = rule.target
        if rule.action in ("kill", "stop"):
            if target in ("sender", "receiver"):
                # the client is the sender of a request and the receiver of a reply
                client_side = (target == "sender") == (direction == REQUEST)
                target = pid if client_side else None
            if target is None or int(target) not in self.allowed or \
                    (rule.action == "stop" and int(target) in self.stopped):
                return False          # no process to act on: the rule waits for another frame
            target = int(target)
        rule.fired += 1
        self.fired[rule.name] += 1
        self.events.append({"rule": rule.name, "action": rule.action, "route": route.name,
                            "direction": direction, "op": op, "pid": target if isinstance(target, int) else None,
                            "t": now})
        if len(self.events) > 10_000:
            del self.events[:5_000]
        frames = [bytes(f.buffer) if isinstance(f, zmq.Frame) else f for f in frames]
        key = (route.name, peer.identity, direction)
        if rule.action == "drop":
            return True
        if rule.action == "delay":
            self._hold(key, now + rule.delay_ms / 1000, sock, frames)
            return True
        if rule.action == "duplicate":
            self._deliver(sock, frames, key)
            self._later(now + rule.delay_ms / 1000, "send", (sock, frames, key))
            return True
        if rule.action == "corrupt":
            data = bytearray(frames[-1])
            if data:
                data[self.rng.randrange(len(data))] ^= 0xFF
            self._deliver(sock, [*frames[:-1], bytes(data)], key)
            return True
        if rule.action == "reorder":
            self._hold(key, now + max(rule.delay_ms, 1) / 1000, sock, frames)
            self.overtake[(route.name, direction)].add(key)
            return True
        if rule.action == "kill":
            self._signal(target, signal.SIGKILL)
            self.allowed.discard(target)
            if rule.forward:
                self._deliver(sock, frames, key)
            return True
        # stop
        self._signal(target, signal.SIGSTOP)
        self.stopped.add(target)
        resume = now + rule.stop_ms / 1000
        self._later(resume, "cont", target)
        if rule.hold:
            self._hold(key, resume + 0.001, sock, frames)
        elif rule.forward:
            self._deliver(sock, frames, key)
        return True

    def _signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _later(self, due: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.timers, (due, next(self._seq), kind, payload))

    def _hold(self, key: tuple, due: float, sock: zmq.Socket, frames: list) -> None:
        """Hold a frame until ``due``; the connection's later frames wait behind it."""
        gate = self.gates.setdefault(key, [])
        gate.append([due, sock, frames])
        if len(gate) == 1:
            self._later(due, "gate", key)

    def _deliver(self, sock: zmq.Socket, frames: list, key: tuple) -> None:
        gate = self.gates.get(key)
        if gate:
            gate.append([0.0, sock, frames])   # behind what this connection has held
            return
        self._send(sock, frames, key)
        waiting = self.overtake.get((key[0], key[2]))
        if waiting:
            # a frame of this connection overtook the held ones of other
            # connections: they follow a little later (over another connection,
            # "at once" could still arrive first)
            for other in [k for k in waiting if k[1] != key[1]]:
                waiting.discard(other)
                self._later(time.monotonic() + self.OVERTAKE_S, "release", other)

    def _flush(self, key: tuple, force: bool = False) -> None:
        """Send the connection's held frames that are due (all, with ``force``),
        in order, stopping at the first that is not."""
        gate = self.gates.get(key)
        now = time.monotonic()
        while gate and (force or gate[0][0] <= now):
            _, sock, frames = gate.pop(0)
            self._send(sock, frames, key)
        if gate:
            self._later(gate[0][0], "gate", key)
        else:
            self.gates.pop(key, None)

    def _send(self, sock: zmq.Socket, frames: list, key: tuple) -> None:
        if sock.closed:
            return
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            self.forwarded[key[0]] += 1
        except zmq.ZMQError:
            pass   # the peer is gone: as on a real network, the frame is lost

    def _due(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now:
            _, _, kind, payload = heapq.heappop(self.timers)
            if kind == "send":
                self._send(*payload)
            elif kind == "gate":
                self._flush(payload)
            elif kind == "release":
                self._flush(payload, force=True)
            elif kind == "cont" and payload in self.stopped:
                self.stopped.discard(payload)
                self._signal(payload, signal.SIGCONT)

    def _collect_idle(self, now: float) -> None:
        for peer in [p for p in self.peers.values() if now - p.last > self.IDLE_S]:
            self._close_peer(peer)

    # ------------------------------------------------------------------ loop

    def _drain(self, sock: zmq.Socket, now: float) -> None:
        if sock is self.control:
            while True:
                try:
                    self._on_control(sock.recv_multipart(flags=zmq.NOBLOCK))
                except zmq.Again:
                    return
        route = self.fronts.get(sock)
        peer = self.dealers.get(sock) if route is None else None
        for _ in range(256):
            # a socket closed while this poll's events are handled (its route
            # or peer went) is skipped
            if sock.closed or (route is None and peer is None):
                return
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if route is not None:
                self._on_request(route, frames, now)
            else:
                self._on_reply(peer, frames, now)

    def serve(self) -> None:
        next_gc = time.monotonic() + self.IDLE_S
        try:
            while self.running:
                now = time.monotonic()
                wait = 20
                if self.timers:
                    wait = max(0, min(wait, int((self.timers[0][0] - now) * 1000) + 1))
                events = self.poller.poll(wait)
                now = time.monotonic()
                for sock, _ in events:
                    try:
                        self._drain(sock, now)
                    except Exception:   # a harness bug: say so, keep the network up
                        traceback.print_exc()
                self._due(time.monotonic())
                if now > next_gc:
                    self._collect_idle(now)
                    next_gc = now + self.IDLE_S / 4
        finally:
            for pid in list(self.stopped):
                self._signal(pid, signal.SIGCONT)
            self.ctx.destroy(linger=0)


class ProxyControl:
    """The harness's side of the proxy's control socket."""

    def __init__(self, endpoint: str, context: Optional[zmq.Context] = None, timeout: float = 10.0) -> None:
        self.ctx = context or zmq.Context.instance()
        self.endpoint = endpoint
        self.timeout = timeout
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        return sock

    def call(self, cmd: str, **args: Any) -> dict:
        self.sock.send_multipart([b"", msgpack.packb({"cmd": cmd, **args}, use_bin_type=True)])
        if not self.sock.poll(int(self.timeout * 1000)):
            self.sock.close(linger=0)
            self.sock = self._connect()
            raise TimeoutError(f"the fault proxy did not answer {cmd!r}")
        reply = msgpack.unpackb(self.sock.recv_multipart()[-1], raw=False, strict_map_key=False)
        if not reply.get("ok"):
            raise RuntimeError(f"fault proxy: {reply.get('error')}")
        return reply

    def route(self, name: str, backend: str, frontend: str = "tcp://127.0.0.1:*") -> str:
        return self.call("route", name=name, frontend=frontend, backend=backend)["frontend"]

    def rule(self, **spec: Any) -> int:
        return self.call("rule", rule=spec)["id"]

    def close(self) -> None:
        self.sock.close(linger=0)


def main(argv: list[str]) -> int:
    control = argv[0] if argv else "tcp://127.0.0.1:*"
    seed = int(argv[1]) if len(argv) > 1 else 0
    proxy = Proxy(control, seed)
    print(f"kvproto fault proxy control on {proxy.control_address}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: setattr(proxy, "running", False))
    proxy.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
