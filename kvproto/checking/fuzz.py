"""Structure-aware fuzzing of the frames the master and the storage nodes accept.

Frames are made from the wire schema tables themselves
(:data:`~kvproto.runtime.wire.MASTER_OPS`, :data:`~kvproto.runtime.wire.STORAGE_OPS`,
read at run time: :func:`describe` turns each field's validator into what it
accepts), in five kinds:

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
import struct
import sys
import time
from typing import Any, Callable, Optional

import msgpack

from kvproto import errors
from kvproto.checking.snapshot import differences, master_snapshot, storage_snapshot
from kvproto.runtime import wire

UINT64 = (1 << 64) - 1
KINDS = ("valid", "field", "payloads", "header", "bytes")


# ---------------------------------------------------------------- the schema

class Field:
    """What one validator accepts: ``kind`` (uint, bytes, str, bool, list,
    tuple), a range (value or length), and the items of a list or tuple."""

    __slots__ = ("kind", "lo", "hi", "item", "items")

    def __init__(self, kind: str, lo: int = 0, hi: int = 0, item: "Optional[Field]" = None,
                 items: tuple = ()) -> None:
        self.kind, self.lo, self.hi, self.item, self.items = kind, lo, hi, item, items

    def __repr__(self) -> str:
        return f"Field({self.kind}, {self.lo}, {self.hi})"


def describe(check: Callable) -> Field:
    """The :class:`Field` a :mod:`~kvproto.runtime.wire` validator checks for,
    read from the closure that :func:`~kvproto.runtime.wire.uint`,
    ``binary``, ``text``, ``boolean``, ``list_of`` and ``tuple_of`` return."""
    kind = check.__qualname__.split(".", 1)[0]
    env = dict(zip(check.__code__.co_freevars, (c.cell_contents for c in check.__closure__ or ())))
    if kind == "uint":
        return Field("uint", env["min_value"], env["max_value"])
    if kind == "binary":
        return Field("bytes", env["min_len"], env["max_len"])
    if kind == "text":
        return Field("str", env["min_len"], env["max_len"])
    if kind == "boolean":
        return Field("bool")
    if kind == "list_of":
        return Field("list", env["min_items"], env["max_items"], item=describe(env["item"]))
    if kind == "tuple_of":
        return Field("tuple", items=tuple(describe(c) for c in env["items"]))
    raise ValueError(f"no fuzzing rule for the validator {check.__qualname__}")


class Op:
    __slots__ = ("name", "fields", "optional", "payloads")

    def __init__(self, name: str, schema: wire.OpSchema) -> None:
        self.name = name
        self.fields = {n: describe(c) for n, c in schema.fields.items()}
        self.optional = {n: describe(c) for n, c in schema.optional.items()}
        self.payloads = schema.payloads


def ops_of(table: dict) -> list[Op]:
    return [Op(name, schema) for name, schema in table.items()]


# ---------------------------------------------------------------- choices

class Source:
    """Where choices come from: a seeded :class:`random.Random` (fast, for
    soak runs) or Hypothesis (:class:`DrawSource`, which shrinks)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class DrawSource(Source):
    """Choices drawn through Hypothesis (``draw`` of a composite strategy)."""

    def __init__(self, draw) -> None:
        from hypothesis import strategies as st
        self.draw, self.st = draw, st

    def int(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def chance(self, p: float) -> bool:
        return self.draw(self.st.integers(0, 999)) < p * 1000

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        return self.draw(self.st.binary(min_size=n, max_size=n))


# ---------------------------------------------------------------- values

def _edge_int(src: Source, lo: int, hi: int) -> int:
    roll = src.int(0, 9)
    if roll == 0:
        return lo
    if roll == 1:
        return hi
    if roll < 6:
        return src.int(lo, min(hi, lo + 64))
    return src.int(lo, hi)


def valid(src: Source, f: Field, name: str, pools: dict) -> Any:
    """A value ``f`` accepts; for a known field name, often one from ``pools``."""
    pool = pools.get(name)
    if pool and src.chance(0.7):
        v = src.pick(pool)
        if _fits(f, v):
            return v
    if f.kind == "uint":
        return _edge_int(src, f.lo, f.hi)
    if f.kind == "bytes":
        return src.bytes(_edge_int(src, f.lo, min(f.hi, 64)))
    if f.kind == "str":
        n = _edge_int(src, f.lo, min(f.hi, 40))
        return "".join(chr(src.int(32, 0x24F)) for _ in range(n))
    if f.kind == "bool":
        return src.chance(0.5)
    if f.kind == "list":
        n = _edge_int(src, f.lo, min(f.hi, 6))
        return [valid(src, f.item, name, pools) for _ in range(n)]
    # a tuple: the field's name lets pools fill e.g. [key, token] items
    return [valid(src, item, f"{name}.{i}", pools) for i, item in enumerate(f.items)]


def _fits(f: Field, v: Any) -> bool:
    if f.kind == "uint":
        return type(v) is int and f.lo <= v <= f.hi
    if f.kind == "bytes":
        return type(v) is bytes and f.lo <= len(v) <= f.hi
    if f.kind == "str":
        return type(v) is str and f.lo <= len(v) <= f.hi
    if f.kind == "bool":
        return type(v) is bool
    if f.kind == "list":
        return type(v) is list and f.lo <= len(v) <= f.hi and all(_fits(f.item, x) for x in v)
    return type(v) is list and len(v) == len(f.items) and all(_fits(i, x) for i, x in zip(f.items, v))


#: a value of each msgpack type, for type confusion
OTHER_TYPES = (None, True, -1, 2 ** 64 - 1, -(2 ** 63), 1.5, float("nan"), "", "x", b"", b"\x00",
               [], [1], {}, {"a": 1}, msgpack.ExtType(5, b"ext"))


def wrong(src: Source, f: Field) -> Any:
    """A value ``f`` refuses: another type, or out of range (value, length, items)."""
    if src.chance(0.5):
        v = src.pick(OTHER_TYPES)
        if not _fits(f, v):
            return v
    if f.kind == "uint":   # outside the range, still a msgpack integer
        return src.pick([v for v in (f.lo - 1, f.hi + 1, -1, -(2 ** 63), UINT64)
                         if not f.lo <= v <= f.hi])
    if f.kind in ("bytes", "str"):
        n = src.pick([n for n in (f.lo - 1, f.hi + 1) if n >= 0])
        return b"k" * n if f.kind == "bytes" else "s" * n
    if f.kind == "list":
        if f.lo > 0 and src.chance(0.6):
            return []
        if src.chance(0.5):
            return [wrong(src, f.item)]
        return [None] * (f.hi + 1) if f.hi < 70000 else "not a list"
    if f.kind == "tuple":
        if src.chance(0.5):
            return [None] * (len(f.items) + src.pick([-1, 1]))
        i = src.int(0, len(f.items) - 1)
        out = [valid(src, it, "", {}) for it in f.items]
        out[i] = wrong(src, f.items[i])
        return out
    return "not a bool"


# ---------------------------------------------------------------- frames

class Frame:
    """A fuzzed request: its frames, its kind, and the request id a typed
    error must echo (``None`` when the header itself was mutated)."""

    __slots__ = ("kind", "op", "frames", "rid")

    def __init__(self, kind: str, op: str, frames: list, rid: Optional[int]) -> None:
        self.kind, self.op, self.frames, self.rid = kind, op, frames, rid

    def __repr__(self) -> str:
        return f"Frame({self.kind}, {self.op}, {[bytes(f)[:80] for f in self.frames]!r})"


def body_of(src: Source, op: Op, pools: dict) -> dict:
    body = {n: valid(src, f, n, pools) for n, f in op.fields.items()}
    for n, f in op.optional.items():
        if src.chance(0.5):
            body[n] = valid(src, f, n, pools)
    return body


def _payloads(src: Source, n: int, pools: dict) -> list:
    lengths = pools.get("length") or [1]
    return [src.bytes(src.pick(lengths) if src.chance(0.8) else src.int(0, 600)) for _ in range(n)]


def make_frame(src: Source, ops: list[Op], pools: dict, kind: Optional[str] = None) -> Frame:
    op = src.pick(ops)
    kind = kind or src.pick(KINDS)
    rid = src.int(0, 1 << 20)
    body = body_of(src, op, pools)
    payloads = _payloads(src, op.payloads, pools)
    if kind == "field":
        names = list(op.fields) + list(op.optional)
        roll = src.int(0, 3)
        if roll == 0 and op.fields:
            del body[src.pick(list(op.fields))]                 # a required field missing
        elif roll == 1:
            body["x-" + str(src.int(0, 9))] = src.pick(OTHER_TYPES)   # an unknown field: ignored
        elif names:
            name = src.pick(names)
            body[name] = wrong(src, (op.fields.get(name) or op.optional[name]))
    elif kind == "payloads":
        n = src.pick([k for k in (0, 1, 2, 3) if k != op.payloads])
        payloads = _payloads(src, n, pools)
    elif kind == "header":
        header = _bad_header(src, op.name, rid, body)
        return Frame(kind, op.name, [_pack(header), *payloads], None)
    frames = [wire.encode_request(op.name, rid, body), *payloads]
    if kind == "bytes":
        frames[0] = mutate(src, frames[0])
        return Frame(kind, op.name, frames, None)
    return Frame(kind, op.name, frames, rid)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _bad_header(src: Source, op: str, rid: int, body: dict) -> Any:
    v = wire.PROTOCOL_VERSION
    return src.pick([
        [v + 1, op, rid, body], [src.pick(OTHER_TYPES), op, rid, body], [v, "no_such_op", rid, body],
        [v, src.pick(OTHER_TYPES), rid, body], [v, op.upper(), rid, body],
        [v, op, -1, body], [v, op, UINT64, body], [v, op, src.pick(OTHER_TYPES), body],
        [v, op, rid, src.pick(OTHER_TYPES)], [v, op, rid], [v, op, rid, body, 0], [],
        {"op": op, "body": body}, op, None,
    ])


def mutate(src: Source, data: bytes) -> bytes:
    """A byte-level mutation of an encoded header."""
    roll = src.int(0, 6)
    buf = bytearray(data)
    if roll == 0:                                    # flip a few bits
        for _ in range(src.int(1, 8)):
            buf[src.int(0, len(buf) - 1)] ^= 1 << src.int(0, 7)
    elif roll == 1:                                  # cut short
        del buf[src.int(0, len(buf) - 1):]
    elif roll == 2:                                  # trailing bytes
        buf += src.bytes(src.int(1, 16))
    elif roll == 3:                                  # random bytes spliced in
        at = src.int(0, len(buf))
        buf[at:at] = src.bytes(src.int(1, 8))
    elif roll == 4:                                  # a length prefix claiming gigabytes
        prefix = src.pick([b"\xdb", b"\xc6", b"\xdd", b"\xdf"])  # str32, bin32, array32, map32
        buf = bytearray(_pack([wire.PROTOCOL_VERSION, "stats", 1])[:-1]) if src.chance(0.3) else buf
        at = src.int(0, len(buf))
        buf[at:at] = prefix + struct.pack(">I", src.pick([0xFFFFFFFF, 0x7FFFFFFF, 1 << 30]))
    elif roll == 5:                                  # a value's msgpack type changed
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
            return _pack(_confuse(src, obj))
        except Exception:
            pass
    else:                                            # a byte set to a msgpack type marker
        buf[src.int(0, len(buf) - 1)] = src.pick([0xc0, 0xc1, 0xc2, 0xc4, 0xca, 0xcb, 0xd9, 0xdc,
                                                   0xde, 0xc7, 0xd4, 0x90, 0x80, 0xa0, 0xff])
    return bytes(buf)


def _confuse(src: Source, obj: Any, depth: int = 0) -> Any:
    """``obj`` with one nested value replaced by a value of another msgpack type."""
    if isinstance(obj, list) and obj and (depth == 0 or src.chance(0.6)):
        i = src.int(0, len(obj) - 1)
        return obj[:i] + [_confuse(src, obj[i], depth + 1)] + obj[i + 1:]
    if isinstance(obj, dict) and obj and src.chance(0.7):
        k = src.pick(list(obj))
        return {**obj, k: _confuse(src, obj[k], depth + 1)}
    if isinstance(obj, str) and src.chance(0.3):
        return obj.encode()
    if isinstance(obj, bytes) and src.chance(0.3):
        return obj.decode("latin-1")
    if isinstance(obj, int) and not isinstance(obj, bool) and src.chance(0.3):
        return float(obj)
    return src.pick(OTHER_TYPES)


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

    def __init__(self) -> None:
        from kvproto.runtime.master import MasterCore
        super().__init__()
        self.now = 1000.0
        self.core = MasterCore(writer_timeout=5.0, storage_timeout=5.0, lease_ttl=2.0,
                               clock=lambda: self.now)
        for i, seg in enumerate(self.SEGMENTS):
            self.core.handle("register", self.registration(seg, i))
        self.settle()
        self.keys = [b"k-%d" % i for i in range(8)]
        self.core.handle("put_start", {"client": "fuzzer", "replicas": 1,
                                       "items": [[k, 100 + i] for i, k in enumerate(self.keys)]})
        self.settle()
        tokens = [t for t in self.core.sessions["fuzzer"].tokens]
        self.core.handle("put_end", {"client": "fuzzer", "items": [[k, t] for k, t in zip(self.keys, tokens)]})
        self.settle()
        self.n = 0

    @staticmethod
    def registration(segment: str, n: int) -> dict:
        return {"segment": segment, "capacity": 1 << 20, "endpoint": f"tcp://127.0.0.1:{9000 + n}",
                "host": "fuzz", "shm": f"shm-{n}", "gen_shm": f"gen-{n}", "nonce": n, "page_size": 4096}

    def settle(self) -> None:
        """Acknowledge every command the core sent its storage nodes."""
        core = self.core
        while core.outbox:
            out, core.outbox = core.outbox, []
            for segment, op, cmd_id, body in out:
                results = [[0, None]] * len(body.get("regions", ()))
                core.storage_reply(segment, wire.Reply(0, cmd_id, {"results": results}, []))
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
            status, body = core.handle("stats", {})
            if status != 0:
                return f"stats answered {status}"
            result = core.handle("put_start", {"client": "probe", "replicas": 1, "items": [[key, 10]]})
            self.settle()
            if result is not None and result[0] != 0:
                return f"put_start answered {result}"
            status, body = core.handle("exists", {"keys": [key]})
            if status != 0:
                return f"exists answered {status}"
        except errors.KvError as err:
            return f"{type(err).__name__}: {err}"
        finally:
            try:
                core.handle("put_abandon", {"client": "probe", "keys": [key]})
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
        at = list(self.core.table.regions.items())[:12]
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
                "owner": ["fuzz-owner", "other-owner"], "xfer": [1, 2, 3], "buffer": ["buf-0"]}

    def serving(self) -> Optional[str]:
        core = self.core
        try:
            core.handle("stats", {}, [])
            done = [(o, r) for o, r in core.table.regions.items() if r.done]
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


TARGETS: dict[str, Callable[[], Target]] = {"master": MasterTarget, "storage": StorageTarget}


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


def frames(target: Target, kind: Optional[str] = None):
    """A Hypothesis strategy of fuzzed frames for ``target`` (its pools as they are now)."""
    from hypothesis import strategies as st

    @st.composite
    def frame(draw):
        return make_frame(DrawSource(draw), target.ops, target.pools(), kind)
    return frame()


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
