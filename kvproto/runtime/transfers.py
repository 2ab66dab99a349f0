"""The client's transfer engine: loads into destination buffers under the
Timeout protocol (``spec/Timeout.tla``, ``docs/protocols/timeout.md``).

A :class:`TransferEngine` belongs to a :class:`~kvproto.runtime.client.Client`
(``client.transfer_engine(...)``). It holds

* a :class:`BufferPool`: ``count`` host buffers of ``size`` bytes, slices of one
  numpy array or the ``memory`` given (page-locked memory, for the GPU layer),
  and the pool machine's state, the fast core
  :class:`~kvproto.cores.pool.PoolCore` held to the reference
  :func:`~kvproto.statemachines.timeout.pool_step`. The engine changes buffer,
  transfer and request state **only** by stepping it and carrying out the
  effects it returns; the counts it reports (free, held, quarantined, leaked,
  stale completions dropped, ...) are read from that state;
* an I/O thread that owns the engine's sockets to the storage nodes. It sends
  ``load`` and ``cancel`` requests and receives the replies, landing a load's
  bytes in its destination buffer asynchronously, the way a NIC or a DMA engine
  would, while the caller is free to stop waiting.

A load (:meth:`EngineRequest.load`, :meth:`EngineRequest.get_into`,
``client.get_into``):

1. ``read_begin`` at the master (pin + replica descriptors), on the client's
   master connection; a miss raises ``KeyNotFound`` and touches no buffer;
2. ``Issue`` -> ``Issued(gen)``: the I/O thread sends ``load`` (segment, offset,
   token, length, owner, ``xfer=gen``, buffer name) to one replica's storage
   node (replicas are spread by token; there is no fall-back to another replica
   within one load: a failed load is a failed load and the engine recomputes);
3. the reply carries ``{"xfer": gen, "buffer": name}`` and the bytes. The I/O
   thread writes the bytes into the buffer **only if the pool still tracks
   transfer ``gen`` into that buffer** (the machine's addressee), then steps
   ``Complete(gen, buffer)``: ``Loaded`` (the caller may ``consume``),
   ``Drained`` (a late completion of a timed-out transfer: the bytes are not
   used, the buffer leaves quarantine) or ``Refused(StaleGeneration)`` (a
   duplicate, or a completion that a cancel ack overtook: nothing is written,
   ``Stats.stale_dropped`` counts it);
4. when the load's deadline passes first (the waiting caller's ``timeout``, or
   the I/O thread's timer when no one waits), the engine steps ``Timeout`` ->
   ``LoadFailed`` (the caller gets :class:`~kvproto.errors.TransferTimeout`, the
   buffer is quarantined) and ``Cancel`` -> ``SendCancel``: a ``cancel`` goes to
   the node on the same connection as the load (so it never overtakes it). The
   node answers with an ack; ``CancelAck`` drains the transfer. Unanswered
   cancels are re-sent every ``cancel_interval`` seconds up to ``max_cancels``
   times, then the transfer is written off (``GiveUp`` -> ``WrittenOff``: the
   buffer goes on the leak ledger, still quarantined, and comes back if the
   completion or ack ever arrives). A written-off transfer's cancel is sent
   again every ``written_off_probe`` seconds (no machine step: the same
   message), so that once a partition heals the node's ack brings the buffer
   back. ``LeakBudgetExhausted`` is retried later;
5. the pin is released (``read_end``, fire-and-forget from the I/O thread) when
   the transfer completes, drains or is written off.

A load the node *refuses* (a stale token, a lost segment) is answered with an
error and no bytes. The pool machine has no "failed completion" event (its
loads end by ``Complete``, ``Timeout`` or the request ending), so the engine
treats it as giving up on the load: ``Timeout`` (the caller gets the node's
error, not ``TransferTimeout``) and ``Cancel``; the node finished and forgot
the refused transfer, so the cancel is acknowledged (as an unknown generation)
and the buffer drains after one more round trip.

Requests (:meth:`TransferEngine.request`): ``acquire`` a free buffer (the pool
hands out only free ones), ``load``/``get_into`` into it, ``consume`` it (the
only way to read loaded bytes), ``release`` it; ``cancel()`` (``RequestCancel``:
in-flight loads are abandoned and cancelled like timeouts) or ``finish()``
(``RequestFinish``); ``drain(timeout)`` waits until the request's last transfer
completed, drained or was written off; ``usable_prefix(chunks)`` is
:func:`~kvproto.statemachines.reuse.plan_reuse` over the chunks' load outcomes
read from the pool.

Threads: any thread may use the engine; the pool state is guarded by one
condition variable, held only for machine steps and the copy of a completion's
bytes into its buffer. Generations are per engine, so the node keys its
transfer table by ``owner`` (the engine's id).

What the engine does not do: a view returned by ``consume`` stays valid after
``release`` (Python cannot revoke it): do not keep it. (The node forgets a
transfer once it landed or was stopped, so its table for this engine holds only
the loads it has received and not yet run.)
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import uuid
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

import attrs
import numpy as np
import zmq

from kvproto import errors
from kvproto.cores.pool import PoolCore
from kvproto.runtime import wire
from kvproto.statemachines import timeout as T
from kvproto.statemachines.reuse import Outcome, RankLoad, ReusePlan, plan_reuse

if TYPE_CHECKING:  # pragma: no cover
    from kvproto.runtime.client import Client

_LOAD, _CANCEL = 0, 1  # request id = gen << 1 | kind


@attrs.frozen
class PoolBuffer:
    """A handle to one pool buffer held by ``request`` of ``engine``."""

    name: str
    request: str
    engine: Any = attrs.field(default=None, eq=False, repr=False)


class MachinePool:
    """Named destination buffers whose state is the pool machine's: a
    :class:`~kvproto.cores.pool.PoolCore` (read as the frozen
    :class:`~kvproto.statemachines.timeout.Pool` is), changed only by
    :meth:`step` and :meth:`step_all`.

    The one piece of code that owns a pool machine for the runtime: the host
    :class:`BufferPool` here and the device block pool
    (:class:`kvproto.gpu.BlockPool`) are both this, with different memory.
    Callers step it under their own lock.
    """

    def __init__(self, names: Iterable[str], *, max_cancels: int = 3, max_leaked: int = 4) -> None:
        self.names = list(names)
        if not self.names:
            raise ValueError("a pool needs at least one buffer")
        self.state = PoolCore(self.names, max_cancels=max_cancels, max_leaked=max_leaked)

    def step(self, event) -> tuple:
        return self.state.step(event)

    def step_all(self, events: Iterable) -> tuple:
        """Step ``events`` all or none (:meth:`~kvproto.cores.pool.PoolCore.step_all`)."""
        return self.state.step_all(events)

    def first_free(self) -> Optional[str]:
        for name in self.names:
            if self.state.buffers[name].state is T.BufState.FREE:
                return name
        return None

    def counts(self) -> dict:
        """Buffers by fate, and the machine's observations."""
        by = {s: 0 for s in T.BufState}
        for name in self.names:   # this pool's buffers (a machine may hold others too)
            by[self.state.buffers[name].state] += 1
        st = self.state.stats
        return {
            "free": by[T.BufState.FREE],
            "held": by[T.BufState.HELD] + by[T.BufState.LOADING] + by[T.BufState.READY]
            + by[T.BufState.USED],
            "loading": by[T.BufState.LOADING],
            "quarantined": by[T.BufState.QUARANTINED],
            "leaked": by[T.BufState.LEAKED],
            "transfers": len(self.state.transfers),
            "requests": len(self.state.requests),
            "stale_dropped": st.stale_dropped, "timed_out": st.timed_out,
            "written_off": st.written_off, "recovered": st.recovered,
        }


class BufferPool(MachinePool):
    """``count`` host buffers of ``size`` bytes and the pool machine's state.

    ``memory``, when given, is the host memory to slice (a 1-D ``uint8`` numpy
    array of at least ``count * size`` bytes, e.g. a view of page-locked
    memory); by default a fresh numpy array. The engine steps :attr:`state`
    under its lock; everything else here reads it.
    """

    def __init__(self, count: int, size: int, *, max_cancels: int = 3, max_leaked: int = 4,
                 memory: Optional[np.ndarray] = None) -> None:
        if count < 1 or size < 1:
            raise ValueError("a pool needs at least one buffer of at least one byte")
        super().__init__([f"b{i}" for i in range(count)], max_cancels=max_cancels, max_leaked=max_leaked)
        self.count = count
        self.size = size
        if memory is None:
            memory = np.zeros(count * size, dtype=np.uint8)
        elif memory.dtype != np.uint8 or memory.ndim != 1 or memory.nbytes < count * size:
            raise ValueError(f"memory must be a 1-D uint8 array of at least {count * size} bytes")
        self.memory = memory
        self._views = {n: memoryview(self.memory[i * size:(i + 1) * size]) for i, n in enumerate(self.names)}

    def view(self, name: str) -> memoryview:
        """The raw bytes of buffer ``name`` (for the engine and tests)."""
        return self._views[name]


class _Xfer:
    """The engine's record of one load (what the I/O thread needs to carry it)."""

    __slots__ = ("gen", "request", "buffer", "endpoint", "key", "token", "length", "deadline",
                 "done", "error", "pinned")

    def __init__(self, gen, request, buffer, endpoint, key, token, length, deadline) -> None:
        self.gen, self.request, self.buffer, self.endpoint = gen, request, buffer, endpoint
        self.key, self.token, self.length, self.deadline = key, token, length, deadline
        self.done = threading.Event()
        self.error: Optional[errors.KvError] = None
        self.pinned = True


class Transfer:
    """A load in flight; :meth:`wait` for it."""

    def __init__(self, engine: "TransferEngine", x: _Xfer) -> None:
        self._engine = engine
        self._x = x
        self.gen = x.gen
        self.buffer = PoolBuffer(x.buffer, x.request, engine)

    def done(self) -> bool:
        return self._x.done.is_set()

    def wait(self) -> PoolBuffer:
        """Wait until the load completes or its deadline passes. Returns the
        buffer, ready to consume, or raises :class:`~kvproto.errors.TransferTimeout`
        (the buffer is quarantined) or the load's error."""
        x = self._x
        if not x.done.wait(max(x.deadline - time.monotonic(), 0.0)):
            self._engine._expire(x.gen)
        x.done.wait()
        if x.error is not None:
            raise x.error
        return self.buffer


class EngineRequest:
    """One inference request's use of the engine (see the module docstring)."""

    def __init__(self, engine: "TransferEngine", name: str) -> None:
        self.engine = engine
        self.name = name

    def acquire(self) -> PoolBuffer:
        """Take a free buffer (``BufferBusy`` when none is free)."""
        return self.engine._acquire(self.name)

    def release(self, buf: PoolBuffer) -> None:
        self.engine._simple(T.Release(self.name, buf.name))

    def load(self, key: Any, buf: PoolBuffer, *, timeout: Optional[float] = None) -> Transfer:
        """Start loading ``key`` into ``buf``; ``timeout`` covers the lookup and the transfer."""
        return self.engine._load(self.name, key, buf, timeout)

    def get_into(self, key: Any, buf: PoolBuffer, *, timeout: Optional[float] = None) -> PoolBuffer:
        """Load ``key`` into ``buf`` and wait (``TransferTimeout`` past ``timeout``)."""
        return self.load(key, buf, timeout=timeout).wait()

    def consume(self, buf: PoolBuffer) -> memoryview:
        """``Consume``: the loaded bytes (read-only), only of a buffer whose own load completed."""
        return self.engine._consume(self.name, buf)

    def cancel(self) -> None:
        """``RequestCancel``: the result is no longer needed; in-flight loads are
        abandoned (quarantined) and cancelled at the storage nodes."""
        self.engine._end(T.RequestCancel(self.name))

    def finish(self) -> None:
        """``RequestFinish`` (refused with ``TransferInFlight`` while a load is awaited)."""
        self.engine._end(T.RequestFinish(self.name))

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until the last transfer of the request completed, drained (late
        completion or cancel ack) or was written off; False if ``timeout`` passed first."""
        return self.engine._drain(self.name, timeout)

    def usable_prefix(self, chunks: Iterable[Union[None, PoolBuffer, Mapping[int, Optional[PoolBuffer]]]],
                      ranks: int = 1) -> ReusePlan:
        """:func:`~kvproto.statemachines.reuse.plan_reuse` over the chunks' loads
        as the pool sees them now. A chunk is a buffer, ``None`` (a miss), or
        ``{rank: buffer}``; the plan names buffers by their pool name."""
        return self.engine._plan(list(chunks), ranks)

    @property
    def active(self) -> bool:
        with self.engine._cv:
            req = self.engine.pool.state.requests.get(self.name)
            return req is not None and req.state is T.ReqState.ACTIVE

    @property
    def ended(self) -> bool:
        with self.engine._cv:
            return self.name not in self.engine.pool.state.requests


class TransferEngine:
    """Loads into a :class:`BufferPool` under the Timeout protocol."""

    def __init__(self, client: "Client", buffers: int = 16, buffer_size: int = 64 << 10, *,
                 max_cancels: int = 3, max_leaked: int = 4, cancel_interval: float = 0.2,
                 memory: Optional[np.ndarray] = None) -> None:
        self.client = client
        self.pool = BufferPool(buffers, buffer_size, max_cancels=max_cancels, max_leaked=max_leaked,
                               memory=memory)
        self.cancel_interval = float(cancel_interval)
        #: how often a written-off transfer's cancel is sent again
        self.written_off_probe = max(10 * self.cancel_interval, 0.5)
        self.owner = f"{client.client_id}/{uuid.uuid4().hex[:8]}"
        self._cv = threading.Condition(threading.RLock())
        self._xfers: dict[int, _Xfer] = {}      # tracked loads (until drained / written off)
        self._timers: list = []                 # (due, gen, kind): deadlines and cancel retries
        self._outbox: deque = deque()           # (endpoint or None, frames) for the I/O thread
        self._req_ids = itertools.count(1)
        self._closed = False
        ctx = client._ctx
        self._wake_addr = f"inproc://kvproto-engine-{uuid.uuid4().hex}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.linger = 0
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = ctx.socket(zmq.PUSH)
        self._wake_tx.linger = 0
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=_io_loop, args=(weakref.ref(self), ctx, self._wake_rx),
                                        daemon=True, name=f"kvproto-transfers-{self.owner}")
        self._thread.start()

    def _request(self, op: str, request_id: int, body: dict) -> bytes:
        """A request frame carrying the client's credential (and namespace)."""
        return wire.encode_request(op, request_id, self.client._stamped(op, body))

    # ------------------------------------------------------------------ public

    def request(self) -> EngineRequest:
        """Admit a new request (``StartRequest``)."""
        name = f"r{next(self._req_ids)}"
        with self._cv:
            self._check(self.pool.step(T.StartRequest(name)))
        return EngineRequest(self, name)

    def counts(self) -> dict:
        with self._cv:
            return self.pool.counts()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no transfer is tracked (every load completed, drained or was
        written off and recovered); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.pool.state.transfers, timeout)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for x in self._xfers.values():
                if x.pinned:
                    self.client._unhold()
                    x.pinned = False
        self._wake()
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    # ------------------------------------------------------------------ steps (under _cv)

    @staticmethod
    def _check(effects: tuple) -> tuple:
        if effects and isinstance(effects[0], T.Refused):
            raise effects[0].error
        return effects

    def _simple(self, event) -> tuple:
        with self._cv:
            effects = self._check(self.pool.step(event))
            self._cv.notify_all()
            return effects

    def _acquire(self, request: str) -> PoolBuffer:
        with self._cv:
            name = self.pool.first_free()
            if name is None:
                raise errors.BufferBusy(f"no free buffer ({self.pool.counts()})")
            self._check(self.pool.step(T.Acquire(request, name)))
            return PoolBuffer(name, request, self)

    def _consume(self, request: str, buf: PoolBuffer) -> memoryview:
        with self._cv:
            self._check(self.pool.step(T.Consume(request, buf.name)))
            return self.pool.view(buf.name).toreadonly()

    def _end(self, event) -> None:
        with self._cv:
            self._apply(self._check(self.pool.step(event)))
        self._wake()

    def _drain(self, request: str, timeout: Optional[float]) -> bool:
        def drained() -> bool:
            req = self.pool.state.requests.get(request)
            return req is None or not req.pending
        with self._cv:
            return self._cv.wait_for(drained, timeout)

    def _plan(self, chunks: list, ranks: int) -> ReusePlan:
        def load(buf: Optional[PoolBuffer]) -> RankLoad:
            if buf is None:
                return RankLoad(Outcome.MISSING)
            return RankLoad(T.load_outcome(self.pool.state, buf.name), buf.name)
        with self._cv:
            loads = [{r: load(b) for r, b in c.items() if b is not None} if isinstance(c, Mapping)
                     else load(c) for c in chunks]
            return plan_reuse(loads, ranks)

    def _load(self, request: str, key: Any, buf: PoolBuffer, timeout: Optional[float]) -> Transfer:
        from kvproto.runtime.client import _as_key
        client = self.client
        deadline = client._deadline(timeout)
        k = _as_key(key)
        if buf.request != request:
            raise errors.BufferBusy(f"buffer {buf.name!r} is not held by {request!r}")
        with client._lock:
            reply = client._call_master("read_begin", {"client": client.client_id, "keys": [k]}, deadline)
            client._note_interval(reply)
        err, grant = wire.item_result(wire.items_of(reply, 1)[0])
        if err is not None:
            raise err
        token, length = grant["token"], grant["length"]
        segments = reply.body.get("segments", {})
        usable = [r for r in grant["replicas"] if isinstance(segments.get(r[0]), list)]
        problem: Optional[errors.KvError] = None
        if not usable:
            problem = errors.SegmentUnavailable(f"no replica of {k!r} is reachable")
        elif length > self.pool.size:
            problem = errors.InvalidArgument(f"{k!r} has {length} bytes; pool buffers hold {self.pool.size}")
        if problem is not None:
            self._queue(None, [self._request("read_end", 0, {
                "client": client.client_id, "items": [[k, token]]})])
            self._wake()
            raise problem
        replica = usable[token % len(usable)]
        seg, offset, _ = replica
        endpoint = segments[seg][0]
        load = {"segment": seg, "offset": offset, "token": token, "length": length,
                "term": reply.body.get("term", 0), "owner": self.owner, "buffer": buf.name}
        if grant.get("tickets"):   # a store with tenants: this replica's read ticket
            load["ticket"] = grant["tickets"][grant["replicas"].index(replica)]
        with self._cv:
            try:
                effects = self._check(self.pool.step(T.Issue(request, buf.name)))
            except errors.KvError:
                self._queue(None, [self._request("read_end", 0, {
                    "client": client.client_id, "items": [[k, token]]})])
                self._wake()
                raise
            gen = effects[0].gen
            x = _Xfer(gen, request, buf.name, endpoint, k, token, length, deadline)
            self._xfers[gen] = x
            client._hold()
            heapq.heappush(self._timers, (deadline, gen, _LOAD))
            self._queue(endpoint, [self._request("load", gen << 1 | _LOAD,
                                                 {**load, "xfer": gen})])
        self._wake()
        return Transfer(self, x)

    def _expire(self, gen: int) -> None:
        """The load's deadline passed: ``Timeout`` (if still in flight) and ``Cancel``."""
        with self._cv:
            t = self.pool.state.transfers.get(gen)
            if t is None or t.state is not T.XferState.INFLIGHT:
                return
            self._apply(self.pool.step(T.Timeout(gen)))
            self._retry(gen)
        self._wake()

    def _retry(self, gen: int) -> None:
        """(Re)send the cancel of timed-out transfer ``gen``; once ``max_cancels``
        went unanswered, write it off (``GiveUp``); a full ledger is retried later."""
        effects = self.pool.step(T.Cancel(gen))
        if effects and isinstance(effects[0], T.Refused):   # cancels exhausted
            effects = self.pool.step(T.GiveUp(gen))
            if effects and isinstance(effects[0], T.Refused):   # ledger full: try later
                heapq.heappush(self._timers, (time.monotonic() + self.cancel_interval, gen, _CANCEL))
        self._apply(effects)

    def _queue(self, endpoint: Optional[str], frames: list) -> None:
        self._outbox.append((endpoint, frames))

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                try:
                    self._wake_tx.send(b"", flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the wake-up queue is full: the I/O thread is already due to run

    def _unpin(self, x: _Xfer) -> None:
        if x.pinned:
            x.pinned = False
            self._queue(None, [self._request("read_end", 0, {
                "client": self.client.client_id, "items": [[x.key, x.token]]})])
            self.client._unhold()

    def _apply(self, effects: tuple, error: Optional[errors.KvError] = None) -> None:
        """Carry out the pool machine's effects (under ``_cv``)."""
        for eff in effects:
            if isinstance(eff, T.Loaded):
                x = self._xfers.pop(eff.gen)
                self._unpin(x)
                x.done.set()
            elif isinstance(eff, T.LoadFailed):
                x = self._xfers[eff.gen]
                x.error = error if error is not None else eff.error
                x.done.set()
                if isinstance(eff.error, errors.RequestNotActive):   # abandoned: cancel it too
                    self._retry(eff.gen)
            elif isinstance(eff, T.SendCancel):
                x = self._xfers[eff.gen]
                self._queue(x.endpoint, [self._request("cancel", eff.gen << 1 | _CANCEL, {
                    "owner": self.owner, "xfer": eff.gen})])
                heapq.heappush(self._timers, (time.monotonic() + self.cancel_interval, eff.gen, _CANCEL))
            elif isinstance(eff, (T.Drained, T.WrittenOff)):
                x = self._xfers.get(eff.gen)
                if x is not None:
                    self._unpin(x)
                    if isinstance(eff, T.Drained):
                        del self._xfers[eff.gen]
                    else:   # keep asking: the ack that recovers it may come once the node is back
                        heapq.heappush(self._timers, (time.monotonic() + self.written_off_probe,
                                                      eff.gen, _CANCEL))
        self._cv.notify_all()

    # ------------------------------------------------------------------ I/O thread side

    def _on_reply(self, reply: wire.Reply) -> None:
        gen, kind = reply.request_id >> 1, reply.request_id & 1
        with self._cv:
            if kind == _CANCEL:
                if reply.status == 0 and reply.body.get("acked") is True:
                    self._apply(self.pool.step(T.CancelAck(gen)))
                return   # a refused cancel is no ack: the retry timer goes on
            x = self._xfers.get(gen)
            buffer = reply.body.get("buffer")
            if reply.status == 0 and isinstance(buffer, str) and len(reply.payloads) == 1:
                t = self.pool.state.transfers.get(gen)
                payload = reply.payloads[0]
                if t is not None and t.buffer == buffer and x is not None and payload.nbytes == x.length:
                    self.pool.view(buffer)[:x.length] = payload   # the bytes land
                    self._apply(self.pool.step(T.Complete(gen, buffer)))
                    return
                if t is None or t.buffer != buffer:
                    # untracked (duplicate, or overtaken by the cancel ack): never lands
                    self._apply(self.pool.step(T.Complete(gen, buffer)))
                    return
                err: errors.KvError = errors.MalformedFrame(
                    f"load {gen} answered {payload.nbytes} bytes, expected {x.length if x else '?'}")
            else:
                err = reply.error() if reply.status else errors.MalformedFrame(f"bad load reply {gen}")
            # the node refused the load: give up on it (Timeout) and cancel it
            t = self.pool.state.transfers.get(gen)
            if t is not None and t.state is T.XferState.INFLIGHT:
                self._apply(self.pool.step(T.Timeout(gen)), error=err)
                self._retry(gen)

    def _on_timer(self, gen: int, kind: int) -> None:
        with self._cv:
            t = self.pool.state.transfers.get(gen)
            if t is None:
                return
            if kind == _LOAD:
                if t.state is T.XferState.INFLIGHT:
                    self._apply(self.pool.step(T.Timeout(gen)))
                    self._retry(gen)
                return
            if t.state is T.XferState.TIMEDOUT:
                self._retry(gen)
            elif t.state is T.XferState.LEAKED:
                self._probe(gen)

    def _probe(self, gen: int) -> None:
        """Send the cancel of written-off transfer ``gen`` again, and again later:
        the node acknowledges it once it is reachable (a generation it does not
        know is acknowledged too), and ``CancelAck`` recovers the buffer."""
        x = self._xfers.get(gen)
        if x is None:
            return
        self._queue(x.endpoint, [self._request("cancel", gen << 1 | _CANCEL, {
            "owner": self.owner, "xfer": gen})])
        heapq.heappush(self._timers, (time.monotonic() + self.written_off_probe, gen, _CANCEL))

    def _take_due(self, now: float) -> list:
        with self._cv:
            due = []
            while self._timers and self._timers[0][0] <= now:
                d, gen, kind = heapq.heappop(self._timers)
                due.append((gen, kind))
            nxt = self._timers[0][0] if self._timers else None
            return due, nxt


def _io_loop(ref: "weakref.ref[TransferEngine]", ctx: zmq.Context, wake: zmq.Socket) -> None:
    """The I/O thread: sends what the engine queued, receives replies, fires timers.
    Holds the engine weakly so that a dropped engine goes away with its thread."""
    socks: dict[Optional[str], zmq.Socket] = {}
    poller = zmq.Poller()
    poller.register(wake, zmq.POLLIN)

    def sock_for(endpoint: Optional[str], master: str) -> zmq.Socket:
        s = socks.get(endpoint)
        if s is None:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.sndhwm = 0
            s.rcvhwm = 0
            s.connect(master if endpoint is None else endpoint)
            socks[endpoint] = s
            poller.register(s, zmq.POLLIN)
        return s

    try:
        while True:
            engine = ref()
            if engine is None or engine._closed:
                return
            due, nxt = engine._take_due(time.monotonic())
            for gen, kind in due:
                engine._on_timer(gen, kind)
            while engine._outbox:
                endpoint, frames = engine._outbox.popleft()
                sock_for(endpoint, engine.client.master).send_multipart(frames, copy=False)
            wait_ms = 50 if nxt is None else max(0, min(50, int((nxt - time.monotonic()) * 1000) + 1))
            del engine
            events = poller.poll(wait_ms)
            engine = ref()
            if engine is None:
                return
            for sock, _ in events:
                if sock is wake:
                    while True:
                        try:
                            wake.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    continue
                for frames in wire.waiting(sock, 256):
                    if sock is socks.get(None):
                        continue   # read_end answers
                    try:
                        reply = wire.decode_reply(frames)
                    except errors.KvError:
                        continue
                    engine._on_reply(reply)
            del engine
    finally:
        engine = ref()
        if engine is not None:   # flush queued read_ends (best effort)
            while engine._outbox:
                endpoint, frames = engine._outbox.popleft()
                if endpoint is None:
                    try:
                        sock_for(None, engine.client.master).send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        for s in socks.values():
            s.close(linger=0)
        wake.close(linger=0)
