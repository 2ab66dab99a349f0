"""The fault matrix's writer and reader processes, and the values they check.

Every value names itself: ``magic | generation | size | digest(key) |
digest(payload) | payload``, the payload drawn from a generator seeded by the
key and generation. A reader checks what it got against the key it asked for
(:func:`verify`) without knowing what was written: torn, stale-region or
foreign bytes fail the digests; bytes of another key fail the key digest.

Each worker appends what it did to a journal (JSON lines, one per operation,
written before a put or remove starts and after it ends, so a worker killed
in the middle leaves an operation with an unknown outcome). The harness
(:mod:`kvproto.checking.chaos.verdict`) judges the journals; workers judge
only the bytes.

* writer: puts fresh keys, removes its older acknowledged ones (keeping at
  most ``live`` objects), and puts some removed keys again with the next
  generation. Each key is written by one writer only, one operation at a time.
* reader: follows the writers' journals and reads acknowledged, removed and
  never-written keys, alone (``get``) or in batches (``get_many``);
* loader: the same reads, one key at a time, into the buffers of a transfer
  engine (tracked loads, cancelled on timeout), journalling the buffer pool's
  counts at the end of each cell.

Run as ``python -m kvproto.checking.chaos.workers CONFIG_JSON`` (see :class:`Worker`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
import sys
import time
import traceback
from typing import Any, Optional

MAGIC = b"KVPF"
HEADER = struct.Struct("<4sII16s16s")


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def value(key: bytes, gen: int, size: int) -> bytes:
    """The only bytes ever put under ``key`` at generation ``gen``."""
    body = max(size - HEADER.size, 1)
    seed = int.from_bytes(_digest(key + gen.to_bytes(4, "little"))[:8], "little")
    payload = random.Random(seed).randbytes(body)
    return HEADER.pack(MAGIC, gen, body, _digest(key), _digest(payload)) + payload


def verify(key: bytes, data: Any, whole: bool = True) -> tuple[Optional[int], str]:
    """``(generation, "")`` if ``data`` is a whole value of ``key`` (or, with
    ``whole=False``, starts with one: a pool buffer larger than the object),
    else ``(None, why)``."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    if len(view) < HEADER.size:
        return None, f"{len(view)} bytes, shorter than a header"
    magic, gen, size, key_digest, payload_digest = HEADER.unpack_from(view)
    if magic != MAGIC:
        return None, "no magic"
    if key_digest != _digest(key):
        return None, f"bytes of another key (generation {gen})"
    if len(view) != HEADER.size + size and (whole or len(view) < HEADER.size + size):
        return None, f"{len(view)} bytes, the header says {HEADER.size + size}"
    if _digest(view[HEADER.size:HEADER.size + size]) != payload_digest:
        return None, f"payload digest mismatch (generation {gen})"
    return gen, ""


class Journal:
    """One JSON object per line, written as soon as it is known."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_journal(path: str, offset: int = 0) -> tuple[list[dict], int]:
    """Complete records from ``offset`` on, and the offset after the last one."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue   # a line cut by a kill -9 in the middle of a write
    return records, offset + end


#: errors after which a put certainly stored nothing, a remove certainly removed
#: nothing. Not ``KeyNotFound`` for a remove: a client that sends its remove
#: again to a new master (the first master died before answering) is told
#: that the key, which the first one removed, is not found.
PUT_REFUSALS = ("KeyExists", "NoSpace", "NoStorage", "InvalidArgument")
REMOVE_REFUSALS = ("ObjectLeased", "ObjectBusy", "NotPublished")


class Worker:
    """A worker process: one client for its whole life, serving cell after cell.

    The harness writes ``cell-K.json`` (the cell's folder, key tag and seed)
    into the control folder for cell K; the worker takes cells from ``first``
    on: it journals ``start`` into ``FOLDER/ROLE-PID.jsonl``, waits for the
    file ``FOLDER/go``, works until ``FOLDER/stop`` exists, journals ``end``
    and moves on. The file ``quit`` in the control folder (or SIGTERM) ends it."""

    def __init__(self, config: dict) -> None:
        import kvproto
        self.config = config
        self.stopping = False
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.client = kvproto.Client(config["master"], **config.get("client", {}))
        self.name = f"{config['role']}{config['index']}-{os.getpid()}"
        self.cell: dict = {}
        self.folder = ""
        self.rng = random.Random()
        self.journal: Optional[Journal] = None

    def quit(self) -> bool:
        return self.stopping or os.path.exists(os.path.join(self.config["control"], "quit"))

    def stopped(self) -> bool:
        return self.quit() or os.path.exists(os.path.join(self.folder, "stop"))

    def _wait_for(self, path: str, stop_too: bool = True) -> bool:
        while not os.path.exists(path):
            if self.quit() or (stop_too and self.folder and self.stopped()):
                return False
            time.sleep(0.01)
        return True

    def run(self) -> None:
        k = self.config["first"]
        try:
            while not self.quit():
                assignment = os.path.join(self.config["control"], f"cell-{k}.json")
                if not self._wait_for(assignment, stop_too=False):
                    return
                with open(assignment, encoding="utf-8") as f:
                    self.cell = json.load(f)
                self.folder = self.cell["folder"]
                self.begin_cell()
                self.journal = Journal(os.path.join(self.folder, f"{self.name}.jsonl"))
                self.journal.write(op="start", pid=os.getpid(), client=self.client.client_id,
                                   t=time.monotonic())
                try:
                    if self._wait_for(os.path.join(self.folder, "go")):
                        pause = self.config.get("pause", 0.0)
                        while not self.stopped():
                            if not self.step():
                                time.sleep(0.02)   # a failed call: do not spin while the master is away
                            elif pause:
                                time.sleep(pause)
                finally:
                    self.end_cell()
                    self.journal.write(op="end", t=time.monotonic())
                    self.journal.close()
                k += 1
        finally:
            self.client.close()

    def begin_cell(self) -> None:
        self.rng = random.Random(f"{self.cell['seed']}/{self.name}")

    def end_cell(self) -> None:
        pass

    def call(self, fn, *args, **kwargs) -> tuple[Any, str]:
        """``(result, "ok")`` or ``(None, error name)``; anything but a typed
        kvproto error is journalled with its traceback (a client bug)."""
        from kvproto.errors import KvError
        try:
            return fn(*args, **kwargs), "ok"
        except KvError as err:
            return None, type(err).__name__
        except Exception as exc:   # not a typed error: the harness reports it
            self.journal.write(op="exception", error=f"{type(exc).__name__}: {exc}",
                               trace=traceback.format_exc(limit=8), t=time.monotonic())
            return None, "exception:" + type(exc).__name__


class Writer(Worker):
    def begin_cell(self) -> None:
        super().begin_cell()
        self.prefix = f"{self.cell['tag']}/{self.name}"
        self.n = 0
        self.live: list[tuple[str, int]] = []       # acknowledged, not removed: (key, gen)
        self.removed: list[tuple[str, int]] = []    # acknowledged removes: (key, gen)

    def step(self) -> bool:
        c = self.config
        roll = self.rng.random()
        if self.live and (len(self.live) > c.get("live", 64) or roll < c.get("remove", 0.15)):
            return self.remove(self.live.pop(0 if roll < 0.5 else self.rng.randrange(len(self.live))))
        if self.removed and roll > 1 - c.get("reput", 0.1):
            key, gen = self.removed.pop(self.rng.randrange(len(self.removed)))
            return self.put(key, gen + 1)
        if roll > 1 - c.get("reput", 0.1) - c.get("put_many", 0.0):
            # new keys in one put_many, which the client (batch 2, window 2)
            # splits into chunks whose put_ends are answered while the next is written
            keys = [f"{self.prefix}/{self.n + j}" for j in range(1, 5)]
            self.n += len(keys)
            return self.put_many(keys)
        self.n += 1
        return self.put(f"{self.prefix}/{self.n}", 1)

    def _value(self, key: str, gen: int) -> bytes:
        """``key``'s bytes at ``gen``, of a random size within the config's."""
        c = self.config
        return value(key.encode(), gen, self.rng.randint(c.get("min_size", 256),
                                                         c.get("max_size", 8192)))

    def put(self, key: str, gen: int) -> bool:
        c = self.config
        data = self._value(key, gen)
        t0 = time.monotonic()
        self.journal.write(op="put?", key=key, gen=gen, t0=t0)
        _, out = self.call(self.client.put, key, data, replicas=c.get("replicas", 1))
        self.journal.write(op="put", key=key, gen=gen, t0=t0, t1=time.monotonic(), out=out)
        if out == "ok":
            self.live.append((key, gen))
        return out == "ok"

    def put_many(self, keys: list[str]) -> bool:
        """New keys (generation 1) in one ``put_many``: each journalled as its
        own put, begun before the call and ended with its own outcome."""
        items = [(k, self._value(k, 1)) for k in keys]
        t0 = time.monotonic()
        for key in keys:
            self.journal.write(op="put?", key=key, gen=1, t0=t0)
        results, out = self.call(self.client.put_many, items,
                                 replicas=self.config.get("replicas", 1))
        t1, stored = time.monotonic(), False
        outs = [out] * len(keys) if results is None else \
            ["ok" if err is None else type(err).__name__ for err in results]
        for key, done in zip(keys, outs):
            self.journal.write(op="put", key=key, gen=1, t0=t0, t1=t1, out=done)
            if done == "ok":
                self.live.append((key, 1))
                stored = True
        return stored

    def remove(self, entry: tuple[str, int]) -> bool:
        key, gen = entry
        t0 = time.monotonic()
        self.journal.write(op="remove?", key=key, gen=gen, t0=t0)
        _, out = self.call(self.client.remove, key)
        self.journal.write(op="remove", key=key, gen=gen, t0=t0, t1=time.monotonic(), out=out)
        if out == "ok":
            self.removed.append(entry)
        elif out in ("ObjectLeased", "ObjectBusy"):
            self.live.append(entry)     # leased or being read: try again later
        # any other outcome: unknown, the key is left alone
        return out == "ok"


class Reader(Worker):
    def begin_cell(self) -> None:
        super().begin_cell()
        self.offsets: dict[str, int] = {}
        self.present: dict[str, int] = {}
        self.gone: dict[str, int] = {}
        self.recent: list[str] = []
        self._followed = 0.0

    def follow(self) -> None:
        """Learn acknowledged puts and removes from the writers' journals."""
        now = time.monotonic()
        if now - self._followed < 0.1:
            return
        self._followed = now
        folder = self.folder
        for name in os.listdir(folder):
            if not name.startswith("writer"):
                continue
            path = os.path.join(folder, name)
            records, self.offsets[path] = read_journal(path, self.offsets.get(path, 0))
            for r in records:
                if r.get("out") != "ok":
                    continue
                if r["op"] == "put":
                    self.present[r["key"]] = r["gen"]
                    self.gone.pop(r["key"], None)
                    self.recent.append(r["key"])
                elif r["op"] == "remove":
                    self.present.pop(r["key"], None)
                    self.gone[r["key"]] = r["gen"]
        del self.recent[:-512]

    def pick(self, n: int) -> list[str]:
        keys = []
        for _ in range(n):
            roll = self.rng.random()
            if self.recent and roll < 0.7:
                keys.append(self.rng.choice(self.recent))
            elif self.gone and roll < 0.85:
                keys.append(self.rng.choice(list(self.gone)) if len(self.gone) < 4096
                            else next(iter(self.gone)))
            else:
                keys.append(f"{self.cell['tag']}/{self.name}/never/"
                            f"{self.rng.randrange(self.config.get('never', 1 << 30))}")
        return keys

    def step(self) -> bool:
        self.follow()
        batch = self.config.get("batch", 8)
        keys = self.pick(batch if self.rng.random() < 0.5 else 1)
        t0 = time.monotonic()
        if len(keys) == 1:
            got, out = self.call(self.client.get, keys[0])
            results = [got] if out == "ok" else None
            if out == "KeyNotFound":
                results, out = [None], "ok"
        else:
            results, out = self.call(self.client.get_many, keys)
        t1 = time.monotonic()
        if results is None:
            self.journal.write(op="get", keys=keys, t0=t0, t1=t1, out=out)
            return False
        res: list = []
        for key, data in zip(keys, results):
            if data is None:
                res.append(-1)
                continue
            gen, why = verify(key.encode(), data)
            res.append(gen if gen is not None else f"wrong: {why}")
        self.journal.write(op="get", keys=keys, t0=t0, t1=t1, out="ok", res=res)
        return any(r != -1 for r in res)   # all misses: maybe a master switch; do not spin


class Loader(Reader):
    """A reader that loads into destination buffers through a transfer engine
    (tracked ``load`` transfers, cancelled on timeout: ``spec/Timeout.tla``).
    At the end of each cell it waits a little for its engine to settle and
    journals the pool's counts: a buffer still quarantined or loading then
    is a buffer the protocol did not give back."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.engine = None

    def begin_cell(self) -> None:
        super().begin_cell()
        counts = self.engine.counts() if self.engine is not None else {}
        if self.engine is None or counts["leaked"] or counts["quarantined"]:
            # buffers written off (their node died mid-load) stay on the leak
            # ledger for good: each cell starts with a whole pool
            if self.engine is not None:
                self.engine.close()
            self.engine = self.client.transfer_engine(buffers=8, buffer_size=16 << 10,
                                                      cancel_interval=0.1)

    def step(self) -> bool:
        from kvproto.errors import KvError
        self.follow()
        key = self.pick(1)[0]
        t0 = time.monotonic()
        request = self.engine.request()
        try:
            buf = request.acquire()
        except KvError as err:               # every buffer quarantined
            request.cancel()
            self.journal.write(op="get", keys=[key], t0=t0, t1=time.monotonic(), out=type(err).__name__)
            return False
        res: Any = -1
        try:
            request.get_into(key, buf, timeout=self.config.get("load_timeout", 0.5))
            gen, why = verify(key.encode(), request.consume(buf), whole=False)
            res = gen if gen is not None else f"wrong: {why}"
            request.release(buf)
            request.finish()
            out = "ok"
        except KvError as err:
            request.cancel()
            out = "ok" if type(err).__name__ == "KeyNotFound" else type(err).__name__
        except Exception as exc:
            request.cancel()
            self.journal.write(op="exception", error=f"{type(exc).__name__}: {exc}",
                               trace=traceback.format_exc(limit=8), t=time.monotonic())
            return False
        t1 = time.monotonic()
        if out != "ok":
            self.journal.write(op="get", keys=[key], t0=t0, t1=t1, out=out)
            return False
        self.journal.write(op="get", keys=[key], t0=t0, t1=t1, out="ok", res=[res])
        return res != -1

    def end_cell(self) -> None:
        # a buffer written off in a partition comes back with the node's ack to
        # a cancel the engine sends again about once a second
        idle = self.engine.wait_idle(self.config.get("settle", 3.0))
        self.journal.write(op="engine", idle=idle, counts=self.engine.counts(), t=time.monotonic())


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    worker = {"writer": Writer, "reader": Reader, "loader": Loader}[config["role"]](config)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
