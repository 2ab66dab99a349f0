"""Device check for kvproto.gpu (see docs/gpu.md).

    python bench/gpu_check.py            # on a CUDA device (H200: a few minutes)
    python bench/gpu_check.py --cpu      # the CPU path with small sizes (the CPU twin)

For each KV arrangement (one tensor, blocks first; one tensor per layer, as
vLLM keeps it) and each object size:

1. saves random KV blocks device -> store and restores them store -> device
   through :class:`~kvproto.gpu.DeviceKV` (a same-host storage node: the save
   is a gather on the device and one copy straight into the granted region,
   the restore one copy out of the segment and a scatter), verifying every
   byte; and times both end to end (the master's grant and publish, the
   lease and its check included) against a plain pinned ``copy_`` of the same
   bytes in the same run (device -> host for saves, host -> device for
   restores). Targets on a GPU: >= 0.8x at 128 MiB, >= 0.6x at 32 MiB.
   Saves are timed twice: as a client does by default (recording the
   object's XXH3 at publish, one CPU pass over its bytes) and with
   ``Client.checksums`` off, to show that pass's share;
2. checks a timed-out copy on the real copy stream: its block stays
   quarantined, and the late completion never touches a reassigned block;
3. on a GPU, the copy unit alone (gather and DMA, DMA and scatter) in
   pieces as the store runs it and as one piece, against a plain pinned copy;
4. host bytes through the store on the same host: put, get_into and get of 8
   and 32 MiB against a memcpy of the same bytes (targets >= 0.8x and >= 0.7x).

Exit status 0 when every byte was right and the timeout check passed (the
ratios are reported, and flagged, not enforced).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="force the CPU path")
    ap.add_argument("--sizes", default=None, help="object sizes in KiB, comma-separated")
    ap.add_argument("--block-kib", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import kvproto
    from kvproto.gpu import BlockPool, DeviceKV, KVLayout, RestoreState, SaveState
    from kvproto.statemachines import timeout as T

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [1 << 10, 4 << 10] if device == "cpu" else [8 << 10, 32 << 10, 128 << 10])
    block_kib = args.block_kib or (64 if device == "cpu" else 2048)
    iters = args.iters or (3 if device == "cpu" else 7)
    heads, dim, layers = (2, 64, 2) if device == "cpu" else (8, 128, 32)
    tokens = block_kib * 1024 // (layers * 2 * heads * dim * 2)
    failures: list[str] = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"device {device}{' ' + torch.cuda.get_device_name() if device == 'cuda' else ''}; "
          f"block {block_kib} KiB; objects {sizes} KiB; iters {iters}; torch {torch.__version__}")
    max_blocks = max(sizes) // block_kib
    seg = 4 * max(sizes) * 1024 + (64 << 20)
    with kvproto.embedded(storage_nodes=1, segment_size=seg) as cluster:
        client = cluster.client()
        for layers_major in (False, True):
            layout = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=tokens,
                              layers_major=layers_major)
            assert layout.block_bytes == block_kib * 1024, (layout, layout.block_bytes)
            num = 2 * max_blocks + 4
            kvt = ([torch.zeros((num, *layout.layer_block_shape), dtype=layout.torch_dtype(), device=device)
                    for _ in range(layers)] if layers_major else
                   torch.zeros(layout.tensor_shape(num), dtype=layout.torch_dtype(), device=device))
            pool = BlockPool(kvt, layout)
            with DeviceKV(client, pool, max_blocks=max_blocks, staging=2, copy_timeout=60,
                          load_timeout=60) as kv:
                print(f"layout {layout.tag()} ({'one tensor per layer' if layers_major else 'one tensor'}); "
                      f"backend {kv.backend.kind}")
                _guarded(f"round trips {layout.tag()}", failures, _round_trips, torch, kv, pool, layout, sizes,
                         block_kib, iters, device, sync, failures, SaveState, RestoreState)
                if device == "cuda":
                    _guarded(f"copy unit {layout.tag()}", failures, _pieces, torch, kv, pool, layout, sizes,
                             block_kib, iters, sync, failures)
                if not layers_major:
                    _guarded(f"late completion {layout.tag()}", failures, _late_completion, torch, kv, pool,
                             layout, sync, failures, T)
        _guarded("host path", failures, _host_path, np, client, iters, failures)
        client.close()
    for f in failures:
        print("FAIL", f)
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


def _plain_copy(host, devbuf, d2h: bool, sync) -> float:
    """Seconds of one plain copy, device to host (``d2h``) or back: the baseline."""
    sync()
    t0 = time.perf_counter()
    host.copy_(devbuf, non_blocking=True) if d2h else devbuf.copy_(host, non_blocking=True)
    sync()
    return time.perf_counter() - t0


def _guarded(name: str, failures: list, section, *args) -> None:
    """Run one section: an exception fails that section, with its traceback
    printed, and the sections after it still run (one device run gives every
    figure it can)."""
    try:
        section(*args)
    except Exception as e:   # noqa: BLE001 - reported, and the run goes on
        traceback.print_exc()
        failures.append(f"{name}: {type(e).__name__}: {e}")


def _round_trips(torch, kv, pool, layout, sizes, block_kib, iters, device, sync, failures,
                 SaveState, RestoreState) -> None:
    r = kv.request()
    try:
        _round_trips_of(r, torch, kv, pool, layout, sizes, block_kib, iters, device, sync,
                        failures, SaveState, RestoreState)
    except BaseException:
        r.cancel()      # its blocks free for the sections after
        raise


def _round_trips_of(r, torch, kv, pool, layout, sizes, block_kib, iters, device, sync, failures,
                    SaveState, RestoreState) -> None:
    max_blocks = max(sizes) // block_kib
    src, dst = r.acquire(max_blocks), r.acquire(max_blocks)
    for size in sizes:
        n = size // block_kib
        sb, db = src[:n], dst[:n]
        nbytes = n * layout.block_bytes
        g = torch.Generator(device=device).manual_seed(size)
        for t in (pool.layers if pool.layers is not None else [pool.kv]):
            t[sb] = torch.randn(t[sb].shape, generator=g, device=device).to(t.dtype)
        want = [pool.block(b).clone() for b in sb]
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(device == "cuda"))
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def plain(d2h: bool) -> float:
            return _plain_copy(host, devbuf, d2h, sync)

        saves, restores, bare, wrong = [], [], [], 0
        for i in range(2 * iters + 2):
            # the second half saves without the checksum the client records at publish
            kv.client.checksums = i <= iters
            key = f"check/{layout.tag()}/{size}/{i}".encode()
            sync()
            t0 = time.perf_counter()
            s = r.save(key, sb)
            state = s.wait(120)
            t1 = time.perf_counter()
            if state is not SaveState.PUBLISHED:
                failures.append(f"save {size} KiB: {state} {s.error}")
                break
            for t in (pool.layers if pool.layers is not None else [pool.kv]):
                t[db] = 0
            sync()
            t2 = time.perf_counter()
            rs = r.restore(key, db)
            rstate = rs.wait(120)
            t3 = time.perf_counter()
            if rstate is not RestoreState.CONSUMABLE:
                failures.append(f"restore {size} KiB: {rstate} {rs.error}")
                break
            got = r.consume(db)
            wrong += not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
            r.release(db)
            for b in db:
                r.acquire_block(b)
            kv.client.remove(key)
            if 0 < i <= iters:
                saves.append(t1 - t0)
                restores.append(t3 - t2)
            elif i > iters + 1:
                bare.append(t1 - t0)
        if wrong:
            failures.append(f"round trip {size} KiB: bytes wrong in {wrong} of {2 * iters + 2}")
        kv.client.checksums = True
        if not saves:
            continue
        plain(True), plain(False)
        pd = statistics.median(plain(True) for _ in range(iters))
        ph = statistics.median(plain(False) for _ in range(iters))
        s_, r_ = statistics.median(saves), statistics.median(restores)
        b_ = statistics.median(bare) if bare else float("nan")
        goal = 0.8 if size >= 128 << 10 else 0.6 if size >= 32 << 10 else None
        flag = lambda ratio: "" if device == "cpu" or goal is None or ratio >= goal else f"  BELOW {goal}x"  # noqa: E731
        print(f"  {size:>7} KiB ({n} blocks, {'every byte right' if not wrong else 'BYTES WRONG'}): "
              f"save {nbytes / s_ / 1e9:6.2f} GB/s vs plain d2h {nbytes / pd / 1e9:6.2f} "
              f"ratio {pd / s_:.2f}{flag(pd / s_)} (without checksum {nbytes / b_ / 1e9:6.2f} GB/s, "
              f"ratio {pd / b_:.2f}); restore {nbytes / r_ / 1e9:6.2f} GB/s vs plain h2d "
              f"{nbytes / ph / 1e9:6.2f} ratio {ph / r_:.2f}{flag(ph / r_)}")
    r.release(src)
    r.release(dst)
    r.finish()


def _pieces(torch, kv, pool, layout, sizes, block_kib, iters, sync, failures) -> None:
    """The copy unit alone, on the copy stream: a save's gather and DMA and a
    restore's DMA and scatter, pipelined in pieces of ``PIECE_BYTES`` and as
    one piece, against a plain pinned copy of the same bytes; every byte
    checked (the pipelined gather against the one-piece one, and the blocks
    scattered back)."""
    from kvproto.gpu import blocks as gpu_blocks
    piece = gpu_blocks.PIECE_BYTES
    r = kv.request()
    max_blocks = max(sizes) // block_kib
    src, dst = r.acquire(max_blocks), r.acquire(max_blocks)
    rows = pool.layers if pool.layers is not None else [pool.kv]
    try:
        for size in sizes:
            n = size // block_kib
            sb, db = src[:n], dst[:n]
            nbytes = n * layout.block_bytes
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            want = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            devbuf = torch.empty(nbytes, dtype=torch.uint8, device=pool.device)

            def unit(into: bool, pieces: int) -> float:
                gpu_blocks.PIECE_BYTES = piece if pieces else 1 << 62
                op = pool.scatter(db) if into else pool.gather(sb)
                sync()
                t0 = time.perf_counter()
                kv.backend.submit([(host, op)]).wait(60)
                t = time.perf_counter() - t0
                gpu_blocks.PIECE_BYTES = piece
                return t

            def plain(d2h: bool) -> float:
                return _plain_copy(host, devbuf, d2h, sync)

            unit(False, 0)
            want.copy_(host)
            unit(False, 1)
            right = torch.equal(host, want)
            for t in rows:
                t[db] = 0
            unit(True, 1)
            right = right and all(torch.equal(t[db].view(torch.uint8), t[sb].view(torch.uint8))
                                  for t in rows)
            if not right:
                failures.append(f"pieces {layout.tag()} {size} KiB: bytes wrong")
            med = {(into, k): statistics.median(unit(into, k) for _ in range(iters))
                   for into in (False, True) for k in (0, 1)}
            pd = statistics.median(plain(True) for _ in range(iters))
            ph = statistics.median(plain(False) for _ in range(iters))
            rate = lambda t: f"{nbytes / t / 1e9:6.2f} GB/s"    # noqa: E731
            print(f"  copy unit {size:>7} KiB ({'every byte right' if right else 'BYTES WRONG'}): "
                  f"gather+DMA {rate(med[False, 1])} in {piece >> 20} MiB pieces, "
                  f"{rate(med[False, 0])} as one, plain d2h {rate(pd)}; DMA+scatter "
                  f"{rate(med[True, 1])} in pieces, {rate(med[True, 0])} as one, plain h2d {rate(ph)}")
    finally:
        r.release(src)
        r.release(dst)
        r.finish()


def _late_completion(torch, kv, pool, layout, sync, failures, T) -> None:
    """A timeout with a late completion on the real copy stream."""
    r = kv.request()
    a, b = r.acquire(2)
    r.release([b])
    pool.block_bytes(a).zero_()
    host = kv.backend.host_buffer(layout.block_bytes)
    host.fill_(0xAB)
    if kv.backend.kind == "cpu":
        kv.backend.hold()
    else:
        kv.backend.stall(0.5)
    late = kv.copier.issue(pool, r.name, pool.name(a), [(pool.block_bytes(a), host)], 0.02)
    try:
        late.wait()
        failures.append("stalled copy did not time out")
    except Exception as e:   # noqa: BLE001
        print(f"  timeout: {type(e).__name__}; block {a} is {pool.state_of(a).value}")
    r2 = kv.request()
    try:
        r2.acquire_block(a)
        failures.append("quarantined block was handed out")
    except Exception:   # noqa: BLE001
        pass
    r2.acquire_block(b)
    pool.block_bytes(b).fill_(0x5C)
    if kv.backend.kind == "cpu":
        kv.backend.resume()
    if not kv.copier.wait_idle(30):
        failures.append("late copy never drained")
    sync()
    untouched = bool((pool.block_bytes(b) == 0x5C).all())
    print(f"  late completion: block {a} {pool.state_of(a).value}, reassigned block {b} "
          f"{'untouched' if untouched else 'TOUCHED'}")
    if not untouched or pool.state_of(a) is not T.BufState.FREE:
        failures.append("late completion check failed")
    r2.release([b])


def _host_path(np, client, iters, failures) -> None:
    """Host bytes through a same-host store: put, get_into and get vs memcpy."""
    for mib in (8, 32):
        data = np.random.default_rng(mib).integers(0, 256, mib << 20, dtype=np.uint8)
        out = np.empty_like(data)

        def memcpy() -> float:
            t0 = time.perf_counter()
            np.copyto(out, data)
            return time.perf_counter() - t0

        memcpy()
        m = statistics.median(memcpy() for _ in range(iters))
        puts, gets, plain = [], [], []
        for i in range(iters + 1):
            key = f"host/{mib}/{i}".encode()
            t0 = time.perf_counter()
            client.put(key, data)
            t1 = time.perf_counter()
            client.get_into(key, out)
            t2 = time.perf_counter()
            got = client.get(key)
            t3 = time.perf_counter()
            if not np.array_equal(out, data) or got != memoryview(data):
                failures.append(f"host {mib} MiB: bytes wrong")
            del got
            client.remove(key)
            if i:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
                plain.append(t3 - t2)
        p, g, pg = (statistics.median(x) for x in (puts, gets, plain))
        nbytes = mib << 20
        print(f"host {mib:>2} MiB: put {nbytes / p / 1e9:6.2f} GB/s ({m / p:.2f}x memcpy), "
              f"get_into {nbytes / g / 1e9:6.2f} GB/s ({m / g:.2f}x), "
              f"get {nbytes / pg / 1e9:6.2f} GB/s ({m / pg:.2f}x), memcpy {nbytes / m / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
