"""Where a batch-1 same-host put and get spend their time, hop by hop.

    PYTHONPATH=. python bench/timeline.py [--puts 2000] [--batch 1] [--json out.json]

Starts a master and a storage node as processes (as ``kvproto bench`` does),
each with a few hooks that note ``time.monotonic_ns()`` (one clock for every
process of the host) when it receives a message and when it sends one, and
runs ``--puts`` 4 KiB puts in calls of ``--batch`` keys, then as many gets,
from this process with the same hooks in the client. Per call each event's
time is taken from the call's start (a client event: its last in the call; a
master's or node's: its first); the table shows the
median over all puts of each event, the step from the previous event, and
the median round trip of raw pyzmq (a DEALER to a ROUTER in another process
that answers at once) in the same run, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# Hooks put into the master's and the storage node's process before their
# main runs: each notes (ns, event) in memory and writes them out on exit.
_PRELUDE = r"""
import atexit, os, sys, time
_ev = []
_note = lambda what: _ev.append((time.monotonic_ns(), what))
def _dump():
    with open(os.environ["KVP_TIMELINE"], "w") as f:
        for t, what in _ev:
            f.write(f"{t} {what}\n")
atexit.register(_dump)
from kvproto.runtime import master_server as _ms, storage_server as _ss, master as _m
def _wrap(cls, name, before=None, after=None):
    inner = getattr(cls, name)
    def hooked(self, *a, **k):
        if before: before(self, *a)
        try:
            return inner(self, *a, **k)
        finally:
            if after: after(self, *a)
    setattr(cls, name, hooked)
_asked = {}
def _m_recv(self, frames):
    from kvproto.runtime import wire
    try:
        req = wire.decode_request(frames[1:], 1 << 20, 0, wire.MASTER_OPS)
    except Exception:
        return
    _asked[(frames[0].bytes, req.request_id)] = req.op
    _note("master_recv_" + req.op)
_wrap(_ms.MasterServer, "_on_request", before=_m_recv)
def _m_out(self):
    # noted as the sends start: a process preempted right after a send
    # would otherwise note it late
    for _, op, _, _ in self.core.outbox:
        _note("master_sent_" + op)
    for r in self.core.ready:
        _note("master_replied_" + _asked.pop((r[0], r[1]), "?"))
_wrap(_ms.MasterServer, "_send_out", before=_m_out)
_inner_reply = _m.MasterCore.storage_reply
def _storage_reply(self, segment, reply):
    cmd = self._commands.get(reply.request_id)
    _note("master_ack_" + (cmd.op if cmd is not None else "?"))
    return _inner_reply(self, segment, reply)
_m.MasterCore.storage_reply = _storage_reply
def _n_recv(self, frames):
    from kvproto.runtime import wire
    try:
        op = wire.decode_request(frames[1:], 1 << 20, 1 << 40, self.ops).op
    except Exception:
        op = "?"
    self._kvp_op = op
    _note("node_recv_" + op)
def _n_send(self, frames):
    _note("node_replied_" + self._kvp_op)
_wrap(_ss.StorageServer, "_on_request", before=_n_recv)
_wrap(_ss.StorageServer, "_send", before=_n_send)
sys.argv = ["kvproto"] + sys.argv[1:]
from kvproto.cli import main
sys.exit(main())
"""

_RAW = r"""
import zmq
ctx = zmq.Context.instance()
r = ctx.socket(zmq.ROUTER)
port = r.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    frames = r.recv_multipart()
    if frames[1] == b"stop":
        break
    r.send_multipart([frames[0], b"ok"])
"""


def _spawn(args: list[str], log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PRELUDE, *args], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                KVP_TIMELINE=log))


def _raw_rtt(n: int) -> float:
    import zmq
    raw = subprocess.Popen([sys.executable, "-c", _RAW], stdout=subprocess.PIPE, text=True)
    port = int(raw.stdout.readline())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload = bytes(4096)
    times = []
    for _ in range(n):
        t0 = time.monotonic_ns()
        sock.send_multipart([b"put", payload])
        sock.recv()
        times.append(time.monotonic_ns() - t0)
    sock.send_multipart([b"stop"])
    sock.close(linger=0)
    raw.wait(5)
    return statistics.median(times) / 1000


def _per_call(client_ev: list, server_ev: list) -> list[dict]:
    """Per client call (from its ``call`` event to its ``done`` event), each
    event's time in microseconds from the call's start; server events falling
    inside the call's window are its."""
    calls, cur = [], None
    for t, what in client_ev:
        if what == "call":
            cur = {"_t0": t, "_end": None, "call": 0.0}
            calls.append(cur)
        elif cur is not None:
            cur[what] = (t - cur["_t0"]) / 1000      # the last of a batch's
            if what == "done":
                cur["_end"] = t
    j = 0
    server_ev = sorted(server_ev)
    for call in calls:
        if call["_end"] is None:
            continue
        while j < len(server_ev) and server_ev[j][0] < call["_t0"]:
            j += 1
        k = j
        while k < len(server_ev) and server_ev[k][0] <= call["_end"]:
            t, what = server_ev[k]
            call.setdefault(what, (t - call["_t0"]) / 1000)
            k += 1
    return [c for c in calls if c["_end"] is not None]


def _table(calls: list[dict]) -> list[tuple[str, float]]:
    names: dict[str, list] = {}
    for c in calls:
        for k, v in c.items():
            if not k.startswith("_"):
                names.setdefault(k, []).append(v)
    rows = [(k, statistics.median(v), statistics.quantiles(v, n=10)[-1])
            for k, v in names.items() if len(v) >= len(calls) * 0.9]
    return sorted(rows, key=lambda r: r[1])


#: spans worth naming: (name, from event, to event)
SPANS = {
    "put": [("put_start round trip (client)", "client_send_put_start", "client_reply_put_start"),
            ("master: put_start received to assign and grant sent", "master_recv_put_start",
             "master_sent_assign"),
            ("writer waits for the assign after the grant", "client_reply_put_start",
             "client_assign_seen"),
            ("memcpy and report", "client_assign_seen", "client_reported"),
            ("put_end round trip (client)", "client_send_put_end", "client_reply_put_end"),
            ("master: put_end received to publish sent", "master_recv_put_end",
             "master_sent_publish"),
            ("publish command to its ack (master)", "master_sent_publish", "master_ack_publish"),
            ("publish ack to the put_end reply (master)", "master_ack_publish", "master_replied_put_end"),
            ("whole put", "call", "done")],
    "get": [("read_begin round trip (client)", "client_send_read_begin", "client_reply_read_begin"),
            ("master: read_begin received to reply", "master_recv_read_begin",
             "master_replied_read_begin"),
            ("after the reply: copy, checks", "client_reply_read_begin", "done"),
            ("whole get", "call", "done")],
}


def _spans(calls: list[dict], spans) -> list[tuple[str, float, float]]:
    out = []
    for name, a, b in spans:
        v = [c[b] - c[a] for c in calls if a in c and b in c]
        if len(v) >= 10:
            out.append((name, statistics.median(v), statistics.quantiles(v, n=10)[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--puts", type=int, default=2000, help="keys put, then read")
    ap.add_argument("--batch", type=int, default=1, help="keys per put_many / get_many")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()


    from kvproto.runtime.client import Client
    from kvproto.runtime.shm import LocalSegment

    ev: list = []
    note = lambda what: ev.append((time.monotonic_ns(), what))   # noqa: E731
    tmp = tempfile.mkdtemp(prefix="kvp_timeline_")
    mlog, nlog = os.path.join(tmp, "master"), os.path.join(tmp, "node")
    master = _spawn(["master", "--listen", "tcp://127.0.0.1:*"], mlog)
    address = master.stdout.readline().split()[-1]
    node = _spawn(["storage", "--master", address, "--size", "64MiB"], nlog)
    node.stdout.readline()
    try:
        client = Client(address, timeout=20.0)
        deadline = time.monotonic() + 20
        while not any(s["live"] for s in client.stats()["segments"].values()):
            if time.monotonic() > deadline:
                raise RuntimeError("storage node did not register")
            time.sleep(0.05)
        # hooks in this process
        cls = type(client)
        inner_send = cls._send

        def _send(self, sock, op, body, payloads=()):
            note("client_send_" + op)
            return inner_send(self, sock, op, body, payloads)
        cls._send = _send
        inner_call = cls._call_master

        def _call(self, op, body, deadline, started=None, meanwhile=None):
            try:
                return inner_call(self, op, body, deadline, started, meanwhile)
            finally:
                note("client_reply_" + op)
        cls._call_master = _call
        inner_write, inner_report = LocalSegment.write, LocalSegment.report_written

        def _write(self, offset, view):
            note("client_assign_seen")
            try:
                return inner_write(self, offset, view)
            finally:
                note("client_memcpy_done")
        LocalSegment.write = _write

        def _report(self, offset, token):
            inner_report(self, offset, token)
            note("client_reported")
        LocalSegment.report_written = _report
        # a read's copy, and a plain get's batch of them
        inner_reads = {name: getattr(LocalSegment, name) for name in ("_seqlocked", "read_many")}
        for name, inner in inner_reads.items():
            def _read(self, *a, inner=inner):
                note("client_copy_start")
                try:
                    return inner(self, *a)
                finally:
                    note("client_copy_done")
            setattr(LocalSegment, name, _read)

        blob = np.ones(4096, dtype=np.uint8)
        keys = [f"tl/{i:08d}".encode() for i in range(args.puts)]
        for k in keys[:50]:            # warm up: sockets, mappings, writer lock
            client.put(b"w" + k, blob)
            client.get(b"w" + k)
        chunks = [keys[i:i + args.batch] for i in range(0, len(keys), args.batch)]
        ev.clear()
        t_put = time.monotonic_ns()
        for chunk in chunks:
            note("call")
            if any(client.put_many([(k, blob) for k in chunk])):
                raise AssertionError("a put failed")
            note("done")
        put_ev, ev[:] = list(ev), []
        t_get = time.monotonic_ns()
        for chunk in chunks:
            note("call")
            if any(v is None for v in client.get_many(chunk)):
                raise AssertionError("a put key was missing")
            note("done")
        get_ev = list(ev)
        t_end = time.monotonic_ns()
        cls._send, cls._call_master = inner_send, inner_call
        LocalSegment.write, LocalSegment.report_written = inner_write, inner_report
        for name, inner in inner_reads.items():
            setattr(LocalSegment, name, inner)
        client.close()
    finally:
        for p in (node, master):
            p.terminate()
            p.wait(10)
    server: list = []
    for path in (mlog, nlog):
        with open(path) as f:
            for line in f:
                t, what = line.split()
                server.append((int(t), what))
        os.unlink(path)
    os.rmdir(tmp)
    raw = _raw_rtt(args.puts)
    out = {"raw_rtt_us": raw,
           "put_per_s": args.puts / ((t_get - t_put) / 1e9),
           "get_per_s": args.puts / ((t_end - t_get) / 1e9),
           "put": _table(_per_call(put_ev, server)),
           "get": _table(_per_call(get_ev, server)),
           "put_spans": _spans(_per_call(put_ev, server), SPANS["put"]),
           "get_spans": _spans(_per_call(get_ev, server), SPANS["get"])}
    print(f"batch {args.batch}; raw pyzmq round trip (4 KiB request, 2-byte reply): "
          f"median {raw:.1f} us")
    for what in ("put", "get"):
        print(f"\n{what}: {out[what + '_per_s']:,.0f} keys/s over the run; "
              "median us from the client's call (step from the previous line), 90th percentile")
        prev = 0.0
        for name, t, p90 in out[what]:
            print(f"  {t:8.1f}  (+{t - prev:6.1f})  p90 {p90:8.1f}  {name}")
            prev = t
        print("  spans, median / 90th percentile us:")
        for name, med, p90 in out[what + "_spans"]:
            print(f"  {med:8.1f} / {p90:8.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
