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

A copy may read *sources* of the same pool: a save issues
``Issue(request, staging_buffer, sources=blocks)``, so the staging buffers are
buffers of the block pool's machine too (:class:`StagingBuffers`). The machine
refuses to release or load into a source while the request still awaits the
copy (``TransferInFlight``, spec ``SourceNotReassignedWhileRead``); after the
copy timed out its bytes land only in a quarantined staging buffer that is never
published, so the source may go. The copier keeps no bookkeeping of its own.
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


class StagingBuffers:
    """``count`` host buffers of ``size`` bytes (``memory``, a 1-D uint8 array)
    added to ``blocks``' machine as buffers ``stg0``, ``stg1``, ... (``AddBuffer``),
    so that a save into one may name the blocks it reads as its sources. Stepped
    only through ``blocks``; this object slices the memory and counts its buffers."""

    def __init__(self, blocks: BlockPool, count: int, size: int, memory) -> None:
        if count < 1 or size < 1 or memory.nbytes < count * size:
            raise ValueError("staging needs at least one buffer of at least one byte, and the memory")
        self.blocks, self.size, self.memory = blocks, size, memory
        self.names = [f"stg{i}" for i in range(count)]
        for n in self.names:
            Copier.check(blocks.step(T.AddBuffer(n)))
        self._views = {n: memoryview(memory[i * size:(i + 1) * size]) for i, n in enumerate(self.names)}

    @property
    def state(self) -> T.Pool:
        return self.blocks.state

    first_free = MachinePool.first_free
    counts = MachinePool.counts

    def view(self, name: str) -> memoryview:
        return self._views[name]


class _Copy:
    __slots__ = ("pool", "gen", "buffer", "request", "handle", "deadline",
                 "done", "error", "next_cancel")

    def __init__(self, pool, gen, buffer, request, handle, deadline) -> None:
        self.pool, self.gen, self.buffer, self.request = pool, gen, buffer, request
        self.handle, self.deadline = handle, deadline
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
              timeout: float, *, sources: Iterable[str] = ()) -> DeviceCopy:
        """``Issue`` a copy of ``pairs`` into ``buffer`` (held by ``request`` in
        ``pool``) and submit it; ``sources`` are buffers of ``pool`` the copy
        reads: the machine keeps them from being released or loaded into while
        the copy is awaited."""
        with self.cv:
            (issued,) = self.check(pool.step(T.Issue(request, buffer, frozenset(sources))))
            try:
                handle = self.backend.submit(pairs)
            except BaseException:
                # never submitted: it cannot write. Abandon it through the machine.
                self._apply(pool.step(T.Timeout(issued.gen)))
                self._apply(pool.step(T.Cancel(issued.gen)))
                self._apply(pool.step(T.CancelAck(issued.gen)))
                raise
            rec = _Copy(pool, issued.gen, buffer, request, handle, time.monotonic() + timeout)
            self._copies[(id(pool), issued.gen)] = rec
            self.cv.notify_all()
            return DeviceCopy(self, rec)

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

