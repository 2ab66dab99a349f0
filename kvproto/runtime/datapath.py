"""The client's data path: object bytes between the caller's memory and the
storage nodes, never through the master.

Reads (:func:`read_all`). A replica on a storage node of this host (same host
id) is read straight out of the node's shared memory: one memcpy, guarded by
the region's generation word (:mod:`kvproto.runtime.shm`), into the caller's
own buffer (``into``), or for a plain ``get`` into one of the client's
:class:`ReadBuffers` that nobody holds any more. Otherwise, or when that check
fails, one ``read`` per key goes to a node, all in flight at once, and the
reply's payload frame is handed on without a copy (or copied once into the
caller's buffer); the next replica is tried when one fails. With ``verify``
the bytes are hashed after the copy and compared with the object's
:func:`checksum` recorded at publish; a replica that differs counts as a
failure (``ChecksumMismatch`` when no replica matches).

Writes (:func:`write_all`). A replica the master granted to this client as a
direct writer (a segment on this host; ``spec/DirectWrite.tla``) is written
straight into the segment: the client waits until the region's generation
word shows its assign, copies the caller's bytes in with one memcpy, and
reports the write finished by setting the word. The other writes of a batch
are sent as one ``writes`` message per storage node, one zero-copy payload
frame per region taken from the caller's buffer; so is a direct write whose
assign did not show in time. Each region sent is a tracked transfer of the
Timeout protocol (``spec/Timeout.tla``): a message unacknowledged by the
deadline is cancelled at its node, which discards what has not run. With
``sums`` the :func:`checksum` of each :class:`Fill`'s bytes is taken where it
produced them; the client computes those of the caller's buffers
(:func:`checksums`) while its ``put_start`` is with the master, so a put's
hash costs it no time of its own.

:class:`LocalSegments` keeps the mappings of this host's segments (read-only
for reads, writable for direct writes).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Optional

import numpy as np
import xxhash
import zmq

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.shm import LocalSegment, shm_exists

#: how long a write batch whose messages timed out waits for the nodes' cancel acks
CANCEL_GRACE = 0.2
#: how long a direct writer waits for its region's assign to show before it
#: sends the bytes over the network instead
ASSIGN_WAIT = 0.5


def checksum(data) -> int:
    """An object's checksum: XXH3-64 of its bytes (``data``: any contiguous
    buffer), never 0 (0 means none, on the wire and in the directory)."""
    return xxhash.xxh3_64_intdigest(data) or 1


def checksums(todo: list, sums: dict) -> None:
    """``sums[i]`` = the :func:`checksum` of each ``(i, key, view)`` of
    ``todo`` whose bytes are there already (not a :class:`Fill`)."""
    for i, _, view in todo:
        if not isinstance(view, Fill):
            sums[i] = checksum(view)


class Fill:
    """An object's bytes that the caller produces straight into their
    destination (a GPU's gather and DMA): ``fill(dst)`` writes ``nbytes``
    into ``dst`` (a writable uint8 memoryview: the granted region itself for
    a same-host replica, else a staging buffer that is then sent) and
    returns once the copy is complete, or raises a typed error. A copy that
    timed out may still land later: ``on_late(report)`` is then called with
    the function to call once it can no longer write (so its region can drain
    at the node, ``spec/DirectWrite.tla``)."""

    __slots__ = ("nbytes", "fill", "on_late", "staging")

    def __init__(self, nbytes: int, fill: Callable[[memoryview], None],
                 on_late: Optional[Callable[[Callable[[], None]], None]] = None,
                 staging: Optional[memoryview] = None) -> None:
        if nbytes <= 0:
            raise errors.InvalidArgument("cannot put an empty object")
        self.nbytes, self.fill, self.on_late = nbytes, fill, on_late
        #: where the bytes go for replicas sent over the network (else a fresh buffer)
        self.staging = staging

    def materialize(self) -> memoryview:
        """The bytes in a buffer (``staging``, or one of their own) for the
        replicas sent over the network."""
        if self.staging is not None and self.staging.nbytes >= self.nbytes:
            buf = self.staging[:self.nbytes]
        else:
            buf = memoryview(np.empty(self.nbytes, dtype=np.uint8))
        self.fill(buf)
        return buf


class Consume:
    """Where a read's bytes go when the caller moves them itself (a GPU's DMA
    and scatter): ``consume(src)`` reads an object of at most ``nbytes`` from
    ``src`` (a read-only uint8 memoryview: the same-host segment's region, or
    the received frame) and returns once its copy is complete, or raises. A
    same-host region is checked after the copy (the seqlock), as for any read."""

    __slots__ = ("nbytes", "consume")

    def __init__(self, nbytes: int, consume: Callable[[memoryview], None]) -> None:
        self.nbytes, self.consume = nbytes, consume


def writable_view(buffer) -> memoryview:
    """A flat, writable byte view of caller-owned memory without copying:
    ``bytearray``, a writable ``memoryview``, a NumPy array, a CPU tensor (by
    its ``numpy()``). Anything else (read-only, not contiguous, a device
    tensor) is ``InvalidArgument``."""
    if not isinstance(buffer, (bytearray, memoryview, np.ndarray)) and hasattr(buffer, "numpy"):
        try:
            buffer = buffer.numpy()
        except (RuntimeError, TypeError) as e:
            raise errors.InvalidArgument(f"cannot read into {type(buffer).__name__}: {e}") from None
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise errors.InvalidArgument(f"{type(buffer).__name__} is not a buffer") from None
    if mv.readonly or not mv.c_contiguous:
        raise errors.InvalidArgument("the destination must be writable and contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class LocalSegments:
    """The same-host storage segments a client has mapped, by name (read-only,
    or ``writable`` for a direct writer)."""

    def __init__(self, host: str, enabled: bool = True, writable: bool = False) -> None:
        self.host = host
        self.enabled = enabled
        self.writable = writable
        self._maps: dict[str, Optional[LocalSegment]] = {}
        #: called with each segment once mapped (a GPU layer page-locks it)
        self.on_map: Optional[Callable[[LocalSegment], None]] = None

    def mapped(self) -> list[LocalSegment]:
        return [seg for seg in self._maps.values() if seg is not None]

    def get(self, info: list) -> Optional[LocalSegment]:
        """The mapping of the segment a master described (``SegmentInfo.wire()``),
        or ``None`` when it is on another host or cannot be mapped."""
        if not self.enabled or info[1] != self.host:
            return None
        name = info[2]
        if name not in self._maps:
            self._prune()
            try:
                self._maps[name] = LocalSegment(info[2], info[3], info[6], info[5],
                                                writable=self.writable)
            except (OSError, ValueError):
                self._maps[name] = None
            else:
                if self.on_map is not None:
                    self.on_map(self._maps[name])
        return self._maps[name]

    def _prune(self) -> None:
        """Unmap segments whose storage node is gone (its name was unlinked), so a
        long-lived client does not keep dead nodes' memory alive."""
        for name, seg in list(self._maps.items()):
            if not shm_exists(name):
                if seg is not None:
                    seg.close()
                del self._maps[name]

    def close(self) -> None:
        for seg in self._maps.values():
            if seg is not None:
                seg.close()
        self._maps.clear()


class ReadBuffers:
    """The memory a plain ``get`` copies same-host objects into, used again
    once its caller has let go of it: a buffer is idle when CPython's count of
    references to it is the pool's own (every view of it, every array made
    from such a view, holds one). A large allocation otherwise costs a fresh
    mapping that the copy then faults in page by page (a 32 MiB ``get`` took
    twice as long as the memcpy). Objects under :data:`MIN_BYTES` get fresh
    memory; the pool holds at most ``capacity`` bytes of buffers, in use or
    idle (0: none). Objects of at most :data:`SLAB_OBJECT` bytes are cut, one
    after the other, from a slab of :data:`SLAB_BYTES` (one allocation for a
    batch of small gets rather than one each; a value still held keeps its
    slab's memory): an idle one of the last :data:`SLABS` slabs (kept besides
    the buffers ``capacity`` counts, 16 MiB at most), else a fresh
    one (whose pages the copies would fault in, a 4 KiB get's copy costing
    three times as much)."""

    #: smaller objects get fresh memory (malloc serves them from its free lists)
    MIN_BYTES = 1 << 20
    #: objects this small share slabs of SLAB_BYTES, each cut at a cache line
    SLAB_OBJECT = 64 << 10
    SLAB_BYTES = 256 << 10
    #: slabs kept to be cut again once idle (while ``capacity`` has room for
    #: them): 16 MiB, a whole request of 4,096 objects of 4 KiB (with 16 kept,
    #: a ``get_many`` of 4,096 such keys faulted three quarters of its values'
    #: memory in afresh each call, and its copies took twice as long)
    SLABS = 64

    def __init__(self, capacity: int = 128 << 20) -> None:
        self.capacity = capacity
        self._bufs: list[np.ndarray] = []
        #: buffers taken from idle memory, and from fresh memory (a get's, or a run of
        #: regions a batch read copies together)
        self.reused = self.fresh = 0
        self._slab, self._cut = memoryview(b""), 0
        self._slabs: list[np.ndarray] = []
        self._slab_reused = False

    def _idle(self, k: int) -> bool:
        # references: the list's and getrefcount's argument
        return sys.getrefcount(self._bufs[k]) == 2

    def take(self, length: int):
        """A writable uint8 buffer (an array, or a byte view of a slab) of
        ``length`` bytes nobody else holds."""
        if length <= self.SLAB_OBJECT:
            at = self._cut
            if at + length > self._slab.nbytes:
                self._next_slab()
                at = 0
            self._cut = (at + length + 63) & ~63
            if self._slab_reused:
                self.reused += 1
            else:
                self.fresh += 1
            return self._slab[at:at + length]
        if length >= self.MIN_BYTES:
            best = None
            for k in range(len(self._bufs)):
                size = self._bufs[k].nbytes
                if length <= size < 2 * length and self._idle(k) \
                        and (best is None or size < self._bufs[best].nbytes):
                    best = k
            if best is not None:
                self.reused += 1
                return self._bufs[best][:length]
        buf = np.empty(length, dtype=np.uint8)
        self.fresh += 1
        if length >= self.MIN_BYTES:
            held = sum(b.nbytes for b in self._bufs)
            for k in reversed(range(len(self._bufs))):   # make room: drop idle buffers
                if held + length <= self.capacity:
                    break
                if self._idle(k):
                    held -= self._bufs.pop(k).nbytes
            if held + length <= self.capacity:
                self._bufs.append(buf)
        return buf

    def _next_slab(self) -> None:
        """Cut from here on from an idle kept slab, or a fresh one (kept if
        there is room)."""
        self._slab = memoryview(b"")     # the slab cut so far is held by its values only
        slabs, getrefcount = self._slabs, sys.getrefcount
        for slab in slabs:
            # references: the list's, the loop's and getrefcount's argument
            if getrefcount(slab) == 3:
                self._slab_reused = True
                break
        else:
            slab = np.empty(self.SLAB_BYTES + 64, dtype=np.uint8)
            self._slab_reused = False
            if len(slabs) < min(self.SLABS, self.capacity // self.SLAB_BYTES):
                slabs.append(slab)
        skip = -slab.ctypes.data % 64
        self._slab = memoryview(slab)[skip:skip + self.SLAB_BYTES]

    def clear(self) -> None:
        self._bufs.clear()
        self._slabs.clear()
        self._slab, self._cut = memoryview(b""), 0


def _verified(client, key: bytes, replica: list, data, expected: int
              ) -> Optional[errors.ChecksumMismatch]:
    """Whether ``data`` (a replica's bytes, after the copy) has the checksum
    ``expected`` recorded at publish: ``None``, or the mismatch (counted)."""
    c = client.checksum_counters
    if not expected:
        c["checksum_absent"] += 1
        return None
    got = checksum(data)
    if got == expected:
        c["checksum_verified"] += 1
        return None
    c["checksum_mismatches"] += 1
    return errors.ChecksumMismatch(
        f"{key!r} read from {replica[0]}@{replica[1]} has checksum {got:#018x}; "
        f"its writer recorded {expected:#018x}")


def all_present(values: list) -> bool:
    """Whether no entry of ``values`` (views read, or counts) is ``None``,
    judged by type: ``None in values`` compares each view with ``None``,
    about 0.2 us apiece."""
    return _NONE not in set(map(type, values))


_NONE = type(None)


def _read_local(where: dict, grants: dict, results: list, done_at: dict, take) -> int:
    """A plain get's first pass: each granted key whose first replica is in
    a segment mapped on this host is copied out of it, one
    :meth:`~kvproto.runtime.shm.LocalSegment.read_many` per segment, into a
    buffer of ``take``; ``done_at`` of a key so read is when its segment's
    pass ended. Returns how many were read; the others (a replica elsewhere,
    refused by the seqlock) are left to :func:`read_all`'s replica by replica."""
    segs, offsets, tokens, lengths = (grants["segment"], grants["offset"], grants["token"],
                                      grants["length"])
    counts = grants["replicas"]
    if segs and counts.count(1) == len(tokens) and segs.count(segs[0]) == len(segs):
        # every key granted, one replica each, all in one segment: the columns as they are
        return _read_batches(where, {segs[0]: (range(len(tokens)), offsets, lengths, tokens)},
                             results, done_at, take)
    batches: dict = {}     # segment -> ([key], [offset], [length], [token])
    at = 0
    for i, (token, length, n) in enumerate(zip(tokens, lengths, counts)):
        if token and n:
            name = segs[at]
            batch = batches.get(name)
            if batch is None:
                batch = batches[name] = ([], [], [], [])
            batch[0].append(i)
            batch[1].append(offsets[at])
            batch[2].append(length)
            batch[3].append(token)
        at += n
    return _read_batches(where, batches, results, done_at, take)


def _read_batches(where: dict, batches: dict, results: list, done_at: dict, take) -> int:
    """:func:`_read_local`'s copies: ``batches`` maps a segment to its keys'
    ``(indexes, offsets, lengths, tokens)``."""
    read = 0
    for name, (index, offs, lengths, tokens) in batches.items():
        seg, nonce = where.get(name, (None, 0))
        if seg is None:
            continue
        got = seg.read_many(offs, lengths, tokens, nonce, take)
        done = time.monotonic()
        if type(index) is range and len(got) > 1 and all_present(got):
            # every key of the reply, each read (:func:`_read_local`'s first
            # case; a single key costs less in the loop)
            results[:] = got
            done_at.update(dict.fromkeys(index, done))
            read += len(got)
            continue
        for i, view in zip(index, got):
            if view is not None:
                results[i], done_at[i] = view, done
                read += 1
    return read


def read_all(client, keys: list, grants: dict, segments: dict, deadline: float,
             results: list, done_at: dict, term: int,
             into: Optional[list] = None, verify: bool = False) -> dict[int, errors.KvError]:
    """Fill ``results[i]`` for each key ``i`` the master granted (``grants``:
    the ``read_begin`` reply's columns, :data:`~kvproto.runtime.wire.READ_COLUMNS`,
    a refused key's token 0; ``tickets``, where present, the read ticket of
    each replica, in order, which a network read carries): the bytes, or with
    ``into`` the number of bytes read into ``into[i]``; ``done_at[i]`` is when
    its last byte was read. With ``verify`` a replica whose bytes do not have
    the checksum is a failure (the next one is tried). Returns the keys no
    replica could serve, with the reason."""
    need: dict[int, list] = {}
    failed: dict[int, errors.KvError] = {}
    # per segment of the reply: (its mapping on this host or None, its nonce);
    # a segment the reply does not describe is not usable
    where: dict = {}
    for name, info in segments.items():
        if isinstance(info, list):
            where[name] = (client._local.get(info), info[4])
    take, local_reads, nowhere = client.read_buffers.take, 0, (None, 0)
    segs, offsets, sums, tickets = (grants["segment"], grants["offset"], grants["checksum"],
                                    grants.get("tickets"))
    #: the keys read over the network: (token, length, replicas, checksum, tickets)
    granted: dict[int, tuple] = {}
    if into is None and not verify:
        local_reads += _read_local(where, grants, results, done_at, take)
    tokens = grants["token"]
    unread = len(tokens) - tokens.count(0) - local_reads    # granted keys not read yet
    last = 0
    for i, (token, length, n) in enumerate(zip(tokens, grants["length"], grants["replicas"])) \
            if unread else ():
        first = last
        last += n
        if not token or results[i] is not None:
            continue
        dest = into[i] if into is not None else None
        if dest is not None and dest.nbytes < length:
            failed[i] = errors.InvalidArgument(
                f"{keys[i]!r} has {length} bytes; the buffer holds {dest.nbytes}")
            continue
        bad = []
        for k in range(first, last):
            seg, nonce = where.get(segs[k], nowhere)
            if seg is None:
                continue
            if dest is None:    # a plain get: into a buffer of the client's that is idle
                buf = memoryview(take(length))
                got = buf if seg.read_into(offsets[k], length, token, nonce, buf) else None
                del buf
            elif isinstance(dest, Consume):
                got = length if seg.consume(offsets[k], length, token, nonce, dest.consume) \
                    else None
            else:
                got = length if seg.read_into(offsets[k], length, token, nonce, dest) else None
            if got is not None:
                done = time.monotonic()
                local_reads += 1
                mismatch = verify and _verified(client, keys[i], [segs[k], offsets[k], length],
                                                got if dest is None else dest[:length], sums[i])
                if mismatch:
                    failed[i] = mismatch
                    bad.append(k)
                    continue
                results[i], done_at[i] = got, done
                if failed:
                    failed.pop(i, None)
                break
        if results[i] is None:
            replicas = [[segs[k], offsets[k], length] for k in range(first, last)]
            granted[i] = (token, length, replicas, sums[i], tickets[i] if tickets else None)
            usable = [k for k in range(first, last) if segs[k] in where]
            local = [k for k in usable if where[segs[k]][0] is not None]
            # remote replicas first (spread by token), then the local ones over
            # the network (not one whose bytes were just found wrong)
            remote = [replicas[k - first] for k in usable if k not in local]
            if remote:
                j = token % len(remote)
                remote = remote[j:] + remote[:j]
            need[i] = remote + [replicas[k - first] for k in local if k not in bad]
    client.transfer_counters["local_reads"] += local_reads
    for i in [i for i, left in need.items() if not left]:
        if i not in failed:
            failed[i] = errors.SegmentUnavailable(f"no replica of {keys[i]!r} is reachable")
        del need[i]
    while need:
        rounds_left = max(len(left) for left in need.values())
        round_deadline = time.monotonic() + max(deadline - time.monotonic(), 0) / rounds_left
        pending: dict[int, zmq.Socket] = {}
        whose: dict[int, tuple[int, str, list]] = {}
        for i, left in need.items():
            replica = left.pop(0)
            seg, offset, length = replica
            endpoint = segments[seg][0]
            sock = client._data_sock(endpoint)
            body = {"segment": seg, "offset": offset, "term": term, "token": granted[i][0],
                    "length": length}
            tickets = granted[i][4]
            if tickets:
                body["ticket"] = tickets[granted[i][2].index(replica)]
            rid = client._send(sock, "read", body)
            pending[rid] = sock
            whose[rid] = (i, endpoint, replica)
        replies = client._gather(pending, round_deadline)
        arrived = time.monotonic()   # at or after each reply's last byte
        for rid, (i, endpoint, replica) in whose.items():
            reply = replies.get(rid)
            if reply is None:
                err: Optional[errors.KvError] = errors.TransferTimeout(
                    f"storage node {endpoint} did not answer a read")
                client._reset_data(endpoint)
            elif reply.status:
                err = reply.error()
            elif len(reply.payloads) != 1 or reply.payloads[0].nbytes != granted[i][1]:
                err = errors.MalformedFrame(f"read reply from {endpoint} has the wrong size")
            else:
                payload, got = reply.payloads[0], None
                if isinstance(into[i] if into is not None else None, Consume):
                    into[i].consume(payload)
                    got = payload.nbytes
                elif into is not None:
                    into[i][:payload.nbytes] = payload
                    got = payload.nbytes
                client.transfer_counters["network_reads"] += 1
                err = verify and _verified(client, keys[i], replica, payload if into is None
                                           else into[i][:payload.nbytes], granted[i][3])
                if not err:
                    results[i] = payload if got is None else got
                    done_at[i] = arrived
                    failed.pop(i, None)
                    need.pop(i)
                    continue
            if not need[i]:
                failed[i] = err
                del need[i]
    return failed


def write_direct(seg: LocalSegment, offset: int, token: int, nonce: int, view,
                 deadline: float) -> bool:
    """One direct write (``spec/DirectWrite.tla`` ``Write``): wait until the
    region shows its assign to ``token``, copy ``view`` in (or let a
    :class:`Fill` produce it there), report it. False (nothing written) if the
    assign did not show by ``deadline``. A :class:`Fill`'s error is raised, its
    report left to the copy (``on_late``).

    The wait is a poll of the region's word: the node tells the writer
    nothing, the word is where its assign shows. The master sends the
    assign before the grant, so the first look finds it at least half the
    time at batch 1 (docs/gpu.md, "Where a 4 KiB put and get spend their
    time"); why the writer may not write before it shows:
    docs/protocols/directwrite.md, "The write"."""
    spins = 0
    while not seg.assigned(offset, token, nonce):
        if time.monotonic() >= deadline:
            return False
        spins += 1
        if spins > 64:
            # the node applies the assign within a wake or two: yield the core
            # first (a 200 us sleep doubled a batch-1 put), sleep later
            if spins < 2048:
                os.sched_yield()
            else:
                time.sleep(0.0002)
    if isinstance(view, Fill):
        dst = seg.region(offset, view.nbytes)
        if dst is None:
            return False
        try:
            view.fill(memoryview(dst))
        except errors.KvError:
            if view.on_late is not None:
                view.on_late(lambda: seg.report_written(offset, token))
            raise
    elif not seg.write(offset, view):
        return False
    seg.report_written(offset, token)
    return True


def write_all(client, grants: dict, segments: dict, deadline: float,
              term: int, sums: Optional[dict] = None) -> dict[int, errors.KvError]:
    """Write every replica of every grant (``grants[i] = (key, view, token,
    replicas)``, a replica ``(segment, offset, direct)``, ``direct`` true where
    the segment is granted to this client as a direct writer): those straight
    into the segment, the others as one
    ``writes`` message per storage node, all in flight at once; wait for the
    acks. Returns the failures by ``i``; with a dict ``sums``, sets
    ``sums[i]`` to the :func:`checksum` of each :class:`Fill`'s bytes (the
    caller's buffers are hashed before: :func:`checksums`).

    A message unacked by the deadline fails its regions with
    ``TransferTimeout`` and is cancelled at its node (each region's transfer,
    which the node discards if it has not run); the caller then revokes the
    attempts at the master, so even a write that ran is never published."""
    failed: dict[int, errors.KvError] = {}
    per_node: dict[str, tuple[str, list, list, list]] = {}   # endpoint -> (segment, regions, frames, whose)
    assign_by = min(deadline, time.monotonic() + ASSIGN_WAIT)
    materialized: dict[int, memoryview] = {}
    writable: dict = {}     # segment -> this client's writable mapping of it (or None), once
    for i, (key, view, token, replicas) in grants.items():
        for seg, offset, direct in replicas:
            info = segments.get(seg)
            if not isinstance(info, list) or not info:
                failed[i] = errors.MalformedFrame(f"grant for {key!r} names unknown segment {seg!r}")
                break
            if direct:
                mapped = writable[seg] if seg in writable \
                    else writable.setdefault(seg, client._writable.get(info))
                try:
                    if mapped is not None and write_direct(mapped, offset, token, info[4], view,
                                                           assign_by):
                        client.transfer_counters["direct_writes"] += 1
                        if sums is not None and i not in sums:
                            # a Fill's bytes where it produced them
                            sums[i] = checksum(mapped.region(offset, view.nbytes))
                        continue
                except errors.KvError as err:
                    failed[i] = err
                    break
            if isinstance(view, Fill):
                try:   # replicas sent over the network: the bytes in a buffer, once
                    view = materialized[i] if i in materialized else \
                        materialized.setdefault(i, view.materialize())
                    if sums is not None and i not in sums:
                        sums[i] = checksum(view)
                except errors.KvError as err:
                    failed[i] = err
                    break
            client.transfer_counters["network_writes"] += 1
            client._put_gen += 1
            batch = per_node.setdefault(info[0], (seg, [], [], []))
            batch[1].append([offset, token, client._put_gen])
            batch[2].append(view)
            batch[3].append(i)
    pending: dict[int, zmq.Socket] = {}
    sent: dict[int, tuple[str, list, list]] = {}
    for endpoint, (seg, regions, frames, whose) in per_node.items():
        sock = client._data_sock(endpoint)
        rid = client._send(sock, "writes", {"segment": seg, "term": term, "owner": client._put_owner,
                                            "regions": regions}, frames)
        pending[rid] = sock
        sent[rid] = (endpoint, regions, whose)
    replies = client._gather(pending, deadline)
    cancels: dict[int, zmq.Socket] = {}
    timed_out: set[str] = set()
    for rid, (endpoint, regions, whose) in sent.items():
        reply = replies.get(rid)
        if reply is None:
            for i in whose:
                failed.setdefault(i, errors.TransferTimeout(f"storage node {endpoint} did not ack a write"))
            sock = pending[rid]
            for _, _, gen in regions:
                cancels[client._send(sock, "cancel", {"owner": client._put_owner, "xfer": gen})] = sock
            timed_out.add(endpoint)
            continue
        results = reply.body.get("results") if reply.status == 0 else None
        if type(results) is not list or len(results) != len(whose):
            err = reply.error() if reply.status else errors.MalformedFrame(
                f"writes reply from {endpoint} has the wrong number of results")
            results = [list(err.to_wire())] * len(whose)
        for i, item in zip(whose, results):
            err, _ = wire.item_result(item)
            if err is not None and i not in failed:
                failed[i] = err
    if cancels:
        client._gather(cancels, time.monotonic() + CANCEL_GRACE)
        for endpoint in timed_out:
            client._reset_data(endpoint)
    return failed
