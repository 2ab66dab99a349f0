"""kvproto demo: writers that die mid-put, readers that check every byte, then a master failover.

Part 1. An embedded cluster (a master and 2 storage nodes in this process).
Writer processes each put 8 MiB objects (one rank's share of a 256-token chunk
of a model with 128 KiB of KV cache per token). Other writers, the victims,
put one object, then start a second: the master allocates space for it and
the victim writes one of its replicas; at that moment (the victim says so on
its output) it is killed with SIGKILL, so its second object is never
published. A reader checks every object as soon as it is published; at the
end every key is read once more, the victims' too. The master notices that
each victim went silent (its writer timeout, 2 s) and reclaims its allocation;
the victim's key can then be put again.

Part 2. A failover: two master processes (one active, one standby, elected
through a coordinator directory) and two storage processes; 16 objects are
put, the active master is killed with SIGKILL, and the standby takes a higher
term, fences the storage nodes, rebuilds the directory from their indexes and
opens; every object is read back through it.

The demo passes only if: no read returns a wrong byte; every surviving writer
stores all its objects; the master counts exactly the expected number of
published objects; the final reads miss exactly the victims' unfinished
objects (one per victim) and the reads during the writes miss nothing; the
master reclaims exactly one allocation per victim and the victims' keys can
be put again; after the failover the new master holds a higher term and
serves all 16 objects. The kill point is a protocol event (space allocated,
one replica written, not published), not a timer, so these figures are the
same in every run; only the timings vary.

With --engine (instead of parts 1 and 2), a real model reuses its prefix: a
tiny random Llama or Qwen2 (transformers, built from a config, nothing
downloaded) runs a prompt, saves its prefix KV chunk by chunk, and restores it
into a fresh cache; the demo prints the prefix hit, the tokens skipped, the
save, restore and recompute times and the logits check (bit-exact on the saved
KV). Then a corrupted chunk, a missing chunk, a prefill -> decode hand-off, and
a storage process killed during a restore: the prefix shrinks, the logits never
change. Needs torch and transformers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

OBJECT_SIZE = 8 << 20

# A writer: puts its objects, printing each key and the seconds spent in put().
_WRITER = r"""
import sys, time
from kvproto.demo import payload
from kvproto.runtime.client import Client
master, writer, count, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Client(master, timeout=30.0) as client:
    for i in range(count):
        key = f"demo/{writer}/{i}".encode()
        data = payload(key)
        t0 = time.perf_counter()
        client.put(key, data, replicas=replicas)
        print("put", key.decode(), f"{time.perf_counter() - t0:.6f}", flush=True)
"""

# A victim: puts one object, then only the first half of a second put, and
# waits to be killed.
_VICTIM = r"""
import sys, time
from kvproto.demo import half_put, payload
from kvproto.runtime.client import Client
master, writer, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(master, timeout=30.0) as client:
    key = f"demo/{writer}/0".encode()
    client.put(key, payload(key), replicas=replicas)
    print("put", key.decode(), flush=True)
    key = f"demo/{writer}/1".encode()
    half_put(client, key, payload(key), replicas)
    print("half-written", key.decode(), flush=True)
    time.sleep(600)
"""


def payload(key: bytes, size: int = OBJECT_SIZE) -> np.ndarray:
    """The bytes a writer puts under ``key``: pseudo-random, reproducible from the key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def checksum(data) -> bytes:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).digest()


def half_put(client, key: bytes, data, replicas: int) -> None:
    """The first half of ``client.put``: the master allocates the space
    (``put_start``) and one replica is written, but the put is not ended:
    what a writer that dies in the middle of a put leaves behind."""
    from kvproto.runtime import datapath
    view = memoryview(data).cast("B")
    reply = client._call_master("put_start", {"client": client.client_id, "replicas": replicas,
                                              "items": [[key, view.nbytes]]}, time.monotonic() + 30)
    (status, grant), = reply.body["items"]
    if status:
        raise RuntimeError(f"put_start of {key!r} refused: {grant}")
    one = {0: (key, view, grant["token"], grant["replicas"][:1])}
    failed = datapath.write_all(client, one, reply.body["segments"], time.monotonic() + 30,
                                reply.body["term"])
    if failed:
        raise failed[0]


class _Tally:
    """What the readers saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gets = self.misses = self.wrong = self.errors = 0
        self.read_seconds: list[float] = []

    def read(self, client, key: bytes) -> None:
        from kvproto import errors
        t0 = time.perf_counter()
        try:
            data = client.get(key)
        except errors.KeyNotFound:
            with self.lock:
                self.misses += 1
            return
        except errors.KvError as e:
            print(f"read of {key.decode()} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            with self.lock:
                self.errors += 1
            return
        elapsed = time.perf_counter() - t0
        ok = checksum(data) == checksum(payload(key))
        with self.lock:
            self.gets += 1
            self.read_seconds.append(elapsed)
            if not ok:
                self.wrong += 1
                print(f"WRONG BYTES for {key.decode()}", file=sys.stderr, flush=True)


def _show(figures: list[tuple[str, str, str]]) -> None:
    """Each figure, with what it means in plain words on the line below."""
    for name, value, meaning in figures:
        print(f"  {name + ':':<22} {value}")
        if meaning:
            print(f"      {meaning}")


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.1f} ms" if seconds else "-"


def main(writers: int = 4, killed: int = 2, objects: int = 8, replicas: int = 2,
         storage_nodes: int = 2, segment_size: "int | str" = "384MiB", writer_timeout: float = 2.0,
         failover_part: bool = True) -> int:
    """Run the demo; 0 if it passed (see the module docstring), else 1."""
    import kvproto
    from kvproto import errors
    from kvproto.runtime.units import format_size, parse_size

    if not logging.getLogger().handlers:     # the servers' warnings, marked as such
        logging.basicConfig(level=logging.WARNING, format="  (log) %(name)s: %(message)s")
    size = format_size(parse_size(segment_size))
    print(f"kvproto demo: {storage_nodes} storage nodes of {size}, {writers} writers putting "
          f"{objects} objects of 8 MiB each with {replicas} replicas, {killed} writers killed mid-put")
    checks: dict[str, bool] = {}
    with kvproto.embedded(storage_nodes=storage_nodes, segment_size=segment_size,
                          writer_timeout=writer_timeout) as cluster:
        client = cluster.client()
        env = dict(os.environ, PYTHONUNBUFFERED="1")

        def spawn(script: str, *args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", script, cluster.master_address, *args],
                                    stdout=subprocess.PIPE, text=True, env=env)

        procs = {f"w{i}": spawn(_WRITER, f"w{i}", str(objects), str(replicas)) for i in range(writers)}
        victims = {f"k{i}": spawn(_VICTIM, f"k{i}", str(replicas)) for i in range(killed)}

        tally = _Tally()
        published: list[bytes] = []
        put_seconds: list[float] = []
        lock = threading.Lock()
        half_written: list[bytes] = []

        def collect(proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                word, key, *rest = line.split()
                if word == "half-written":
                    half_written.append(key.encode())
                    proc.send_signal(signal.SIGKILL)      # the kill point: a protocol event
                    continue
                with lock:
                    published.append(key.encode())
                    put_seconds.extend(float(r) for r in rest)

        collectors = [threading.Thread(target=collect, args=(p,))
                      for p in [*procs.values(), *victims.values()]]
        for t in collectors:
            t.start()

        # A reader runs while writers write, reading what has been published so far.
        stop_reader = threading.Event()
        during = _Tally()

        def concurrent_reader() -> None:
            reader = cluster.client()
            seen = 0
            while not stop_reader.is_set():
                with lock:
                    batch = published[seen:]
                if not batch:
                    time.sleep(0.01)
                    continue
                for key in batch:
                    during.read(reader, key)
                seen += len(batch)

        reader = threading.Thread(target=concurrent_reader)
        reader.start()
        failed_writers = [n for n, p in procs.items() if p.wait() != 0]
        for p in victims.values():
            p.wait()
        for t in collectors:
            t.join()
        stop_reader.set()
        reader.join()

        # Every key again, the victims' too: an unfinished object must be a miss.
        all_keys = [f"demo/{w}/{i}".encode() for w in procs for i in range(objects)]
        all_keys += [f"demo/{v}/{i}".encode() for v in victims for i in range(2)]
        for key in all_keys:
            tally.read(client, key)

        # The master reclaims each victim's allocation once it has been silent
        # for the writer timeout; then the key is free to be put again.
        deadline = time.monotonic() + writer_timeout * 10
        stats = client.stats()
        while stats["counters"].get("reclaimed", 0) < killed and time.monotonic() < deadline:
            time.sleep(0.2)
            stats = client.stats()
        counters = stats["counters"]
        reput = 0
        for key in half_written:
            try:
                client.put(key, payload(key), replicas=replicas)
                reput += checksum(client.get(key)) == checksum(payload(key))
            except errors.KvError as e:
                print(f"putting {key.decode()} again failed: {type(e).__name__}: {e}", file=sys.stderr)

        expected_puts = writers * objects + killed
        print()
        figures = [
            ("objects published", f"{len(published)} (the master counts "
             f"{counters.get('puts_published', '?')}; expected {writers} x {objects} + {killed})",
             "every object of the surviving writers, and the first object of each killed one"),
            ("reads during writes", f"{during.gets} verified, {during.misses} misses",
             "a reader checks each object as soon as it is published (how many it reads "
             "depends on timing; a miss here would be a bug)"),
            ("reads afterwards", f"{tally.gets} verified, {tally.misses} misses, of {len(all_keys)} keys",
             f"the expected {killed} misses are the killed writers' second objects: space "
             "allocated, one replica written, never published, so never readable"),
            ("reclaimed", f"{counters.get('reclaimed', 0)} allocations (expected {killed})",
             "the master takes back the space of a put whose writer fell silent for the "
             f"writer timeout ({writer_timeout:g} s): one per killed writer"),
            ("put again", f"{reput} of {len(half_written)}",
             "the killed writers' unfinished keys, put and read back once reclaimed"),
            ("wrong bytes", f"{during.wrong + tally.wrong}", ""),
            ("time in put()", f"median {_ms(put_seconds)} per 8 MiB object, {replicas} replicas",
             "a timing, not a throughput figure: `kvproto bench` measures that against a baseline"),
            ("time in get()", f"median {_ms(during.read_seconds + tally.read_seconds)} per 8 MiB object",
             ""),
        ]
        _show(figures)
        if failed_writers:
            print(f"  writers that failed:   {', '.join(failed_writers)}", file=sys.stderr)
        checks.update({
            "no wrong bytes": during.wrong + tally.wrong == 0 and during.errors + tally.errors == 0,
            "every writer stored all its objects": not failed_writers,
            "published count": len(published) == counters.get("puts_published") == expected_puts,
            "misses only the unfinished objects": during.misses == 0 and tally.misses == killed
            and len(half_written) == killed,
            "one reclaim per killed writer": counters.get("reclaimed", 0) == killed,
            "reclaimed keys can be put again": reput == killed,
        })
    if failover_part:
        checks["failover"] = failover()
    failed = [name for name, ok in checks.items() if not ok]
    print("\ndemo " + ("passed" if not failed else "FAILED: " + "; ".join(failed)))
    return 0 if not failed else 1


def failover(objects: int = 16, size: int = 1 << 20) -> bool:
    """Kill the active master; the standby takes over; every object is read back."""
    import tempfile
    from kvproto.runtime.client import Client, put_retrying
    from kvproto.runtime.coordinator import connect

    print(f"\nfailover: 2 masters (one standby), 2 storage nodes, {objects} objects of "
          f"{size >> 20} MiB, then SIGKILL of the active master")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> str:
        p = subprocess.Popen([sys.executable, "-m", "kvproto", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(p)
        return p.stdout.readline().split()[-1]

    with tempfile.TemporaryDirectory(prefix="kvproto-demo-") as tmp:
        url = f"file://{tmp}"
        coordinator = connect(url, ttl=1.0)
        masters = {}
        try:
            for _ in range(2):
                address = start("master", "--coordinator", url, "--standby", "--ttl", "1",
                                "--listen", "tcp://127.0.0.1:*")
                masters[address] = procs[-1]
            for _ in range(2):
                start("storage", "--master", url, "--size", "64MiB")
            with Client(url, timeout=5.0) as client:
                keys = [f"failover/{i}".encode() for i in range(objects)]
                put_retrying(client, keys[0], payload(keys[0], size), 30, replicas=2, pause=0.1)
                for key in keys[1:]:
                    client.put(key, payload(key, size), replicas=2)
                term, active = coordinator.leader()
                masters[active].send_signal(signal.SIGKILL)
                masters[active].wait()
                took = put_retrying(client, b"failover/after", payload(b"failover/after", size), 30)
                stats = client.stats()["failover"]
                wrong = misses = 0
                for key in keys:
                    got = client.get_many([key])[0]
                    if got is None:
                        misses += 1
                    elif checksum(got) != checksum(payload(key, size)):
                        wrong += 1
                last = stats["last"]
                _show([
                    ("term", f"{term} -> {stats['term']}", "the standby took a higher term"),
                    ("first put after kill", f"{took:.2f} s",
                     "the old master's leadership ran out (TTL 1 s), then the standby fenced the "
                     f"storage nodes ({last['fence_s'] * 1000:.1f} ms) and rebuilt the directory "
                     f"from their indexes ({last['recover_s'] * 1000:.1f} ms)"),
                    ("objects recovered", f"{last['recovered']} from {last['nodes_fenced']} "
                     f"storage nodes ({last['nodes_lost']} lost)", ""),
                    ("read back", f"{objects - misses - wrong} of {objects}, {misses} misses, "
                     f"{wrong} wrong", ""),
                ])
                return wrong == 0 and misses == 0 and stats["term"] > term
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            coordinator.close()


# --------------------------------------------------------------------------- kvproto demo --engine


def _model(kind: str, layers: int, hidden: int):
    import torch
    import transformers
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    config = cls[0](vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                    max_position_embeddings=8192)
    torch.manual_seed(0)
    return cls[1](config).eval()


def _start_storage(master: str) -> "tuple[subprocess.Popen, str]":
    import re
    proc = subprocess.Popen([sys.executable, "-m", "kvproto", "storage", "--master", master, "--size", "64MiB",
                             "--listen", "tcp://127.0.0.1:*"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        m = re.search(r"ready: segment (\S+),", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("the storage process did not start")


def engine(kind: str = "llama", prompt_tokens: int = 1025, chunk: int = 128, layers: int = 4,
           hidden: int = 256) -> int:
    """``kvproto demo --engine``: a real model (tiny, random, built from a config)
    reuses its prefix through kvproto; 0 if every logits check passed. The
    prompt must hold at least 4 full chunks and one token more."""
    if prompt_tokens <= 4 * chunk:
        raise ValueError(f"the prompt needs more than {4 * chunk} tokens (4 chunks of {chunk})")
    import torch
    import kvproto
    from kvproto.engines.handoff import HandoffReceiver, HandoffSender
    from kvproto.engines.hf import PrefixCache

    model = _model(kind, layers, hidden)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    ids = torch.tensor([tokens])
    print(f"kvproto demo --engine: a random {kind} model ({layers} layers, hidden {hidden}, fp32, on the CPU), "
          f"a prompt of {prompt_tokens} tokens, chunks of {chunk} tokens")
    checks: dict[str, bool] = {}

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def continuation(restored):
        with torch.no_grad():
            if restored.cache is None:
                return model(ids).logits
            return model(ids[:, restored.tokens:], cache=restored.cache).logits

    def exact(restored) -> tuple[bool, str]:
        """Bit-exact against the continuation on the prefill's own KV (cropped to
        the reused prefix); how far from a recompute from scratch and one pass."""
        import copy
        with torch.no_grad():
            got = continuation(restored)
            if restored.tokens:
                own = copy.deepcopy(with_cache)
                own.crop(restored.tokens - own.get_seq_length())
                same = torch.equal(got, model(ids[:, restored.tokens:], cache=own).logits)
                fresh = model(ids[:, :restored.tokens], use_cache=True).cache
                again = model(ids[:, restored.tokens:], cache=fresh).logits
            else:
                same, again = True, got
            one_pass = model(ids).logits[:, restored.tokens:]
        d1, d2 = ((got - x).abs().max().item() for x in (again, one_pass))
        return same, (f"bit-exact on the saved KV; max |diff| {d1:.1e} to a recompute from scratch, "
                      f"{d2:.1e} to one pass over the prompt (fp32 rounding of the prefill itself)")

    with kvproto.embedded(storage_nodes=1, segment_size="64MiB") as cluster:
        proc = None
        try:
            pc = PrefixCache(cluster.client(), f"{kind}/demo", model.config, model.dtype, chunk_size=chunk)
            chunks = pc.chunks(tokens)
            with torch.no_grad():
                out, t_prefill = timed(lambda: model(ids, use_cache=True))
                with_cache = out.cache
                _, t_prefix = timed(lambda: model(ids[:, :len(chunks) * chunk], use_cache=True))
            errs, t_save = timed(lambda: pc.save(tokens, with_cache))
            checks["every chunk saved"] = errs == [None] * len(errs)
            restored, t_restore = timed(lambda: pc.restore(tokens))
            ok, how = exact(restored)
            checks["restored logits"] = ok and restored.tokens == len(chunks) * chunk
            print("\nreuse: the same prompt again")
            _show([
                ("prefix hit", f"{restored.hit} chunks of {len(chunks)}", "exists_many over every object"),
                ("tokens skipped", f"{restored.tokens} of {prompt_tokens}", "restored instead of computed"),
                ("save", f"{t_save * 1000:.1f} ms", "copy out of the cache, digest, put_many"),
                ("restore", f"{t_restore * 1000:.1f} ms", "lookup, loads under the Timeout protocol, digests"),
                ("recompute", f"{t_prefix * 1000:.1f} ms", f"the model computing those {restored.tokens} tokens"),
                ("time saved", f"{(t_prefix - t_restore) * 1000:.1f} ms",
                 "recompute minus restore (a tiny model on a CPU: a real one saves far more)"),
                ("logits check", "passed" if ok else "FAILED", how),
            ])

            client = pc.store.client
            bad, gap = len(chunks) // 4, 5 * len(chunks) // 8
            (lease,) = client.read_begin([pc.store.key(chunks[bad])])
            cluster.storage[0].memory.data[lease.replicas[0][1] + 4096] ^= 0xFF
            client.release([lease])
            corrupt = pc.restore(tokens)
            ok, _ = exact(corrupt)
            checks["corrupt chunk"] = ok and corrupt.tokens == bad * chunk
            pc.save(tokens, with_cache)                   # the corrupt chunk was removed: store it again
            client.remove(pc.store.key(chunks[gap]))
            missing = pc.restore(tokens)
            ok2, _ = exact(missing)
            checks["missing chunk"] = ok2 and missing.tokens == gap * chunk

            print("\nfailures: the prefix shrinks, the logits never change")
            _show([
                ("corrupt chunk", f"prefix {corrupt.tokens} tokens", f"chunk {bad}'s digest failed: it is never used, "
                 "and removed so that it can be stored again"),
                ("missing chunk", f"prefix {missing.tokens} tokens", f"a gap (chunk {gap}) ends the reusable prefix"),
                ("logits check", "passed" if ok and ok2 else "FAILED", "each continuation equals the recompute"),
            ])

            print("\nhand-off: prefill -> decode")
            everything = pc.namespace.chunks(tokens, chunk)
            decode = PrefixCache(cluster.client(), f"{kind}/demo", model.config, model.dtype, chunk_size=chunk)
            descriptor, t_offer = timed(lambda: HandoffSender(pc.store).offer(
                "demo-request", len(tokens), pc.pack(everything, with_cache)))
            sink, build = decode.unpacker(everything)
            taken, t_take = timed(lambda: HandoffReceiver(decode.store).take(descriptor, everything, sink))
            with torch.no_grad():
                first = int(out.logits[0, -1].argmax())
                expected = model(torch.tensor([[first]]), cache=with_cache).logits
                got = model(torch.tensor([[first]]), cache=build(len(everything))).logits if taken.taken else None
            checks["hand-off"] = got is not None and torch.equal(got, expected)
            _show([
                ("handed off", f"{len(tokens)} tokens in {len(everything)} chunks", f"offer {t_offer * 1000:.1f} ms, "
                 f"take-over {t_take * 1000:.1f} ms ({taken.attempts} attempt), then consumed"),
                ("logits check", "passed" if checks["hand-off"] else "FAILED",
                 "the decode side's next token sees the prefill's KV bit for bit"),
            ])
            # a second storage node, in its own process, killed during a restore
            proc, victim = _start_storage(cluster.master_address)
            killer = PrefixCache(cluster.client(), f"{kind}/demo-kill", model.config, model.dtype,
                                 chunk_size=chunk, buffers=1, timeout=1.0)
            checks["every chunk saved"] &= killer.save(tokens, with_cache) == [None] * len(chunks)
            placed = []
            for c in killer.chunks(tokens):
                (lease,) = client.read_begin([killer.store.key(c)])
                placed.append(lease.replicas[0][0])
                client.release([lease])
            load = killer.store.load

            def load_and_kill(chunk_list, sink, **kw):
                def first_then_kill(i, gi, view):
                    sink(i, gi, view)
                    if i == 0 and proc.poll() is None:
                        proc.send_signal(signal.SIGKILL)
                        proc.wait(10)
                return load(chunk_list, first_then_kill, **kw)
            killer.store.load = load_and_kill
            killed = killer.restore(tokens)
            killer.store.load = load
            ok3, _ = exact(killed)
            expect = placed.index(victim, 1) * chunk if victim in placed[1:] else len(chunks) * chunk
            checks["storage node killed"] = ok3 and killed.tokens == expect
            print("\na storage node killed during a restore")
            _show([
                ("node killed", f"prefix {killed.tokens} tokens", "SIGKILL of a storage process after the first "
                 "chunk loaded: its chunks time out (1 s) and are recomputed"),
                ("logits check", "passed" if ok3 else "FAILED", "the continuation equals the recompute"),
            ])
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(10)
    failed = [name for name, passed in checks.items() if not passed]
    print("\ndemo " + ("passed" if not failed else "FAILED: " + "; ".join(failed)))
    return 0 if not failed else 1
