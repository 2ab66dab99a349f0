"""The publish protocol of ``spec/Publish.tla`` as pure, sans-IO state machines.

Three processes take part, each with its own state and its own step function:

* the master's :class:`Directory` (objects and the space ledger), stepped by
  :func:`master_step` — the runtime master holds exactly one of these;
* a storage node's :class:`RegionTable` (which attempt owns which region of its
  segment), stepped by :func:`storage_step` — one per storage segment;
* a writer's :class:`Attempt` (the put it is carrying out).

:class:`System` composes them into the closed system the spec describes; its
actions (:data:`ACTIONS`) carry the spec's action names and are what the
conformance test and the Hypothesis stateful test drive. Invariants carry the
spec's invariant names (:data:`INVARIANTS`).

Every step is ``(state, event) -> (state, effects)``. A refused event returns
the state unchanged and a single :class:`Refused` effect carrying a typed error
from :mod:`kvproto.errors`. Objects live in a persistent hash map, so a step
costs O(log32 n) in the number of objects (except :class:`SegmentLost`, which
walks the directory once). Where the allocator places a replica is an input
(``PutStart.placement``), like time: the runtime's allocator chooses, the
machine accounts.
"""

from __future__ import annotations

import enum
import itertools
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit, memoised_step
from kvproto.statemachines.maps import map_of
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse
from kvproto.checking.tla import Fn, ModelValue, model_names

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


@attrs.frozen
class Replica:
    """One replica's region: ``length`` bytes at ``offset`` of ``segment``."""

    segment: str
    offset: int
    length: int


class Status(str, enum.Enum):
    PENDING = "pending"
    PUBLISHED = "published"


@attrs.frozen
class RepairRegion:
    """A repair in flight (``dir[k].repairs[s]``): the region at ``offset`` of
    ``segment`` being filled for a new replica, and the repair's ``id``."""

    segment: str
    offset: int
    id: int


@attrs.frozen
class ObjectRecord:
    """The master's record of one key (``dir[k]`` in the spec). ``checksum``
    is the one its writer sent with ``PutEnd`` (0: none), data carried along
    like ``length``; the spec abstracts it away. ``requested`` is the replica
    count its put asked for (default: the replicas it has); ``repairs`` the
    repairs in flight, in the order they started."""

    status: Status
    token: int
    replicas: tuple[Replica, ...]
    length: int
    reads: int = 0
    checksum: int = 0
    requested: int = attrs.field(default=attrs.Factory(lambda self: len(self.replicas),
                                                        takes_self=True))
    repairs: tuple[RepairRegion, ...] = ()

    def below(self) -> bool:
        """Spec ``Below(k)``: fewer replicas, listed or being repaired, than requested."""
        return len(self.replicas) + len(self.repairs) < self.requested


@attrs.frozen
class SegmentLedger:
    """The master's account of one segment's space (``free[s]``, ``s \\in live``)."""

    capacity: int
    free: int
    live: bool = True


@attrs.frozen(cache_hash=True)
class Directory:
    """The master's state: ``dir``, ``free``, ``live`` and ``nextToken``."""

    objects: immutables.Map = immutables.Map()
    segments: immutables.Map = immutables.Map()
    next_token: int = 1


@attrs.frozen
class Region:
    """A storage node's record of one allocated region (``store[s][i]``)."""

    key: bytes
    token: int
    length: int
    done: bool = False


@attrs.frozen(cache_hash=True)
class RegionTable:
    """A storage node's region table for its segment: offset -> :class:`Region`."""

    segment: str
    regions: immutables.Map = immutables.Map()


# --------------------------------------------------------------------------
# Events fed to the master (named after the spec's actions)
# --------------------------------------------------------------------------


@attrs.frozen
class AddSegment:
    """A storage segment joins the ledger (part of the spec's ``Init``)."""

    segment: str
    capacity: int


@attrs.frozen
class PutStart:
    """``PutStart``: allocate ``placement`` for ``key`` and issue a token."""

    key: bytes
    length: int
    placement: tuple[Replica, ...]


@attrs.frozen
class PutEnd:
    """``PutEnd``: publish ``key`` if ``token`` still owns its allocation;
    ``checksum`` is what the writer computed over the bytes (0: none)."""

    key: bytes
    token: int
    checksum: int = 0


@attrs.frozen
class PutRevoke:
    """``PutRevoke``: the writer gives up; free the allocation if it owns it."""

    key: bytes
    token: int


@attrs.frozen
class ReclaimAbandoned:
    """``ReclaimAbandoned``: the master's timeout for a silent writer."""

    key: bytes
    token: int


@attrs.frozen
class ReadBegin:
    """``ReadBegin``: hand out descriptors of a published object and pin it."""

    key: bytes


@attrs.frozen
class ReadEnd:
    """``ReadEnd``: unpin an object a reader got with ``token``."""

    key: bytes
    token: int


@attrs.frozen
class Remove:
    """``Remove``: delete a published, unpinned object and free its space."""

    key: bytes


@attrs.frozen
class SegmentLost:
    """``SegmentLost``: a segment died with its bytes."""

    segment: str


@attrs.frozen
class RepairStart:
    """``RepairStart``: a region ``replica`` for a new replica of the published
    object ``key`` whose token is ``token``."""

    key: bytes
    token: int
    replica: Replica


@attrs.frozen
class ListReplica:
    """``ListReplica``: the copier of repair ``repair`` into ``segment``
    reported its copy complete."""

    key: bytes
    segment: str
    repair: int


@attrs.frozen
class RepairCancel:
    """``RepairCancel``: repair ``repair`` into ``segment`` ends unlisted."""

    key: bytes
    segment: str
    repair: int


MasterEvent = Union[AddSegment, PutStart, PutEnd, PutRevoke, ReclaimAbandoned,
                    ReadBegin, ReadEnd, Remove, SegmentLost, RepairStart, ListReplica,
                    RepairCancel]

# --------------------------------------------------------------------------
# Events fed to a storage node
# --------------------------------------------------------------------------


@attrs.frozen
class AssignRegion:
    """Master -> storage: ``token`` now owns the region at ``offset``."""

    segment: str
    offset: int
    length: int
    key: bytes
    token: int


@attrs.frozen
class FreeRegion:
    """Master -> storage: the ``length`` bytes at ``offset`` owned by ``token`` are free."""

    segment: str
    offset: int
    token: int
    length: int


@attrs.frozen
class WriteReplica:
    """``WriteReplica``: bytes for the region at ``offset``, stamped with ``token``."""

    segment: str
    offset: int
    token: int


@attrs.frozen
class ReadReplica:
    """A reader's request for the bytes at ``offset`` of the object with ``token``."""

    segment: str
    offset: int
    token: int


StorageEvent = Union[AssignRegion, FreeRegion, WriteReplica, ReadReplica]

# --------------------------------------------------------------------------
# Effects
# --------------------------------------------------------------------------



@attrs.frozen
class PutGranted:
    key: bytes
    token: int
    replicas: tuple[Replica, ...]


@attrs.frozen
class Published:
    key: bytes
    token: int


@attrs.frozen
class Revoked:
    key: bytes
    token: int


@attrs.frozen
class ReadGranted:
    key: bytes
    token: int
    replicas: tuple[Replica, ...]
    length: int
    checksum: int = 0


@attrs.frozen
class Removed:
    key: bytes
    token: int


@attrs.frozen
class RepairStarted:
    """A repair began: its ``id`` and its destination region."""

    key: bytes
    token: int
    repair: int
    replica: Replica


@attrs.frozen
class ReplicaListed:
    """A repaired replica is listed: readers may be handed it from now on."""

    key: bytes
    token: int
    repair: int
    replica: Replica


@attrs.frozen
class RepairCancelled:
    """A repair ended unlisted (cancelled, or its object or segment gone)."""

    key: bytes
    token: int
    repair: int
    segment: str


@attrs.frozen
class Accepted:
    """A storage node accepted a write or read."""

    segment: str
    offset: int
    token: int


Effects = tuple

# --------------------------------------------------------------------------
# Master
# --------------------------------------------------------------------------



def _free_effects(key: bytes, record: ObjectRecord, skip: str | None = None) -> tuple:
    """The frees of ``record``'s replicas, then per repair in flight its
    cancellation and its region's free (none on segment ``skip``)."""
    out: list = [FreeRegion(r.segment, r.offset, record.token, r.length)
                 for r in record.replicas if r.segment != skip]
    for p in record.repairs:
        out.append(RepairCancelled(key, record.token, p.id, p.segment))
        if p.segment != skip:
            out.append(FreeRegion(p.segment, p.offset, record.token, record.length))
    return tuple(out)


def _release_space(segments: immutables.Map, record: ObjectRecord,
                   skip: str | None = None) -> immutables.Map:
    """Return ``record``'s replicas and repair regions to the ledger (spec
    ``FreeObjects``)."""
    with segments.mutate() as m:
        for seg in [r.segment for r in record.replicas] + [p.segment for p in record.repairs]:
            if seg != skip:
                ledger = m[seg]
                m[seg] = attrs.evolve(ledger, free=ledger.free + record.length)
        return m.finish()


def _drop(state: Directory, key: bytes, record: ObjectRecord) -> Directory:
    return attrs.evolve(state, objects=state.objects.delete(key),
                        segments=_release_space(state.segments, record))


def _pending_with(state: Directory, key: bytes, token: int) -> Optional[ObjectRecord]:
    """Spec ``TokenOwns(k, t)``: the pending record ``token`` owns, if any."""
    record = state.objects.get(key)
    if record is not None and record.status is Status.PENDING and record.token == token:
        return record
    return None


def add_segment(state: Directory, ev: AddSegment):
    if ev.segment in state.segments:
        return _refuse(state, errors.InvalidArgument(f"segment {ev.segment!r} already joined"))
    if ev.capacity <= 0:
        return _refuse(state, errors.InvalidArgument("segment capacity must be positive"))
    ledger = SegmentLedger(capacity=ev.capacity, free=ev.capacity)
    return attrs.evolve(state, segments=state.segments.set(ev.segment, ledger)), ()


def restored(capacities: Mapping[str, int], objects: Iterable[tuple], next_token: int) -> Directory:
    """The directory a new master opens with after ``spec/Failover.tla``'s
    ``Recover``: every object in ``objects`` (``(key, token, length, replicas)``,
    or with its ``checksum`` as a fifth item and its requested replica count
    as a sixth, 0: the replicas it had) is published on its replicas, the segments in ``capacities`` are live with
    those replicas' bytes taken from their free space, and tokens continue from
    ``next_token``. A replica on a segment not in ``capacities`` is dropped
    (its bytes are gone); an object left with no replica is not listed."""
    used = dict.fromkeys(capacities, 0)
    listed = {}
    for key, token, length, replicas, *extra in objects:
        kept = tuple(r for r in replicas if r.segment in used)
        if not kept:
            continue
        for r in kept:
            used[r.segment] += r.length
        checksum, requested = (list(extra) + [0, 0])[:2]
        listed[key] = ObjectRecord(Status.PUBLISHED, token, kept, length, checksum=checksum,
                                   requested=max(requested, len(kept)))
        next_token = max(next_token, token + 1)
    segments = {s: SegmentLedger(capacity=c, free=c - used[s]) for s, c in capacities.items()}
    if any(ledger.free < 0 for ledger in segments.values()):
        raise ValueError("recovered objects exceed a segment's capacity")
    return Directory(map_of(listed.items()), immutables.Map(segments), next_token)


def put_start(state: Directory, ev: PutStart):
    """Spec ``PutStart``: the key is absent and every replica fits on a live segment."""
    if ev.key in state.objects:
        return _refuse(state, errors.KeyExists(f"key {ev.key!r} exists or is being put"))
    if ev.length <= 0 or not ev.placement:
        return _refuse(state, errors.InvalidArgument("empty object or placement"))
    if len({r.segment for r in ev.placement}) != len(ev.placement):
        return _refuse(state, errors.InvalidArgument("two replicas on one segment"))
    for r in ev.placement:
        ledger = state.segments.get(r.segment)
        if ledger is None or not ledger.live:
            return _refuse(state, errors.SegmentUnavailable(f"segment {r.segment!r} is not live"))
        if r.length != ev.length or ledger.free < r.length or r.offset < 0 \
                or r.offset + r.length > ledger.capacity:
            return _refuse(state, errors.NoSpace(f"segment {r.segment!r} cannot hold {ev.length} bytes"))
    token = state.next_token
    record = ObjectRecord(Status.PENDING, token, tuple(ev.placement), ev.length)
    with state.segments.mutate() as m:
        for r in ev.placement:
            ledger = m[r.segment]
            m[r.segment] = attrs.evolve(ledger, free=ledger.free - r.length)
        segments = m.finish()
    new = Directory(state.objects.set(ev.key, record), segments, token + 1)
    assigns = tuple(AssignRegion(r.segment, r.offset, r.length, ev.key, token) for r in ev.placement)
    return new, (PutGranted(ev.key, token, record.replicas),) + assigns


def put_end(state: Directory, ev: PutEnd):
    """Spec ``PutEnd``: publish only if ``TokenOwns(k, t)``; else StaleToken."""
    record = _pending_with(state, ev.key, ev.token)
    if record is None:
        return _refuse(state, errors.StaleToken(f"token {ev.token} does not own {ev.key!r}"))
    record = attrs.evolve(record, status=Status.PUBLISHED, checksum=ev.checksum)
    return attrs.evolve(state, objects=state.objects.set(ev.key, record)), (Published(ev.key, ev.token),)


def put_revoke(state: Directory, ev: PutRevoke):
    """Spec ``PutRevoke``: free the allocation if ``token`` still owns it."""
    record = _pending_with(state, ev.key, ev.token)
    if record is None:
        return _refuse(state, errors.StaleToken(f"token {ev.token} does not own {ev.key!r}"))
    return _drop(state, ev.key, record), (Revoked(ev.key, ev.token),) + _free_effects(ev.key, record)


def reclaim_abandoned(state: Directory, ev: ReclaimAbandoned):
    """Spec ``ReclaimAbandoned``: the writer fell silent; free its allocation."""
    record = _pending_with(state, ev.key, ev.token)
    if record is None:
        return _refuse(state, errors.StaleToken(f"token {ev.token} does not own {ev.key!r}"))
    return _drop(state, ev.key, record), (Revoked(ev.key, ev.token),) + _free_effects(ev.key, record)


def read_begin(state: Directory, ev: ReadBegin):
    """Spec ``ReadBegin``: only a published object is readable (``Readable(k)``)."""
    record = state.objects.get(ev.key)
    if record is None or record.status is not Status.PUBLISHED:
        return _refuse(state, errors.KeyNotFound(f"{ev.key!r}"))
    pinned = attrs.evolve(record, reads=record.reads + 1)
    return (attrs.evolve(state, objects=state.objects.set(ev.key, pinned)),
            (ReadGranted(ev.key, record.token, record.replicas, record.length, record.checksum),))


def read_end(state: Directory, ev: ReadEnd):
    """Spec ``ReadEnd``: unpin; a read of an object that is gone changes nothing."""
    record = state.objects.get(ev.key)
    if record is None or record.token != ev.token or record.reads == 0:
        return _refuse(state, errors.StaleToken(f"no read of {ev.key!r} with token {ev.token}"))
    unpinned = attrs.evolve(record, reads=record.reads - 1)
    return attrs.evolve(state, objects=state.objects.set(ev.key, unpinned)), ()


def remove(state: Directory, ev: Remove):
    """Spec ``Remove``: published and unpinned only."""
    record = state.objects.get(ev.key)
    if record is None:
        return _refuse(state, errors.KeyNotFound(f"{ev.key!r}"))
    if record.status is not Status.PUBLISHED:
        return _refuse(state, errors.NotPublished(f"{ev.key!r} is being put"))
    if record.reads:
        return _refuse(state, errors.ObjectBusy(f"{ev.key!r} has {record.reads} reader(s)"))
    return _drop(state, ev.key, record), (Removed(ev.key, record.token),) + _free_effects(ev.key, record)


def segment_lost(state: Directory, ev: SegmentLost):
    """Spec ``SegmentLost``: revoke pending objects with a replica there, drop the
    replica from published ones, and forget published ones left with none.
    Walks the directory once."""
    ledger = state.segments.get(ev.segment)
    if ledger is None or not ledger.live:
        return _refuse(state, errors.SegmentUnavailable(f"segment {ev.segment!r} is not live"))
    effects: list = []
    segments = state.segments.set(ev.segment, SegmentLedger(ledger.capacity, 0, live=False))
    with state.objects.mutate() as objects:
        for key, record in state.objects.items():
            if not any(r.segment == ev.segment for r in record.replicas) \
                    and not any(p.segment == ev.segment for p in record.repairs):
                continue
            kept = tuple(r for r in record.replicas if r.segment != ev.segment)
            if record.status is Status.PENDING or not kept:
                del objects[key]
                segments = _release_space(segments, record, skip=ev.segment)
                effects.append(Revoked(key, record.token) if record.status is Status.PENDING
                               else Removed(key, record.token))
                effects.extend(_free_effects(key, record, skip=ev.segment))
            else:
                ended = [p for p in record.repairs if p.segment == ev.segment]
                effects.extend(RepairCancelled(key, record.token, p.id, p.segment) for p in ended)
                objects[key] = attrs.evolve(record, replicas=kept, repairs=tuple(
                    p for p in record.repairs if p.segment != ev.segment))
        new = attrs.evolve(state, objects=objects.finish(), segments=segments)
    return new, tuple(effects)


def repair_start(state: Directory, ev: RepairStart):
    """Spec ``RepairStart``: the object is published (with ``token``) and below
    its requested count, and the region fits on a live segment holding none
    of it; the repair's id is the next token."""
    record = state.objects.get(ev.key)
    if record is None or record.status is not Status.PUBLISHED or record.token != ev.token:
        return _refuse(state, errors.StaleToken(f"no published {ev.key!r} with token {ev.token}"))
    if not record.below():
        return _refuse(state, errors.InvalidArgument(
            f"{ev.key!r} has the {record.requested} replica(s) it requested"))
    r = ev.replica
    if any(h.segment == r.segment for h in record.replicas + record.repairs):
        return _refuse(state, errors.InvalidArgument("two replicas on one segment"))
    ledger = state.segments.get(r.segment)
    if ledger is None or not ledger.live:
        return _refuse(state, errors.SegmentUnavailable(f"segment {r.segment!r} is not live"))
    if r.length != record.length or ledger.free < r.length or r.offset < 0 \
            or r.offset + r.length > ledger.capacity:
        return _refuse(state, errors.NoSpace(f"segment {r.segment!r} cannot hold {r.length} bytes"))
    repair = state.next_token
    record = attrs.evolve(record, repairs=record.repairs + (RepairRegion(r.segment, r.offset, repair),))
    segments = state.segments.set(r.segment, attrs.evolve(ledger, free=ledger.free - r.length))
    new = Directory(state.objects.set(ev.key, record), segments, repair + 1)
    return new, (RepairStarted(ev.key, ev.token, repair, r),
                 AssignRegion(r.segment, r.offset, r.length, ev.key, ev.token))


def _repair_of(state: Directory, key: bytes, segment: str, repair: int):
    """``(record, repair region)`` of repair ``repair`` into ``segment``, or None."""
    record = state.objects.get(key)
    if record is not None:
        for p in record.repairs:
            if p.segment == segment and p.id == repair:
                return record, p
    return None


def list_replica(state: Directory, ev: ListReplica):
    """Spec ``ListReplica``: the report names a repair in flight (a late report
    of a cancelled one is refused); its region becomes a listed replica."""
    found = _repair_of(state, ev.key, ev.segment, ev.repair)
    if found is None:
        return _refuse(state, errors.StaleToken(
            f"no repair {ev.repair} of {ev.key!r} into {ev.segment!r} in flight"))
    record, p = found
    replica = Replica(p.segment, p.offset, record.length)
    record = attrs.evolve(record, replicas=record.replicas + (replica,),
                          repairs=tuple(q for q in record.repairs if q is not p))
    return (attrs.evolve(state, objects=state.objects.set(ev.key, record)),
            (ReplicaListed(ev.key, record.token, ev.repair, replica),))


def repair_cancel(state: Directory, ev: RepairCancel):
    """Spec ``RepairCancel``: the repair ends unlisted and its region is freed."""
    found = _repair_of(state, ev.key, ev.segment, ev.repair)
    if found is None:
        return _refuse(state, errors.StaleToken(
            f"no repair {ev.repair} of {ev.key!r} into {ev.segment!r} in flight"))
    record, p = found
    ledger = state.segments[p.segment]
    segments = state.segments.set(p.segment, attrs.evolve(ledger, free=ledger.free + record.length))
    kept = attrs.evolve(record, repairs=tuple(q for q in record.repairs if q is not p))
    return (Directory(state.objects.set(ev.key, kept), segments, state.next_token),
            (RepairCancelled(ev.key, record.token, p.id, p.segment),
             FreeRegion(p.segment, p.offset, record.token, record.length)))


_MASTER_HANDLERS: dict[type, Callable] = {
    AddSegment: add_segment, PutStart: put_start, PutEnd: put_end, PutRevoke: put_revoke,
    ReclaimAbandoned: reclaim_abandoned, ReadBegin: read_begin, ReadEnd: read_end,
    Remove: remove, SegmentLost: segment_lost, RepairStart: repair_start,
    ListReplica: list_replica, RepairCancel: repair_cancel,
}


@memoised_step
def master_step(state: Directory, event: MasterEvent) -> tuple[Directory, Effects]:
    """Apply one event to the master's directory."""
    return _MASTER_HANDLERS[type(event)](state, event)


# --------------------------------------------------------------------------
# Storage node
# --------------------------------------------------------------------------


@memoised_step
def storage_step(table: RegionTable, event: StorageEvent) -> tuple[RegionTable, Effects]:
    """Apply one event to a storage node's region table.

    A write or read is accepted only for a region owned by the stamped token
    (spec ``WriteReplica``: ``store[s][i].token = writer[w].token``). A region
    is written once: a second write is refused, so no token holder can rewrite
    bytes that may already be published. Reads need the region completely
    written.
    """
    region = table.regions.get(event.offset)
    if isinstance(event, AssignRegion):
        if region is not None:
            return _refuse(table, errors.RegionMismatch(f"offset {event.offset} is already owned"))
        new = Region(event.key, event.token, event.length)
        return attrs.evolve(table, regions=table.regions.set(event.offset, new)), ()
    if region is None or region.token != event.token:
        return _refuse(table, errors.RegionMismatch(
            f"{table.segment}@{event.offset} is not owned by token {event.token}"))
    if isinstance(event, FreeRegion):
        return attrs.evolve(table, regions=table.regions.delete(event.offset)), ()
    if isinstance(event, WriteReplica):
        if region.done:
            return _refuse(table, errors.RegionMismatch(f"{table.segment}@{event.offset} is already written"))
        done = attrs.evolve(region, done=True)
        return (attrs.evolve(table, regions=table.regions.set(event.offset, done)),
                (Accepted(table.segment, event.offset, event.token),))
    if isinstance(event, ReadReplica):
        if not region.done:
            return _refuse(table, errors.RegionMismatch(f"{table.segment}@{event.offset} is incomplete"))
        return table, (Accepted(table.segment, event.offset, event.token),)
    raise TypeError(f"not a storage event: {event!r}")


def apply_to_storage(tables: immutables.Map, effects: Sequence) -> immutables.Map:
    """Carry the master's Assign/Free effects to the storage nodes' tables
    (a lost segment's table is gone and ignores them)."""
    with tables.mutate() as m:
        for eff in effects:
            if isinstance(eff, (AssignRegion, FreeRegion)) and eff.segment in m:
                m[eff.segment], _ = storage_step(m[eff.segment], eff)
        return m.finish()


# --------------------------------------------------------------------------
# The closed system of the spec: master + storage nodes + writers
# --------------------------------------------------------------------------


@attrs.frozen
class Attempt:
    """A writer's put in progress (``writer[w]``)."""

    key: bytes
    token: int
    replicas: tuple[Replica, ...]
    written: frozenset = frozenset()


@attrs.frozen(cache_hash=True)
class System:
    """The closed system, with the spec's history variables: what the writers
    were told (``published_token``), whose bytes each region holds
    (``content``) and which objects' descriptors readers hold (``handed``).
    Histories record observations; no step reads them."""

    directory: Directory
    tables: immutables.Map          # segment -> RegionTable (lost segments absent)
    writers: immutables.Map         # writer -> Attempt | None
    published_token: immutables.Map  # key -> token of the writer told its PutEnd published
    content: immutables.Map = immutables.Map()  # (segment, offset) -> token of the bytes' writer
    handed: immutables.Map = immutables.Map()   # (key, token) -> readers holding its descriptors

    @classmethod
    def initial(cls, segments: Mapping[str, int], writers: Sequence[str]) -> "System":
        directory = Directory()
        for seg, capacity in segments.items():
            directory, _ = master_step(directory, AddSegment(seg, capacity))
        return cls(directory,
                   immutables.Map({s: RegionTable(s) for s in segments}),
                   immutables.Map({w: None for w in writers}),
                   immutables.Map())

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def _master(self, event) -> tuple["System", Effects]:
        directory, effects = master_step(self.directory, event)
        new = self._with(directory=directory, tables=apply_to_storage(self.tables, effects))
        freed = [(e.segment, e.offset) for e in effects if isinstance(e, FreeRegion)]
        if freed:     # a freed region holds no attempt's bytes (spec FreeObjects)
            with new.content.mutate() as m:
                for region in freed:
                    m.pop(region, None)
                new = new._with(content=m.finish())
        return new, effects

    def _handed(self, key: bytes, token: int, change: int) -> "System":
        count = self.handed.get((key, token), 0) + change
        handed = self.handed.set((key, token), count) if count else self.handed.delete((key, token))
        return self._with(handed=handed)



def sys_put_start(sys: System, w: str, key: bytes, placement: tuple[Replica, ...]) -> Optional[System]:
    if sys.writers[w] is not None:
        return None
    new, effects = sys._master(PutStart(key, placement[0].length, placement))
    if not _accepted(effects):
        return None
    grant = effects[0]
    return new._with(writers=new.writers.set(w, Attempt(key, grant.token, grant.replicas)))


def sys_write_replica(sys: System, w: str, segment: str) -> Optional[System]:
    attempt = sys.writers[w]
    if attempt is None or segment in attempt.written:
        return None
    replica = next((r for r in attempt.replicas if r.segment == segment), None)
    table = sys.tables.get(segment)
    if replica is None or table is None:
        return None
    table, effects = storage_step(table, WriteReplica(segment, replica.offset, attempt.token))
    if not _accepted(effects):
        return None
    attempt = attrs.evolve(attempt, written=attempt.written | {segment})
    return sys._with(tables=sys.tables.set(segment, table), writers=sys.writers.set(w, attempt),
                     content=sys.content.set((segment, replica.offset), attempt.token))


def writer_may_put_end(attempt: Attempt) -> bool:
    """Spec ``WriterMayPutEnd``: every replica write was acknowledged."""
    return attempt.written == frozenset(r.segment for r in attempt.replicas)


def sys_put_end(sys: System, w: str) -> Optional[System]:
    attempt = sys.writers[w]
    if attempt is None or not writer_may_put_end(attempt):
        return None
    new, effects = sys._master(PutEnd(attempt.key, attempt.token))
    published = new.published_token
    if _accepted(effects):
        published = published.set(attempt.key, attempt.token)
    return new._with(writers=new.writers.set(w, None), published_token=published)


def sys_put_revoke(sys: System, w: str) -> Optional[System]:
    attempt = sys.writers[w]
    if attempt is None:
        return None
    new, _ = sys._master(PutRevoke(attempt.key, attempt.token))
    return new._with(writers=new.writers.set(w, None))


def sys_writer_crash(sys: System, w: str) -> Optional[System]:
    if sys.writers[w] is None:
        return None
    return sys._with(writers=sys.writers.set(w, None))


def _forget(sys: System, effects: Effects) -> System:
    """Drop the history entry of objects that were removed."""
    gone = [e.key for e in effects if isinstance(e, Removed)]
    if not gone:
        return sys
    with sys.published_token.mutate() as m:
        for key in gone:
            m.pop(key, None)
        return sys._with(published_token=m.finish())


def _on_master(event) -> Callable[[System], Optional[System]]:
    def act(sys: System) -> Optional[System]:
        new, effects = sys._master(event)
        return _forget(new, effects) if _accepted(effects) else None
    return act


def sys_reclaim_abandoned(sys: System, key: bytes) -> Optional[System]:
    record = sys.directory.objects.get(key)
    if record is None:
        return None
    return _on_master(ReclaimAbandoned(key, record.token))(sys)


def sys_read_begin(sys: System, key: bytes) -> Optional[System]:
    """Spec ``ReadBegin``; the reader now holds the granted descriptors."""
    new, effects = sys._master(ReadBegin(key))
    if not _accepted(effects):
        return None
    return new._handed(key, effects[0].token, +1)


def sys_read_end(sys: System, key: bytes) -> Optional[System]:
    """Spec ``ReadEnd``; the reader lets go of the descriptors it held."""
    record = sys.directory.objects.get(key)
    if record is None:
        return None
    new = _on_master(ReadEnd(key, record.token))(sys)
    return None if new is None else new._handed(key, record.token, -1)


def sys_remove(sys: System, key: bytes) -> Optional[System]:
    return _on_master(Remove(key))(sys)


def sys_segment_lost(sys: System, segment: str) -> Optional[System]:
    """Spec ``SegmentLost``: the segment's bytes are gone, and the readers of
    an object left with no replica fail and let go of its descriptors."""
    new, effects = sys._master(SegmentLost(segment))
    if not _accepted(effects):
        return None
    gone = {e.key for e in effects if isinstance(e, Removed)}
    content = immutables.Map({r: t for r, t in new.content.items() if r[0] != segment})
    handed = immutables.Map({h: n for h, n in new.handed.items() if h[0] not in gone})
    return _forget(new, effects)._with(tables=new.tables.delete(segment), content=content,
                                       handed=handed)


def sys_repair_start(sys: System, key: bytes, segment: str, offset: int) -> Optional[System]:
    """Spec ``RepairStart`` into the region at ``offset`` of ``segment``."""
    record = sys.directory.objects.get(key)
    if record is None:
        return None
    return _on_master(RepairStart(key, record.token, Replica(segment, offset, record.length)))(sys)


def sys_copy_replica(sys: System, key: bytes, segment: str) -> Optional[System]:
    """Spec ``CopyReplica``: the copier reads a listed replica (``ReadReplica``
    at its node, under the object's token) and writes the bytes into the
    repair's region (``WriteReplica`` at the destination node)."""
    record = sys.directory.objects.get(key)
    repair = None if record is None else next(
        (p for p in record.repairs if p.segment == segment), None)
    table = sys.tables.get(segment)
    if repair is None or table is None or record.status is not Status.PUBLISHED:
        return None
    for src in record.replicas:
        _, read = storage_step(sys.tables[src.segment], ReadReplica(src.segment, src.offset, record.token))
        if _accepted(read):
            break
    else:
        return None
    table, effects = storage_step(table, WriteReplica(segment, repair.offset, record.token))
    if not _accepted(effects):
        return None
    bytes_of = sys.content.get((src.segment, src.offset), 0)
    content = sys.content.set((segment, repair.offset), bytes_of) if bytes_of \
        else sys.content.delete((segment, repair.offset))
    return sys._with(tables=sys.tables.set(segment, table), content=content)


def repair_copied(sys: System, key: bytes, segment: str, offset: int) -> bool:
    """Spec ``RepairCopied``: the copier reports only a complete copy (its
    region at the destination node is written)."""
    table = sys.tables.get(segment)
    region = None if table is None else table.regions.get(offset)
    return region is not None and region.done


def sys_list_replica(sys: System, key: bytes, segment: str) -> Optional[System]:
    """Spec ``ListReplica``, on the copier's report of a complete copy."""
    record = sys.directory.objects.get(key)
    repair = None if record is None else next(
        (p for p in record.repairs if p.segment == segment), None)
    if repair is None or not repair_copied(sys, key, segment, repair.offset):
        return None
    return _on_master(ListReplica(key, segment, repair.id))(sys)


def sys_repair_cancel(sys: System, key: bytes, segment: str) -> Optional[System]:
    """Spec ``RepairCancel``."""
    record = sys.directory.objects.get(key)
    repair = None if record is None else next(
        (p for p in record.repairs if p.segment == segment), None)
    if repair is None:
        return None
    return _on_master(RepairCancel(key, segment, repair.id))(sys)


#: The spec's actions, each as a function on :class:`System` that returns the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "PutStart": sys_put_start,
    "WriteReplica": sys_write_replica,
    "PutEnd": sys_put_end,
    "PutRevoke": sys_put_revoke,
    "WriterCrash": sys_writer_crash,
    "ReclaimAbandoned": sys_reclaim_abandoned,
    "ReadBegin": sys_read_begin,
    "ReadEnd": sys_read_end,
    "Remove": sys_remove,
    "SegmentLost": sys_segment_lost,
    "RepairStart": sys_repair_start,
    "CopyReplica": sys_copy_replica,
    "ListReplica": sys_list_replica,
    "RepairCancel": sys_repair_cancel,
}


# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``."""
    d = sys.directory
    for record in d.objects.values():
        if not (isinstance(record, ObjectRecord) and isinstance(record.status, Status)
                and 0 < record.token < d.next_token and record.reads >= 0
                and all(r.length == record.length for r in record.replicas)
                and record.requested >= 1
                and all(isinstance(p, RepairRegion) and 0 < p.id < d.next_token
                        for p in record.repairs)):
            return False
    for ledger in d.segments.values():
        if not 0 <= ledger.free <= ledger.capacity:
            return False
    return all(a is None or isinstance(a, Attempt) for a in sys.writers.values())


def only_published_readable(sys: System) -> bool:
    """Spec ``OnlyPublishedReadable``: every reader holds descriptors of a
    published object, of the attempt its key still names."""
    for key, token in sys.handed:
        record = sys.directory.objects.get(key)
        if record is None or record.status is not Status.PUBLISHED or record.token != token:
            return False
    return True


def published_has_all_replicas_complete(sys: System) -> bool:
    """Spec ``PublishedHasAllReplicasComplete``."""
    for key, record in sys.directory.objects.items():
        if record.status is not Status.PUBLISHED:
            continue
        for r in record.replicas:
            table = sys.tables.get(r.segment)
            region = None if table is None else table.regions.get(r.offset)
            if region != Region(key, record.token, record.length, done=True):
                return False
    return True


def no_overlapping_allocation(sys: System) -> bool:
    """Spec ``NoOverlappingAllocation``: no byte belongs to two objects, and every
    storage region table agrees with the directory."""
    owned: dict[tuple[str, int], tuple[bytes, int]] = {}
    extents: dict[str, list[tuple[int, int]]] = {}
    for key, record in sys.directory.objects.items():
        for seg, off in _held(record):
            owned[(seg, off)] = (key, record.token)
            extents.setdefault(seg, []).append((off, off + record.length))
    for spans in extents.values():
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return False
    stored = {(seg, off): (reg.key, reg.token)
              for seg, table in sys.tables.items() for off, reg in table.regions.items()}
    return stored == owned


def _held(record: ObjectRecord) -> list[tuple[str, int]]:
    """``(segment, offset)`` of each replica and repair region (spec ``SlotsOf``)."""
    return [(r.segment, r.offset) for r in record.replicas] + \
        [(p.segment, p.offset) for p in record.repairs]


def never_above_requested(sys: System) -> bool:
    """Spec ``NeverAboveRequested``: replicas and repairs in flight stay within
    the requested count, one per segment."""
    for record in sys.directory.objects.values():
        segs = [seg for seg, _ in _held(record)]
        if len(segs) > record.requested or len(set(segs)) != len(segs):
            return False
    return True


def space_accounted(sys: System) -> bool:
    """Spec ``SpaceAccounted``: free + allocated = capacity on live segments."""
    used: dict[str, int] = {}
    for record in sys.directory.objects.values():
        for seg, _ in _held(record):
            used[seg] = used.get(seg, 0) + record.length
    for seg, ledger in sys.directory.segments.items():
        if ledger.live and ledger.free + used.get(seg, 0) != ledger.capacity:
            return False
        if not ledger.live and (ledger.free or used.get(seg)):
            return False
    return True


def one_attempt_publishes(sys: System) -> bool:
    """Spec ``OneAttemptPublishes``: the writers told their put was published
    are exactly the attempts of the published objects."""
    published = {key: record.token for key, record in sys.directory.objects.items()
                 if record.status is Status.PUBLISHED}
    return dict(sys.published_token) == published


def published_bytes_are_the_attempts(sys: System) -> bool:
    """Spec ``PublishedBytesAreTheAttempts``: every replica of a published
    object holds the bytes of the attempt whose PutEnd published it."""
    for key, record in sys.directory.objects.items():
        if record.status is Status.PUBLISHED:
            token = sys.published_token.get(key, 0)
            if any(sys.content.get((r.segment, r.offset), 0) != token for r in record.replicas):
                return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "OnlyPublishedReadable": only_published_readable,
    "PublishedHasAllReplicasComplete": published_has_all_replicas_complete,
    "NoOverlappingAllocation": no_overlapping_allocation,
    "SpaceAccounted": space_accounted,
    "OneAttemptPublishes": one_attempt_publishes,
    "PublishedBytesAreTheAttempts": published_bytes_are_the_attempts,
    "NeverAboveRequested": never_above_requested,
}



# --------------------------------------------------------------------------
# Model constants and the successor relation (for conformance and exploration)
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    """The spec's CONSTANTS. Keys, writers and segments are model-value names;
    slot ``i`` of the spec is the region of length 1 at offset ``i - 1``."""

    keys: tuple[str, ...]
    writers: tuple[str, ...]
    segments: tuple[str, ...]
    slots_per_segment: int
    replica_count: int
    max_token: int
    max_reads: int

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Keys"]), model_names(consts["Writers"]), model_names(consts["Segments"]),
                   consts["SlotsPerSegment"], consts["ReplicaCount"],
                   consts["MaxToken"], consts["MaxReads"])

    def initial(self) -> System:
        return System.initial({s: self.slots_per_segment for s in self.segments}, self.writers)


def placements(sys: System, c: Constants) -> Iterator[tuple[Replica, ...]]:
    """Every placement the allocator could choose: ``replica_count`` live
    segments, one free slot on each."""
    taken = {held for rec in sys.directory.objects.values() for held in _held(rec)}
    live = [s for s in c.segments if sys.directory.segments[s].live
            and sys.directory.segments[s].free > 0]
    for segs in itertools.combinations(live, c.replica_count):
        choices = [[Replica(s, i, 1) for i in range(c.slots_per_segment) if (s, i) not in taken]
                   for s in segs]
        yield from itertools.product(*choices)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    if sys.directory.next_token <= c.max_token:
        for w in c.writers:
            for k in c.keys:
                for p in placements(sys, c):
                    yield from emit("PutStart", sys_put_start(sys, w, k, p))
    for w in c.writers:
        for s in c.segments:
            yield from emit("WriteReplica", sys_write_replica(sys, w, s))
        yield from emit("PutEnd", sys_put_end(sys, w))
        yield from emit("PutRevoke", sys_put_revoke(sys, w))
        yield from emit("WriterCrash", sys_writer_crash(sys, w))
    for k in c.keys:
        yield from emit("ReclaimAbandoned", sys_reclaim_abandoned(sys, k))
        record = sys.directory.objects.get(k)
        if record is None or record.reads < c.max_reads:
            yield from emit("ReadBegin", sys_read_begin(sys, k))
        yield from emit("ReadEnd", sys_read_end(sys, k))
        yield from emit("Remove", sys_remove(sys, k))
    for s in c.segments:
        yield from emit("SegmentLost", sys_segment_lost(sys, s))
    if sys.directory.next_token <= c.max_token:
        taken = {held for rec in sys.directory.objects.values() for held in _held(rec)}
        for k in c.keys:
            for s in c.segments:
                for i in range(c.slots_per_segment):
                    if (s, i) not in taken:
                        yield from emit("RepairStart", sys_repair_start(sys, k, s, i))
    for k in c.keys:
        for s in c.segments:
            yield from emit("CopyReplica", sys_copy_replica(sys, k, s))
            yield from emit("ListReplica", sys_list_replica(sys, k, s))
            yield from emit("RepairCancel", sys_repair_cancel(sys, k, s))


NONE = ModelValue("None")


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping from a Python :class:`System` to the spec's variables.

    Keys, writers and segments map to model values of the same name, the region
    at offset ``i`` to slot ``i + 1``, an absent record, region or attempt to the
    model value ``None``, and a missing ``published_token``, ``content`` or
    ``handed`` entry to ``0``.
    """
    def placement(replicas) -> Fn:
        return Fn.of({ModelValue(r.segment): r.offset + 1 for r in replicas})

    def record(rec: Optional[ObjectRecord]):
        if rec is None:
            return NONE
        repairs = Fn.of({ModelValue(p.segment): Fn.of({"slot": p.offset + 1, "id": p.id})
                         for p in rec.repairs}) if rec.repairs else ()
        return Fn.of({"status": rec.status.value, "token": rec.token,
                      "replicas": placement(rec.replicas), "requested": rec.requested,
                      "repairs": repairs, "reads": rec.reads})

    def slots(seg: str) -> tuple:
        table = sys.tables.get(seg)
        regions = table.regions if table is not None else immutables.Map()
        out = []
        for i in range(c.slots_per_segment):
            reg = regions.get(i)
            out.append(NONE if reg is None else Fn.of(
                {"key": ModelValue(reg.key), "token": reg.token, "done": reg.done}))
        return tuple(out)

    def attempt(a: Optional[Attempt]):
        if a is None:
            return NONE
        return Fn.of({"key": ModelValue(a.key), "token": a.token,
                      "replicas": placement(a.replicas),
                      "written": frozenset(ModelValue(s) for s in a.written)})

    d = sys.directory
    return Fn.of({
        "dir": Fn.of({ModelValue(k): record(d.objects.get(k)) for k in c.keys}),
        "free": Fn.of({ModelValue(s): d.segments[s].free for s in c.segments}),
        "live": frozenset(ModelValue(s) for s in c.segments if d.segments[s].live),
        "nextToken": d.next_token,
        "store": Fn.of({ModelValue(s): slots(s) for s in c.segments}),
        "writer": Fn.of({ModelValue(w): attempt(sys.writers[w]) for w in c.writers}),
        "publishedToken": Fn.of({ModelValue(k): sys.published_token.get(k, 0) for k in c.keys}),
        "content": Fn.of({ModelValue(s): tuple(sys.content.get((s, i), 0)
                                               for i in range(c.slots_per_segment))
                          for s in c.segments}),
        "handed": Fn.of({ModelValue(k): tuple(sys.handed.get((k, t), 0)
                                              for t in range(1, c.max_token + 1))
                         for k in c.keys}),
    })


BINDING = SpecBinding(
    module="Publish",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
