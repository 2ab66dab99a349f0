"""Direct writers (``spec/DirectWrite.tla``) as a pure, sans-IO machine.

A direct writer writes the region it was granted itself (a same-host memcpy
into the storage segment, a GPU DMA into a registered one); the storage node
neither performs nor can refuse that write. So the node keeps, per region
granted to a direct writer, a :class:`DirectRegion` in its :class:`DirectTable`,
stepped by :func:`node_step`:

* ``GrantDirect`` — the region's ``assign`` named a direct writer; refused
  while the region is still held (granted, published or draining);
* ``WriteReported`` — the writer reported its write finished (the runtime
  sees the region's generation word set by the writer after its copy);
* ``PublishDirect`` — the master published the object: accepted only once
  the write was reported (spec ``MayPublish``);
* ``FreeDirect`` — the master freed the region (revoke, timeout, remove):
  if its writer is alive and has not reported, the region *drains*
  (:class:`Draining`) instead of being freed (spec ``FreedState``); else
  :class:`Freed`;
* ``Drain`` — a draining region whose writer reported or died (the runtime
  sees the generation word, or the writer's lock released by the kernel)
  is free: :class:`Drained`.

Whether the writer is alive is an input (``writer_alive``), like time: the
runtime observes it. :class:`System` composes the master's directory, one
node's table, the writers and the ghost ``bytes`` into the closed system of
the spec for the conformance and stateful tests.
"""

from __future__ import annotations

import enum
from typing import Callable, Iterator, Mapping, Optional, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit, memoised_step
from kvproto.checking.tla import Fn, ModelValue, model_names
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse


class RegionState(str, enum.Enum):
    GRANTED = "granted"
    PUBLISHED = "published"
    DRAINING = "draining"


@attrs.frozen
class DirectRegion:
    """A region granted to a direct writer (``region[i]`` in the spec)."""

    token: int
    writer: str
    state: RegionState = RegionState.GRANTED
    wrote: bool = False


@attrs.frozen
class DirectTable:
    """A storage node's regions granted to direct writers: offset -> region."""

    regions: immutables.Map = immutables.Map()


# --------------------------------------------------------------------------
# Events and effects
# --------------------------------------------------------------------------


@attrs.frozen
class GrantDirect:
    offset: int
    token: int
    writer: str


@attrs.frozen
class WriteReported:
    offset: int
    token: int


@attrs.frozen
class PublishDirect:
    offset: int
    token: int


@attrs.frozen
class FreeDirect:
    offset: int
    token: int
    writer_alive: bool


@attrs.frozen
class Drain:
    offset: int
    writer_alive: bool


NodeEvent = Union[GrantDirect, WriteReported, PublishDirect, FreeDirect, Drain]


@attrs.frozen
class Freed:
    """The region is free: the master may hand it out again."""

    offset: int


@attrs.frozen
class Draining:
    """The region is held for a writer that may still write it: not free."""

    offset: int


@attrs.frozen
class Drained:
    """A draining region is free now."""

    offset: int


def _held(table: DirectTable, offset: int, token: int) -> Optional[DirectRegion]:
    region = table.regions.get(offset)
    return region if region is not None and region.token == token else None


@memoised_step
def node_step(table: DirectTable, event: NodeEvent) -> tuple[DirectTable, tuple]:
    """Apply one event to a node's table of direct regions."""
    regions = table.regions
    if isinstance(event, GrantDirect):
        held = regions.get(event.offset)
        if held is not None:
            return _refuse(table, errors.RegionMismatch(
                f"region {event.offset} is still {held.state.value} for token {held.token}"))
        region = DirectRegion(event.token, event.writer)
        return DirectTable(regions.set(event.offset, region)), ()
    if isinstance(event, WriteReported):
        region = _held(table, event.offset, event.token)
        if region is None or region.wrote:
            return _refuse(table, errors.StaleToken(
                f"region {event.offset} holds no unreported write of token {event.token}"))
        return DirectTable(regions.set(event.offset, attrs.evolve(region, wrote=True))), ()
    if isinstance(event, PublishDirect):
        region = _held(table, event.offset, event.token)
        if region is None or region.state is not RegionState.GRANTED or not region.wrote:
            return _refuse(table, errors.StaleToken(
                f"region {event.offset} holds no finished direct write of token {event.token}"))
        published = attrs.evolve(region, state=RegionState.PUBLISHED)
        return DirectTable(regions.set(event.offset, published)), ()
    if isinstance(event, FreeDirect):
        region = _held(table, event.offset, event.token)
        if region is None or region.state is RegionState.DRAINING:
            return _refuse(table, errors.StaleToken(
                f"region {event.offset} is not held by token {event.token}"))
        if region.state is RegionState.GRANTED and not region.wrote and event.writer_alive:
            draining = attrs.evolve(region, state=RegionState.DRAINING)
            return DirectTable(regions.set(event.offset, draining)), (Draining(event.offset),)
        return DirectTable(regions.delete(event.offset)), (Freed(event.offset),)
    if isinstance(event, Drain):
        region = regions.get(event.offset)
        if region is None or region.state is not RegionState.DRAINING:
            return _refuse(table, errors.StaleToken(f"region {event.offset} is not draining"))
        if event.writer_alive and not region.wrote:
            return _refuse(table, errors.BufferQuarantined(
                f"region {event.offset}: writer {region.writer} may still write it"))
        return DirectTable(regions.delete(event.offset)), (Drained(event.offset),)
    raise TypeError(f"not a direct-write event: {event!r}")


# --------------------------------------------------------------------------
# The closed system of the spec
# --------------------------------------------------------------------------


@attrs.frozen
class Attempt:
    """A writer's put (``writer[w]``)."""

    key: str
    token: int
    slot: str
    wrote: bool = False


@attrs.frozen(cache_hash=True)
class System:
    dir: immutables.Map       # key -> (token, slot, published) | None
    table: DirectTable        # the node's direct regions (slot names as offsets)
    next_token: int
    writers: immutables.Map   # writer -> Attempt | None
    bytes: immutables.Map     # ghost: slot -> token whose writer's bytes are there (0: none)

    @classmethod
    def initial(cls, keys, writers, slots) -> "System":
        return cls(immutables.Map({k: None for k in keys}), DirectTable(), 1,
                   immutables.Map({w: None for w in writers}), immutables.Map({s: 0 for s in slots}))

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def holds(self, token: int) -> bool:
        """Spec ``Holds(t)``: a live writer of ``token`` has not written yet."""
        return any(a is not None and a.token == token and not a.wrote for a in self.writers.values())

    def node(self, event) -> tuple["System", tuple]:
        table, effects = node_step(self.table, event)
        return self._with(table=table), effects


def sys_grant(sys: System, w: str, k: str, i: str, max_token: int) -> Optional[System]:
    if sys.writers[w] is not None or sys.dir[k] is not None or sys.next_token > max_token:
        return None
    t = sys.next_token
    new, effects = sys.node(GrantDirect(i, t, w))
    if not _accepted(effects):
        return None
    return new._with(dir=sys.dir.set(k, (t, i, False)), next_token=t + 1,
                     writers=sys.writers.set(w, Attempt(k, t, i)))


def sys_write(sys: System, w: str) -> Optional[System]:
    """Spec ``Write``: the bytes land unchecked; the node sees the report if the
    region is still the writer's (under the rule it always is)."""
    a = sys.writers[w]
    if a is None or a.wrote:
        return None
    new, _ = sys.node(WriteReported(a.slot, a.token))
    return new._with(bytes=sys.bytes.set(a.slot, a.token),
                     writers=sys.writers.set(w, attrs.evolve(a, wrote=True)))


def sys_put_end(sys: System, w: str) -> Optional[System]:
    a = sys.writers[w]
    if a is None or not a.wrote:
        return None
    new = sys._with(writers=sys.writers.set(w, None))
    entry = sys.dir[a.key]
    if entry is None or entry[0] != a.token or entry[2]:
        return new                                        # refused: StaleToken
    new, effects = new.node(PublishDirect(entry[1], a.token))
    if not _accepted(effects):
        return None
    return new._with(dir=new.dir.set(a.key, (a.token, entry[1], True)))


def sys_writer_dies(sys: System, w: str) -> Optional[System]:
    if sys.writers[w] is None:
        return None
    return sys._with(writers=sys.writers.set(w, None))


def _free(sys: System, k: str, published: bool) -> Optional[System]:
    entry = sys.dir[k]
    if entry is None or entry[2] != published:
        return None
    token, slot, _ = entry
    new, effects = sys.node(FreeDirect(slot, token, sys.holds(token)))
    if not _accepted(effects):
        return None
    return new._with(dir=new.dir.set(k, None))


def sys_revoke(sys: System, k: str) -> Optional[System]:
    """Spec ``Revoke``: the writer gave up, or its timeout fired."""
    return _free(sys, k, published=False)


def sys_remove(sys: System, k: str) -> Optional[System]:
    return _free(sys, k, published=True)


def sys_drain(sys: System, i: str) -> Optional[System]:
    region = sys.table.regions.get(i)
    if region is None or region.state is not RegionState.DRAINING:
        return None
    new, effects = sys.node(Drain(i, sys.holds(region.token)))
    return new if _accepted(effects) else None


ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "Grant": sys_grant,
    "Write": sys_write,
    "PutEnd": sys_put_end,
    "WriterDies": sys_writer_dies,
    "Revoke": sys_revoke,
    "Remove": sys_remove,
    "Drain": sys_drain,
}

# --------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``."""
    return all(isinstance(r, DirectRegion) and r.token >= 1 for r in sys.table.regions.values()) \
        and all(t >= 0 for t in sys.bytes.values())


def published_bytes_are_the_attempts(sys: System) -> bool:
    """Spec ``PublishedBytesAreTheAttempts``."""
    return all(e is None or not e[2] or sys.bytes[e[1]] == e[0] for e in sys.dir.values())


def drain_waits_for_the_writer(sys: System) -> bool:
    """Spec ``DrainWaitsForTheWriter``: a live writer's unwritten slot is still its."""
    for a in sys.writers.values():
        if a is not None and not a.wrote:
            region = sys.table.regions.get(a.slot)
            if region is None or region.token != a.token:
                return False
    return True


def directory_holds_its_region(sys: System) -> bool:
    """Spec ``DirectoryHoldsItsRegion``."""
    for e in sys.dir.values():
        if e is None:
            continue
        region = sys.table.regions.get(e[1])
        want = RegionState.PUBLISHED if e[2] else RegionState.GRANTED
        if region is None or region.token != e[0] or region.state is not want:
            return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "PublishedBytesAreTheAttempts": published_bytes_are_the_attempts,
    "DrainWaitsForTheWriter": drain_waits_for_the_writer,
    "DirectoryHoldsItsRegion": directory_holds_its_region,
}

# --------------------------------------------------------------------------
# Constants, successors and the stated mapping
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    keys: tuple[str, ...]
    writers: tuple[str, ...]
    slots: tuple[str, ...]
    max_token: int

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Keys"]), model_names(consts["Writers"]),
                   model_names(consts["Slots"]), consts["MaxToken"])

    def initial(self) -> System:
        return System.initial(self.keys, self.writers, self.slots)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    for w in c.writers:
        for k in c.keys:
            for i in c.slots:
                yield from emit("Grant", sys_grant(sys, w, k, i, c.max_token))
        yield from emit("Write", sys_write(sys, w))
        yield from emit("PutEnd", sys_put_end(sys, w))
        yield from emit("WriterDies", sys_writer_dies(sys, w))
    for k in c.keys:
        yield from emit("Revoke", sys_revoke(sys, k))
        yield from emit("Remove", sys_remove(sys, k))
    for i in c.slots:
        yield from emit("Drain", sys_drain(sys, i))


NONE = ModelValue("None")


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping: keys, writers and slots are model values of the same
    name; a region's writer identity is not in the spec (the spec's writers
    are found by token)."""
    def entry(e):
        return NONE if e is None else Fn.of({"token": e[0], "slot": ModelValue(e[1]), "pub": e[2]})

    def region(i):
        r = sys.table.regions.get(i)
        return NONE if r is None else Fn.of({"token": r.token, "state": r.state.value})

    def attempt(a: Optional[Attempt]):
        return NONE if a is None else Fn.of({"key": ModelValue(a.key), "token": a.token,
                                             "slot": ModelValue(a.slot), "wrote": a.wrote})

    return Fn.of({
        "dir": Fn.of({ModelValue(k): entry(sys.dir[k]) for k in c.keys}),
        "region": Fn.of({ModelValue(i): region(i) for i in c.slots}),
        "nextToken": sys.next_token,
        "writer": Fn.of({ModelValue(w): attempt(sys.writers[w]) for w in c.writers}),
        "bytes": Fn.of({ModelValue(i): sys.bytes[i] for i in c.slots}),
    })


BINDING = SpecBinding(
    module="DirectWrite",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
