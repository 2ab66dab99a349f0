"""The fault matrix's proxy (kvproto/checking/chaos/proxy.py): each action on
the frame its rule picks, between a DEALER client and a ROUTER server."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvproto.checking.chaos.proxy import Proxy, ProxyControl, pid_of
from kvproto.runtime import wire

pytestmark = pytest.mark.faults


class Server(threading.Thread):
    """Answers every request with its op and request id (and a grant for put_start)."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.seen: list[tuple[str, int]] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            if not self.sock.poll(20):
                continue
            identity, header, *_ = self.sock.recv_multipart()
            _, op, rid, body = wire.msgpack.unpackb(header, raw=False)
            self.seen.append((op, rid))
            reply = {"op": op}
            if op == "put_start" and body.get("columns"):
                n = len(body["items"])
                reply["columns"] = {"token": [40 + i for i in range(n)], "errors": [],
                                    "segment": ["seg-a", "seg-b"] * n, "offset": [0, 0] * n,
                                    "direct": b"\0\0" * n}
            elif op == "put_start":
                reply["items"] = [[0, {"token": 40 + i, "replicas": [["seg-a", 0, 9], ["seg-b", 0, 9]]}]
                                  for i, _ in enumerate(body["items"])]
            elif op == "put_end" and body.get("columns"):   # the refused keys only
                reply["errors"] = [[i, 5, "stale"] for i, item in enumerate(body["items"])
                                   if item[0] == b"c"]
            elif op == "put_end":
                reply["items"] = [[5, "stale"] if item[0] == b"c" else [0, None]
                                  for item in body["items"]]
            self.sock.send_multipart([identity, wire.encode_reply(rid, 0, reply)])


@pytest.fixture
def net():
    ctx = zmq.Context()
    proxy = Proxy("tcp://127.0.0.1:*", seed=1)
    thread = threading.Thread(target=proxy.serve, daemon=True)
    thread.start()
    control = ProxyControl(proxy.control_address, ctx)
    server = Server(ctx)
    server.start()
    front = control.route("node", server.address)
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(front)
    yield control, server, client
    control.call("quit")
    thread.join(5)
    server.running = False
    server.join(5)
    client.close()
    ctx.destroy(linger=0)


def send(sock, op: str, rid: int, body=None) -> None:
    sock.send(wire.encode_request(op, rid, body or {}))


def replies(sock, expect: int = 0, wait: float = 3.0) -> list[int]:
    """The request ids answered: ``expect`` of them (or all that come within
    ``wait``), then whatever else arrives in the next 100 ms."""
    out, deadline = [], time.monotonic() + wait
    while len(out) < expect and sock.poll(max(int((deadline - time.monotonic()) * 1000), 1)):
        out.append(wire.decode_reply(sock.recv_multipart()).request_id)
    while sock.poll(100):
        out.append(wire.decode_reply(sock.recv_multipart()).request_id)
    return out


def test_frames_pass_through_both_ways(net):
    control, server, client = net
    for rid in (1, 2, 3):
        send(client, "read", rid)
    assert replies(client, 3) == [1, 2, 3]
    assert server.seen == [("read", 1), ("read", 2), ("read", 3)]


def test_drop_the_nth_matching_request_only(net):
    control, server, client = net
    control.rule(ops="write", direction="request", nth=2, action="drop")
    for rid, op in enumerate(["write", "read", "write", "write"], 1):
        send(client, op, rid)
    assert replies(client, 3) == [1, 2, 4]


def test_delay_duplicate_and_reorder(net):
    control, server, client = net
    control.rule(ops="read", direction="reply", action="delay", delay_ms=300)
    started = time.monotonic()
    send(client, "read", 1)
    assert replies(client, 1) == [1] and time.monotonic() - started >= 0.3
    control.rule(ops="stats", direction="request", action="duplicate", delay_ms=10)
    send(client, "stats", 2)
    assert replies(client, 2) == [2, 2]
    # a delayed frame holds back the later frames of its connection (TCP keeps order)
    control.rule(ops="read", direction="request", action="delay", delay_ms=200)
    send(client, "read", 3)
    send(client, "stats", 4)
    assert replies(client, 2) == [3, 4]


def test_reorder_lets_another_connection_overtake(net):
    control, server, client = net
    other = zmq.Context.instance().socket(zmq.DEALER)
    other.linger = 0
    other.connect(client.getsockopt(zmq.LAST_ENDPOINT).decode())
    try:
        control.rule(ops="free", direction="request", action="reorder", delay_ms=2000)
        send(client, "free", 1)
        send(client, "assign", 2)          # same connection: stays behind the free
        time.sleep(0.2)
        assert server.seen == []
        send(other, "stats", 3)            # another connection overtakes
        assert replies(other, 1) == [3]
        assert replies(client, 2) == [1, 2]
        assert [rid for _, rid in server.seen] == [3, 1, 2]
    finally:
        other.close()


def test_a_partition_drops_everything_for_a_while(net):
    control, server, client = net
    control.rule(action="drop", count=0, for_ms=300)
    send(client, "read", 1)
    assert replies(client) == []
    time.sleep(0.3)
    send(client, "read", 2)
    assert replies(client, 1) == [2]


def test_clear_heals_and_counts_what_fired(net):
    control, server, client = net
    control.rule(ops="read", action="delay", delay_ms=60_000, name="cell:slow")
    send(client, "read", 1)
    assert replies(client) == []
    assert control.call("clear")["fired"] == {"cell:slow": 1}
    assert replies(client, 1) == [1]                     # what was held is delivered


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_kill_and_stop_the_process_named_in_the_frame(net):
    control, server, client = net
    victim = _child("import time; time.sleep(60)")
    try:
        client_id = f"host:{victim.pid}:abc"
        assert pid_of(client_id) == victim.pid and pid_of(client_id + "/put") == victim.pid
        # a pid the harness did not allow is never signalled
        control.rule(ops="put_end", action="kill", target="sender")
        send(client, "put_end", 1, {"client": client_id, "items": [[b"k", 1]]})
        assert replies(client, 1) == [1] and victim.poll() is None
        control.call("clear")
        control.call("allow", pids=[victim.pid])
        control.rule(ops="put_end", action="stop", target="sender", stop_ms=400, hold=True)
        send(client, "put_end", 2, {"client": client_id, "items": [[b"k", 1]]})
        time.sleep(0.15)
        assert _state(victim.pid) == "T"              # stopped, its frame held
        assert replies(client, 1) == [2]              # delivered after SIGCONT
        assert _state(victim.pid) != "T"
        control.rule(ops="put_end", action="kill", target="sender")
        send(client, "put_end", 3, {"client": client_id, "items": [[b"k", 1]]})
        assert replies(client) == []                  # the kill rule: killed, frame dropped
        assert victim.wait(5) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("refused_only", [False, True])
def test_placements_of_acknowledged_puts(net, columns, refused_only):
    """A put's placement is learned from its grant, answered as items or as
    columns, once its put_end is acknowledged, answered by an item per key or
    (asked with ``columns``) by the refused keys only."""
    control, server, client = net
    send(client, "put_start", 1, {"client": "c", "replicas": 2,
                                  "items": [[b"a", 9], [b"b", 9], [b"c", 9]], "columns": columns})
    # the fake master refuses c's put_end
    send(client, "put_end", 2, {"client": "c", "items": [[b"b", 41], [b"c", 42]],
                                **({"columns": True} if refused_only else {})})
    assert replies(client, 2) == [1, 2]
    assert control.call("placements")["placements"] == {b"b": ["seg-a", "seg-b"]}


def test_a_reader_is_learned_from_a_read_begin_answered_as_items_or_as_columns():
    """The proxy learns which client a read token was granted to (its rules
    pick a ``read`` by its reader) from either shape of the reply."""
    from collections import OrderedDict
    proxy = Proxy.__new__(Proxy)       # no sockets: only what the learning keeps
    proxy.token_pid = OrderedDict()
    proxy._learn("read_begin", 7, True, {"columns": {"token": [5, 0, 6]}})
    proxy._learn("read_begin", 8, True, {"items": [[0, {"token": 9}], [1, "no such key"]]})
    assert dict(proxy.token_pid) == {5: 7, 6: 7, 9: 8}
