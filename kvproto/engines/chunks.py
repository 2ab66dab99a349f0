"""KV chunks as store objects: their format, and the one place each
direction moves them.

A chunk of a token sequence (:mod:`kvproto.engines.prefix`) is stored as one
object per tensor-parallel rank and layer group. Every object carries a header
in front of its payload (the engine's KV bytes, in the layout the namespace
names)::

    magic "KVPC" | format 1 | digest algorithm 1 (BLAKE2b-256) | header length u16
    | tokens u32 | payload length u64 | chunk digest (32 bytes) | layout tag length u16
    | layout tag (UTF-8) | zero padding | digest (32 bytes)

little endian, padded so that the payload starts on a 64-byte boundary. The
digest is BLAKE2b-256 over the header before it and the payload. The store
keeps no checksum of its own, so the reader checks it: an object whose digest
does not match (a corrupted or truncated object, or one that is not a chunk
object at all) is refused with :class:`~kvproto.errors.ChecksumMismatch`, one
holding another chunk the same way, and one whose layout tag differs from the
reader's with :class:`~kvproto.errors.LayoutMismatch`. Refused bytes are never
handed to the engine.

:class:`ChunkStore` is where bytes move:

* save: :meth:`ChunkStore.new_object` gives a buffer whose payload the engine
  fills (one copy from its KV memory), :meth:`ChunkStore.save` seals the
  objects and stores them with one ``put_many``; an object already stored
  (``KeyExists``) counts as saved;
* lookup: :meth:`ChunkStore.lookup` asks ``exists_many`` about every object
  of every chunk (all ranks, all layer groups) and answers the longest
  contiguous run of complete chunks from the start (``plan_reuse``);
* load: :meth:`ChunkStore.load` loads this rank's objects through the client's
  transfer engine (spec/Timeout.tla: a timed-out load's buffer is quarantined
  until its completion or cancel acknowledgement arrives, and a late
  completion is never consumed), checks each object and hands the verified
  payload to the engine's ``sink``; the usable prefix is ``plan_reuse``'s
  (a chunk counts only when all its objects loaded and verified, and nothing
  after the first gap counts). Loads of chunks after a known gap are not issued.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs
import numpy as np

from kvproto import errors
from kvproto.engines.prefix import Chunk, Namespace, usable_chunks
from kvproto.statemachines.reuse import Outcome, RankLoad, plan_reuse

MAGIC = b"KVPC"
FORMAT = 1
DIGEST_BLAKE2B = 1
_DIGEST = 32
_PERSON = b"kvproto.kvpc.v1"
_FIXED = struct.Struct("<4sBBHIQ32sH")   # magic, format, algorithm, header length, tokens,
                                        # payload length, chunk digest, tag length
ALIGN = 64


def header_size(layout: str) -> int:
    """Bytes of the header of an object of ``layout`` (a multiple of 64)."""
    raw = _FIXED.size + len(layout.encode("utf-8")) + _DIGEST
    return -(-raw // ALIGN) * ALIGN


def _digest(header: memoryview, payload: memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST, person=_PERSON)
    h.update(header)
    h.update(payload)
    return h.digest()


class ChunkObject:
    """One object being written: ``payload`` (a writable ``uint8`` array) is
    filled by the engine, then :meth:`seal` writes the header in front."""

    def __init__(self, layout: str, payload_bytes: int) -> None:
        self.layout = layout
        self.header_bytes = header_size(layout)
        self.data = np.empty(self.header_bytes + payload_bytes, dtype=np.uint8)
        self.payload = self.data[self.header_bytes:]

    def seal(self, chunk: Chunk) -> np.ndarray:
        """Write the header of ``chunk`` (its digest covers the payload as it is now)."""
        tag = self.layout.encode("utf-8")
        head = memoryview(self.data)[:self.header_bytes]
        head[:] = bytes(self.header_bytes)
        _FIXED.pack_into(head, 0, MAGIC, FORMAT, DIGEST_BLAKE2B, self.header_bytes, chunk.tokens,
                         self.payload.nbytes, chunk.digest, len(tag))
        head[_FIXED.size:_FIXED.size + len(tag)] = tag
        end = self.header_bytes - _DIGEST
        head[end:] = _digest(head[:end], memoryview(self.payload))
        return self.data


def encode(layout: str, chunk: Chunk, payload: Any) -> np.ndarray:
    """The object of ``chunk`` holding ``payload`` (bytes-like), sealed."""
    src = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    obj = ChunkObject(layout, src.nbytes)
    obj.payload[:] = src
    return obj.seal(chunk)


def decode(data: Any, layout: str, chunk: Chunk) -> memoryview:
    """The payload of the object ``data`` (its first bytes; anything after the
    object is ignored) after checking that it is intact and is ``chunk`` under
    ``layout``: ``ChecksumMismatch`` or ``LayoutMismatch`` otherwise."""
    view = memoryview(data).cast("B")
    if view.nbytes < _FIXED.size:
        raise errors.ChecksumMismatch(f"{view.nbytes} bytes are too short for a chunk object")
    magic, fmt, algo, hlen, tokens, plen, cdigest, tlen = _FIXED.unpack_from(view, 0)
    if magic != MAGIC or fmt != FORMAT or algo != DIGEST_BLAKE2B:
        raise errors.ChecksumMismatch("not a chunk object of format 1 (bad magic, format or digest)")
    if hlen < _FIXED.size + tlen + _DIGEST or hlen + plen > view.nbytes:
        raise errors.ChecksumMismatch(f"object lengths do not fit: header {hlen}, payload {plen}, "
                                      f"{view.nbytes} bytes present")
    end = hlen - _DIGEST
    if _digest(view[:end], view[hlen:hlen + plen]) != bytes(view[end:hlen]):
        raise errors.ChecksumMismatch(f"chunk {chunk.index}: the digest does not match the bytes")
    tag = bytes(view[_FIXED.size:_FIXED.size + tlen]).decode("utf-8", "replace")
    if tag != layout:
        raise errors.LayoutMismatch(f"chunk {chunk.index} was written as {tag!r}, read as {layout!r}")
    if cdigest != chunk.digest or tokens != chunk.tokens:
        raise errors.ChecksumMismatch(f"the object holds another chunk than {chunk.index}")
    return view[hlen:hlen + plen].toreadonly()


def group_layers(num_layers: int, groups: int) -> list[range]:
    """The layers of each of ``groups`` layer groups: contiguous runs, the
    first ``num_layers % groups`` one layer longer."""
    if not 1 <= groups <= num_layers:
        raise errors.InvalidArgument(f"1..{num_layers} layer groups, not {groups}")
    size, extra = divmod(num_layers, groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(range(start, end))
        start = end
    return out


@attrs.frozen
class LoadResult:
    """What :meth:`ChunkStore.load` found, chunk by chunk.

    ``usable``: chunks ``[0, usable)`` loaded and verified in every layer group;
    ``outcomes[i]``: chunk ``i``'s worst group outcome (``MISSING`` also for a
    load not issued because an earlier chunk failed); ``errors``: ``(chunk,
    group) -> error`` of each object that did not load; ``quarantined``: the
    ``(chunk, group)`` objects whose load timed out (their buffers stay
    quarantined in the transfer engine until they drain)."""

    usable: int
    outcomes: tuple
    errors: dict
    quarantined: frozenset

    def tokens(self, chunks: Sequence[Chunk]) -> int:
        return chunks[self.usable - 1].end if self.usable else 0


def lookup(client, namespace: Namespace, chunks: Sequence[Chunk]) -> int:
    """How many chunks from the start have every object (all ranks, all layer
    groups) in the store: one ``exists_many``."""
    keys = [k for c in chunks for k in namespace.object_keys(c)]
    if not keys:
        return 0
    present = {k for k, hit in zip(keys, client.exists_many(keys)) if hit}
    return usable_chunks(namespace, chunks, present)


def tensor_copy(payload: memoryview, dtype):
    """A torch tensor of ``dtype`` holding a copy of ``payload`` (one memcpy;
    much faster than ``clone()`` of a tensor over read-only bytes)."""
    import torch
    return torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).view(dtype)


_WORST = (Outcome.LOADED, Outcome.IN_FLIGHT, Outcome.MISSING, Outcome.FAILED, Outcome.TIMED_OUT)

Sink = Callable[[int, int, memoryview], None]


class ChunkStore:
    """Chunk objects of one namespace in a kvproto store (see the module docstring).

    ``payload_bytes`` is the largest payload of one object (it sizes the
    transfer engine's ``buffers`` host buffers); ``timeout`` bounds each load
    and each save batch; ``replicas`` is passed to ``put_many``."""

    def __init__(self, client, namespace: Namespace, payload_bytes: int, *, replicas: int = 1,
                 timeout: float = 5.0, buffers: int = 8, max_cancels: int = 3,
                 max_leaked: int = 4) -> None:
        if payload_bytes < 1:
            raise errors.InvalidArgument(f"payload_bytes must be >= 1, not {payload_bytes}")
        self.client = client
        self.namespace = namespace
        self.layout = namespace.layout
        self.payload_bytes = payload_bytes
        self.replicas = replicas
        self.timeout = float(timeout)
        self.engine = client.transfer_engine(buffers, header_size(self.layout) + payload_bytes,
                                             max_cancels=max_cancels, max_leaked=max_leaked)

    # ------------------------------------------------------------------ keys and lookup

    def key(self, chunk: Chunk, rank: int = 0, group: int = 0,
            namespace: Optional[Namespace] = None) -> str:
        return (namespace or self.namespace).object_key(chunk, rank, group)

    def lookup(self, chunks: Sequence[Chunk], namespace: Optional[Namespace] = None) -> int:
        """:func:`lookup` in this store's namespace (or ``namespace``, e.g. the
        same one under a request's cache salt)."""
        return lookup(self.client, namespace or self.namespace, chunks)

    # ------------------------------------------------------------------ save

    def new_object(self, payload_bytes: Optional[int] = None) -> ChunkObject:
        """A buffer for one object; fill ``.payload``, then :meth:`save` it."""
        n = self.payload_bytes if payload_bytes is None else payload_bytes
        if not 1 <= n <= self.payload_bytes:
            raise errors.InvalidArgument(f"a payload has 1..{self.payload_bytes} bytes, not {n}")
        return ChunkObject(self.layout, n)

    def save(self, parts: Sequence[tuple[Chunk, int, int, ChunkObject]],
             namespace: Optional[Namespace] = None) -> list[Optional[errors.KvError]]:
        """Seal and store ``(chunk, rank, group, object)`` parts with one
        ``put_many``; per part ``None`` (stored, or already stored) or the error."""
        items = [(self.key(c, r, g, namespace), obj.seal(c)) for c, r, g, obj in parts]
        if not items:
            return []
        out = self.client.put_many(items, replicas=self.replicas, timeout=self.timeout)
        return [None if isinstance(e, errors.KeyExists) else e for e in out]

    # ------------------------------------------------------------------ load

    def load(self, chunks: Sequence[Chunk], sink: Sink, *, rank: int = 0,
             groups: Optional[Sequence[int]] = None,
             group_done: Optional[Callable[[int], None]] = None,
             namespace: Optional[Namespace] = None, drop_bad: bool = True) -> LoadResult:
        """Load ``rank``'s objects of ``chunks`` (layer group by layer group, in
        chunk order), verify each and call ``sink(chunk_index, group, payload)``
        with its payload (valid only during the call); ``group_done(g)`` after
        the last object of group ``g`` was handled. See :class:`LoadResult`.

        With ``drop_bad``, an object that fails its check (corrupt, another
        chunk, another layout) is removed afterwards, so that the chunk can be
        stored again (right where keys name content, as a namespace's do)."""
        namespace = namespace or self.namespace
        groups = list(range(self.namespace.layer_groups) if groups is None else groups)
        n = len(chunks)
        loads: list[dict] = [{} for _ in range(n)]
        errs: dict = {}
        gap = n                                        # chunks >= gap are not loaded
        req = self.engine.request()
        inflight: list = []                            # (chunk, group, buffer, transfer)

        def settle(i, g, buf, transfer) -> None:
            nonlocal gap
            outcome, release = Outcome.FAILED, True
            try:
                transfer.wait()
                payload = decode(req.consume(buf), self.layout, chunks[i])
                sink(i, g, payload)
                outcome = Outcome.LOADED
            except errors.TransferTimeout as e:
                outcome, release = Outcome.TIMED_OUT, False   # quarantined until it drains
                errs[(i, g)] = e
            except errors.KvError as e:
                errs[(i, g)] = e
            if release:
                req.release(buf)
            loads[i][g] = RankLoad(outcome, (i, g))
            if outcome is not Outcome.LOADED:
                gap = min(gap, i)

        try:
            for g in groups:
                for i in range(n):
                    if i >= gap:
                        break
                    while True:
                        try:
                            buf = req.acquire()
                            break
                        except errors.BufferBusy as e:
                            if not inflight:
                                errs[(i, g)] = e
                                loads[i][g] = RankLoad(Outcome.FAILED, (i, g))
                                gap = min(gap, i)
                                buf = None
                                break
                            settle(*inflight.pop(0))
                    if buf is None or i >= gap:
                        if buf is not None:
                            req.release(buf)
                        break
                    try:
                        transfer = req.load(self.key(chunks[i], rank, g, namespace), buf,
                                            timeout=self.timeout)
                    except errors.KvError as e:
                        req.release(buf)
                        errs[(i, g)] = e
                        missing = isinstance(e, errors.KeyNotFound)
                        loads[i][g] = RankLoad(Outcome.MISSING if missing else Outcome.FAILED,
                                               None if missing else (i, g))
                        gap = min(gap, i)
                        break
                    inflight.append((i, g, buf, transfer))
                while inflight and inflight[0][1] == g:
                    settle(*inflight.pop(0))
                if group_done is not None:
                    group_done(g)
            while inflight:
                settle(*inflight.pop(0))
        finally:
            if inflight or errs:
                req.cancel()        # abandoned loads stay quarantined until they drain
            else:
                req.finish()
        bad = [self.key(chunks[i], rank, g, namespace) for (i, g), e in errs.items()
               if isinstance(e, (errors.ChecksumMismatch, errors.LayoutMismatch))]
        if bad and drop_bad:
            self._drop(bad)
        by_group = [{gi: loads[i].get(g, RankLoad(Outcome.MISSING)) for gi, g in enumerate(groups)}
                    for i in range(n)]
        plan = plan_reuse(by_group, ranks=len(groups))
        outcomes = tuple(max((ld.outcome for ld in c.values()), key=_WORST.index) if c else
                         Outcome.MISSING for c in by_group)
        return LoadResult(plan.usable, outcomes, errs,
                          frozenset(k for k, e in errs.items() if isinstance(e, errors.TransferTimeout)))

    def _drop(self, keys: list, within: float = 0.5) -> None:
        """Remove objects that failed their check (best effort: the read that
        found them may still be ending at the master)."""
        deadline = time.monotonic() + within
        for key in keys:
            while True:
                try:
                    self.client.remove(key)
                    break
                except (errors.ObjectBusy, errors.ObjectLeased):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                except errors.KvError:
                    break

    def close(self) -> None:
        self.engine.close()
