"""Requests of one call in flight together (``window``). Lookups
(``ClientLink._lookups``): a call of more keys than ``batch`` sends several
requests before the first answer is read; answers are matched to their
requests whatever order they arrive in, a request the master did not serve is
asked again alone, and a ``get_many`` that fails lets go of what the requests
already sent took. Puts: the next chunk's ``put_start`` goes before this
chunk's writes and ``put_end``; one left unanswered is abandoned and asked
again."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

import kvproto
from kvproto import errors
from kvproto.runtime import datapath, wire


def _fake_master(answer):
    """A master that collects ``exists`` requests and, each time one arrives,
    calls ``answer(waiting)`` (the requests not answered yet, oldest first,
    each ``(identity, request)``): it returns the ones to answer now, each
    ``(identity, request, status)``. Replies say every key is found. Records
    the most requests ever waiting at once in ``most[0]`` and every request's
    keys in ``asked``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    waiting: list = []
    most, asked = [0], []

    def serve():
        while not stop.is_set():
            if not sock.poll(20):
                continue
            identity, *frames = sock.recv_multipart()
            req = wire.decode_request(frames, wire.MASTER_MAX_HEADER, 0)
            if req.op != "exists":
                continue
            asked.append(list(req.body["keys"]))
            waiting.append((identity, req))
            most[0] = max(most[0], len(waiting))
            for identity, req, status in answer(list(waiting)):
                waiting.remove((identity, req))
                body = {"found": b"\1" * len(req.body["keys"])} if status == 0 else \
                    {"message": "not open"}
                sock.send_multipart([identity, wire.encode_reply(req.request_id, status, body)])
        sock.close(linger=0)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", stop, most, asked


KEYS = [b"k%d" % i for i in range(12)]


@pytest.fixture
def cluster_of_one():
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB") as cluster:
        yield cluster


@pytest.mark.parametrize("window", [1, 2, 3])
def test_answers_in_reverse_order_are_matched_to_their_requests(window):
    """The master answers only once ``window`` requests wait, newest first:
    no answer is dropped while an older one is awaited, and no more than
    ``window`` requests are ever in flight."""
    def answer(waiting):
        if len(waiting) < window and len(asked) < 4:    # 12 keys, 3 a request
            return []
        return [(i, r, 0) for i, r in reversed(waiting)]
    address, stop, most, asked = _fake_master(answer)
    c = kvproto.Client(address, batch=3, window=window, lookup_timeout=5.0)
    try:
        t = time.monotonic()
        assert c.exists_many(KEYS) == [True] * 12
        assert time.monotonic() - t < 2.5           # no answer waited out lookup_timeout
        assert asked == [KEYS[at:at + 3] for at in range(0, 12, 3)]
        assert most[0] == window
    finally:
        c.close()
        stop.set()


def test_a_request_the_master_did_not_serve_is_asked_again_alone():
    """The second of three requests in flight is answered ``MasterNotOpen``
    once: the others' answers are kept, and that one is sent again."""
    refused = []

    def answer(waiting):
        out = []
        for identity, req in waiting:
            if req.body["keys"] == KEYS[4:8] and not refused:
                refused.append(req.request_id)
                out.append((identity, req, errors.MasterNotOpen.code))
            else:
                out.append((identity, req, 0))
        return out
    address, stop, most, asked = _fake_master(answer)
    c = kvproto.Client(address, batch=4, window=3, lookup_timeout=5.0)
    try:
        assert c.exists_many(KEYS) == [True] * 12
        assert asked == [KEYS[0:4], KEYS[4:8], KEYS[8:12], KEYS[4:8]]
    finally:
        c.close()
        stop.set()


def test_batch_and_window_are_checked():
    for kwargs in ({"batch": 0}, {"batch": wire.MAX_BATCH + 1}, {"window": 0}, {"window": 1.5}):
        with pytest.raises(errors.InvalidArgument):
            kvproto.Client("tcp://127.0.0.1:1", **kwargs)


@pytest.mark.parametrize("leases", [True, False], ids=["leases", "pins"])
def test_a_failed_get_many_lets_go_of_the_lookups_in_flight(monkeypatch, leases):
    """The second of five lookups fails while the third and fourth are in
    flight: the fifth is never sent, and the master holds nothing of the
    client's afterwards (the leases released, the pins ended)."""
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB") as cluster:
        c = cluster.client(batch=2, window=2, leases=leases)
        keys = [b"p%d" % i for i in range(10)]
        assert c.put_many([(k, b"v" * 64) for k in keys]) == [None] * 10
        sent = []
        c.observe = lambda op, s: sent.append(op)
        real = datapath.read_all

        def read_all(client, ks, *args):
            if ks == keys[2:4]:
                raise errors.ChecksumMismatch("the second lookup's read")
            return real(client, ks, *args)
        monkeypatch.setattr(datapath, "read_all", read_all)
        with pytest.raises(errors.ChecksumMismatch):
            c.get_many(keys)
        assert sent == ["read_begin"] * 4
        c.flush_releases()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = cluster.stats()
            if stats["leases"]["held"] == 0 and stats["clients"] == 0:
                break
            time.sleep(0.05)
        assert stats["leases"]["held"] == 0 and stats["clients"] == 0, stats
        monkeypatch.undo()
        assert [bytes(v) for v in c.get_many(keys)] == [b"v" * 64] * 10


def test_the_next_chunks_put_start_goes_before_this_chunks_put_end(cluster_of_one):
    c = cluster_of_one.client(batch=2, window=2)
    sent, send = [], c._send

    def recording(sock, op, body, *args):
        if op in ("put_start", "put_end"):
            sent.append(op)
        return send(sock, op, body, *args)
    c._send = recording
    items = [(b"in/%d" % i, b"v" * 100) for i in range(6)]
    assert c.put_many(items) == [None] * 6
    assert sent == ["put_start", "put_start", "put_end", "put_start", "put_end", "put_end"]
    assert [bytes(v) for v in c.get_many([k for k, _ in items])] == [b"v" * 100] * 6
    c.window = 1
    sent.clear()
    assert c.put_many([(b"one/%d" % i, b"w") for i in range(4)]) == [None] * 4
    assert sent == ["put_start", "put_end"] * 2


def test_a_put_start_sent_ahead_and_left_unanswered_is_abandoned_and_asked_again(
        cluster_of_one):
    """The master granted the second chunk's attempts, but (as if its answer
    were lost) the client gets nothing: it abandons them and asks again, and
    every key is stored, none refused ``KeyExists``."""
    c = cluster_of_one.client(batch=2, window=2, lookup_timeout=1.0)
    awaited = c._await_master
    dropped = []

    def losing_the_first_ahead(sock, rid, *args):
        ahead = rid in c._early
        reply = awaited(sock, rid, *args)
        if ahead and not dropped:
            dropped.append(rid)
            return None
        return reply
    c._await_master = losing_the_first_ahead
    items = [(b"lost/%d" % i, b"v" * 100) for i in range(6)]
    assert c.put_many(items) == [None] * 6
    assert dropped
    assert c.exists_many([k for k, _ in items]) == [True] * 6
    assert cluster_of_one.stats()["pending"] == 0


def _recording(c, monkeypatch):
    """Record on ``c`` each request sent (``("send", op, rid)``), each answer
    awaited (``("await", op, rid)``) and each chunk written (``("write",
    first key)``) in ``events``."""
    events, ops = [], {}
    send, awaited, write_all = c._send, c._await_master, datapath.write_all

    def sending(sock, op, body, *args):
        rid = send(sock, op, body, *args)
        ops[rid] = op
        events.append(("send", op, rid))
        return rid

    def awaiting(sock, rid, *args):
        events.append(("await", ops.get(rid), rid))
        return awaited(sock, rid, *args)

    def writing(client, grants, *args):
        events.append(("write", min(g[0] for g in grants.values())))
        return write_all(client, grants, *args)
    monkeypatch.setattr(c, "_send", sending)
    monkeypatch.setattr(c, "_await_master", awaiting)
    monkeypatch.setattr(datapath, "write_all", writing)
    return events


def test_a_chunks_put_end_is_answered_while_the_next_chunk_is_written(cluster_of_one,
                                                                       monkeypatch):
    """With a window, chunk n's ``put_end`` goes out after its writes and its
    answer is awaited only after chunk n+1's writes, before chunk n+1's own
    ``put_end``; the last chunk's is awaited at once, and none is left."""
    c = cluster_of_one.client(batch=2, window=2)
    events = _recording(c, monkeypatch)
    items = [(b"end/%d" % i, b"v" * 100) for i in range(6)]
    assert c.put_many(items) == [None] * 6
    ends = [e for e in events if e[0] == "send" and e[1] == "put_end"]
    writes = [e for e in events if e[0] == "write"]
    assert [w[1] for w in writes] == [b"end/0", b"end/2", b"end/4"]
    for n, (_, _, rid) in enumerate(ends):
        sent, awaited = events.index(ends[n]), events.index(("await", "put_end", rid))
        assert events.index(writes[n]) < sent < awaited
        if n + 1 < len(ends):
            assert events.index(writes[n + 1]) < awaited < events.index(ends[n + 1])
    assert not c._early
    assert c.exists_many([k for k, _ in items]) == [True] * 6


def test_a_put_end_sent_ahead_that_goes_unanswered_fails_its_keys_and_revokes_them(
        cluster_of_one, monkeypatch):
    """The first chunk's ``put_end`` gets no answer and asking again fails:
    its keys get that error (not a success by default) and their attempts are
    revoked; the other chunks are stored."""
    c = cluster_of_one.client(batch=2, window=2)
    events = _recording(c, monkeypatch)
    awaited, call = c._await_master, c._call_master
    revoked = []

    def losing_the_first_put_end(sock, rid, *args):
        reply = awaited(sock, rid, *args)
        ends = [e[2] for e in events if e[:2] == ("send", "put_end")]
        return None if ends and rid == ends[0] else reply

    def failing_put_end_again(op, body, *args, **kw):
        if op == "put_end" and body["items"][0][0] == b"unended/0":
            raise errors.RequestTimeout("no answer")
        if op == "put_revoke":
            revoked.extend(k for k, _ in body["items"])
        return call(op, body, *args, **kw)
    monkeypatch.setattr(c, "_await_master", losing_the_first_put_end)
    monkeypatch.setattr(c, "_call_master", failing_put_end_again)
    items = [(b"unended/%d" % i, b"v" * 100) for i in range(6)]
    results = c.put_many(items)
    assert [type(r) for r in results[:2]] == [errors.RequestTimeout] * 2
    assert results[2:] == [None] * 4
    assert sorted(revoked) == [b"unended/0", b"unended/1"]
    assert not c._early
