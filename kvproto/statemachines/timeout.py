"""Remote-load timeout, quarantine and drain (``spec/Timeout.tla``) as pure,
sans-IO state machines.

The rule: a timeout is the caller's decision, not proof that the transfer
stopped. Two processes take part:

* the client's transfer engine, a :class:`Pool` of destination buffers (host
  staging buffers or GPU blocks) with the transfers into them and the requests
  that own them, stepped by :func:`pool_step`. The engine holds one ``Pool``
  and replaces it only with what ``pool_step`` returns;
* a storage node's (or NIC's) :class:`NodeTransfers`, the transfers it is
  running, stepped by :func:`node_step`. It acknowledges a cancel only once the
  transfer can no longer write, and forgets a transfer in the step that
  finishes it (``Land``, or a ``StorageCancel`` that stops it), so its table
  holds only the transfers in progress; a cancel of a generation it does not
  know is acknowledged without effect.

:class:`System` composes them with the buffers' bytes and the messages between
them into the closed system the spec describes; its actions (:data:`ACTIONS`)
carry the spec's action names and are what the conformance test and the
Hypothesis stateful test drive. Invariants carry the spec's invariant names
(:data:`INVARIANTS`).

How the pool keeps the rule:

* every transfer gets a fresh **generation** (``Issue`` answers with
  :class:`Issued` carrying it); a completion callback or cancel ack names its
  generation, and one the pool no longer tracks is recognised as stale and
  dropped (``Refused(StaleGeneration)``, counted in :class:`Stats`), so
  callbacks are idempotent;
* ``Timeout`` quarantines the buffer: it is handed to no one (``Acquire``,
  ``Issue``, ``Consume`` and ``Release`` refuse it with ``BufferQuarantined``)
  until the transfer's completion or the storage node's cancel ack arrives;
  late bytes are never handed to the request;
* ``RequestCancel``/``RequestFinish`` release a request's idle buffers at once,
  but the request keeps its quarantined buffers and is *draining* until the
  last of its transfers drains; only then is it removed (``RequestEnded``);
* a failed clean-up is bounded and observable: after ``max_cancels``
  unanswered cancels a transfer may be written off (``GiveUp``): its buffer
  moves from the request to the pool's leak ledger (:attr:`Pool.leaked`,
  :class:`WrittenOff` effect), still quarantined, and the request may end. The
  ledger holds at most ``max_leaked`` buffers (``LeakBudgetExhausted``
  beyond), so at most that many buffers are ever lost to silent storage nodes,
  and a draining request always holds a quarantined buffer, so lingering
  requests never outnumber the pool. The write-off is kept tracked: a late
  completion or ack still brings the buffer back;
* a copy may read **sources** of the same pool (``Issue.sources``: a save reads
  device blocks into a staging buffer), buffers its request holds with bytes.
  While the request still awaits the copy, ``Release`` and ``Issue`` refuse its
  sources (``TransferInFlight``: ``SourceNotReassignedWhileRead``); once it
  timed out (or its request ended) its bytes land only in a quarantined
  destination, so the sources may go.

Every step is ``(state, event) -> (state, effects)``. A refused event returns
the state unchanged (the same object) and one :class:`Refused` effect carrying
a typed error from :mod:`kvproto.errors`; a dropped stale callback returns a
state equal to the old one whose :class:`Stats` counted it. Buffers,
transfers and requests live in persistent hash maps, so a step costs
O(log32 n) in their number; ``RequestCancel``/``RequestFinish`` walk the
request's own buffers and transfers once. Which buffer a request takes is an
input (``Acquire.buffer``), like time: the runtime's pool chooses, the machine
accounts.
"""

from __future__ import annotations

import enum
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit, memoised_step
from kvproto.statemachines.reuse import Outcome
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse
from kvproto.checking.tla import Fn, ModelValue, model_names

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


class BufState(str, enum.Enum):
    FREE = "free"                # in the pool
    HELD = "held"                # taken by a request, no transfer into it
    LOADING = "loading"          # a transfer into it is in flight
    READY = "ready"              # its transfer completed; the consumer may read it
    USED = "used"                # the consumer read it
    QUARANTINED = "quarantined"  # its transfer timed out and has not drained
    LEAKED = "leaked"            # quarantined, written off to the leak ledger


class XferState(str, enum.Enum):
    INFLIGHT = "inflight"
    TIMEDOUT = "timedout"        # the client stopped waiting; the buffer is quarantined
    LEAKED = "leaked"            # written off after unanswered cancels


class ReqState(str, enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"        # cancelled or finished; transfers still to drain
    ENDED = "ended"              # only in the spec: the pool forgets ended requests


@attrs.frozen
class Buffer:
    """One destination buffer (``pool[b]`` in the spec). ``gen`` is the
    generation of the transfer it waits for or holds the bytes of (0: none)."""

    owner: Optional[str] = None
    gen: int = 0
    state: BufState = BufState.FREE


FREE_BUFFER = Buffer()


@attrs.frozen
class Transfer:
    """A transfer the client still tracks (``xfer[g]``): in flight, timed out or
    written off. Drained transfers are forgotten."""

    gen: int
    request: str
    buffer: str
    state: XferState = XferState.INFLIGHT
    cancels: int = 0
    sources: frozenset = frozenset()   # buffers of the pool the copy reads


@attrs.frozen
class Request:
    """A request that has not ended: its buffers and its undrained transfers
    (in flight or timed out, not written off), both as persistent sets."""

    state: ReqState = ReqState.ACTIVE
    buffers: immutables.Map = immutables.Map()   # buffer -> True
    pending: immutables.Map = immutables.Map()   # generation -> True


@attrs.frozen
class Stats:
    """Observations, not protocol state: excluded from :class:`Pool` equality.
    No step reads them (tests/stateful/test_caches.py)."""

    stale_dropped: int = 0   # completion callbacks and cancel acks of untracked generations
    timed_out: int = 0       # transfers timed out or abandoned by their request
    written_off: int = 0     # transfers written off (GiveUp)
    recovered: int = 0       # written-off buffers brought back by a late completion or ack


@attrs.frozen(cache_hash=True)
class Pool:
    """The client transfer engine's state."""

    buffers: immutables.Map = immutables.Map()     # buffer -> Buffer
    transfers: immutables.Map = immutables.Map()   # generation -> Transfer
    requests: immutables.Map = immutables.Map()    # request -> Request (ended ones removed)
    next_gen: int = 1
    leaked: int = 0                                # buffers on the leak ledger
    max_cancels: int = 3                           # cancels sent before GiveUp is allowed
    max_leaked: int = 4                            # capacity of the leak ledger
    stats: Stats = attrs.field(default=Stats(), eq=False)


# --------------------------------------------------------------------------
# Events fed to the pool (named after the spec's actions)
# --------------------------------------------------------------------------


@attrs.frozen
class AddBuffer:
    """A buffer joins the pool (part of the spec's ``Init``)."""

    buffer: str


@attrs.frozen
class StartRequest:
    """A request is admitted (part of the spec's ``Init``)."""

    request: str


@attrs.frozen
class Acquire:
    """``Acquire``: the request takes the free ``buffer``."""

    request: str
    buffer: str


@attrs.frozen
class Release:
    """``Release``: the request gives back a buffer no transfer may write."""

    request: str
    buffer: str


@attrs.frozen
class Issue:
    """``Issue``: load into the request's held ``buffer``; answered with :class:`Issued`.
    ``sources``: other buffers the request holds that the copy reads (a save)."""

    request: str
    buffer: str
    sources: frozenset = attrs.field(default=frozenset(), converter=frozenset)


@attrs.frozen
class Complete:
    """``Complete``: the completion callback of transfer ``gen`` into ``buffer``."""

    gen: int
    buffer: str


@attrs.frozen
class Timeout:
    """``Timeout``: the client stops waiting for transfer ``gen``."""

    gen: int


@attrs.frozen
class Cancel:
    """``Cancel``: (re)send a cancel of timed-out transfer ``gen`` to the storage node."""

    gen: int


@attrs.frozen
class CancelAck:
    """``CancelAck``: the storage node's acknowledgement that ``gen`` will not write."""

    gen: int


@attrs.frozen
class GiveUp:
    """``GiveUp``: write off a timed-out transfer whose cancels went unanswered."""

    gen: int


@attrs.frozen
class RequestCancel:
    """``RequestCancel``: the engine no longer needs the request's result."""

    request: str


@attrs.frozen
class RequestFinish:
    """``RequestFinish``: the request is done; none of its loads is still awaited."""

    request: str


@attrs.frozen
class Consume:
    """``Consume``: the consumer reads the request's loaded ``buffer``."""

    request: str
    buffer: str


PoolEvent = Union[AddBuffer, StartRequest, Acquire, Release, Issue, Complete, Timeout,
                  Cancel, CancelAck, GiveUp, RequestCancel, RequestFinish, Consume]

# --------------------------------------------------------------------------
# Effects
# --------------------------------------------------------------------------



@attrs.frozen
class Issued:
    """Start transfer ``gen`` into ``buffer`` (send it to the storage node)."""

    request: str
    buffer: str
    gen: int


@attrs.frozen
class Loaded:
    """Transfer ``gen`` completed: ``buffer`` is ready for the consumer."""

    request: str
    buffer: str
    gen: int


@attrs.frozen
class LoadFailed:
    """The request will not get transfer ``gen``'s bytes (timed out, or abandoned
    when the request ended): recompute; ``buffer`` is quarantined."""

    request: str
    buffer: str
    gen: int
    error: errors.KvError


@attrs.frozen
class SendCancel:
    """Send the storage node a cancel of ``gen`` (attempt ``attempt``)."""

    gen: int
    buffer: str
    attempt: int


@attrs.frozen
class Drained:
    """Transfer ``gen`` can no longer write; ``buffer`` is back in the pool."""

    gen: int
    buffer: str
    was_written_off: bool = False


@attrs.frozen
class WrittenOff:
    """A failed clean-up, reported: ``buffer`` is on the leak ledger."""

    gen: int
    buffer: str
    request: str
    error: errors.KvError


@attrs.frozen
class Released:
    request: str
    buffer: str


@attrs.frozen
class RequestDraining:
    """The request ended for the engine but still owns ``pending`` transfers."""

    request: str
    pending: int


@attrs.frozen
class RequestEnded:
    """The request's last resource is reclaimable; the pool forgot it."""

    request: str


@attrs.frozen
class Consumed:
    request: str
    buffer: str
    gen: int


Effects = tuple

# --------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------



def _active(pool: Pool, request: str):
    """The active request, or the refusal to return."""
    req = pool.requests.get(request)
    if req is None:
        return None, errors.RequestNotActive(f"request {request!r} is unknown or ended")
    if req.state is not ReqState.ACTIVE:
        return None, errors.RequestNotActive(f"request {request!r} is {req.state.value}")
    return req, None


def _buffer_refusal(buf: Optional[Buffer], name: str, request: str) -> Optional[errors.KvError]:
    """Why ``request`` may not use ``buf`` at all (None: it owns it)."""
    if buf is None:
        return errors.InvalidArgument(f"no buffer {name!r}")
    if buf.state in (BufState.QUARANTINED, BufState.LEAKED):
        return errors.BufferQuarantined(f"buffer {name!r}: transfer {buf.gen} may still write it")
    if buf.owner != request:
        return errors.BufferBusy(f"buffer {name!r} is not held by {request!r}")
    return None


def _owned(pool: Pool, request: str, buffer: str):
    """``(req, buf, None)`` when the active ``request`` holds ``buffer``, else the refusal."""
    req, refusal = _active(pool, request)
    if refusal:
        return None, None, refusal
    buf = pool.buffers.get(buffer)
    return req, buf, _buffer_refusal(buf, buffer, request)


def add_buffer(pool: Pool, ev: AddBuffer):
    if ev.buffer in pool.buffers:
        return _refuse(pool, errors.InvalidArgument(f"buffer {ev.buffer!r} already in the pool"))
    return attrs.evolve(pool, buffers=pool.buffers.set(ev.buffer, FREE_BUFFER)), ()


def start_request(pool: Pool, ev: StartRequest):
    if ev.request in pool.requests:
        return _refuse(pool, errors.InvalidArgument(f"request {ev.request!r} already started"))
    return attrs.evolve(pool, requests=pool.requests.set(ev.request, Request())), ()


def acquire(pool: Pool, ev: Acquire):
    """Spec ``Acquire``: an active request takes a free buffer."""
    req, refusal = _active(pool, ev.request)
    if refusal:
        return _refuse(pool, refusal)
    buf = pool.buffers.get(ev.buffer)
    if buf is None:
        return _refuse(pool, errors.InvalidArgument(f"no buffer {ev.buffer!r}"))
    if buf.state in (BufState.QUARANTINED, BufState.LEAKED):
        return _refuse(pool, errors.BufferQuarantined(
            f"buffer {ev.buffer!r}: transfer {buf.gen} may still write it"))
    if buf.state is not BufState.FREE:
        return _refuse(pool, errors.BufferBusy(f"buffer {ev.buffer!r} is held by {buf.owner!r}"))
    req = attrs.evolve(req, buffers=req.buffers.set(ev.buffer, True))
    return attrs.evolve(pool, buffers=pool.buffers.set(ev.buffer, Buffer(ev.request, 0, BufState.HELD)),
                        requests=pool.requests.set(ev.request, req)), ()


def _read_by(pool: Pool, req: Request, buffer: str) -> Optional[int]:
    """Spec ``ReadBy``: the earliest awaited copy of ``req`` that reads ``buffer``,
    if any. (A source is held by its copy's request until the copy is no longer
    awaited.)"""
    return min((gen for gen in req.pending if pool.transfers[gen].state is XferState.INFLIGHT
                and buffer in pool.transfers[gen].sources), default=None)


def _read_refusal(pool: Pool, req: Request, buffer: str) -> Optional[errors.KvError]:
    """Spec ``MayReassign``: refused while an awaited copy still reads ``buffer``."""
    reader = _read_by(pool, req, buffer)
    if reader is None:
        return None
    return errors.TransferInFlight(f"buffer {buffer!r}: awaited copy {reader} still reads it")


def release(pool: Pool, ev: Release):
    """Spec ``Release``: only a buffer no transfer may write or awaited copy read goes back."""
    req, buf, refusal = _owned(pool, ev.request, ev.buffer)
    if refusal:
        return _refuse(pool, refusal)
    if buf.state is BufState.LOADING:
        return _refuse(pool, errors.TransferInFlight(
            f"buffer {ev.buffer!r}: transfer {buf.gen} in flight; time it out first"))
    refusal = _read_refusal(pool, req, ev.buffer)
    if refusal:
        return _refuse(pool, refusal)
    req = attrs.evolve(req, buffers=req.buffers.delete(ev.buffer))
    return (attrs.evolve(pool, buffers=pool.buffers.set(ev.buffer, FREE_BUFFER),
                         requests=pool.requests.set(ev.request, req)),
            (Released(ev.request, ev.buffer),))


def issue(pool: Pool, ev: Issue):
    """Spec ``Issue``: a fresh generation for a load into a held buffer."""
    req, buf, refusal = _owned(pool, ev.request, ev.buffer)
    if refusal:
        return _refuse(pool, refusal)
    if buf.state is BufState.LOADING:
        return _refuse(pool, errors.TransferInFlight(f"buffer {ev.buffer!r}: transfer {buf.gen} in flight"))
    if buf.state is not BufState.HELD:
        return _refuse(pool, errors.BufferBusy(f"buffer {ev.buffer!r} holds loaded data; release it first"))
    refusal = _read_refusal(pool, req, ev.buffer)
    if refusal:
        return _refuse(pool, refusal)
    for src in ev.sources:
        if src == ev.buffer:
            return _refuse(pool, errors.InvalidArgument(f"buffer {src!r} cannot be its own copy's source"))
        refusal = _buffer_refusal(pool.buffers.get(src), src, ev.request)
        if refusal:
            return _refuse(pool, refusal)
        if pool.buffers[src].state is BufState.LOADING:
            return _refuse(pool, errors.TransferInFlight(
                f"source {src!r}: transfer {pool.buffers[src].gen} still writes it"))
    gen = pool.next_gen
    req = attrs.evolve(req, pending=req.pending.set(gen, True))
    new = attrs.evolve(
        pool,
        buffers=pool.buffers.set(ev.buffer, Buffer(ev.request, gen, BufState.LOADING)),
        transfers=pool.transfers.set(gen, Transfer(gen, ev.request, ev.buffer, sources=ev.sources)),
        requests=pool.requests.set(ev.request, req),
        next_gen=gen + 1)
    return new, (Issued(ev.request, ev.buffer, gen),)


def _addressee(pool: Pool, gen: int, buffer: str) -> Optional[Transfer]:
    """Spec ``Addressee(g, b)``: the tracked transfer a callback for generation
    ``gen`` is applied to: transfer ``gen`` itself, or none (stale, dropped)."""
    t = pool.transfers.get(gen)
    if t is None or t.buffer != buffer:
        return None
    return t


def _stale(pool: Pool, what: str):
    """Drop a callback of a generation no longer tracked; count it."""
    stats = attrs.evolve(pool.stats, stale_dropped=pool.stats.stale_dropped + 1)
    return attrs.evolve(pool, stats=stats), (Refused(errors.StaleGeneration(what)),)


def _settle(pool: Pool, request: str, req: Request, effects: list) -> Pool:
    """Store ``req``; a draining request with nothing left to drain ends."""
    if req.state is ReqState.DRAINING and not req.pending:
        effects.append(RequestEnded(request))
        return attrs.evolve(pool, requests=pool.requests.delete(request))
    return attrs.evolve(pool, requests=pool.requests.set(request, req))


def _drain(pool: Pool, t: Transfer):
    """Spec ``Drain``: transfer ``t`` can no longer write; its buffer is freed."""
    pool = attrs.evolve(pool, transfers=pool.transfers.delete(t.gen),
                        buffers=pool.buffers.set(t.buffer, FREE_BUFFER))
    effects: list = [Drained(t.gen, t.buffer, was_written_off=t.state is XferState.LEAKED)]
    if t.state is XferState.LEAKED:
        stats = attrs.evolve(pool.stats, recovered=pool.stats.recovered + 1)
        return attrs.evolve(pool, leaked=pool.leaked - 1, stats=stats), tuple(effects)
    req = pool.requests[t.request]
    req = attrs.evolve(req, buffers=req.buffers.delete(t.buffer), pending=req.pending.delete(t.gen))
    return _settle(pool, t.request, req, effects), tuple(effects)


def _on_late_completion(pool: Pool, t: Transfer):
    """Spec ``OnLateCompletion``: the late bytes are not used; drain."""
    return _drain(pool, t)


def complete(pool: Pool, ev: Complete):
    """Spec ``Complete``: apply the callback to its own generation only."""
    t = _addressee(pool, ev.gen, ev.buffer)
    if t is None:
        return _stale(pool, f"completion of generation {ev.gen} into {ev.buffer!r} is stale")
    if t.state is XferState.INFLIGHT:
        req = pool.requests[t.request]
        req = attrs.evolve(req, pending=req.pending.delete(t.gen))
        buf = pool.buffers[t.buffer]
        new = attrs.evolve(pool, transfers=pool.transfers.delete(t.gen),
                           buffers=pool.buffers.set(t.buffer, attrs.evolve(buf, state=BufState.READY)),
                           requests=pool.requests.set(t.request, req))
        return new, (Loaded(t.request, t.buffer, t.gen),)
    return _on_late_completion(pool, t)


def timeout(pool: Pool, ev: Timeout):
    """Spec ``Timeout``: stop waiting; quarantine the buffer."""
    t = pool.transfers.get(ev.gen)
    if t is None or t.state is not XferState.INFLIGHT:
        return _refuse(pool, errors.StaleGeneration(f"transfer {ev.gen} is not in flight"))
    buf = pool.buffers[t.buffer]
    stats = attrs.evolve(pool.stats, timed_out=pool.stats.timed_out + 1)
    new = attrs.evolve(
        pool,
        transfers=pool.transfers.set(ev.gen, attrs.evolve(t, state=XferState.TIMEDOUT)),
        buffers=pool.buffers.set(t.buffer, attrs.evolve(buf, state=BufState.QUARANTINED)),
        stats=stats)
    error = errors.TransferTimeout(f"transfer {ev.gen} into {t.buffer!r} timed out")
    return new, (LoadFailed(t.request, t.buffer, t.gen, error),)


def cancel(pool: Pool, ev: Cancel):
    """Spec ``Cancel``: (re)send a cancel, at most ``max_cancels`` times."""
    t = pool.transfers.get(ev.gen)
    if t is None:
        return _refuse(pool, errors.StaleGeneration(f"transfer {ev.gen} is not tracked"))
    if t.state is XferState.INFLIGHT:
        return _refuse(pool, errors.InvalidArgument(f"transfer {ev.gen} has not timed out"))
    if t.state is XferState.LEAKED or t.cancels >= pool.max_cancels:
        return _refuse(pool, errors.CleanupFailed(
            f"transfer {ev.gen}: {t.cancels} cancel(s) unanswered"))
    t = attrs.evolve(t, cancels=t.cancels + 1)
    return (attrs.evolve(pool, transfers=pool.transfers.set(ev.gen, t)),
            (SendCancel(t.gen, t.buffer, t.cancels),))


def cancel_ack(pool: Pool, ev: CancelAck):
    """Spec ``CancelAck``: drain a timed-out or written-off transfer; drop the rest."""
    t = pool.transfers.get(ev.gen)
    if t is None or t.state is XferState.INFLIGHT:
        return _stale(pool, f"cancel ack of generation {ev.gen} is stale")
    return _drain(pool, t)


def give_up(pool: Pool, ev: GiveUp):
    """Spec ``GiveUp``: write off a transfer whose cancels all went unanswered."""
    t = pool.transfers.get(ev.gen)
    if t is None:
        return _refuse(pool, errors.StaleGeneration(f"transfer {ev.gen} is not tracked"))
    if t.state is not XferState.TIMEDOUT or t.cancels < pool.max_cancels:
        return _refuse(pool, errors.InvalidArgument(
            f"transfer {ev.gen} is {t.state.value} with {t.cancels} of {pool.max_cancels} cancels sent"))
    if pool.leaked >= pool.max_leaked:
        return _refuse(pool, errors.LeakBudgetExhausted(
            f"{pool.leaked} buffer(s) already written off (max {pool.max_leaked})"))
    stats = attrs.evolve(pool.stats, written_off=pool.stats.written_off + 1)
    pool = attrs.evolve(
        pool,
        transfers=pool.transfers.set(t.gen, attrs.evolve(t, state=XferState.LEAKED)),
        buffers=pool.buffers.set(t.buffer, Buffer(None, t.gen, BufState.LEAKED)),
        leaked=pool.leaked + 1, stats=stats)
    effects: list = [WrittenOff(t.gen, t.buffer, t.request, errors.CleanupFailed(
        f"transfer {t.gen} into {t.buffer!r}: {t.cancels} cancel(s) unanswered"))]
    req = pool.requests[t.request]
    req = attrs.evolve(req, buffers=req.buffers.delete(t.buffer), pending=req.pending.delete(t.gen))
    return _settle(pool, t.request, req, effects), tuple(effects)


def _end_request(pool: Pool, request: str, req: Request):
    """Spec ``EndRequest``: abandon in-flight loads (quarantine), release idle
    buffers, then drain what remains."""
    effects: list = []
    buffers, transfers = pool.buffers, pool.transfers
    kept = req.buffers
    abandoned = 0
    for gen in req.pending:
        t = transfers[gen]
        if t.state is XferState.INFLIGHT:
            transfers = transfers.set(gen, attrs.evolve(t, state=XferState.TIMEDOUT))
            buffers = buffers.set(t.buffer, attrs.evolve(buffers[t.buffer], state=BufState.QUARANTINED))
            abandoned += 1
            effects.append(LoadFailed(request, t.buffer, gen, errors.RequestNotActive(
                f"request {request!r} ended; transfer {gen} abandoned")))
    for name in req.buffers:
        if buffers[name].state in (BufState.HELD, BufState.READY, BufState.USED):
            buffers = buffers.set(name, FREE_BUFFER)
            kept = kept.delete(name)
            effects.append(Released(request, name))
    stats = attrs.evolve(pool.stats, timed_out=pool.stats.timed_out + abandoned)
    pool = attrs.evolve(pool, buffers=buffers, transfers=transfers, stats=stats)
    req = Request(ReqState.DRAINING, kept, req.pending)
    pool = _settle(pool, request, req, effects)
    if request in pool.requests:
        effects.append(RequestDraining(request, len(req.pending)))
    return pool, tuple(effects)


def request_cancel(pool: Pool, ev: RequestCancel):
    """Spec ``RequestCancel``: result no longer needed; drain what is in flight."""
    req, refusal = _active(pool, ev.request)
    if refusal:
        return _refuse(pool, refusal)
    return _end_request(pool, ev.request, req)


def request_finish(pool: Pool, ev: RequestFinish):
    """Spec ``RequestFinish``: only with no load still awaited."""
    req, refusal = _active(pool, ev.request)
    if refusal:
        return _refuse(pool, refusal)
    waiting = [g for g in req.pending if pool.transfers[g].state is XferState.INFLIGHT]
    if waiting:
        return _refuse(pool, errors.TransferInFlight(
            f"request {ev.request!r} still awaits transfer(s) {sorted(waiting)}"))
    return _end_request(pool, ev.request, req)


def consume(pool: Pool, ev: Consume):
    """Spec ``Consume``: only a buffer whose own transfer completed."""
    req, buf, refusal = _owned(pool, ev.request, ev.buffer)
    if refusal:
        return _refuse(pool, refusal)
    if buf.state is not BufState.READY:
        return _refuse(pool, errors.BufferNotReady(f"buffer {ev.buffer!r} is {buf.state.value}"))
    return (attrs.evolve(pool, buffers=pool.buffers.set(ev.buffer, attrs.evolve(buf, state=BufState.USED))),
            (Consumed(ev.request, ev.buffer, buf.gen),))


_POOL_HANDLERS: dict[type, Callable] = {
    AddBuffer: add_buffer, StartRequest: start_request, Acquire: acquire, Release: release,
    Issue: issue, Complete: complete, Timeout: timeout, Cancel: cancel, CancelAck: cancel_ack,
    GiveUp: give_up, RequestCancel: request_cancel, RequestFinish: request_finish,
    Consume: consume,
}


@memoised_step
def pool_step(pool: Pool, event: PoolEvent) -> tuple[Pool, Effects]:
    """Apply one event to the client transfer engine's pool."""
    return _POOL_HANDLERS[type(event)](pool, event)


def new_pool(buffers: Sequence[str], *, max_cancels: int = 3, max_leaked: int = 4) -> Pool:
    """A pool of free ``buffers``."""
    if max_cancels < 0 or max_leaked < 0:
        raise ValueError("max_cancels and max_leaked must be >= 0")
    pool = Pool(max_cancels=max_cancels, max_leaked=max_leaked)
    for b in buffers:
        pool, effects = pool_step(pool, AddBuffer(b))
        if effects:
            raise ValueError(effects[0].error.message)
    return pool


def load_outcome(pool: Pool, buffer: str):
    """The :class:`~kvproto.statemachines.reuse.Outcome` of the load into
    ``buffer``, for :func:`~kvproto.statemachines.reuse.plan_reuse`."""
    buf = pool.buffers[buffer]
    if buf.state in (BufState.READY, BufState.USED):
        return Outcome.LOADED
    if buf.state is BufState.LOADING:
        return Outcome.IN_FLIGHT
    if buf.state in (BufState.QUARANTINED, BufState.LEAKED):
        return Outcome.TIMED_OUT
    return Outcome.MISSING


# --------------------------------------------------------------------------
# Storage node / NIC: the transfers it runs
# --------------------------------------------------------------------------


class WireState(str, enum.Enum):
    RUNNING = "running"   # the only state a record has: finished transfers are forgotten


@attrs.frozen
class WireTransfer:
    buffer: str
    state: WireState = WireState.RUNNING


@attrs.frozen
class NodeTransfers:
    """A storage node's (or NIC's) transfers in progress: generation ->
    :class:`WireTransfer`. A transfer that landed or was stopped is forgotten,
    so the table is bounded by the transfers in flight (``NodeTableBounded``)."""

    transfers: immutables.Map = immutables.Map()


@attrs.frozen
class Start:
    """The client's :class:`Issued`: start transfer ``gen`` into ``buffer``."""

    gen: int
    buffer: str


@attrs.frozen
class Land:
    """``Land``: transfer ``gen`` finished; its bytes are in its buffer."""

    gen: int


@attrs.frozen
class StorageCancel:
    """``StorageCancel``: a cancel of ``gen`` reached the storage node."""

    gen: int


@attrs.frozen
class CompletionSent:
    gen: int
    buffer: str


@attrs.frozen
class AckSent:
    """Acknowledge the cancel of ``gen``; ``stopped``: it stopped a running
    transfer (otherwise the node did not know ``gen``: it had landed or been
    stopped and was forgotten)."""

    gen: int
    stopped: bool = False


@memoised_step
def node_step(node: NodeTransfers, event) -> tuple[NodeTransfers, Effects]:
    """Apply one event to a storage node's transfers.

    A transfer is recorded when its load arrives (``Start``) and forgotten in
    the step that finishes it: ``Land`` (answered with the completion, which
    carries the buffer) or a ``StorageCancel`` that stops it. A cancel stops a
    running transfer before it is acknowledged, so the ack promises that the
    transfer will never write again. A cancel of a generation the node does
    not know is acknowledged without effect: the cancel travels after its load
    on the same ordered connection, so that transfer already landed or was
    stopped (or its load was lost and never runs). Cancels are idempotent:
    every one is acknowledged. A ``Land`` of a generation the node does not
    know (a load a cancel stopped before it ran) is refused: it must not write.
    """
    t = node.transfers.get(event.gen)
    if isinstance(event, Start):
        if t is not None:
            return _refuse(node, errors.InvalidArgument(f"transfer {event.gen} already started"))
        return NodeTransfers(node.transfers.set(event.gen, WireTransfer(event.buffer))), ()
    if isinstance(event, Land):
        if t is None:
            return _refuse(node, errors.StaleGeneration(
                f"transfer {event.gen} is not running (stopped by a cancel, or unknown)"))
        return (NodeTransfers(node.transfers.delete(event.gen)),
                (CompletionSent(event.gen, t.buffer),))
    if isinstance(event, StorageCancel):
        if t is None:
            return node, (AckSent(event.gen),)
        return NodeTransfers(node.transfers.delete(event.gen)), (AckSent(event.gen, stopped=True),)
    raise TypeError(f"not a storage-node event: {event!r}")


# --------------------------------------------------------------------------
# The closed system of the spec: pool + storage node + bytes + messages
# --------------------------------------------------------------------------


@attrs.frozen(cache_hash=True)
class System:
    pool: Pool
    node: NodeTransfers = NodeTransfers()
    moving: frozenset = frozenset()            # physical: (gen, buffer) of transfers that may still write
    data: immutables.Map = immutables.Map()   # buffer -> generation whose bytes it holds
    callbacks: frozenset = frozenset()         # completions sent, (gen, buffer) (deliverable again and again)
    cancels: frozenset = frozenset()           # cancels sent to the storage node
    acks: frozenset = frozenset()              # cancel acks sent to the client
    timed_out: frozenset = frozenset()         # history: generations the client stopped waiting for
    consumed: frozenset = frozenset()          # history: (generation expected, generation read)

    @classmethod
    def initial(cls, buffers: Sequence[str], requests: Sequence[str], *,
                max_cancels: int = 3, max_leaked: int = 4) -> "System":
        pool = new_pool(buffers, max_cancels=max_cancels, max_leaked=max_leaked)
        for r in requests:
            pool, _ = pool_step(pool, StartRequest(r))
        return cls(pool, data=immutables.Map({b: 0 for b in buffers}))

    def _with(self, **changes) -> "System":
        return attrs.evolve(self, **changes)

    def _pool(self, event) -> tuple["System", Effects]:
        """Step the pool and deliver its effects to the rest of the system."""
        pool, effects = pool_step(self.pool, event)
        if pool is self.pool:
            return self, effects
        node, moving = self.node, self.moving
        cancels, timed_out, consumed = self.cancels, self.timed_out, self.consumed
        for eff in effects:
            if isinstance(eff, Issued):
                node, _ = node_step(node, Start(eff.gen, eff.buffer))
                moving = moving | {(eff.gen, eff.buffer)}
            elif isinstance(eff, SendCancel):
                cancels = cancels | {eff.gen}
            elif isinstance(eff, LoadFailed):
                timed_out = timed_out | {eff.gen}
            elif isinstance(eff, Consumed):
                consumed = consumed | {(eff.gen, self.data[eff.buffer])}
        return self._with(pool=pool, node=node, moving=moving, cancels=cancels,
                          timed_out=timed_out, consumed=consumed), effects



def _client(event) -> Optional[System]:
    def act(sys: System) -> Optional[System]:
        new, effects = sys._pool(event)
        return new if _accepted(effects) else None
    return act


def sys_acquire(sys: System, r: str, b: str) -> Optional[System]:
    return _client(Acquire(r, b))(sys)


def sys_release(sys: System, r: str, b: str) -> Optional[System]:
    return _client(Release(r, b))(sys)


def sys_issue(sys: System, r: str, b: str, s=frozenset()) -> Optional[System]:
    return _client(Issue(r, b, s))(sys)


def sys_consume(sys: System, r: str, b: str) -> Optional[System]:
    return _client(Consume(r, b))(sys)


def sys_timeout(sys: System, g: int) -> Optional[System]:
    return _client(Timeout(g))(sys)


def sys_cancel(sys: System, g: int) -> Optional[System]:
    return _client(Cancel(g))(sys)


def sys_give_up(sys: System, g: int) -> Optional[System]:
    return _client(GiveUp(g))(sys)


def sys_request_cancel(sys: System, r: str) -> Optional[System]:
    return _client(RequestCancel(r))(sys)


def sys_request_finish(sys: System, r: str) -> Optional[System]:
    return _client(RequestFinish(r))(sys)


def sys_complete(sys: System, g: int, b: str) -> Optional[System]:
    """Deliver transfer ``g``'s completion callback into ``b`` (again, if it
    was before). A stale one is dropped: the result equals ``sys``."""
    if (g, b) not in sys.callbacks:
        return None
    return sys._pool(Complete(g, b))[0]


def sys_cancel_ack(sys: System, g: int) -> Optional[System]:
    """Deliver the cancel ack of ``g`` (again, if it was before)."""
    if g not in sys.acks:
        return None
    return sys._pool(CancelAck(g))[0]


def sys_land(sys: System, g: int) -> Optional[System]:
    """Transfer ``g`` completes: its bytes land, its callback (naming the
    buffer) is sent, and the node forgets it."""
    moving = [m for m in sys.moving if m[0] == g]
    if not moving:
        return None
    node, effects = node_step(sys.node, Land(g))
    assert _accepted(effects), "a transfer in progress is one the node knows"
    (sent,) = effects
    return sys._with(node=node, moving=sys.moving - {moving[0]}, data=sys.data.set(sent.buffer, g),
                     callbacks=sys.callbacks | {(g, sent.buffer)})


def sys_storage_cancel(sys: System, g: int) -> Optional[System]:
    """A cancel of ``g`` reaches the storage node: stop (and forget) it if it
    still runs, then acknowledge, known or not."""
    if g not in sys.cancels:
        return None
    running = sys.node.transfers.get(g)
    node, (ack,) = node_step(sys.node, StorageCancel(g))
    moving = sys.moving - {(g, running.buffer)} if ack.stopped else sys.moving
    return sys._with(node=node, moving=moving, acks=sys.acks | {g})


#: The spec's actions, each as a function on :class:`System` that returns the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "Acquire": sys_acquire,
    "Release": sys_release,
    "Issue": sys_issue,
    "Consume": sys_consume,
    "Land": sys_land,
    "Complete": sys_complete,
    "Timeout": sys_timeout,
    "Cancel": sys_cancel,
    "StorageCancel": sys_storage_cancel,
    "CancelAck": sys_cancel_ack,
    "GiveUp": sys_give_up,
    "RequestCancel": sys_request_cancel,
    "RequestFinish": sys_request_finish,
}

# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------

_LOADED = (BufState.READY, BufState.USED)


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``, plus the agreement of the pool's redundant indexes
    (each request's buffer and pending sets, the leak count) with the records."""
    pool = sys.pool
    owned: dict[str, set] = {}
    for name, buf in pool.buffers.items():
        if not (isinstance(buf, Buffer) and isinstance(buf.state, BufState)
                and 0 <= buf.gen < pool.next_gen):
            return False
        if (buf.state in (BufState.FREE, BufState.LEAKED)) != (buf.owner is None):
            return False
        if buf.state in (BufState.FREE, BufState.HELD) and buf.gen != 0:
            return False
        if buf.owner is not None:
            owned.setdefault(buf.owner, set()).add(name)
    pending: dict[str, set] = {}
    for gen, t in pool.transfers.items():
        if not (isinstance(t, Transfer) and t.gen == gen and 0 < gen < pool.next_gen
                and 0 <= t.cancels <= pool.max_cancels and t.buffer in pool.buffers
                and isinstance(t.sources, frozenset) and t.buffer not in t.sources
                and all(c in pool.buffers for c in t.sources)):
            return False
        if t.state is not XferState.LEAKED:
            pending.setdefault(t.request, set()).add(gen)
    for name, req in pool.requests.items():
        if req.state is ReqState.ENDED:
            return False
        if set(req.buffers) != owned.pop(name, set()) or set(req.pending) != pending.pop(name, set()):
            return False
    if owned or pending:
        return False
    if pool.leaked != sum(b.state is BufState.LEAKED for b in pool.buffers.values()):
        return False
    sent = {g for g, _ in sys.callbacks | sys.moving} | sys.cancels | sys.acks
    return (all(0 < g < pool.next_gen for g in sent)
            and all(b in pool.buffers for _, b in sys.callbacks | sys.moving)
            and all(isinstance(w, WireTransfer) and w.state is WireState.RUNNING
                    and w.buffer in pool.buffers and 0 < g < pool.next_gen
                    for g, w in sys.node.transfers.items()))


def no_write_into_reassigned_buffer(sys: System) -> bool:
    """Spec ``NoWriteIntoReassignedBuffer``: the buffer a transfer in
    progress may write still waits for that transfer's generation."""
    for gen, b in sys.moving:
        buf = sys.pool.buffers[b]
        if buf.gen != gen or buf.state not in (BufState.LOADING, BufState.QUARANTINED,
                                               BufState.LEAKED):
            return False
    return True


def source_not_reassigned_while_read(sys: System) -> bool:
    """Spec ``SourceNotReassignedWhileRead``: the sources of an awaited copy
    that may still read them stay held by its request, with bytes."""
    pool = sys.pool
    moving = {g for g, _ in sys.moving}
    for gen, t in pool.transfers.items():
        if t.state is XferState.INFLIGHT and gen in moving:
            for c in t.sources:
                buf = pool.buffers[c]
                if buf.owner != t.request or buf.state not in (BufState.HELD, *_LOADED):
                    return False
    return True


def node_knows_what_moves(sys: System) -> bool:
    """Spec ``NodeKnowsWhatMoves``: the node never forgot a transfer that may
    still write, so acknowledging a cancel of an unknown generation is safe."""
    return all(sys.node.transfers.get(g) == WireTransfer(b) for g, b in sys.moving)


def node_table_bounded(sys: System) -> bool:
    """Spec ``NodeTableBounded``: the node keeps only transfers in progress."""
    return all(w.state is WireState.RUNNING and (g, w.buffer) in sys.moving
               for g, w in sys.node.transfers.items())


def stale_callbacks_have_no_effect(sys: System) -> bool:
    """Spec ``StaleCallbacksHaveNoEffect``: a buffer is ready only with its own
    generation's bytes, and the consumer reads the generation it expects."""
    return (all(sys.data[name] == buf.gen for name, buf in sys.pool.buffers.items()
                if buf.state in _LOADED)
            and all(expected == read for expected, read in sys.consumed))


def no_consume_of_timed_out_data(sys: System) -> bool:
    """Spec ``NoConsumeOfTimedOutData``."""
    return (all(buf.gen not in sys.timed_out for buf in sys.pool.buffers.values()
                if buf.state in _LOADED)
            and all(e not in sys.timed_out and r not in sys.timed_out for e, r in sys.consumed))


def request_ends_only_after_drain(sys: System) -> bool:
    """Spec ``RequestEndsOnlyAfterDrain``: a request the pool forgot (ended)
    holds no buffer and owns no undrained transfer."""
    live = sys.pool.requests
    return (all(buf.owner is None or buf.owner in live for buf in sys.pool.buffers.values())
            and all(t.request in live for t in sys.pool.transfers.values()
                    if t.state is not XferState.LEAKED))


def leak_bounded(sys: System) -> bool:
    """Spec ``LeakBounded``: the ledger holds at most ``max_leaked`` buffers, and
    a draining request holds a quarantined buffer."""
    pool = sys.pool
    leaked = sum(b.state is BufState.LEAKED for b in pool.buffers.values())
    return leaked <= pool.max_leaked and all(
        any(pool.buffers[b].state is BufState.QUARANTINED for b in req.buffers)
        for req in pool.requests.values() if req.state is ReqState.DRAINING)


def buffers_accounted(sys: System) -> bool:
    """Spec ``BuffersAccounted``: every buffer out of the free pool is held by a
    live request or on the leak ledger with its written-off transfer tracked."""
    pool = sys.pool
    for name, buf in pool.buffers.items():
        if buf == FREE_BUFFER:
            continue
        t = pool.transfers.get(buf.gen)
        if buf.state is BufState.LEAKED:
            if not (buf.owner is None and t is not None and t.state is XferState.LEAKED
                    and t.buffer == name):
                return False
        elif buf.owner is None or buf.owner not in pool.requests:
            return False
        elif buf.state in (BufState.LOADING, BufState.QUARANTINED):
            if t is None or t.buffer != name or t.request != buf.owner:
                return False
        elif buf.state in (BufState.HELD, *_LOADED) and buf.gen != 0 and t is not None:
            return False
    return True


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "NoWriteIntoReassignedBuffer": no_write_into_reassigned_buffer,
    "StaleCallbacksHaveNoEffect": stale_callbacks_have_no_effect,
    "NoConsumeOfTimedOutData": no_consume_of_timed_out_data,
    "RequestEndsOnlyAfterDrain": request_ends_only_after_drain,
    "LeakBounded": leak_bounded,
    "BuffersAccounted": buffers_accounted,
    "NodeKnowsWhatMoves": node_knows_what_moves,
    "NodeTableBounded": node_table_bounded,
    "SourceNotReassignedWhileRead": source_not_reassigned_while_read,
}



# --------------------------------------------------------------------------
# Model constants and the successor relation (for conformance and exploration)
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    """The spec's CONSTANTS; buffers and requests are model-value names."""

    buffers: tuple[str, ...]
    requests: tuple[str, ...]
    max_gen: int
    max_cancels: int
    max_leaked: int

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Buffers"]), model_names(consts["Requests"]), consts["MaxGen"],
                   consts["MaxCancels"], consts["MaxLeaked"])

    def initial(self) -> System:
        return System.initial(self.buffers, self.requests,
                              max_cancels=self.max_cancels, max_leaked=self.max_leaked)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    for r in c.requests:
        for b in c.buffers:
            yield from emit("Acquire", sys_acquire(sys, r, b))
            yield from emit("Release", sys_release(sys, r, b))
            if sys.pool.next_gen <= c.max_gen:
                for s in _subsets(c.buffers):
                    yield from emit("Issue", sys_issue(sys, r, b, s))
            yield from emit("Consume", sys_consume(sys, r, b))
    for g in range(1, c.max_gen + 1):
        yield from emit("Land", sys_land(sys, g))
        yield from emit("Timeout", sys_timeout(sys, g))
        yield from emit("Cancel", sys_cancel(sys, g))
        yield from emit("StorageCancel", sys_storage_cancel(sys, g))
        yield from emit("CancelAck", sys_cancel_ack(sys, g))
        yield from emit("GiveUp", sys_give_up(sys, g))
    for g in range(1, c.max_gen + 1):
        for b in c.buffers:
            yield from emit("Complete", sys_complete(sys, g, b))
    for r in c.requests:
        yield from emit("RequestCancel", sys_request_cancel(sys, r))
        yield from emit("RequestFinish", sys_request_finish(sys, r))


def _subsets(items: Sequence[str]) -> Iterator[frozenset]:
    """``SUBSET items``."""
    for mask in range(1 << len(items)):
        yield frozenset(x for i, x in enumerate(items) if mask >> i & 1)


NONE = ModelValue("None")


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping from a Python :class:`System` to the spec's variables.

    Buffers and requests map to model values of the same name, generation ``g``
    to index ``g`` of ``xfer`` and ``wire`` (functions over ``1..MaxGen``, so
    tuples), an absent owner, transfer or request record (a transfer the node
    forgot included) to the model value ``None``, a ``(gen, buffer)`` pair of
    ``moving`` or ``callbacks`` to ``<<gen, buffer>>``, and a request the pool
    forgot to ``"ended"``. :class:`Stats` are observations and are not mapped.
    """
    pool = sys.pool

    def mv(name):
        return NONE if name is None else ModelValue(name)

    def xfer(g: int):
        t = pool.transfers.get(g)
        if t is None:
            return NONE
        return Fn.of({"req": mv(t.request), "buf": mv(t.buffer),
                      "src": frozenset(ModelValue(c) for c in t.sources), "st": t.state.value,
                      "cancels": t.cancels})

    def wire(g: int):
        w = sys.node.transfers.get(g)
        return NONE if w is None else Fn.of({"buf": mv(w.buffer), "st": w.state.value})

    def req(r: str) -> str:
        record = pool.requests.get(r)
        return ReqState.ENDED.value if record is None else record.state.value

    gens = range(1, c.max_gen + 1)
    return Fn.of({
        "pool": Fn.of({ModelValue(b): Fn.of({"owner": mv(buf.owner), "gen": buf.gen,
                                              "st": buf.state.value})
                       for b, buf in pool.buffers.items()}),
        "xfer": tuple(xfer(g) for g in gens),
        "req": Fn.of({ModelValue(r): req(r) for r in c.requests}),
        "nextGen": pool.next_gen,
        "wire": tuple(wire(g) for g in gens),
        "moving": frozenset((g, ModelValue(b)) for g, b in sys.moving),
        "data": Fn.of({ModelValue(b): sys.data[b] for b in c.buffers}),
        "cbs": frozenset((g, ModelValue(b)) for g, b in sys.callbacks),
        "cancels": frozenset(sys.cancels),
        "acks": frozenset(sys.acks),
        "timedOut": frozenset(sys.timed_out),
        "consumed": frozenset(sys.consumed),
    })


BINDING = SpecBinding(
    module="Timeout",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
