"""Master failover of ``spec/Failover.tla`` as pure, sans-IO state machines.

Four pieces, each a value with pure steps:

* the master's failover phase machine, :class:`Master`, stepped by
  :func:`master_step`: standby -> term obtained and fencing (waiting for the
  storage nodes' acks) -> recovered (directory rebuilt from the nodes' indexes)
  -> open; it steps down to standby on seeing a higher term;
* a storage node's term fence and object index, :class:`StorageNode`, stepped
  by :func:`storage_step`: every allocation, publish, read and index request is
  stamped with a term, and one below the highest term the node has seen is
  refused with :class:`~kvproto.errors.StaleTerm`; a repaired replica's
  publish carries its object's publishing term, which the node records
  (spec ``Repair``: the copy is the listed allocation's);
* :func:`rebuild_directory`, the directory rebuilt from the storage nodes'
  indexes: only published objects whose bytes are on live nodes; unpublished
  allocations of older terms are purged and their space freed;
* :class:`RecomputeLimiter`, a token bucket that bounds the engine's fall-back
  to recomputation while lookups miss during the switch.

:class:`System` composes masters, a coordinator, storage nodes and readers
into the closed system the spec describes; its actions (:data:`ACTIONS`) carry
the spec's action names and its invariants (:data:`INVARIANTS`) the spec's
invariant names. Every step is ``(state, event) -> (state, effects)``; a
refused event returns the state unchanged and a single :class:`Refused`
effect carrying a typed error from :mod:`kvproto.errors`. Time enters only as
an argument (``RecomputeLimiter.take(now)``).
"""

from __future__ import annotations

import enum
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit, memoised_step
from kvproto.statemachines.maps import map_of
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse
from kvproto.checking.tla import Fn, ModelValue, function, model_names

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


class Phase(str, enum.Enum):
    STANDBY = "standby"
    FENCING = "fencing"        # term obtained; waiting for every live node's ack
    RECOVERED = "recovered"    # directory rebuilt from the nodes' indexes; not yet serving
    OPEN = "open"


@attrs.frozen
class IndexEntry:
    """A storage node's index entry for one object it holds (``idx[n][k]``).

    ``term`` is the term of the allocation, ``by`` the term of the publish that
    made it visible (0 while unpublished). ``offset``, ``length`` and
    ``checksum`` locate and check the bytes, ``requested`` is the replica
    count the object's put asked for (0: not recorded); the spec abstracts
    them away.
    """

    term: int
    published: bool = False
    by: int = 0
    offset: int = 0
    length: int = 1
    checksum: int = 0
    token: int = 0
    requested: int = 0


@attrs.frozen
class DirEntry:
    """The master's directory entry for one key (``dir[m][k]``).

    ``node`` is the replica a lookup names first; ``replicas`` lists every
    live node holding the same published allocation (``(node, offset)``
    pairs; empty: ``node`` alone, a put's one replica), the spec's ``nodes``;
    ``token`` is that allocation's publish-protocol token and ``by`` its
    publishing term (0 while unpublished), which a repair's copy records.
    """

    node: str
    published: bool = False
    offset: int = 0
    length: int = 1
    checksum: int = 0
    token: int = 0
    replicas: tuple = ()
    requested: int = 0
    by: int = 0

    def listed(self) -> tuple:
        """``(node, offset)`` of every replica listed, ``node``'s first."""
        return self.replicas or ((self.node, self.offset),)


@attrs.frozen
class Master:
    """One master process: its failover phase, term, fence acks and directory."""

    phase: Phase = Phase.STANDBY
    term: int = 0
    acked: frozenset = frozenset()
    directory: immutables.Map = immutables.Map()


@attrs.frozen(cache_hash=True)
class StorageNode:
    """A storage node's fence (highest term seen) and its object index."""

    term: int = 0
    index: immutables.Map = immutables.Map()


@attrs.frozen
class Descriptor:
    """What a lookup hands a reader: where the bytes are, stamped with a term."""

    key: str
    node: str
    term: int
    offset: int = 0
    length: int = 1


# --------------------------------------------------------------------------
# Master events (named after the spec's actions where they are one)
# --------------------------------------------------------------------------


@attrs.frozen
class ObtainTerm:
    """The coordinator granted ``term`` to this (standby) master."""

    term: int


@attrs.frozen
class FenceAcked:
    """Storage node ``node`` acknowledged this master's term."""

    node: str


@attrs.frozen
class HigherTermSeen:
    """A node (or the coordinator) refused this master with a higher ``term``: step down."""

    term: int


@attrs.frozen
class Recover:
    """Rebuild the directory from the indexes of the ``live`` storage nodes."""

    live: frozenset
    indexes: Mapping  # node -> immutables.Map[key, IndexEntry]


@attrs.frozen
class Open:
    """Open service after recovery."""


@attrs.frozen
class Allocate:
    """Ask to allocate ``key`` on ``node``; emits the stamped request for the node."""

    key: str
    node: str
    length: int = 1
    offset: int = 0


@attrs.frozen
class Allocated:
    """The node accepted the stamped allocation; record it (unpublished)."""

    key: str
    node: str
    length: int = 1
    offset: int = 0


@attrs.frozen
class Publish:
    """The writer finished ``key``; emits the stamped publish for its node."""

    key: str


@attrs.frozen
class PublishAcked:
    """The node accepted the stamped publish; the key is visible."""

    key: str


@attrs.frozen
class Remove:
    """A client removes published ``key``; emits the stamped free for its node."""

    key: str


@attrs.frozen
class RemoveAcked:
    """The node recorded the stamped free; the key is gone and the remove is
    acknowledged to the client."""

    key: str


@attrs.frozen
class Lookup:
    """A reader asks where ``key`` is; ``node`` names the listed replica it
    is handed (None: the entry's first)."""

    key: str
    node: Optional[str] = None


@attrs.frozen
class Repair:
    """Copy published ``key`` from its listed replica on ``source`` into a
    region at ``offset`` of ``node``, which holds none of it; emits the stamped
    allocation and publish for ``node``, the publish carrying the object's
    publishing term (spec ``Repair``)."""

    key: str
    source: str
    node: str
    offset: int = 0


@attrs.frozen
class RepairListed:
    """``node`` recorded the copy: list it among ``key``'s replicas."""

    key: str
    node: str
    offset: int = 0


@attrs.frozen
class NodeLost:
    """A storage node died with its bytes."""

    node: str


MasterEvent = Union[ObtainTerm, FenceAcked, HigherTermSeen, Recover, Open, Allocate,
                    Allocated, Publish, PublishAcked, Remove, RemoveAcked, Lookup, Repair,
                    RepairListed, NodeLost]

# --------------------------------------------------------------------------
# Storage node events: each stamped with the sender's term
# --------------------------------------------------------------------------


@attrs.frozen
class Fence:
    """A new master's term: from now on refuse anything stamped lower."""

    term: int


@attrs.frozen
class StampedAllocate:
    node: str
    key: str
    term: int
    offset: int = 0
    length: int = 1
    token: int = 0


@attrs.frozen
class StampedPublish:
    """Publish ``key``'s open allocation at ``node``, stamped with ``term``.
    ``by`` (0: ``term``) is the publishing term to record, the object's own
    for a repaired replica (a copy of the listed allocation, spec
    ``RepairedEntry``); it records the allocation term too, and may not be
    above ``term``."""

    node: str
    key: str
    term: int
    checksum: int = 0
    requested: int = 0
    by: int = 0


@attrs.frozen
class StampedRead:
    node: str
    key: str
    term: int


@attrs.frozen
class IndexRequest:
    """A recovering master asks for the node's index."""

    term: int


@attrs.frozen
class PurgeUnpublished:
    """Drop unpublished allocations of terms below ``below`` and free their space."""

    node: str
    below: int


@attrs.frozen
class StampedFree:
    """The publish protocol freed ``key``'s region (its ``FreeRegion``: the
    object was removed, evicted or its attempt revoked): the entry of
    allocation ``token`` leaves the index with its region (spec ``Remove``,
    node side). The term fence applies as to every request of a master."""

    node: str
    key: str
    term: int
    token: int


StorageEvent = Union[Fence, StampedAllocate, StampedPublish, StampedRead, IndexRequest,
                     PurgeUnpublished, StampedFree]

# --------------------------------------------------------------------------
# Effects
# --------------------------------------------------------------------------


@attrs.frozen
class FenceAck:
    term: int


@attrs.frozen
class StorageAccepted:
    key: str
    term: int


@attrs.frozen
class ReadReturned:
    key: str
    entry: IndexEntry


@attrs.frozen
class IndexReturned:
    index: immutables.Map


@attrs.frozen
class Purged:
    """Unpublished allocations dropped by a node, and the bytes freed."""

    keys: tuple
    freed: int


@attrs.frozen
class SteppedDown:
    term: int


Effects = tuple

# --------------------------------------------------------------------------
# Directory rebuild (pure)
# --------------------------------------------------------------------------


def rebuild_directory(indexes: Mapping[str, immutables.Map], live) -> immutables.Map:
    """The directory recovered from the storage nodes' indexes (spec ``RecoveredDir``).

    Lists exactly the published objects whose bytes are on a ``live`` node;
    unpublished allocations are left out (the nodes purge them). The entry
    names the live node whose publish has the highest term, then the least node
    name (the protocol publishes one allocation per key, so the nodes agree);
    ``replicas`` are all live nodes that published that same allocation
    (same publishing term and token) with the same checksum, in node order:
    a repaired replica records its object's publishing term (spec
    ``Repair``, ``RepairedEntry``), so it is listed with the original. A
    replica of that allocation whose checksum differs from the listed
    entry's is left out (see :func:`checksum_mismatches`).
    """
    best: dict = {}
    for node, key, entry in _published(indexes, live):
        held = best.get(key)
        if held is None or entry.by > held[1].by:
            best[key] = (node, entry, [(node, entry.offset)])
        elif entry.by == held[1].by and entry.token == held[1].token \
                and entry.checksum == held[1].checksum:
            held[2].append((node, entry.offset))
    return map_of((k, DirEntry(n, True, e.offset, e.length, e.checksum, e.token, tuple(r),
                               e.requested, e.by))
                  for k, (n, e, r) in best.items())


def _published(indexes: Mapping[str, immutables.Map], live):
    """``(node, key, entry)`` of the published entries on ``live`` nodes, in node order."""
    for node in sorted(indexes):
        if node in live:
            for key, entry in indexes[node].items():
                if entry.published:
                    yield node, key, entry


def checksum_mismatches(indexes: Mapping[str, immutables.Map], live) -> list[tuple]:
    """The rebuild's check of the checksums: ``(key, node, offset)`` of every
    published entry on a live node that holds the allocation
    :func:`rebuild_directory` lists for ``key`` (same publishing term and
    token) but records another checksum, sorted. Such a replica is not
    listed: its bytes or its index disagree with the listed one's (the
    runtime master frees its region)."""
    listed = rebuild_directory(indexes, live)
    out = []
    for node, key, entry in _published(indexes, live):
        chosen = listed[key]
        held = indexes[chosen.node][key]
        if entry.by == held.by and entry.token == held.token and entry.checksum != held.checksum:
            out.append((key, node, entry.offset))
    return sorted(out)


def purge_unpublished(index: immutables.Map, below: int) -> tuple[immutables.Map, tuple, int]:
    """Drop unpublished entries allocated in a term below ``below``: ``(index, keys, freed bytes)``."""
    gone = sorted(k for k, e in index.items() if not e.published and e.term < below)
    freed = sum(index[k].length for k in gone)
    with index.mutate() as m:
        for k in gone:
            del m[k]
        return m.finish(), tuple(gone), freed


# --------------------------------------------------------------------------
# Recompute limiter (pure token bucket)
# --------------------------------------------------------------------------


@attrs.frozen
class RecomputeLimiter:
    """A token bucket bounding the engine's fall-back to recomputation.

    ``rate`` tokens per second refill the bucket up to ``burst``; each allowed
    recompute takes one. Over any interval ``[t0, t1]`` at most
    ``burst + rate * (t1 - t0)`` recomputes are allowed. Time only enters as
    ``now``; a ``now`` earlier than the last one refills nothing.
    """

    rate: float
    burst: float
    tokens: float = attrs.field(default=None)
    last: Optional[float] = None

    def __attrs_post_init__(self):
        if self.rate < 0 or self.burst < 1:
            raise errors.InvalidArgument("rate must be >= 0 and burst >= 1")
        if self.tokens is None:
            object.__setattr__(self, "tokens", float(self.burst))

    def take(self, now: float) -> tuple["RecomputeLimiter", bool]:
        """``(limiter, allowed)``: whether one recompute may start at ``now``."""
        if self.last is None:
            tokens, last = self.tokens, now
        else:
            elapsed = max(0.0, now - self.last)
            tokens, last = min(self.burst, self.tokens + elapsed * self.rate), max(self.last, now)
        if tokens >= 1:
            return attrs.evolve(self, tokens=tokens - 1, last=last), True
        return attrs.evolve(self, tokens=tokens, last=last), False


# --------------------------------------------------------------------------
# Master
# --------------------------------------------------------------------------


def _step_down(state: Master) -> Master:
    """Back to standby; the (now stale) directory stays in memory until a crash."""
    return Master(Phase.STANDBY, 0, frozenset(), state.directory)


def fence_complete(state: Master, live) -> bool:
    """Spec ``FenceComplete``: every live storage node acknowledged the term."""
    return frozenset(live) <= state.acked


def obtain_term(state: Master, ev: ObtainTerm):
    """Spec ``ObtainTerm`` (master side): a standby master starts fencing."""
    if state.phase is not Phase.STANDBY:
        return _refuse(state, errors.MasterNotStandby(f"master is {state.phase.value}"))
    if ev.term <= 0:
        return _refuse(state, errors.InvalidArgument("terms start at 1"))
    return Master(Phase.FENCING, ev.term, frozenset(), state.directory), ()


def fence_acked(state: Master, ev: FenceAcked):
    """Spec ``Fence`` (master side): record the node's ack."""
    if state.phase is not Phase.FENCING:
        return _refuse(state, errors.MasterNotOpen("not fencing"))
    return attrs.evolve(state, acked=state.acked | {ev.node}), ()


def higher_term_seen(state: Master, ev: HigherTermSeen):
    """Step down on a higher term; a term not above ours changes nothing."""
    if state.phase is Phase.STANDBY or ev.term <= state.term:
        return _refuse(state, errors.InvalidArgument(f"term {ev.term} is not above {state.term}"))
    return _step_down(state), (SteppedDown(ev.term),)


def recover(state: Master, ev: Recover):
    """Spec ``Recover``: after a complete fence, rebuild the directory from the
    nodes' indexes and tell every live node to purge older unpublished allocations."""
    if state.phase is not Phase.FENCING:
        return _refuse(state, errors.MasterNotOpen("not fencing"))
    if not fence_complete(state, ev.live):
        return _refuse(state, errors.FenceIncomplete(
            f"no ack from {sorted(frozenset(ev.live) - state.acked)}"))
    directory = rebuild_directory(ev.indexes, ev.live)
    purges = tuple(PurgeUnpublished(n, state.term) for n in sorted(ev.live))
    return attrs.evolve(state, phase=Phase.RECOVERED, directory=directory), purges


def open_service(state: Master, ev: Open):
    """Spec ``Open``: only after recovery."""
    if state.phase is not Phase.RECOVERED:
        return _refuse(state, errors.MasterNotOpen(f"master is {state.phase.value}"))
    return attrs.evolve(state, phase=Phase.OPEN), ()


def _require_open(state: Master):
    if state.phase is not Phase.OPEN:
        return errors.MasterNotOpen(f"master is {state.phase.value}")
    return None


def allocate(state: Master, ev: Allocate):
    """Spec ``Allocate`` (master side): emit the allocation stamped with our term."""
    err = _require_open(state)
    if err is None and ev.key in state.directory:
        err = errors.KeyExists(f"{ev.key!r}")
    if err is not None:
        return _refuse(state, err)
    return state, (StampedAllocate(ev.node, ev.key, state.term, ev.offset, ev.length),)


def allocated(state: Master, ev: Allocated):
    err = _require_open(state)
    if err is None and ev.key in state.directory:
        err = errors.KeyExists(f"{ev.key!r}")
    if err is not None:
        return _refuse(state, err)
    entry = DirEntry(ev.node, False, ev.offset, ev.length)
    return attrs.evolve(state, directory=state.directory.set(ev.key, entry)), ()


def publish(state: Master, ev: Publish):
    """Spec ``Publish`` (master side): emit the publish stamped with our term."""
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and entry is None:
        err = errors.KeyNotFound(f"{ev.key!r}")
    if err is None and entry.published:
        err = errors.KeyExists(f"{ev.key!r} is already published")
    if err is not None:
        return _refuse(state, err)
    return state, (StampedPublish(entry.node, ev.key, state.term, entry.checksum),)


def publish_acked(state: Master, ev: PublishAcked):
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and (entry is None or entry.published):
        err = errors.NotPublished(f"{ev.key!r} is not being published")
    if err is not None:
        return _refuse(state, err)
    return attrs.evolve(state, directory=state.directory.set(
        ev.key, attrs.evolve(entry, published=True, by=state.term))), ()


def remove(state: Master, ev: Remove):
    """Spec ``Remove`` (master side): emit the free stamped with our term; the
    remove is acknowledged only once the node recorded it (``RemoveAcked``)."""
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and (entry is None or not entry.published):
        err = errors.KeyNotFound(f"{ev.key!r}")
    if err is not None:
        return _refuse(state, err)
    return state, tuple(StampedFree(n, ev.key, state.term, entry.token) for n, _ in entry.listed())


def remove_acked(state: Master, ev: RemoveAcked):
    err = _require_open(state)
    if err is None and ev.key not in state.directory:
        err = errors.KeyNotFound(f"{ev.key!r}")
    if err is not None:
        return _refuse(state, err)
    return attrs.evolve(state, directory=state.directory.delete(ev.key)), ()


def lookup(state: Master, ev: Lookup):
    """Spec ``Lookup``: a descriptor stamped with our term, or a refusal the
    client treats as a miss (``MasterNotOpen``, ``KeyNotFound``)."""
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and (entry is None or not entry.published):
        err = errors.KeyNotFound(f"{ev.key!r}")
    offset = dict(entry.listed()).get(entry.node if ev.node is None else ev.node) \
        if err is None else None
    if err is None and offset is None:
        err = errors.KeyNotFound(f"{ev.key!r} is not listed on {ev.node}")
    if err is not None:
        return _refuse(state, err)
    node = entry.node if ev.node is None else ev.node
    return state, (Descriptor(ev.key, node, state.term, offset, entry.length),)


def repair(state: Master, ev: Repair):
    """Spec ``Repair`` (master side): the copy of a published object into a
    node that holds none of it, allocated under the object's token and
    published with its publishing term (``by``), both stamped with our term."""
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and (entry is None or not entry.published):
        err = errors.KeyNotFound(f"{ev.key!r}")
    if err is None:
        nodes = dict(entry.listed())
        if ev.source not in nodes:
            err = errors.KeyNotFound(f"{ev.key!r} is not listed on {ev.source}")
        elif ev.node in nodes:
            err = errors.KeyExists(f"{ev.key!r} is listed on {ev.node}")
    if err is not None:
        return _refuse(state, err)
    return state, (StampedAllocate(ev.node, ev.key, state.term, ev.offset, entry.length,
                                   entry.token),
                   StampedPublish(ev.node, ev.key, state.term, entry.checksum, entry.requested,
                                  entry.by))


def repair_listed(state: Master, ev: RepairListed):
    """The repaired replica is recorded at its node: list it."""
    err = _require_open(state)
    entry = state.directory.get(ev.key)
    if err is None and (entry is None or not entry.published):
        err = errors.KeyNotFound(f"{ev.key!r}")
    if err is None and ev.node in dict(entry.listed()):
        err = errors.KeyExists(f"{ev.key!r} is listed on {ev.node}")
    if err is not None:
        return _refuse(state, err)
    entry = attrs.evolve(entry, replicas=entry.listed() + ((ev.node, ev.offset),))
    return attrs.evolve(state, directory=state.directory.set(ev.key, entry)), ()


def node_lost(state: Master, ev: NodeLost):
    """Spec ``NodeLost`` (master side): a serving master drops the node from
    its entries, and an entry with no replica left."""
    if state.phase not in (Phase.RECOVERED, Phase.OPEN):
        return state, ()
    hit = [(k, e) for k, e in state.directory.items()
           if any(n == ev.node for n, _ in e.listed())]
    with state.directory.mutate() as m:
        for k, e in hit:
            left = tuple(r for r in e.listed() if r[0] != ev.node)
            if left:
                m[k] = attrs.evolve(e, node=left[0][0], offset=left[0][1], replicas=left)
            else:
                del m[k]
        return attrs.evolve(state, directory=m.finish()), ()


_MASTER_HANDLERS: dict[type, Callable] = {
    ObtainTerm: obtain_term, FenceAcked: fence_acked, HigherTermSeen: higher_term_seen,
    Recover: recover, Open: open_service, Allocate: allocate, Allocated: allocated,
    Publish: publish, PublishAcked: publish_acked, Remove: remove, RemoveAcked: remove_acked,
    Lookup: lookup, Repair: repair, RepairListed: repair_listed, NodeLost: node_lost,
}


@memoised_step
def master_step(state: Master, event: MasterEvent) -> tuple[Master, Effects]:
    """Apply one event to a master."""
    return _MASTER_HANDLERS[type(event)](state, event)


# --------------------------------------------------------------------------
# Storage node: the term fence
# --------------------------------------------------------------------------


def node_accepts(node: StorageNode, term: int) -> bool:
    """Spec ``NodeAccepts``: a request stamped below the node's term is refused."""
    return term >= node.term


def _stale(node: StorageNode, term: int):
    return _refuse(node, errors.StaleTerm(f"term {term} is below {node.term}"))


@memoised_step
def storage_step(node: StorageNode, event: StorageEvent) -> tuple[StorageNode, Effects]:
    """Apply one stamped request to a storage node.

    The term fence comes after the request's own checks (the region must be
    free for an allocation, allocated and unpublished for a publish), as in the
    spec; any request accepted raises the node's term to the request's.
    """
    if isinstance(event, Fence):
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        return attrs.evolve(node, term=event.term), (FenceAck(event.term),)
    if isinstance(event, StampedAllocate):
        if event.key in node.index:
            return _refuse(node, errors.KeyExists(f"{event.key!r} is held here"))
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        entry = IndexEntry(event.term, False, 0, event.offset, event.length, 0, event.token)
        return (StorageNode(max(node.term, event.term), node.index.set(event.key, entry)),
                (StorageAccepted(event.key, event.term),))
    if isinstance(event, StampedPublish):
        entry = node.index.get(event.key)
        if entry is None or entry.published:
            return _refuse(node, errors.NotPublished(f"{event.key!r} is not an open allocation here"))
        if event.by > event.term:
            return _refuse(node, errors.InvalidArgument(
                f"publishing term {event.by} is above the command's {event.term}"))
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        by = event.by or event.term
        entry = attrs.evolve(entry, published=True, by=by, checksum=event.checksum,
                             requested=event.requested, term=by if event.by else entry.term)
        return (StorageNode(max(node.term, event.term), node.index.set(event.key, entry)),
                (StorageAccepted(event.key, event.term),))
    if isinstance(event, StampedRead):
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        entry = node.index.get(event.key)
        if entry is None:
            return _refuse(node, errors.KeyNotFound(f"{event.key!r}"))
        return node, (ReadReturned(event.key, entry),)
    if isinstance(event, IndexRequest):
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        return node, (IndexReturned(node.index),)
    if isinstance(event, PurgeUnpublished):
        index, keys, freed = purge_unpublished(node.index, event.below)
        return attrs.evolve(node, index=index), (Purged(keys, freed),)
    if isinstance(event, StampedFree):
        entry = node.index.get(event.key)
        if entry is None or entry.token != event.token:
            return _refuse(node, errors.StaleToken(
                f"{event.key!r} is not held here with token {event.token}"))
        if not node_accepts(node, event.term):
            return _stale(node, event.term)
        return (StorageNode(max(node.term, event.term), node.index.delete(event.key)),
                (StorageAccepted(event.key, event.term),))
    raise TypeError(f"not a storage event: {event!r}")


# --------------------------------------------------------------------------
# The closed system of the spec
# --------------------------------------------------------------------------

#: The result of a read that missed (spec ``Miss``).
MISS = IndexEntry(term=0, published=False, by=0)

#: What the last acknowledged change of a key told its client (spec ``told``):
#: ``("none", None)``, ``("published", node)`` or ``("removed", None)``.
TOLD_NONE = ("none", None)
TOLD_REMOVED = ("removed", None)


@attrs.frozen(cache_hash=True)
class System:
    coord_term: int
    masters: immutables.Map         # master -> Master
    nodes: immutables.Map           # node -> StorageNode (dead ones keep their term)
    live: frozenset
    desc: immutables.Map            # reader -> Descriptor | None
    got: immutables.Map             # reader -> IndexEntry | MISS | None
    stale_accepted: frozenset       # history: nodes that accepted a request stamped below
                                    # a term whose fence they acknowledged
    told: immutables.Map            # history: key -> what its last acknowledged change told
    promised: immutables.Map = immutables.Map()  # history: node -> highest fence term it acked

    @classmethod
    def initial(cls, masters: Sequence[str], nodes: Sequence[str], readers: Sequence[str],
                keys: Sequence[str] = ()) -> "System":
        return cls(0, immutables.Map({m: Master() for m in masters}),
                   immutables.Map({n: StorageNode() for n in nodes}), frozenset(nodes),
                   immutables.Map({r: None for r in readers}),
                   immutables.Map({r: None for r in readers}), frozenset(),
                   immutables.Map({k: TOLD_NONE for k in keys}))

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def _master(self, m: str, event) -> tuple["System", Effects]:
        new, effects = master_step(self.masters[m], event)
        return self._with(masters=self.masters.set(m, new)), effects

    def _node(self, n: str, event) -> tuple["System", Effects]:
        new, effects = storage_step(self.nodes[n], event)
        return self._with(nodes=self.nodes.set(n, new)), effects


def _refused_term(effects: Effects) -> bool:
    return bool(effects) and isinstance(effects[0], Refused) \
        and isinstance(effects[0].error, errors.StaleTerm)


def _step_down_on(sys: System, m: str, n: str) -> System:
    new, _ = sys._master(m, HigherTermSeen(sys.nodes[n].term))
    return new


def sys_obtain_term(sys: System, m: str) -> Optional[System]:
    new, effects = sys._master(m, ObtainTerm(sys.coord_term + 1))
    if not _accepted(effects):
        return None
    return new._with(coord_term=sys.coord_term + 1)


def sys_fence(sys: System, m: str, n: str) -> Optional[System]:
    master = sys.masters[m]
    if master.phase is not Phase.FENCING or n not in sys.live or n in master.acked:
        return None
    new, effects = sys._node(n, Fence(master.term))
    if not _accepted(effects):
        return _step_down_on(sys, m, n)
    new, _ = new._master(m, FenceAcked(n))
    promised = max(sys.promised.get(n, 0), master.term)
    return new._with(promised=new.promised.set(n, promised))


def _breaks_promise(sys: System, n: str, term: int) -> bool:
    """Whether ``n`` accepting a request stamped ``term`` breaks the promise of
    a fence it acknowledged (the spec's ``staleAccepted`` test)."""
    return term < sys.promised.get(n, 0)


def sys_recover(sys: System, m: str) -> Optional[System]:
    master = sys.masters[m]
    if master.phase is not Phase.FENCING or not fence_complete(master, sys.live):
        return None
    indexes = {}
    for n in sorted(sys.live):
        _, effects = storage_step(sys.nodes[n], IndexRequest(master.term))
        if not _accepted(effects):
            return _step_down_on(sys, m, n)
        indexes[n] = effects[0].index
    new, effects = sys._master(m, Recover(sys.live, indexes))
    if not _accepted(effects):
        return None
    for purge in effects:
        new, _ = new._node(purge.node, purge)
    return new


def sys_open(sys: System, m: str) -> Optional[System]:
    new, effects = sys._master(m, Open())
    return new if _accepted(effects) else None


def sys_crash(sys: System, m: str) -> Optional[System]:
    """Spec ``Crash``: the process dies and loses its directory."""
    if sys.masters[m].phase is Phase.STANDBY:
        return None
    return sys._with(masters=sys.masters.set(m, Master()))


def sys_allocate(sys: System, m: str, key: str, n: str) -> Optional[System]:
    if n not in sys.live:
        return None
    _, effects = master_step(sys.masters[m], Allocate(key, n))
    if not _accepted(effects):
        return None
    request = effects[0]
    new, effects = sys._node(n, request)
    if _refused_term(effects):
        return _step_down_on(sys, m, n)
    if not _accepted(effects):
        return None
    new, _ = new._master(m, Allocated(key, n))
    if _breaks_promise(sys, n, request.term):
        new = new._with(stale_accepted=new.stale_accepted | {n})
    return new


def sys_publish(sys: System, m: str, key: str) -> Optional[System]:
    _, effects = master_step(sys.masters[m], Publish(key))
    if not _accepted(effects):
        return None
    request = effects[0]
    n = request.node
    if n not in sys.live:
        return None
    new, effects = sys._node(n, request)
    if _refused_term(effects):
        return _step_down_on(sys, m, n)
    if not _accepted(effects):
        return None
    new, _ = new._master(m, PublishAcked(key))
    if _breaks_promise(sys, n, request.term):
        new = new._with(stale_accepted=new.stale_accepted | {n})
    return new._with(told=new.told.set(key, ("published", n)))


def sys_remove(sys: System, m: str, key: str) -> Optional[System]:
    """Spec ``Remove``: refused while a reader holds a descriptor of ``key``;
    acknowledged (``told``) only once the node recorded the stamped free."""
    _, requests = master_step(sys.masters[m], Remove(key))
    if not _accepted(requests):
        return None
    if any(d is not None and d.key == key for d in sys.desc.values()):
        return None
    for request in requests:            # every listed replica's node holds it
        n = request.node
        if n not in sys.live or key not in sys.nodes[n].index:
            return None
    for request in requests:            # all record the free, or the first refusal
        if not node_accepts(sys.nodes[request.node], request.term):
            return _step_down_on(sys, m, request.node)
    new = sys
    for request in requests:
        n = request.node
        new, effects = new._node(n, request)
        if not _accepted(effects):
            return None
        if _breaks_promise(sys, n, request.term):
            new = new._with(stale_accepted=new.stale_accepted | {n})
    new, _ = new._master(m, RemoveAcked(key))
    return new._with(told=new.told.set(key, TOLD_REMOVED))


def sys_lookup(sys: System, r: str, m: str, key: str, n: Optional[str] = None
               ) -> Optional[System]:
    """Spec ``Lookup`` (handed the listed replica on ``n``); a refused lookup
    is a miss and changes nothing."""
    if sys.desc[r] is not None:
        return None
    _, effects = master_step(sys.masters[m], Lookup(key, n))
    if not _accepted(effects):
        return None
    return sys._with(desc=sys.desc.set(r, effects[0]))


def sys_read(sys: System, r: str) -> Optional[System]:
    """Spec ``Read``: a dead node, a stale term or a missing region is a miss."""
    d = sys.desc[r]
    if d is None:
        return None
    result = MISS
    if d.node in sys.live:
        _, effects = storage_step(sys.nodes[d.node], StampedRead(d.node, d.key, d.term))
        if _accepted(effects):
            result = effects[0].entry
    return sys._with(desc=sys.desc.set(r, None), got=sys.got.set(r, result))


def sys_repair(sys: System, m: str, key: str, s: str, d: str, max_copies: int
               ) -> Optional[System]:
    """Spec ``Repair``: the copier reads ``key`` from the listed replica on
    ``s`` under the master's term (a refused or missing source: the copy
    fails, nothing changes), and ``d`` records the copy under that term, with
    the object's publishing term; the master lists ``d``."""
    master = sys.masters[m]
    entry = master.directory.get(key)
    if entry is None or len(entry.listed()) >= max_copies or not {s, d} <= sys.live:
        return None
    _, requests = master_step(master, Repair(key, s, d))
    if not _accepted(requests):
        return None
    _, read = storage_step(sys.nodes[s], StampedRead(s, key, master.term))
    if not _accepted(read) or not read[0].entry.published:
        return None
    allocate, publish = requests
    new, effects = sys._node(d, allocate)
    if _refused_term(effects):
        return _step_down_on(sys, m, d)
    if not _accepted(effects):
        return None
    new, effects = new._node(d, publish)
    if not _accepted(effects):
        return None
    new, _ = new._master(m, RepairListed(key, d))
    if _breaks_promise(sys, d, master.term):
        new = new._with(stale_accepted=new.stale_accepted | {d})
    return new


def sys_node_lost(sys: System, n: str) -> Optional[System]:
    if n not in sys.live:
        return None
    node = sys.nodes[n]
    new = sys._with(live=sys.live - {n},
                    nodes=sys.nodes.set(n, StorageNode(node.term, immutables.Map())))
    for m in sys.masters:
        new, _ = new._master(m, NodeLost(n))
    return new


#: The spec's actions, each a function on :class:`System` returning the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "ObtainTerm": sys_obtain_term,
    "Fence": sys_fence,
    "Recover": sys_recover,
    "Open": sys_open,
    "Crash": sys_crash,
    "Allocate": sys_allocate,
    "Publish": sys_publish,
    "Remove": sys_remove,
    "Lookup": sys_lookup,
    "Read": sys_read,
    "Repair": sys_repair,
    "NodeLost": sys_node_lost,
}

# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``."""
    for master in sys.masters.values():
        if not (isinstance(master.phase, Phase) and 0 <= master.term <= sys.coord_term
                and master.acked <= frozenset(sys.nodes)):
            return False
        if (master.phase is Phase.STANDBY) != (master.term == 0):
            return False
        if any(not isinstance(e, DirEntry) or e.node not in sys.nodes
               for e in master.directory.values()):
            return False
    for node in sys.nodes.values():
        if not 0 <= node.term <= sys.coord_term:
            return False
        if any(not (1 <= e.term <= sys.coord_term and 0 <= e.by <= sys.coord_term)
               for e in node.index.values()):
            return False
    if any(what not in ("none", "published", "removed") or (n is not None and n not in sys.nodes)
           for what, n in sys.told.values()):
        return False
    if any(n not in sys.nodes or not 0 <= t <= sys.coord_term for n, t in sys.promised.items()):
        return False
    return sys.live <= frozenset(sys.nodes) and sys.stale_accepted <= frozenset(sys.nodes)


def current(sys: System, m: str) -> bool:
    """Spec ``Current``: serving, with the coordinator's latest term."""
    master = sys.masters[m]
    return master.phase in (Phase.RECOVERED, Phase.OPEN) and master.term == sys.coord_term


def can_mutate(sys: System, m: str) -> bool:
    """Spec ``CanMutate``: open, and some live node would accept its term."""
    master = sys.masters[m]
    return master.phase is Phase.OPEN and any(node_accepts(sys.nodes[n], master.term)
                                              for n in sys.live)


def no_split_brain_allocation(sys: System) -> bool:
    """Spec ``NoSplitBrainAllocation``: at most one master can allocate or publish."""
    return sum(1 for m in sys.masters if can_mutate(sys, m)) <= 1


def no_stale_term_write_accepted(sys: System) -> bool:
    """Spec ``NoStaleTermWriteAccepted``."""
    return not sys.stale_accepted


def directory_only_lists_live_bytes(sys: System) -> bool:
    """Spec ``DirectoryOnlyListsLiveBytes``."""
    for m, master in sys.masters.items():
        if not current(sys, m):
            continue
        for key, e in master.directory.items():
            for n, _ in e.listed():
                held = sys.nodes[n].index.get(key) if n in sys.live else None
                if held is None or held.published != e.published:
                    return False
    return True


def unpublished_purged_after_recovery(sys: System) -> bool:
    """Spec ``UnpublishedPurgedAfterRecovery``."""
    for m, master in sys.masters.items():
        if not current(sys, m):
            continue
        for n in sys.live:
            for key, e in sys.nodes[n].index.items():
                if e.published:
                    continue
                d = master.directory.get(key)
                if e.term != master.term or d is None or d.published \
                        or [r for r, _ in d.listed()] != [n]:
                    return False
    return True


def reads_return_published_bytes_or_miss(sys: System) -> bool:
    """Spec ``ReadsReturnPublishedBytesOrMiss``."""
    return all(g is None or g == MISS or (g.published and g.by == g.term)
               for g in sys.got.values())


def acknowledged_changes_survive(sys: System) -> bool:
    """Spec ``AcknowledgedChangesSurvive``: a current master lists as published
    every object whose publish was acknowledged (while its node lives) and none
    whose remove was acknowledged."""
    for m, master in sys.masters.items():
        if not current(sys, m):
            continue
        for key, (what, n) in sys.told.items():
            e = master.directory.get(key)
            listed = e is not None and e.published
            if what == "published" and n in sys.live and not listed:
                return False
            if what == "removed" and listed:
                return False
    return True


def no_published_copy_orphaned(sys: System) -> bool:
    """Spec ``NoPublishedCopyOrphaned``: the current master lists every
    published entry on a live node (an original and its repaired replicas
    alike), so none is left unreadable and never freed."""
    for m, master in sys.masters.items():
        if not current(sys, m):
            continue
        for n in sys.live:
            for key, e in sys.nodes[n].index.items():
                d = master.directory.get(key)
                if e.published and (d is None or n not in dict(d.listed())):
                    return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "NoSplitBrainAllocation": no_split_brain_allocation,
    "NoStaleTermWriteAccepted": no_stale_term_write_accepted,
    "DirectoryOnlyListsLiveBytes": directory_only_lists_live_bytes,
    "UnpublishedPurgedAfterRecovery": unpublished_purged_after_recovery,
    "ReadsReturnPublishedBytesOrMiss": reads_return_published_bytes_or_miss,
    "AcknowledgedChangesSurvive": acknowledged_changes_survive,
    "NoPublishedCopyOrphaned": no_published_copy_orphaned,
}

# --------------------------------------------------------------------------
# Model constants, successors and the stated mapping
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    masters: tuple[str, ...]
    nodes: tuple[str, ...]
    keys: tuple[str, ...]
    readers: tuple[str, ...]
    max_term: int
    max_copies: int = 1

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Masters"]), model_names(consts["Nodes"]),
                   model_names(consts["Keys"]), model_names(consts["Readers"]),
                   consts["MaxTerm"], consts["MaxCopies"])

    def initial(self) -> System:
        return System.initial(self.masters, self.nodes, self.readers, self.keys)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    for m in c.masters:
        if sys.coord_term < c.max_term:
            yield from emit("ObtainTerm", sys_obtain_term(sys, m))
        yield from emit("Recover", sys_recover(sys, m))
        yield from emit("Open", sys_open(sys, m))
        yield from emit("Crash", sys_crash(sys, m))
        for n in c.nodes:
            yield from emit("Fence", sys_fence(sys, m, n))
        for k in c.keys:
            for n in c.nodes:
                yield from emit("Allocate", sys_allocate(sys, m, k, n))
            yield from emit("Publish", sys_publish(sys, m, k))
            yield from emit("Remove", sys_remove(sys, m, k))
            for s in c.nodes:
                for d in c.nodes:
                    yield from emit("Repair", sys_repair(sys, m, k, s, d, c.max_copies))
    for r in c.readers:
        for m in c.masters:
            for k in c.keys:
                for n in c.nodes:
                    yield from emit("Lookup", sys_lookup(sys, r, m, k, n))
        yield from emit("Read", sys_read(sys, r))
    for n in c.nodes:
        yield from emit("NodeLost", sys_node_lost(sys, n))


NONE = ModelValue("None")


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping from a :class:`System` to the spec's variables.

    Masters, nodes, keys and readers map to model values of the same name; an
    absent directory or index entry, descriptor or read result to ``None``;
    offsets, lengths and checksums are abstracted away.
    """
    def dir_entry(e: Optional[DirEntry]):
        return NONE if e is None else Fn.of(
            {"nodes": frozenset(ModelValue(n) for n, _ in e.listed()), "pub": e.published})

    def idx_entry(e: Optional[IndexEntry]):
        return NONE if e is None else Fn.of({"term": e.term, "pub": e.published, "by": e.by})

    def descriptor(d: Optional[Descriptor]):
        return NONE if d is None else Fn.of(
            {"key": ModelValue(d.key), "node": ModelValue(d.node), "term": d.term})

    ms = sys.masters
    return Fn.of({
        "coordTerm": sys.coord_term,
        "phase": Fn.of({ModelValue(m): ms[m].phase.value for m in c.masters}),
        "mterm": Fn.of({ModelValue(m): ms[m].term for m in c.masters}),
        "acked": Fn.of({ModelValue(m): frozenset(ModelValue(n) for n in ms[m].acked)
                        for m in c.masters}),
        "dir": Fn.of({ModelValue(m): Fn.of({ModelValue(k): dir_entry(ms[m].directory.get(k))
                                            for k in c.keys}) for m in c.masters}),
        "live": frozenset(ModelValue(n) for n in sys.live),
        "nodeTerm": Fn.of({ModelValue(n): sys.nodes[n].term for n in c.nodes}),
        "idx": Fn.of({ModelValue(n): Fn.of({ModelValue(k): idx_entry(sys.nodes[n].index.get(k))
                                            for k in c.keys}) for n in c.nodes}),
        "desc": function({ModelValue(r): descriptor(sys.desc[r]) for r in c.readers}),
        "got": function({ModelValue(r): idx_entry(sys.got[r]) for r in c.readers}),
        "promised": Fn.of({ModelValue(n): sys.promised.get(n, 0) for n in c.nodes}),
        "staleAccepted": frozenset(ModelValue(n) for n in sys.stale_accepted),
        "told": Fn.of({ModelValue(k): Fn.of({"what": what, "node": NONE if n is None else ModelValue(n)})
                       for k, (what, n) in sys.told.items()}),
    })


BINDING = SpecBinding(
    module="Failover",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
