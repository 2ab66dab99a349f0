"""Read and print the TLA+ values, states, state graphs and traces that TLC prints.

This module is pure: it parses text and builds values, and never runs TLC.

Value representation (code that maps Python state into TLA+ terms must produce
exactly these forms, or states will not compare equal):

=====================================  ======================================
TLA+ as TLC prints it                  Python
=====================================  ======================================
``42``, ``-3``                         ``int``
``"text"``                             ``str``
``TRUE`` / ``FALSE``                   ``bool``
``k1``, ``none`` (model values)        :class:`ModelValue` ``("k1")``
``{a, b}``, ``1..3``                   ``frozenset``
``<<a, b>>``                           ``tuple``
``[a |-> 1, b |-> "x"]`` (record)      :class:`Fn` with ``str`` keys
``(k1 :> 1 @@ k2 :> 2)``, ``k1 :> 1``  :class:`Fn`
=====================================  ======================================

TLC prints any function whose domain is ``1..n`` as a sequence ``<<...>>`` and
the empty function as ``<<>>``, so mapping code must produce a ``tuple`` for
those, never an :class:`Fn` (an empty :class:`Fn` prints as ``<<>>`` and reads
back as ``()``). Likewise a function whose domain is a set of strings is a
record: ``("a" :> 1)`` and ``[a |-> 1]`` both read as ``Fn({'a': 1})``.

Python's ``True == 1`` carries over: a TLA+ ``TRUE`` and ``1`` compare equal
here, which TLC would reject anyway.

A *state* is an :class:`Fn` from variable name to value, so states are hashable
and can be put in sets and compared between TLC and Python.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs

Value = Any  # int | str | bool | ModelValue | frozenset | tuple | Fn


class ModelValue:
    """A TLC model value or other bare identifier, e.g. ``k1`` or ``none``.

    There is one object per name (``ModelValue("k1") is ModelValue("k1")``),
    so equality and hashing are the object's own, done in C: a conformance
    graph hashes millions of model values. Immutable; copies and pickles are
    the same object.
    """

    __slots__ = ("name",)
    _interned: dict[str, ModelValue] = {}

    def __new__(cls, name: str) -> ModelValue:
        found = cls._interned.get(name)
        if found is not None:
            return found
        if type(name) is not str:
            raise TypeError(f"a model value's name is a str, not {type(name).__name__}")
        value = object.__new__(cls)
        object.__setattr__(value, "name", name)
        return cls._interned.setdefault(name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("a ModelValue is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("a ModelValue is immutable")

    def __reduce__(self):
        return ModelValue, (self.name,)

    def __repr__(self) -> str:
        return f"ModelValue({self.name!r})"


def model_names(values) -> tuple[str, ...]:
    """The sorted names of a set of model values (a cfg constant like ``{k1, k2}``)."""
    return tuple(sorted(v.name for v in values))


def sort_key(value: Value) -> tuple:
    """A total order over values, consistent with equality (used to canonicalise)."""
    if isinstance(value, (bool, int)):
        return (0, int(value))
    if isinstance(value, str):
        return (1, value)
    if isinstance(value, ModelValue):
        return (2, value.name)
    if isinstance(value, tuple):
        return (3, tuple(sort_key(v) for v in value))
    if isinstance(value, frozenset):
        return (4, tuple(sorted(sort_key(v) for v in value)))
    if isinstance(value, Fn):
        return (5, tuple((sort_key(k), sort_key(v)) for k, v in value.pairs))
    raise TypeError(f"not a TLA+ value: {value!r} ({type(value).__name__})")


def _canonical_pairs(pairs: Iterable[tuple[Value, Value]]) -> tuple[tuple[Value, Value], ...]:
    pairs = tuple(pairs)
    seen: dict[Value, Value] = dict(pairs)
    if len(seen) != len(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {format_value(key)} in function")
            seen[key] = value
    return tuple(sorted(seen.items(), key=_pair_order(seen)))


def _first(pair: tuple[Value, Value]) -> Value:
    return pair[0]


def _first_name(pair: tuple[Value, Value]) -> str:
    return pair[0].name


def _first_sort_key(pair: tuple[Value, Value]) -> tuple:
    return sort_key(pair[0])


def _pair_order(mapping: dict) -> Callable[[tuple[Value, Value]], Any]:
    """A sort key for ``mapping``'s items that orders them as :func:`sort_key`
    orders their keys, cheaper when every key has the same simple type (records
    and states: strings; functions over model values; over integers)."""
    kinds = set(map(type, mapping))
    if len(kinds) == 1:
        kind = kinds.pop()
        if kind is str or kind is int:
            return _first
        if kind is ModelValue:
            return _first_name
    return _first_sort_key


@attrs.frozen(repr=False, cache_hash=True)
class Fn:
    """A TLA+ function or record: an immutable, hashable mapping.

    ``pairs`` is kept sorted by key, so equal functions are equal tuples.
    """

    pairs: tuple[tuple[Value, Value], ...] = attrs.field(converter=_canonical_pairs)
    _index: dict = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_index", dict(self.pairs))

    @classmethod
    def of(cls, mapping: Mapping[Value, Value] | Iterable[tuple[Value, Value]]) -> Fn:
        """Build from a mapping or from ``(key, value)`` pairs."""
        items = mapping.items() if isinstance(mapping, Mapping) else mapping
        return cls(tuple(items))

    def __getitem__(self, key: Value) -> Value:
        return self._index[key]

    def get(self, key: Value, default: Value = None) -> Value:
        return self._index.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Value]:
        return (k for k, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def keys(self) -> list[Value]:
        return [k for k, _ in self.pairs]

    def values(self) -> list[Value]:
        return [v for _, v in self.pairs]

    def items(self) -> tuple[tuple[Value, Value], ...]:
        return self.pairs

    def __repr__(self) -> str:
        return f"Fn({{{', '.join(f'{k!r}: {v!r}' for k, v in self.pairs)}}})"


# --- printing -----------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KEYWORDS = {"TRUE": True, "FALSE": False}
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f"}


def function(mapping: Mapping[Value, Value]) -> Value:
    """A TLA+ function as TLC prints it: over an empty domain it is ``<<>>``,
    which reads back as ``()``."""
    return Fn.of(mapping) if mapping else ()


def _is_field_name(key: Value) -> bool:
    return isinstance(key, str) and bool(_IDENT.match(key))


def format_string(text: str) -> str:
    return '"' + "".join(_ESCAPES.get(c, c) for c in text) + '"'


def format_value(value: Value) -> str:
    """Print a value in TLC syntax (one line); :func:`parse_value` reads it back."""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, ModelValue):
        return value.name
    if isinstance(value, tuple):
        return "<<" + ", ".join(format_value(v) for v in value) + ">>"
    if isinstance(value, frozenset):
        return "{" + ", ".join(format_value(v) for v in sorted(value, key=sort_key)) + "}"
    if isinstance(value, Fn):
        if not value:
            return "<<>>"
        if all(_is_field_name(k) for k in value.keys()):
            return "[" + ", ".join(f"{k} |-> {format_value(v)}" for k, v in value.items()) + "]"
        return "(" + " @@ ".join(f"{format_value(k)} :> {format_value(v)}" for k, v in value.items()) + ")"
    raise TypeError(f"not a TLA+ value: {value!r} ({type(value).__name__})")


def format_state(state: Fn | Mapping[str, Value], indent: str = "") -> str:
    """Print a state as TLC does: one ``/\\ var = value`` line per variable."""
    return "\n".join(f"{indent}/\\ {name} = {format_value(v)}" for name, v in state.items())


def value_diff(path: str, old: Value, new: Value) -> list[tuple[str, Value, Value]]:
    """The smallest parts of ``old`` that differ from ``new``, as ``(path, old, new)``.

    Descends into functions with the same domain and sequences of the same
    length, so a change deep inside a large variable is reported as e.g.
    ``f[k1].state``.
    """
    if old == new:
        return []
    if isinstance(old, Fn) and isinstance(new, Fn) and old.keys() == new.keys():
        return [
            change
            for key in old.keys()
            for change in value_diff(path + _subscript(key), old[key], new[key])
        ]
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return [
            change
            for i, (o, n) in enumerate(zip(old, new))
            for change in value_diff(f"{path}[{i + 1}]", o, n)
        ]
    return [(path, old, new)]


def describe_changes(old: Fn, new: Fn) -> list[str]:
    """``"path: old -> new"`` for each smallest part of a state that a step changed."""
    return [
        f"{path}: {_format_or_absent(o)} -> {_format_or_absent(n)}"
        for name in dict.fromkeys([*old.keys(), *new.keys()])
        for path, o, n in value_diff(name, old.get(name, _ABSENT), new.get(name, _ABSENT))
    ]


_ABSENT = object()


def _format_or_absent(value: Value) -> str:
    return "(absent)" if value is _ABSENT else format_value(value)


def _subscript(key: Value) -> str:
    return f".{key}" if _is_field_name(key) else f"[{format_value(key)}]"


# --- parsing ------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<int>-?\d+)
  | (?P<punct><<|>>|\|->|:>|@@|\.\.|/\\|[{}\[\](),=])
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.VERBOSE | re.DOTALL,
)
_UNESCAPE = {"n": "\n", "t": "\t", "r": "\r", "f": "\f"}


class ParseError(ValueError):
    """Text that is not a TLC-printed value or state."""


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ParseError(f"unexpected character {text[pos]!r} at {pos} in {_excerpt(text, pos)}")
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup, m.group(), pos))
        pos = m.end()
    tokens.append(("end", "", pos))
    return tokens


def _excerpt(text: str, pos: int) -> str:
    return repr(text[max(0, pos - 30): pos + 30])


class _Parser:
    """Recursive descent over the token list; one method per grammar rule."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self, offset: int = 0) -> tuple[str, str, int]:
        return self.tokens[min(self.i + offset, len(self.tokens) - 1)]

    def at(self, lexeme: str) -> bool:
        kind, tok, _ = self.peek()
        return kind != "string" and tok == lexeme

    def take(self, lexeme: str | None = None, kind: str | None = None) -> str:
        k, tok, _ = self.peek()
        if (lexeme is not None and (tok != lexeme or k == "string")) or (kind is not None and k != kind):
            raise self.error(repr(lexeme) if lexeme is not None else kind)
        self.i += 1
        return tok

    def error(self, wanted: str) -> ParseError:
        kind, tok, pos = self.peek()
        got = "end of text" if kind == "end" else repr(tok)
        return ParseError(f"expected {wanted}, got {got} at {pos} in {_excerpt(self.text, pos)}")

    def finish(self) -> None:
        self.take(kind="end")

    # value := pair ('@@' pair)*      pair := primary (':>' primary)?
    def value(self) -> Value:
        first = self.primary()
        if not self.at(":>"):
            return first
        pairs = [(first, self.mapsto())]
        while self.at("@@"):
            self.take("@@")
            key = self.primary()
            pairs.append((key, self.mapsto()))
        # f @@ g takes f's value where both are defined.
        merged: dict[Value, Value] = {}
        for key, val in pairs:
            merged.setdefault(key, val)
        return Fn.of(merged)

    def mapsto(self) -> Value:
        self.take(":>")
        return self.primary()

    def primary(self) -> Value:
        kind, tok, _ = self.peek()
        if kind == "int":
            self.take()
            if self.at(".."):
                self.take("..")
                return frozenset(range(int(tok), int(self.take(kind="int")) + 1))
            return int(tok)
        if kind == "string":
            self.take()
            return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m[1], m[1]), tok[1:-1], flags=re.DOTALL)
        if kind == "ident":
            self.take()
            return _KEYWORDS.get(tok, ModelValue(tok))
        if tok == "{":
            return frozenset(self.items("{", "}"))
        if tok == "<<":
            return tuple(self.items("<<", ">>"))
        if tok == "[":
            return self.record()
        if tok == "(":
            self.take("(")
            inner = self.value()
            self.take(")")
            return inner
        raise self.error("a value")

    def items(self, open_: str, close: str) -> list[Value]:
        self.take(open_)
        out = []
        if not self.at(close):
            out.append(self.value())
            while self.at(","):
                self.take(",")
                out.append(self.value())
        self.take(close)
        return out

    def record(self) -> Fn:
        self.take("[")
        fields = []
        while True:
            name = self.take(kind="ident")
            self.take("|->")
            fields.append((name, self.value()))
            if not self.at(","):
                break
            self.take(",")
        self.take("]")
        return Fn.of(fields)

    # state := ('/\' ident '=' value)+ | ident '=' value
    def state(self) -> dict[str, Value]:
        out: dict[str, Value] = {}
        conjunction = self.at("/\\")
        while True:
            if conjunction:
                self.take("/\\")
            name = self.take(kind="ident")
            self.take("=")
            out[name] = self.value()
            if not conjunction or not self.at("/\\"):
                return out


def parse_value(text: str) -> Value:
    """Parse one TLC-printed value (whitespace and newlines allowed anywhere)."""
    parser = _Parser(text)
    value = parser.value()
    parser.finish()
    return value


def parse_state(text: str) -> dict[str, Value]:
    """Parse ``/\\ x = 1 /\\ y = {}`` (or a lone ``x = 1``) into ``{name: value}``."""
    parser = _Parser(text)
    state = parser.state()
    parser.finish()
    return state


# --- state graphs (TLC's -dump dot) ----------------------------------------------


@attrs.frozen
class StateGraph:
    """A reachable state graph; states are :class:`Fn` from variable name to value."""

    states: frozenset[Fn]
    initial: frozenset[Fn]
    edges: frozenset[tuple[Fn, str, Fn]]


_DOT_STRING = r'"(?:[^"\\]+|\\.)*"'
_DOT_LINE = re.compile(
    rf"^\s*(?P<src>-?\d+)\s*(?:->\s*(?P<dst>-?\d+)\s*)?\[(?P<attrs>(?:[^\]\"]+|{_DOT_STRING})*)\]",
    re.MULTILINE,
)
_DOT_LABEL = re.compile(rf"\blabel\s*=\s*({_DOT_STRING})")
_DOT_FILLED = re.compile(r"\bstyle\s*=\s*\"?filled")


def _dot_unescape(quoted: str) -> str:
    if "\\" not in quoted:
        return quoted[1:-1]
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], quoted[1:-1], flags=re.DOTALL)


# TLC prints a state as ``/\ var = value`` conjuncts, each starting a line. A
# long value wraps onto indented lines, none of which starts with ``/\`` (a
# string prints its line breaks as ``\n``), so a break followed by ``/\``
# starts the next conjunct.
_CONJUNCT = re.compile(r"\n(?=[ \t]*/\\)")


class _StateReader:
    """Parses the states of one graph, each distinct conjunct text once.

    States of a graph share most of their variables' values, so the parsed
    ``(name, value)`` of a conjunct is kept by its text; states that share a
    value share one object. A label that does not split into conjuncts that
    each parse alone is parsed whole, as :func:`parse_state` would.
    """

    def __init__(self) -> None:
        self.conjuncts: dict[str, tuple[tuple[str, Value], ...]] = {}

    def __call__(self, label: str) -> Fn:
        chunks = _CONJUNCT.split(label)
        if len(chunks) > 1 and not chunks[0].lstrip().startswith("/\\"):
            return Fn.of(parse_state(label))
        state: dict[str, Value] = {}
        try:
            for chunk in chunks:
                parsed = self.conjuncts.get(chunk)
                if parsed is None:
                    parsed = self.conjuncts[chunk] = tuple(parse_state(chunk).items())
                state.update(parsed)
        except ParseError:
            state = parse_state(label)
        return Fn.of(state)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cycle collector off a large graph.

    A graph is hundreds of thousands of small acyclic objects, freed by
    reference counting alone. The collector would walk all of them in each of
    its passes while the graph is built (about 3x the cost of building a
    20k-state graph), and again afterwards, once in each generation, finding
    nothing to free (a quarter of a conformance test's CPU time). So it is off
    while the graph is built, and on leaving, what is alive is moved out of its
    reach (``gc.freeze``); reference counting still frees it. The garbage of
    before is collected on entry, so that no cycle already unreachable is kept.
    """
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def parse_dot(text: str) -> StateGraph:
    """Read the graph TLC writes with ``-dump dot,actionlabels FILE``."""
    with gc_paused():
        return _parse_dot(text)


def _parse_dot(text: str) -> StateGraph:
    nodes: dict[str, Fn] = {}
    initial: set[Fn] = set()
    raw_edges: list[tuple[str, str, str]] = []
    read_state = _StateReader()
    for m in _DOT_LINE.finditer(text):
        label_m = _DOT_LABEL.search(m["attrs"])
        label = _dot_unescape(label_m[1]) if label_m else ""
        if m["dst"] is not None:
            raw_edges.append((m["src"], label, m["dst"]))
            continue
        state = read_state(label)
        nodes[m["src"]] = state
        if _DOT_FILLED.search(m["attrs"]):
            initial.add(state)
    try:
        edges = frozenset((nodes[s], label, nodes[d]) for s, label, d in raw_edges)
    except KeyError as e:
        raise ParseError(f"dot edge refers to undeclared node {e.args[0]}") from None
    return StateGraph(frozenset(nodes.values()), frozenset(initial), edges)


# --- counterexample traces ------------------------------------------------------


@attrs.frozen
class TraceStep:
    """One state of a TLC counterexample.

    ``action`` is ``"Initial predicate"``, the action's operator name, or
    ``"Stuttering"``. For a liveness lasso's last line ("Back to state N")
    ``back_to`` is N and ``state`` is that earlier state. ``text`` is the
    state as TLC printed it.
    """

    index: int
    action: str
    text: str = attrs.field(repr=False)
    back_to: int | None = None

    @functools.cached_property
    def state(self) -> Fn:
        """The state, read on first use: a trace check's counterexample can
        be hundreds of thousands of lines, of which the check reads the last
        state alone."""
        return Fn.of(parse_state(self.text))


_STATE_HEADER = re.compile(r"^State (\d+): (.*)$")
_BACK_TO = re.compile(r"^Back to state (\d+)(?::\s*(.*?))?\.?\s*$")
_INIT_VIOLATION = re.compile(r"is violated by the initial state:\s*$")
_ACTION_NAME = re.compile(r"<([^\s<>(]+)")
_BLOCK_END = re.compile(r"^\s*$|^State \d+:|^Back to state |^Error:")


def _action(header_rest: str, default: str) -> str:
    if header_rest.strip() == "<Initial predicate>":
        return "Initial predicate"
    m = _ACTION_NAME.match(header_rest.strip())
    return m[1] if m else default


def parse_trace(tlc_output: str) -> list[TraceStep]:
    """The first counterexample in TLC's output; ``[]`` when there is none."""
    lines = tlc_output.splitlines()
    steps: list[TraceStep] = []

    def block(start: int) -> tuple[str, int]:
        end = start
        while end < len(lines) and not _BLOCK_END.match(lines[end]):
            end += 1
        return "\n".join(lines[start:end]), end

    i = 0
    while i < len(lines):
        line = lines[i]
        header = _STATE_HEADER.match(line)
        back = _BACK_TO.match(line)
        if _INIT_VIOLATION.search(line) and not steps:
            text, i = block(i + 1)
            return [TraceStep(1, "Initial predicate", text)]
        if header:
            index, rest = int(header[1]), header[2].strip()
            if index == 1 and steps:
                break
            if rest == "Stuttering":
                steps.append(TraceStep(index, "Stuttering", steps[-1].text))
                i += 1
                continue
            text, i = block(i + 1)
            steps.append(TraceStep(index, _action(rest, rest), text))
            continue
        if back and steps:
            target = int(back[1])
            action = _action(back[2] or "", "Back to state")
            steps.append(TraceStep(len(steps) + 1, action, steps[target - 1].text, back_to=target))
            break
        i += 1
    return steps


def trace_changes(steps: list[TraceStep]) -> list[dict[str, tuple[Value, Value]]]:
    """For each step, ``{variable: (old, new)}`` for the variables it changed.

    The first step has no predecessor and maps to ``{}``.
    """
    out: list[dict[str, tuple[Value, Value]]] = []
    for prev, step in zip([None, *steps], steps):
        if prev is None:
            out.append({})
            continue
        names = list(dict.fromkeys([*prev.state.keys(), *step.state.keys()]))
        out.append({
            n: (prev.state.get(n), step.state.get(n))
            for n in names
            if prev.state.get(n) != step.state.get(n)
        })
    return out
