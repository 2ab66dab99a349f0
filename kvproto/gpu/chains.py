"""The save and restore completion chains, as small named-state objects an
engine waits on, and :class:`DeviceKV`, which runs them. Each chain is three
events that happen at different moments (a save may be restored by another
request, with failures in between), so each stage is observed on its own.

Save (:class:`SaveChain`): ``DEVICE_COPIED`` (blocks copied into a page-locked
staging buffer, the copy's event observed) -> ``PUBLISHED`` (``client.put``
returned) -> ``L2_SAVED`` (only when a second tier is given). Restore
(:class:`RestoreChain`): ``LOOKUP_ACKED`` (the master granted the read) ->
``IN_HOST`` (the bytes are in a page-locked host buffer) -> ``CONSUMABLE``
(the bytes are in the device blocks, every block's copy event observed).

Each stage has a ``threading.Event``; :meth:`_Chain.wait` waits for the chain
to end and returns its state. A failed or timed-out step ends the chain in a
named state (``COPY_TIMED_OUT``, ``PUBLISH_FAILED``, ``HOST_LOAD_TIMED_OUT``,
``LAYOUT_MISMATCH``, ``CANCELLED``, ...) with :attr:`_Chain.error` set; a chain
never ends as done after a failure.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from kvproto import errors
from kvproto.gpu.backend import select_backend
from kvproto.gpu.blocks import BlockPool, Copier, StagingBuffers
from kvproto.statemachines import timeout as T


class SaveState(str, enum.Enum):
    COPYING = "copying"
    DEVICE_COPIED = "device_copied"
    PUBLISHED = "published"            # done when there is no second tier
    L2_SAVED = "l2_saved"              # done
    NO_STAGING = "no_staging"          # failed: no free staging buffer
    COPY_TIMED_OUT = "copy_timed_out"  # failed: the staging buffer is quarantined
    COPY_FAILED = "copy_failed"
    PUBLISH_FAILED = "publish_failed"
    L2_FAILED = "l2_failed"            # published in L1, not saved in L2
    CANCELLED = "cancelled"


class RestoreState(str, enum.Enum):
    LOOKING_UP = "looking_up"
    LOOKUP_ACKED = "lookup_acked"
    IN_HOST = "in_host"
    CONSUMABLE = "consumable"                  # done
    MISS = "miss"                              # ended: the key is not in the store
    LOOKUP_FAILED = "lookup_failed"
    LAYOUT_MISMATCH = "layout_mismatch"
    HOST_LOAD_TIMED_OUT = "host_load_timed_out"
    HOST_LOAD_FAILED = "host_load_failed"
    DEVICE_COPY_TIMED_OUT = "device_copy_timed_out"   # the blocks are quarantined
    DEVICE_COPY_FAILED = "device_copy_failed"
    CANCELLED = "cancelled"


_SAVE_STAGES = (SaveState.DEVICE_COPIED, SaveState.PUBLISHED, SaveState.L2_SAVED)
_RESTORE_STAGES = (RestoreState.LOOKUP_ACKED, RestoreState.IN_HOST, RestoreState.CONSUMABLE)


class _Chain:
    _stages: tuple = ()
    _done: tuple = ()

    def __init__(self, key: bytes, blocks: Sequence[int], first) -> None:
        self.key = key
        self.blocks = tuple(blocks)
        self.state = first
        self.error: Optional[BaseException] = None
        self.events = {s: threading.Event() for s in self._stages}
        self.finished = threading.Event()
        self.history = [first]
        self._lock = threading.Lock()

    def _reach(self, state) -> None:
        with self._lock:
            self.state = state
            self.history.append(state)
        if state in self.events:
            self.events[state].set()

    def _fail(self, state, error: BaseException) -> None:
        with self._lock:
            self.state, self.error = state, error
            self.history.append(state)
        self.finished.set()

    def _finish(self) -> None:
        self.finished.set()

    @property
    def ok(self) -> bool:
        return self.finished.is_set() and self.state in self._done

    @property
    def failed(self) -> bool:
        return self.finished.is_set() and self.state not in self._done

    def wait_for(self, stage, timeout: Optional[float] = None) -> bool:
        """True once ``stage`` was reached; False if the chain ended without it
        or ``timeout`` passed."""
        ev = self.events[stage]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ev.is_set():
            if self.finished.is_set():
                return ev.is_set()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.finished.wait(0.01 if left is None else min(left, 0.01))
        return True

    def wait(self, timeout: Optional[float] = None):
        """Wait for the chain to end; its final state (or the current one on timeout)."""
        self.finished.wait(timeout)
        return self.state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key!r} {self.state.value}>"


class SaveChain(_Chain):
    _stages = _SAVE_STAGES
    _done = (SaveState.PUBLISHED, SaveState.L2_SAVED)

    def __init__(self, key: bytes, blocks: Sequence[int]) -> None:
        super().__init__(key, blocks, SaveState.COPYING)


class RestoreChain(_Chain):
    _stages = _RESTORE_STAGES
    _done = (RestoreState.CONSUMABLE,)

    def __init__(self, key: bytes, blocks: Sequence[int]) -> None:
        super().__init__(key, blocks, RestoreState.LOOKING_UP)


def _failure(error: BaseException, timed_out, failed, cancelled):
    if isinstance(error, errors.TransferTimeout):
        return timed_out
    if isinstance(error, errors.RequestNotActive):
        return cancelled
    return failed


class DeviceKV:
    """Moves KV blocks of a :class:`BlockPool` to and from the store.

    ``staging`` page-locked host buffers of ``max_blocks`` blocks each back
    saves (device -> host copies under the pool machine). They are buffers of
    the block pool's own machine (:class:`StagingBuffers`), so a save names the
    blocks it reads as its sources and the machine keeps them from being
    released while the save is awaited (its leak ledger and ``max_cancels`` are
    the block pool's). A transfer engine
    over ``staging`` more page-locked buffers backs restores (store -> host
    under the pool machine), from which host -> device copies go to blocks.
    ``l2``, when given, is called ``l2(key, bytes)`` after publication (the
    second tier).
    """

    def __init__(self, client, blocks: BlockPool, *, max_blocks: int = 8, staging: int = 4,
                 backend=None, copy_timeout: float = 5.0, load_timeout: float = 5.0,
                 l2: Optional[Callable[[bytes, memoryview], None]] = None,
                 cancel_interval: float = 0.05, max_cancels: int = 3, max_leaked: int = 4,
                 workers: int = 4) -> None:
        self.client = client
        self.blocks = blocks
        self.layout = blocks.layout
        self.max_blocks = max_blocks
        self.backend = backend if backend is not None else select_backend(blocks.device)
        self.copier = Copier(self.backend, cancel_interval=cancel_interval)
        self.copy_timeout, self.load_timeout, self.l2 = copy_timeout, load_timeout, l2
        size = max_blocks * self.layout.block_bytes
        self._save_mem = self.backend.host_buffer(staging * size)
        # buffers of the block pool's machine, so a save names the blocks it reads
        self.staging = StagingBuffers(blocks, staging, size, self._save_mem.numpy())
        self._load_mem = self.backend.host_buffer(staging * size)
        self.engine = client.transfer_engine(staging, size, memory=self._load_mem.numpy(),
                                             max_cancels=max_cancels, max_leaked=max_leaked,
                                             cancel_interval=cancel_interval)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvproto-gpu-chain")

    # ------------------------------------------------------------------ requests

    def request(self) -> "DeviceRequest":
        name = f"g{uuid.uuid4().hex[:10]}"
        with self.copier.cv:
            self.copier.check(self.blocks.step(T.StartRequest(name)))
        return DeviceRequest(self, name)

    def counts(self) -> dict:
        with self.copier.cv:
            return {"blocks": self.blocks.counts(), "staging": self.staging.counts(),
                    "host": self.engine.counts(), "copies": len(self.copier._copies)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.copier.close()
        self.backend.close()
        self.engine.close()

    def __enter__(self) -> "DeviceKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the save chain

    def _staging_slice(self, buffer: str, nbytes: int):
        i = self.staging.names.index(buffer)
        base = i * self.staging.size
        return self._save_mem[base:base + nbytes]

    def _run_save(self, req: "DeviceRequest", chain: SaveChain, replicas: int,
                  timeout: float) -> None:
        bb = self.layout.block_bytes
        copier, name = self.copier, req.name
        try:
            with copier.cv:
                slot = self.staging.first_free()
                if slot is None:
                    raise errors.BufferBusy(f"no free staging buffer ({self.staging.counts()})")
                copier.step(self.blocks, T.Acquire(name, slot))
        except errors.KvError as e:
            chain._fail(_failure(e, SaveState.NO_STAGING, SaveState.NO_STAGING, SaveState.CANCELLED), e)
            return
        release = True
        try:
            dst = self._staging_slice(slot, bb * len(chain.blocks))
            pairs = [(dst[i * bb:(i + 1) * bb], self.blocks.block_bytes(b))
                     for i, b in enumerate(chain.blocks)]
            try:
                copy = copier.issue(self.blocks, name, slot, pairs, timeout,
                                    sources=[self.blocks.name(b) for b in chain.blocks])
                copy.wait()
            except errors.KvError as e:
                release = False   # quarantined (or the request ended): the machine owns it now
                chain._fail(_failure(e, SaveState.COPY_TIMED_OUT, SaveState.COPY_FAILED,
                                     SaveState.CANCELLED), e)
                return
            chain._reach(SaveState.DEVICE_COPIED)
            try:
                with copier.cv:
                    copier.step(self.blocks, T.Consume(name, slot))
                view = self.staging.view(slot)[:bb * len(chain.blocks)]
                self.client.put(chain.key, view, replicas=replicas, timeout=timeout)
            except Exception as e:   # noqa: BLE001 - the chain records it
                chain._fail(SaveState.PUBLISH_FAILED, e)
                return
            chain._reach(SaveState.PUBLISHED)
            if self.l2 is not None:
                try:
                    self.l2(chain.key, view)
                except Exception as e:   # noqa: BLE001
                    chain._fail(SaveState.L2_FAILED, e)
                    return
                chain._reach(SaveState.L2_SAVED)
            chain._finish()
        finally:
            if release:
                with copier.cv:
                    st = self.staging.state.buffers[slot]
                    if st.owner == name and st.state in (T.BufState.HELD, T.BufState.READY,
                                                         T.BufState.USED):
                        req_live = self.staging.state.requests.get(name)
                        if req_live is not None and req_live.state is T.ReqState.ACTIVE:
                            copier.step(self.blocks, T.Release(name, slot))

    # ------------------------------------------------------------------ the restore chain

    def _run_restore(self, req: "DeviceRequest", chain: RestoreChain, timeout: float) -> None:
        bb = self.layout.block_bytes
        want = bb * len(chain.blocks)
        ereq = self.engine.request()
        hbuf = None
        try:
            try:
                hbuf = ereq.acquire()
                load = ereq.load(chain.key, hbuf, timeout=timeout)
            except errors.KeyNotFound as e:
                chain._fail(RestoreState.MISS, e)
                return
            except errors.KvError as e:
                chain._fail(RestoreState.LOOKUP_FAILED, e)
                return
            chain._reach(RestoreState.LOOKUP_ACKED)
            try:
                load.wait()
            except errors.KvError as e:
                chain._fail(_failure(e, RestoreState.HOST_LOAD_TIMED_OUT, RestoreState.HOST_LOAD_FAILED,
                                     RestoreState.CANCELLED), e)
                return
            length = load._x.length
            if length != want:
                ereq.consume(hbuf)
                chain._fail(RestoreState.LAYOUT_MISMATCH, errors.InvalidArgument(
                    f"{chain.key!r} has {length} bytes; {len(chain.blocks)} blocks of "
                    f"{self.layout.tag()} hold {want}"))
                return
            chain._reach(RestoreState.IN_HOST)
            ereq.consume(hbuf)
            i0 = self.engine.pool.names.index(hbuf.name) * self.engine.pool.size
            src = self._load_mem[i0:i0 + want]
            copies = []
            try:
                for i, b in enumerate(chain.blocks):
                    copies.append(self.copier.issue(
                        self.blocks, req.name, self.blocks.name(b),
                        [(self.blocks.block_bytes(b), src[i * bb:(i + 1) * bb])], timeout))
                for c in copies:
                    c.wait()
            except errors.KvError as e:
                chain._fail(_failure(e, RestoreState.DEVICE_COPY_TIMED_OUT,
                                     RestoreState.DEVICE_COPY_FAILED, RestoreState.CANCELLED), e)
                # the host buffer is the copies' source: keep it until none can read it
                for c in copies:
                    if not c.done():
                        self.copier._expire(c._rec)
                self.copier.wait_idle_for(copies)
                return
            chain._reach(RestoreState.CONSUMABLE)
            chain._finish()
        finally:
            if hbuf is not None:
                try:
                    ereq.release(hbuf)
                except errors.KvError:
                    pass
            try:
                ereq.cancel()
            except errors.KvError:
                pass


class DeviceRequest:
    """One engine request's use of the device blocks."""

    def __init__(self, kv: DeviceKV, name: str) -> None:
        self.kv, self.name = kv, name

    def acquire(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (``BufferBusy`` when fewer are free)."""
        kv, copier = self.kv, self.kv.copier
        with copier.cv:
            free = [b for b in kv.blocks.names if kv.blocks.state.buffers[b].state is T.BufState.FREE][:n]
            if len(free) < n:
                raise errors.BufferBusy(f"{n} blocks wanted, {len(free)} free")
            for b in free:
                copier.step(kv.blocks, T.Acquire(self.name, b))
            return [BlockPool.index(b) for b in free]

    def acquire_block(self, block: int) -> int:
        """Take the free block ``block`` (``BufferQuarantined`` if a copy may still write it)."""
        self.kv.copier.step(self.kv.blocks, T.Acquire(self.name, BlockPool.name(block)))
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Give blocks back, all or none: the machine refuses (``TransferInFlight``)
        a block an awaited save reads, (``BufferQuarantined``) one a copy may still write."""
        kv, copier = self.kv, self.kv.copier
        events = [T.Release(self.name, BlockPool.name(b)) for b in blocks]
        with copier.cv:
            trial = kv.blocks.state                      # the machine is pure: try them all first
            for ev in events:
                trial, effects = T.pool_step(trial, ev)
                copier.check(effects)
            for ev in events:
                copier.step(kv.blocks, ev)

    def consume(self, blocks: Sequence[int]) -> list:
        """``Consume``: the restored blocks as tensors, only of blocks whose own copy completed."""
        kv, copier = self.kv, self.kv.copier
        with copier.cv:
            for b in blocks:
                copier.step(kv.blocks, T.Consume(self.name, BlockPool.name(b)))
        return [kv.blocks.block(b) for b in blocks]

    def save(self, key: bytes, blocks: Sequence[int], *, replicas: int = 1,
             timeout: Optional[float] = None) -> SaveChain:
        """Start the save chain of ``blocks`` (held by this request) as object ``key``."""
        kv = self.kv
        self._check_blocks(blocks, (T.BufState.HELD, T.BufState.READY, T.BufState.USED))
        chain = SaveChain(key, blocks)
        kv._pool.submit(kv._run_save, self, chain, replicas,
                        kv.copy_timeout if timeout is None else timeout)
        return chain

    def restore(self, key: bytes, blocks: Sequence[int], *, timeout: Optional[float] = None) -> RestoreChain:
        """Start the restore chain of object ``key`` into ``blocks`` (held by this request)."""
        kv = self.kv
        self._check_blocks(blocks, (T.BufState.HELD,))
        chain = RestoreChain(key, blocks)
        kv._pool.submit(kv._run_restore, self, chain, kv.load_timeout if timeout is None else timeout)
        return chain

    def cancel(self) -> None:
        """``RequestCancel``: awaited copies are abandoned (their destinations
        quarantined until they drain), idle blocks and staging buffers freed."""
        kv, copier = self.kv, self.kv.copier
        with copier.cv:
            if self.name in kv.blocks.state.requests:
                copier.step(kv.blocks, T.RequestCancel(self.name))

    def finish(self) -> None:
        """``RequestFinish`` (refused while a copy is awaited)."""
        kv, copier = self.kv, self.kv.copier
        with copier.cv:
            req = kv.blocks.state.requests.get(self.name)
            if req is not None and req.pending:
                raise errors.TransferInFlight(f"request {self.name}: copies still awaited")
            if req is not None:
                copier.step(kv.blocks, T.RequestFinish(self.name))

    def _check_blocks(self, blocks: Sequence[int], states: tuple) -> None:
        kv = self.kv
        if not blocks or len(blocks) > kv.max_blocks:
            raise errors.InvalidArgument(f"1..{kv.max_blocks} blocks per object, not {len(blocks)}")
        with kv.copier.cv:
            for b in blocks:
                buf = kv.blocks.state.buffers.get(BlockPool.name(b))
                if buf is None or buf.owner != self.name or buf.state not in states:
                    raise errors.BufferBusy(f"block {b} is not held by {self.name} in state "
                                            f"{'/'.join(s.value for s in states)}")
