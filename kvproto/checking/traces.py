r"""Runtime traces checked by TLC: is what the master did a behaviour of its specs?

A master started with ``--trace FILE`` (or ``KVPROTO_TRACE=FILE``) records
every event it feeds its publish machine, the effects it got back and what the
step left of the directory, and every step of its lease table
(:mod:`kvproto.runtime.tracing`). :func:`check` checks each machine present in
the file: the lease steps against ``spec/Lease.tla``
(:mod:`kvproto.checking.leasetrace`), and the publish steps as follows.
:func:`check_run` turns one recorded run into a TLA+ module ``PublishTrace`` that extends
``Publish`` and holds the run as a constant sequence of records, and has TLC
walk it: at step ``i`` the trace's ``Next`` takes the spec's own action that
record ``i`` names, with the recorded arguments, and requires what the spec's
step does to agree with what was recorded:

* an accepted event is the spec's action with its guard holding (``PutEnd``
  and ``PutRevoke`` of the attempt holding the token, ``TokenOwns``; ``PutStart``
  with the token ``nextToken`` and a placement of ``ReplicaCount`` joined
  segments; ``ReadBegin`` handing out the record's token and replicas; ...);
  its effects must be exactly the spec step's: the regions assigned and freed
  (``store``), the objects revoked or removed, the objects published; and the
  directory after it (each named key's record, ``nextToken``) must be the
  spec's;
* a refused event changes nothing, and the spec must not have allowed it
  (a ``PutEnd`` refused as stale while its token owns the key is a mismatch).

The writers' ``WriteReplica`` steps are not seen by the master; before a
recorded ``PutEnd`` the trace lets that attempt's writer write its replicas
(the spec's own ``WriteReplica``), in any order. Nor are the repair copiers'
``CopyReplica`` steps: a ``ListReplica`` the master took on its copier's
report of a complete copy (the step's ``report``, ``copied``) is preceded by
the spec's ``CopyReplica`` of that repair; one taken without such a report
has nothing copied, and the spec's ``ListReplica`` (``RepairCopied``) refuses
it. ``RepairStart`` must name the repair ``nextToken`` and a joined segment,
and ``ListReplica`` and ``RepairCancel`` the repair in flight into their
segment (its id). TLC checks deadlock: a state
where the next record matches no step of the spec is where the run left the
spec, and its step number is reported. A run that matches every step also
keeps the spec's invariants (checked in every state).

The run starts from the directory the master opened with (``TraceInit``,
built from the ``opened`` line's ``directory``, :func:`opened_objects`): its
objects' records, their regions complete on their nodes (a published
object's, holding its attempt's bytes), the rest of each segment free, no
writer busy. For an empty directory (a master's first run) that is the
spec's ``Init``; for a master that took over, the directory it recovered.
The spec's invariants, and ``TokensIssued`` (every token held is below
``nextToken``), are checked in that state as in every other.

Mapping onto model values: keys, segments, and each segment's offsets are
numbered by first appearance (``key1``, ``seg1``, slot 1, ...; the opened
directory's first); the ``R`` tokens and repair ids the opened directory
holds are ``1..R`` in their order, a token ``t`` the run issues is
``t - first + 1 + R`` (``first`` the token the run's directory opened with),
any other token 0 (never issued in the run), and each attempt has its own
writer (``wr<token>``). The
spec counts space in slots: an offset is a slot, so the byte accounting (free
bytes, overlapping extents of different lengths) is not checked here (the
differential test holds the core to the reference for that). Segments are all
in the spec's ``Init``: a segment joins with ``AddSegment``, and the trace
requires a placement to use joined segments only (those the directory
opened with, and those joined since). One run per file; the constants are
derived from the run and bounded (:data:`LIMITS`) so that TLC checks it in
seconds. A longer run is checked whole in windows (:func:`check_windows`,
:mod:`kvproto.checking.windows`): each window starts from the state the one
before ended in (:func:`boundary`, an ``opened`` header with the writers of
pending puts busy) and must end in the next one's (``WindowEnd``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable, Optional

import attrs

from kvproto.checking import leasetrace, windows
from kvproto.checking.tla import Fn, ModelValue, format_value
from kvproto.checking.tracerun import (Numbered, TraceError, Verdict, accepted, cfg_text,
                                       failure, json_lines, module_text, outcome, run_module)

__all__ = ["TraceError", "Verdict", "boundary", "check", "check_each", "check_run", "check_windows",
           "read", "publish_run", "describe"]

NONE = ModelValue("None")
NOBODY = ModelValue("wr0")

#: the largest run checked: TLC re-evaluates the spec's invariants over all
#: keys, segments and slots in every state
LIMITS = {"steps": 3000, "keys": 32, "segments": 6, "slots": 64, "tokens": 512}

INVARIANTS = ("TraceTypeOK", "OnlyPublishedReadable", "PublishedHasAllReplicasComplete",
              "NoOverlappingAllocation", "SpaceAccounted", "OneAttemptPublishes",
              "PublishedBytesAreTheAttempts", "NeverAboveRequested", "TokensIssued")
#: the spec's sets no step or invariant of a trace reads, left unbuilt (``Unread``)
OVERRIDES = tuple(f"{name} <- Unread" for name in
                  ("Placements", "SomeReplicas", "SomeRepairs", "Object", "Attempt"))


# --- reading ---------------------------------------------------------------------


#: the machines a trace may hold, in the order they are checked
MACHINES = ("publish", "lease")


def read(path: "str | Path") -> dict[str, list[tuple[int, dict]]]:
    """The lines of a trace file by machine, each with its line number."""
    lines: dict[str, list[tuple[int, dict]]] = {m: [] for m in MACHINES}
    for number, obj in json_lines(path):
        if not isinstance(obj, dict) or "machine" not in obj:
            raise TraceError(f"{path}:{number}: not a trace line (no 'machine')")
        if obj["machine"] in lines:
            lines[obj["machine"]].append((number, obj))
    return lines


def runs(lines: list) -> list[list]:
    """A machine's lines split where the master opened it anew: a master that
    stepped down (paused past its term) and later took over again records a
    second run in the same file."""
    out: list[list] = []
    for number, obj in lines:
        if "opened" in obj or not out:
            out.append([])
        out[-1].append((number, obj))
    return out


def publish_run(lines: list[tuple[int, dict]]) -> tuple[dict, list[tuple[int, dict]]]:
    """The one run in ``lines``: its ``opened`` header and its steps."""
    opened = [i for i, (_, obj) in enumerate(lines) if "opened" in obj]
    if not opened or opened[0] != 0:
        raise TraceError("the trace does not start where a master opened its directory "
                         "(no 'opened' line first)")
    if len(opened) > 1:
        raise TraceError(f"the trace holds {len(opened)} runs (a master restarted or took over "
                         "on the same file); record one run per file")
    header = lines[0][1]["opened"]
    opened_objects(header)
    steps = lines[1:]
    for number, obj in steps:
        if not isinstance(obj.get("event"), dict) or not isinstance(obj.get("effects"), list) \
                or not isinstance(obj.get("after"), dict):
            raise TraceError(f"line {number}: a step needs 'event', 'effects' and 'after'")
    return header, steps


def opened_objects(header: dict) -> dict:
    """The objects of the directory a run opened with (``"directory"`` of its
    ``opened`` line): key -> record, empty for a run from an empty directory."""
    n = header.get("objects", 0)
    listed = header.get("directory", {} if n == 0 else None)
    if not isinstance(listed, dict) or len(listed) != n:
        raise TraceError(f"the run starts from a recovered directory of {n} object(s) that its "
                         "'opened' line does not list (more than 1,000 objects, or recorded by "
                         "an older master)")
    return listed


# --- mapping onto model values ---------------------------------------------------


class _Mapping:
    """The run's names, tokens and offsets as the spec's model values."""

    def __init__(self, first_token: int, last_token: int, before: tuple = ()) -> None:
        self.keys = Numbered("key")
        self.segments = Numbered("seg")
        self.slots: dict[str, dict[int, int]] = {}
        self.first, self.last = first_token, last_token
        #: the tokens below ``first`` that the opened directory holds, in order
        self.before = {t: i for i, t in enumerate(sorted(before), 1)}

    def token(self, t) -> int:
        if isinstance(t, int) and self.first <= t < self.last:
            return self.counter(t)
        return self.before.get(t, 0) if isinstance(t, int) else 0

    def counter(self, next_token: int) -> int:
        """The spec's ``nextToken`` for the directory's ``next_token``."""
        return next_token - self.first + 1 + len(self.before)

    def writer(self, t) -> ModelValue:
        m = self.token(t)
        return ModelValue(f"wr{m}") if m else NOBODY

    def slot(self, segment: str, offset: int) -> tuple[ModelValue, int]:
        slots = self.slots.setdefault(segment, {})
        if offset not in slots:
            slots[offset] = len(slots) + 1
        return self.segments(segment), slots[offset]

    def placement(self, replicas: list) -> Fn:
        return Fn.of(self.slot(r["segment"], r["offset"]) for r in replicas)

    def record(self, rec: Optional[dict]):
        if rec is None:
            return NONE
        repairs = Fn.of({self.segments(p["segment"]):
                         Fn.of({"slot": self.slot(p["segment"], p["offset"])[1],
                                "id": self.token(p["id"])})
                         for p in rec.get("repairs", ())}) if rec.get("repairs") else ()
        return Fn.of({"status": rec["status"], "token": self.token(rec["token"]),
                      "replicas": self.placement(rec["replicas"]),
                      "requested": rec.get("requested", len(rec["replicas"])),
                      "repairs": repairs, "reads": rec["reads"]})


def _record(m: _Mapping, step: dict, joined: set) -> Fn:
    """One step as the trace module's record (every record has every field)."""
    ev, effects = step["event"], step["effects"]
    ok = not (effects and effects[0].get("type") == "Refused")
    act = ev["type"]
    fields = {"act": act, "ok": ok, "err": "" if ok else effects[0]["error"]["type"],
              "k": m.keys(ev["key"]) if "key" in ev else NONE,
              "t": m.token(ev.get("token")), "w": m.writer(ev.get("token")),
              "s": m.segments(ev["segment"]) if "segment" in ev else NONE,
              "p": m.placement(ev.get("placement", ())),
              "joined": frozenset(m.segments(s) for s in joined),
              "gt": 0, "gp": Fn.of({}), "frees": frozenset(), "assigns": frozenset(),
              "gone": frozenset(), "published": frozenset(),
              "i": 0, "rid": m.token(ev.get("repair")),
              "copied": bool(step.get("report", {}).get("copied"))}
    if act == "RepairStart":
        fields["s"], fields["i"] = m.slot(ev["replica"]["segment"], ev["replica"]["offset"])
    for e in effects if ok else ():
        kind = e["type"]
        if kind in ("PutGranted", "ReadGranted"):
            fields["gt"], fields["gp"] = m.token(e["token"]), m.placement(e["replicas"])
            if kind == "PutGranted":
                fields["w"] = m.writer(e["token"])
        elif kind == "AssignRegion":
            fields["assigns"] |= {(*m.slot(e["segment"], e["offset"]), m.keys(e["key"]),
                                   m.token(e["token"]))}
        elif kind == "FreeRegion":
            fields["frees"] |= {(*m.slot(e["segment"], e["offset"]), m.token(e["token"]))}
        elif kind in ("Revoked", "Removed"):
            status = "pending" if kind == "Revoked" else "published"
            fields["gone"] |= {(m.keys(e["key"]), m.token(e["token"]), status)}
        elif kind == "Published":
            fields["published"] |= {(m.keys(e["key"]), m.token(e["token"]))}
        elif kind == "RepairStarted":
            fields["gt"] = m.token(e["repair"])
    after = step["after"]
    fields["after"] = Fn.of({m.keys(k): m.record(rec) for k, rec in after["objects"].items()})
    fields["next"] = m.counter(after["next_token"])
    return Fn.of(fields)


@attrs.frozen
class TraceModel:
    """A run mapped onto the spec: its constants and one record per step."""

    constants: dict
    records: tuple
    model_values: tuple
    numbers: tuple      # (recorded n, file line) per record
    opened: Fn          # the directory the run opened with (``Opened`` of the module)
    end: Optional[Fn] = None    # the state a window must end in (``End``), or None


def token_range(header: dict, steps: list[tuple[int, dict]]) -> tuple[int, int]:
    """The first token the run's directory issues and the one after its last."""
    first = header["next_token"]
    return first, max([first] + [s["after"]["next_token"] for _, s in steps])


def run_mapping(header: dict, steps: list[tuple[int, dict]], held: frozenset = frozenset()
                ) -> _Mapping:
    """The run's mapping: its tokens from :func:`token_range`, after the tokens
    (and repair ids) of the directory it opened with, which were issued before
    it. ``held``: more tokens the run starts with (its nodes' regions, for
    :mod:`kvproto.checking.mergetrace`); one at or above the run's first token
    is mapped as one the run issues."""
    first, last = token_range(header, steps)
    try:
        held = {t for rec in opened_objects(header).values()
                for t in [rec["token"]] + [p["id"] for p in rec.get("repairs", ())]} | set(held)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"an object of the opened directory the checker cannot read ({e!r})") \
            from None
    held = {t for t in held if isinstance(t, int) and t > 0}
    last = max([last] + [t + 1 for t in held])
    return _Mapping(first, last, tuple(t for t in held if t < first))


def _opened(m: _Mapping, header: dict) -> Fn:
    """``Opened`` (or ``End``) of the module: the directory of an ``opened``
    line (or of a window's start, :func:`kvproto.checking.windows.boundary`)
    on model values, with the writers it lists busy."""
    try:
        objects = {m.keys(k): m.record(rec) for k, rec in opened_objects(header).items()}
        writers = {m.writer(w["token"]): Fn.of({"key": m.keys(w["key"]),
                                               "token": m.token(w["token"]),
                                               "replicas": m.placement(w["replicas"]),
                                               "written": frozenset()})
                   for w in header.get("writers", ())}
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"an object of the opened directory the checker cannot read ({e!r})") \
            from None
    return Fn.of({"dir": Fn.of(objects),
                  "lost": frozenset(m.segments(s) for s in header.get("lost", ())),
                  "next": m.counter(header["next_token"]), "writers": Fn.of(writers)})


def to_model(header: dict, steps: list[tuple[int, dict]],
             mapping: Optional[_Mapping] = None, end: Optional[dict] = None) -> TraceModel:
    """Map a run onto model values (see the module docstring); raise
    :class:`TraceError` for a run outside :data:`LIMITS` or the spec's shape.
    ``mapping`` (of :func:`run_mapping`) may already hold names of the run
    that the master's steps do not (its storage nodes' steps). ``end``: the
    state a window of a longer run must end in (the next window's header)."""
    if len(steps) > LIMITS["steps"]:
        raise TraceError(f"the run has {len(steps)} steps; at most {LIMITS['steps']} are "
                         "checked (record a shorter run)")
    m = mapping if mapping is not None else run_mapping(header, steps)
    joined = set(header.get("segments", {}))
    for s in header.get("segments", {}):
        m.segments(s)
    opened = _opened(m, header)
    objects = opened["dir"]
    records, replica_counts = [], set()
    reads = max([1] + [rec["reads"] for rec in objects.values()])
    requested = max([0] + [rec["requested"] for rec in objects.values()])
    for number, step in steps:
        try:
            records.append(_record(m, step, joined))
        except (KeyError, TypeError, AttributeError) as e:
            raise TraceError(f"line {number}: a step the checker cannot read ({e!r})") from None
        ev, effects = step["event"], step["effects"]
        accepted = not (effects and effects[0].get("type") == "Refused")
        if accepted and ev["type"] == "AddSegment":
            joined.add(ev["segment"])
        if accepted and ev["type"] == "PutStart":
            replica_counts.add(len(ev["placement"]))
        for rec in step["after"]["objects"].values():
            if rec is not None:
                reads = max(reads, rec["reads"])
    closing = _opened(m, end) if end is not None else None
    if len(replica_counts) > 1:
        raise TraceError(f"the run puts objects with {sorted(replica_counts)} replicas; the spec "
                         "has one ReplicaCount (record a run with one replica count)")
    sizes = {"keys": len(m.keys.names), "segments": len(m.segments.names),
             "slots": max([len(s) for s in m.slots.values()] or [1]),
             "tokens": m.counter(m.last) - 1}
    for name, size in sizes.items():
        if size > LIMITS[name]:
            raise TraceError(f"the run has {size} {name}; at most {LIMITS[name]} are checked "
                             "(record a run with fewer)")
    segments = m.segments.values() or [ModelValue("seg1")]
    replicas = replica_counts.pop() if replica_counts else max(requested, 1)
    if requested > replicas:
        raise TraceError(f"the run opened with objects that requested {requested} replicas and "
                         f"puts objects with {replicas}; the spec has one ReplicaCount")
    if replicas > len(segments):
        raise TraceError(f"{replicas} replicas but only {len(segments)} segment(s) in the run")
    writers = [ModelValue(f"wr{t}") for t in range(sizes["tokens"] + 1)]
    keys = m.keys.values() or [ModelValue("key1")]
    constants = {"Keys": frozenset(keys), "Writers": frozenset(writers),
                 "Segments": frozenset(segments), "SlotsPerSegment": sizes["slots"],
                 "ReplicaCount": replicas, "MaxToken": max(1, sizes["tokens"]),
                 "MaxReads": reads, "None": NONE}
    values = tuple(dict.fromkeys([*keys, *writers, *segments]))
    return TraceModel(constants, tuple(records), values, tuple((s.get("n"), n) for n, s in steps),
                      opened, closing)


def boundary(header: dict, steps: list[tuple[int, dict]]) -> dict:
    """The ``opened`` header of the state a run from ``header`` is in after
    ``steps``: the directory (each step's ``after`` applied in order, and a
    lost segment's replicas and repairs dropped from the objects that kept
    others, which its step does not name), the segments joined and lost, the
    next token, and ``writers``: each pending put's attempt, its writer busy
    and nothing written yet (a writer writes just before its ``PutEnd``)."""
    directory = copy.deepcopy(opened_objects(header))
    segments = dict(header.get("segments", {}))
    lost = list(header.get("lost", ()))
    writers = {w["token"]: w for w in header.get("writers", ())}
    next_token = header["next_token"]
    for number, step in steps:
        try:
            ev, ok = step["event"], accepted(step)
            kind = ev["type"]
            if ok and kind == "AddSegment":
                segments[ev["segment"]] = ev.get("capacity")
            elif ok and kind == "SegmentLost":
                lost.append(ev["segment"])
                for rec in directory.values():
                    rec["replicas"] = [r for r in rec["replicas"] if r["segment"] != ev["segment"]]
                    if rec.get("repairs"):
                        rec["repairs"] = [p for p in rec["repairs"]
                                          if p["segment"] != ev["segment"]]
            elif ok and kind == "PutStart":
                (grant,) = [e for e in step["effects"] if e["type"] == "PutGranted"]
                writers[grant["token"]] = {"key": ev["key"], "token": grant["token"],
                                           "replicas": grant["replicas"]}
            elif ok and kind in ("PutEnd", "PutRevoke"):
                writers.pop(ev["token"], None)
            for key, rec in step["after"]["objects"].items():
                if rec is None:
                    directory.pop(key, None)
                else:
                    directory[key] = copy.deepcopy(rec)
            next_token = step["after"]["next_token"]
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise TraceError(f"line {number}: a step the checker cannot read ({e!r})") from None
    busy = [w for t, w in sorted(writers.items())
            if directory.get(w["key"], {}).get("status") == "pending"
            and directory[w["key"]]["token"] == t]
    out = {"next_token": next_token, "objects": len(directory), "directory": directory,
           "segments": segments, "writers": busy}
    if lost:
        out["lost"] = lost
    return out


# --- the trace module ------------------------------------------------------------

_MODULE = r"""---------------------------- MODULE PublishTrace ----------------------------
(* A recorded run of the master's publish machine (kvproto trace check):    *)
(* each step must be the spec's action the record names, with its effects.  *)
EXTENDS Publish, Sequences, TLC

CONSTANTS %(values)s

VARIABLE pos   \* the next record to match

Trace == %(trace)s

R == Trace[pos]

\* The directory the run opened with (a takeover's, recovered; empty at a
\* start): each object's record, the segments not live, the next token.
Opened == %(opened)s
End == %(end)s

\* The spec's state of the opened directory O: each object's regions on their
\* nodes (a published object's replicas complete, holding its attempt's
\* bytes; a pending object's regions and a repair's not yet written), the
\* rest of each live segment free, and the readers of each object holding
\* its descriptors. From an empty directory it is Init. Writers apart.
Listed(k, s, i) == s \in DOMAIN dir[k].replicas /\ dir[k].replicas[s] = i
DirectoryState(O) ==
    /\ dir = [k \in Keys |-> IF k \in DOMAIN O.dir THEN O.dir[k] ELSE None]
    /\ live = Segments \ O.lost
    /\ free = [s \in Segments |-> IF s \in live THEN SlotsPerSegment - UsedSlots(s) ELSE 0]
    /\ nextToken = O.next
    /\ store = [s \in Segments |-> [i \in Slots |->
                  IF Allocated(s, i)
                  THEN LET k == CHOOSE k \in Keys : Exists(k) /\ <<s, i>> \in SlotsOf(k) IN
                       [key |-> k, token |-> dir[k].token,
                        done |-> Published(k) /\ Listed(k, s, i)]
                  ELSE None]]
    /\ publishedToken = [k \in Keys |-> IF Published(k) THEN dir[k].token ELSE 0]
    /\ content = [s \in Segments |-> [i \in Slots |->
                    IF store[s][i] # None /\ store[s][i].done THEN store[s][i].token ELSE 0]]
    /\ handed = [k \in Keys |-> [t \in Tokens |->
                    IF Exists(k) /\ dir[k].token = t THEN dir[k].reads ELSE 0]]

\* The run starts there, with the writers O lists busy with their attempts
\* (none at a master's opening; a window's pending puts, nothing written).
OpenedInit ==
    /\ DirectoryState(Opened)
    /\ writer = [w \in Writers |-> IF w \in DOMAIN Opened.writers THEN Opened.writers[w]
                                   ELSE None]

\* A window of a longer run (kvproto.checking.windows) ends in the state the
\* next window starts from: End, built from the recorded steps. A writer End
\* does not list is idle or holds an attempt whose token no longer owns its
\* key (revoked or reclaimed under it), which no later step can take.
WindowEnd ==
    pos > Len(Trace) =>
        /\ DirectoryState(End)
        /\ \A w \in Writers :
              IF w \in DOMAIN End.writers THEN writer[w] = End.writers[w]
              ELSE writer[w] = None \/ ~TokenOwns(writer[w].key, writer[w].token)

\* Every token the directory holds was issued, below nextToken: so in every
\* state of the spec; checked here of the directory the run opened with.
TokensIssued ==
    \A k \in Keys : Exists(k) =>
        /\ dir[k].token < nextToken
        /\ \A s \in DOMAIN dir[k].repairs : dir[k].repairs[s].id < nextToken

\* The spec's TypeOK as TLC checks it on a run's constants: an object's
\* replicas and repairs and an attempt's placement (functions of some
\* segments: a UNION of function sets, which TLC enumerates in full to test
\* membership) are checked domain and range apart; the other sets are the spec's.
PartialOK(f, T) == DOMAIN f \subseteq Segments /\ \A s \in DOMAIN f : f[s] \in T
ObjectOK(o) ==
    /\ DOMAIN o = {"status", "token", "replicas", "requested", "repairs", "reads"}
    /\ o.status \in {"pending", "published"} /\ o.token \in Tokens
    /\ PartialOK(o.replicas, Slots) /\ o.requested \in 1..ReplicaCount
    /\ PartialOK(o.repairs, RepairRegion) /\ o.reads \in 0..MaxReads
AttemptOK(a) ==
    /\ DOMAIN a = {"key", "token", "replicas", "written"}
    /\ a.key \in Keys /\ a.token \in Tokens /\ a.written \subseteq Segments
    /\ PartialOK(a.replicas, Slots) /\ Cardinality(DOMAIN a.replicas) = ReplicaCount
TraceTypeOK ==
    /\ \A k \in Keys : dir[k] = None \/ ObjectOK(dir[k])
    /\ DOMAIN dir = Keys
    /\ free \in [Segments -> 0..SlotsPerSegment]
    /\ live \subseteq Segments
    /\ nextToken \in 1..(MaxToken + 1)
    /\ store \in [Segments -> [Slots -> {None} \cup Region]]
    /\ DOMAIN writer = Writers /\ \A w \in Writers : writer[w] = None \/ AttemptOK(writer[w])
    /\ publishedToken \in [Keys -> 0..MaxToken]
    /\ content \in [Segments -> [Slots -> 0..MaxToken]]
    /\ handed \in [Keys -> [Tokens -> 0..MaxReads]]

\* The spec's sets of every object, attempt and placement, read by its TypeOK
\* and Next alone, are Unread here (the cfg's overrides): TLC would build them
\* before the first state, seconds on a run's constants. A read is an error.
Unread == CHOOSE x \in {} : TRUE

\* The writer of the recorded attempt holds it.
Holds(r) == writer[r.w] # None /\ writer[r.w].key = r.k /\ writer[r.w].token = r.t

\* The repair the record names (its object, destination and id) is in flight.
InFlight(r) == Published(r.k) /\ r.s \in DOMAIN dir[r.k].repairs
               /\ dir[r.k].repairs[r.s].id = r.rid

\* The spec's step for an accepted event.
Accepted(r) ==
    \/ r.act = "AddSegment" /\ UNCHANGED vars
    \/ /\ r.act = "PutStart"
       /\ r.gt = nextToken /\ r.gp = r.p /\ r.w # wr0
       /\ DOMAIN r.p \subseteq r.joined /\ Cardinality(DOMAIN r.p) = ReplicaCount
       /\ PutStart(r.w, r.k, r.p)
    \/ r.act = "PutEnd" /\ Holds(r) /\ TokenOwns(r.k, r.t) /\ PutEnd(r.w)
    \/ r.act = "PutRevoke" /\ Holds(r) /\ TokenOwns(r.k, r.t) /\ PutRevoke(r.w)
    \/ r.act = "ReclaimAbandoned" /\ TokenOwns(r.k, r.t) /\ ReclaimAbandoned(r.k)
    \/ /\ r.act = "ReadBegin" /\ ReadBegin(r.k)
       /\ r.gt = dir[r.k].token /\ r.gp = dir[r.k].replicas
    \/ r.act = "ReadEnd" /\ Exists(r.k) /\ dir[r.k].token = r.t /\ ReadEnd(r.k)
    \/ r.act = "Remove" /\ Remove(r.k)
    \/ r.act = "SegmentLost" /\ r.s \in r.joined /\ SegmentLost(r.s)
    \/ /\ r.act = "RepairStart" /\ r.gt = nextToken /\ r.s \in r.joined
       /\ Published(r.k) /\ dir[r.k].token = r.t /\ RepairStart(r.k, r.s, r.i)
    \/ r.act = "ListReplica" /\ InFlight(r) /\ ListReplica(r.k, r.s)
    \/ r.act = "RepairCancel" /\ InFlight(r) /\ RepairCancel(r.k, r.s)

\* The effects recorded are exactly the spec step's.
Effects(r) ==
    /\ { <<s, x, store[s][x].token>> :
           <<s, x>> \in { <<s, x>> \in Segments \X Slots :
                            s \in live' /\ store[s][x] # None /\ store'[s][x] = None } } = r.frees
    /\ { <<s, x, store'[s][x].key, store'[s][x].token>> :
           <<s, x>> \in { <<s, x>> \in Segments \X Slots :
                            store[s][x] = None /\ store'[s][x] # None } } = r.assigns
    /\ { <<k, dir[k].token, dir[k].status>> :
           k \in { k \in Keys : dir[k] # None /\ dir'[k] = None } } = r.gone
    /\ { <<k, dir'[k].token>> :
           k \in { k \in Keys : Pending(k) /\ dir'[k] # None /\ dir'[k].status = "published" } }
         = r.published

\* A refused event changes nothing, and the spec would not have taken it.
Refused(r) ==
    /\ UNCHANGED vars
    /\ \/ r.act \in {"PutEnd", "PutRevoke", "ReclaimAbandoned"} /\ ~TokenOwns(r.k, r.t)
       \/ r.act = "PutStart" /\ (r.err = "KeyExists" => Exists(r.k))
       \/ r.act = "ReadBegin" /\ ~Readable(r.k)
       \/ r.act = "ReadEnd" /\ ~(Exists(r.k) /\ dir[r.k].token = r.t /\ dir[r.k].reads > 0)
       \/ r.act = "Remove" /\ ~(Published(r.k) /\ dir[r.k].reads = 0)
       \/ r.act = "SegmentLost" /\ (r.s \notin r.joined \/ r.s \notin live)
       \/ r.act = "AddSegment"
       \/ /\ r.act = "RepairStart"
          /\ ~(/\ Published(r.k) /\ dir[r.k].token = r.t /\ Below(r.k) /\ nextToken \in Tokens
               /\ r.s \in live \ SegmentsOf(r.k) /\ free[r.s] > 0 /\ ~Allocated(r.s, r.i))
       \/ r.act \in {"ListReplica", "RepairCancel"} /\ ~InFlight(r)

\* The directory the master had after the step is the spec's.
After(r) ==
    /\ \A k \in DOMAIN r.after : dir'[k] = r.after[k]
    /\ nextToken' = r.next

Step ==
    /\ pos <= Len(Trace)
    /\ IF R.ok THEN Accepted(R) /\ Effects(R) ELSE Refused(R)
    /\ After(R)
    /\ pos' = pos + 1

\* The writer of the next recorded PutEnd writes its replicas first (unseen
\* by the master).
Write ==
    /\ pos <= Len(Trace) /\ R.act = "PutEnd" /\ R.ok /\ R.w # wr0
    /\ \E s \in Segments : WriteReplica(R.w, s)
    /\ UNCHANGED pos

\* Before a recorded ListReplica on its copier's report of a complete copy,
\* the copier copies a listed replica (unseen by the master). Without such a
\* report nothing was copied, and ListReplica finds the copy incomplete.
Copy ==
    /\ pos <= Len(Trace) /\ R.act = "ListReplica" /\ R.ok /\ R.copied /\ InFlight(R)
    /\ CopyReplica(R.k, R.s)
    /\ UNCHANGED pos

Done == pos > Len(Trace) /\ UNCHANGED <<vars, pos>>

TraceInit == OpenedInit /\ pos = 1
TraceNext == Step \/ Write \/ Copy \/ Done
=============================================================================
"""


def module(model) -> str:
    """The ``PublishTrace`` module of a run's model (:func:`to_model`)."""
    end = getattr(model, "end", None)
    return module_text(_MODULE, model, opened=format_value(model.opened),
                       end=format_value(end if end is not None else model.opened))


# --- checking --------------------------------------------------------------------


def check(path: "str | Path", *, keep: Optional[Path] = None,
          on_output: Optional[Callable[[str], None]] = None) -> dict[str, Verdict]:
    """Have TLC check each machine's run recorded in ``path`` against its spec
    (``spec/Publish.tla``, ``spec/Lease.tla``): a verdict per machine present,
    publish first. With ``keep``, the generated modules and cfgs are written
    there (else to a temporary directory)."""
    verdicts = {}
    for machine, verdict in check_each(path, keep=keep, on_output=on_output).items():
        if isinstance(verdict, TraceError):
            raise TraceError(f"{machine}: {verdict}")
        verdicts[machine] = verdict
    return verdicts


def check_each(path: "str | Path", *, keep: Optional[Path] = None,
               on_output: Optional[Callable[[str], None]] = None
               ) -> "dict[str, Verdict | TraceError]":
    """:func:`check`, with the error of a machine that cannot be checked (a
    run over the limits, a recovered directory its ``opened`` line does not
    list) in place of its verdict, so that the other machines are still checked.
    Raises :class:`TraceError` only for a file that cannot be read."""
    lines = read(path)
    if not any(lines.values()):
        raise TraceError(f"{path} holds no recorded step")
    out: "dict[str, Verdict | TraceError]" = {}
    for machine in MACHINES:
        if not lines[machine]:
            continue
        try:
            if machine == "publish":
                header, steps = publish_run(lines[machine])
                out[machine] = check_windows(header, steps, keep=keep, on_output=on_output)
            else:
                out[machine] = leasetrace.check_lines(lines[machine], keep=keep,
                                                      on_output=on_output)
        except TraceError as e:
            out[machine] = e
    return out


def check_run(header: dict, steps: list[tuple[int, dict]], *, keep: Optional[Path] = None,
              on_output: Optional[Callable[[str], None]] = None,
              end: Optional[dict] = None) -> Verdict:
    """Have TLC check one publish run (:func:`publish_run`) against
    ``spec/Publish.tla``; with ``end``, a window of a longer run that must
    end in that state (:mod:`kvproto.checking.windows`)."""
    model = to_model(header, steps, end=end)
    result = run_module("Publish", "PublishTrace", module(model),
                        cfg_text(model, INVARIANTS + (("WindowEnd",) if end is not None else ()),
                                 OVERRIDES),
                        keep=keep, on_output=on_output)
    n = len(steps)
    common = dict(steps=n, distinct_states=result.distinct_states, seconds=result.seconds)
    if result.verdict == "ok":
        return Verdict(True, message=f"all {n} steps are steps of spec/Publish.tla", **common)
    if result.verdict == "deadlock" and result.trace:
        i = result.trace[-1].state["pos"]
        recorded, line = model.numbers[i - 1]
        step = steps[i - 1][1]
        return Verdict(False, failed_step=recorded, line=line, **common,
                       message=f"step {recorded} (line {line}) is not a step of spec/Publish.tla "
                               f"from the state the steps before it reached: {describe(step)}")
    if result.verdict == "safety":
        where = "the directory the run opened with is a state" if len(result.trace or ()) == 1 \
            else "the trace reached a state"
        return Verdict(False, **common, message=f"invariant {result.violated} is violated "
                                                 f"({where} the spec forbids)")
    raise failure(result)


def check_windows(header: dict, steps: list[tuple[int, dict]], *, size: int = windows.SIZE,
                  max_windows: Optional[int] = None, keep: Optional[Path] = None,
                  on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """:func:`check_run` of a run of any length: in windows of at most
    ``size`` steps chained state to state (:mod:`kvproto.checking.windows`),
    at most ``max_windows`` of them."""
    return windows.check(
        header, steps, spec="Publish", fits=to_model, boundary=boundary, size=size,
        max_windows=max_windows, keep=keep,
        run=lambda start, part, end, keep: check_run(start, part, end=end, keep=keep,
                                                     on_output=on_output))


def describe(step: dict) -> str:
    """A recorded step in one line: ``PutEnd(key='k', token=3) -> Published``."""
    ev = step["event"]
    args = ", ".join(f"{k}={v!r}" for k, v in ev.items() if k != "type")
    out = outcome(step["effects"])
    return f"{ev['type']}({args}) -> {out}"


# --- command line ----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser):
    """The ``trace`` command's arguments; returns its subparsers (for ``merge``)."""
    parser.description = (
        "Check a trace recorded by 'kvproto master --trace FILE' (or KVPROTO_TRACE=FILE): "
        "TLC walks the recorded steps of each of the master's machines in the file (publish, "
        "lease) and reports whether each is a step of its spec (spec/Publish.tla, "
        "spec/Lease.tla), or the first that is not. A long run is checked whole, in windows "
        "of 1,000 steps, each its own TLC run from the state the one before ended in.")
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    check_parser = sub.add_parser("check", help="check one recorded run with TLC",
                                  description="check one recorded run with TLC")
    check_parser.add_argument("file", type=Path, help="the trace file (JSON lines)")
    check_parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                              help="write the generated PublishTrace and LeaseTrace modules "
                                   "and cfgs to DIR "
                                   "(default: a temporary directory)")
    return sub


def main(args: argparse.Namespace) -> int:
    try:
        verdicts = check_each(args.file, keep=args.keep)
    except (TraceError, FileNotFoundError) as e:
        print(f"kvproto trace: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    status = 0
    for machine, verdict in verdicts.items():
        if isinstance(verdict, TraceError):
            print(f"kvproto trace: {machine}: {' '.join(str(verdict).split())}", file=sys.stderr)
            status = status or 2
            continue
        states = "?" if verdict.distinct_states is None else f"{verdict.distinct_states:,}"
        print(f"{args.file}: {machine}: {verdict.message} ({states} distinct states, "
              f"{verdict.seconds:.1f}s)")
        if not verdict.ok:
            status = 1
    return status
