"""kvproto.gpu on the CPU path (and the CUDA path where a device exists)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import kvproto  # noqa: E402
from kvproto import errors  # noqa: E402
from kvproto.gpu import (BlockPool, Copier, CpuBackend, DeviceKV, KVLayout,  # noqa: E402
                         RestoreState, SaveState)
from kvproto.statemachines import timeout as T  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=4)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fill(pool: BlockPool, blocks, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in blocks:
        pool.block(b).copy_(torch.randn(LAYOUT.block_shape, generator=g).to(pool.kv.dtype))


def raw(pool: BlockPool, b: int) -> bytes:
    return pool.block_bytes(b).cpu().numpy().tobytes()


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB") as c:
        yield c


@pytest.fixture
def dkv(cluster):
    client = cluster.client()
    kv = DeviceKV(client, BlockPool.allocate(LAYOUT, 8, device="cpu"), max_blocks=4, staging=2,
                  copy_timeout=2.0, load_timeout=2.0, cancel_interval=0.02, max_cancels=2)
    yield kv
    kv.close()
    client.close()


# ---------------------------------------------------------------- layout and pool


def test_layout_value_and_tag():
    assert LAYOUT.block_shape == (2, 2, 4, 2, 16)
    assert LAYOUT.block_bytes == 2 * 2 * 4 * 2 * 16 * 2
    assert LAYOUT.tag() == "kvl1:L2:H2:D16:bf16:B4:tp0/1"
    assert KVLayout(32, 8, 128, "float16", 16, tp_rank=1, tp_size=2).tag() == "kvl1:L32:H8:D128:fp16:B16:tp1/2"
    assert KVLayout(32, 8, 128).bytes_per_token == 128 << 10   # 32 layers x 8 heads x 128 x bf16
    with pytest.raises(ValueError):
        KVLayout(2, 2, 16, dtype="float32")
    with pytest.raises(ValueError):
        KVLayout(2, 2, 16, tp_rank=2, tp_size=2)


def test_pool_registers_a_tensor_of_its_layout():
    pool = BlockPool.allocate(LAYOUT, 4, device="cpu")
    assert pool.num_blocks == 4 and pool.names == ["blk0", "blk1", "blk2", "blk3"]
    assert all(pool.state_of(b) is T.BufState.FREE for b in range(4))
    pool.block(2).fill_(1.0)
    assert pool.block_bytes(2).numel() == LAYOUT.block_bytes and pool.block_bytes(1).sum() == 0
    with pytest.raises(errors.InvalidArgument):
        BlockPool(torch.zeros(LAYOUT.tensor_shape(2), dtype=torch.float16), LAYOUT)
    with pytest.raises(errors.InvalidArgument):
        BlockPool(torch.zeros((2, 2, 2, 4, 2, 8), dtype=torch.bfloat16), LAYOUT)


# ---------------------------------------------------------------- chains through a real store


def test_save_restore_round_trip_every_byte(dkv):
    r = dkv.request()
    src = r.acquire(3)
    fill(dkv.blocks, src, 1)
    want = [raw(dkv.blocks, b) for b in src]
    save = r.save(b"rt", src)
    assert save.wait(5) is SaveState.PUBLISHED and save.ok
    assert save.history == [SaveState.COPYING, SaveState.DEVICE_COPIED, SaveState.PUBLISHED]
    assert all(save.events[s].is_set() for s in (SaveState.DEVICE_COPIED, SaveState.PUBLISHED))
    assert not save.events[SaveState.L2_SAVED].is_set()
    r.release(src)
    r.finish()
    r2 = dkv.request()
    dst = r2.acquire(3)
    with pytest.raises(errors.BufferNotReady):   # not consumable before its copy completed
        r2.consume(dst)
    rest = r2.restore(b"rt", dst)
    assert rest.wait(5) is RestoreState.CONSUMABLE, rest.error
    assert rest.history == [RestoreState.LOOKING_UP, RestoreState.LOOKUP_ACKED, RestoreState.IN_HOST,
                            RestoreState.CONSUMABLE]
    tensors = r2.consume(dst)
    assert [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors] == want
    r2.release(dst)
    r2.finish()
    c = dkv.counts()
    assert c["blocks"]["free"] == 8 and c["staging"]["free"] == 2 and c["host"]["free"] == 2


def test_second_tier_and_its_failure(cluster):
    saved = {}
    client = cluster.client()

    def l2(key, view):
        if key == b"l2-bad":
            raise OSError("disk full")
        saved[key] = bytes(view)
    kv = DeviceKV(client, BlockPool.allocate(LAYOUT, 4, device="cpu"), max_blocks=2, l2=l2)
    try:
        r = kv.request()
        blocks = r.acquire(2)
        fill(kv.blocks, blocks, 2)
        ok = r.save(b"l2-ok", blocks)
        assert ok.wait(5) is SaveState.L2_SAVED and ok.ok
        assert saved[b"l2-ok"] == b"".join(raw(kv.blocks, b) for b in blocks)
        bad = r.save(b"l2-bad", blocks)
        assert bad.wait(5) is SaveState.L2_FAILED and bad.failed and isinstance(bad.error, OSError)
        assert bad.events[SaveState.PUBLISHED].is_set()       # L1 has it, L2 does not
        assert client.exists(b"l2-bad")
    finally:
        kv.close()
        client.close()


def test_restore_named_failures(dkv):
    r = dkv.request()
    blocks = r.acquire(2)
    miss = r.restore(b"no-such-key", blocks)
    assert miss.wait(5) is RestoreState.MISS and miss.failed
    assert not miss.events[RestoreState.LOOKUP_ACKED].is_set()
    dkv.client.put(b"short", b"x" * (LAYOUT.block_bytes + 7))
    bad = r.restore(b"short", blocks)
    assert bad.wait(5) is RestoreState.LAYOUT_MISMATCH and bad.failed
    assert bad.events[RestoreState.LOOKUP_ACKED].is_set()
    assert not bad.events[RestoreState.CONSUMABLE].is_set()
    assert all(dkv.blocks.state_of(b) is T.BufState.HELD for b in blocks)   # untouched


def test_save_publish_failure_is_named(dkv):
    r = dkv.request()
    blocks = r.acquire(1)
    dkv.client.close()      # the store is gone for this client: it grants no space
    ch = r.save(b"pub-fail", blocks)
    assert ch.wait(5) is SaveState.PUBLISH_FAILED and ch.failed
    # the copy goes into the space the store grants: none was granted, none was copied
    assert not ch.events[SaveState.DEVICE_COPIED].is_set() and not ch.events[SaveState.PUBLISHED].is_set()
    assert dkv.counts()["staging"]["free"] == 2


# ---------------------------------------------------------------- timeouts, quarantine, late completions


#: a save's timeout covers its put's round trips to the master as well as its
#: copy: long enough for those on a loaded machine (its copy is held past it)
SHORT = 0.5


def warmed(kv: DeviceKV) -> DeviceKV:
    """``kv`` whose client has put once (its connections and the segment's
    mapping made), so that a short timeout is spent on the save alone."""
    kv.client.put(b"warm-up", b"x")
    kv.client.remove(b"warm-up")
    return kv


def test_save_copy_timeout_quarantines_staging_and_never_publishes(dkv):
    r = warmed(dkv).request()
    blocks = r.acquire(2)
    fill(dkv.blocks, blocks, 3)
    dkv.backend.hold()
    ch = r.save(b"late-save", blocks, timeout=SHORT)
    assert ch.wait(5) is SaveState.COPY_TIMED_OUT and isinstance(ch.error, errors.TransferTimeout)
    assert dkv.counts()["staging"]["quarantined"] + dkv.counts()["staging"]["leaked"] == 1
    r.release(blocks)          # the late read lands only in the quarantined staging buffer
    dkv.backend.resume()
    assert dkv.copier.wait_idle(5)
    assert dkv.counts()["staging"]["free"] == 2
    assert not dkv.client.exists(b"late-save")


def test_release_of_a_block_a_save_still_reads_is_refused(dkv):
    r = dkv.request()
    blocks = r.acquire(1)
    spare = r.acquire(1)
    dkv.backend.hold()
    ch = r.save(b"busy", blocks, timeout=5)
    deadline = time.monotonic() + 5
    while not dkv.backend.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    # the save is a copy of the pool machine that names its source blocks: the
    # machine (spec SourceNotReassignedWhileRead) refuses, not a runtime guard
    (save,) = dkv.blocks.state.transfers.values()
    assert save.sources == {BlockPool.name(b) for b in blocks}
    with pytest.raises(errors.TransferInFlight):
        r.release(spare + blocks)
    assert dkv.blocks.state_of(spare[0]) is T.BufState.HELD        # all or none
    with pytest.raises(errors.TransferInFlight):
        dkv.copier.step(dkv.blocks, T.Issue(r.name, BlockPool.name(blocks[0])))
    dkv.backend.resume()
    assert ch.wait(5) is SaveState.PUBLISHED
    r.release(blocks + spare)


def _issue(copier, pool, req, block, value, timeout):
    src = torch.full((LAYOUT.block_bytes,), value, dtype=torch.uint8)
    return copier.issue(pool, req, BlockPool.name(block), [(pool.block_bytes(block), src)], timeout)


def test_late_completion_after_timeout_never_touches_a_reassigned_block():
    backend = CpuBackend()
    copier = Copier(backend, cancel_interval=0.02)
    pool = BlockPool.allocate(LAYOUT, 3, device="cpu", max_cancels=2)
    try:
        for r in ("r1", "r2", "r3"):
            copier.step(pool, T.StartRequest(r))
        copier.step(pool, T.Acquire("r1", "blk0"))
        backend.hold()                                   # the copy starts, then stalls before writing
        late = _issue(copier, pool, "r1", 0, 0xAA, timeout=0.05)
        with pytest.raises(errors.TransferTimeout):
            late.wait()
        assert pool.state_of(0) in (T.BufState.QUARANTINED, T.BufState.LEAKED)
        with pytest.raises(errors.BufferQuarantined):     # never handed out while it may be written
            copier.step(pool, T.Acquire("r2", "blk0"))
        copier.step(pool, T.Acquire("r2", "blk1"))        # recompute goes elsewhere
        pool.block_bytes(1).fill_(0x11)
        # the cancel cannot stop a running copy: it is written off after max_cancels
        deadline = time.monotonic() + 5
        while pool.state_of(0) is not T.BufState.LEAKED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.state_of(0) is T.BufState.LEAKED and pool.state.stats.written_off == 1
        backend.resume()                                  # the late completion arrives
        assert copier.wait_idle(5)
        assert pool.state_of(0) is T.BufState.FREE and pool.state.stats.recovered == 1
        assert bytes(pool.block_bytes(1).numpy()) == b"\x11" * LAYOUT.block_bytes   # untouched
        # block 0 is reassigned and loaded under a new generation...
        copier.step(pool, T.Acquire("r3", "blk0"))
        fresh = _issue(copier, pool, "r3", 0, 0x55, timeout=2)
        fresh.wait()
        # ...and a replayed completion of the old generation is dropped without effect
        before = pool.state.stats.stale_dropped
        effects = copier.inject_completion(pool, late.gen, "blk0")
        assert isinstance(effects[0], T.Refused) and isinstance(effects[0].error, errors.StaleGeneration)
        assert pool.state.stats.stale_dropped == before + 1
        assert pool.state_of(0) is T.BufState.READY
        copier.step(pool, T.Consume("r3", "blk0"))
        assert bytes(pool.block_bytes(0).numpy()) == b"\x55" * LAYOUT.block_bytes
        assert bytes(pool.block_bytes(1).numpy()) == b"\x11" * LAYOUT.block_bytes
    finally:
        backend.resume()
        copier.close()
        backend.close()


def test_cancelled_copies_queued_are_stopped_running_drain_late():
    backend = CpuBackend()
    copier = Copier(backend, cancel_interval=0.02)
    pool = BlockPool.allocate(LAYOUT, 3, device="cpu")
    try:
        copier.step(pool, T.StartRequest("r"))
        copier.step(pool, T.Acquire("r", "blk0"))
        copier.step(pool, T.Acquire("r", "blk1"))
        backend.hold()
        running = _issue(copier, pool, "r", 0, 0x01, timeout=10)
        queued = _issue(copier, pool, "r", 1, 0x02, timeout=10)
        deadline = time.monotonic() + 5
        while not backend.running() and time.monotonic() < deadline:
            time.sleep(0.005)
        copier.step(pool, T.RequestCancel("r"))           # the result is no longer needed
        for c in (running, queued):
            with pytest.raises(errors.RequestNotActive):
                c.wait()
        # the queued copy was stopped before it wrote: acked, drained, never written
        deadline = time.monotonic() + 5
        while pool.state_of(1) is not T.BufState.FREE and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pool.state_of(1) is T.BufState.FREE
        assert pool.block_bytes(1).sum() == 0
        # the running one cannot be stopped: quarantined (written off once its cancels went unanswered)
        assert pool.state_of(0) in (T.BufState.QUARANTINED, T.BufState.LEAKED)
        backend.resume()
        assert copier.wait_idle(5)
        assert pool.block_bytes(0).sum() > 0          # the late bytes landed in the quarantined block only
        assert pool.state_of(0) is T.BufState.FREE and "r" not in pool.state.requests
    finally:
        backend.resume()
        copier.close()
        backend.close()


def test_chain_cancelled_by_request_cancel(dkv):
    r = dkv.request()
    blocks = r.acquire(1)
    dkv.backend.hold()
    ch = r.save(b"cancelled", blocks, timeout=5)
    deadline = time.monotonic() + 5
    while not dkv.backend.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    r.cancel()
    assert ch.wait(5) is SaveState.CANCELLED and ch.failed
    dkv.backend.resume()
    assert dkv.copier.wait_idle(5)
    assert not dkv.client.exists(b"cancelled")


def test_restore_device_copy_timeout_quarantines_blocks(dkv):
    r = dkv.request()
    src = r.acquire(2)
    fill(dkv.blocks, src, 4)
    assert r.save(b"to-restore", src).wait(5) is SaveState.PUBLISHED
    r2 = dkv.request()
    dst = r2.acquire(2)
    dkv.backend.hold()
    ch = r2.restore(b"to-restore", dst, timeout=0.3)
    assert ch.wait_for(RestoreState.IN_HOST, 5)
    assert ch.wait(5) is RestoreState.DEVICE_COPY_TIMED_OUT and ch.failed
    assert not ch.events[RestoreState.CONSUMABLE].is_set()
    assert any(dkv.blocks.state_of(b) in (T.BufState.QUARANTINED, T.BufState.LEAKED) for b in dst)
    with pytest.raises(errors.BufferQuarantined):
        r2.consume(dst)
    dkv.backend.resume()
    assert dkv.copier.wait_idle(5)


@cuda
def test_cuda_round_trip():   # pragma: no cover - needs a CUDA device
    pool = BlockPool.allocate(LAYOUT, 4, device="cuda")
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB") as c, \
            DeviceKV(c.client(), pool, max_blocks=2) as kv:
        assert kv.backend.kind == "cuda"
        r = kv.request()
        blocks = r.acquire(2)
        pool.kv[blocks] = torch.randn((2, *LAYOUT.block_shape), device="cuda").to(pool.kv.dtype)
        want = pool.kv[blocks].clone()
        assert r.save(b"cuda", blocks).wait(10) is SaveState.PUBLISHED
        r2 = kv.request()
        dst = r2.acquire(2)
        assert r2.restore(b"cuda", dst).wait(10) is RestoreState.CONSUMABLE
        got = torch.stack(r2.consume(dst))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@cuda
@pytest.mark.parametrize("layers_major", [False, True])
def test_cuda_round_trip_in_pieces(monkeypatch, layers_major):   # pragma: no cover - needs CUDA
    """Save and restore through the store on the device, pipelined in pieces
    of three block rows (so a piece ends inside a layer's share): every byte."""
    from kvproto.gpu import blocks as gpu_blocks
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, layers_major=layers_major)
    kvt = ([torch.zeros((12, *lay.layer_block_shape), dtype=torch.bfloat16, device="cuda")
            for _ in range(3)] if layers_major else
           torch.zeros(lay.tensor_shape(12), dtype=torch.bfloat16, device="cuda"))
    pool = BlockPool(kvt, lay)
    monkeypatch.setattr(gpu_blocks, "PIECE_BYTES", 3 * pool._rows[0].shape[1])
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB") as c, \
            DeviceKV(c.client(), pool, max_blocks=6) as kv:
        r = kv.request()
        src = [7, 8, 2, 0, 1, 10]
        r.acquire(12)
        r.release([b for b in range(12) if b not in src])
        for t in (pool.layers or [pool.kv]):
            t[src] = torch.randn(t[src].shape, device="cuda").to(t.dtype)
        want = [raw(pool, b) for b in src]
        assert len(pool.pieces(len(src), gpu_blocks.PIECE_BYTES)) > 1
        assert r.save(b"pieces/" + lay.tag().encode(), src).wait(10) is SaveState.PUBLISHED
        dst = r.acquire(6)
        assert r.restore(b"pieces/" + lay.tag().encode(), dst).wait(10) is RestoreState.CONSUMABLE
        r.consume(dst)
        assert [raw(pool, b) for b in dst] == want


def test_gpu_check_cpu_smoke():
    import pathlib
    import runpy
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    main = runpy.run_path(str(path))["main"]
    assert main(["--cpu", "--sizes", "64,256", "--block-kib", "32", "--iters", "1"]) == 0


# ---------------------------------------------------------------- the direct path and the layers-first layout


def test_a_save_is_one_copy_into_the_granted_region_and_a_restore_one_out_of_it(dkv):
    """Same host: the save's gather lands straight in the region the master
    granted (the client is its direct writer), the restore copies straight
    out of the segment into the blocks; no payload crosses a socket."""
    c = dkv.client.transfer_counters
    before = dict(c)
    r = dkv.request()
    src = r.acquire(2)
    fill(dkv.blocks, src, 5)
    want = [raw(dkv.blocks, b) for b in src]
    assert r.save(b"direct", src).wait(5) is SaveState.PUBLISHED
    dst = r.acquire(2)
    assert r.restore(b"direct", dst).wait(5) is RestoreState.CONSUMABLE
    assert [t.contiguous().view(torch.uint8).numpy().tobytes() for t in r.consume(dst)] == want
    assert c["direct_writes"] - before["direct_writes"] == 1
    assert c["local_reads"] - before["local_reads"] == 1
    assert c["network_writes"] == before["network_writes"] and c["network_reads"] == before["network_reads"]


def test_a_timed_out_save_keeps_its_region_draining_until_the_copy_settles(dkv):
    r = warmed(dkv).request()
    blocks = r.acquire(2)
    dkv.backend.hold()
    ch = r.save(b"late-direct", blocks, timeout=SHORT)
    assert ch.wait(5) is SaveState.COPY_TIMED_OUT

    def draining():
        return sum(s["draining"] for s in dkv.client.stats()["segments"].values())
    deadline = time.monotonic() + 5
    while draining() == 0 and time.monotonic() < deadline:      # revoked: held for the copy
        time.sleep(0.01)
    assert draining() == 2 * LAYOUT.block_bytes
    dkv.backend.resume()                                        # the copy lands late, and settles
    deadline = time.monotonic() + 5
    while draining() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert draining() == 0 and not dkv.client.exists(b"late-direct")


@pytest.mark.parametrize("remote", [False, True])
def test_layers_first_kv_round_trips(cluster, remote):
    """One tensor per layer (``[blocks, 2, tokens, heads, dim]``, as vLLM keeps
    it): blocks gathered across the layers into one object and scattered back,
    through the same-host path or over the network."""
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, layers_major=True)
    assert lay.tag().endswith(":lm") and lay.block_bytes == 3 * 2 * 4 * 2 * 16 * 2
    layers = [torch.zeros((6, *lay.layer_block_shape), dtype=torch.bfloat16) for _ in range(3)]
    client = cluster.client(local_reads=not remote, local_writes=not remote)
    kv = DeviceKV(client, BlockPool(layers, lay), max_blocks=3, staging=2)
    try:
        r = kv.request()
        src, dst = r.acquire(3), r.acquire(3)
        for i, t in enumerate(layers):
            t[src] = torch.randn((3, *lay.layer_block_shape)).to(torch.bfloat16) + i
        want = [t[src].clone() for t in layers]
        key = b"lm/" + (b"remote" if remote else b"local")
        assert r.save(key, src).wait(5) is SaveState.PUBLISHED
        assert r.restore(key, dst).wait(5) is RestoreState.CONSUMABLE, r
        r.consume(dst)
        for t, w in zip(layers, want):
            assert torch.equal(t[dst].view(torch.uint8), w.view(torch.uint8))
        # another layout's object is refused, whatever its key
        other = DeviceKV(client, BlockPool.allocate(LAYOUT, 4, device="cpu"), max_blocks=2)
        try:
            r2 = other.request()
            bad = r2.restore(key, r2.acquire(2))
            assert bad.wait(5) is RestoreState.LAYOUT_MISMATCH
        finally:
            other.close()
        with pytest.raises(errors.InvalidArgument):
            BlockPool(layers[:2], lay)
    finally:
        kv.close()
        client.close()


@pytest.mark.parametrize("layers_major", [False, True])
def test_blocks_in_runs_round_trip_as_one_copy_unit(cluster, layers_major):
    """Blocks that are not one run (ids out of order, gaps, single blocks) are
    gathered and scattered run by run; a restore is one copy unit of a
    generation per block, every block loaded, and the copier tracks nothing after."""
    assert BlockPool.runs([4, 5, 6, 0, 2, 3, 9]) == [(0, 4, 3), (3, 0, 1), (4, 2, 2), (6, 9, 1)]
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, layers_major=layers_major)
    kvt = ([torch.zeros((12, *lay.layer_block_shape), dtype=torch.bfloat16) for _ in range(2)]
           if layers_major else torch.zeros(lay.tensor_shape(12), dtype=torch.bfloat16))
    pool = BlockPool(kvt, lay)
    client = cluster.client()
    kv = DeviceKV(client, pool, max_blocks=6, staging=1)
    try:
        r = kv.request()
        r.acquire(12)
        src, dst = [7, 8, 2, 0, 1, 10], [5, 6, 11, 3, 4, 9]
        r.release(dst)
        g = torch.Generator().manual_seed(7)
        for b in src:
            for t in (pool.layers or [pool.kv]):
                t[b] = torch.randn(t[b].shape, generator=g).to(torch.bfloat16)
        want = [raw(pool, b) for b in src]
        assert r.save(b"runs/" + lay.tag().encode(), src).wait(5) is SaveState.PUBLISHED
        r.acquire(6)
        gen = pool.state.next_gen
        assert r.restore(b"runs/" + lay.tag().encode(), dst).wait(5) is RestoreState.CONSUMABLE
        assert pool.state.next_gen == gen + len(dst)
        r.consume(dst)
        assert [raw(pool, b) for b in dst] == want and kv.copier.tracked() == 0
    finally:
        kv.close()
        client.close()


def test_a_copy_unit_of_no_buffer_is_refused():
    pool = BlockPool.allocate(LAYOUT, 2, device="cpu")
    backend = CpuBackend()
    copier = Copier(backend)
    try:
        copier.step(pool, T.StartRequest("r"))
        with pytest.raises(errors.InvalidArgument):
            copier.issue_into(pool, "r", [], [], 1.0)
        assert copier.tracked() == 0 and pool.state.next_gen == 1
    finally:
        copier.close()
        backend.close()


class _Streams:
    """A stand-in for ``torch.cuda``'s streams and events on the CPU: work
    runs at once, and each copy, gather, scatter, event record and wait is
    written down with the stream it was issued on, so a test can check the
    order a device would keep."""

    def __init__(self, monkeypatch) -> None:
        import contextlib
        self.log: list = []
        self.current = "copy"
        log, streams = self.log, self

        class Stream:
            def __init__(self, name="side", device=None):
                self.name = name

            def wait_stream(self, other):
                log.append((self.name, "wait_stream", other.name))

            def wait_event(self, event):
                log.append((self.name, "wait_event", event.id))

        class Event:
            made = 0

            def __init__(self):
                Event.made += 1
                self.id = Event.made

            def record(self, stream):
                log.append((stream.name, "record", self.id))

        @contextlib.contextmanager
        def stream(s):
            before, streams.current = streams.current, s.name
            try:
                yield
            finally:
                streams.current = before

        def logged(name, inner):
            def run(*a, **k):
                log.append((streams.current, name))
                return inner(*a, **k)
            return run

        copy_stream = Stream("copy")
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: copy_stream)
        monkeypatch.setattr(torch, "index_select", logged("gather", torch.index_select))
        monkeypatch.setattr(torch.Tensor, "index_copy_", logged("scatter", torch.Tensor.index_copy_))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
        copy_ = torch.Tensor.copy_

        def dma(self, src, non_blocking=False):
            if non_blocking:        # the DMAs; the test's own copies block
                log.append((streams.current, "dma"))
            return copy_(self, src, non_blocking=non_blocking)
        monkeypatch.setattr(torch.Tensor, "copy_", dma)


@pytest.mark.parametrize("layers_major", [False, True])
@pytest.mark.parametrize("piece", [1, 3, 5, 64], ids=lambda p: f"{p}-rows")
def test_a_device_save_and_restore_are_pipelined_piece_by_piece(monkeypatch, layers_major, piece):
    """The GPU's copy unit (``BlockPool._pipelined``), run on the CPU with
    recorded streams: the pieces cover the object's bytes once, in order; a
    save's piece is DMA'd on the copy stream after waiting for its own
    gather's event (not for the side stream as a whole, so the next gather
    runs during the DMA); a restore's piece is scattered on the side stream
    after waiting for its own DMA's event, and the copy stream waits for the
    side stream at the end. The bytes are those of the run-by-run CPU copy."""
    from kvproto.gpu import blocks as gpu_blocks
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, layers_major=layers_major)
    kvt = ([torch.randn((10, *lay.layer_block_shape)).to(torch.bfloat16) for _ in range(3)]
           if layers_major else torch.randn(lay.tensor_shape(10)).to(torch.bfloat16))
    pool = BlockPool(kvt, lay)
    row = pool._rows[0].shape[1]
    chosen = [7, 8, 2, 0, 1, 9]
    n = len(chosen)
    pieces = pool.pieces(n, piece * row)
    spans = [pool.span(n, p) for p in pieces]
    assert spans[0][0] == 0 and spans[-1][1] == n * lay.block_bytes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(0 < hi - lo <= max(piece, 1) * row for lo, hi in spans)

    want = torch.zeros(n * lay.block_bytes, dtype=torch.uint8)
    pool.gather(chosen)(want)                   # the CPU's run-by-run copy
    monkeypatch.setattr(gpu_blocks, "PIECE_BYTES", piece * row)
    streams = _Streams(monkeypatch)
    saved = torch.zeros_like(want)
    pool._pipelined(chosen, into_blocks=False)(saved)
    assert torch.equal(saved, want)
    log = streams.log
    assert log[0] == ("side", "wait_stream", "copy")
    dmas = [i for i, e in enumerate(log) if e == ("copy", "dma")]
    assert len(dmas) == len(pieces)
    assert {e[0] for e in log if e[1] == "gather"} == {"side"}
    for k, at in enumerate(dmas):
        (event,) = [e[2] for e in log[:at] if e[:2] == ("side", "record")][k:k + 1]
        assert log[at - 1] == ("copy", "wait_event", event)     # its own gather, then the DMA
    # the copy stream waits for no later gather: the next one runs during a DMA
    assert ("copy", "wait_stream", "side") not in log

    targets = BlockPool([torch.zeros_like(t) for t in kvt] if layers_major else torch.zeros_like(kvt),
                        lay)
    dst = [3, 4, 5, 6, 0, 1]
    log.clear()
    targets._pipelined(dst, into_blocks=True)(saved)
    for b_src, b_dst in zip(chosen, dst):
        assert raw(targets, b_dst) == raw(pool, b_src)
    assert {e[0] for e in log if e[1] == "scatter"} == {"side"}
    assert [e[0] for e in log if e[1] == "dma"] == ["copy"] * len(pieces)
    waits = [i for i, e in enumerate(log) if e[:2] == ("side", "wait_event")]
    assert len(waits) == len(pieces)
    for at in waits:
        assert log[at - 1][:2] == ("copy", "record") and log[at - 2] == ("copy", "dma")
        assert log[at + 1] == ("side", "scatter")
    assert log[-1] == ("copy", "wait_stream", "side")
