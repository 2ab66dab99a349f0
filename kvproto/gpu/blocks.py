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


#: a device save or restore is gathered (scattered) and DMA'd in pieces of at
#: most this many bytes, so the DMA of one overlaps the gather (scatter) of
#: the next (:meth:`BlockPool.gather`)
PIECE_BYTES = 8 << 20


class BlockPool(MachinePool):
    """An engine's KV cache, registered once: one tensor
    (``layout.tensor_shape(n)``), or for a layers-first layout one tensor per
    layer; block ``i`` is machine buffer ``"blk{i}"``.

    :meth:`gather` and :meth:`scatter` move a run of blocks between the cache
    and one contiguous host buffer (the bytes of an object): on a GPU, a
    gather on the device and a DMA, or a DMA and a scatter, pipelined piece
    by piece."""

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
        #: each cache tensor as rows of bytes, one row a block (of one layer, layers first)
        self._rows = [t.view(torch.uint8).reshape(n, -1) for t in (self.layers or [kv])]
        self._side = None

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

    @staticmethod
    def runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
        """The runs of consecutive block ids in ``blocks``: ``(position in the
        object, first block, count)`` each."""
        out: list = []
        pos = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                out.append((pos, blocks[pos], i - pos))
                pos = i
        return out

    def _parts(self, host, n: int) -> list:
        """``host`` (a 1-D uint8 tensor of ``n`` blocks' bytes) as rows of bytes
        in the order :attr:`_rows` holds them: one ``(n, block_bytes)`` for
        blocks first, one ``(n, layer block bytes)`` per layer for layers first."""
        per = host.numel() // len(self._rows)
        return [host[i * per:(i + 1) * per].view(n, -1) for i in range(len(self._rows))]

    def _run_copies(self, blocks: Sequence[int], into_blocks: bool):
        """The CPU's copy unit function for ``blocks``: one copy per run of
        consecutive blocks (and layer) between them and a 1-D uint8 host
        tensor, into the blocks or out of them."""
        runs, n = self.runs(blocks), len(blocks)

        def copy_runs(host) -> None:
            for rows, part in zip(self._rows, self._parts(host, n)):
                for pos, first, count in runs:
                    cache, obj = rows.narrow(0, first, count), part.narrow(0, pos, count)
                    if into_blocks:
                        cache.copy_(obj)
                    else:
                        obj.copy_(cache)
        return copy_runs

    def pieces(self, n: int, piece_bytes: int) -> list[list[tuple[int, int, int]]]:
        """An object of ``n`` blocks cut into pieces of at most
        ``piece_bytes`` (at least one block row), in the object's byte order:
        each piece a list of ``(part, first, end)``, blocks ``first:end`` of
        part ``part`` (the whole object for blocks first, a layer's share for
        layers first; :meth:`_views`), parts next to each other in the object,
        so a piece's bytes are one contiguous range (:meth:`span`)."""
        row = self._rows[0].shape[1]
        step = max(1, piece_bytes // row)
        out: list = []
        piece: list = []
        room = step
        for part in range(len(self._rows)):
            first = 0
            while first < n:
                end = min(n, first + room)
                piece.append((part, first, end))
                room -= end - first
                first = end
                if not room:
                    out.append(piece)
                    piece, room = [], step
        if piece:
            out.append(piece)
        return out

    def span(self, n: int, piece: list) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of ``piece`` (of :meth:`pieces`) in an
        object of ``n`` blocks."""
        row = self._rows[0].shape[1]
        (part, first, _), (last, _, end) = piece[0], piece[-1]
        return (part * n + first) * row, (last * n + end) * row

    def _side_stream(self):
        """The stream of this pool's on-device gathers and scatters, beside
        the copy stream's DMAs (made once)."""
        import torch
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def _pipelined(self, blocks: Sequence[int], into_blocks: bool):
        """The GPU's copy unit function for ``blocks``, run on the copy stream
        (the current one), through one device buffer of the object's bytes,
        piece by piece (:meth:`pieces`, :data:`PIECE_BYTES`). Out of the
        blocks: each piece gathered on the side stream, then DMA'd to the host
        on the copy stream, which waits for that gather only, so the next
        gather runs during the DMA. Into the blocks: each piece DMA'd on the
        copy stream, then scattered on the side stream, which waits for that
        DMA only; the copy stream then waits for the last scatter, so the
        unit's completion event covers every scatter."""
        import torch
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        cache = self.layers if self.layers is not None else [self.kv]

        def op(host) -> None:
            n = len(idx)
            copy, side = torch.cuda.current_stream(self.device), self._side_stream()
            staged = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            parts = self._views(staged, n)
            side.wait_stream(copy)      # after what the copy stream waits for (the KV's producer)
            for piece in self.pieces(n, PIECE_BYTES):
                lo, hi = self.span(n, piece)
                if into_blocks:         # DMA, then scatter once it landed
                    staged[lo:hi].copy_(host[lo:hi], non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(copy)
                    side.wait_event(landed)
                    with torch.cuda.stream(side):
                        for part, first, end in piece:
                            cache[part].index_copy_(0, idx[first:end], parts[part][first:end])
                else:                   # gather, then DMA once it is done
                    with torch.cuda.stream(side):
                        for part, first, end in piece:
                            torch.index_select(cache[part], 0, idx[first:end],
                                               out=parts[part][first:end])
                        gathered = torch.cuda.Event()
                        gathered.record(side)
                    copy.wait_event(gathered)
                    host[lo:hi].copy_(staged[lo:hi], non_blocking=True)
            if into_blocks:
                copy.wait_stream(side)
            staged.record_stream(side)
        return op

    def gather(self, blocks: Sequence[int]):
        """A copy unit's function: ``gather(blocks)(dst)`` writes the blocks'
        bytes into ``dst`` (a 1-D uint8 host tensor), on the copy stream: on the
        CPU straight into ``dst``, one copy per run of consecutive blocks (and
        layer); on a GPU gathered into one device buffer and DMA'd, piece by
        piece, each DMA during the next piece's gather (:meth:`_pipelined`)."""
        if self.device.type == "cpu":
            return self._run_copies(blocks, into_blocks=False)
        return self._pipelined(blocks, into_blocks=False)    # pragma: no cover - CUDA

    def scatter(self, blocks: Sequence[int]):
        """A copy unit's function: ``scatter(blocks)(src)`` writes the bytes in
        ``src`` (a 1-D uint8 host tensor) into the blocks, on the copy stream:
        on the CPU straight from ``src``, one copy per run of consecutive
        blocks (and layer); on a GPU DMA'd and scattered piece by piece, each
        scatter during the next piece's DMA (:meth:`_pipelined`)."""
        if self.device.type == "cpu":
            return self._run_copies(blocks, into_blocks=True)
        return self._pipelined(blocks, into_blocks=True)     # pragma: no cover - CUDA

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


class _Unit:
    """One submission: a copy (a generation of ``pool``) into each of its
    destination buffers, one backend handle, one deadline."""

    __slots__ = ("pool", "request", "handle", "deadline", "tracked", "unknown", "errors",
                 "next_cancel", "on_settled")

    def __init__(self, pool, request, handle, deadline: float, gens: dict) -> None:
        self.pool, self.request, self.handle, self.deadline = pool, request, handle, deadline
        self.tracked = gens                    # gen -> buffer: copies that may still write
        self.unknown = set(gens)               # gens whose outcome is not known yet
        self.errors: dict = {}                 # gen -> the error of a copy that failed
        self.next_cancel: dict = {}            # gen -> when to send its next cancel
        self.on_settled: list = []             # called once none of it can write


class DeviceCopy:
    """A copy unit in flight (one or several destination buffers); :meth:`wait` for it."""

    def __init__(self, copier: "Copier", unit: _Unit) -> None:
        self._copier, self._unit = copier, unit
        self.gens = list(unit.tracked)
        self.buffers = list(unit.tracked.values())
        self.gen, self.buffer = self.gens[0], self.buffers[0]

    def done(self) -> bool:
        """The outcome of every copy of the unit is known."""
        return not self._unit.unknown

    def wait(self) -> None:
        """Until every copy of the unit completed (returns) or one failed:
        ``TransferTimeout`` past its deadline (the destinations are
        quarantined), ``RequestNotActive`` when its request ended first."""
        unit = self._unit
        self._copier._wait(unit)
        if unit.errors:
            raise unit.errors[min(unit.errors)]


class Copier:
    """Issues copies into machine pools on one backend and turns completions,
    deadlines and cancels into pool machine steps (one lock, one poller thread).

    It tracks copy units, not blocks: a unit's generations (one per
    destination buffer) point to it, and a completion or deadline is observed
    once per unit, then stepped for each of its generations."""

    def __init__(self, backend, *, cancel_interval: float = 0.05, poll_interval: float = 0.002) -> None:
        self.backend = backend
        self.cancel_interval = float(cancel_interval)
        self.poll_interval = float(poll_interval)
        self.cv = threading.Condition(threading.RLock())
        self._copies: dict[tuple, _Unit] = {}      # (id(pool), gen) -> the unit of a tracked copy
        self._units: dict[int, _Unit] = {}         # id(unit) -> a unit with a tracked copy
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
        return self.issue_into(pool, request, [buffer], pairs, timeout, sources=sources)

    def issue_into(self, pool: MachinePool, request: str, buffers: Sequence[str],
                   pairs: Sequence[tuple], timeout: float, *,
                   sources: Iterable[str] = ()) -> DeviceCopy:
        """One copy unit that writes several ``buffers`` of ``pool`` (a scatter
        into blocks): an ``Issue`` per buffer, stepped all or none, one
        submission; each buffer's generation completes with the unit."""
        if not buffers:
            raise errors.InvalidArgument("a copy unit writes at least one buffer")
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
            unit = _Unit(pool, request, handle, time.monotonic() + timeout,
                         {ev.gen: ev.buffer for ev in issued})
            pid, copies = id(pool), self._copies
            for gen in unit.tracked:
                copies[(pid, gen)] = unit
            self._units[id(unit)] = unit
            self.cv.notify_all()
            return DeviceCopy(self, unit)

    def when_settled(self, copy: DeviceCopy, callback) -> None:
        """Call ``callback()`` once no copy of ``copy``'s unit can still write
        (completed, drained, cancelled before it ran), or now if none can."""
        with self.cv:
            unit = copy._unit
            if unit.tracked:
                unit.on_settled.append(callback)
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
        """Copies (generations) that may still write."""
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
                unit = c._unit
                for gen in unit.tracked:
                    t = unit.pool.state.transfers.get(gen)
                    if t is not None and t.state is not T.XferState.LEAKED:
                        return False
            return True
        with self.cv:
            return self.cv.wait_for(gone, timeout)

    def expire(self, copy: DeviceCopy) -> None:
        """Stop waiting for the copies of ``copy`` still in flight: ``Timeout``
        (their destinations quarantined) and ``Cancel``."""
        self._expire(copy._unit)

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ observing

    def _wait(self, unit: _Unit) -> None:
        while unit.unknown:
            left = unit.deadline - time.monotonic()
            if left <= 0:
                self._expire(unit)
                break
            if unit.handle.wait(min(left, 0.01)):   # the outcome may also come from elsewhere
                self._observe(unit)
                break
        with self.cv:
            self.cv.wait_for(lambda: not unit.unknown)

    def _observe(self, unit: _Unit) -> None:
        """The backend says the unit can no longer write: a completion, or a
        cancel ack, for each of its copies still tracked."""
        with self.cv:
            pool, step = unit.pool, unit.pool.step
            effects: list = []
            if unit.handle.stopped:
                for gen in list(unit.tracked):
                    effects.extend(step(T.CancelAck(gen)))
            else:
                complete = T.Complete
                for gen, buffer in list(unit.tracked.items()):
                    effects.extend(step(complete(gen, buffer)))
            if effects:
                self._apply(tuple(effects), pool)

    def _expire(self, unit: _Unit) -> None:
        """``Timeout`` and ``Cancel`` each copy of ``unit`` still in flight."""
        with self.cv:
            transfers = unit.pool.state.transfers
            for gen in list(unit.tracked):
                t = transfers.get(gen)
                if t is not None and t.state is T.XferState.INFLIGHT:
                    self._apply(unit.pool.step(T.Timeout(gen)), unit.pool)
                    self._retry(unit, gen)

    def _retry(self, unit: _Unit, gen: int) -> None:
        pool = unit.pool
        effects = pool.step(T.Cancel(gen))
        if effects and isinstance(effects[0], T.Refused):   # cancels exhausted: write off
            effects = pool.step(T.GiveUp(gen))
            if effects and isinstance(effects[0], T.Refused):   # ledger full: later
                unit.next_cancel[gen] = time.monotonic() + self.cancel_interval
                return
            unit.next_cancel.pop(gen, None)
        self._apply(effects, pool)

    def _untrack(self, unit: _Unit, gen: int) -> None:
        self._copies.pop((id(unit.pool), gen), None)
        unit.tracked.pop(gen, None)
        unit.next_cancel.pop(gen, None)
        if not unit.tracked:
            self._units.pop(id(unit), None)
            callbacks, unit.on_settled = unit.on_settled, []
            for callback in callbacks:
                callback()

    def _apply(self, effects: tuple, pool: Optional[MachinePool] = None) -> None:
        """Carry out pool machine effects (under ``cv``)."""
        copies, pid = self._copies, id(pool)
        for eff in effects:
            kind = type(eff)
            if pool is None or kind not in _TRACKED:
                continue
            gen = eff.gen
            unit = copies.get((pid, gen))
            if unit is None:
                continue
            if kind is T.Loaded or kind is T.Drained:
                self._untrack(unit, gen)
                unit.unknown.discard(gen)
            elif kind is T.LoadFailed:
                unit.errors[gen] = eff.error
                unit.unknown.discard(gen)
                if isinstance(eff.error, errors.RequestNotActive):   # abandoned: cancel it
                    self._retry(unit, gen)
            elif kind is T.SendCancel:
                unit.next_cancel[gen] = time.monotonic() + self.cancel_interval
                self.backend.cancel(unit.handle)     # stopped -> handle done, stopped
            else:   # WrittenOff: still tracked, a late completion recovers it
                unit.next_cancel.pop(gen, None)
        self.cv.notify_all()

    def _poll_loop(self) -> None:
        while True:
            with self.cv:
                if self._closed:
                    return
                if not self._units:
                    self.cv.wait(0.1)
                    continue
                units = list(self._units.values())
            now = time.monotonic()
            for unit in units:
                if unit.handle.query():
                    self._observe(unit)
                    continue
                if now < unit.deadline and not unit.next_cancel:
                    continue
                with self.cv:
                    transfers = unit.pool.state.transfers
                    for gen in list(unit.tracked):
                        t = transfers.get(gen)
                        if t is None:
                            continue
                        if t.state is T.XferState.INFLIGHT:
                            if now >= unit.deadline:
                                self._apply(unit.pool.step(T.Timeout(gen)), unit.pool)
                                self._retry(unit, gen)
                        elif t.state is T.XferState.TIMEDOUT and gen in unit.next_cancel \
                                and now >= unit.next_cancel[gen]:
                            self._retry(unit, gen)
            time.sleep(self.poll_interval)


#: the pool machine effects that concern a tracked copy
_TRACKED = frozenset({T.Loaded, T.Drained, T.LoadFailed, T.SendCancel, T.WrittenOff})
