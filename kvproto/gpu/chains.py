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
import warnings
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np

from kvproto import errors
from kvproto.gpu.backend import select_backend
from kvproto.gpu.blocks import BlockPool, Copier, StagingBuffers
from kvproto.runtime.datapath import Consume, Fill
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
    LEASE_EXPIRED = "lease_expired"            # copied, but its lease may have ended first
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

    A save gathers its blocks on the device and copies them once, straight
    into the region the master granted on a same-host storage segment (that
    segment is page-locked for the device once, so on a GPU the copy is one
    DMA at the pinned rate), then publishes once the copy's completion event
    was seen: the client is the region's direct writer
    (``spec/DirectWrite.tla``). A replica on another host gets the bytes from
    one of ``staging`` page-locked buffers of ``max_blocks`` blocks each. Each
    save is a copy of the block pool's machine into such a staging buffer
    (:class:`StagingBuffers`), so it names the blocks it reads as its sources
    and the machine keeps them from being released while it is awaited; a
    copy that times out leaves that buffer quarantined, and the region it was
    writing draining at its node, until the copy settles.

    A restore copies the object out of a same-host segment into its blocks
    (one DMA, then a scatter on the device), as one copy unit that writes
    every destination block of the machine; the read's lease and generation
    checks judge it after the copy's completion event. Bytes from another host
    arrive in a frame and go through one of ``staging`` more page-locked
    buffers (a transfer engine's pool). ``l2``, when given, is called
    ``l2(key, bytes)`` after publication (the second tier).
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
        #: same-host segments page-locked for this device (CUDA only)
        self._registrations: list = []
        for segments in (client._writable, client._local):
            for segment in segments.mapped():
                self._register(segment)
            segments.on_map = self._register

    # ------------------------------------------------------------------ requests

    def request(self) -> "DeviceRequest":
        name = f"g{uuid.uuid4().hex[:10]}"
        with self.copier.cv:
            self.copier.check(self.blocks.step(T.StartRequest(name)))
        return DeviceRequest(self, name)

    def counts(self) -> dict:
        with self.copier.cv:
            return {"blocks": self.blocks.counts(), "staging": self.staging.counts(),
                    "host": self.engine.counts(), "copies": self.copier.tracked()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.copier.close()
        self.backend.close()
        self.engine.close()
        for segments in (self.client._writable, self.client._local):
            segments.on_map = None
        for registration in self._registrations:   # pragma: no cover - needs a CUDA device
            registration.close()
        self._registrations.clear()

    def __enter__(self) -> "DeviceKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the save chain

    def _register(self, segment) -> None:
        """Page-lock a same-host segment the client mapped, once (CUDA only), so
        the DMAs of saves and restores go straight to and from it."""
        if self.backend.kind == "cuda":   # pragma: no cover - needs a CUDA device
            from kvproto.gpu.backend import register_host
            self._registrations.append(register_host(segment.array))

    def _host(self, view: memoryview):
        """A host buffer (a memoryview) as the 1-D uint8 tensor copies take; a
        read-only one (a segment or a frame a restore reads) is only read."""
        import torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # torch warns of read-only buffers
            return torch.frombuffer(view, dtype=torch.uint8)

    # ------------------------------------------------------------------ the save chain

    def _run_save(self, req: "DeviceRequest", chain: SaveChain, replicas: int,
                  timeout: float) -> None:
        """Gather the blocks and copy them once into the object's destination
        (:class:`~kvproto.runtime.datapath.Fill`): a same-host replica's
        granted region itself (a DMA into the registered segment), else a
        page-locked staging buffer sent on. The copy is a copy of the block
        pool's machine into a staging buffer, which names the blocks it reads
        (they cannot be released while it may read them) and which is
        quarantined if the copy times out; a same-host region it was writing
        stays draining at its node until the copy settles (DirectWrite)."""
        bb = self.layout.block_bytes
        copier, name = self.copier, req.name
        nbytes = bb * len(chain.blocks)
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
        copies: list = []

        def fill(dst: memoryview) -> None:
            copy = copier.issue(self.blocks, name, slot, [(self._host(dst), self.blocks.gather(chain.blocks))],
                                timeout, sources=[self.blocks.name(b) for b in chain.blocks])
            copies.append(copy)
            copy.wait()
            chain._reach(SaveState.DEVICE_COPIED)
            with copier.cv:
                copier.step(self.blocks, T.Consume(name, slot))

        def on_late(report) -> None:
            copier.when_settled(copies[-1], report) if copies else report()

        staging = self.staging.view(slot)[:nbytes]
        try:
            try:
                self.client.put(chain.key, Fill(nbytes, fill, on_late, staging=staging),
                                replicas=replicas, timeout=timeout)
            except errors.KvError as e:
                if copies and not chain.events[SaveState.DEVICE_COPIED].is_set():
                    release = False   # its copy was issued: the machine owns the slot now
                    chain._fail(_failure(e, SaveState.COPY_TIMED_OUT, SaveState.COPY_FAILED,
                                         SaveState.CANCELLED), e)
                else:   # the store refused, before the copy (no space...) or after it
                    chain._fail(_failure(e, SaveState.PUBLISH_FAILED, SaveState.PUBLISH_FAILED,
                                         SaveState.CANCELLED), e)
                return
            chain._reach(SaveState.PUBLISHED)
            if self.l2 is not None:
                try:
                    self.l2(chain.key, self._l2_bytes(chain, staging))
                except Exception as e:   # noqa: BLE001
                    chain._fail(SaveState.L2_FAILED, e)
                    return
                chain._reach(SaveState.L2_SAVED)
            chain._finish()
        except Exception as e:   # noqa: BLE001 - the chain records it
            if not chain.finished.is_set():
                chain._fail(SaveState.PUBLISH_FAILED, e)
        finally:
            if release:
                with copier.cv:
                    st = self.staging.state.buffers[slot]
                    if st.owner == name and st.state in (T.BufState.HELD, T.BufState.READY,
                                                         T.BufState.USED):
                        req_live = self.staging.state.requests.get(name)
                        if req_live is not None and req_live.state is T.ReqState.ACTIVE:
                            copier.step(self.blocks, T.Release(name, slot))

    def _l2_bytes(self, chain: SaveChain, staging: memoryview) -> memoryview:
        """The saved object's bytes for the second tier: read back from the store
        (the copy went straight into the segment, not through staging)."""
        self.client.get_into(chain.key, staging)
        return staging

    # ------------------------------------------------------------------ the restore chain

    def _run_restore(self, req: "DeviceRequest", chain: RestoreChain, timeout: float) -> None:
        """Read the object straight into the blocks
        (:class:`~kvproto.runtime.datapath.Consume`): out of a same-host
        segment (registered: one DMA, then a scatter on the device), or out of
        the received frame through page-locked staging. One copy unit of the
        block pool's machine writes every destination block (an ``Issue`` per
        block: a copy that times out leaves them quarantined until it settles);
        the read's lease and generation checks come after the copy completed."""
        bb = self.layout.block_bytes
        want = bb * len(chain.blocks)
        copier, name = self.copier, req.name
        entered, held = [], []

        def consume(src: memoryview) -> None:
            chain._reach(RestoreState.LOOKUP_ACKED)
            if src.nbytes != want:
                raise _LayoutMismatch(f"{chain.key!r} has {src.nbytes} bytes; {len(chain.blocks)} "
                                      f"blocks of {self.layout.tag()} hold {want}")
            if entered:
                # a same-host read that failed its check: the blocks were written
                raise errors.StaleToken(f"{chain.key!r} changed while it was read")
            host = self._host(src)
            if not self._pinned(src):
                # the received frame: through a page-locked staging buffer (cross host)
                ereq = self.engine.request()
                hbuf = ereq.acquire()
                held.append((ereq, hbuf))
                i0 = self.engine.pool.names.index(hbuf.name) * self.engine.pool.size
                staged = self._load_mem[i0:i0 + want]
                staged.copy_(host)
                host = staged
            chain._reach(RestoreState.IN_HOST)
            entered.append(True)
            names = [self.blocks.name(b) for b in chain.blocks]
            copy = copier.issue_into(self.blocks, name, names,
                                     [(host, self.blocks.scatter(chain.blocks))], timeout)
            try:
                copy.wait()
            except errors.KvError:
                # the source is the segment or staging: keep it until none can read it
                copier.expire(copy)
                copier.wait_idle_for([copy])
                raise
            buffers = self.blocks.state.buffers
            for b in names:     # each block's own copy completed
                if buffers[b].state is not T.BufState.READY:
                    raise errors.TransferTimeout(f"block {BlockPool.index(b)} was not loaded")

        try:
            try:
                self.client.get_into(chain.key, Consume(1 << 62, consume), timeout=timeout)
            finally:
                for ereq, hbuf in held:
                    try:
                        ereq.release(hbuf)
                        ereq.cancel()
                    except errors.KvError:
                        pass
        except _LayoutMismatch as e:
            chain._fail(RestoreState.LAYOUT_MISMATCH, errors.InvalidArgument(str(e)))
            return
        except errors.KeyNotFound as e:
            chain._fail(RestoreState.MISS, e)
            return
        except errors.LeaseExpired as e:
            chain._fail(RestoreState.LEASE_EXPIRED, e)
            return
        except errors.KvError as e:
            if not entered:
                state = RestoreState.LOOKUP_FAILED if not chain.events[RestoreState.LOOKUP_ACKED].is_set() \
                    else _failure(e, RestoreState.HOST_LOAD_TIMED_OUT, RestoreState.HOST_LOAD_FAILED,
                                  RestoreState.CANCELLED)
                if isinstance(e, errors.TransferTimeout) and not chain.events[RestoreState.LOOKUP_ACKED].is_set():
                    state = RestoreState.HOST_LOAD_TIMED_OUT
            else:
                state = _failure(e, RestoreState.DEVICE_COPY_TIMED_OUT, RestoreState.DEVICE_COPY_FAILED,
                                 RestoreState.CANCELLED)
            chain._fail(state, e)
            return
        chain._reach(RestoreState.CONSUMABLE)
        chain._finish()

    def _pinned(self, view: memoryview) -> bool:
        """Whether ``view`` lies in host memory device copies can read at the
        pinned rate: any host memory on the CPU path; a registered segment on a GPU."""
        if self.backend.kind != "cuda":
            return True
        ptr = np.frombuffer(view, dtype=np.uint8).ctypes.data   # pragma: no cover - needs a GPU
        return any(r.ptr <= ptr < r.ptr + r.nbytes for r in self._registrations)


class _LayoutMismatch(errors.InvalidArgument):
    """The stored object is not the size its blocks hold (another layout)."""


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
            copier.step_all(kv.blocks, [T.Acquire(self.name, b) for b in free])
            return [BlockPool.index(b) for b in free]

    def acquire_block(self, block: int) -> int:
        """Take the free block ``block`` (``BufferQuarantined`` if a copy may still write it)."""
        self.kv.copier.step(self.kv.blocks, T.Acquire(self.name, BlockPool.name(block)))
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Give blocks back, all or none: the machine refuses (``TransferInFlight``)
        a block an awaited save reads, (``BufferQuarantined``) one a copy may still write."""
        kv = self.kv
        kv.copier.step_all(kv.blocks, [T.Release(self.name, BlockPool.name(b)) for b in blocks])

    def consume(self, blocks: Sequence[int]) -> list:
        """``Consume``: the restored blocks as tensors, all or none, only of
        blocks whose own copy completed."""
        kv = self.kv
        kv.copier.step_all(kv.blocks, [T.Consume(self.name, BlockPool.name(b)) for b in blocks])
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
