r"""Runtime traces checked by TLC: is what the master's lease table did a behaviour of ``spec/Lease.tla``?

A master recording a trace (:mod:`kvproto.runtime.tracing`) writes every step
of its lease table: the ``Tick`` of its clock before each event, ``Put`` of a
published object, ``Grant``, ``Renew`` and ``Release`` of read leases,
``Remove`` and ``Evict`` of objects, with the effects the table returned.
:func:`check_lines` turns one recorded run into a module ``LeaseTrace`` that
extends ``Lease`` and holds the run as a constant sequence of records; TLC
walks it, and at step ``i`` the trace's ``Next`` takes the spec's action that
record ``i`` names, with the recorded arguments, and requires the recorded
effects to be the spec step's:

* ``Tick(t)``: the spec's ``Tick``, and the leases it ended are exactly those
  whose expiry ``t`` reached;
* ``Put``: the spec's ``Put`` of the key into a free slot (its region);
* ``Grant``: a lease on a cached object, in the slot the object is in,
  expiring at ``now + TTL``; a miss is the spec's ``Grant`` that ends the read;
* ``Renew``: only an unexpired lease, extended to ``now + TTL``;
* ``Release`` by the lease's reader: the spec's ``Release``;
* ``Remove``, ``Evict``: only an object no unexpired lease protects, freeing
  the object's own slot (``Evict`` with the spec's memory pressure taken as
  given: the runtime's watermark counts bytes, not the spec's slots);
* a refused event changes nothing, and the spec must not have allowed it.

The readers' own steps never reach the master: before a recorded ``Grant``
the trace lets its reader send the request (``Request``), before a ``Renew``
let the reply reach it (``Reply``), before its ``Release`` let its transfer
complete (``Complete``, the outcome unseen). A ``Release`` the master feeds
itself (``"by"`` in the record) is no reader's: while it ends an unexpired
lease of an object removed or evicted it matches no step (the spec's
``Remove`` and ``Evict`` need the object unleased), and refused it changes
nothing. Where the master ends a lease on its own for a reason the spec does
not model (an operator's forced remove, an object lost with its segment),
the run leaves the spec's world: the steps before it are checked, and the
verdict says where checking stopped.

Mapping onto model values: keys, regions (slots) and holders (readers, one a
lease) are numbered by first appearance; a reader is used again once its
holder's read is over at the master (its own release, or a miss), and a slot
once its object was reclaimed and no read in progress was granted it, so a
long run needs only as many readers and slots as are in use at once.

Times: the spec's clock counts ticks; the run's clock is the master's
(seconds). Every time the run compares (each
``Tick``, each expiry a ``Grant`` or ``Renew`` set, the time the table opened
with) is mapped to a whole number of ticks, keeping their order and
distinctness, the table's start at 0, and every expiry exactly ``TTL`` ticks
after the grant or renewal that set it (:func:`abstract_times`); so every
comparison the runtime made (``expires <= now``, ``expires > now``) has the
same outcome in the spec. An expiry the runtime recorded that is not its
``now + ttl`` keeps its order among the others but not that distance, and
fails at its step.

One run per file. A master that took over opens its table with the objects it
recovered, all inherited, and lists them: the trace then starts with the
spec's ``Put`` of each at tick 0 and its ``Takeover``, after which they count
as leased until one ``TTL`` later (the time map links the table's opening
time to that time plus the lease TTL). The runtime keeps them leased longer (a
margin for the clocks' rates), so a remove it allowed after its own quiet
period is after the spec's too. A ``Disown`` that ends an inherited object's
quiet period early (an operator's forced remove, its segment lost) leaves
the spec's world, like a forced release (:func:`first_outside`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import attrs

from kvproto.checking import windows
from kvproto.checking.tla import Fn, ModelValue, format_value
from kvproto.checking.tracerun import (Numbered, TraceError, Verdict, accepted, cfg_text,
                                       failure, module_text, outcome, run_module)

NONE = ModelValue("None")

#: the largest run checked (TLC re-evaluates the invariants over all readers,
#: keys and slots in every state); readers and slots count those in use at once
LIMITS = {"steps": 3000, "keys": 64, "slots": 128, "readers": 256}

INVARIANTS = ("TypeOK", "NoReclaimUnderLease", "NoConsumeOfReclaimedBytes",
              "ReleaseIsNotDelete", "LeasesHeldByReads")


# --- reading ---------------------------------------------------------------------


def lease_run(lines: list[tuple[int, dict]]) -> tuple[dict, list[tuple[int, dict]]]:
    """The one run in the lease ``lines``: its ``opened`` header and its steps."""
    opened = [i for i, (_, obj) in enumerate(lines) if "opened" in obj]
    if not opened or opened[0] != 0:
        raise TraceError("the lease steps do not start where a master opened its lease "
                         "table (no lease 'opened' line first)")
    if len(opened) > 1:
        raise TraceError(f"the trace holds {len(opened)} lease tables (a master restarted or "
                         "took over on the same file); record one run per file")
    header = lines[0][1]["opened"]
    if not isinstance(header.get("ttl"), (int, float)) or header["ttl"] <= 0 \
            or not isinstance(header.get("now"), (int, float)):
        raise TraceError(f"line {lines[0][0]}: the lease header needs a positive 'ttl' and 'now'")
    listed = header.get("inherited", [])
    if header.get("objects") and (not isinstance(listed, list) or len(listed) != header["objects"]
                                  or not isinstance(header.get("quiet_until"), (int, float))):
        raise TraceError(f"the lease table opened with {header['objects']} recovered "
                         f"object(s) and lists {len(listed) if isinstance(listed, list) else 0} "
                         "(a takeover's table is checked only when it lists them all, with its "
                         "quiet period)")
    steps = lines[1:]
    for number, obj in steps:
        if not isinstance(obj.get("event"), dict) or not isinstance(obj.get("effects"), list):
            raise TraceError(f"line {number}: a lease step needs 'event' and 'effects'")
    return header, steps


def first_outside(header: dict, steps: list[tuple[int, dict]]) -> Optional[tuple[int, str]]:
    """The index of the first step that leaves the world ``spec/Lease.tla``
    models, and why (:func:`outside`), or None. After a takeover, that is also
    a ``Disown`` that ends an inherited object's quiet period early (an
    operator's forced remove of it, or its segment lost): the spec keeps it
    leased until one TTL after the takeover."""
    quiet = set(_key(k) for k, _ in header.get("inherited", ()))
    now, until = header["now"], header.get("quiet_until", 0)
    for i, (_, step) in enumerate(steps):
        ev = step["event"]
        if ev["type"] == "Tick" and accepted(step):
            now = ev["now"]
        elif ev["type"] == "Disown" and accepted(step) and _key(ev["key"]) in quiet \
                and now < until:
            return i, ("an inherited object stopped counting as leased before one TTL after "
                       "the takeover (an operator's forced remove, or its segment lost)")
        for e in step["effects"] if accepted(step) else ():
            if e["type"] == "Reclaimed":
                quiet.discard(_key(e["key"]))
        why = outside(step)
        if why is not None:
            return i, why
    return None


def outside(step: dict) -> Optional[str]:
    """Why ``step`` leaves the world ``spec/Lease.tla`` models, or None: the
    master ended an unexpired lease on its own for a reason the spec does not
    model (an operator's forced remove, or its object lost with its segment)."""
    if step["event"].get("type") != "Release" or not accepted(step):
        return None
    by, during = step.get("by"), step.get("during") or {}
    if by == "forced":
        return "an operator's forced remove ended an unexpired lease"
    if by == "dropped" and during.get("type") == "SegmentLost":
        return (f"an unexpired lease ended with its object, lost with its segment "
                f"(publish step {during.get('n')})")
    return None


# --- time ------------------------------------------------------------------------


def _solve(n: int, into: list, links: list, ttl: int, passes: int) -> Optional[list[int]]:
    """The least ``f`` over ranks ``0..n-1`` with ``f[k+1] >= f[k] + 1`` and
    ``f[j] = f[i] + ttl`` per link ``(i, j)``, or None if ``passes`` sweeps do
    not settle it (Bellman-Ford on the longest-path form)."""
    f = list(range(n))
    back = sorted(links, key=lambda l: -l[1])
    for _ in range(passes):
        changed = False
        for k in range(1, n):
            best = f[k - 1] + 1
            for i in into[k]:
                best = max(best, f[i] + ttl)
            if best > f[k]:
                f[k], changed = best, True
        for i, j in back:
            if f[j] - ttl > f[i]:
                f[i], changed = f[j] - ttl, True
        if not changed:
            return f
    return None


def abstract_times(start: float, points: list[float],
                   links: list[tuple[float, float]]) -> tuple[int, dict[float, int]]:
    """Map the run's times onto the spec's ticks: ``(TTL, {time: tick})``.

    ``start`` (the table's clock when it opened) maps to 0 (a time before it,
    as a ``Tick`` refused for going back may carry, below 0); distinct times map
    to distinct ticks in the same order; each ``(granted, expires)`` link to
    ticks exactly TTL apart. Such a map exists whenever TTL exceeds the number
    of distinct times (a cycle of the constraints that gains must cross a link
    backwards, losing TTL); a smaller TTL is tried first (the largest number of
    times a link spans, then doubling), so that ticks read small."""
    values = sorted({start, *points, *(t for link in links for t in link)})
    rank = {v: i for i, v in enumerate(values)}
    pairs = sorted({(rank[a], rank[b]) for a, b in links})
    into: list[list[int]] = [[] for _ in values]
    for i, j in pairs:
        into[j].append(i)
    n = len(values)
    ttl = max([j - i for i, j in pairs] + [1])
    while True:
        last = ttl >= n
        ttl = min(ttl, n)
        f = _solve(n, into, pairs, ttl, n + 1 if last else 32)
        if f is not None:
            break
        if last:
            raise TraceError("the run's times cannot be mapped onto whole ticks "
                             "(an expiry closer to a grant than another's)")
        ttl *= 2
    base = f[rank[start]]     # a refused Tick's time may lie before it: below 0
    return ttl, {v: f[i] - base for i, v in enumerate(values)}


# --- mapping onto model values ---------------------------------------------------


def _key(k):
    return tuple(k) if isinstance(k, list) else k


def _holder(h) -> tuple:
    return tuple(h) if isinstance(h, list) else (h,)


def _region(r) -> tuple:
    return tuple(r) if isinstance(r, list) else (r,)


@attrs.frozen
class TraceModel:
    """A lease run mapped onto the spec: its constants and one record per step."""

    constants: dict
    records: tuple
    model_values: tuple
    numbers: tuple      # (recorded n, file line) per record
    ticks: dict         # the run's time -> the spec's tick
    stopped: Optional[tuple] = None   # (recorded n, line, why) of the first step not checked
    taken: int = 0      # records before the recorded steps: a takeover's Puts and Takeover
    cached: Fn = Fn.of({})          # a window's objects at its start: key -> slot
    end: Optional[Fn] = None        # the objects a window must end with (``End``), or None


def _times(header: dict, steps: list[tuple[int, dict]]) -> tuple[int, dict]:
    """The run's times and expiry links (:func:`abstract_times`)."""
    ttl, now = header["ttl"], header["now"]
    points, links = [], []
    if header.get("inherited"):
        links.append((now, now + ttl))          # the spec's quietUntil: one TTL after takeover
    for _, step in steps:
        ev = step["event"]
        if ev["type"] == "Tick":
            points.append(ev["now"])
            if accepted(step):
                now = ev["now"]
        elif ev["type"] in ("Grant", "Renew") and accepted(step):
            links.append((now, now + ttl))
            points.append(step["effects"][0]["expires"])
    return abstract_times(header["now"], points, links)


def to_model(header: dict, steps: list[tuple[int, dict]], end: Optional[dict] = None
             ) -> TraceModel:
    """Map a lease run onto model values (see the module docstring); raise
    :class:`TraceError` for a run outside :data:`LIMITS` or the spec's shape.
    A window of a longer run (:func:`boundary`) starts with the objects its
    header lists ``cached``, and ``end`` is the next window's header: the
    state it must end in."""
    stopped = None
    try:
        cut = first_outside(header, steps)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"a lease step the checker cannot read ({e!r})") from None
    if cut is not None:
        number, step = steps[cut[0]]
        stopped, steps = (step.get("n"), number, cut[1]), steps[:cut[0]]
    if len(steps) > LIMITS["steps"]:
        raise TraceError(f"the run has {len(steps)} lease steps; at most {LIMITS['steps']} are "
                         "checked (record a shorter run)")
    try:
        ttl, ticks = _times(header, steps)
    except (KeyError, TypeError, AttributeError) as e:
        raise TraceError(f"a lease step the checker cannot read ({e!r})") from None
    m = _Mapping(ticks)
    try:
        cached = Fn.of({m.keys(k): m.slots(_region(r)) for k, r in header.get("cached", ())})
        m.cached |= {_region(r) for _, r in header.get("cached", ())}
    except (TypeError, ValueError) as e:
        raise TraceError(f"the cached objects the checker cannot read ({e!r})") from None
    # a takeover: the spec's Put of each recovered object, then its Takeover
    taken = [{"event": {"type": "Put", "key": k, "region": r},
              "effects": [{"type": "Cached", "key": k, "region": r}]}
             for k, r in header.get("inherited", ())]
    if taken:
        taken.append({"event": {"type": "Takeover"}, "effects": []})
    try:
        records = [m.record(step) for step in taken]
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise TraceError(f"the recovered objects the checker cannot read ({e!r})") from None
    for number, step in steps:
        try:
            records.append(m.record(step))
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise TraceError(f"line {number}: a lease step the checker cannot read "
                             f"({e!r})") from None
    try:
        closing = None if end is None else \
            Fn.of({m.keys(k): m.slots.active[_region(r)] for k, r in end["cached"]})
    except (KeyError, TypeError) as e:
        raise TraceError(f"a window end the checker cannot map ({e!r})") from None
    keys, slots, readers = m.keys, m.slots, m.readers
    sizes = {"keys": len(keys.values()), "slots": len(slots.values()),
             "readers": len(readers.values())}
    for name, size in sizes.items():
        if size > LIMITS[name]:
            raise TraceError(f"the run has {size} lease {name}; at most {LIMITS[name]} are "
                             "checked (record a run with fewer)")
    key_values = keys.values() or [ModelValue("key1")]
    slot_values = slots.values() or [ModelValue("slot1")]
    reader_values = readers.values() or [ModelValue("rd1")]
    constants = {"Keys": frozenset(key_values), "Slots": frozenset(slot_values),
                 "Readers": frozenset(reader_values), "TTL": ttl, "MaxSkew": 0,
                 "MaxTime": max(ticks.values()), "MaxTakeovers": 1 if taken else 0,
                 "None": NONE}
    values = tuple(dict.fromkeys([*key_values, *slot_values, *reader_values]))
    return TraceModel(constants, tuple(records), values,
                      tuple((s.get("n"), n) for n, s in steps), ticks, stopped, len(taken),
                      cached, closing)


class _Pool:
    """Runtime names -> model values ``prefix1, prefix2, ...``, one runtime name
    at a time: a value given back (:meth:`give_back`) stands for the next new
    name. Holders and regions are used once each in the runtime; the spec's
    readers and slots are used again and again, so a long run needs only as
    many as are in use at once."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.active: dict = {}
        self.free: list[ModelValue] = []
        self.count = 0

    def __call__(self, name) -> ModelValue:
        value = self.active.get(name)
        if value is None:
            if self.free:
                value = self.free.pop()
            else:
                self.count += 1
                value = ModelValue(f"{self.prefix}{self.count}")
            self.active[name] = value
        return value

    def give_back(self, name) -> None:
        value = self.active.pop(name, None)
        if value is not None:
            self.free.append(value)

    def values(self) -> list[ModelValue]:
        return [ModelValue(f"{self.prefix}{i}") for i in range(1, self.count + 1)]


class _Mapping:
    """The run's keys, regions, holders and times as the spec's model values.

    A holder's reader is given back once its read is over at the master (its
    own ``Release``, accepted or refused, or a ``Grant`` that missed): the
    spec's reader is then idle with no lease. A region's slot is given back
    once its object was reclaimed and no read in progress was granted it, so
    a reused slot carries nothing of its last object."""

    def __init__(self, ticks: dict) -> None:
        self.ticks = ticks
        self.keys = Numbered("key")
        self.slots = _Pool("slot")
        self.readers = _Pool("rd")
        self.cached: set = set()          # regions holding an object
        self.reading: dict = {}           # region -> {holder: None}, reads granted it
        self.granted: dict = {}           # holder -> region

    def _end_read(self, holder) -> None:
        self.readers.give_back(holder)
        region = self.granted.pop(holder, None)
        if region is not None:
            users = self.reading[region]
            del users[holder]
            if not users:
                del self.reading[region]
                if region not in self.cached:
                    self.slots.give_back(region)

    def record(self, step: dict) -> Fn:
        """One step as the trace module's record (every record has every field)."""
        ev, effects = step["event"], step["effects"]
        ok = accepted(step)
        act, by = ev["type"], step.get("by") or ""
        fields = {"act": act, "ok": ok, "err": "" if ok else effects[0]["error"]["type"],
                  "by": by, "k": NONE, "h": NONE, "s": NONE, "t": 0, "exp": 0,
                  "ended": frozenset()}
        holder = _holder(ev["holder"]) if "holder" in ev else None
        if "key" in ev:
            fields["k"] = self.keys(ev["key"])
        if holder is not None:
            fields["h"] = self.readers(holder)
        if "region" in ev:
            fields["s"] = self.slots(_region(ev["region"]))
        if act == "Tick":
            fields["t"] = self.ticks[ev["now"]]
        for e in effects if ok else ():
            kind = e["type"]
            if kind in ("LeaseGranted", "LeaseRenewed", "LeaseReleased", "Reclaimed", "Cached"):
                fields["k"] = self.keys(e["key"])
            if kind in ("LeaseGranted", "Reclaimed", "Cached"):
                fields["s"] = self.slots(_region(e["region"]))
            if kind in ("LeaseGranted", "LeaseRenewed"):
                fields["exp"] = self.ticks[e["expires"]]
            elif kind == "LeaseEnded":
                fields["ended"] |= {self.readers(_holder(e["holder"]))}
                self.keys(e["key"])
        record = Fn.of(fields)
        # what the step changed in the use of model values, for the next steps
        for e in effects if ok else ():
            region = _region(e["region"]) if "region" in e else None
            if e["type"] == "Cached":
                self.cached.add(region)
            elif e["type"] == "LeaseGranted":
                self.reading.setdefault(region, {})[holder] = None
                self.granted[holder] = region
            elif e["type"] == "Reclaimed":
                self.cached.discard(region)
                if region not in self.reading:
                    self.slots.give_back(region)
        if holder is not None and not by and (
                act == "Release" or (act == "Grant" and fields["err"] == "KeyNotFound")):
            self._end_read(holder)
        return record


# --- the trace module ------------------------------------------------------------

_MODULE = r"""----------------------------- MODULE LeaseTrace -----------------------------
(* A recorded run of the master's lease table (kvproto trace check): each   *)
(* step must be the spec's action the record names, with its effects.       *)
EXTENDS Lease, Sequences, TLC

CONSTANTS %(values)s

VARIABLE pos   \* the next record to match

Trace == %(trace)s

R == Trace[pos]

\* Memory pressure is the runtime's watermark over bytes, not a count of the
\* spec's slots: the trace takes an Evict's pressure as given.
TracePressure == TRUE

\* The recorded holder's read is of the recorded key.
ReadOf(r) == reader[r.h] # None /\ reader[r.h].key = r.k

\* The spec's step for an accepted event, with the recorded effects.
Accepted(r) ==
    \/ /\ r.act = "Tick" /\ Tick(r.t)
       /\ {h \in Readers : lease[h] # None /\ lease[h].exp <= r.t} = r.ended
    \/ r.act = "Put" /\ Put(r.k, r.s)
    \/ /\ r.act = "Grant" /\ ReadOf(r) /\ Present(r.k) /\ dir[r.k] = r.s
       /\ r.exp = now + TTL /\ Grant(r.h)
    \/ /\ r.act = "Renew" /\ lease[r.h] # None /\ lease[r.h].key = r.k
       /\ r.exp = now + TTL /\ Renew(r.h)
    \/ /\ r.act = "Release" /\ r.by = "" /\ lease[r.h] # None /\ lease[r.h].key = r.k
       /\ Release(r.h)
    \/ r.act = "Remove" /\ Present(r.k) /\ dir[r.k] = r.s /\ Remove(r.k)
    \/ r.act = "Evict" /\ Present(r.k) /\ dir[r.k] = r.s /\ Evict(r.k)
    \/ /\ r.act = "Disown" /\ Present(r.k) /\ ~(r.k \in inherited /\ now < quietUntil)
       /\ UNCHANGED vars
    \/ r.act = "Takeover" /\ Takeover

\* A refused event: the spec's miss ends the read; a reader's release of a
\* lease that already ended ends its read; anything else changes nothing, and
\* the spec would not have taken it.
Refused(r) ==
    \/ /\ r.act = "Grant" /\ r.err = "KeyNotFound" /\ ReadOf(r) /\ ~Present(r.k)
       /\ Grant(r.h)
    \/ /\ r.act = "Release" /\ r.by = "" /\ lease[r.h] = None /\ reader[r.h] # None
       /\ Release(r.h)
    \/ /\ UNCHANGED vars
       /\ \/ r.act = "Tick" /\ r.t <= now
          \/ r.act = "Put" /\ r.err = "KeyExists" /\ Present(r.k)
          \/ r.act = "Put" /\ r.err = "NoSpace" /\ r.s \notin FreeSlots
          \/ r.act = "Put" /\ r.err = "InvalidArgument"
          \/ r.act = "Grant" /\ r.err = "LeaseHeld" /\ lease[r.h] # None
          \/ r.act = "Renew" /\ ~Unexpired(r.h)
          \/ r.act = "Release" /\ lease[r.h] = None /\ (r.by # "" \/ reader[r.h] = None)
          \/ r.act \in {"Remove", "Evict", "Disown"} /\ r.err = "KeyNotFound" /\ ~Present(r.k)
          \/ r.act \in {"Remove", "Evict"} /\ r.err = "ObjectLeased" /\ Leased(r.k)

Step ==
    /\ pos <= Len(Trace)
    /\ IF R.ok THEN Accepted(R) ELSE Refused(R)
    /\ pos' = pos + 1

\* The reader of the next record takes its own steps first (unseen by the
\* master): it sends its request before its Grant, the grant's reply reaches
\* it before it renews, and its transfer completes before it releases.
ReaderSteps ==
    /\ pos <= Len(Trace) /\ R.by = "" /\ R.h # None
    /\ \/ R.act = "Grant" /\ Request(R.h, R.k)
       \/ R.act \in {"Renew", "Release"} /\ Reply(R.h)
       \/ R.act = "Release" /\ \E d \in Skews : Complete(R.h, d)
    /\ UNCHANGED pos

Done == pos > Len(Trace) /\ UNCHANGED <<vars, pos>>

\* Where the run starts: the spec's Init, with the objects Cached holds (a
\* window of a longer run starts where the window before it ended, at a
\* point where no read was in progress and no inherited lease left).
Cached == %(cached)s
TraceInit ==
    /\ now = 0
    /\ dir = [k \in Keys |-> IF k \in DOMAIN Cached THEN Cached[k] ELSE None]
    /\ lease = [r \in Readers |-> None]
    /\ reader = [r \in Readers |-> None]
    /\ dropped = Keys \ DOMAIN Cached
    /\ inherited = {}
    /\ quietUntil = 0
    /\ takeovers = 0
    /\ pos = 1

\* A window ends where the next one starts: the objects End holds cached in
\* their slots, no lease, no reader, no inherited object leased any more;
\* the clock apart (the next window's starts at 0: from such a state only
\* times after it are compared).
End == %(end)s
WindowEnd ==
    pos > Len(Trace) =>
        /\ dir = [k \in Keys |-> IF k \in DOMAIN End THEN End[k] ELSE None]
        /\ dropped = Keys \ DOMAIN End
        /\ lease = [r \in Readers |-> None]
        /\ reader = [r \in Readers |-> None]
        /\ now >= quietUntil

TraceNext == Step \/ ReaderSteps \/ Done
=============================================================================
"""


# --- checking --------------------------------------------------------------------


def check_lines(lines: list[tuple[int, dict]], *, keep: Optional[Path] = None,
                on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """Have TLC check the lease run in ``lines`` (a trace file's lease lines,
    with their line numbers) against ``spec/Lease.tla``, the whole run, in
    windows (:func:`check_windows`)."""
    header, steps = lease_run(lines)
    return check_windows(header, steps, keep=keep, on_output=on_output)


def check_run(header: dict, steps: list[tuple[int, dict]], *, keep: Optional[Path] = None,
              on_output: Optional[Callable[[str], None]] = None,
              end: Optional[dict] = None) -> Verdict:
    """Have TLC check one lease run (:func:`lease_run`) against
    ``spec/Lease.tla``; with ``end``, a window of a longer run that must end
    in that state (:func:`check_windows`)."""
    model = to_model(header, steps, end=end)
    text = module_text(_MODULE, model, cached=format_value(model.cached),
                       end=format_value(model.end if model.end is not None else model.cached))
    result = run_module("Lease", "LeaseTrace", text,
                        cfg_text(model, INVARIANTS + (("WindowEnd",) if end is not None else ()),
                                 ("Pressure <- TracePressure",)),
                        keep=keep, on_output=on_output)
    n = len(model.records) - model.taken
    common = dict(steps=n, distinct_states=result.distinct_states, seconds=result.seconds,
                  machine="lease")
    if result.verdict == "ok":
        message = f"all {n} steps are steps of spec/Lease.tla"
        if model.stopped is not None:
            recorded, line, why = model.stopped
            message = (f"the {n} steps before step {recorded} are steps of spec/Lease.tla; "
                       f"step {recorded} (line {line}) and after are not checked: {why}")
            return Verdict(True, message=message, stopped=why, **common)
        return Verdict(True, message=message, **common)
    if result.verdict == "deadlock" and result.trace:
        i = result.trace[-1].state["pos"] - model.taken
        if i < 1:
            raise TraceError("the recovered objects the lease table opened with are not a "
                             "state the spec reaches by Put and Takeover")
        recorded, line = model.numbers[i - 1]
        step = steps[i - 1][1]
        return Verdict(False, failed_step=recorded, line=line, **common,
                       message=f"step {recorded} (line {line}) is not a step of spec/Lease.tla "
                               f"from the state the steps before it reached: "
                               f"{describe(step)}")
    if result.verdict == "safety":
        return Verdict(False, **common, message=f"invariant {result.violated} is violated "
                                                 "(the trace reached a state the spec forbids)")
    raise failure(result)


def _reads_over(step: dict) -> bool:
    """Whether ``step`` ends its holder's read at the master (its own
    release, or a grant that missed), as :class:`_Mapping` gives its reader back."""
    act = step["event"]["type"]
    return not step.get("by") and (act == "Release" or (
        act == "Grant" and not accepted(step)
        and step["effects"][0]["error"]["type"] == "KeyNotFound"))


def quiet_cut(header: dict, steps: list[tuple[int, dict]]) -> int:
    """The largest ``k <= len(steps)`` after whose first ``k`` steps the table
    is quiet: no read in progress (so no lease held) and, after a takeover,
    one TTL past it (no inherited object counts as leased); 0 if none is.
    Only there may a window end (:func:`boundary`)."""
    reading: set = set()
    now, until = header["now"], header["now"] + header["ttl"] if header.get("inherited") else 0
    best = 0
    for i, (number, step) in enumerate(steps, 1):
        try:
            ev = step["event"]
            if ev["type"] == "Tick" and accepted(step):
                now = ev["now"]
            if "holder" in ev:
                holder = _holder(ev["holder"])
                reading.add(holder)
                if _reads_over(step):
                    reading.discard(holder)
        except (KeyError, TypeError, IndexError) as e:
            raise TraceError(f"line {number}: a lease step the checker cannot read ({e!r})") \
                from None
        if not reading and now >= until:
            best = i
    return best


def boundary(header: dict, steps: list[tuple[int, dict]]) -> dict:
    """The header of a window that starts after ``steps`` (which end where
    the table is quiet, :func:`quiet_cut`): the table's clock then, its TTL,
    and the objects cached (``[key, region]`` each, as recorded)."""
    cached = {_key(k): (k, r) for k, r in header.get("cached", ())}
    cached.update({_key(k): (k, r) for k, r in header.get("inherited", ())})
    now = header["now"]
    for number, step in steps:
        try:
            if step["event"]["type"] == "Tick" and accepted(step):
                now = step["event"]["now"]
            for e in step["effects"] if accepted(step) else ():
                if e["type"] == "Cached":
                    cached[_key(e["key"])] = (e["key"], e["region"])
                elif e["type"] == "Reclaimed":
                    cached.pop(_key(e["key"]), None)
        except (KeyError, TypeError) as e:
            raise TraceError(f"line {number}: a lease step the checker cannot read ({e!r})") \
                from None
    return {"ttl": header["ttl"], "now": now, "quiet_until": 0, "objects": 0,
            "cached": [list(kr) for kr in cached.values()]}


def check_windows(header: dict, steps: list[tuple[int, dict]], *, size: int = windows.SIZE,
                  max_windows: Optional[int] = None, keep: Optional[Path] = None,
                  on_output: Optional[Callable[[str], None]] = None) -> Verdict:
    """:func:`check_run` of a lease run of any length, in windows of at most
    ``size`` steps chained state to state (:mod:`kvproto.checking.windows`),
    each ending where the table is quiet (:func:`quiet_cut`): there the
    spec's state is the objects cached and the clock, which the next window
    starts from (its clock at 0)."""
    return windows.check(
        header, steps, spec="Lease", fits=to_model, boundary=boundary, cut=quiet_cut,
        size=size, max_windows=max_windows, keep=keep, machine="lease",
        run=lambda start, part, end, keep: check_run(start, part, end=end, keep=keep,
                                                     on_output=on_output))


def describe(step: dict) -> str:
    """A recorded lease step in one line: ``Release(holder=['c', 5]) by dropped
    during publish step 9 (Remove) -> LeaseReleased``."""
    ev = step["event"]
    args = ", ".join(f"{k}={v!r}" for k, v in ev.items() if k != "type")
    text = f"{ev['type']}({args})"
    if step.get("by"):
        during = step.get("during") or {}
        text += f" by the master ({step['by']}" + (
            f" during publish step {during.get('n')}, {during.get('type')})" if during else ")")
    out = outcome(step["effects"])
    return f"{text} -> {out}"
