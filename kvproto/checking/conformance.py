"""Check that a Python state machine has the same state graph as its TLA+ spec.

:func:`explore` enumerates the Python machine's reachable graph through a stated
mapping ``to_tla`` (Python state -> :class:`~kvproto.checking.tla.Fn` from
TLA+ variable name to value; see :mod:`kvproto.checking.tla` for the value
forms). :func:`compare` diffs it against the graph TLC dumped with
``-dump dot,actionlabels``. Edge labels are TLA+ action operator names.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, Optional

import attrs

from .tla import Fn, StateGraph, describe_changes, format_state, format_value, gc_paused

Edge = tuple[Fn, str, Fn]


@attrs.frozen
class SpecBinding:
    """How one TLA+ module and its Python machine line up.

    ``constants`` turns a model's CONSTANTS (as parsed TLA+ values) into the
    machine's constants; ``initial``, ``successors`` and ``to_tla`` define the
    Python graph and the stated mapping; ``actions`` and ``invariants`` name
    the spec's actions and invariants with their Python twins.
    """

    module: str
    constants: Callable[[Mapping[str, Any]], Any]
    initial: Callable[[Any], Iterable[Hashable]]
    successors: Callable[[Hashable, Any], Iterable[tuple[str, Hashable]]]
    to_tla: Callable[[Hashable, Any], Fn]
    actions: Mapping[str, Callable]
    invariants: Mapping[str, Callable]

    def violated(self, state: Hashable) -> list[str]:
        """Names of the invariants ``state`` violates."""
        return [name for name, check in self.invariants.items() if not check(state)]

    def graph(self, tla_constants: Mapping[str, Any], max_states: int = 100_000) -> StateGraph:
        """The Python machine's reachable graph for one model's constants."""
        c = self.constants(tla_constants)
        return explore(self.initial(c), lambda s: self.successors(s, c),
                       lambda s: self.to_tla(s, c), max_states=max_states)


def emit(action: str, successor):
    """``(action, successor)`` when the action is enabled (``successor`` is not
    ``None``): each machine's ``successors`` yields from it per action."""
    if successor is not None:
        yield action, successor


#: The steps taken in the exploration in progress: ``(step, state, event) -> result``.
_steps_taken: ContextVar[Optional[dict]] = ContextVar("steps_taken", default=None)


def memoised_step(step: Callable[[Hashable, Hashable], tuple]) -> Callable[[Hashable, Hashable], tuple]:
    """``step(state, event) -> (state, effects)``, taken once per equal
    ``(state, event)`` while :func:`explore` walks a graph.

    The exploration expands one state of each class of equal states, so it
    already takes a step's result to depend on its arguments' values only
    (tests/stateful/test_caches.py shows it for the fields left out of
    equality). Many system states share equal parts (a pool, a directory), and
    each part meets the same events again and again. A step that returns its
    state unchanged (a refusal) returns the caller's own object, as the step
    does. An event that cannot be hashed is stepped every time.
    """
    @functools.wraps(step)
    def memo(state, event):
        taken = _steps_taken.get()
        if taken is None:
            return step(state, event)
        key = (step, state, event)
        try:
            found = taken.get(key)
        except TypeError:   # an event that carries a dict
            return step(state, event)
        if found is None:
            new, effects = step(state, event)
            found = taken[key] = (None if new is state else new, effects)
        new, effects = found
        return (state if new is None else new), effects
    return memo


class StateLimitExceeded(RuntimeError):
    """:func:`explore` reached more states than its ``max_states``."""


def explore(
    initial_states: Iterable[Hashable],
    successors: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
    to_tla: Callable[[Hashable], Fn],
    max_states: int = 100_000,
) -> StateGraph:
    """Breadth-first enumeration of a Python machine's reachable state graph.

    ``successors(state)`` yields ``(action_name, next_state)``. Python states
    must be hashable; they are deduplicated as Python states and recorded as
    ``to_tla(state)``. Self-loops are kept, as TLC keeps them.
    """
    token = _steps_taken.set({})
    try:
        with gc_paused():
            return _explore(initial_states, successors, to_tla, max_states)
    finally:
        _steps_taken.reset(token)


def _explore(initial_states, successors, to_tla, max_states) -> StateGraph:
    initial = list(dict.fromkeys(initial_states))
    if len(initial) > max_states:
        raise StateLimitExceeded(f"more than {max_states} initial states")
    # Python states that map to equal TLA+ states share one object.
    interned: dict[Fn, Fn] = {}

    def tla(state: Hashable) -> Fn:
        mapped = to_tla(state)
        return interned.setdefault(mapped, mapped)

    tla_of = {state: tla(state) for state in initial}
    queue = deque(initial)
    edges: set[Edge] = set()
    while queue:
        state = queue.popleft()
        for label, nxt in successors(state):
            if nxt not in tla_of:
                if len(tla_of) >= max_states:
                    raise StateLimitExceeded(f"more than {max_states} reachable states")
                tla_of[nxt] = tla(nxt)
                queue.append(nxt)
            edges.add((tla_of[state], label, tla_of[nxt]))
    return StateGraph(
        states=frozenset(tla_of.values()),
        initial=frozenset(tla_of[s] for s in initial),
        edges=frozenset(edges),
    )


@attrs.frozen
class ConformanceReport:
    """What differs between TLC's graph and the Python machine's graph."""

    tlc: StateGraph = attrs.field(repr=False)
    py: StateGraph = attrs.field(repr=False)
    states_only_tlc: frozenset[Fn]
    states_only_py: frozenset[Fn]
    edges_only_tlc: frozenset[Edge]
    edges_only_py: frozenset[Edge]
    initial_only_tlc: frozenset[Fn]
    initial_only_py: frozenset[Fn]

    @property
    def ok(self) -> bool:
        return not (
            self.states_only_tlc or self.states_only_py
            or self.edges_only_tlc or self.edges_only_py
            or self.initial_only_tlc or self.initial_only_py
        )

    def describe(self, limit: int = 5) -> str:
        """A readable account of the differences, at most ``limit`` examples per kind."""
        sides = {"TLC": self.tlc, "Python": self.py}
        lines = [
            f"TLC: {_size(self.tlc)}; Python: {_size(self.py)}.",
        ]
        if self.ok:
            return "\n".join(["The graphs are identical.", *lines])
        lines += _variable_mismatch(self.tlc, self.py)
        for side, only in (("TLC", self.initial_only_tlc), ("Python", self.initial_only_py)):
            lines += _state_section(f"Initial states only in {side}", only, limit)
        # Edges leaving a state both sides reach are where the machines diverge;
        # edges from states only one side reaches are consequences of that.
        for side, other, only in (("TLC", "Python", self.edges_only_tlc),
                                  ("Python", "TLC", self.edges_only_py)):
            diverging = sorted(
                (e for e in only if e[0] in sides[other].states), key=_edge_sort_key
            )
            if diverging:
                lines.append(f"\nSteps only {side} takes from states both reach ({len(diverging)}):")
                for src, label, dst in diverging[:limit]:
                    lines.append("  from:")
                    lines.append(format_state(src, indent="      "))
                    lines.append(f"  {side}: {label} {_step_changes(src, dst)}")
                    theirs = [d for s, lbl, d in sides[other].edges if s == src and lbl == label]
                    if not theirs:
                        lines.append(f"  {other}: no {label} step from this state")
                    for d in theirs[:limit]:
                        lines.append(f"  {other}: {label} {_step_changes(src, d)}")
                _more(lines, len(diverging), limit)
        for side, only in (("TLC", self.states_only_tlc), ("Python", self.states_only_py)):
            lines += _state_section(f"States only {side} reaches", only, limit)
        return "\n".join(["The graphs differ.", *lines])


def compare(tlc: StateGraph, py: StateGraph) -> ConformanceReport:
    """Diff TLC's state graph against the Python machine's."""
    with gc_paused():
        return _compare(tlc, py)


def _compare(tlc: StateGraph, py: StateGraph) -> ConformanceReport:
    # Each state is compared by value once: a TLC state equal to a Python one
    # is replaced by that very object in TLC's edges, so that comparing the
    # edges (many per state) finds equal states by identity.
    py_state = {s: s for s in py.states}
    as_py = {s: py_state.get(s) for s in tlc.states}
    matched = frozenset(p for p in as_py.values() if p is not None)

    def on_py(state: Fn) -> Fn:
        found = as_py.get(state)
        return state if found is None else found

    tlc_edges = frozenset((on_py(a), label, on_py(b)) for a, label, b in tlc.edges)
    return ConformanceReport(
        tlc=tlc,
        py=py,
        states_only_tlc=frozenset(s for s, p in as_py.items() if p is None),
        states_only_py=py.states - matched,
        edges_only_tlc=tlc_edges - py.edges,
        edges_only_py=py.edges - tlc_edges,
        initial_only_tlc=tlc.initial - py.initial,
        initial_only_py=py.initial - tlc.initial,
    )


def _size(graph: StateGraph) -> str:
    return f"{len(graph.states)} states, {len(graph.initial)} initial, {len(graph.edges)} steps"


def _variable_mismatch(tlc: StateGraph, py: StateGraph) -> list[str]:
    tlc_vars = {name for s in tlc.states for name in s.keys()}
    py_vars = {name for s in py.states for name in s.keys()}
    out = []
    if tlc_vars - py_vars:
        out.append(f"Variables only in TLC states: {', '.join(sorted(tlc_vars - py_vars))}")
    if py_vars - tlc_vars:
        out.append(f"Variables only in Python states: {', '.join(sorted(py_vars - tlc_vars))}")
    return out


def _state_section(title: str, states: frozenset[Fn], limit: int) -> list[str]:
    if not states:
        return []
    lines = [f"\n{title} ({len(states)}):"]
    for state in sorted(states, key=_state_sort_key)[:limit]:
        lines.append(format_state(state, indent="    "))
        lines.append("")
    _more(lines, len(states), limit)
    return lines


def _step_changes(src: Fn, dst: Fn) -> str:
    changes = describe_changes(src, dst)
    return "changes " + "; ".join(changes) if changes else "changes nothing (self-loop)"


def _more(lines: list[str], total: int, limit: int) -> None:
    if total > limit:
        lines.append(f"  ... and {total - limit} more")


def _state_sort_key(state: Fn) -> str:
    return format_value(state)


def _edge_sort_key(edge: Edge) -> tuple[str, str, str]:
    return (format_value(edge[0]), edge[1], format_value(edge[2]))
