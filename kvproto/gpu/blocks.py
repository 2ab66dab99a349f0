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
from kvproto.cores.pool import PoolCore
from kvproto.gpu.layout import KVLayout
from kvproto.runtime.transfers import MachinePool
from kvproto.statemachines import timeout as T


class BlockPool(MachinePool):
    """An engine's KV cache, registered once: one tensor
    (``layout.tensor_shape(n)``), or for a layers-first layout one tensor per
    layer; block ``i`` is machine buffer ``"blk{i}"``.

    :meth:`gather` and :meth:`scatter` move a run of blocks between the cache
    and one contiguous host buffer (the bytes of an object): on a GPU, one
    gather on the device and one DMA, or one DMA and one scatter."""

    def __init__(self, kv: Any, layout: KVLayout, *, max_cancels: int = 3, max_leaked: int = 4) -> None:
        import torch
        n = layout.check(kv)
        super().__init__([f"blk{i}" for i in range(n)], max_cancels=max_cancels, max_leaked=max_leaked)
        self.kv = kv
        self.layout = layout
        self.num_blocks = n
        self.layers = list(kv) if layout.layers_major else None
        self.device = (self.layers[0] if self.layers else kv).device
        self._bytes = None if self.layers else kv.view(torch.uint8).reshape(n, layout.block_bytes)

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
        """Block ``block`` as a 1-D uint8 tensor (a view of a blocks-first cache,
        a copy of a layers-first one), on the cache's device."""
        import torch
        if self.layers is None:
            return self._bytes[block]
        return torch.cat([t[block].reshape(-1).view(torch.uint8) for t in self.layers])

    def block(self, block: int):
        """Block ``block`` as a ``layout.block_shape`` tensor (a view of a
        blocks-first cache, a stacked copy of a layers-first one)."""
        import torch
        if self.layers is None:
            return self.kv[block]
        return torch.stack([t[block] for t in self.layers])

    def _views(self, host, n: int) -> list:
        """``host`` (a 1-D uint8 tensor of ``n`` blocks' bytes) as the tensors
        it holds: one ``(n, *block_shape)`` for blocks first, one
        ``(n, *layer_block_shape)`` per layer for layers first."""
        lay = self.layout
        typed = host.view(lay.torch_dtype())
        if self.layers is None:
            return [typed.view(n, *lay.block_shape)]
        per = typed.numel() // lay.num_layers
        return [typed[i * per:(i + 1) * per].view(n, *lay.layer_block_shape)
                for i in range(lay.num_layers)]

    def gather(self, blocks: Sequence[int]):
        """A copy unit's function: ``gather(blocks)(dst)`` writes the blocks'
        bytes into ``dst`` (a 1-D uint8 host tensor), on the copy stream: on the
        CPU straight into ``dst``; on a GPU into one device buffer, then one DMA."""
        import torch
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        sources = self.layers if self.layers is not None else [self.kv]

        def op(dst) -> None:
            n = len(idx)
            if self.device.type == "cpu":
                for src, out in zip(sources, self._views(dst, n)):
                    torch.index_select(src, 0, idx, out=out)
                return
            staged = torch.empty(dst.numel(), dtype=torch.uint8, device=self.device)
            for src, out in zip(sources, self._views(staged, n)):
                torch.index_select(src, 0, idx, out=out)
            dst.copy_(staged, non_blocking=True)
        return op

    def scatter(self, blocks: Sequence[int]):
        """A copy unit's function: ``scatter(blocks)(src)`` writes the bytes in
        ``src`` (a 1-D uint8 host tensor) into the blocks, on the copy stream:
        on the CPU straight from ``src``; on a GPU one DMA, then a scatter."""
        import torch
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        targets = self.layers if self.layers is not None else [self.kv]

        def op(src) -> None:
            n = len(idx)
            if self.device.type != "cpu":
                staged = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
                staged.copy_(src, non_blocking=True)
                src = staged
            for dst, part in zip(targets, self._views(src, n)):
                dst.index_copy_(0, idx, part)
        return op

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
    def state(self) -> PoolCore:
        return self.blocks.state

    first_free = MachinePool.first_free
    counts = MachinePool.counts

    def view(self, name: str) -> memoryview:
        return self._views[name]


class _Copy:
    __slots__ = ("pool", "gen", "buffer", "request", "handle", "deadline", "unit",
                 "done", "error", "next_cancel", "on_settled")

    def __init__(self, pool, gen, buffer, request, handle, deadline, unit: list) -> None:
        self.pool, self.gen, self.buffer, self.request = pool, gen, buffer, request
        self.handle, self.deadline = handle, deadline
        self.unit = unit                       # the records of one submission, this one among them
        self.done = False                      # the copy's outcome is known (set under the copier's cv)
        self.error: Optional[errors.KvError] = None
        self.next_cancel: Optional[float] = None
        self.on_settled: list = []             # called once it can no longer write


class DeviceCopy:
    """A copy in flight; :meth:`wait` for it."""

    def __init__(self, copier: "Copier", rec: _Copy) -> None:
        self._copier, self._rec = copier, rec
        self.gen, self.buffer = rec.gen, rec.buffer

    def done(self) -> bool:
        return self._rec.done

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
        (copy,) = self.issue_into(pool, request, [buffer], pairs, timeout, sources=sources)
        return copy

    def issue_into(self, pool: MachinePool, request: str, buffers: Sequence[str],
                   pairs: Sequence[tuple], timeout: float, *,
                   sources: Iterable[str] = ()) -> list[DeviceCopy]:
        """One copy unit that writes several ``buffers`` of ``pool`` (a scatter
        into blocks): an ``Issue`` per buffer, stepped all or none, one
        submission; each buffer's generation completes with the unit."""
        sources = frozenset(sources)
        with self.cv:
            issued = self.check(pool.step_all([T.Issue(request, b, sources) for b in buffers]))
            try:
                handle = self.backend.submit(pairs)
            except BaseException:
                # never submitted: none can write. Abandon them through the machine.
                for ev in issued:
                    self._apply(pool.step(T.Timeout(ev.gen)))
                    self._apply(pool.step(T.Cancel(ev.gen)))
                    self._apply(pool.step(T.CancelAck(ev.gen)))
                raise
            deadline = time.monotonic() + timeout
            copies, unit = [], []
            for ev, buffer in zip(issued, buffers):
                rec = _Copy(pool, ev.gen, buffer, request, handle, deadline, unit)
                unit.append(rec)
                self._copies[(id(pool), ev.gen)] = rec
                copies.append(DeviceCopy(self, rec))
            self.cv.notify_all()
            return copies

    def when_settled(self, copy: DeviceCopy, callback) -> None:
        """Call ``callback()`` once ``copy`` can no longer write (completed,
        drained, cancelled before it ran), or now if it already cannot."""
        with self.cv:
            rec = copy._rec
            if self._copies.get((id(rec.pool), rec.gen)) is rec:
                rec.on_settled.append(callback)
                return
        callback()

    def step(self, pool: MachinePool, event) -> tuple:
        """Step ``pool`` (refusals raise) and carry out the effects."""
        with self.cv:
            effects = self.check(pool.step(event))
            self._apply(effects, pool)
            return effects

    def step_all(self, pool: MachinePool, events: Sequence) -> tuple:
        """Step ``events`` all or none (a refusal raises, nothing changed) and
        carry out the effects."""
        with self.cv:
            effects = self.check(pool.step_all(events))
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
        while not rec.done:
            left = rec.deadline - time.monotonic()
            if left <= 0:
                self._expire(rec)
                break
            if rec.handle.wait(min(left, 0.01)):   # the outcome may also come from elsewhere
                self._observe(rec)
                break
        with self.cv:
            self.cv.wait_for(lambda: rec.done)

    def _observe(self, rec: _Copy) -> None:
        """The backend says the copy can no longer write: completion or cancel
        ack, for every copy of its unit (one submission) still tracked."""
        with self.cv:
            pool, stopped = rec.pool, rec.handle.stopped
            effects: list = []
            for r in rec.unit:
                if self._copies.get((id(pool), r.gen)) is r:
                    effects.extend(pool.step(T.CancelAck(r.gen) if stopped
                                             else T.Complete(r.gen, r.buffer)))
            if effects:
                self._apply(tuple(effects), pool)

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
        callbacks, rec.on_settled = rec.on_settled, []
        for callback in callbacks:
            callback()

    def _apply(self, effects: tuple, pool: Optional[MachinePool] = None) -> None:
        """Carry out pool machine effects (under ``cv``)."""
        for eff in effects:
            gen = getattr(eff, "gen", None)
            rec = self._copies.get((id(pool), gen)) if pool is not None and gen is not None else None
            if isinstance(eff, T.Loaded):
                if rec is not None:
                    self._untrack(rec)
                    rec.done = True
            elif isinstance(eff, T.LoadFailed):
                if rec is not None:
                    rec.error = eff.error
                    rec.done = True
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
                    rec.done = True
        self.cv.notify_all()

    def _poll_loop(self) -> None:
        while True:
            with self.cv:
                if self._closed:
                    return
                if not self._copies:
                    self.cv.wait(0.1)
                    continue
                units = list({id(rec.unit): rec.unit for rec in self._copies.values()}.values())
            now = time.monotonic()
            for unit in units:
                if unit[0].handle.query():
                    self._observe(unit[0])
                    continue
                if now < unit[0].deadline and all(rec.next_cancel is None for rec in unit):
                    continue
                with self.cv:
                    for rec in unit:
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

