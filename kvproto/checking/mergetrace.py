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
grant, so it is placed before the ``PutEnd``, where the writer wrote it. Not
covered: a master's takeover (one run per master file).
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

from kvproto.checking import traces
from kvproto.checking.tla import Fn, format_value
from kvproto.checking.tracerun import (TraceError, Verdict, accepted, cfg_text, failure,
                                       first_unmatched, machine_lines, run_module)

__all__ = ["check", "merge", "node_files", "read_node"]

#: the node steps that are steps of the region table (``publish.storage_step``)
REGION_STEPS = ("AssignRegion", "FreeRegion", "WriteReplica", "ReadReplica")
#: the steps a request to the node asks for, by the ``op`` of its ``asked`` line
ASKED = {"WriteReplica": "write", "ReadReplica": "read"}
#: the master's effects that are commands to a node, and their names in the queue
COMMANDS = {"AssignRegion": "assign", "FreeRegion": "free"}


def node_files(master: "str | Path") -> list[Path]:
    """The node files a master's ``KVPROTO_TRACE`` file has beside it."""
    return sorted(Path(p) for p in glob.glob(glob.escape(str(master)) + ".storage-*"))


def read_node(path: "str | Path") -> tuple[set, list[tuple[int, dict]]]:
    """A node file's segments and its region-table steps (each with its line)."""
    lines = machine_lines(path, "storage")
    if not lines or "opened" not in lines[0][1]:
        raise TraceError(f"{path} does not start where a storage node opened its segment")
    segments = {obj["opened"]["segment"] for _, obj in lines if "opened" in obj}
    steps, asked = [], None
    for number, obj in lines:
        if "opened" in obj or "asked" in obj:
            asked = obj.get("asked")
            continue
        if not isinstance(obj.get("event"), dict) or not isinstance(obj.get("effects"), list):
            raise TraceError(f"{path}:{number}: a step needs 'event' and 'effects'")
        ev = obj["event"]
        if ev.get("type") in REGION_STEPS:
            if asked is not None and ASKED.get(ev["type"]) == asked.get("op") \
                    and asked.get("offset") == ev.get("offset"):
                obj = {**obj, "asked": asked.get("token")}
            steps.append((number, obj))
        asked = None
    return segments, steps


def merge(master: list[tuple[int, dict]], nodes: list[list[tuple[int, dict]]]) -> list[tuple]:
    """The master's steps and the nodes' region steps in one causal order:
    ``(source, index, (line, step))`` each, ``source`` ``-1`` for the master
    and else the node's index (see the module docstring)."""
    issued: dict[tuple, list[int]] = defaultdict(list)   # command -> master positions
    granted: dict[int, int] = {}                         # token -> its PutStart
    for pos, (_, step) in enumerate(master, 1):
        for e in step["effects"] if accepted(step) else ():
            kind = e["type"]
            if kind in COMMANDS:
                issued[(e["segment"], kind, e["offset"], e["token"])].append(pos)
            elif kind == "PutGranted":
                granted.setdefault(e["token"], pos)
    order = [((pos, -1, 0), (-1, pos - 1)) for pos in range(1, len(master) + 1)]
    for n, steps in enumerate(nodes):
        seen: dict[tuple, int] = defaultdict(int)
        at = 0
        for i, (_, step) in enumerate(steps):
            ev = step["event"]
            kind, token = ev["type"], ev.get("token")
            if kind in COMMANDS:
                command = (ev["segment"], kind, ev["offset"], token)
                k, seen[command] = seen[command], seen[command] + 1
                cause = issued[command][k] if k < len(issued[command]) else 0
            else:
                cause = max(granted.get(t, 0) for t in (token, step.get("asked", token)))
            at = max(at, cause)
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
    writer ``w``) the token the request carried (the event's, for a command)."""
    ev = step["event"]
    segment, slot = m.slot(ev["segment"], ev["offset"])
    asked = step.get("asked", ev.get("token"))
    return Fn.of({"src": "node", "act": ev["type"], "ok": accepted(step), "s": segment,
                  "x": slot, "t": m.token(ev.get("token")), "a": m.token(asked),
                  "w": m.writer(asked)})


class MergedModel:
    """The merged behaviour on model values: what :func:`traces.module` and
    :func:`cfg_text` take, and where each record came from."""

    def __init__(self, header, master, nodes, files) -> None:
        if header.get("objects"):
            raise TraceError(f"the master's run starts from a recovered directory of "
                             f"{header['objects']} object(s); the merge covers a run from an "
                             "empty directory")
        m = traces.run_mapping(header, master)
        merged = merge(master, nodes)
        for source, _, (_, step) in merged:      # the nodes' names first, then the master's
            if source >= 0:
                m.slot(step["event"]["segment"], step["event"]["offset"])
        base = traces.to_model(header, master, mapping=m)
        self.constants, self.model_values, self.opened = \
            base.constants, base.model_values, base.opened
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

Applied(s, x, t) == nodes[s][x] # None /\ nodes[s][x].token = t
StoreOwns(s, x, t) == store[s][x] # None /\ store[s][x].token = t
\* The master freed the region and its free is on its way to the node.
FreeInFlight(s, x, t) == \E j \in 1..Len(sent[s]) : sent[s][j] = <<"free", x, t>>

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

MergedInit ==
    /\ TraceInit
    /\ nodes = [s \in Segments |-> [x \in Slots |-> None]]
    /\ sent = [s \in Segments |-> <<>>]
MergedNext ==
    \/ pos <= Len(Trace) /\ (MasterStep \/ NodeStep \/ UntracedWrite \/ UntracedCopy)
    \/ Done /\ UNCHANGED <<nodes, sent>>
=============================================================================
"""


def check(master: "str | Path", nodes: Optional[list] = None, *, keep: Optional[Path] = None,
          on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """Have TLC check the master's run in ``master`` merged with its nodes'
    (``nodes``, default: :func:`node_files`) against ``spec/Publish.tla``."""
    header, steps = traces.publish_run(traces.read(master)["publish"])
    files = [Path(master)] + [Path(n) for n in (node_files(master) if nodes is None else nodes)]
    if len(files) < 2:
        raise TraceError(f"no storage node trace beside {master} (name the nodes' files)")
    segments, node_steps = set(), []
    for path in files[1:]:
        segs, recorded = read_node(path)
        segments |= segs
        node_steps.append(recorded)
    return check_steps(header, steps, node_steps, files, segments, keep=keep, on_output=on_output)


def check_steps(header: dict, steps: list[tuple[int, dict]], node_steps: list[list[tuple[int, dict]]],
                files: list[Path], segments: set, *, keep: Optional[Path] = None,
                on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """:func:`check` of a master's run (:func:`traces.publish_run`) and its
    nodes' region steps (:func:`read_node`, one list per file of ``files[1:]``;
    ``files[0]`` the master's) on the ``segments`` the node files cover."""
    try:
        model = MergedModel(header, steps, node_steps, files)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"a step the checker cannot read ({e!r})") from None
    traced = frozenset(model.mapping.segments.names[s] for s in segments
                       if s in model.mapping.segments.names)
    n = len(model.records)
    if n > traces.LIMITS["steps"]:
        raise TraceError(f"the merged run has {n} steps; at most {traces.LIMITS['steps']} "
                         "are checked (record a shorter run)")
    publish = traces.module(model)
    text = _MODULE % {"traced": format_value(traced)}
    cfg = cfg_text(model, traces.INVARIANTS).replace("INIT TraceInit", "INIT MergedInit") \
        .replace("NEXT TraceNext", "NEXT MergedNext")
    result = run_module("Publish", "MergedTrace", text, cfg, keep=keep, on_output=on_output,
                        also={"PublishTrace": publish})
    common = dict(steps=n, distinct_states=result.distinct_states, seconds=result.seconds,
                  machine="merged")
    if result.verdict == "ok":
        return Verdict(True, message=f"all {n} steps of the master and {len(files) - 1} "
                                     "node(s) are steps of spec/Publish.tla", **common)
    unmatched = first_unmatched(result, "Publish")
    if unmatched is not None:
        i, what = unmatched
        path, recorded, line, step = model.origins[i]
        return Verdict(False, failed_step=recorded, line=line, **common,
                       message=f"{path.name} step {recorded} (line {line}) {what}: "
                               f"{traces.describe(step)}")
    raise failure(result)


# --- command line ----------------------------------------------------------------


def add_arguments(sub) -> None:
    """``kvproto trace merge`` on the ``trace`` command's subparsers."""
    parser = sub.add_parser(
        "merge", help="check a master's run merged with its storage nodes' runs with TLC",
        description="Merge a master's trace and its storage nodes' traces (by the protocol's "
                    "causality: commands, tokens) into one run and check with TLC that it is "
                    "a behaviour of spec/Publish.tla, or name the first step that is not.")
    parser.add_argument("file", type=Path, help="the master's trace file")
    parser.add_argument("nodes", type=Path, nargs="*", metavar="NODE_FILE",
                        help="the nodes' trace files (default: FILE.storage-* beside it)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="write the generated modules and cfg to DIR")


def main(args: argparse.Namespace) -> int:
    try:
        verdict = check(args.file, args.nodes or None, keep=args.keep)
    except (TraceError, FileNotFoundError) as e:
        print(f"kvproto trace: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    states = "?" if verdict.distinct_states is None else f"{verdict.distinct_states:,}"
    print(f"{args.file}: merged: {verdict.message} ({states} distinct states, "
          f"{verdict.seconds:.1f}s)")
    return 0 if verdict.ok else 1
