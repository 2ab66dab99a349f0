"""The wire's validators: the limits, one small check per kind of value
(:func:`uint`, :func:`binary`, :func:`text`, :func:`boolean`, :func:`list_of`,
:func:`tuple_of`, :func:`columns_of`) and :class:`OpSchema`, an op's fields.
The per-op tables built from them, and :func:`~kvproto.runtime.wire.decode_request`
that applies them, are in :mod:`kvproto.runtime.wire`.

Each check is ``check(value, path)`` and returns the value (possibly
normalised: an array of fixed shape becomes a tuple) or raises
:class:`~kvproto.errors.MalformedFrame` / :class:`~kvproto.errors.InvalidArgument`
naming the path of the first bad value. Each also carries ``check.ok(value)``,
the same test without paths or messages: a whole request is first judged with
these (one pass, no string built per field or key), and only a request that
fails is checked again, slowly, to say where.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from kvproto import errors

MAX_KEY_BYTES = 4096
MAX_BATCH = 65536
MAX_REPLICAS = 16
MAX_NAME = 1024
UINT63 = (1 << 63) - 1
UINT64 = (1 << 64) - 1

Check = Callable[[Any, str], Any]


def _malformed(path: str, what: str) -> errors.MalformedFrame:
    return errors.MalformedFrame(f"{path}: {what}")


def _with(expr: Callable[[str, dict], str], norm: Optional[Callable[[Any], Any]] = None):
    """Attach the fast test (``ok``, the normaliser ``norm``) to a checker.

    ``expr(var, ns)`` writes the test of the value named ``var`` as one Python
    expression (names it needs go into ``ns``), so that a container's test
    inlines its elements' tests: the ``ok`` of an array of tuples is one loop
    over the array with the test of an element written out in it, compiled
    once per field of each op, not a call per element and per field."""
    def attach(check):
        check.expr = expr
        check.ok = _compiled(expr)
        check.norm = norm
        return check
    return attach


def _compiled(expr: Callable[[str, dict], str]) -> Callable[[Any], bool]:
    ns: dict = {}
    exec(f"def ok(v):\n    return {expr('v', ns)}\n", ns)
    return ns["ok"]


def _sized(kind: str, lo: int, hi: int) -> Callable[[str, dict], str]:
    """The test of a value of type ``kind`` whose ``len`` is in ``[lo, hi]``."""
    return lambda var, ns: f"(type({var}) is {kind} and {lo} <= len({var}) <= {hi})"


def uint(max_value: int = UINT63, min_value: int = 0) -> Check:
    @_with(lambda var, ns: f"(type({var}) is int and {min_value} <= {var} <= {max_value})")
    def check(v, path):
        if type(v) is not int:
            raise _malformed(path, f"expected int, got {type(v).__name__}")
        if not min_value <= v <= max_value:
            raise errors.InvalidArgument(f"{path}: {v} not in [{min_value}, {max_value}]")
        return v
    check.column = lambda c: set(map(type, c)) == {int} and min_value <= min(c) and max(c) <= max_value
    return check


def binary(max_len: int = MAX_KEY_BYTES, min_len: int = 1) -> Check:
    return _sized_value(bytes, min_len, max_len)


def _column_of(kind: type, lo: int, hi: int) -> Callable[[list], bool]:
    """The test of a non-empty column of ``kind`` values whose ``len`` is in
    ``[lo, hi]``, in builtins (no Python loop)."""
    return lambda c: set(map(type, c)) == {kind} and lo <= min(map(len, c)) and max(map(len, c)) <= hi


def text(max_len: int = MAX_NAME, min_len: int = 0) -> Check:
    return _sized_value(str, min_len, max_len)


def _sized_value(kind: type, min_len: int, max_len: int) -> Check:
    """A value of type ``kind`` (bytes or str) whose ``len`` is in
    ``[min_len, max_len]``."""
    @_with(_sized(kind.__name__, min_len, max_len))
    def check(v, path):
        if type(v) is not kind:
            raise _malformed(path, f"expected {kind.__name__}, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise errors.InvalidArgument(f"{path}: length {len(v)} not in [{min_len}, {max_len}]")
        return v
    check.column = _column_of(kind, min_len, max_len)
    return check


def _loop(item: Check, min_items: int, max_items: int) -> Callable[[str, dict], str]:
    """The test of an array of ``item``: a compiled loop, called by name."""
    ns: dict = {}
    exec("def ok(v):\n"
         f"    if type(v) is not list or not {min_items} <= len(v) <= {max_items}:\n"
         "        return False\n"
         "    for x in v:\n"
         f"        if not {item.expr('x', ns)}:\n"
         "            return False\n"
         "    return True\n", ns)
    ok = ns["ok"]

    def expr(var, outer):
        name = f"_ok{len(outer)}"
        outer[name] = ok
        return f"{name}({var})"
    return expr


def list_of(item: Check, max_items: int = MAX_BATCH, min_items: int = 0) -> Check:
    item_norm = item.norm

    @_with(_loop(item, min_items, max_items),
           None if item_norm is None else (lambda v: list(map(item_norm, v))))
    def check(v, path):
        if type(v) is not list:
            raise _malformed(path, f"expected array, got {type(v).__name__}")
        if not min_items <= len(v) <= max_items:
            raise errors.InvalidArgument(f"{path}: {len(v)} items not in [{min_items}, {max_items}]")
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return check


def boolean() -> Check:
    @_with(lambda var, ns: f"(type({var}) is bool)")
    def check(v, path):
        if type(v) is not bool:
            raise _malformed(path, f"expected bool, got {type(v).__name__}")
        return v
    return check


def tuple_of(*items: Check, optional: tuple = ()) -> Check:
    """An array of ``items``, then (from the end, any number) of ``optional``
    trailing ones: a field added later that an older sender leaves out."""
    every = items + tuple(optional)
    n, most = len(items), len(every)

    def expr(var, ns):
        tests = [f"(type({var}) is list and {n} <= len({var}) <= {most})"]
        for i, c in enumerate(every):
            test = c.expr(f"{var}[{i}]", ns)
            tests.append(test if i < n else f"(len({var}) <= {i} or {test})")
        return "(" + " and ".join(tests) + ")"

    @_with(expr, tuple)
    def check(v, path):
        if type(v) is not list:
            raise _malformed(path, f"expected array, got {type(v).__name__}")
        if not n <= len(v) <= most:
            raise _malformed(path, f"expected {n if n == most else f'{n} to {most}'} elements, "
                                   f"got {len(v)}")
        return tuple(c(x, f"{path}[{i}]") for i, (c, x) in enumerate(zip(every, v)))
    return check


def columns_of(*columns: Check, max_items: int = MAX_BATCH) -> Check:
    """Rows sent as columns: an array of one array per field (``columns``,
    of ``uint``, ``binary`` or ``text`` values, in order), all of one length
    in ``[1, max_items]``. Each column is judged at once, in builtins; one
    row (a batch of one), value by value as a row's. The columns stay lists."""
    tests = [list_of(c, max_items, 1) for c in columns]
    n = len(columns)

    def expr(var, ns):
        name = f"_cols{len(ns)}"
        ns[name] = [c.column for c in columns]
        one = " and ".join(f"type({var}[{i}]) is list and len({var}[{i}]) == 1 and "
                           + c.expr(f"{var}[{i}][0]", ns) for i, c in enumerate(columns))
        return (f"(type({var}) is list and len({var}) == {n} and (({one}) or ("
                f"set(map(type, {var})) == {{list}} "
                f"and len(set(map(len, {var}))) == 1 and 1 <= len({var}[0]) <= {max_items} "
                f"and all(t(c) for t, c in zip({name}, {var})))))")

    @_with(expr)
    def check(v, path):
        if type(v) is not list:
            raise _malformed(path, f"expected array, got {type(v).__name__}")
        if len(v) != n:
            raise _malformed(path, f"expected {n} columns, got {len(v)}")
        for i, (t, c) in enumerate(zip(tests, v)):
            t(c, f"{path}[{i}]")
        if len(set(map(len, v))) != 1:
            raise _malformed(path, f"columns of unequal lengths {[len(c) for c in v]}")
        return v
    return check


class OpSchema:
    """Required body fields of one op, optional ones (checked when present), and
    how many payload frames it carries (-1: one per entry of its ``regions``).
    ``one_of``: optional fields of which a body carries exactly one (its rows
    as ``regions``, or as ``columns``)."""

    __slots__ = ("fields", "optional", "payloads", "one_of")

    def __init__(self, fields: Mapping[str, Check], payloads: int = 0,
                 optional: Optional[Mapping[str, Check]] = None, one_of: tuple = ()) -> None:
        self.fields = dict(fields)
        self.optional = dict(optional or {})
        self.payloads = payloads
        self.one_of = one_of


