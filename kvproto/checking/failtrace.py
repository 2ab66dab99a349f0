r"""The storage nodes' fence, index and purge steps of a run with master
takeovers, merged into one behaviour of ``spec/Failover.tla`` and checked by
TLC (``kvproto trace failover``).

Each storage node records the steps of its core
(:class:`~kvproto.cores.storage.StorageNodeCore`, ``failover.storage_step``)
beside the master's trace (``KVPROTO_TRACE``, or ``kvproto storage --trace``);
each master records, when it opens, its term and what it recovered
(:mod:`kvproto.runtime.tracing`). The checker takes the nodes' steps of the
term fence and the object index:

=====================  ==================================================
recorded at a node     step of ``spec/Failover.tla``
=====================  ==================================================
``Fence`` accepted     ``Fence(m, n)`` of the master ``m`` of that term,
                       while it fences; once it serves, a node that joins
                       it (empty) learns the term as a fence does
``StampedAllocate``    ``Allocate(m, k, n)``, accepted
``StampedPublish``     ``Publish(m, k)``, accepted; with a publishing
                       term ``by`` below its own (a repaired replica's
                       mark) ``PublishCopy``: the node's part of the
                       spec's ``Repair``, the entry recording ``by``
                       (``RepairedEntry``) where another replica of the
                       object was published in term ``by`` earlier
``StampedFree``        ``Remove(m, k)`` of a published object; of an
                       unpublished one (a revoked or reclaimed attempt)
                       ``Revoke``, which the spec abstracts away: the entry
                       leaves the index and the directory, under the fence
``PurgeUnpublished``   the node's part of ``Recover(m)``: it must drop
                       exactly the entries the spec's ``Recover`` purged
                       at that node
``ReadReplica``        a read the node served: the spec's ``Lookup(r, m,
accepted               k)`` at an open master ``m`` that lists the
                       replica, then ``Read(r)``, not a miss (the node is
                       live, accepts ``m``'s term and has ``k``'s entry);
                       ``k`` is the allocation holding the region and
                       token read (its ``StampedAllocate``), and
                       ``ReadsReturnPublishedBytesOrMiss`` judges the entry
refused ``StaleTerm``  the node's fence is above the request's term, and
                       the master of that term steps down (also a
                       ``StaleRequest``: any request refused at the fence
                       before a step of the core; a client's read or write
                       refused so is a miss, its master does not step down)
other refusals         change nothing (``KeyExists``: the node holds the
                       key; ``NotPublished``: no open allocation there)
=====================  ==================================================

and the masters' steps that no node records are placed between them:
``ObtainTerm(m)`` before the first step that carries ``m``'s term,
``Recover(m)`` and ``Open(m)`` before the first step that needs ``m`` to
serve (a stamped request of its term, or its purge); a master whose file
says it opened but that no node step needed (killed as its purges went
out) recovers and opens before the next term is obtained, or at the end of
the run if its term is the last. A master's file (``"opened"`` with
``"term"``) gives the number of objects it recovered and, up to 1,000 of
them, each one's replicas (``"recovered"``): ``Recover(m)`` must rebuild
exactly that directory, replica for replica, from the fenced nodes' indexes.

Mapping. Terms are numbered by rank (the spec's ``1..MaxTerm``), one master
per term. A spec key is one replica, an object's key on one node (a put
with two replicas is two spec keys, and a repair's copy a third), and a
spec node is one segment of a node file (a node that starts over opens a new
one). Dropped: offsets, lengths, tokens, checksums and requested replica
counts of the index (the publish protocol's, checked by ``kvproto trace
merge``). A read served is one reader's lookup and read (``rd1``: the spec's
``Read`` drops the descriptor, so one reader serves every read); a read
refused at the fence is a ``StaleRequest``, and one the region table refused
is a miss that changes nothing (the merged check's).

Joining and leaving, which the spec does not model (its nodes are all there
from ``Init`` and only ``NodeLost`` leaves), are placed before each
``Recover(m)``: a segment with no step yet, whose first step will be a
fence (a node joins by one), holds nothing and is fenced by ``m`` there
(``FenceUnstarted``: the spec's ``Fence`` of an empty node); a
segment that ``m`` did not fence and that has no step left (killed, or
started over) is the spec's ``NodeLost``, and so is one that took ``m``'s
fence but that ``m`` recovered without (its answer came after the fence
timeout: ``m``'s file does not list the segment) and that has no step left
(the node started over, as a node left out of a recovery does). A segment that ``m`` did not fence
but that still takes steps stays live, and ``Recover(m)`` cannot be taken.

Order. No clock orders the files; the fence does. Each node's steps keep
their order; across nodes they are ordered by the term the node held before
each step (its fence; a fence that raises it comes after every other step
of the term below, which it causes none of), then by node: a step of a
node fenced at term ``t`` has no cause in a step of another node fenced
higher, since a master of a higher term sends nothing but its fence before
every node acknowledged it, and a master refused for its term stops. In the merged behaviour every
fence of term ``t`` comes before the steps of nodes fenced at ``t``, as the
spec's ``Recover`` requires.

TLC walks the merged behaviour with a module ``FailoverTrace`` that extends
``spec/Failover.tla``: each step must be the spec's action above from the
state the steps before it reached, and the spec's invariants are checked in
every state. A behaviour that the spec does not allow fails at the first
step TLC cannot take, named by its node file and recorded number.

Long runs. The merged behaviour is checked whole, in windows of at most
1,000 merged steps (:func:`check`), each its own TLC run, chained state to
state. No recorded line holds the spec's state here (the nodes record their
own steps, not the spec's variables), so TLC itself says where a window
ended: the invariant ``WindowEnd`` (always TRUE) prints every state the
window ends in, and the next window starts in exactly those states
(``WindowInit``, from ``Starts``): every variable of the spec, the history
variables ``promised``, ``staleAccepted`` and ``told`` and the fence's
``acked`` included, and the module's ``pending`` and ``recoveredTerms``. A
window may end after any step. Each window's model holds only the keys its
steps name (and the replicas its recoveries list) and the keys that still
hold something where it starts (:func:`_empty`: an entry at a node or at a
master that is not on standby, a purge owed, an acknowledged publish on a
live node); another key's ``told`` and its entries at masters on standby,
which no step of the run and no invariant reads while nothing names the key,
are set aside unchanged and come back when a later window names it. So a
window's model is as small as its own steps however long the run, and
together the windows check the whole run: a step the spec does not allow
fails in its window, named by its node file and recorded number and by its
place in the whole merged run (``merged step i of N, window w``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

from kvproto.checking import windows
from kvproto.checking.tla import Fn, ModelValue, format_value
from kvproto.checking.tracerun import (Numbered, TraceError, Verdict, accepted, cfg_text,
                                       failure, first_unmatched, json_lines, machine_lines,
                                       outcome, run_module)

__all__ = ["check", "read_master", "read_node"]

#: the node steps of ``failover.storage_step`` (the term fence and the object index)
STEPS = ("Fence", "StampedAllocate", "StampedPublish", "StampedFree", "PurgeUnpublished",
         "IndexRequest", "StaleRequest")
#: the steps that carry a key
KEYED = ("StampedAllocate", "StampedPublish", "StampedFree")
#: the requests a master sends a node (the others are clients' reads and writes)
MASTER_OPS = ("assign", "free", "publish", "fence", "purge", "repair")
#: the spec's invariants checked in every state (spec/Failover.cfg)
INVARIANTS = ("TypeOK", "NoSplitBrainAllocation", "NoStaleTermWriteAccepted",
              "DirectoryOnlyListsLiveBytes", "UnpublishedPurgedAfterRecovery",
              "AcknowledgedChangesSurvive", "NoPublishedCopyOrphaned",
              "ReadsReturnPublishedBytesOrMiss")
NONE = ModelValue("None")


def read_node(path: "str | Path") -> list[tuple[dict, list[tuple[int, dict]]]]:
    """A node file's segments: each one's ``opened`` header and its fence and
    index steps (each with its line), and the reads it served: each accepted
    ``ReadReplica`` as a step ``Read`` of the key whose allocation (its
    ``StampedAllocate``) holds that region and token, at the term the node
    held (``"?offset/token"`` where no allocation of the segment did). A node
    that starts over opens a new segment in the same file."""
    lines = machine_lines(path, "storage")
    if not lines or "opened" not in lines[0][1]:
        raise TraceError(f"{path} does not start where a storage node opened its segment")
    segments: list = []
    for number, obj in lines:
        if "opened" in obj:
            segments.append((obj["opened"], []))
            held, allocated = obj["opened"].get("term", 0), {}
            continue
        if "asked" in obj:
            continue
        ev = obj.get("event")
        if not isinstance(ev, dict) or not isinstance(obj.get("effects"), list):
            raise TraceError(f"{path}:{number}: a step needs 'event' and 'effects'")
        kind, ok = ev.get("type"), accepted(obj)
        if kind == "ReadReplica" and ok:
            where = (ev.get("offset"), ev.get("token"))
            key = allocated.get(where, f"?{where[0]}/{where[1]}")
            segments[-1][1].append((number, {**obj, "event": {
                "type": "Read", "key": key, "term": held, "offset": where[0],
                "token": where[1]}}))
        if kind not in STEPS:
            continue
        if ok and kind == "StampedAllocate":
            allocated[(ev.get("offset"), ev.get("token"))] = ev["key"]
        if ok and (kind == "Fence" or kind in KEYED):
            held = max(held, ev["term"])
        segments[-1][1].append((number, obj))
    return segments


def read_master(path: "str | Path") -> list[dict]:
    """What a master's file says it opened: ``{"term", "objects", "keys",
    "replicas"}`` per opening (``replicas``: ``(key, segment)`` of each
    recovered replica where the opening lists them; ``keys`` the recovered
    objects' keys, from there or from its lease table's list; else None)."""
    openings: list[dict] = []
    for number, obj in json_lines(path):
        if not isinstance(obj, dict):
            continue
        if obj.get("machine") == "publish" and "opened" in obj:
            header = obj["opened"]
            if "term" not in header:
                raise TraceError(f"{path}:{number}: the master's 'opened' line has no term "
                                 "(recorded by an older master)")
            listed = header.get("recovered")
            replicas = frozenset((k, seg) for k, segs in listed for seg in segs) \
                if isinstance(listed, list) else None
            segments = header.get("segments")
            openings.append({"term": header["term"], "objects": header["objects"],
                             "segments": frozenset(segments) if isinstance(segments, dict) else None,
                             "keys": frozenset() if header["objects"] == 0 else
                             None if replicas is None else frozenset(k for k, _ in replicas),
                             "replicas": frozenset() if header["objects"] == 0 else replicas})
        elif obj.get("machine") == "lease" and "opened" in obj and openings \
                and openings[-1]["keys"] is None:
            listed = obj["opened"].get("inherited")
            if isinstance(listed, list) and len(listed) == openings[-1]["objects"]:
                openings[-1]["keys"] = frozenset(k for k, _ in listed)
    return openings


def _error(step: dict) -> str:
    return "" if accepted(step) else step["effects"][0]["error"]["type"]


def _term(ev: dict) -> int:
    return ev["below"] if ev["type"] == "PurgeUnpublished" else ev["term"]


def merge(nodes: list[tuple[dict, list]], rank: dict) -> list[tuple[int, int]]:
    """The nodes' steps in one order: ``(node, index)`` each, by the term the
    node held before the step (an accepted fence raising it by more than one
    term: the term just below the fence's), the fences that raise it after
    the other steps of that term (a fence of a higher term causes none of
    them, and the master of the lower term may have recovered before it),
    then node, then the node's own order."""
    keyed = []
    for n, (opened, steps) in enumerate(nodes):
        held = rank.get(opened.get("term", 0), 0)
        for i, (_, step) in enumerate(steps):
            ev = step["event"]
            raised = rank[ev["term"]] if accepted(step) and ev["type"] in ("Fence",) + KEYED \
                else 0
            raising = ev["type"] == "Fence" and raised > held
            at = raised - 1 if raising else held
            keyed.append(((at, raising, n, i), (n, i)))
            held = max(held, raised)
    keyed.sort(key=lambda item: item[0])
    return [where for _, where in keyed]


def _needs_open(step: dict) -> bool:
    """A step only a serving master of its term causes (a read served: its
    reader looked the object up at an open master)."""
    kind = step["event"]["type"]
    return kind in ("PurgeUnpublished", "Read") or (kind in KEYED and _error(step) != "StaleTerm")


class FailoverModel:
    """The merged behaviour on model values: records, constants and origins."""

    def __init__(self, nodes: list[tuple[dict, list]], files: list[Path],
                 masters: list[dict]) -> None:
        terms = {opened.get("term", 0) for opened, _ in nodes} - {0}
        terms |= {_term(step["event"]) for _, steps in nodes for _, step in steps
                  if step["event"]["type"] != "Read"}
        terms |= {o["term"] for o in masters}
        terms |= {step["event"]["by"] for _, steps in nodes for _, step in steps
                  if step["event"]["type"] == "StampedPublish" and step["event"].get("by")}
        rank = {t: i for i, t in enumerate(sorted(terms), 1)}
        self.rank = rank
        self.masters = tuple(ModelValue(f"m{i}") for i in range(1, len(rank) + 1))
        node_names = [ModelValue(f"n{i}") for i in range(1, len(nodes) + 1)]
        keys = Numbered("k")
        objects: dict = {}

        def key(n: int, name: str) -> ModelValue:
            k = keys((n, name))
            objects[k] = name
            return k

        self.records, self.origins = [], []
        obtained, opened_terms = 0, set()

        def master(act: str, t: int, why: str, n: Optional[int] = None) -> None:
            self.records.append(Fn.of({**_BLANK, "src": "master", "act": act, "t": t,
                                       "n": NONE if n is None else node_names[n]}))
            what = f"{act} of the master of term {sorted(rank)[t - 1]}" if n is None else \
                f"{act} of {files[n].name} segment {nodes[n][0].get('segment')!r} " \
                f"(term {sorted(rank)[t - 1]})"
            self.origins.append((None, None, None, f"{what} ({why})"))

        said_opened = {rank[o["term"]] for o in masters}

        def obtain(t: int, why: str) -> None:
            nonlocal obtained
            while obtained < t:
                if obtained in said_opened and obtained not in opened_terms:
                    # its file says it opened, and no step of a node needed it
                    # to serve (killed as its purges went out): it recovered
                    # before the next term's fence, from the indexes it fenced
                    open_(obtained, f"its file says it opened; {why}")
                obtained += 1
                master("ObtainTerm", obtained, why)

        placed = [0] * len(nodes)          # per node: its steps placed so far
        fenced = [set() for _ in nodes]    # per node: the terms whose fence it took
        lost: set = set()
        listed = {rank[o["term"]]: o["segments"] for o in masters if o.get("segments") is not None}

        def open_(t: int, why: str) -> None:
            if t in opened_terms:
                return
            obtain(t, why)
            opened_terms.add(t)
            for n, (_, steps) in enumerate(nodes):
                if n in lost:
                    continue
                if t in fenced[n]:
                    # the node took the fence but its answer came after the
                    # fence timeout: the master recovered without the segment
                    # (its file does not list it), which has no step left (the
                    # node started over): lost after its fence
                    if placed[n] == len(steps) and t in listed \
                            and nodes[n][0].get("segment") not in listed[t]:
                        master("NodeLost", t, why, n)
                        lost.add(n)
                    continue
                if placed[n] == 0 and (not steps or steps[0][1]["event"]["type"] == "Fence"):
                    # not started yet (it joins by a fence): it holds nothing
                    master("FenceUnstarted", t, why, n)
                elif placed[n] == len(steps):   # gone (killed, or started over)
                    master("NodeLost", t, why, n)
                    lost.add(n)
            master("Recover", t, why)
            master("Open", t, why)

        published: set = set()        # (object key, publishing term) published so far
        for n, i in merge(nodes, rank):
            line, step = nodes[n][1][i]
            ev = step["event"]
            t = rank.get(_term(ev), 1) if ev["type"] == "Read" else rank[_term(ev)]
            why = f"before {files[n].name} step {step.get('n')}"
            obtain(t, why)
            if _needs_open(step):
                open_(t, why)
            k = key(n, ev["key"]) if ev["type"] in KEYED + ("Read",) else NONE
            purged = frozenset(key(n, name) for name in step["effects"][0]["keys"]) \
                if ev["type"] == "PurgeUnpublished" and accepted(step) else frozenset()
            by = ev.get("by") if ev["type"] == "StampedPublish" else None
            source = bool(by) and (ev["key"], by) in published
            if ev["type"] == "StampedPublish" and accepted(step):
                published.add((ev["key"], by or _term(ev)))
            self.records.append(Fn.of({**_BLANK, "src": "node", "act": ev["type"],
                                       "n": node_names[n], "t": t, "k": k,
                                       "by": rank[by] if by else 0, "source": source,
                                       "ok": accepted(step), "err": _error(step),
                                       "keys": purged, "client": ev["type"] == "StaleRequest"
                                       and ev.get("op") not in MASTER_OPS}))
            self.origins.append((files[n], step.get("n"), line, step))
            placed[n] += 1
            if ev["type"] == "Fence" and accepted(step):
                fenced[n].add(t)
        for o in sorted(masters, key=lambda o: o["term"]):
            open_(rank[o["term"]], "its file says it opened")
        self.records = tuple(self.records)
        self.count = Fn.of({rank[o["term"]]: o["objects"] for o in masters})
        self.keys = Fn.of({rank[o["term"]]: o["keys"] for o in masters if o["keys"] is not None})
        segments = {opened["segment"]: n for n, (opened, _) in enumerate(nodes)}
        replicas = {}
        for o in masters:
            if o.get("replicas") is None:
                continue
            for name, seg in o["replicas"]:
                if seg not in segments:
                    raise TraceError(f"the master of term {o['term']} recovered {name!r} on "
                                     f"segment {seg}, which no node file covers")
            replicas[rank[o["term"]]] = frozenset(key(segments[s], k) for k, s in o["replicas"])
        self.replicas = Fn.of(replicas)
        self.objects = Fn.of(objects)
        readers = [ModelValue("rd1")] if any(r["act"] == "Read" for r in self.records) else []
        self.model_values = list(self.masters) + node_names + keys.values() + readers
        self.constants = {"Masters": frozenset(self.masters), "Nodes": frozenset(node_names),
                          "Keys": frozenset(keys.values()), "Readers": frozenset(readers),
                          "MaxTerm": len(rank), "MaxCopies": 1, "None": NONE}


_BLANK = {"n": NONE, "k": NONE, "t": 0, "ok": True, "err": "", "keys": frozenset(),
          "client": False, "by": 0, "source": False}


_MODULE = r"""---------------------------- MODULE FailoverTrace ----------------------------
(* The storage nodes' recorded fence and index steps of a run with master    *)
(* takeovers, merged (kvproto trace failover): each step must be an action   *)
(* of Failover from the state the steps before it reached.                  *)
EXTENDS Failover, Sequences, TLC

CONSTANTS %(values)s

Trace == %(trace)s
MasterOf == %(masters)s
\* spec key (one replica) -> the object's key
ObjOf == %(objects)s
\* term -> how many objects its master's file says it recovered, and which
RecCount == %(count)s
RecKeys == %(keys)s
\* term -> the replicas its master's file lists as recovered
RecReplicas == %(replicas)s

VARIABLES
    pos,             \* the next step of Trace
    pending,         \* node -> entries Recover purged that the node has not purged yet
    recoveredTerms   \* the terms whose master recovered

R == Trace[pos]
M(t) == MasterOf[t]
Objects(d) == {ObjOf[k] : k \in {x \in Keys : d[x] # None}}
Others == <<pending, recoveredTerms>>

\* A request stamped below the node's fence is refused; a master's steps it
\* down, a client's (a read or a write, spec Read) is a miss.
RefusedStale(n, t) ==
    /\ ~NodeAccepts(n, t)
    /\ IF phase[M(t)] # "standby" /\ ~R.client THEN StepDown(M(t))
       ELSE UNCHANGED <<phase, mterm, acked>>
    /\ UNCHANGED <<coordTerm, dir, live, nodeTerm, idx, desc, got, promised, staleAccepted, told>>

\* A node joins a master that already serves (the spec has every node from
\* the start): it holds nothing and learns the term as a fence does.
Join(m, n) ==
    /\ phase[m] \in {"recovered", "open"}
    /\ nodeTerm[n] <= mterm[m]
    /\ \A k \in Keys : idx[n][k] = None
    /\ nodeTerm' = [nodeTerm EXCEPT ![n] = mterm[m]]
    /\ promised' = [promised EXCEPT ![n] = Max(@, mterm[m])]
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, dir, live, idx, desc, got, staleAccepted, told>>

\* An unpublished allocation freed (its attempt revoked or reclaimed): the
\* spec abstracts this away; the entry leaves the index and the directory.
Revoke(m, k, n) ==
    /\ phase[m] = "open"
    /\ idx[n][k] # None /\ ~idx[n][k].pub
    /\ idx' = [idx EXCEPT ![n][k] = None]
    /\ nodeTerm' = [nodeTerm EXCEPT ![n] = Max(@, mterm[m])]
    /\ dir' = [dir EXCEPT ![m][k] = None]
    /\ staleAccepted' = IF mterm[m] < promised[n] THEN staleAccepted \cup {n} ELSE staleAccepted
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, live, desc, got, promised, told>>

\* A repaired replica's publish mark (the node's part of Repair: a spec key
\* is one replica here, so the copy is its own key, allocated by the repair's
\* StampedAllocate): the entry records the object's publishing term b
\* (RepairedEntry), which another replica of the object was published in
\* earlier in the run (R.source: the copy's source may be lost by now).
PublishCopy(m, k, n, b) ==
    /\ phase[m] = "open"
    /\ dir[m][k] # None /\ dir[m][k].nodes = {n} /\ ~dir[m][k].pub
    /\ idx[n][k] # None /\ ~idx[n][k].pub
    /\ b < mterm[m]
    /\ R.source
    /\ idx' = [idx EXCEPT ![n][k] = [term |-> b, pub |-> TRUE, by |-> b]]
    /\ nodeTerm' = [nodeTerm EXCEPT ![n] = Max(@, mterm[m])]
    /\ dir' = [dir EXCEPT ![m][k].pub = TRUE]
    /\ staleAccepted' = IF mterm[m] < promised[n] THEN staleAccepted \cup {n} ELSE staleAccepted
    /\ told' = [told EXCEPT ![k] = [what |-> "published", node |-> n]]
    /\ UNCHANGED <<coordTerm, phase, mterm, acked, live, desc, got, promised>>

\* A read the node served (an accepted ReadReplica of k's region): a reader
\* looked k up at an open master listing the replica on n (Lookup) and read
\* it there (Read), and the node had the entry under a term it accepts: not
\* the spec's miss. The entry returned is the reader's (got), which
\* ReadsReturnPublishedBytesOrMiss judges.
ReadServed(n, k) ==
    \E r \in Readers, m \in Masters :
        /\ desc[r] = None
        /\ phase[m] = "open" /\ dir[m][k] # None /\ dir[m][k].pub /\ n \in dir[m][k].nodes
        /\ n \in live /\ NodeAccepts(n, mterm[m]) /\ idx[n][k] # None
        /\ got' = [got EXCEPT ![r] = idx[n][k]]
        /\ UNCHANGED <<coordTerm, phase, mterm, acked, dir, live, nodeTerm, idx, desc, promised,
                       staleAccepted, told>>

NodeStep ==
    LET n == R.n  t == R.t  k == R.k  m == M(R.t) IN
    \/ /\ R.act = "Fence" /\ R.ok
       /\ \/ phase[m] = "fencing" /\ nodeTerm[n] <= t /\ Fence(m, n)
          \/ Join(m, n)
          \/ nodeTerm[n] = t /\ UNCHANGED vars     \* fenced again at the same term
       /\ UNCHANGED Others
    \/ /\ ~R.ok /\ R.err = "StaleTerm"
       /\ R.act \in {"Fence", "IndexRequest", "StampedAllocate", "StampedPublish", "StampedFree",
                     "StaleRequest"}
       /\ RefusedStale(n, t) /\ UNCHANGED Others
    \/ /\ R.act = "StampedAllocate"
       /\ IF R.ok THEN NodeAccepts(n, t) /\ Allocate(m, k, n)
                  ELSE R.err = "KeyExists" /\ idx[n][k] # None /\ UNCHANGED vars
       /\ UNCHANGED Others
    \/ /\ R.act = "StampedPublish"
       /\ IF R.ok THEN /\ NodeAccepts(n, t)
                       /\ IF R.by = 0 \/ R.by = t
                          THEN dir[m][k] # None /\ dir[m][k].nodes = {n} /\ Publish(m, k)
                          ELSE PublishCopy(m, k, n, R.by)
                  ELSE /\ R.err = "NotPublished" /\ k \notin pending[n]
                       /\ (idx[n][k] = None \/ idx[n][k].pub) /\ UNCHANGED vars
       /\ UNCHANGED Others
    \/ /\ R.act = "StampedFree"
       /\ IF R.ok THEN /\ NodeAccepts(n, t) /\ dir[m][k] # None /\ dir[m][k].nodes = {n}
                       /\ IF dir[m][k].pub THEN Remove(m, k) ELSE Revoke(m, k, n)
                  ELSE R.err = "StaleToken" /\ UNCHANGED vars
       /\ UNCHANGED Others
    \/ R.act = "IndexRequest" /\ R.ok /\ NodeAccepts(n, t) /\ UNCHANGED <<vars, Others>>
    \/ R.act = "Read" /\ ReadServed(n, k) /\ UNCHANGED Others
    \/ /\ R.act = "PurgeUnpublished" /\ R.ok
       /\ t \in recoveredTerms
       /\ R.keys = pending[n]
       /\ pending' = [pending EXCEPT ![n] = {}]
       /\ UNCHANGED <<vars, recoveredTerms>>

MasterStep ==
    LET m == M(R.t) IN
    \/ R.act = "ObtainTerm" /\ ObtainTerm(m) /\ UNCHANGED Others
    \/ /\ R.act = "Recover"
       /\ phase[m] = "fencing" /\ FenceComplete(m) /\ \A n \in live : nodeTerm[n] <= mterm[m]
       /\ Recover(m)
       /\ R.t \in DOMAIN RecCount => Cardinality(Objects(dir'[m])) = RecCount[R.t]
       /\ R.t \in DOMAIN RecKeys => Objects(dir'[m]) = RecKeys[R.t]
       /\ R.t \in DOMAIN RecReplicas => {x \in Keys : dir'[m][x] # None} = RecReplicas[R.t]
       /\ pending' = [n \in Nodes |-> pending[n] \cup
                        {k \in Keys : idx[n][k] # None /\ ~idx[n][k].pub
                                      /\ idx[n][k].term < mterm[m]}]
       /\ recoveredTerms' = recoveredTerms \cup {R.t}
    \/ R.act = "Open" /\ Open(m) /\ UNCHANGED Others
    \* a node that has not started yet holds nothing: its fence changes nothing it holds
    \/ /\ R.act = "FenceUnstarted" /\ phase[m] = "fencing"
       /\ nodeTerm[R.n] <= R.t /\ \A k \in Keys : idx[R.n][k] = None
       /\ Fence(m, R.n) /\ UNCHANGED Others
    \* a node with no step left (killed, or started over under a new segment)
    \/ R.act = "NodeLost" /\ NodeLost(R.n) /\ UNCHANGED Others

TraceInit ==
    /\ Init
    /\ pos = 1
    /\ pending = [n \in Nodes |-> {}]
    /\ recoveredTerms = {}

\* A window of a longer run (kvproto.checking.failtrace) starts in a state the
\* window before it ended in: every variable of the spec and of this module,
\* on the keys this window names or whose entries are not empty there.
Starts == %(starts)s
WindowInit ==
    \E s \in Starts :
        /\ coordTerm = s.coordTerm /\ phase = s.phase /\ mterm = s.mterm /\ acked = s.acked
        /\ dir = s.dir /\ live = s.live /\ nodeTerm = s.nodeTerm /\ idx = s.idx
        /\ desc = s.desc /\ got = s.got /\ promised = s.promised
        /\ staleAccepted = s.staleAccepted /\ told = s.told
        /\ pending = s.pending /\ recoveredTerms = s.recoveredTerms
        /\ pos = 1

\* Each state a window ends in, printed for the next window to start from
\* (always TRUE: not a property).
WindowEnd ==
    pos > Len(Trace) =>
        PrintT(<<"WindowEnd", [coordTerm |-> coordTerm, phase |-> phase, mterm |-> mterm,
                              acked |-> acked, dir |-> dir, live |-> live,
                              nodeTerm |-> nodeTerm, idx |-> idx, desc |-> desc, got |-> got,
                              promised |-> promised, staleAccepted |-> staleAccepted,
                              told |-> told, pending |-> pending,
                              recoveredTerms |-> recoveredTerms]>>)

Done == pos > Len(Trace) /\ UNCHANGED <<vars, pos, Others>>

TraceNext ==
    \/ /\ pos <= Len(Trace)
       /\ IF R.src = "node" THEN NodeStep ELSE MasterStep
       /\ pos' = pos + 1
    \/ Done
=============================================================================
"""


def _fn(value: Fn) -> str:
    return format_value(value) if value else "<<>>"


# --- windows ---------------------------------------------------------------------

#: what a window carries to the next: the spec's variables and the trace module's
CARRIED = ("coordTerm", "phase", "mterm", "acked", "dir", "live", "nodeTerm", "idx", "desc",
           "got", "promised", "staleAccepted", "told", "pending", "recoveredTerms")
_TOLD_NONE = Fn.of({"what": "none", "node": NONE})


def _dict(value) -> dict:
    """A function TLC printed (``<<>>`` over an empty domain) as a dict."""
    return dict(value.items()) if isinstance(value, Fn) else {}


def _named(model: "FailoverModel", lo: int, hi: int) -> set:
    """The keys the steps ``lo:hi`` name, and those their recoveries list."""
    out: set = set()
    for r in model.records[lo:hi]:
        if r["k"] != NONE:
            out.add(r["k"])
        out |= r["keys"]
        if r["act"] == "Recover" and r["t"] in model.replicas:
            out |= model.replicas[r["t"]]
    return out


def _empty(state: dict, k) -> bool:
    """Whether key ``k`` holds nothing in ``state`` that a later step or an
    invariant reads: no node's entry, no serving or fencing master's
    directory entry, no purge owed, no descriptor, and no acknowledged
    publish on a live node (a ``told`` of a remove, or of a publish on a
    lost node, obliges nothing: a later publish of ``k`` resets it)."""
    told = _dict(state["told"]).get(k, _TOLD_NONE)
    phase = _dict(state["phase"])
    return (all(_dict(keys).get(k, NONE) == NONE for keys in _dict(state["idx"]).values())
            and all(_dict(keys).get(k, NONE) == NONE for m, keys in _dict(state["dir"]).items()
                    if phase[m] != "standby")
            and all(k not in owed for owed in _dict(state["pending"]).values())
            and all(d == NONE or d["key"] != k for d in _dict(state["desc"]).values())
            and not (told["what"] == "published" and told["node"] in state["live"]))


def _aside(state: dict, k) -> tuple:
    """What an empty key keeps while no window names it: its ``told`` and the
    directory entries of masters on standby (read by no step or invariant)."""
    return (_dict(state["told"]).get(k, _TOLD_NONE),
            tuple(sorted(((m.name, _dict(keys).get(k, NONE))
                          for m, keys in _dict(state["dir"]).items()), key=lambda x: x[0])))


def _on_keys(state: dict, keys: set, aside: dict) -> dict:
    """``state`` on exactly the keys ``keys``: those it does not hold come
    back from ``aside`` (or start empty), the others are dropped."""
    def keyed(fn, default) -> Fn:
        held = _dict(fn)
        return Fn.of({k: held[k] if k in held else default(k) for k in keys})

    dir_aside = {k: dict(aside[k][1]) for k in aside}
    out = dict(state)
    out["told"] = keyed(state["told"], lambda k: aside[k][0] if k in aside else _TOLD_NONE)
    out["idx"] = Fn.of({n: keyed(v, lambda k: NONE) for n, v in _dict(state["idx"]).items()})
    out["dir"] = Fn.of({m: keyed(v, lambda k, m=m: dir_aside.get(k, {}).get(m.name, NONE))
                        for m, v in _dict(state["dir"]).items()})
    return out


def _text(model: "FailoverModel", lo: int, hi: int, keys: set, starts: Optional[list],
          last: bool) -> tuple[str, str]:
    """The trace module and cfg of the steps ``lo:hi`` on the keys ``keys``,
    from ``starts`` (None: the spec's ``Init``), printing where it ends
    unless ``last``."""
    records = model.records[lo:hi]
    recovering = {r["t"] for r in records if r["act"] == "Recover"}
    ordered = sorted(keys, key=lambda k: int(k.name[1:]))
    values = list(model.masters) + [v for v in model.model_values
                                    if v in model.constants["Nodes"]] + ordered \
        + sorted(model.constants["Readers"], key=lambda v: v.name)
    trace = "<<\n    " + ",\n    ".join(format_value(r) for r in records) + "\n  >>" \
        if records else "<<>>"
    state = "{" + ",\n    ".join(format_value(Fn.of({n: s[n] for n in CARRIED}))
                                 for s in starts) + "}" if starts else "{}"
    text = _MODULE % {"values": ", ".join(v.name for v in values), "trace": trace,
                      "masters": format_value(model.masters),
                      "objects": _fn(Fn.of({k: v for k, v in model.objects.items() if k in keys})),
                      "count": _fn(model.count), "keys": _fn(model.keys),
                      "replicas": _fn(Fn.of({t: v for t, v in model.replicas.items()
                                             if t in recovering})),
                      "starts": state}
    window = SimpleNamespace(constants={**model.constants, "Keys": frozenset(keys)},
                             model_values=values)
    cfg = cfg_text(window, INVARIANTS + (() if last else ("WindowEnd",)))
    if starts is not None:
        cfg = cfg.replace("INIT TraceInit", "INIT WindowInit")
    return text, cfg


def check(nodes: list, masters: Optional[list] = None, *, size: int = windows.SIZE,
          max_windows: Optional[int] = None, keep: Optional[Path] = None,
          on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """Have TLC check the fence and index steps in the node files ``nodes``
    (with what the masters' files ``masters`` say they recovered) against
    ``spec/Failover.tla``: the whole merged run, in windows of at most
    ``size`` merged steps (at most ``max_windows`` of them), each its own
    TLC run from the states the window before it ended in."""
    if not nodes:
        raise TraceError("no storage node trace to check")
    if size < 1 or (max_windows is not None and max_windows < 1):
        raise TraceError("a window needs at least one step, and a check at least one window")
    read, files = [], []
    for path in nodes:
        for segment in read_node(path):
            read.append(segment)
            files.append(Path(path))
    openings = [o for p in (masters or ()) for o in read_master(p)]
    try:
        model = FailoverModel(read, files, openings)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise TraceError(f"a step the checker cannot read ({e!r})") from None
    n = len(model.records)
    count = max(1, -(-n // size))
    if max_windows is not None:
        count = min(count, max_windows)
    starts, held, aside = None, set(), {}
    states, seconds = 0, 0.0
    for w in range(count):
        lo, hi = w * size, min(n, (w + 1) * size)
        keys = _named(model, lo, hi) if n > size else set(model.constants["Keys"])
        if starts is not None:
            stay = {k for k in held if any(not _empty(s, k) for s in starts)
                    or len({_aside(s, k) for s in starts}) > 1}
            for k in held - stay - keys:
                aside[k] = _aside(starts[0], k)
            keys |= stay
            starts = [_on_keys(s, keys, aside) for s in starts]
        where = keep if keep is None or count == 1 else Path(keep) / f"window-{w + 1}"
        text, cfg = _text(model, lo, hi, keys, starts, w == count - 1)
        result = run_module("Failover", "FailoverTrace", text, cfg, keep=where,
                            on_output=on_output)
        states += result.distinct_states or 0
        seconds += result.seconds
        common = dict(steps=hi, distinct_states=states, seconds=seconds, machine="failover",
                      windows=w + 1)
        if result.verdict != "ok":
            return _failed(model, result, lo, hi, w + 1 if n > size else 0, common)
        if w < count - 1:
            starts, held = windows.printed_ends(result.output, CARRIED), keys
            if not starts:
                raise failure(result)
    spread = f" in {count} windows" if count > 1 else ""
    what = f"{len(files)} segment(s) and {len(model.masters)} term(s)"
    if hi == n:
        return Verdict(True, message=f"all {n} fence, index and recovery steps of {what} are "
                                     f"steps of spec/Failover.tla{spread}", **common)
    stopped = f"at most {max_windows} window(s) of {size} steps are checked"
    return Verdict(True, message=f"the first {hi} of {n} fence, index and recovery steps of "
                                 f"{what} are steps of spec/Failover.tla{spread}; the rest "
                                 f"are not checked: {stopped}", stopped=stopped, **common)


def _failed(model: "FailoverModel", result, lo: int, hi: int, window: int,
            common: dict) -> Verdict:
    """The verdict of a window TLC found wanting: the first step it could not
    take, named by its node file and recorded number and by its place in the
    whole merged run."""
    unmatched = first_unmatched(result, "Failover")
    if unmatched is None:
        raise failure(result)
    i, what = unmatched
    i += lo
    within = f" (merged step {i + 1} of {len(model.records)}, window {window} of steps " \
             f"{lo + 1} to {hi})" if window else ""
    path, recorded, line, step = model.origins[i]
    if path is None:        # a master's step placed between the nodes' steps
        return Verdict(False, **common, message=f"{step} {what}{within}")
    return Verdict(False, failed_step=recorded, line=line, **common,
                   message=f"{path.name} step {recorded} (line {line}) {what}: "
                           f"{describe(step)}{within}")


def describe(step: dict) -> str:
    """A recorded node step in one line: ``Fence(term=2) -> FenceAck``."""
    ev = step["event"]
    args = ", ".join(f"{k}={v!r}" for k, v in ev.items() if k not in ("type", "node"))
    return f"{ev['type']}({args}) -> {outcome(step['effects'])}"


# --- command line ----------------------------------------------------------------


def add_arguments(sub) -> None:
    """``kvproto trace failover`` on the ``trace`` command's subparsers."""
    parser = sub.add_parser(
        "failover", help="check the storage nodes' fence and index steps of a run with "
                         "takeovers with TLC",
        description="Merge the storage nodes' traces (ordered by their term fences) into one "
                    "run and check with TLC that their fence, index and purge steps, with the "
                    "masters' takeovers between them, are a behaviour of spec/Failover.tla, or "
                    "name the first step that is not. A long run is checked whole, in windows "
                    "of at most 1,000 merged steps, each its own TLC run from the states the "
                    "one before ended in.")
    parser.add_argument("nodes", type=Path, nargs="+", metavar="NODE_FILE",
                        help="the storage nodes' trace files")
    parser.add_argument("--master", type=Path, action="append", default=[], metavar="FILE",
                        help="a master's trace file: what it recovered must be what the fenced "
                             "nodes held (repeat for each master)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="write the generated module and cfg to DIR")


def main(args: argparse.Namespace) -> int:
    try:
        verdict = check(args.nodes, args.master, keep=args.keep)
    except (TraceError, FileNotFoundError) as e:
        print(f"kvproto trace: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    states = "?" if verdict.distinct_states is None else f"{verdict.distinct_states:,}"
    print(f"failover: {verdict.message} ({states} distinct states, {verdict.seconds:.1f}s)")
    return 0 if verdict.ok else 1
