"""Structure-aware fuzzing of the frames the master and the storage nodes accept.

Frames are made from the wire schema tables themselves
(:data:`~kvproto.runtime.wire.MASTER_OPS`, :data:`~kvproto.runtime.wire.STORAGE_OPS`,
read at run time: :func:`kvproto.checking.frames.describe` turns each field's
validator into what it accepts), in five kinds (:mod:`kvproto.checking.frames`):

* ``valid``: every field well typed and in range, often drawn from the
  target's own state (its segment ids, keys, tokens, terms, offsets), so that
  many requests get past the checks to the protocol machines;
* ``field``: a valid body with one field of the wrong type, out of range,
  missing, or one unknown field added;
* ``payloads``: a valid header with the wrong number of payload frames;
* ``header``: a wrong version, op, request id or body type, or not a
  ``[version, op, request_id, body]`` array;
* ``bytes``: a valid frame's encoding mutated: bits flipped, cut short,
  extended, spliced, a msgpack value's type changed, or a length prefix
  claiming gigabytes.

Each frame goes through :func:`~kvproto.runtime.wire.decode_request` and the
socket-free core (``MasterCore.handle``; ``StorageCore.start``/``handle``)
exactly as the servers call them, and must satisfy:

1. **no crash**: nothing but a typed :class:`~kvproto.errors.KvError` is raised;
2. **a typed error for a rejected frame**: a specific error class (not the
   base), with the frame's request id when its header could be read;
3. **a rejected frame changes nothing**: the core's protocol state
   (:mod:`kvproto.checking.snapshot`) is the same before and after;
4. **the server keeps serving**: a valid request built from the current state
   then succeeds.

:func:`fuzz` runs the cores (``kvproto fuzz --frames N``); :func:`fuzz_servers`
sends a sample to real ``kvproto master`` and ``kvproto storage`` processes
over their sockets, where a crash shows as an ``InternalError`` reply or
silence. The Hypothesis strategy :func:`frames` draws the same frames for tests.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any, Callable, Optional

from kvproto import errors
from kvproto.checking.frames import KINDS, Frame, Source, make_frame, ops_of, strategy
from kvproto.checking.snapshot import differences, master_snapshot, storage_snapshot
from kvproto.runtime import wire


# ---------------------------------------------------------------- targets

class Outcome:
    __slots__ = ("stage", "status", "error", "crash")

    def __init__(self, stage: str, status: int = 0, error: Optional[errors.KvError] = None,
                 crash: str = "") -> None:
        self.stage, self.status, self.error, self.crash = stage, status, error, crash


class Target:
    """A socket-free core, driven as its server drives it."""

    name = ""
    table: dict = {}
    max_header = 0
    max_payload = 0

    def __init__(self) -> None:
        self.ops = ops_of(self.table)
        self.core: Any = None

    def pools(self) -> dict:
        raise NotImplementedError

    def snapshot(self) -> Any:
        raise NotImplementedError

    def handle(self, req: wire.Request) -> None:
        raise NotImplementedError

    def serving(self) -> Optional[str]:
        """None if a valid request now succeeds, else what went wrong."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def serve(self, frames: list) -> tuple[Outcome, Any, Any]:
        """Decode and handle ``frames``; returns the outcome and, for a frame
        the core refused, its state before and after."""
        try:
            req = wire.decode_request(frames, self.max_header, self.max_payload, self.table)
        except errors.KvError as err:
            return Outcome("decode", err.code, err), None, None
        except Exception as exc:   # noqa: BLE001 - the property under test
            return Outcome("decode", crash=f"{type(exc).__name__}: {exc}"), None, None
        before = self.snapshot()
        try:
            self.handle(req)
        except errors.KvError as err:
            return Outcome("handle", err.code, err), before, self.snapshot()
        except Exception as exc:   # noqa: BLE001
            return Outcome("handle", crash=f"{type(exc).__name__}: {exc}"), None, None
        return Outcome("handle"), None, None


class MasterTarget(Target):
    """A ``MasterCore`` (term 1, open) with two registered segments, whose
    storage commands are acknowledged at once; its clock is advanced by the
    fuzzer between frames, never during one."""

    name = "master"
    table = wire.MASTER_OPS
    max_header = wire.MASTER_MAX_HEADER
    max_payload = 0
    SEGMENTS = ("fuzz-a", "fuzz-b")
    #: the master's tenants (none: one shared key space), and the fields the
    #: set-up and probe requests carry (a tenant's credential)
    TENANTS: tuple = ()
    AUTH: dict = {}

    def __init__(self) -> None:
        from kvproto.runtime.master import MasterCore
        super().__init__()
        self.now = 1000.0
        self.core = MasterCore(writer_timeout=5.0, storage_timeout=5.0, lease_ttl=2.0,
                               clock=lambda: self.now, tenants=self.TENANTS)
        for i, seg in enumerate(self.SEGMENTS):
            self.core.handle("register", self.registration(seg, i))
        self.settle()
        self.keys = [b"k-%d" % i for i in range(8)]
        self.core.handle("put_start", {**self.AUTH, "client": "fuzzer", "replicas": 1,
                                       "items": [[k, 100 + i] for i, k in enumerate(self.keys)]})
        self.settle()
        tokens = [t for s in self.core.sessions.values() for t in s.tokens]
        self.core.handle("put_end", {**self.AUTH, "client": "fuzzer",
                                     "items": [[k, t] for k, t in zip(self.keys, tokens)]})
        self.settle()
        self.n = 0

    @staticmethod
    def registration(segment: str, n: int) -> dict:
        return {"segment": segment, "capacity": 1 << 20, "endpoint": f"tcp://127.0.0.1:{9000 + n}",
                "host": "fuzz", "shm": f"shm-{n}", "gen_shm": f"gen-{n}", "nonce": n, "page_size": 4096,
                "columns": bool(n % 2)}   # one node takes assign and publish as columns

    def settle(self) -> None:
        """Acknowledge every command the core sent its storage nodes."""
        core = self.core
        while core.outbox:
            out, core.outbox = core.outbox, []
            for segment, op, cmd_id, body in out:
                rows = body["columns"][0] if "columns" in body else body.get("regions", ())
                answer = {"accepted": len(rows)} if body.get("tally") and cmd_id % 2 else \
                    {"results": [[0, None]] * len(rows)}
                core.storage_reply(segment, wire.Reply(0, cmd_id, answer, []))
        core.ready.clear()
        core.opened.clear()
        core.closed.clear()

    def handle(self, req: wire.Request) -> None:
        self.core.handle(req.op, req.body, b"fuzz", req.request_id)

    def after(self) -> None:
        self.settle()
        self.now += 0.01

    def snapshot(self) -> Any:
        return master_snapshot(self.core)

    def pools(self) -> dict:
        d = self.core.directory
        keys = list(d.objects)[:16] + self.keys[:2] + [b"absent"]
        tokens = [r.token for r in list(d.objects.values())[:16]] + [d.next_token, 1]
        clients = ["fuzzer"] + list(self.core.sessions)[:4] + ["nobody"]
        return {"segment": list(self.SEGMENTS) + ["lost"], "keys": keys, "items.0": keys,
                "items.1": tokens + [100, 4096], "client": clients, "leases": [1, (1 << 32) + 1],
                "tokens": tokens, "replicas": [1, 2, 3], "prefix": [b"k-", b""], "after": [b""],
                "limit": [1, 10], "endpoint": ["tcp://127.0.0.1:9000", "tcp://127.0.0.1:9001"],
                "capacity": [1 << 20, 4096], "page_size": [4096, 512, 3000], "nonce": [0, 1]}

    def serving(self) -> Optional[str]:
        core = self.core
        key = b"serving-%d" % self.n
        self.n += 1
        try:
            status, body = core.handle("stats", dict(self.AUTH))
            if status != 0:
                return f"stats answered {status}"
            result = core.handle("put_start", {**self.AUTH, "client": "probe", "replicas": 1,
                                               "items": [[key, 10]], "columns": bool(self.n % 2)})
            self.settle()
            if result is not None and result[0] != 0:
                return f"put_start answered {result}"
            if result is not None and self.n % 2:     # the grant as columns, as a client checks it
                wire.put_columns(wire.Reply(0, 1, result[1], []), 1, 1)
            status, body = core.handle("exists", {**self.AUTH, "keys": [key], "found": True})
            if status != 0 or body != {"found": b"\0"}:     # put, not yet published
                return f"exists answered {status}: {body}"
        except errors.KvError as err:
            return f"{type(err).__name__}: {err}"
        finally:
            try:
                core.handle("put_abandon", {**self.AUTH, "client": "probe", "keys": [key]})
            except errors.KvError:
                pass
            self.settle()
        return None


class StorageTarget(Target):
    """A ``StorageCore`` over a 64 KiB segment of 512-byte pages, fenced at
    term 1, with regions assigned, some written and published."""

    name = "storage"
    table = wire.STORAGE_OPS
    max_header = wire.STORAGE_MAX_HEADER
    PAGE = 512
    CAPACITY = 64 << 10

    def __init__(self) -> None:
        from kvproto.runtime.shm import SegmentMemory
        from kvproto.runtime.storage import StorageCore
        super().__init__()
        self.max_payload = self.CAPACITY
        self.memory = SegmentMemory(self.CAPACITY, self.PAGE, prefix="kvpfuzz")
        self.core = StorageCore(self.memory, "fuzz-seg")
        self.core.endpoint = "tcp://127.0.0.1:9100"
        self.core.handle("fence", {"segment": "fuzz-seg", "term": 1}, [])
        self.regions = [(i * 2 * self.PAGE, 300 + i, b"r-%d" % i, 10 + i) for i in range(12)]
        self.core.handle("assign", {"segment": "fuzz-seg", "term": 1,
                                    "regions": [list(r) for r in self.regions]}, [])
        for offset, length, key, token in self.regions[:8]:
            self.core.handle("write", {"segment": "fuzz-seg", "offset": offset, "token": token,
                                       "term": 1}, [memoryview(bytes([token]) * length)])
        self.core.handle("publish", {"segment": "fuzz-seg", "term": 1,
                                     "regions": [[o, k, t] for o, _, k, t in self.regions[:4]]}, [])

    def handle(self, req: wire.Request) -> None:
        core = self.core
        if core.tracked(req.op, req.body):
            core.start(req.op, req.body)
        core.handle(req.op, req.body, req.payloads)

    def after(self) -> None:
        pass

    def snapshot(self) -> Any:
        return storage_snapshot(self.core)

    def pools(self) -> dict:
        at = list(self.core.node.regions.items())[:12]
        regions = [r for _, r in at]
        offsets = [o for o, _ in at] + [0, self.PAGE, self.CAPACITY - self.PAGE, self.CAPACITY]
        tokens = [r.token for r in regions] + [1, 10]
        keys = [r.key for r in regions] + [b"other"]
        term = self.core.term
        return {"segment": ["fuzz-seg", "fuzz-seg", "other-seg"], "offset": offsets, "token": tokens,
                "term": [term, term, term + 1, max(term - 1, 0)], "below": [term, term + 1],
                "length": [r.length for r in regions] + [1, self.PAGE],
                "regions.0": offsets, "regions.1": [r.length for r in regions] + keys,
                "regions.2": keys + tokens, "regions.3": tokens,
                "columns.0": offsets, "columns.1": [r.length for r in regions] + keys,
                "columns.2": keys + tokens, "columns.3": tokens,
                "owner": ["fuzz-owner", "other-owner"], "xfer": [1, 2, 3], "buffer": ["buf-0"]}

    def serving(self) -> Optional[str]:
        core = self.core
        try:
            core.handle("stats", {}, [])
            done = [(o, r) for o, r in core.node.regions.items() if r.done]
            if done:
                offset, r = done[0]
                body, out = core.handle("read", {"segment": core.segment, "offset": offset,
                                                 "token": r.token, "term": core.term,
                                                 "length": r.length}, [])
                if len(out) != 1 or len(out[0]) != r.length:
                    return f"a read of {r.length} bytes answered {len(out)} frame(s)"
        except errors.KvError as err:
            return f"{type(err).__name__}: {err}"
        return None

    def close(self) -> None:
        self.memory.close()


class TenantMasterTarget(MasterTarget):
    """A :class:`MasterTarget` with tenants (spec/Tenancy.tla): two tenants,
    one of them granted a read of the other's namespace; frames carry their
    credentials, wrong ones and none."""

    name = "master-tenants"
    TOKENS = {"alpha": "fuzz-alpha-token", "beta": "fuzz-beta-token"}
    AUTH = {"cred": TOKENS["alpha"].encode()}

    def __init__(self) -> None:
        from kvproto.ops.tenants import parse_tenants
        self.TENANTS = parse_tenants({"tenants": {
            "alpha": {"tokens": [self.TOKENS["alpha"]], "namespaces": ["default", "shared"],
                      "stored": 4096, "in_flight": 2048, "grants": {"shared": ["beta"]}},
            "beta": {"tokens": [self.TOKENS["beta"]], "write_rate": 100, "write_burst": 1000}}})
        super().__init__()

    def pools(self) -> dict:
        from kvproto.ops.tenants import split_object_key
        pools = super().pools()
        keys = [split_object_key(k)[1] for k in self.core.directory.objects][:16] + [b"absent"]
        clients = [c.split("/", 1)[-1] for c in self.core.sessions][:4] + ["fuzzer", "nobody"]
        creds = [t.encode() for t in self.TOKENS.values()] + [b"wrong-token"]
        return {**pools, "keys": keys, "items.0": keys, "client": clients, "prefix": [b"k-", b""],
                "cred": creds, "ns": ["default", "shared", "alpha/shared", "alpha/default", "x"],
                "grantee": ["alpha", "beta", "nobody"]}


TARGETS: dict[str, Callable[[], Target]] = {"master": MasterTarget, "storage": StorageTarget,
                                            "master-tenants": TenantMasterTarget}


# ---------------------------------------------------------------- running

class Report:
    """Counts of one fuzzing run, and the first failures of each property."""

    def __init__(self) -> None:
        self.frames = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.crashes: list[str] = []
        self.untyped: list[str] = []
        self.changed: list[str] = []
        self.stopped_serving: list[str] = []
        self.seconds = 0.0

    @property
    def failures(self) -> int:
        return len(self.crashes) + len(self.untyped) + len(self.changed) + len(self.stopped_serving)

    def _note(self, where: list, text: str) -> None:
        if len(where) < 1000:
            where.append(text)

    def summary(self) -> str:
        rate = self.frames / self.seconds if self.seconds else 0.0
        kinds = ", ".join(f"{k} {v:,}" for k, v in self.by_kind.items())
        top = sorted(self.rejected.items(), key=lambda kv: -kv[1])
        rejected = ", ".join(f"{name} {n:,}" for name, n in top)
        lines = [f"{self.frames:,} frames in {self.seconds:.0f} s ({rate:,.0f}/s): {kinds}",
                 f"accepted {self.accepted:,}; rejected {sum(self.rejected.values()):,}: {rejected}",
                 f"crashes {len(self.crashes)}, untyped errors {len(self.untyped)}, state changed by "
                 f"a rejected frame {len(self.changed)}, stopped serving {len(self.stopped_serving)}"]
        for name in ("crashes", "untyped", "changed", "stopped_serving"):
            for text in getattr(self, name)[:5]:
                lines.append(f"  {name}: {text}")
        return "\n".join(lines)


def check(target: Target, frame: Frame, report: Report) -> None:
    """One frame against the four properties (see the module docstring)."""
    report.frames += 1
    report.by_kind[frame.kind] += 1
    outcome, before, after = target.serve(frame.frames)
    if outcome.crash:
        report._note(report.crashes, f"{target.name} {outcome.stage}: {outcome.crash} on {frame!r}")
        return
    err = outcome.error
    if err is None:
        report.accepted += 1
        target.after()
        return
    name = type(err).__name__
    report.rejected[name] = report.rejected.get(name, 0) + 1
    if type(err) is errors.KvError or type(errors.from_wire(err.code, "")) is not type(err):
        report._note(report.untyped, f"{target.name}: {name} ({err.code}) is not a typed error: {frame!r}")
    # the request id is echoed whenever the header could be read (sizes are
    # checked first, before anything is decoded: FrameTooLarge carries 0)
    if outcome.stage == "decode" and frame.rid is not None and not isinstance(err, errors.FrameTooLarge) \
            and getattr(err, "request_id", None) != frame.rid:
        report._note(report.untyped, f"{target.name}: {name} answers request id "
                                     f"{getattr(err, 'request_id', None)}, not {frame.rid}: {frame!r}")
    if before is not None and before != after:
        report._note(report.changed, f"{target.name} {frame.op} refused with {name}: "
                                     f"{differences(before, after)} by {frame!r}")
    target.after()
    problem = target.serving()
    if problem is not None:
        report._note(report.stopped_serving, f"{target.name} after {frame!r}: {problem}")


def fuzz(frames: int, seed: int = 0, targets: tuple = ("master", "storage"),
         fresh_every: int = 2000, progress: Optional[Callable[[Report], None]] = None) -> Report:
    """``frames`` frames, spread over ``targets``; each target starts afresh
    every ``fresh_every`` frames (its state drifts under valid frames)."""
    import logging
    src = Source(random.Random(seed))
    report = Report()
    started = time.monotonic()
    live: dict[str, Target] = {}
    quiet = logging.getLogger("kvproto")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)   # refusals are logged; thousands of them are noise here
    try:
        for n in range(frames):
            name = targets[n % len(targets)]
            target = live.get(name)
            if target is None or (n // len(targets)) % fresh_every == 0:
                if target is not None:
                    target.close()
                target = live[name] = TARGETS[name]()
            check(target, make_frame(src, target.ops, target.pools()), report)
            if progress is not None and n % 50_000 == 49_999:
                report.seconds = time.monotonic() - started
                progress(report)
    finally:
        quiet.setLevel(level)
        for target in live.values():
            target.close()
    report.seconds = time.monotonic() - started
    return report


def frames(target: "Target", kind: Optional[str] = None):
    """A Hypothesis strategy of fuzzed frames for ``target`` (its pools as they are now)."""
    return strategy(target.ops, target.pools(), kind)


# ---------------------------------------------------------------- real servers

def fuzz_servers(frames: int, seed: int = 0, timeout: float = 5.0) -> Report:
    """``frames`` fuzzed frames to a real master and storage node (separate
    processes), over their sockets. A frame the wire rejects must be answered
    with that typed error and its request id; no answer may be
    ``InternalError`` (an exception in the server); each server must keep
    answering ``stats``; and a batch of rejected frames leaves the servers'
    figures (objects, pending attempts, regions) as they were."""
    import zmq
    from kvproto.checking.chaos.cluster import Proc, free_port
    import tempfile
    from pathlib import Path
    src = Source(random.Random(seed))
    report = Report()
    started = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="kvproto-fuzz-"))
    master_at = f"tcp://127.0.0.1:{free_port()}"
    # no attempt or node lapses during the run: between two looks at the
    # figures only the frames sent can change them
    procs = [Proc("master", "master", [sys.executable, "-m", "kvproto", "master", "--listen", master_at,
                                       "--writer-timeout", "3600", "--storage-timeout", "3600"],
                  logs / "master.log")]
    ctx = zmq.Context()
    try:
        procs[0].line("kvproto master listening on", 60)
        storage_at = f"tcp://127.0.0.1:{free_port()}"
        procs.append(Proc("storage", "storage", [sys.executable, "-m", "kvproto", "storage", "--master",
                                                 master_at, "--size", "1MiB", "--listen", storage_at],
                          logs / "storage.log"))
        procs[1].line("kvproto storage ready", 60)
        servers = [(MasterTarget, master_at, wire.MASTER_OPS, wire.MASTER_MAX_HEADER, 0),
                   (StorageTarget, storage_at, wire.STORAGE_OPS, wire.STORAGE_MAX_HEADER, 1 << 20)]
        socks = {}
        for _, at, *_ in servers:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(at)
            socks[at] = s
        oracles = {at: cls() for cls, at, *_ in servers}

        def ask(at: str, frame_list: list) -> Optional[wire.Reply]:
            sock = socks[at]
            sock.send_multipart(frame_list)
            deadline = time.monotonic() + timeout
            while sock.poll(max(int((deadline - time.monotonic()) * 1000), 1)):
                reply = wire.decode_reply(sock.recv_multipart())
                return reply
            return None

        def figures(at: str) -> dict:
            reply = ask(at, [wire.encode_request("stats", 1, {})])
            if reply is None or reply.status:
                raise AssertionError(f"{at} does not answer stats")
            b = reply.body
            return {k: b.get(k) for k in ("objects", "pending", "regions", "used", "indexed", "term")}

        # windows of 50 frames: in even ones only frames the wire rejects are
        # sent, and the figures must be the same at their end as at their start
        marks: dict = {}
        for n in range(frames):
            window, rejected_only = n // 50, (n // 50) % 2 == 0
            if n % 50 == 0:
                marks = {a: figures(a) for a in socks} if rejected_only else {}
            cls, at, table, max_header, max_payload = servers[n % 2]
            oracle = oracles[at]
            while True:
                frame = make_frame(src, oracle.ops, oracle.pools())
                try:
                    wire.decode_request(frame.frames, max_header, max_payload, table)
                    expect = None
                except errors.KvError as err:
                    expect = err
                if expect is not None or not rejected_only:
                    break
            report.frames += 1
            report.by_kind[frame.kind] += 1
            reply = ask(at, frame.frames)
            if reply is None:
                if expect is not None:
                    report._note(report.crashes, f"{at} did not answer a rejected frame {frame!r}")
                continue
            if reply.status == errors.InternalError.code:
                report._note(report.crashes, f"{at}: {reply.body.get('message')} on {frame!r}")
            if reply.status == 0:
                report.accepted += 1
            else:
                name = type(reply.error()).__name__
                report.rejected[name] = report.rejected.get(name, 0) + 1
            echo = frame.rid is not None and not isinstance(expect, errors.FrameTooLarge)
            if expect is not None and (reply.status != expect.code or (
                    echo and reply.request_id != frame.rid)):
                report._note(report.untyped, f"{at} answered {reply.status}/{reply.request_id}, "
                                             f"the wire says {expect.code}/{frame.rid}: {frame!r}")
            if rejected_only and n % 50 == 49:
                for a, before in marks.items():
                    now = figures(a)
                    if now != before:
                        report._note(report.changed, f"{a} in window {window}: {before} -> {now}")
        for a in socks:
            figures(a)                 # still serving
    finally:
        for sock in locals().get("socks", {}).values():
            sock.close(linger=0)
        for target in locals().get("oracles", {}).values():
            target.close()
        for p in procs:
            p.stop()
        ctx.destroy(linger=0)
    report.seconds = time.monotonic() - started
    return report


# ---------------------------------------------------------------- command line

def add_arguments(parser) -> None:
    from kvproto.cli import _count
    parser.description = (
        "Fuzz the frames the master and storage nodes accept: valid bodies made from the "
        "wire schema, bodies with one field wrong, missing or extra, wrong payload counts, "
        "bad headers and byte-level mutations. Every frame goes through the socket-free "
        "cores as the servers drive them and must not crash them, must be refused with a "
        "typed error, must change nothing when refused, and must leave the core serving. "
        "Exits 1 on any failure.")
    parser.add_argument("--frames", type=_count, default=100_000, help="frames to send")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--target", choices=("master", "storage", "both"), default="both",
                        help="which core to fuzz")
    parser.add_argument("--servers", type=int, default=0, metavar="N",
                        help="also send N frames to real master and storage processes")


def main(args) -> int:
    targets = ("master", "storage") if args.target == "both" else (args.target,)
    print(f"kvproto fuzz: {args.frames:,} frames to {' and '.join(targets)}, seed {args.seed}",
          flush=True)
    report = fuzz(args.frames, args.seed, targets,
                  progress=lambda r: print(f"  {r.frames:,} frames, {r.failures} failure(s), "
                                           f"{r.frames / max(r.seconds, 1e-9):,.0f}/s", flush=True))
    print(report.summary())
    failed = report.failures
    if args.servers:
        served = fuzz_servers(args.servers, args.seed)
        print("real servers: " + served.summary())
        failed += served.failures
    return 1 if failed else 0
