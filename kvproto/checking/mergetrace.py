r"""A master's trace and its storage nodes' traces, merged into one behaviour of
``spec/Publish.tla`` and checked by TLC (``kvproto trace merge``).

A master records its directory's steps (:mod:`kvproto.runtime.tracing`), a
storage node its core's steps (``kvproto storage --trace FILE``, or beside the
master's ``KVPROTO_TRACE`` file). No clock orders the files; the protocol
does. Every node step of the region table has a cause in the master's steps:

* an ``AssignRegion`` or ``FreeRegion`` is the master's command, sent for the
  effect of that name (same segment, offset and token) of one of its steps;
  the i-th such step at the node was caused by the i-th such effect;
* a ``WriteReplica`` or ``ReadReplica`` names a token (the one its request
  carried, and the one the node stepped), which exists from the master's
  ``PutStart`` that granted it. (A read's own cause is later, a ``ReadBegin``
  or, for a repair's copier, a ``RepairStart``; the node's order keeps it
  after the write it reads.)

The merged behaviour keeps the master's steps in their order and each node's
in its order, and puts each node step right after the later of its cause and
the node's step before it: no later than it happened, so everything it caused
still comes after it, and after the causes named here. Only the region
table's steps are merged: the term fence and object index steps (``Fence``,
``StampedAllocate``, ``StampedPublish``, ...) belong to ``spec/Failover.tla``
and are left out.

TLC walks the merged behaviour with a module ``MergedTrace`` that extends the
master's ``PublishTrace`` (:mod:`kvproto.checking.traces`): a master step is
checked as there, and its commands join a per-segment queue of commands in
flight; a node step must be the spec's storage action:

* an accepted ``AssignRegion``/``FreeRegion`` applies the command at the head
  of its segment's queue (the master sends them in order, on one connection),
  to the node's region table as the trace builds it; a refused assign, or a
  command the master never sent, matches nothing;
* an accepted ``WriteReplica`` is the spec's ``WriteReplica`` into that slot
  by the writer of the token the write request carried (the node records it,
  ``asked``, before it steps its core), whose guard is the spec's token check
  (``StorageOwns``); where the master has freed the region already and the
  free is still on its way to the node, the write lands in a region about to
  be freed and changes nothing of the spec; in both cases the node's table
  must hold the region for the event's token, unwritten;
* an accepted ``ReadReplica`` reads, for the token its request carried, a
  region holding that attempt's complete bytes (the spec's ``content``), or
  one whose free is on its way;
* a refused write or read is one the node's table would refuse.

Since the master's commands are its steps' effects, which must be the spec's
changes of ``store``, and each node applies them in order, a node's table
with its commands in flight applied is the spec's ``store`` in every state
(by construction: it is not a separate invariant); the spec's invariants are
checked in every state. Writes to segments no trace covers are let happen
before the attempt's ``PutEnd`` (as in the master's own check). A merged behaviour that
the spec does not allow fails at the first step TLC cannot take, named by its
file and recorded number.

A repair's copy into a traced segment is the node's ``WriteReplica`` of the
repair's region under the object's token: the spec's ``CopyReplica``. A
same-host writer's direct write (``spec/DirectWrite.tla``) is stepped by its
node when it publishes the object, with no request recorded: its cause is the
grant, so it is placed before the ``PutEnd``, where the writer wrote it.

A master file holds a run per time the master opened its directory (one is
checked: :func:`master_run`). The run of a master of term ``T`` is merged
with each node's steps under ``T``
(:func:`~kvproto.checking.nodetrace.read_node`: from its fence of ``T`` to
its first fence of a later term), and starts from the directory it
opened with (``traces.OpenedInit``) and from each traced node's region table
at its fence of ``T``, replayed from its steps before (``NodesOpened``). For a
master that took over:

* ``OpenedOnNodes``, where the run starts: each replica the directory lists is
  held by its node under the object's token, written as the spec's ``store``
  has it, and every region a node holds carries a token issued before the run;
* a node's purge (a ``FreeRegion`` per allocation its ``PurgeUnpublished``
  dropped, by the node's index) is caused by the opening, and may free only a
  region the spec's ``store`` does not hold (one the directory does not list);
* the frees the recovery sends itself (the ``opened`` line's ``frees``) are
  commands in flight from the start, ahead of the run's own;
* a write or read under a token issued before the run is caused by the opening.

A run longer than one TLC run may take is checked whole in windows
(:func:`check_windows`, :mod:`kvproto.checking.windows`) that end only where
the run is quiet (:class:`Windows`: nothing of a pending put or repair
written on a traced node), so that the state there is the directory (pending
puts' writers busy), the nodes' tables and the commands on their way; TLC
checks each window ends in it (``WindowEnd``, ``NodesWindowEnd``) and the
next starts from it, as from a takeover's opening.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

import attrs

from kvproto.checking import traces, windows
from kvproto.checking.nodetrace import node_files, read_nodes, replay
from kvproto.checking.tla import Fn, format_value
from kvproto.checking.tracerun import (TraceError, Verdict, accepted, cfg_text, failure,
                                       first_unmatched, run_module)

__all__ = ["Causes", "MergedModel", "Windows", "check", "check_steps", "check_windows",
           "master_run", "merge"]

#: the master's effects that are commands to a node, and their names in the queue
COMMANDS = {"AssignRegion": "assign", "FreeRegion": "free"}


def opened_commands(header: dict) -> list[tuple]:
    """The master's commands on their way to the nodes when the run opened
    (``(segment, kind, offset, token)`` each, in order): its recovery's own
    frees (an ``opened`` line's ``frees``: replicas left out for their
    checksum), or those a window before left on their way (``sent``)."""
    try:
        return [(f["segment"], "FreeRegion", f["offset"], f["token"])
                for f in header.get("frees", ())] \
            + [(c["segment"], c["type"], c["offset"], c["token"]) for c in header.get("sent", ())]
    except (KeyError, TypeError) as e:
        raise TraceError(f"a command of the opened line the checker cannot read ({e!r})") \
            from None


class Causes:
    """Where the cause of each node step is among a master's steps (see the
    module docstring): the position of the step that issued its command or
    granted its token (0: the run's opening, for the purge, recovery's own
    frees and the tokens issued before the run), or ``None`` where it is not
    among them."""

    def __init__(self, master: list[tuple[int, dict]], header: dict) -> None:
        self.issued: dict[tuple, list[int]] = defaultdict(list)   # command -> positions
        self.granted: dict[int, int] = {}                         # token -> its PutStart
        self.first = header.get("next_token", 1)
        for command in opened_commands(header):
            self.issued[command].append(0)
        for pos, (_, step) in enumerate(master, 1):
            for e in step["effects"] if accepted(step) else ():
                kind = e["type"]
                if kind in COMMANDS:
                    self.issued[(e["segment"], kind, e["offset"], e["token"])].append(pos)
                elif kind == "PutGranted":
                    self.granted.setdefault(e["token"], pos)

    def of(self, steps: list[tuple[int, dict]]) -> list[Optional[int]]:
        """The cause of each of one node's steps, in its order."""
        seen: dict[tuple, int] = defaultdict(int)
        out: list[Optional[int]] = []
        for _, step in steps:
            ev = step["event"]
            kind, token = ev["type"], ev.get("token")
            if step.get("purge"):
                out.append(0)
            elif kind in COMMANDS:
                command = (ev["segment"], kind, ev["offset"], token)
                k, seen[command] = seen[command], seen[command] + 1
                out.append(self.issued[command][k] if k < len(self.issued[command]) else None)
            else:
                causes = [self._grant(t) for t in (token, step.get("asked", token))]
                out.append(None if None in causes else max(causes))
        return out

    def _grant(self, token) -> Optional[int]:
        if token in self.granted:
            return self.granted[token]
        return 0 if isinstance(token, int) and token < self.first else None


def merge(master: list[tuple[int, dict]], nodes: list[list[tuple[int, dict]]],
          header: Optional[dict] = None) -> list[tuple]:
    """The master's steps and the nodes' region steps in one causal order:
    ``(source, index, (line, step))`` each, ``source`` ``-1`` for the master
    and else the node's index (see the module docstring); ``header``: the
    run's ``opened`` line."""
    causes = Causes(master, header or {})
    order = [((pos, -1, 0), (-1, pos - 1)) for pos in range(1, len(master) + 1)]
    for n, steps in enumerate(nodes):
        at = 0
        for i, cause in enumerate(causes.of(steps)):
            at = max(at, cause or 0)     # a step without a cause is left where TLC rejects it
            order.append(((at, n, i), (n, i)))
    order.sort(key=lambda item: item[0])
    return [(source, index, master[index] if source < 0 else nodes[source][index])
            for _, (source, index) in order]


def _commands(m, step: dict) -> Fn:
    """A master step's commands to the nodes, per segment, in the order sent."""
    queued: dict = defaultdict(list)
    for e in step["effects"] if accepted(step) else ():
        if e["type"] in COMMANDS:
            segment, slot = m.slot(e["segment"], e["offset"])
            queued[segment].append((COMMANDS[e["type"]], slot, m.token(e["token"])))
    return Fn.of({s: tuple(q) for s, q in queued.items()})


def _node_record(m, step: dict) -> Fn:
    """A node step: ``t`` the token of the event the node stepped, ``a`` (and its
    writer ``w``) the token the request carried (the event's, for a command);
    a free of the node's purge is ``Purge``."""
    ev = step["event"]
    segment, slot = m.slot(ev["segment"], ev["offset"])
    asked = step.get("asked", ev.get("token"))
    return Fn.of({"src": "node", "act": "Purge" if step.get("purge") else ev["type"],
                  "ok": accepted(step), "s": segment, "x": slot, "t": m.token(ev.get("token")),
                  "a": m.token(asked), "w": m.writer(asked)})


def _regions(m, tables: dict) -> Fn:
    """The nodes' region tables (segment -> offset -> (token, written)) on
    model values: slot -> [token, done]."""
    return Fn.of({m.slot(segment, offset): Fn.of({"token": m.token(token), "done": written})
                  for segment, regions in tables.items()
                  for offset, (token, written) in regions.items()})


def _queues(m, commands: list[tuple]) -> Fn:
    """Commands on their way (:func:`opened_commands`) as the module's ``sent``."""
    sent: dict = defaultdict(list)
    for segment, kind, offset, token in commands:
        seg, slot = m.slot(segment, offset)
        sent[seg].append((COMMANDS[kind], slot, m.token(token)))
    return Fn.of({seg: tuple(q) for seg, q in sent.items()})


class MergedModel:
    """The merged behaviour on model values: what :func:`traces.module` and
    :func:`cfg_text` take, and where each record came from. ``tables``: the
    nodes' region tables the run starts from (segment -> offset -> (token,
    written), :attr:`~kvproto.checking.nodetrace.NodeRun.table`)."""

    def __init__(self, header, master, nodes, files, tables: Optional[dict] = None,
                 end: Optional[dict] = None, end_tables: Optional[dict] = None) -> None:
        tables = tables or {}
        frees = opened_commands(header)
        m = traces.run_mapping(header, master, frozenset(
            [t for regions in tables.values() for t, _ in regions.values()]
            + [token for *_, token in frees]))
        merged = merge(master, nodes, header)
        for segment, regions in tables.items():  # the nodes' names first, then the master's
            for offset in sorted(regions):
                m.slot(segment, offset)
        for segment, _, offset, _ in frees:
            m.slot(segment, offset)
        for source, _, (_, step) in merged:
            if source >= 0:
                m.slot(step["event"]["segment"], step["event"]["offset"])
        base = traces.to_model(header, master, mapping=m, end=end)
        self.constants, self.model_values, self.opened, self.end = \
            base.constants, base.model_values, base.opened, base.end
        self.nodes_opened = _regions(m, tables)
        #: the regions the nodes hold where a window ends (``NodesEnd``)
        self.nodes_end = _regions(m, end_tables or {})
        self.sent_opened = _queues(m, frees)
        #: the commands on their way where a window ends (``SentEnd``)
        self.sent_end = _queues(m, opened_commands({"sent": (end or {}).get("sent", ())}))
        records, self.origins = [], []
        for source, index, (line, step) in merged:
            if source < 0:
                record = base.records[index]
                records.append(Fn.of({**dict(record.items()), "src": "master",
                                      "cmds": _commands(m, step)}))
                self.origins.append((files[0], step.get("n"), line, step))
            else:
                records.append(_node_record(m, step))
                self.origins.append((files[source + 1], step.get("n"), line, step))
        self.records = tuple(records)
        self.mapping = m


_MODULE = r"""---------------------------- MODULE MergedTrace -----------------------------
(* A master's recorded run and its storage nodes', merged in causal order   *)
(* (kvproto trace merge): each master step is checked as in PublishTrace,   *)
(* each node step must be the spec's storage action.                        *)
EXTENDS PublishTrace

VARIABLES
    nodes,   \* segment -> slot -> the region its node holds, as its steps built it
    sent     \* segment -> the master's commands its node has not applied yet

Traced == %(traced)s

\* What the run starts from beside the directory it opened with: the regions
\* the traced nodes held when fenced under the master's term (segment and
\* slot -> token, written), and the frees the master's recovery sent itself.
NodesOpened == %(nodes)s
SentOpened == %(sent)s
\* Where a window of a longer run ends (kvproto.checking.windows): the
\* regions its nodes hold there, built from their recorded steps, and the
\* master's commands still on their way to them.
NodesEnd == %(nodes_end)s
SentEnd == %(sent_end)s
\* The segments whose nodes take no step after the window (killed): commands
\* on their way there can never be taken, and the next window drops them.
Idle == %(idle)s

Applied(s, x, t) == nodes[s][x] # None /\ nodes[s][x].token = t
StoreOwns(s, x, t) == store[s][x] # None /\ store[s][x].token = t
\* The master freed (assigned) the region and the command is on its way to the node.
FreeInFlight(s, x, t) == \E j \in 1..Len(sent[s]) : sent[s][j] = <<"free", x, t>>
AssignInFlight(s, x, t) == \E j \in 1..Len(sent[s]) : sent[s][j] = <<"assign", x, t>>

MasterStep ==
    /\ R.src = "master"
    /\ Step
    /\ sent' = [s \in Segments |-> IF s \in DOMAIN R.cmds THEN sent[s] \o R.cmds[s] ELSE sent[s]]
    /\ UNCHANGED nodes

\* A command applied at the node: the head of its segment's queue.
Command(r, kind) ==
    /\ sent[r.s] # <<>> /\ Head(sent[r.s]) = <<kind, r.x, r.t>>
    /\ sent' = [sent EXCEPT ![r.s] = Tail(@)]

NodeStep ==
    /\ R.src = "node"
    /\ LET r == R IN
       \/ /\ r.act = "AssignRegion" /\ r.ok /\ Command(r, "assign")
          /\ nodes[r.s][r.x] = None
          /\ nodes' = [nodes EXCEPT ![r.s][r.x] = [token |-> r.t, done |-> FALSE]]
          /\ UNCHANGED vars
       \/ /\ r.act = "FreeRegion" /\ Command(r, "free")
          /\ IF r.ok THEN /\ Applied(r.s, r.x, r.t)
                          /\ nodes' = [nodes EXCEPT ![r.s][r.x] = None]
                     ELSE /\ ~Applied(r.s, r.x, r.t)
                          /\ UNCHANGED nodes
          /\ UNCHANGED vars
       \/ /\ r.act = "WriteReplica" /\ r.ok
          /\ Applied(r.s, r.x, r.t) /\ ~nodes[r.s][r.x].done
          /\ nodes' = [nodes EXCEPT ![r.s][r.x].done = TRUE]
          /\ IF StoreOwns(r.s, r.x, r.t)
             THEN \/ /\ writer[r.w] # None /\ r.s \in DOMAIN writer[r.w].replicas
                     /\ writer[r.w].replicas[r.s] = r.x
                     /\ WriteReplica(r.w, r.s)
                  \/ /\ r.a = r.t   \* a repair's copier fills the region of its repair
                     /\ \E k \in Keys : /\ Published(k) /\ dir[k].token = r.t
                                       /\ r.s \in DOMAIN dir[k].repairs
                                       /\ dir[k].repairs[r.s].slot = r.x
                                       /\ CopyReplica(k, r.s)
             ELSE r.a = r.t /\ FreeInFlight(r.s, r.x, r.t) /\ UNCHANGED vars
          /\ UNCHANGED sent
       \/ /\ r.act = "ReadReplica" /\ r.ok /\ r.a = r.t
          /\ Applied(r.s, r.x, r.t) /\ nodes[r.s][r.x].done
          /\ \/ StoreOwns(r.s, r.x, r.t) /\ store[r.s][r.x].done /\ content[r.s][r.x] = r.t
             \/ FreeInFlight(r.s, r.x, r.t)
          /\ UNCHANGED <<vars, nodes, sent>>
       \/ /\ r.act = "Purge"   \* a region the node's purge frees itself: one the
          /\ store[r.s][r.x] = None   \* directory does not hold
          /\ IF r.ok THEN Applied(r.s, r.x, r.t) /\ nodes' = [nodes EXCEPT ![r.s][r.x] = None]
                     ELSE ~Applied(r.s, r.x, r.t) /\ UNCHANGED nodes
          /\ UNCHANGED <<vars, sent>>
       \/ /\ r.act \in {"WriteReplica", "ReadReplica"} /\ ~r.ok
          /\ ~(Applied(r.s, r.x, r.t)
               /\ nodes[r.s][r.x].done = (r.act = "ReadReplica"))
          /\ UNCHANGED <<vars, nodes, sent>>
    /\ pos' = pos + 1

\* Writes to segments no node trace covers happen unseen before the PutEnd,
\* and repair copies into them before the ListReplica.
UntracedWrite ==
    /\ R.src = "master" /\ R.act = "PutEnd" /\ R.ok /\ R.w # wr0
    /\ \E s \in Segments \ Traced : WriteReplica(R.w, s)
    /\ UNCHANGED <<pos, nodes, sent>>
UntracedCopy ==
    /\ R.src = "master" /\ R.act = "ListReplica" /\ R.ok /\ R.copied /\ InFlight(R)
    /\ R.s \notin Traced /\ CopyReplica(R.k, R.s)
    /\ UNCHANGED <<pos, nodes, sent>>

\* The directory the run opened with is what its traced nodes held: each
\* listed replica's region under its object's token, written as the spec's
\* store has it (or unwritten, its assign on its way); and every region a node
\* held carries a token issued before the run (below nextToken). Checked
\* where the run starts.
OpenedOnNodes ==
    pos = 1 =>
        \A s \in Traced, x \in Slots :
            /\ store[s][x] # None =>
                  \/ Applied(s, x, store[s][x].token) /\ nodes[s][x].done = store[s][x].done
                  \/ AssignInFlight(s, x, store[s][x].token) /\ ~store[s][x].done
            /\ nodes[s][x] # None => nodes[s][x].token \in 1..(nextToken - 1)

\* A window ends where the nodes hold the regions their steps left and the
\* commands on their way to a node that steps again are SentEnd (by the cut,
\* nothing of a pending put or repair written): with WindowEnd, every variable
\* a later step can read is the next window's initial state.
NodesWindowEnd ==
    pos > Len(Trace) =>
        /\ nodes = [s \in Segments |-> [x \in Slots |->
                      IF <<s, x>> \in DOMAIN NodesEnd THEN NodesEnd[<<s, x>>] ELSE None]]
        /\ \A s \in Segments \ Idle : sent[s] = IF s \in DOMAIN SentEnd THEN SentEnd[s] ELSE <<>>

MergedInit ==
    /\ TraceInit
    /\ nodes = [s \in Segments |-> [x \in Slots |->
                  IF <<s, x>> \in DOMAIN NodesOpened THEN NodesOpened[<<s, x>>] ELSE None]]
    /\ sent = [s \in Segments |-> IF s \in DOMAIN SentOpened THEN SentOpened[s] ELSE <<>>]
MergedNext ==
    \/ pos <= Len(Trace) /\ (MasterStep \/ NodeStep \/ UntracedWrite \/ UntracedCopy)
    \/ Done /\ UNCHANGED <<nodes, sent>>
=============================================================================
"""


def master_run(path: "str | Path", run: Optional[int] = None) -> tuple[dict, list[tuple[int, dict]]]:
    """The publish run ``run`` (counted from 1) of a master's file, as
    :func:`traces.publish_run` reads it: a master that took over again
    records a run per takeover; without ``run`` the file must hold one."""
    split = traces.runs(traces.read(path)["publish"]) or [[]]
    if run is None and len(split) > 1:
        raise TraceError(f"{path} holds {len(split)} runs (the master opened its directory "
                         f"{len(split)} times); name one with --run N")
    if run is not None and not 1 <= run <= len(split):
        raise TraceError(f"{path} holds {len(split)} run(s); there is no run {run}")
    return traces.publish_run(split[(run or 1) - 1])


def check(master: "str | Path", nodes: Optional[list] = None, *, run: Optional[int] = None,
          size: int = windows.SIZE, keep: Optional[Path] = None,
          on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """Have TLC check the master's run in ``master`` (its run ``run``, see
    :func:`master_run`) merged with its nodes' steps under its term (``nodes``,
    default: :func:`node_files`) against ``spec/Publish.tla``, whole, in
    windows of at most ``size`` master steps (:func:`check_windows`)."""
    header, steps = master_run(master, run)
    files = [Path(master)] + [Path(n) for n in (node_files(master) if nodes is None else nodes)]
    if len(files) < 2:
        raise TraceError(f"no storage node trace beside {master} (name the nodes' files)")
    segments, node_steps, tables = read_nodes(files[1:], header.get("term", 1))
    return check_windows(header, steps, node_steps, files, segments, tables=tables, size=size,
                         keep=keep, on_output=on_output)


def check_steps(header: dict, steps: list[tuple[int, dict]], node_steps: list[list[tuple[int, dict]]],
                files: list[Path], segments: set, *, tables: Optional[dict] = None,
                keep: Optional[Path] = None,
                on_output: Optional[Callable[[str], None]] = None,
                end: Optional[dict] = None, end_tables: Optional[dict] = None,
                idle: frozenset = frozenset()) -> Verdict:
    """:func:`check` of a master's run (:func:`traces.publish_run`) and its
    nodes' region steps (:func:`~kvproto.checking.nodetrace.read_nodes`, one list per file of ``files[1:]``;
    ``files[0]`` the master's) on the ``segments`` the node files cover, from
    the region ``tables`` the nodes held at its start (and the commands on
    their way then: :func:`opened_commands` of ``header``). With ``end`` (an
    ``opened`` header, :meth:`Windows.boundary`: with its ``sent``) and
    ``end_tables``: a window of a longer run (:func:`check_windows`) that
    must end in that state, commands on their way to the ``idle`` segments
    (whose nodes take no step later) apart."""
    try:
        model = MergedModel(header, steps, node_steps, files, tables, end, end_tables)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"a step the checker cannot read ({e!r})") from None
    traced = frozenset(model.mapping.segments.names[s] for s in segments
                       if s in model.mapping.segments.names)
    n = len(model.records)
    if n > traces.LIMITS["steps"]:
        raise TraceError(f"the merged run has {n} steps; at most {traces.LIMITS['steps']} "
                         "are checked (record a shorter run)")
    publish = traces.module(model)
    idle = frozenset(model.mapping.segments.names[s] for s in idle
                     if s in model.mapping.segments.names)
    text = _MODULE % {"traced": format_value(traced), "idle": format_value(idle),
                      "nodes": format_value(model.nodes_opened),
                      "sent": format_value(model.sent_opened),
                      "nodes_end": format_value(model.nodes_end),
                      "sent_end": format_value(model.sent_end)}
    ends = ("WindowEnd", "NodesWindowEnd") if end is not None else ()
    cfg = cfg_text(model, traces.INVARIANTS + ("OpenedOnNodes",) + ends, traces.OVERRIDES) \
        .replace("INIT TraceInit", "INIT MergedInit").replace("NEXT TraceNext", "NEXT MergedNext")
    result = run_module("Publish", "MergedTrace", text, cfg, keep=keep, on_output=on_output,
                        also={"PublishTrace": publish})
    common = dict(steps=n, distinct_states=result.distinct_states, seconds=result.seconds,
                  machine="merged")
    if result.verdict == "ok":
        return Verdict(True, message=f"all {n} steps of the master and {len(files) - 1} "
                                     "node(s) are steps of spec/Publish.tla", **common)
    if result.verdict == "safety" and result.violated in ends:
        return Verdict(False, **common, message=f"invariant {result.violated} is violated (the "
                                                 "window did not end in the state its steps left)")
    if result.verdict == "safety" and len(result.trace or ()) == 1:
        return Verdict(False, **common, message=f"invariant {result.violated} is violated where "
                                                 "the run starts (the directory it opened with, "
                                                 "and the regions its nodes held)")
    unmatched = first_unmatched(result, "Publish")
    if unmatched is not None:
        i, what = unmatched
        path, recorded, line, step = model.origins[i]
        return Verdict(False, failed_step=recorded, line=line, **common,
                       message=f"{path.name} step {recorded} (line {line}) {what}: "
                               f"{traces.describe(step)}")
    raise failure(result)

# --- long runs: windows ----------------------------------------------------------


class Windows:
    """A master's run and its nodes' region steps (:func:`merge`d once, whole)
    cut at the master's steps for :func:`check_windows`: the node steps of a
    window are those merged after its master steps' first and up to the one
    after its last, and a window may end after master step ``p`` only where
    the state is the directory, the nodes' tables and the commands on their
    way (:attr:`quiet`)."""

    def __init__(self, header: dict, steps: list[tuple[int, dict]],
                 node_steps: list[list[tuple[int, dict]]]) -> None:
        self.steps, self.node_steps = steps, node_steps
        self.at = {id(step): p for p, (_, step) in enumerate(steps)}
        #: groups[p]: the node steps (node, index) merged after master step p (0: before the first)
        self.groups: list[list[tuple[int, int]]] = [[] for _ in range(len(steps) + 1)]
        #: the last p whose group holds a step on each segment
        self.last: dict = {}
        #: idle[p]: the segments with commands on their way after master step p
        #: whose nodes take no step later (a killed node's: they are dropped)
        self.idle: list[frozenset] = []
        #: sent[p]: those on their way to the other nodes (a header's ``sent``)
        self.sent: list[list[dict]] = []
        try:
            p = 0
            for source, index, _ in merge(steps, node_steps, header):
                if source < 0:
                    p = index + 1
                else:
                    self.groups[p].append((source, index))
                    self.last[node_steps[source][index][1]["event"]["segment"]] = p
            self.quiet = self._quiet(header)
        except (KeyError, TypeError, AttributeError) as e:
            raise TraceError(f"a step the checker cannot read ({e!r})") from None

    def _quiet(self, header: dict) -> list[bool]:
        """``quiet[p]``: after master step ``p`` and the node steps merged up to
        it, no put pending and no repair in flight has a region written on a
        traced node (an untraced one is written just before its ``PutEnd`` or
        ``ListReplica``): the merged spec's state there is an ``opened``
        header (pending puts' writers busy, nothing written), the nodes'
        tables and the commands on their way (:attr:`sent`, :attr:`idle`)."""
        directory = dict(traces.opened_objects(header))
        busy = {k for k, rec in directory.items() if _busy(rec)}
        queues: dict = defaultdict(list)
        for segment, kind, offset, token in opened_commands(header):
            queues[segment].append((kind, offset, token))
        written: set = set()            # (segment, offset, token) a traced node wrote
        out = []
        for p in range(len(self.steps) + 1):
            if p:
                step = self.steps[p - 1][1]
                ev, ok = step["event"], accepted(step)
                if ok and ev["type"] == "SegmentLost":   # its repairs go, unnamed in the step
                    for k, rec in list(directory.items()):
                        if rec and rec.get("repairs"):
                            directory[k] = {**rec, "repairs": [
                                r for r in rec["repairs"] if r["segment"] != ev["segment"]]}
                for k, rec in step["after"]["objects"].items():
                    directory[k] = rec
                busy = {k for k in busy | set(step["after"]["objects"]) | (
                    set(directory) if ok and ev["type"] == "SegmentLost" else set())
                    if _busy(directory.get(k))}
                for e in step["effects"] if ok else ():
                    if e["type"] in COMMANDS:
                        queues[e["segment"]].append((e["type"], e["offset"], e["token"]))
            for n, i in self.groups[p]:
                node_step = self.node_steps[n][i][1]
                ev = node_step["event"]
                if ev["type"] in COMMANDS and not node_step.get("purge") and queues[ev["segment"]]:
                    queues[ev["segment"]].pop(0)
                elif ev["type"] == "WriteReplica" and accepted(node_step):
                    written.add((ev["segment"], ev["offset"], ev["token"]))
            waiting = {s for s, q in queues.items() if q}
            idle = {s for s in waiting if self.last.get(s, -1) <= p}
            self.idle.append(frozenset(idle))
            self.sent.append([{"segment": s, "type": kind, "offset": offset, "token": token}
                              for s in sorted(waiting - idle)
                              for kind, offset, token in queues[s]])
            out.append(not any((r["segment"], r["offset"], directory[k]["token"]) in written
                               for k in busy for r in (directory[k]["replicas"] if
                                                       directory[k]["status"] == "pending"
                                                       else directory[k]["repairs"])))
        return out

    def span(self, part: list) -> tuple[int, int]:
        """The master steps ``(p0, p1]`` a window's ``part`` covers."""
        p0 = self.at[id(part[0][1])] if part else 0
        return p0, p0 + len(part)

    def nodes_of(self, part: list) -> list[list[tuple[int, dict]]]:
        """Each node's steps in the window of ``part``."""
        p0, p1 = self.span(part)
        out: list[list] = [[] for _ in self.node_steps]
        for p in range(0 if p0 == 0 else p0 + 1, p1 + 1):
            for n, i in self.groups[p]:
                out[n].append(self.node_steps[n][i])
        return out

    def cut(self, start: dict, part: list) -> int:
        """The most steps of ``part`` after which the run is quiet (0: none)."""
        p0, p1 = self.span(part)
        return next((p - p0 for p in range(p1, p0, -1) if self.quiet[p]), 0)

    def boundary(self, start: dict, part: list) -> dict:
        """The state the window of ``part`` from ``start`` ends in: the
        directory's (:func:`traces.boundary`, with the commands on their way,
        ``sent``) and the nodes' tables, each node's steps applied to them."""
        tables = {segment: dict(regions) for segment, regions in start["tables"].items()}
        for steps in self.nodes_of(part):
            for _, step in steps:
                ev = step["event"]
                replay(tables.setdefault(ev["segment"], {}), ev["type"], ev, accepted(step))
        p1 = self.span(part)[1]
        header = {**traces.boundary(start["header"], part), "sent": self.sent[p1]}
        return {"header": header, "tables": tables, "idle": self.idle[p1]}

    def merged(self, upto: int) -> int:
        """The merged steps up to master step ``upto``: its steps and the nodes'."""
        return upto + sum(len(g) for g in self.groups[:upto + 1])


def _busy(rec: Optional[dict]) -> bool:
    return rec is not None and (rec["status"] == "pending" or bool(rec.get("repairs")))


def check_windows(header: dict, steps: list[tuple[int, dict]],
                  node_steps: list[list[tuple[int, dict]]], files: list[Path], segments: set, *,
                  tables: Optional[dict] = None, size: int = windows.SIZE,
                  max_windows: Optional[int] = None, keep: Optional[Path] = None,
                  on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """:func:`check_steps` of a run of any length, in windows of at most
    ``size`` master steps chained state to state (:mod:`kvproto.checking.windows`;
    at most ``max_windows`` of them). A window ends only where the run is
    quiet (:class:`Windows`): there the state of ``MergedTrace`` is the
    directory, the nodes' tables and the commands on their way, which TLC
    checks the window ends in (``WindowEnd``, ``NodesWindowEnd``) and the
    next one starts from."""
    cuts = Windows(header, steps, node_steps)

    def fits(start: dict, part: list) -> None:
        try:
            model = MergedModel(start["header"], part, cuts.nodes_of(part), files,
                                start["tables"])
        except (KeyError, TypeError, AttributeError) as e:
            raise TraceError(f"a step the checker cannot read ({e!r})") from None
        if len(model.records) > traces.LIMITS["steps"]:
            raise TraceError(f"the merged window would have {len(model.records)} steps; at "
                             f"most {traces.LIMITS['steps']} are checked")

    def run(start: dict, part: list, end: Optional[dict], keep: Optional[Path]) -> Verdict:
        return check_steps(start["header"], part, cuts.nodes_of(part), files, segments,
                           tables=start["tables"], keep=keep, on_output=on_output,
                           end=end and end["header"], end_tables=end and end["tables"],
                           idle=end["idle"] if end else frozenset())

    start = {"header": header, "tables": tables or {}}
    if not steps:
        return run(start, steps, None, keep)
    verdict = windows.check(start, steps, spec="Publish", fits=fits, run=run,
                            boundary=cuts.boundary, cut=cuts.cut, size=size,
                            max_windows=max_windows, keep=keep, machine="merged")
    if not verdict.ok:
        return verdict
    merged, nodes = cuts.merged(verdict.steps), len(files) - 1
    spread = f" in {verdict.windows} windows" if verdict.windows > 1 else ""
    if verdict.steps == len(steps):
        message = (f"all {merged} steps of the master and {nodes} node(s) are steps of "
                   f"spec/Publish.tla{spread}")
    else:
        n = steps[verdict.steps][1].get("n")
        message = (f"the {merged} steps of the master and {nodes} node(s) before the master's "
                   f"step {n} are steps of spec/Publish.tla{spread}; from there on nothing is "
                   f"checked: {verdict.stopped}")
    return attrs.evolve(verdict, steps=merged, message=message)


# --- command line ----------------------------------------------------------------


def add_arguments(sub) -> None:
    """``kvproto trace merge`` on the ``trace`` command's subparsers."""
    parser = sub.add_parser(
        "merge", help="check a master's run merged with its storage nodes' runs with TLC",
        description="Merge a master's trace and its storage nodes' traces (by the protocol's "
                    "causality: commands, tokens) into one run and check with TLC that it is "
                    "a behaviour of spec/Publish.tla, or name the first step that is not. "
                    "A long run is checked whole, in windows of at most 1,000 master steps "
                    "that end where no pending put or repair has a region written on a node, "
                    "each its own TLC run from the state the one before ended in.")
    parser.add_argument("file", type=Path, help="the master's trace file")
    parser.add_argument("nodes", type=Path, nargs="*", metavar="NODE_FILE",
                        help="the nodes' trace files (default: FILE.storage-* beside it)")
    parser.add_argument("--run", type=int, default=None, metavar="N",
                        help="the master's N-th run in FILE (one per takeover it made; "
                             "needed where FILE holds more than one)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="write the generated modules and cfg to DIR")


def main(args: argparse.Namespace) -> int:
    try:
        verdict = check(args.file, args.nodes or None, run=args.run, keep=args.keep)
    except (TraceError, FileNotFoundError) as e:
        print(f"kvproto trace: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    states = "?" if verdict.distinct_states is None else f"{verdict.distinct_states:,}"
    print(f"{args.file}: merged: {verdict.message} ({states} distinct states, "
          f"{verdict.seconds:.1f}s)")
    return 0 if verdict.ok else 1
