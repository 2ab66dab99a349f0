"""Replica repair (``spec/Repair.tla``) as a pure, sans-IO machine.

After a segment is lost, the master re-replicates every object left below the
replica count its put requested. It keeps a :class:`RepairTable`, stepped by
:func:`step`:

* ``StartRepair`` — spec ``RepairStart``: accepted only for an object below
  its requested count (listed replicas plus repairs in flight), from a
  listed replica, into a live segment holding none of the object, while
  fewer than ``max_repairs`` copies are in flight (the rate limit). Effect:
  :class:`CopyOrdered`, the order to the destination's storage node to
  allocate a region and copy the object into it;
* ``RepairCopied`` — spec ``ListReplica``: the destination reported the copy
  complete; only now is the new replica listed (:class:`ReplicaListed`);
* ``LoseSegment`` — spec ``SegmentLost``: its replicas are unlisted and its
  readers fail; every repair reading from it or writing into it is
  cancelled (:class:`RepairCancelled`: free the destination region if its
  segment is alive); an object with no replica left is gone;
* ``BeginRead`` / ``EndRead`` — spec ``ReadBegin`` / ``ReadEnd``: a reader is
  handed a listed replica only (:class:`ReadGranted`);
* ``RemoveObject`` — spec ``Remove``: refused while the object is read;
  its repairs are cancelled.

:func:`plan_repairs` picks, for the runtime, the repairs to start now within
the rate limit. :class:`System` composes the master's table with the storage
nodes' regions, the copiers' progress and the ghost ``bytes`` into the
closed system of the spec for the conformance and stateful tests.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Mapping, Optional, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit
from kvproto.checking.tla import Fn, ModelValue, model_names
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse


@attrs.frozen
class Replicas:
    """What the master keeps of an object for repair: the count its put
    requested and the segments whose replicas readers may be handed."""

    requested: int
    listed: frozenset


@attrs.frozen
class RepairTable:
    """The master's view for repair (spec ``requested``, ``live``, ``listed``,
    the master's part of ``repairs``, and ``reading``)."""

    live: frozenset
    objects: immutables.Map = immutables.Map()    # key -> Replicas
    repairs: immutables.Map = immutables.Map()    # (key, dst) -> src
    reading: immutables.Map = immutables.Map()    # key -> frozenset of segments read
    max_repairs: int = 1

    def in_flight(self, key) -> int:
        return sum(1 for k, _ in self.repairs if k == key)

    def below(self, key) -> bool:
        """Spec ``Below(k)``: fewer replicas, listed or being repaired, than requested."""
        obj = self.objects.get(key)
        return obj is not None and len(obj.listed) + self.in_flight(key) < obj.requested

    def holds(self, key, segment) -> bool:
        """The segment has a region of the object: a listed replica or a repair's."""
        obj = self.objects.get(key)
        return (obj is not None and segment in obj.listed) or (key, segment) in self.repairs


# --------------------------------------------------------------------------
# Events and effects
# --------------------------------------------------------------------------


@attrs.frozen
class StartRepair:
    key: str
    src: str
    dst: str


@attrs.frozen
class RepairCopied:
    key: str
    dst: str


@attrs.frozen
class LoseSegment:
    segment: str


@attrs.frozen
class BeginRead:
    key: str
    segment: str


@attrs.frozen
class EndRead:
    key: str
    segment: str


@attrs.frozen
class RemoveObject:
    key: str


Event = Union[StartRepair, RepairCopied, LoseSegment, BeginRead, EndRead, RemoveObject]


@attrs.frozen
class CopyOrdered:
    """The destination's storage node allocates a region for the object and
    copies it there from the source; it reports back when complete."""

    key: str
    src: str
    dst: str


@attrs.frozen
class ReplicaListed:
    """The repaired replica is complete and listed: readers may be handed it."""

    key: str
    dst: str


@attrs.frozen
class RepairCancelled:
    """The repair stopped; its destination region is freed (``dst_alive``)."""

    key: str
    src: str
    dst: str
    dst_alive: bool


@attrs.frozen
class ReadGranted:
    key: str
    segment: str


@attrs.frozen
class ObjectRemoved:
    """The object's listed replicas are freed."""

    key: str
    segments: frozenset


def _cancel(table: RepairTable, doomed) -> tuple[immutables.Map, tuple]:
    """Drop the repairs ``(key, dst)`` in ``doomed``; the effects that free their regions."""
    repairs, effects = table.repairs, []
    for key, dst in sorted(doomed):
        src = repairs[key, dst]
        repairs = repairs.delete((key, dst))
        effects.append(RepairCancelled(key, src, dst, dst in table.live))
    return repairs, tuple(effects)


def _start(table: RepairTable, ev: StartRepair):
    obj = table.objects.get(ev.key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"no object {ev.key} to repair"))
    if not table.below(ev.key):
        return _refuse(table, errors.InvalidArgument(
            f"object {ev.key} has the {obj.requested} replicas it requested, listed or being repaired"))
    if len(table.repairs) >= table.max_repairs:
        return _refuse(table, errors.InvalidArgument(
            f"{len(table.repairs)} repairs in flight: the repair rate limit is {table.max_repairs}"))
    if ev.src not in obj.listed:
        return _refuse(table, errors.SegmentUnavailable(
            f"segment {ev.src} holds no listed replica of {ev.key} to copy from"))
    if ev.dst not in table.live:
        return _refuse(table, errors.SegmentUnavailable(f"segment {ev.dst} is lost or unknown"))
    if table.holds(ev.key, ev.dst):
        return _refuse(table, errors.InvalidArgument(
            f"segment {ev.dst} already holds a region of {ev.key}"))
    new = attrs.evolve(table, repairs=table.repairs.set((ev.key, ev.dst), ev.src))
    return new, (CopyOrdered(ev.key, ev.src, ev.dst),)


def _copied(table: RepairTable, ev: RepairCopied):
    if (ev.key, ev.dst) not in table.repairs:
        return _refuse(table, errors.StaleToken(
            f"no repair of {ev.key} into {ev.dst} in flight (cancelled, or listed already)"))
    obj = table.objects[ev.key]
    listed = attrs.evolve(obj, listed=obj.listed | {ev.dst})
    new = attrs.evolve(table, objects=table.objects.set(ev.key, listed),
                       repairs=table.repairs.delete((ev.key, ev.dst)))
    return new, (ReplicaListed(ev.key, ev.dst),)


def _lose(table: RepairTable, ev: LoseSegment):
    s = ev.segment
    if s not in table.live:
        return _refuse(table, errors.SegmentUnavailable(f"segment {s} is lost or unknown"))
    doomed = [(k, dst) for (k, dst), src in table.repairs.items() if s in (src, dst)]
    live = table.live - {s}
    repairs, effects = _cancel(attrs.evolve(table, live=live), doomed)
    objects = table.objects
    for key, obj in table.objects.items():
        if s in obj.listed:
            rest = obj.listed - {s}
            objects = objects.set(key, attrs.evolve(obj, listed=rest)) if rest else objects.delete(key)
    reading = table.reading
    for key, segments in table.reading.items():
        if s in segments:
            reading = reading.set(key, segments - {s}) if segments - {s} else reading.delete(key)
    new = attrs.evolve(table, live=live, objects=objects, repairs=repairs, reading=reading)
    return new, effects


def _begin_read(table: RepairTable, ev: BeginRead):
    obj = table.objects.get(ev.key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"no object {ev.key}"))
    if ev.segment not in obj.listed:
        return _refuse(table, errors.SegmentUnavailable(
            f"segment {ev.segment} holds no listed replica of {ev.key}"))
    read = table.reading.get(ev.key, frozenset())
    if ev.segment in read:
        return _refuse(table, errors.ObjectBusy(f"the replica of {ev.key} on {ev.segment} is being read"))
    new = attrs.evolve(table, reading=table.reading.set(ev.key, read | {ev.segment}))
    return new, (ReadGranted(ev.key, ev.segment),)


def _end_read(table: RepairTable, ev: EndRead):
    read = table.reading.get(ev.key, frozenset())
    if ev.segment not in read:
        return _refuse(table, errors.InvalidArgument(f"no read of {ev.key} on {ev.segment}"))
    rest = read - {ev.segment}
    reading = table.reading.set(ev.key, rest) if rest else table.reading.delete(ev.key)
    return attrs.evolve(table, reading=reading), ()


def _remove(table: RepairTable, ev: RemoveObject):
    obj = table.objects.get(ev.key)
    if obj is None:
        return _refuse(table, errors.KeyNotFound(f"no object {ev.key}"))
    if ev.key in table.reading:
        return _refuse(table, errors.ObjectBusy(f"object {ev.key} is being read"))
    repairs, cancelled = _cancel(table, [r for r in table.repairs if r[0] == ev.key])
    new = attrs.evolve(table, objects=table.objects.delete(ev.key), repairs=repairs)
    return new, cancelled + (ObjectRemoved(ev.key, obj.listed),)


_HANDLERS = {StartRepair: _start, RepairCopied: _copied, LoseSegment: _lose,
             BeginRead: _begin_read, EndRead: _end_read, RemoveObject: _remove}


def step(table: RepairTable, event: Event) -> tuple[RepairTable, tuple]:
    """Apply one event to the master's repair table."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"not a repair event: {event!r}")
    return handler(table, event)


def plan_repairs(table: RepairTable) -> list[StartRepair]:
    """The repairs to start now, within the rate limit: for each object below
    its requested count (in key order), from its first listed replica into the
    first live segment holding none of it. Feeding them to :func:`step` in
    order accepts every one."""
    planned, slots, taken = [], table.max_repairs - len(table.repairs), set()
    for key in sorted(table.objects):
        obj = table.objects[key]
        missing = obj.requested - len(obj.listed) - table.in_flight(key)
        src = min(obj.listed)
        for dst in sorted(table.live):
            if slots <= 0 or missing <= 0:
                break
            if not table.holds(key, dst) and (key, dst) not in taken:
                planned.append(StartRepair(key, src, dst))
                taken.add((key, dst))
                slots -= 1
                missing -= 1
    return planned


# --------------------------------------------------------------------------
# The closed system of the spec
# --------------------------------------------------------------------------


@attrs.frozen(cache_hash=True)
class System:
    master: RepairTable
    region: immutables.Map     # storage nodes: segment -> frozenset of keys with a region there
    copied: immutables.Map     # copiers: (key, dst) -> chunks copied
    bytes: immutables.Map      # ghost: (segment, key) -> leading chunks of the object there
    requested: immutables.Map  # ghost: key -> requested count (kept after the object is gone)
    chunks: int                # constant: the chunks an object is copied in

    @classmethod
    def initial(cls, placement: Mapping[str, frozenset], requested: Mapping[str, int], segments,
                chunks: int, max_repairs: int) -> "System":
        """Every object published with its requested count of complete replicas."""
        objects = {k: Replicas(requested[k], frozenset(placement[k])) for k in requested}
        region = {s: frozenset(k for k in requested if s in placement[k]) for s in segments}
        bytes_ = {(s, k): chunks for k in requested for s in placement[k]}
        return cls(RepairTable(frozenset(segments), immutables.Map(objects), max_repairs=max_repairs),
                   immutables.Map(region), immutables.Map(), immutables.Map(bytes_),
                   immutables.Map(requested), chunks)

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def node_frees(self, segment, key) -> "System":
        """A storage node frees the object's region; the bytes there go with it."""
        return self._with(region=self.region.set(segment, self.region[segment] - {key}),
                          bytes=self.bytes.delete((segment, key)) if (segment, key) in self.bytes
                          else self.bytes)

    def apply(self, event) -> Optional[tuple["System", tuple]]:
        """The master steps; the storage nodes and copiers follow its effects.
        ``None`` when the master refused."""
        master, effects = step(self.master, event)
        if not _accepted(effects):
            return None
        new = self._with(master=master)
        for ef in effects:
            if isinstance(ef, CopyOrdered):
                new = new._with(region=new.region.set(ef.dst, new.region[ef.dst] | {ef.key}),
                                copied=new.copied.set((ef.key, ef.dst), 0))
            elif isinstance(ef, (RepairCancelled, ReplicaListed)):
                new = new._with(copied=new.copied.delete((ef.key, ef.dst)))
                if isinstance(ef, RepairCancelled) and ef.dst_alive:
                    new = new.node_frees(ef.dst, ef.key)
            elif isinstance(ef, ObjectRemoved):
                for s in ef.segments:
                    new = new.node_frees(s, ef.key)
        return new, effects


def _applied(sys: System, event) -> Optional[System]:
    done = sys.apply(event)
    return None if done is None else done[0]


def sys_repair_start(sys: System, k: str, src: str, dst: str) -> Optional[System]:
    return _applied(sys, StartRepair(k, src, dst))


def sys_copy_chunk(sys: System, k: str, dst: str) -> Optional[System]:
    """Spec ``CopyChunk``: the next chunk lands only if the source holds it."""
    n = sys.copied.get((k, dst))
    if n is None or n >= sys.chunks:
        return None
    src = sys.master.repairs[k, dst]
    have = sys.bytes.get((dst, k), 0)
    if have == n and sys.bytes.get((src, k), 0) > n:
        sys = sys._with(bytes=sys.bytes.set((dst, k), n + 1))
    return sys._with(copied=sys.copied.set((k, dst), n + 1))


def sys_list_replica(sys: System, k: str, dst: str) -> Optional[System]:
    """Spec ``ListReplica``: the copier reports only a complete copy."""
    if sys.copied.get((k, dst)) != sys.chunks:
        return None
    return _applied(sys, RepairCopied(k, dst))


def sys_segment_lost(sys: System, s: str) -> Optional[System]:
    new = _applied(sys, LoseSegment(s))
    if new is None:
        return None
    with new.bytes.mutate() as kept:       # the segment's bytes are gone with it
        for seg, key in new.bytes:
            if seg == s:
                del kept[seg, key]
        return new._with(region=new.region.set(s, frozenset()), bytes=kept.finish())


def sys_read_begin(sys: System, k: str, s: str) -> Optional[System]:
    return _applied(sys, BeginRead(k, s))


def sys_read_end(sys: System, k: str, s: str) -> Optional[System]:
    return _applied(sys, EndRead(k, s))


def sys_remove(sys: System, k: str) -> Optional[System]:
    return _applied(sys, RemoveObject(k))


ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "RepairStart": sys_repair_start,
    "CopyChunk": sys_copy_chunk,
    "ListReplica": sys_list_replica,
    "SegmentLost": sys_segment_lost,
    "ReadBegin": sys_read_begin,
    "ReadEnd": sys_read_end,
    "Remove": sys_remove,
}

# --------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------


def _listed(sys: System, key) -> frozenset:
    obj = sys.master.objects.get(key)
    return frozenset() if obj is None else obj.listed


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``."""
    t = sys.master
    return (t.live <= frozenset(sys.region)
            and all(1 <= n <= len(sys.region) for n in sys.requested.values())
            and all(o.listed <= frozenset(sys.region) for o in t.objects.values())
            and all(0 <= n <= sys.chunks for n in sys.copied.values())
            and all(0 < n <= sys.chunks for n in sys.bytes.values())
            and set(sys.copied) == set(t.repairs))


def listed_replicas_are_complete(sys: System) -> bool:
    """Spec ``ListedReplicasAreComplete``."""
    return all(s in sys.master.live and sys.bytes.get((s, k), 0) == sys.chunks
               for k, obj in sys.master.objects.items() for s in obj.listed)


def reads_only_listed_replicas(sys: System) -> bool:
    """Spec ``ReadsOnlyListedReplicas``."""
    return all(s in _listed(sys, k) and sys.bytes.get((s, k), 0) == sys.chunks
               for k, segments in sys.master.reading.items() for s in segments)


def repair_never_from_a_lost_segment(sys: System) -> bool:
    """Spec ``RepairNeverFromALostSegment``."""
    return all(src in sys.master.live and src in _listed(sys, k)
               for (k, _), src in sys.master.repairs.items())


def repairs_within_rate(sys: System) -> bool:
    """Spec ``RepairsWithinRate``."""
    return len(sys.master.repairs) <= sys.master.max_repairs


def never_above_requested(sys: System) -> bool:
    """Spec ``NeverAboveRequested``."""
    return all(len(_listed(sys, k)) + sys.master.in_flight(k) <= n for k, n in sys.requested.items())


def one_replica_per_segment(sys: System) -> bool:
    """Spec ``OneReplicaPerSegment`` (repairs are keyed by key and destination,
    so two repairs of one object into one segment cannot be held)."""
    return all(dst not in _listed(sys, k) for k, dst in sys.master.repairs)


def regions_accounted(sys: System) -> bool:
    """Spec ``RegionsAccounted``: no cancelled or removed repair leaks its region."""
    t = sys.master
    for s, keys in sys.region.items():
        want = frozenset(k for k in sys.requested if s in _listed(sys, k)) | \
            frozenset(k for k, dst in t.repairs if dst == s) if s in t.live else frozenset()
        if keys != want:
            return False
    return all(k in sys.region[s] for s, k in sys.bytes)


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "ListedReplicasAreComplete": listed_replicas_are_complete,
    "ReadsOnlyListedReplicas": reads_only_listed_replicas,
    "RepairNeverFromALostSegment": repair_never_from_a_lost_segment,
    "RepairsWithinRate": repairs_within_rate,
    "NeverAboveRequested": never_above_requested,
    "OneReplicaPerSegment": one_replica_per_segment,
    "RegionsAccounted": regions_accounted,
}

# --------------------------------------------------------------------------
# Constants, successors and the stated mapping
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    keys: tuple[str, ...]
    segments: tuple[str, ...]
    max_replicas: int
    chunks: int
    max_repairs: int

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Keys"]), model_names(consts["Segments"]),
                   consts["MaxReplicas"], consts["Chunks"], consts["MaxRepairs"])

    def initial(self) -> Iterator[System]:
        """Spec ``Init``: every requested count, every placement of that many replicas."""
        choices = [[(n, frozenset(p)) for n in range(1, self.max_replicas + 1)
                    for p in itertools.combinations(self.segments, n)] for _ in self.keys]
        for picked in itertools.product(*choices):
            yield System.initial({k: p for k, (_, p) in zip(self.keys, picked)},
                                 {k: n for k, (n, _) in zip(self.keys, picked)},
                                 self.segments, self.chunks, self.max_repairs)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    for k in c.keys:
        for src in c.segments:
            for dst in c.segments:
                yield from emit("RepairStart", sys_repair_start(sys, k, src, dst))
    for k, dst in sys.copied:
        yield from emit("CopyChunk", sys_copy_chunk(sys, k, dst))
        yield from emit("ListReplica", sys_list_replica(sys, k, dst))
    for s in c.segments:
        yield from emit("SegmentLost", sys_segment_lost(sys, s))
    for k in c.keys:
        for s in c.segments:
            yield from emit("ReadBegin", sys_read_begin(sys, k, s))
            yield from emit("ReadEnd", sys_read_end(sys, k, s))
        yield from emit("Remove", sys_remove(sys, k))


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping: keys and segments are model values of the same name;
    a repair is the master's ``(key, dst) -> src`` with its copier's progress;
    a gone object (removed, or its last replica lost) has no listed replica."""
    def segments(names) -> frozenset:
        return frozenset(ModelValue(s) for s in names)

    t = sys.master
    return Fn.of({
        "requested": Fn.of({ModelValue(k): sys.requested[k] for k in c.keys}),
        "live": segments(t.live),
        "listed": Fn.of({ModelValue(k): segments(_listed(sys, k)) for k in c.keys}),
        "repairs": frozenset(
            Fn.of({"key": ModelValue(k), "src": ModelValue(src), "dst": ModelValue(dst),
                   "copied": sys.copied[k, dst]})
            for (k, dst), src in t.repairs.items()),
        "region": Fn.of({ModelValue(s): frozenset(ModelValue(k) for k in sys.region[s])
                         for s in c.segments}),
        "bytes": Fn.of({ModelValue(s): Fn.of({ModelValue(k): sys.bytes.get((s, k), 0) for k in c.keys})
                        for s in c.segments}),
        "reading": Fn.of({ModelValue(k): segments(t.reading.get(k, ())) for k in c.keys}),
    })


BINDING = SpecBinding(
    module="Repair",
    constants=Constants.from_tla,
    initial=lambda c: c.initial(),
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
