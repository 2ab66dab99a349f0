"""The device block pool and the copier that drives the Timeout pool machine.

:class:`BlockPool` registers an engine's KV tensor once. Its blocks are the
pool machine's buffers (:class:`~kvproto.runtime.transfers.MachinePool`, the
same code as the host :class:`~kvproto.runtime.transfers.BufferPool`): free,
held, loading, ready, used, quarantined and leaked are
:class:`~kvproto.statemachines.timeout.BufState`, and generations are the
machine's. There is no second state machine here.

:class:`Copier` carries copies into any such pool (device blocks for restores,
host staging buffers for saves): ``Issue`` gives the generation, the backend
runs the copy, and the copy's completion becomes ``Complete(gen, buffer)`` —
``Loaded``, or ``Drained`` for a late completion of a timed-out copy, or a
dropped ``StaleGeneration``. A copy not done by its deadline is ``Timeout``
(the destination is quarantined) and ``Cancel``: the backend stops it if it has
not started (then ``CancelAck``) — a CUDA copy never can, so its own event is
the acknowledgement; cancels unanswered ``max_cancels`` times are written off
(``GiveUp``) and a late completion recovers the buffer.

The one thing the Timeout spec does not cover is the *source* of a copy (it
models destinations). The copier keeps a copy's sources held: a source block
cannot be released while a save that reads it is still awaited (in flight);
see :meth:`Copier.reading`. After such a save times out its bytes land only in
a quarantined staging buffer and are never published, so the source may go.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Optional, Sequence

from kvproto import errors
from kvproto.gpu.layout import KVLayout
from kvproto.runtime.transfers import MachinePool
from kvproto.statemachines import timeout as T


class BlockPool(MachinePool):
    """An engine's KV tensor (``layout.tensor_shape(n)``), registered once; block
    ``i`` is machine buffer ``"blk{i}"``."""

    def __init__(self, kv: Any, layout: KVLayout, *, max_cancels: int = 3, max_leaked: int = 4) -> None:
        import torch
        n = layout.check(kv)
        super().__init__([f"blk{i}" for i in range(n)], max_cancels=max_cancels, max_leaked=max_leaked)
        self.kv = kv
        self.layout = layout
        self.num_blocks = n
        self.device = kv.device
        self._bytes = kv.view(torch.uint8).reshape(n, layout.block_bytes)

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, device: Any = None, **kw) -> "BlockPool":
        """A zeroed KV tensor on ``device`` (CUDA when present, else CPU)."""
        import torch
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        kv = torch.zeros(layout.tensor_shape(num_blocks), dtype=layout.torch_dtype(), device=device)
        return cls(kv, layout, **kw)

    @staticmethod
    def name(block: int) -> str:
        return f"blk{block}"

    @staticmethod
    def index(name: str) -> int:
        return int(name[3:])

    def block_bytes(self, block: int):
        """Block ``block`` as a 1-D uint8 tensor view (on the KV tensor's device)."""
        return self._bytes[block]

    def block(self, block: int):
        """Block ``block`` as a ``layout.block_shape`` tensor view."""
        return self.kv[block]

    def state_of(self, block: int) -> T.BufState:
        return self.state.buffers[self.name(block)].state


class _Copy:
    __slots__ = ("pool", "gen", "buffer", "request", "handle", "deadline", "sources",
                 "done", "error", "next_cancel")

    def __init__(self, pool, gen, buffer, request, handle, deadline, sources) -> None:
        self.pool, self.gen, self.buffer, self.request = pool, gen, buffer, request
        self.handle, self.deadline, self.sources = handle, deadline, tuple(sources)
        self.done = threading.Event()          # the copy's outcome is known to the caller
        self.error: Optional[errors.KvError] = None
        self.next_cancel: Optional[float] = None


class DeviceCopy:
    """A copy in flight; :meth:`wait` for it."""

    def __init__(self, copier: "Copier", rec: _Copy) -> None:
        self._copier, self._rec = copier, rec
        self.gen, self.buffer = rec.gen, rec.buffer

    def done(self) -> bool:
        return self._rec.done.is_set()

    def wait(self) -> None:
        """Until the copy completed (returns) or failed: ``TransferTimeout`` past
        its deadline (the destination is quarantined), ``RequestNotActive`` when
        its request ended first."""
        self._copier._wait(self._rec)
        if self._rec.error is not None:
            raise self._rec.error


class Copier:
    """Issues copies into machine pools on one backend and turns completions,
    deadlines and cancels into pool machine steps (one lock, one poller thread)."""

    def __init__(self, backend, *, cancel_interval: float = 0.05, poll_interval: float = 0.002) -> None:
        self.backend = backend
        self.cancel_interval = float(cancel_interval)
        self.poll_interval = float(poll_interval)
        self.cv = threading.Condition(threading.RLock())
        self._copies: dict[tuple, _Copy] = {}      # (id(pool), gen) -> tracked copy
        self._reading: dict[tuple, int] = {}       # (id(pool), buffer) -> awaited copies reading it
        self._closed = False
        self._thread = threading.Thread(target=self._poll_loop, daemon=True, name="kvproto-gpu-copier")
        self._thread.start()

    # ------------------------------------------------------------------ issuing

    @staticmethod
    def check(effects: tuple) -> tuple:
        if effects and isinstance(effects[0], T.Refused):
            raise effects[0].error
        return effects

    def issue(self, pool: MachinePool, request: str, buffer: str, pairs: Sequence[tuple],
              timeout: float, *, sources: Iterable[tuple] = ()) -> DeviceCopy:
        """``Issue`` a copy of ``pairs`` into ``buffer`` (held by ``request`` in
        ``pool``) and submit it; ``sources`` are ``(pool, buffer)`` pairs the copy
        reads, kept unreleasable while it is awaited."""
        with self.cv:
            (issued,) = self.check(pool.step(T.Issue(request, buffer)))
            try:
                handle = self.backend.submit(pairs)
            except BaseException:
                # never submitted: it cannot write. Abandon it through the machine.
                self._apply(pool.step(T.Timeout(issued.gen)))
                self._apply(pool.step(T.Cancel(issued.gen)))
                self._apply(pool.step(T.CancelAck(issued.gen)))
                raise
            rec = _Copy(pool, issued.gen, buffer, request, handle, time.monotonic() + timeout,
                        [(id(p), b) for p, b in sources])
            self._copies[(id(pool), issued.gen)] = rec
            for s in rec.sources:
                self._reading[s] = self._reading.get(s, 0) + 1
            self.cv.notify_all()
            return DeviceCopy(self, rec)

    def reading(self, pool: MachinePool, buffer: str) -> bool:
        """True while an awaited copy reads ``buffer`` of ``pool``."""
        with self.cv:
            return self._reading.get((id(pool), buffer), 0) > 0

    def step(self, pool: MachinePool, event) -> tuple:
        """Step ``pool`` (refusals raise) and carry out the effects."""
        with self.cv:
            effects = self.check(pool.step(event))
            self._apply(effects, pool)
            return effects

    def inject_completion(self, pool: MachinePool, gen: int, buffer: str) -> tuple:
        """Deliver a completion callback of ``gen`` into ``buffer`` again (tests:
        a duplicated or replayed late completion). Returns the machine's effects."""
        with self.cv:
            effects = pool.step(T.Complete(gen, buffer))
            self._apply(effects, pool)
            return effects

    def tracked(self) -> int:
        with self.cv:
            return len(self._copies)

    def wait_idle(self, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: not self._copies, timeout)

    def wait_idle_for(self, copies, timeout: Optional[float] = None) -> bool:
        """Wait until none of ``copies`` can still write: each completed, drained
        or was written off (a written-off one is recovered later by the poller)."""
        def gone() -> bool:
            for c in copies:
                rec = c._rec
                if self._copies.get((id(rec.pool), rec.gen)) is rec:
                    t = rec.pool.state.transfers.get(rec.gen)
                    if t is not None and t.state is not T.XferState.LEAKED:
                        return False
            return True
        with self.cv:
            return self.cv.wait_for(gone, timeout)

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ observing

    def _wait(self, rec: _Copy) -> None:
        while not rec.done.is_set():
            left = rec.deadline - time.monotonic()
            if left <= 0:
                self._expire(rec)
                break
            if rec.handle.wait(min(left, 0.01)):   # the outcome may also come from elsewhere
                self._observe(rec)
                break
        rec.done.wait()

    def _observe(self, rec: _Copy) -> None:
        """The backend says the copy can no longer write: completion or cancel ack."""
        with self.cv:
            if self._copies.get((id(rec.pool), rec.gen)) is not rec:
                return
            if rec.handle.stopped:
                self._apply(rec.pool.step(T.CancelAck(rec.gen)), rec.pool)
            else:
                self._apply(rec.pool.step(T.Complete(rec.gen, rec.buffer)), rec.pool)

    def _expire(self, rec: _Copy) -> None:
        with self.cv:
            t = rec.pool.state.transfers.get(rec.gen)
            if t is not None and t.state is T.XferState.INFLIGHT:
                self._apply(rec.pool.step(T.Timeout(rec.gen)), rec.pool)
                self._retry(rec)

    def _retry(self, rec: _Copy) -> None:
        effects = rec.pool.step(T.Cancel(rec.gen))
        if effects and isinstance(effects[0], T.Refused):   # cancels exhausted: write off
            effects = rec.pool.step(T.GiveUp(rec.gen))
            if effects and isinstance(effects[0], T.Refused):   # ledger full: later
                rec.next_cancel = time.monotonic() + self.cancel_interval
                return
            rec.next_cancel = None
        self._apply(effects, rec.pool)

    def _untrack(self, rec: _Copy) -> None:
        self._copies.pop((id(rec.pool), rec.gen), None)
        self._unread(rec)

    def _unread(self, rec: _Copy) -> None:
        for s in rec.sources:
            n = self._reading.get(s, 0) - 1
            if n > 0:
                self._reading[s] = n
            else:
                self._reading.pop(s, None)
        rec.sources = ()

    def _apply(self, effects: tuple, pool: Optional[MachinePool] = None) -> None:
        """Carry out pool machine effects (under ``cv``)."""
        for eff in effects:
            gen = getattr(eff, "gen", None)
            rec = self._copies.get((id(pool), gen)) if pool is not None and gen is not None else None
            if isinstance(eff, T.Loaded):
                if rec is not None:
                    self._untrack(rec)
                    rec.done.set()
            elif isinstance(eff, T.LoadFailed):
                if rec is not None:
                    rec.error = eff.error
                    self._unread(rec)          # its bytes will never be used
                    rec.done.set()
                    if isinstance(eff.error, errors.RequestNotActive):   # abandoned: cancel it
                        self._retry(rec)
            elif isinstance(eff, T.SendCancel):
                if rec is not None:
                    rec.next_cancel = time.monotonic() + self.cancel_interval
                    self.backend.cancel(rec.handle)     # stopped -> handle done, stopped
            elif isinstance(eff, T.WrittenOff):
                if rec is not None:
                    rec.next_cancel = None             # still tracked: a late completion recovers it
            elif isinstance(eff, T.Drained):
                if rec is not None:
                    self._untrack(rec)
                    rec.done.set()
        self.cv.notify_all()

    def _poll_loop(self) -> None:
        while True:
            with self.cv:
                if self._closed:
                    return
                if not self._copies:
                    self.cv.wait(0.1)
                    continue
                recs = list(self._copies.values())
            now = time.monotonic()
            for rec in recs:
                if rec.handle.query():
                    self._observe(rec)
                    continue
                with self.cv:
                    t = rec.pool.state.transfers.get(rec.gen)
                    if t is None or self._copies.get((id(rec.pool), rec.gen)) is not rec:
                        continue
                    if t.state is T.XferState.INFLIGHT:
                        if now >= rec.deadline:
                            self._expire(rec)
                    elif t.state is T.XferState.TIMEDOUT and rec.next_cancel is not None \
                            and now >= rec.next_cancel:
                        self._retry(rec)
            time.sleep(self.poll_interval)

