"""The client's pool of destination buffers of ``spec/Timeout.tla`` as a
mutable, compact core.

Reference machine: :class:`kvproto.statemachines.timeout.Pool` stepped by
:func:`kvproto.statemachines.timeout.pool_step`. :class:`PoolCore` takes the
same events (``AddBuffer``, ``StartRequest``, ``Acquire``, ``Release``,
``Issue``, ``Complete``, ``Timeout``, ``Cancel``, ``CancelAck``, ``GiveUp``,
``RequestCancel``, ``RequestFinish``, ``Consume``), returns the same effects,
refuses with the same single ``Refused`` effect and changes nothing then (a
dropped stale callback counts it in the stats, as the reference does).
:meth:`PoolCore.reference` gives the equal frozen ``Pool``.

:meth:`PoolCore.step_all` steps several events as one: all of them, or, when
one is refused, none (the state as before, and that event's refusal). A block
copy unit issues into every block it writes, and an engine gives back or
reads a run of blocks, this way. A copy unit's ``Issue``s (one request,
distinct buffers, the same sources, none a destination) are checked whole
and then applied, since none changes what another checks.

Layout. Buffers and transfers are dicts of the reference's own frozen
``Buffer`` and ``Transfer`` records (a step stores a new record; a free buffer
is the shared ``FREE_BUFFER``), so the views :attr:`PoolCore.buffers` and
:attr:`PoolCore.transfers` are read-only proxies of them. A request is its
state and two insertion-ordered dicts, its buffers and its undrained
generations. The spec's ``ReadBy`` (an awaited copy still reads a buffer) is
an index, buffer -> the in-flight copies reading it, kept as a copy is issued
and stops being awaited, so ``Release`` and ``Issue`` do not walk the
request's transfers (the reference does, once per event: a copy unit of ``n``
blocks cost it O(n^2)). Every write goes through :meth:`PoolCore._set` or
:meth:`PoolCore._del`, which, inside :meth:`step_all`, journal the old value
so that a refusal undoes the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Optional

import immutables

from kvproto import errors
from kvproto.statemachines.refusal import Refused
from kvproto.statemachines.timeout import (
    FREE_BUFFER, Acquire, AddBuffer, Buffer, BufState, Cancel, CancelAck, Complete, Consume,
    Consumed, Drained, GiveUp, Issue, Issued, Loaded, LoadFailed, Pool, Release, Released,
    ReqState, Request, RequestCancel, RequestDraining, RequestEnded, RequestFinish,
    SendCancel, StartRequest, Stats, Timeout, Transfer, WrittenOff, XferState,
)

_MISSING = object()
_INFLIGHT, _TIMEDOUT, _LEAKED = XferState.INFLIGHT, XferState.TIMEDOUT, XferState.LEAKED
_HELD, _LOADING, _READY, _USED = BufState.HELD, BufState.LOADING, BufState.READY, BufState.USED
_LOST = (BufState.QUARANTINED, BufState.LEAKED)
_IDLE = (BufState.HELD, BufState.READY, BufState.USED)
_ACTIVE, _DRAINING = ReqState.ACTIVE, ReqState.DRAINING
#: the counters, scalar state and observations (``Stats``) alike
_COUNTERS = ("next_gen", "leaked", "stale_dropped", "timed_out", "written_off", "recovered")


def _refused(error: errors.KvError) -> tuple:
    return (Refused(error),)


class PoolCore:
    """The transfer engine's pool: ``step(event) -> effects``, mutating in place.

    Read it as one reads the frozen ``Pool``: :attr:`buffers` (name ->
    ``Buffer``), :attr:`transfers` (generation -> ``Transfer``),
    :attr:`requests` (name -> a view with ``state``, ``buffers`` and
    ``pending``), :attr:`next_gen`, :attr:`leaked`, :attr:`stats`,
    :attr:`max_cancels`, :attr:`max_leaked`. The views are live.
    """

    __slots__ = ("max_cancels", "max_leaked", "_bufs", "_xfers", "_rstate", "_rbufs",
                 "_rpending", "_readers", "_n", "_log", "_handlers", "buffers", "transfers",
                 "requests")

    def __init__(self, buffers: Iterable[str] = (), *, max_cancels: int = 3,
                 max_leaked: int = 4) -> None:
        if max_cancels < 0 or max_leaked < 0:
            raise ValueError("max_cancels and max_leaked must be >= 0")
        self.max_cancels, self.max_leaked = max_cancels, max_leaked
        self._bufs: dict = {}          # buffer -> Buffer
        self._xfers: dict = {}         # generation -> Transfer (drained ones forgotten)
        self._rstate: dict = {}        # request -> ReqState (ended ones forgotten)
        self._rbufs: dict = {}         # request -> {buffer: True}
        self._rpending: dict = {}      # request -> {generation: True}, undrained, not written off
        self._readers: dict = {}       # buffer -> {generation: True}, in-flight copies reading it
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._n["next_gen"] = 1
        self._log: Optional[list] = None
        self._setup()
        for b in buffers:
            effects = self._add_buffer(AddBuffer(b))
            if effects:
                raise ValueError(effects[0].error.message)

    def _setup(self) -> None:
        self._handlers = {
            AddBuffer: self._add_buffer, StartRequest: self._start_request,
            Acquire: self._acquire, Release: self._release, Issue: self._issue,
            Complete: self._complete, Timeout: self._timeout, Cancel: self._cancel,
            CancelAck: self._cancel_ack, GiveUp: self._give_up,
            RequestCancel: self._request_cancel, RequestFinish: self._request_finish,
            Consume: self._consume,
        }
        self.buffers = MappingProxyType(self._bufs)
        self.transfers = MappingProxyType(self._xfers)
        self.requests = _Requests(self)

    # ------------------------------------------------------------------ writes

    def _set(self, d: dict, k, v) -> None:
        if self._log is not None:
            self._log.append((d, k, d.get(k, _MISSING)))
        d[k] = v

    def _del(self, d: dict, k) -> None:
        if self._log is not None:
            self._log.append((d, k, d[k]))
        del d[k]

    def _add(self, counter: str, by: int = 1) -> None:
        self._set(self._n, counter, self._n[counter] + by)

    # ------------------------------------------------------------------ stepping

    def step(self, event) -> tuple:
        """Apply one event (the events of ``timeout.pool_step``)."""
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a pool event: {event!r}") from None
        return handler(event)

    def step_all(self, events: Iterable) -> tuple:
        """Step ``events`` in order, all or none: their effects, or, when one is
        refused, that refusal with the state (stats included) as before."""
        if self._log is not None:
            raise RuntimeError("step_all does not nest")
        if type(events) is not list and type(events) is not tuple:
            events = list(events)
        log = self._log = []
        try:
            if len(events) > 1:
                run = self._runs.get(type(events[0]))
                effects = run(self, events) if run is not None else None
                if effects is not None:
                    return effects
            out: list = []
            for event in events:
                effects = self.step(event)
                if effects and type(effects[0]) is Refused:
                    self._undo(log)
                    return effects
                out.extend(effects)
            return tuple(out)
        except BaseException:
            self._undo(log)
            raise
        finally:
            self._log = None

    def _issue_run(self, events) -> Optional[tuple]:
        """``step_all`` of a copy unit: ``Issue``s of one request into distinct
        buffers with the same sources, none of them a destination. No such
        event changes what another checks (its buffer, that buffer's readers,
        the request, the sources), so all are checked before any is applied:
        the first refusal is the one stepping them in order gives. None when
        the run is not of that shape."""
        first = events[0]
        r, sources = first.request, first.sources
        buffers = []
        for ev in events:
            if type(ev) is not Issue or ev.request != r or (ev.sources is not sources
                                                            and ev.sources != sources):
                return None
            buffers.append(ev.buffer)
        if len(set(buffers)) != len(buffers) or not sources.isdisjoint(buffers):
            return None
        refusal = self._issue_refusal(r, buffers[0], sources)
        if refusal is not None:
            return _refused(refusal)
        bufs, readers = self._bufs, self._readers
        for b in buffers:   # the request and the sources passed: the rest is each buffer's own
            buf = bufs.get(b)
            if buf is None or buf.owner != r or buf.state is not _HELD or b in readers:
                refusal = self._issue_refusal(r, b, ())
                if refusal is not None:
                    return _refused(refusal)
        log, pending, xfers = self._log, self._rpending[r], self._xfers
        gen0 = gen = self._n["next_gen"]
        effects = []
        for b in buffers:
            log.append((pending, gen, _MISSING))
            pending[gen] = True
            log.append((bufs, b, bufs[b]))
            bufs[b] = Buffer(r, gen, _LOADING)
            log.append((xfers, gen, _MISSING))
            xfers[gen] = Transfer(gen, r, b, _INFLIGHT, 0, sources)
            effects.append(Issued(r, b, gen))
            gen += 1
        for src in sources:
            for g in range(gen0, gen):
                reading = readers.get(src)
                if reading is None:
                    self._set(readers, src, {g: True})
                else:
                    self._set(reading, g, True)
        self._set(self._n, "next_gen", gen)
        return tuple(effects)

    _runs = {Issue: _issue_run}

    @staticmethod
    def _undo(log: list) -> None:
        for d, k, old in reversed(log):
            if old is _MISSING:
                del d[k]
            else:
                d[k] = old
        log.clear()

    # ------------------------------------------------------------------ checks shared by events

    def _active(self, request) -> Optional[errors.KvError]:
        """Why ``request`` is not active (None: it is)."""
        state = self._rstate.get(request)
        if state is None:
            return errors.RequestNotActive(f"request {request!r} is unknown or ended")
        if state is not _ACTIVE:
            return errors.RequestNotActive(f"request {request!r} is {state.value}")
        return None

    @staticmethod
    def _buffer_refusal(buf: Optional[Buffer], name, request) -> Optional[errors.KvError]:
        """Why ``request`` may not use ``buf`` at all (None: it owns it)."""
        if buf is None:
            return errors.InvalidArgument(f"no buffer {name!r}")
        if buf.state in _LOST:
            return errors.BufferQuarantined(f"buffer {name!r}: transfer {buf.gen} may still write it")
        if buf.owner != request:
            return errors.BufferBusy(f"buffer {name!r} is not held by {request!r}")
        return None

    def _owned(self, request, buffer) -> Optional[errors.KvError]:
        """Why the active ``request`` does not hold ``buffer`` (None: it does)."""
        refusal = self._active(request)
        if refusal is not None:
            return refusal
        return self._buffer_refusal(self._bufs.get(buffer), buffer, request)

    def _read_refusal(self, request, buffer) -> Optional[errors.KvError]:
        """Spec ``MayReassign``: refused while an awaited copy of ``request``
        still reads ``buffer`` (``ReadBy``; the earliest one is named)."""
        readers = self._readers.get(buffer)
        if not readers:
            return None
        xfers = self._xfers
        gens = [g for g in readers if xfers[g].request == request]
        if not gens:
            return None
        return errors.TransferInFlight(f"buffer {buffer!r}: awaited copy {min(gens)} still reads it")

    def _unread(self, t: Transfer) -> None:
        """Transfer ``t`` is no longer awaited: it reads its sources no more."""
        for src in t.sources:
            readers = self._readers[src]
            if len(readers) == 1:
                self._del(self._readers, src)
            else:
                self._del(readers, t.gen)

    # ------------------------------------------------------------------ events

    def _add_buffer(self, ev: AddBuffer) -> tuple:
        if ev.buffer in self._bufs:
            return _refused(errors.InvalidArgument(f"buffer {ev.buffer!r} already in the pool"))
        self._set(self._bufs, ev.buffer, FREE_BUFFER)
        return ()

    def _start_request(self, ev: StartRequest) -> tuple:
        r = ev.request
        if r in self._rstate:
            return _refused(errors.InvalidArgument(f"request {r!r} already started"))
        self._set(self._rstate, r, _ACTIVE)
        self._set(self._rbufs, r, {})
        self._set(self._rpending, r, {})
        return ()

    def _acquire(self, ev: Acquire) -> tuple:
        """Spec ``Acquire``: an active request takes a free buffer."""
        r, b = ev.request, ev.buffer
        refusal = self._active(r)
        if refusal is not None:
            return _refused(refusal)
        buf = self._bufs.get(b)
        if buf is None:
            return _refused(errors.InvalidArgument(f"no buffer {b!r}"))
        if buf.state in _LOST:
            return _refused(errors.BufferQuarantined(f"buffer {b!r}: transfer {buf.gen} may still write it"))
        if buf.state is not BufState.FREE:
            return _refused(errors.BufferBusy(f"buffer {b!r} is held by {buf.owner!r}"))
        self._set(self._rbufs[r], b, True)
        self._set(self._bufs, b, Buffer(r, 0, _HELD))
        return ()

    def _release(self, ev: Release) -> tuple:
        """Spec ``Release``: only a buffer no transfer may write or awaited copy read goes back."""
        r, b = ev.request, ev.buffer
        refusal = self._owned(r, b)
        if refusal is not None:
            return _refused(refusal)
        buf = self._bufs[b]
        if buf.state is _LOADING:
            return _refused(errors.TransferInFlight(
                f"buffer {b!r}: transfer {buf.gen} in flight; time it out first"))
        refusal = self._read_refusal(r, b)
        if refusal is not None:
            return _refused(refusal)
        self._del(self._rbufs[r], b)
        self._set(self._bufs, b, FREE_BUFFER)
        return (Released(r, b),)

    def _issue_refusal(self, r, b, sources: frozenset) -> Optional[errors.KvError]:
        """Why ``Issue(r, b, sources)`` is refused (None: it may start)."""
        refusal = self._owned(r, b)
        if refusal is not None:
            return refusal
        bufs = self._bufs
        buf = bufs[b]
        if buf.state is _LOADING:
            return errors.TransferInFlight(f"buffer {b!r}: transfer {buf.gen} in flight")
        if buf.state is not _HELD:
            return errors.BufferBusy(f"buffer {b!r} holds loaded data; release it first")
        refusal = self._read_refusal(r, b)
        if refusal is not None:
            return refusal
        for src in sources:
            if src == b:
                return errors.InvalidArgument(f"buffer {src!r} cannot be its own copy's source")
            refusal = self._buffer_refusal(bufs.get(src), src, r)
            if refusal is not None:
                return refusal
            if bufs[src].state is _LOADING:
                return errors.TransferInFlight(f"source {src!r}: transfer {bufs[src].gen} still writes it")
        return None

    def _issue(self, ev: Issue) -> tuple:
        """Spec ``Issue``: a fresh generation for a load into a held buffer."""
        r, b = ev.request, ev.buffer
        refusal = self._issue_refusal(r, b, ev.sources)
        if refusal is not None:
            return _refused(refusal)
        gen = self._n["next_gen"]
        self._set(self._rpending[r], gen, True)
        self._set(self._bufs, b, Buffer(r, gen, _LOADING))
        self._set(self._xfers, gen, Transfer(gen, r, b, sources=ev.sources))
        for src in ev.sources:
            readers = self._readers.get(src)
            if readers is None:
                self._set(self._readers, src, {gen: True})
            else:
                self._set(readers, gen, True)
        self._add("next_gen")
        return (Issued(r, b, gen),)

    def _stale(self, what: str) -> tuple:
        """Drop a callback of a generation no longer tracked; count it."""
        self._add("stale_dropped")
        return _refused(errors.StaleGeneration(what))

    def _settle(self, request, effects: list) -> None:
        """A draining request with nothing left to drain ends."""
        if self._rstate[request] is _DRAINING and not self._rpending[request]:
            effects.append(RequestEnded(request))
            self._del(self._rstate, request)
            self._del(self._rbufs, request)
            self._del(self._rpending, request)

    def _drain(self, t: Transfer) -> tuple:
        """Spec ``Drain``: transfer ``t`` can no longer write; its buffer is freed."""
        self._del(self._xfers, t.gen)
        self._set(self._bufs, t.buffer, FREE_BUFFER)
        effects: list = [Drained(t.gen, t.buffer, was_written_off=t.state is _LEAKED)]
        if t.state is _LEAKED:
            self._add("leaked", -1)
            self._add("recovered")
            return tuple(effects)
        self._del(self._rbufs[t.request], t.buffer)
        self._del(self._rpending[t.request], t.gen)
        self._settle(t.request, effects)
        return tuple(effects)

    def _complete(self, ev: Complete) -> tuple:
        """Spec ``Complete``: apply the callback to its own generation only
        (``Addressee``); a late one is not used (``OnLateCompletion``): drain."""
        t = self._xfers.get(ev.gen)
        if t is None or t.buffer != ev.buffer:
            return self._stale(f"completion of generation {ev.gen} into {ev.buffer!r} is stale")
        if t.state is not _INFLIGHT:
            return self._drain(t)
        self._del(self._rpending[t.request], t.gen)
        self._del(self._xfers, t.gen)
        buf = self._bufs[t.buffer]
        self._set(self._bufs, t.buffer, Buffer(buf.owner, buf.gen, _READY))
        if t.sources:
            self._unread(t)
        return (Loaded(t.request, t.buffer, t.gen),)

    def _stop_waiting(self, t: Transfer) -> None:
        """``t`` is no longer awaited: timed out, its buffer quarantined."""
        self._set(self._xfers, t.gen, Transfer(t.gen, t.request, t.buffer, _TIMEDOUT, t.cancels,
                                               t.sources))
        buf = self._bufs[t.buffer]
        self._set(self._bufs, t.buffer, Buffer(buf.owner, buf.gen, BufState.QUARANTINED))
        if t.sources:
            self._unread(t)

    def _timeout(self, ev: Timeout) -> tuple:
        """Spec ``Timeout``: stop waiting; quarantine the buffer."""
        t = self._xfers.get(ev.gen)
        if t is None or t.state is not _INFLIGHT:
            return _refused(errors.StaleGeneration(f"transfer {ev.gen} is not in flight"))
        self._stop_waiting(t)
        self._add("timed_out")
        error = errors.TransferTimeout(f"transfer {ev.gen} into {t.buffer!r} timed out")
        return (LoadFailed(t.request, t.buffer, t.gen, error),)

    def _cancel(self, ev: Cancel) -> tuple:
        """Spec ``Cancel``: (re)send a cancel, at most ``max_cancels`` times."""
        t = self._xfers.get(ev.gen)
        if t is None:
            return _refused(errors.StaleGeneration(f"transfer {ev.gen} is not tracked"))
        if t.state is _INFLIGHT:
            return _refused(errors.InvalidArgument(f"transfer {ev.gen} has not timed out"))
        if t.state is _LEAKED or t.cancels >= self.max_cancels:
            return _refused(errors.CleanupFailed(
                f"transfer {ev.gen}: {t.cancels} cancel(s) unanswered"))
        t = Transfer(t.gen, t.request, t.buffer, t.state, t.cancels + 1, t.sources)
        self._set(self._xfers, ev.gen, t)
        return (SendCancel(t.gen, t.buffer, t.cancels),)

    def _cancel_ack(self, ev: CancelAck) -> tuple:
        """Spec ``CancelAck``: drain a timed-out or written-off transfer; drop the rest."""
        t = self._xfers.get(ev.gen)
        if t is None or t.state is _INFLIGHT:
            return self._stale(f"cancel ack of generation {ev.gen} is stale")
        return self._drain(t)

    def _give_up(self, ev: GiveUp) -> tuple:
        """Spec ``GiveUp``: write off a transfer whose cancels all went unanswered."""
        t = self._xfers.get(ev.gen)
        if t is None:
            return _refused(errors.StaleGeneration(f"transfer {ev.gen} is not tracked"))
        if t.state is not _TIMEDOUT or t.cancels < self.max_cancels:
            return _refused(errors.InvalidArgument(
                f"transfer {ev.gen} is {t.state.value} with {t.cancels} of {self.max_cancels} cancels sent"))
        leaked = self._n["leaked"]
        if leaked >= self.max_leaked:
            return _refused(errors.LeakBudgetExhausted(
                f"{leaked} buffer(s) already written off (max {self.max_leaked})"))
        self._set(self._xfers, t.gen, Transfer(t.gen, t.request, t.buffer, _LEAKED, t.cancels,
                                               t.sources))
        self._set(self._bufs, t.buffer, Buffer(None, t.gen, BufState.LEAKED))
        self._add("leaked")
        self._add("written_off")
        effects: list = [WrittenOff(t.gen, t.buffer, t.request, errors.CleanupFailed(
            f"transfer {t.gen} into {t.buffer!r}: {t.cancels} cancel(s) unanswered"))]
        self._del(self._rbufs[t.request], t.buffer)
        self._del(self._rpending[t.request], t.gen)
        self._settle(t.request, effects)
        return tuple(effects)

    def _end_request(self, request) -> tuple:
        """Spec ``EndRequest``: abandon in-flight loads (quarantine), release idle
        buffers, then drain what remains."""
        effects: list = []
        xfers, bufs = self._xfers, self._bufs
        abandoned = 0
        for gen in list(self._rpending[request]):
            t = xfers[gen]
            if t.state is _INFLIGHT:
                self._stop_waiting(t)
                abandoned += 1
                effects.append(LoadFailed(request, t.buffer, gen, errors.RequestNotActive(
                    f"request {request!r} ended; transfer {gen} abandoned")))
        held = self._rbufs[request]
        for name in list(held):
            if bufs[name].state in _IDLE:
                self._set(bufs, name, FREE_BUFFER)
                self._del(held, name)
                effects.append(Released(request, name))
        if abandoned:
            self._add("timed_out", abandoned)
        self._set(self._rstate, request, _DRAINING)
        self._settle(request, effects)
        if request in self._rstate:
            effects.append(RequestDraining(request, len(self._rpending[request])))
        return tuple(effects)

    def _request_cancel(self, ev: RequestCancel) -> tuple:
        """Spec ``RequestCancel``: result no longer needed; drain what is in flight."""
        refusal = self._active(ev.request)
        if refusal is not None:
            return _refused(refusal)
        return self._end_request(ev.request)

    def _request_finish(self, ev: RequestFinish) -> tuple:
        """Spec ``RequestFinish``: only with no load still awaited."""
        refusal = self._active(ev.request)
        if refusal is not None:
            return _refused(refusal)
        xfers = self._xfers
        waiting = [g for g in self._rpending[ev.request] if xfers[g].state is _INFLIGHT]
        if waiting:
            return _refused(errors.TransferInFlight(
                f"request {ev.request!r} still awaits transfer(s) {sorted(waiting)}"))
        return self._end_request(ev.request)

    def _consume(self, ev: Consume) -> tuple:
        """Spec ``Consume``: only a buffer whose own transfer completed."""
        r, b = ev.request, ev.buffer
        refusal = self._owned(r, b)
        if refusal is not None:
            return _refused(refusal)
        buf = self._bufs[b]
        if buf.state is not _READY:
            return _refused(errors.BufferNotReady(f"buffer {b!r} is {buf.state.value}"))
        self._set(self._bufs, b, Buffer(buf.owner, buf.gen, _USED))
        return (Consumed(r, b, buf.gen),)

    # ------------------------------------------------------------------ reads

    @property
    def next_gen(self) -> int:
        return self._n["next_gen"]

    @property
    def leaked(self) -> int:
        return self._n["leaked"]

    @property
    def stats(self) -> Stats:
        n = self._n
        return Stats(n["stale_dropped"], n["timed_out"], n["written_off"], n["recovered"])

    # ------------------------------------------------------------------ checks

    def reference(self) -> Pool:
        """The equal frozen :class:`~kvproto.statemachines.timeout.Pool` (O(n); for checks)."""
        return Pool(
            buffers=immutables.Map(self._bufs), transfers=immutables.Map(self._xfers),
            requests=immutables.Map({
                r: Request(state, immutables.Map(self._rbufs[r]), immutables.Map(self._rpending[r]))
                for r, state in self._rstate.items()}),
            next_gen=self.next_gen, leaked=self.leaked, max_cancels=self.max_cancels,
            max_leaked=self.max_leaked, stats=self.stats)

    def copy(self) -> "PoolCore":
        """An independent copy."""
        new = PoolCore.__new__(PoolCore)
        new.max_cancels, new.max_leaked = self.max_cancels, self.max_leaked
        new._bufs, new._xfers, new._rstate = dict(self._bufs), dict(self._xfers), dict(self._rstate)
        new._rbufs = {r: dict(d) for r, d in self._rbufs.items()}
        new._rpending = {r: dict(d) for r, d in self._rpending.items()}
        new._readers = {b: dict(d) for b, d in self._readers.items()}
        new._n = dict(self._n)
        new._log = None
        new._setup()
        return new


# --------------------------------------------------------------------------
# Read views with the frozen Pool's shape
# --------------------------------------------------------------------------


class RequestView:
    """A request that has not ended, as ``timeout.Request`` reads: ``state``,
    and read-only live views of its ``buffers`` and ``pending`` generations."""

    __slots__ = ("state", "buffers", "pending")

    def __init__(self, state: ReqState, buffers: dict, pending: dict) -> None:
        self.state = state
        self.buffers = MappingProxyType(buffers)
        self.pending = MappingProxyType(pending)

    def __repr__(self) -> str:
        return f"RequestView({self.state.value}, buffers={list(self.buffers)}, pending={list(self.pending)})"


class _Requests(Mapping):
    """``request -> RequestView``, requests that have not ended."""

    __slots__ = ("_core",)

    def __init__(self, core: PoolCore) -> None:
        self._core = core

    def __getitem__(self, request) -> RequestView:
        core = self._core
        state = core._rstate[request]
        return RequestView(state, core._rbufs[request], core._rpending[request])

    def __contains__(self, request) -> bool:
        return request in self._core._rstate

    def __len__(self) -> int:
        return len(self._core._rstate)

    def __iter__(self) -> Iterator:
        return iter(list(self._core._rstate))
