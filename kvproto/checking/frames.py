"""Fuzzed frames, made from the wire schema tables.

:func:`describe` turns each field's validator in
:data:`~kvproto.runtime.wire.MASTER_OPS` / :data:`~kvproto.runtime.wire.STORAGE_OPS`
(read at run time) into what it accepts; :func:`make_frame` then draws a frame
of one of five kinds (see :mod:`kvproto.checking.fuzz`): ``valid``, ``field``
(one field wrong, missing or extra), ``payloads``, ``header``, ``bytes``
(byte-level mutations of a valid frame). Choices come from a
:class:`Source`: a seeded :class:`random.Random` for long runs, or Hypothesis
(:func:`strategy`) for tests that shrink.
"""

from __future__ import annotations

import random
import struct
from typing import Any, Callable, Optional

import msgpack

from kvproto.runtime import wire

UINT64 = (1 << 64) - 1
KINDS = ("valid", "field", "payloads", "header", "bytes")


# ---------------------------------------------------------------- the schema

class Field:
    """What one validator accepts: ``kind`` (uint, bytes, str, bool, list,
    tuple, columns), a range (value or length; a tuple's: how many of its
    items), and the items of a list or tuple (a column's items)."""

    __slots__ = ("kind", "lo", "hi", "item", "items")

    def __init__(self, kind: str, lo: int = 0, hi: int = 0, item: "Optional[Field]" = None,
                 items: tuple = ()) -> None:
        self.kind, self.lo, self.hi, self.item, self.items = kind, lo, hi, item, items

    def __repr__(self) -> str:
        return f"Field({self.kind}, {self.lo}, {self.hi})"


def describe(check: Callable) -> Field:
    """The :class:`Field` a :mod:`~kvproto.runtime.schema` validator checks for,
    read from the closure that :func:`~kvproto.runtime.schema.uint`,
    ``binary`` and ``text`` (both ``_sized_value``), ``boolean``, ``list_of``,
    ``tuple_of`` and ``columns_of`` return."""
    kind = check.__qualname__.split(".", 1)[0]
    env = dict(zip(check.__code__.co_freevars, (c.cell_contents for c in check.__closure__ or ())))
    if kind == "uint":
        return Field("uint", env["min_value"], env["max_value"])
    if kind == "_sized_value":
        return Field(env["kind"].__name__, env["min_len"], env["max_len"])
    if kind == "boolean":
        return Field("bool")
    if kind == "list_of":
        return Field("list", env["min_items"], env["max_items"], item=describe(env["item"]))
    if kind == "tuple_of":
        return Field("tuple", env["n"], env["most"], items=tuple(describe(c) for c in env["every"]))
    if kind == "columns_of":
        columns = [describe(t) for t in env["tests"]]       # each a list_of
        return Field("columns", columns[0].lo, columns[0].hi, items=tuple(c.item for c in columns))
    raise ValueError(f"no fuzzing rule for the validator {check.__qualname__}")


class Op:
    __slots__ = ("name", "fields", "optional", "payloads", "one_of")

    def __init__(self, name: str, schema: wire.OpSchema) -> None:
        self.name = name
        self.fields = {n: describe(c) for n, c in schema.fields.items()}
        self.optional = {n: describe(c) for n, c in schema.optional.items()}
        self.payloads = schema.payloads
        self.one_of = schema.one_of


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
    if f.kind == "columns":
        n = _edge_int(src, f.lo, min(f.hi, 6))
        return [[valid(src, item, f"{name}.{i}", pools) for _ in range(n)]
                for i, item in enumerate(f.items)]
    # a tuple (its optional trailing items or not): the field's name lets
    # pools fill e.g. [key, token] items
    n = src.int(f.lo, f.hi) if f.lo < f.hi else f.hi
    return [valid(src, item, f"{name}.{i}", pools) for i, item in enumerate(f.items[:n])]


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
    if f.kind == "columns":
        return type(v) is list and len(v) == len(f.items) and len({len(c) for c in v}) == 1 \
            and all(type(c) is list and f.lo <= len(c) <= f.hi and all(_fits(i, x) for x in c)
                    for i, c in zip(f.items, v))
    return type(v) is list and f.lo <= len(v) <= f.hi \
        and all(_fits(i, x) for i, x in zip(f.items, v))


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
                         if not f.lo <= v <= f.hi and -(2 ** 63) <= v <= UINT64])
    if f.kind in ("bytes", "str"):
        n = src.pick([n for n in (f.lo - 1, f.hi + 1) if n >= 0])
        return b"k" * n if f.kind == "bytes" else "s" * n
    if f.kind == "list":
        if f.lo > 0 and src.chance(0.6):
            return []
        if src.chance(0.5):
            return [wrong(src, f.item)]
        return [None] * (f.hi + 1) if f.hi < 70000 else "not a list"
    if f.kind == "columns":
        out = [[valid(src, item, "", {})] for item in f.items]
        roll = src.int(0, 2)
        if roll == 0:
            return out[:-1]                                  # a column missing
        if roll == 1:
            out[src.int(0, len(out) - 1)].append(out[0][0])  # columns of unequal lengths
            return out
        i = src.int(0, len(out) - 1)
        out[i] = [wrong(src, f.items[i])]                    # a bad value in one column
        return out
    if f.kind == "tuple":
        if src.chance(0.5):
            return [None] * src.pick([f.lo - 1, f.hi + 1])
        i = src.int(0, f.lo - 1)
        out = [valid(src, it, "", {}) for it in f.items[:f.lo]]
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
    chosen = src.pick(op.one_of) if op.one_of else None     # exactly one of them
    for n, f in op.optional.items():
        if n == chosen or (n not in op.one_of and src.chance(0.5)):
            body[n] = valid(src, f, n, pools)
    return body


def payload_count(op: Op, body: dict) -> int:
    """How many payload frames ``op`` carries with ``body`` (a negative count
    in the schema: one per entry of its ``regions``)."""
    if op.payloads >= 0:
        return op.payloads
    regions = body.get("regions")
    return len(regions) if type(regions) is list else 1


def _payloads(src: Source, n: int, pools: dict) -> list:
    lengths = pools.get("length") or [1]
    return [src.bytes(src.pick(lengths) if src.chance(0.8) else src.int(0, 600)) for _ in range(n)]


def make_frame(src: Source, ops: list[Op], pools: dict, kind: Optional[str] = None) -> Frame:
    op = src.pick(ops)
    kind = kind or src.pick(KINDS)
    rid = src.int(0, 1 << 20)
    body = body_of(src, op, pools)
    payloads = _payloads(src, payload_count(op, body), pools)
    if kind == "field":
        names = list(op.fields) + list(op.optional)
        roll = src.int(0, 3)
        if roll == 0 and (op.fields or op.one_of):
            # a required field missing, or the one of ``one_of`` given, or a second one
            name = src.pick(list(op.fields) + list(op.one_of))
            if name in body:
                del body[name]
            else:
                body[name] = valid(src, op.optional[name], name, pools)
        elif roll == 1:
            body["x-" + str(src.int(0, 9))] = src.pick(OTHER_TYPES)   # an unknown field: ignored
        elif names:
            name = src.pick(names)
            body[name] = wrong(src, (op.fields.get(name) or op.optional[name]))
    elif kind == "payloads":
        n = src.pick([k for k in (0, 1, 2, 3) if k != payload_count(op, body)])
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


def strategy(ops: list, pools: dict, kind: Optional[str] = None):
    """A Hypothesis strategy of frames of ``ops`` with values from ``pools``."""
    from hypothesis import strategies as st

    @st.composite
    def frame(draw):
        return make_frame(DrawSource(draw), ops, pools, kind)
    return frame()
