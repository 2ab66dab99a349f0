"""Parsing and printing of TLC values, states, dot graphs and traces (no TLC needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvproto.checking.tla import (
    Fn,
    ModelValue,
    ParseError,
    describe_changes,
    function,
    format_state,
    format_value,
    gc_paused,
    parse_dot,
    parse_state,
    parse_trace,
    parse_value,
    trace_changes,
    value_diff,
)

k1, k2, none = ModelValue("k1"), ModelValue("k2"), ModelValue("none")


# --- values -----------------------------------------------------------------------

def test_a_model_value_is_one_object_per_name():
    import copy
    import pickle
    assert ModelValue("k1") is k1 and parse_value("k1") is k1
    assert k1 == ModelValue("k1") and k1 != k2 and hash(k1) == hash(ModelValue("k1"))
    assert pickle.loads(pickle.dumps(k1)) is k1 and copy.deepcopy(k1) is k1
    with pytest.raises(AttributeError):
        k1.name = "k2"
    with pytest.raises(TypeError):
        ModelValue(1)


@pytest.mark.parametrize("text, value", [
    ("42", 42),
    ("-7", -7),
    ("TRUE", True),
    ("FALSE", False),
    ('""', ""),
    ('"a b"', "a b"),
    ('"q\\"\\\\z"', 'q"\\z'),
    ('"line\\nnext\\ttab"', "line\nnext\ttab"),
    ("k1", k1),
    ("{}", frozenset()),
    ("{-2, 1}", frozenset({1, -2})),
    ("1..3", frozenset({1, 2, 3})),
    ("2..1", frozenset()),
    ("<<>>", ()),
    ("<<1, <<>>, k1>>", (1, (), k1)),
    ("[a |-> 1, b |-> \"x\"]", Fn.of({"a": 1, "b": "x"})),
    ("(k1 :> 1 @@ k2 :> 2)", Fn.of({k1: 1, k2: 2})),
    ("k1 :> 1", Fn.of({k1: 1})),
    ("(k1 :> 1)", Fn.of({k1: 1})),
    ("((k1 :> 1))", Fn.of({k1: 1})),
    ("(<<1, 2>> :> {TRUE} @@ <<>> :> -1)", Fn.of({(1, 2): frozenset({True}), (): -1})),
    ("((a :> 1) :> (b :> <<2>>))", Fn.of({Fn.of({ModelValue("a"): 1}): Fn.of({ModelValue("b"): (2,)})})),
    ("(k1 :> 1 @@ k1 :> 2)", Fn.of({k1: 1})),  # @@ keeps the left function's value
])
def test_parse_value(text, value):
    assert parse_value(text) == value


def test_records_and_string_functions_are_the_same_value():
    assert parse_value('[a |-> 1]') == parse_value('("a" :> 1)') == Fn.of({"a": 1})
    assert parse_value('[a |-> 1]') != parse_value("(a :> 1)")  # model value key


def test_whitespace_and_newlines_anywhere():
    text = '(\n  k1\n :>  << [ a\t|->\n -3 ] ,\n {  } >>\n  @@ k2 :> <<>> )'
    assert parse_value(text) == Fn.of({k1: (Fn.of({"a": -3}), frozenset()), k2: ()})


@pytest.mark.parametrize("text", ["", "{1,", "<<1 2>>", "[a |-> ]", "[]", "1 2", '"open', "$", "k1 :>", "(1"])
def test_parse_errors(text):
    with pytest.raises(ParseError):
        parse_value(text)


def test_format_value():
    value = Fn.of({k2: (1, "a\"b"), k1: frozenset({none, -1})})
    assert format_value(value) == '(k1 :> {-1, none} @@ k2 :> <<1, "a\\"b">>)'
    assert format_value(Fn.of({"b": True, "a": ()})) == "[a |-> <<>>, b |-> TRUE]"
    assert format_value(Fn.of({"not a field": 1})) == '("not a field" :> 1)'


def test_a_function_over_an_empty_domain_is_the_empty_sequence_tlc_prints():
    assert function({}) == parse_value("<<>>") == ()
    assert function({k1: 1}) == parse_value("(k1 :> 1)")
    assert Fn.of({}) != parse_value("<<>>")


def test_fn_mapping_interface():
    f = Fn.of([(k2, 2), (k1, 1)])
    assert f == Fn.of({k1: 1, k2: 2}) and hash(f) == hash(Fn.of({k1: 1, k2: 2}))
    assert f[k1] == 1 and f.get(ModelValue("k3")) is None and k2 in f
    assert f.keys() == [k1, k2] and f.items() == ((k1, 1), (k2, 2)) and len(f) == 2
    assert repr(f) == "Fn({ModelValue('k1'): 1, ModelValue('k2'): 2})"
    with pytest.raises(ValueError):
        Fn(((k1, 1), (k1, 2)))


identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: s not in ("TRUE", "FALSE"))
leaves = st.one_of(
    st.integers(-10**12, 10**12),
    st.booleans(),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
    identifiers.map(ModelValue),
)


values = st.deferred(lambda: st.one_of(leaves, leaves, compounds))
compounds = st.one_of(
    st.frozensets(values, max_size=3),
    st.lists(values, max_size=3).map(tuple),
    st.dictionaries(values, values, min_size=1, max_size=3).map(Fn.of),
    st.dictionaries(identifiers, values, min_size=1, max_size=3).map(Fn.of),  # records
)


@given(values)
def test_format_then_parse_round_trips(value):
    assert parse_value(format_value(value)) == value


@given(st.dictionaries(identifiers, values, min_size=1, max_size=4))
def test_state_round_trips(state):
    text = "\n".join(f"/\\ {name} = {format_value(v)}" for name, v in state.items())
    assert parse_state(text) == state


# --- states -----------------------------------------------------------------------

def test_parse_state_conjunction_spanning_lines():
    text = (
        "/\\ x = << [aaaa |-> 1, b |-> {\"c\", \"d\"}],\n"
        "   [aaaa |-> 2, b |-> {}] >>\n"
        "/\\ s = none\n"
        "/\\ y = -1"
    )
    assert parse_state(text) == {
        "x": (Fn.of({"aaaa": 1, "b": frozenset({"c", "d"})}), Fn.of({"aaaa": 2, "b": frozenset()})),
        "s": none,
        "y": -1,
    }


def test_parse_single_variable_state():
    assert parse_state("x = 0") == {"x": 0}
    assert parse_state("  x =\n (k1 :> 0) ") == {"x": Fn.of({k1: 0})}
    with pytest.raises(ParseError):
        parse_state("x = 0 /\\ y = 1")


# --- dot graphs -----------------------------------------------------------------------

# Captured from TLC 2.15: `-dump dot,actionlabels` of a small spec (Max = 1).
TINY_DOT = r'''strict digraph DiskGraph {
nodesep=0.35;
subgraph cluster_graph {
color="white";
-314930165480121739 [label="/\\ held = (k1 :> \"free\" @@ k2 :> \"free\")\n/\\ count = 0\n/\\ log = <<>>",style = filled]
-314930165480121739 -> 5317404898184382902 [label="Take",color="black",fontcolor="black"];
5317404898184382902 [label="/\\ held = (k1 :> \"taken\" @@ k2 :> \"free\")\n/\\ count = 1\n/\\ log = <<k1>>"];
-314930165480121739 -> -7732047579040395306 [label="Take",color="black",fontcolor="black"];
-7732047579040395306 [label="/\\ held = (k1 :> \"free\" @@ k2 :> \"taken\")\n/\\ count = 1\n/\\ log = <<k2>>"];
5317404898184382902 -> 5317404898184382902 [label="Idle",color="black",fontcolor="black"];
5317404898184382902 -> 4191814154063108972 [label="Drop",color="black",fontcolor="black"];
4191814154063108972 [label="/\\ held = (k1 :> \"free\" @@ k2 :> \"free\")\n/\\ count = 1\n/\\ log = <<k1>>"];
-7732047579040395306 -> -7732047579040395306 [label="Idle",color="black",fontcolor="black"];
-7732047579040395306 -> 9035068971375131620 [label="Drop",color="black",fontcolor="black"];
9035068971375131620 [label="/\\ held = (k1 :> \"free\" @@ k2 :> \"free\")\n/\\ count = 1\n/\\ log = <<k2>>"];
4191814154063108972 -> 4191814154063108972 [label="Idle",color="black",fontcolor="black"];
9035068971375131620 -> 9035068971375131620 [label="Idle",color="black",fontcolor="black"];
{rank = same; -314930165480121739;}
{rank = same; -7732047579040395306;5317404898184382902;}
{rank = same; 4191814154063108972;9035068971375131620;}
}
}
'''


def tiny_state(count, k1_held, k2_held, log):
    held = Fn.of({k1: "taken" if k1_held else "free", k2: "taken" if k2_held else "free"})
    return Fn.of({"count": count, "held": held, "log": log})


def test_parse_dot():
    graph = parse_dot(TINY_DOT)
    init = tiny_state(0, False, False, ())
    took = tiny_state(1, True, False, (k1,))
    dropped = tiny_state(1, False, False, (k1,))
    assert len(graph.states) == 5
    assert graph.initial == {init}
    assert len(graph.edges) == 8
    assert (init, "Take", took) in graph.edges
    assert (took, "Idle", took) in graph.edges  # self-loops are kept
    assert (took, "Drop", dropped) in graph.edges


def test_parse_dot_unescapes_labels():
    dot = (
        '1 [label="/\\\\ s = \\"q\\\\\\"\\\\\\\\z\\"\\n/\\\\ x = 0",style = filled]\n'
        '-2 [label="x = 1"];\n'
        '1 -> -2 [label="Inc",color="black",fontcolor="black"];\n'
    )
    graph = parse_dot("strict digraph DiskGraph {\n" + dot + "}\n")
    assert graph.initial == {Fn.of({"s": 'q"\\z', "x": 0})}
    assert Fn.of({"x": 1}) in graph.states
    assert len(graph.edges) == 1



def dot_of(states: list[dict], edges: list[tuple[int, str, int]]) -> str:
    """A graph in the form TLC's ``-dump dot,actionlabels`` writes."""
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    lines = ["strict digraph DiskGraph {", "nodesep=0.35;", "subgraph cluster_graph {", 'color="white";']
    for i, state in enumerate(states):
        label = "\n".join(f"/\\ {name} = {format_value(v)}" for name, v in state.items())
        lines.append(f"{i} [label={quoted(label)}{',style = filled' if i == 0 else ''}]")
    for src, action, dst in edges:
        lines.append(f'{src} -> {dst} [label={quoted(action)},color="black",fontcolor="black"];')
    return "\n".join(lines + ["}", "}", ""])


@given(st.data())
def test_parse_dot_reads_every_state_as_parse_state_does(data):
    """States that share variables' values (parsed once per graph) still read
    back as written, strings with line breaks and ``/\\`` in them included."""
    names = data.draw(st.lists(identifiers, min_size=1, max_size=3, unique=True))
    pool = data.draw(st.lists(st.one_of(values, st.just("a\n/\\ x = 1")), min_size=1, max_size=3))
    states = data.draw(st.lists(st.fixed_dictionaries({n: st.sampled_from(pool) for n in names}),
                                min_size=1, max_size=4, unique_by=lambda d: format_state(d)))
    edges = data.draw(st.lists(st.tuples(st.integers(0, len(states) - 1), st.sampled_from(["A", "B"]),
                                         st.integers(0, len(states) - 1)), max_size=5))
    graph = parse_dot(dot_of(states, edges))
    read = [Fn.of(s) for s in states]
    assert graph.states == frozenset(read)
    assert graph.initial == {read[0]}
    assert graph.edges == {(read[a], label, read[b]) for a, label, b in edges}


def test_parse_dot_reads_a_label_it_cannot_split_whole():
    """A label whose line breaks do not all start a conjunct (here one inside a
    string) is parsed whole."""
    dot = dot_of([{"x": 1}], []).replace(
        '"/\\\\ x = 1"', '"/\\\\ s = \\"a\\n/\\\\\\\\ b\\"\\n/\\\\ x = 1"')
    assert parse_dot(dot).states == {Fn.of({"s": "a\n/\\ b", "x": 1})}


def test_a_graph_built_with_the_collector_paused_is_left_out_of_its_passes():
    """``gc_paused``: the collector is off inside; what was garbage before is
    collected on entry; what is alive on leaving is frozen (never walked
    again, still freed by reference counting); the collector is on again."""
    import gc
    import weakref

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    assert gc.isenabled()
    gone_before = cycle()          # unreachable, not collected yet
    frozen = gc.get_freeze_count()
    with gc_paused():
        assert not gc.isenabled() and gone_before() is None
        built = [Node() for _ in range(1000)]
        with gc_paused():          # nested: the inner one leaves it off
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(built)
    kept = weakref.ref(built[0])
    del built
    assert kept() is None          # frozen, and freed by reference counting


# --- traces -------------------------------------------------------------------------

SAFETY_OUTPUT = """\
Finished computing initial states: 1 distinct state generated at 2026-11-29 11:54:49.
Error: Invariant Inv is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ f = (k1 :> <<>> @@ k2 :> <<>>)
/\\ x = 0

State 2: <Inc line 9, col 8 to line 11, col 28 of module M>
/\\ f = (k1 :> <<>> @@ k2 :> <<>>)
/\\ x = 1

State 3: <Put line 12, col 11 to line 15, col 24 of module M>
/\\ f = (k1 :> <<[a |-> 3, b |-> "q\\"\\\\z", c |-> {-2, 1}]>> @@ k2 :> <<>>)
/\\ x = 1

12 states generated, 12 distinct states found, 6 states left on queue.
The depth of the complete state graph search is 3.
"""

STUTTER_OUTPUT = """\
Error: Temporal properties were violated.

Error: The following behavior constitutes a counter-example:

State 1: <Initial predicate>
x = 0

State 2: <Inc line 9, col 8 to line 11, col 28 of module M>
x = 1

State 3: Stuttering
Finished checking temporal properties in 00s at 2026-11-29 11:54:50
"""

LASSO_OUTPUT = """\
Error: Temporal properties were violated.

Error: The following behavior constitutes a counter-example:

State 1: <Initial predicate>
x = 0

State 2: <A line 5, col 6 to line 5, col 21 of module L>
x = 1

State 3: <A line 5, col 6 to line 5, col 21 of module L>
x = 2

Back to state 1: <A line 5, col 6 to line 5, col 21 of module L>

Finished checking temporal properties in 00s at 2026-11-29 11:55:05
"""

INITIAL_OUTPUT = """\
Computing initial states...
Error: Invariant Inv0 is violated by the initial state:
/\\ x = 0
/\\ y = {}

Finished in 00s at (2026-11-29 11:55:04)
"""

RUNTIME_ERROR_OUTPUT = """\
Error: The behavior up to this point is:
State 1: <Initial predicate>
x = 0

State 2: <Next line 5, col 9 to line 5, col 28 of module E>
x = 1
Error: TLC was unable to fingerprint.
"""


def test_parse_safety_trace():
    steps = parse_trace(SAFETY_OUTPUT)
    assert [(s.index, s.action) for s in steps] == [(1, "Initial predicate"), (2, "Inc"), (3, "Put")]
    assert steps[2].state["f"][k1][0]["b"] == 'q"\\z'
    changes = trace_changes(steps)
    assert changes[0] == {} and changes[1] == {"x": (0, 1)} and list(changes[2]) == ["f"]
    assert describe_changes(steps[1].state, steps[2].state) == [
        'f[k1]: <<>> -> <<[a |-> 3, b |-> "q\\"\\\\z", c |-> {-2, 1}]>>'
    ]


def test_parse_stuttering_trace():
    steps = parse_trace(STUTTER_OUTPUT)
    assert [s.action for s in steps] == ["Initial predicate", "Inc", "Stuttering"]
    assert steps[2].state == steps[1].state == Fn.of({"x": 1})
    assert trace_changes(steps)[2] == {}


def test_parse_lasso_trace():
    steps = parse_trace(LASSO_OUTPUT)
    assert [(s.index, s.action, s.back_to) for s in steps] == [
        (1, "Initial predicate", None), (2, "A", None), (3, "A", None), (4, "A", 1)]
    assert steps[3].state == steps[0].state
    assert trace_changes(steps)[3] == {"x": (2, 0)}


def test_parse_initial_state_violation_and_runtime_error_traces():
    [step] = parse_trace(INITIAL_OUTPUT)
    assert step.action == "Initial predicate" and step.state == Fn.of({"x": 0, "y": frozenset()})
    assert [s.state["x"] for s in parse_trace(RUNTIME_ERROR_OUTPUT)] == [0, 1]
    assert parse_trace("Model checking completed. No error has been found.\n") == []


def test_value_diff_paths():
    old = Fn.of({"objs": Fn.of({k1: Fn.of({"state": "writing", "reps": (1, 2)})})})
    new = Fn.of({"objs": Fn.of({k1: Fn.of({"state": "published", "reps": (1, 3)})})})
    assert value_diff("v", old, new) == [
        ("v.objs[k1].reps[2]", 2, 3),
        ("v.objs[k1].state", "writing", "published"),
    ]
    assert value_diff("v", (1,), (1, 2)) == [("v", (1,), (1, 2))]
    assert describe_changes(Fn.of({"a": 1}), Fn.of({"b": 1})) == ["a: 1 -> (absent)", "b: (absent) -> 1"]
