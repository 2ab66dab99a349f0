"""Prefill -> decode hand-off on the runtime (kvproto.engines.handoff): a
prefill side stores a request's KV in the hand-off's own key space, the
decode side takes it over (bounded attempts, every part checked) and
acknowledges by removing it; a failed take-over falls back to recomputing
within the process's budget, then is refused; expired hand-offs are swept,
never from under a take-over's read; publishing into the long-term cache is
the request's choice. Last, two engine processes on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvproto
from kvproto import errors
from kvproto.engines.chunks import ChunkStore
from kvproto.engines.handoff import PREFIX, HandoffReceiver, HandoffSender, sweep
from kvproto.engines.prefix import Namespace
from kvproto.statemachines.failover import RecomputeLimiter

REPO = Path(kvproto.__file__).resolve().parent.parent
CHUNK, TOKEN_BYTES = 16, 64
NS = Namespace("fake-model", "rev", "fake1:B16:64-bytes-per-token")


def payload(chunk, group: int) -> bytes:
    seed = hashlib.blake2b(chunk.digest + bytes([group]), digest_size=64).digest()
    return (seed * (chunk.tokens * TOKEN_BYTES // 64))[:chunk.tokens * TOKEN_BYTES]


def parts_of(store, chunks, groups=2):
    out = []
    for c in chunks:
        for g in range(groups):
            obj = store.new_object(c.tokens * TOKEN_BYTES)
            obj.payload[:] = np.frombuffer(payload(c, g), dtype=np.uint8)
            out.append((c, 0, g, obj))
    return out


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="32MiB") as c:
        yield c


@pytest.fixture
def sides(cluster):
    made = []

    def make(layout=NS.layout, **kw):
        ns = Namespace(NS.model, NS.revision, layout, layer_groups=2)
        store = ChunkStore(cluster.client(), ns, CHUNK * TOKEN_BYTES, timeout=2.0)
        made.append(store)
        return store
    yield make
    for s in made:
        s.close()


def tokens(seed: int, n: int = 70) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50000, n).tolist()


def collect(chunks):
    got = {}

    def sink(i, g, view):
        got[i, g] = bytes(view)
    return got, sink


def handoff_keys(client, request: str = "") -> list:
    return [k for k in client.keys(PREFIX.encode()) if f"/{request}/".encode() in k or not request]


def test_a_take_over_gets_every_part_then_consumes_the_hand_off(sides):
    prefill, decode = sides(), sides()
    chunks = prefill.namespace.chunks(tokens(1), CHUNK)          # 4 full chunks and 6 tokens
    sender = HandoffSender(prefill, ttl=30)
    descriptor = sender.offer("req-1", 70, parts_of(prefill, chunks), groups=2)
    assert json.loads(json.dumps(descriptor)) == descriptor       # the router passes it as JSON
    assert len(handoff_keys(prefill.client, "req-1")) == 5 * 2 + 1
    got, sink = collect(chunks)
    result = HandoffReceiver(decode).take(descriptor, chunks, sink)
    assert result.taken and result.attempts == 1
    assert all(got[c.index, g] == payload(c, g) for c in chunks for g in range(2))
    assert handoff_keys(prefill.client, "req-1") == []            # consumed once
    assert prefill.lookup(chunks) == 0                            # never in the long-term cache


def test_publishing_into_the_long_term_cache_is_the_requests_choice(sides):
    prefill, decode = sides(), sides()
    chunks = prefill.namespace.chunks(tokens(2), CHUNK)
    descriptor = HandoffSender(prefill).offer("req-2", 70, parts_of(prefill, chunks), groups=2,
                                              publish_chunks=4)
    got, sink = collect(chunks)
    assert HandoffReceiver(decode).take(descriptor, chunks, sink).taken
    assert handoff_keys(prefill.client, "req-2") == []
    assert decode.lookup(chunks) == 4          # the long-term copy outlives the hand-off
    got2, sink2 = collect(chunks)
    assert decode.load(chunks[:4], sink2).usable == 4 and got2[3, 1] == payload(chunks[3], 1)


def test_a_decode_side_that_arrives_first_retries_until_the_hand_off_is_there(sides):
    prefill, decode = sides(), sides()
    chunks = prefill.namespace.chunks(tokens(3), CHUNK)
    sender = HandoffSender(prefill, ttl=30)
    descriptor = sender.offer("req-3", 70, parts_of(prefill, chunks), groups=2)
    ticket = bytes(prefill.client.get(f"{PREFIX}/default/{descriptor['expiry_ms']:013d}/req-3/t"))
    prefill.client.remove(f"{PREFIX}/default/{descriptor['expiry_ms']:013d}/req-3/t")   # not offered yet
    timer = threading.Timer(0.25, lambda: prefill.client.put(
        f"{PREFIX}/default/{descriptor['expiry_ms']:013d}/req-3/t", ticket))
    timer.start()
    got, sink = collect(chunks)
    result = HandoffReceiver(decode, attempts=10, retry_interval=0.1).take(descriptor, chunks, sink)
    timer.join()
    assert result.taken and 2 <= result.attempts <= 10
    assert all(isinstance(f, errors.KeyNotFound) for f in result.failures)


def test_failed_take_overs_recompute_within_the_shared_budget_then_are_refused(sides):
    prefill, decode = sides(), sides()
    budget = RecomputeLimiter(rate=0.0, burst=1.0)

    def may_recompute():
        nonlocal budget
        budget, allowed = budget.take(time.monotonic())
        return allowed

    receiver = HandoffReceiver(decode, attempts=2, retry_interval=0.01, may_recompute=may_recompute)
    outcomes = []
    for n in (4, 5):
        chunks = prefill.namespace.chunks(tokens(n), CHUNK)
        descriptor = HandoffSender(prefill).offer(f"req-{n}", 70, parts_of(prefill, chunks), groups=2)
        prefill.client.remove(prefill.key(chunks[1], 0, 1, namespace=_keys(descriptor)))   # a part lost
        got, sink = collect(chunks)
        outcomes.append(receiver.take(descriptor, chunks, sink))
    assert [o.outcome for o in outcomes] == ["recompute", "refused"]
    assert all(o.attempts == 2 for o in outcomes)
    assert isinstance(outcomes[1].error, errors.RecomputeLimited)
    assert all(isinstance(f, errors.KeyNotFound) for o in outcomes for f in o.failures)


def _keys(descriptor):
    from kvproto.engines.handoff import HandoffKeys
    return HandoffKeys.of(descriptor)


def test_a_hand_off_of_another_layout_is_refused(sides):
    prefill, decode = sides(), sides(layout="fake1:B16:another")
    chunks = prefill.namespace.chunks(tokens(6), CHUNK)
    descriptor = HandoffSender(prefill).offer("req-6", 70, parts_of(prefill, chunks), groups=2)
    result = HandoffReceiver(decode, attempts=1, may_recompute=lambda: True).take(descriptor, chunks,
                                                                                 lambda *a: None)
    assert result.outcome == "recompute"
    assert isinstance(result.failures[0], errors.LayoutMismatch)


def test_expired_hand_offs_are_swept_but_never_from_under_a_read(sides):
    prefill = sides()
    client = prefill.client
    chunks = prefill.namespace.chunks(tokens(7), CHUNK)
    now = [1000.0]
    sender = HandoffSender(prefill, ttl=5, clock=lambda: now[0])
    descriptor = sender.offer("req-7", 70, parts_of(prefill, chunks), groups=2)
    assert sweep(client, now=now[0]) == set()               # retained: not acked, not expired
    now[0] += 5.5                                           # past the TTL, within the clock error
    assert sweep(client, now=now[0]) == set()
    now[0] += 1.0
    ticket = _keys(descriptor).ticket
    (lease,) = client.read_begin([ticket])                  # a take-over is reading it
    assert sender.sweep() == set() and len(handoff_keys(client, "req-7")) == 11
    client.release([lease])
    assert sender.sweep() == {"req-7"} and sender.retention == {}
    assert handoff_keys(client, "req-7") == []
    # parts whose ticket is gone (a reclaim cut short) are found by their keys
    descriptor = sender.offer("req-8", 70, parts_of(prefill, chunks), groups=2)
    client.remove(_keys(descriptor).ticket)
    now[0] += 7
    assert sender.sweep() == {"req-8"} and handoff_keys(client, "req-8") == []


def test_bad_names_and_descriptors_are_refused(sides):
    prefill = sides()
    with pytest.raises(errors.InvalidArgument):
        HandoffSender(prefill).offer("a/b", 1, [])
    with pytest.raises(errors.InvalidArgument):
        HandoffSender(prefill, tenant="")
    with pytest.raises(errors.InvalidArgument):
        HandoffReceiver(prefill).take({"request": "x"}, [], lambda *a: None)


# --------------------------------------------------------------------------- two processes

_ENGINE = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import kvproto
    from kvproto.engines.chunks import ChunkStore
    from kvproto.engines.handoff import HandoffReceiver, HandoffSender
    from test_handoff_runtime import CHUNK, TOKEN_BYTES, NS, parts_of, payload, tokens
    from kvproto.engines.prefix import Namespace
    role, master = sys.argv[1], sys.argv[2]
    ns = Namespace(NS.model, NS.revision, NS.layout, layer_groups=2)
    with kvproto.Client(master) as client:
        store = ChunkStore(client, ns, CHUNK * TOKEN_BYTES, timeout=5.0)
        for line in sys.stdin:
            job = json.loads(line)
            chunks = ns.chunks(tokens(job["seed"]), CHUNK)
            if role == "prefill":
                d = HandoffSender(store, ttl=job["ttl"]).offer(job["request"], 70, parts_of(store, chunks),
                                                               groups=2, publish_chunks=job["publish"])
                print(json.dumps(d), flush=True)
            else:
                got = {}
                result = HandoffReceiver(store, attempts=3, retry_interval=0.05).take(
                    job["descriptor"], chunks, lambda i, g, v: got.__setitem__((i, g), bytes(v)))
                good = result.taken and all(got[c.index, g] == payload(c, g) for c in chunks for g in range(2))
                print(json.dumps({"outcome": result.outcome, "attempts": result.attempts,
                                  "bytes_ok": good}), flush=True)
        store.close()
""")


class Engine:
    def __init__(self, role: str, master: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-c", _ENGINE, role, master], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.mark.runtime
def test_two_engine_processes_on_loopback(cluster):
    prefill, decode = Engine("prefill", cluster.master_address), Engine("decode", cluster.master_address)
    client = cluster.client()
    try:
        d = prefill.ask({"seed": 10, "request": "p1", "ttl": 30, "publish": 0})
        assert decode.ask({"seed": 10, "descriptor": d}) == {"outcome": "taken", "attempts": 1, "bytes_ok": True}
        assert handoff_keys(client, "p1") == []
        # the decode side got another prompt's descriptor: the ticket does not match it
        d = prefill.ask({"seed": 11, "request": "p2", "ttl": 30, "publish": 4})
        out = decode.ask({"seed": 12, "descriptor": d})
        assert out["outcome"] == "recompute" and out["attempts"] == 3
        # the hand-off the wrong reader could not use is still there for the right one
        out = decode.ask({"seed": 11, "descriptor": d})
        assert out == {"outcome": "taken", "attempts": 1, "bytes_ok": True}
        assert handoff_keys(client, "p2") == []
    finally:
        prefill.close()
        decode.close()
