"""Device check for kvproto.gpu (see docs/gpu.md).

    python bench/gpu_check.py            # on a CUDA device (H200: well under 5 minutes)
    python bench/gpu_check.py --cpu      # CPU smoke test with small sizes

1. round-trips random KV blocks device -> store -> device for objects of 1, 8
   and 32 MiB (blocks of ``--block-kib``), verifying every byte;
2. measures device->host and host->device GB/s of the layer's copies (Copier
   under the pool machine, into / out of page-locked staging) against a plain
   pinned ``torch.Tensor.copy_`` of the same size in the same run; target
   ratio >= 0.9;
3. times out a copy stalled on the real copy stream, checks its block is
   quarantined and no reassigned block is touched when the late completion
   arrives.
Exit status 0 when every byte was right and the timeout check passed (the
ratio is reported, and flagged, not enforced).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="force the CPU path (smoke test)")
    ap.add_argument("--sizes", default=None, help="object sizes in KiB, comma-separated")
    ap.add_argument("--block-kib", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args(argv)

    import torch
    import kvproto
    from kvproto.gpu import BlockPool, DeviceKV, KVLayout, RestoreState, SaveState
    from kvproto.statemachines import timeout as T

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [16, 64, 256] if device == "cpu" else [1 << 10, 8 << 10, 32 << 10])
    block_kib = args.block_kib or (4 if device == "cpu" else 1024)
    iters = args.iters or (2 if device == "cpu" else 20)
    # block = layers x 2 x tokens x heads x dim x 2 bytes; heads 8, dim 128: 4 KiB per token-layer
    if device == "cpu":
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=block_kib * 1024 // 1024)
    else:
        layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=max(1, block_kib // 128))
    assert layout.block_bytes == block_kib * 1024, (layout, layout.block_bytes)
    max_blocks = max(sizes) // block_kib
    num_blocks = 2 * max_blocks + 4
    seg = 4 * max(sizes) * 1024 + (64 << 20)
    print(f"device {device}; layout {layout.tag()}; block {block_kib} KiB; objects {sizes} KiB; iters {iters}")
    failures = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with kvproto.embedded(storage_nodes=1, segment_size=seg) as cluster:
        client = cluster.client()
        pool = BlockPool.allocate(layout, num_blocks, device=device)
        with DeviceKV(client, pool, max_blocks=max_blocks, staging=2, copy_timeout=30,
                      load_timeout=30) as kv:
            print(f"backend {kv.backend.kind}")
            r = kv.request()

            def reset(blocks) -> None:   # loaded blocks back to held
                r.release(blocks)
                for b in blocks:
                    r.acquire_block(b)
            src = r.acquire(max_blocks)
            dst = r.acquire(max_blocks)
            for size in sizes:
                n = size // block_kib
                sb, db = src[:n], dst[:n]
                for b in sb:
                    pool.block_bytes(b).copy_(torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8,
                                                            device=device))
                key = f"check/{layout.tag()}/{size}".encode()
                save = r.save(key, sb)
                if save.wait(60) is not SaveState.PUBLISHED:
                    failures.append(f"save {size} KiB: {save.state} {save.error}")
                    continue
                for b in db:
                    pool.block_bytes(b).zero_()
                rest = r.restore(key, db)
                if rest.wait(60) is not RestoreState.CONSUMABLE:
                    failures.append(f"restore {size} KiB: {rest.state} {rest.error}")
                    continue
                got = r.consume(db)
                ok = all(torch.equal(g.view(torch.uint8), pool.block(s).view(torch.uint8))
                         for g, s in zip(got, sb))
                reset(db)
                print(f"round trip {size:>6} KiB ({n} blocks): {'every byte right' if ok else 'BYTES WRONG'}")
                if not ok:
                    failures.append(f"round trip {size} KiB: bytes wrong")
                client.remove(key)

                # throughput: the layer's copies vs a plain pinned copy_ of the same size
                nbytes = n * layout.block_bytes
                host = kv.backend.host_buffer(nbytes)
                dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
                slot = kv.staging.names[0]

                def plain(d2h: bool) -> float:
                    sync()
                    t0 = time.perf_counter()
                    (host.copy_(dev, non_blocking=True) if d2h else dev.copy_(host, non_blocking=True))
                    sync()
                    return time.perf_counter() - t0

                def layer(d2h: bool) -> float:
                    if d2h:
                        kv.copier.step(kv.blocks, T.Acquire(r.name, slot))
                    else:
                        reset(db)
                    stage = kv._staging_slice(slot, nbytes)
                    sync()
                    t0 = time.perf_counter()
                    if d2h:
                        c = kv.copier.issue(kv.blocks, r.name, slot,
                                            [(stage[i * layout.block_bytes:(i + 1) * layout.block_bytes],
                                              pool.block_bytes(b)) for i, b in enumerate(sb)], 30,
                                            sources=[pool.name(b) for b in sb])
                        c.wait()
                    else:
                        cs = [kv.copier.issue(pool, r.name, pool.name(b),
                                              [(pool.block_bytes(b),
                                                stage[i * layout.block_bytes:(i + 1) * layout.block_bytes])], 30)
                              for i, b in enumerate(db)]
                        for c in cs:
                            c.wait()
                    dt = time.perf_counter() - t0
                    if d2h:
                        kv.copier.step(kv.blocks, T.Release(r.name, slot))
                    return dt

                for d2h, name in ((True, "device->host"), (False, "host->device")):
                    plain(d2h), layer(d2h)   # warm-up
                    p = statistics.median(plain(d2h) for _ in range(iters))
                    q = statistics.median(layer(d2h) for _ in range(iters))
                    ratio = p / q
                    flag = "" if ratio >= 0.9 or device == "cpu" else "  BELOW 0.9x TARGET"
                    print(f"  {name} {size:>6} KiB: layer {nbytes / q / 1e9:7.2f} GB/s, "
                          f"plain pinned copy_ {nbytes / p / 1e9:7.2f} GB/s, ratio {ratio:.2f}{flag}")
                reset(db)
            r.release(src)
            r.release(dst)
            r.finish()

            # a timeout with a late completion on the real copy stream
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
                print(f"timeout: {type(e).__name__}; block {a} is {pool.state_of(a).value}")
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
            print(f"late completion: block {a} {pool.state_of(a).value}, reassigned block {b} "
                  f"{'untouched' if untouched else 'TOUCHED'}; stats {pool.state.stats}")
            if not untouched or pool.state_of(a) is not T.BufState.FREE:
                failures.append("late completion check failed")
            r2.release([b])
        client.close()
    for f in failures:
        print("FAIL", f)
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
