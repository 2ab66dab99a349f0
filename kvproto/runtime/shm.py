"""A storage segment in POSIX shared memory, and lock-free same-host reads of it.

A storage node keeps its segment's bytes in one shared-memory object and, next
to it, a *generation table*: one ``uint64`` word per page, after a 4-word header
``[MAGIC, nonce, page_size, pages]``. The word of the page a region starts on
describes the region:

* ``0`` — no region starts here (never assigned, or freed);
* ``token << 1`` — assigned to ``token``, bytes not (or being) written;
* ``token << 1 | 1`` — written by ``token``: the bytes are complete.

The node changes a word only together with its region table (the regions of
its ``StorageNodeCore``, for an event the table accepts): AssignRegion sets
``token << 1``, a write sets ``token << 1`` before its memcpy and
``token << 1 | 1`` after it, and FreeRegion sets 0. Tokens are never reused within one master's life, and the
nonce changes whenever the node starts over under a new segment id, so the pair
``(nonce, word)`` works as a seqlock generation with no ABA: a reader on the
same host copies the region out in one memcpy and keeps the copy only if the
nonce and the word equal ``(descriptor nonce, token << 1 | 1)`` both before and
after the copy. Otherwise it falls back to a network read, where
``ReadReplica`` decides.

In a correct run the check never fails: the reader holds a pin from
``ReadBegin``, so the region can be neither freed nor reassigned while it
copies. The seqlock guards against stale descriptors, a node that started
over, and a writer that rewrites a published region with its own token (which
``storage_step`` accepts). The words are aligned 8-byte loads and stores. On
x86-64 (TSO) loads are not reordered with loads nor stores with stores, so the
reader's two checks bracket its copy and the node's two stores bracket its
memcpy. On weakly ordered CPUs no fence is issued from Python; there the pin is
what makes the read safe and the check is best effort.

Readers map the objects read-only with ``shm_open(O_RDONLY)`` + ``mmap`` and
never register them with :mod:`multiprocessing.resource_tracker` (which would
unlink the node's segment when the *reader* exits).

Direct writers (``spec/DirectWrite.tla``). A client on the node's host may be
granted a region to write itself: it maps the segment writable
(:class:`LocalSegment` with ``writable=True``), waits until the region's word
reads ``token << 1`` (the node applied the assign), copies its bytes in, and
then sets the word to ``token << 1 | 1``: that store is its report that the
write is finished. Each direct writer holds a :class:`WriterLock` (an
exclusive ``flock`` on a small file beside the segments) for as long as its
process lives; the kernel releases it when the process dies, which is how the
node knows a writer that never reported is dead (:func:`writer_alive`).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import socket
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Optional

import numpy as np

try:  # POSIX only; the same primitive multiprocessing.shared_memory uses
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

MAGIC = 0x6B7670726F746F31  # "kvproto1"
HEADER_WORDS = 4

_HOST_ID: Optional[str] = None


def host_id() -> str:
    """Identifies this machine (hostname + boot id): equal ids may share memory."""
    global _HOST_ID
    if _HOST_ID is None:
        boot = ""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            pass
        _HOST_ID = f"{socket.gethostname()}/{boot}"
    return _HOST_ID


def shm_exists(name: str) -> bool:
    """Whether a POSIX shared-memory object of this name exists."""
    if _posixshmem is None:
        return False
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def gen_word(token: int, done: bool) -> int:
    return (token << 1) | int(done)


SHM_DIR = "/dev/shm"


def shm_free() -> Optional[int]:
    """Bytes free for shared memory (``/dev/shm``), or None where it is not a directory."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _reserve(shm: SharedMemory, size: int) -> None:
    """Allocate the object's pages now (``posix_fallocate``), so a full
    ``/dev/shm`` is an ``ENOSPC`` here, not a SIGBUS ("Bus error") at the
    first write into a page that has no room."""
    fd = getattr(shm, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


class SegmentMemory:
    """The storage node's side: owns (creates, and at :meth:`close` unlinks) the
    segment and its generation table. A segment larger than the free space of
    ``/dev/shm`` is refused at once: ``OSError(ENOSPC)`` saying how much is free
    (a default container has 64 MiB; ``docker run --shm-size`` raises it)."""

    def __init__(self, capacity: int, page_size: int, prefix: str = "kvp") -> None:
        if capacity <= 0 or capacity % page_size:
            raise ValueError("capacity must be a positive multiple of page_size")
        self.capacity = capacity
        self.page_size = page_size
        self.pages = capacity // page_size
        gen_size = 8 * (HEADER_WORDS + self.pages)
        free = shm_free()
        if free is not None and capacity + gen_size > free:
            raise _no_room(capacity + gen_size, free)
        tag = secrets.token_hex(6)
        self._shm = SharedMemory(name=f"{prefix}_{tag}", create=True, size=capacity)
        try:
            self._gen_shm = SharedMemory(name=f"{prefix}_{tag}_g", create=True, size=gen_size)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        try:
            _reserve(self._shm, capacity)
            _reserve(self._gen_shm, gen_size)
        except OSError as e:
            for shm in (self._shm, self._gen_shm):
                shm.close()
                shm.unlink()
            if e.errno == errno.ENOSPC:
                raise _no_room(capacity + gen_size, shm_free() or 0) from None
            raise
        self.data: memoryview = self._shm.buf
        # Fault every page in now, as a store registering its memory would, so
        # the first write into a region does not pay the kernel's page faults.
        np.frombuffer(self.data, dtype=np.uint8)[::mmap.PAGESIZE] = 0
        self.gens = np.ndarray((HEADER_WORDS + self.pages,), dtype=np.uint64, buffer=self._gen_shm.buf)
        self.gens[0] = MAGIC
        self.gens[2] = page_size
        self.gens[3] = self.pages
        #: the same words as a plain view: one read or write is a Python int
        self._words = self._gen_shm.buf.cast("Q")
        self.nonce = 0
        self.reset()
        self._closed = False

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def gen_name(self) -> str:
        return self._gen_shm.name

    def reset(self) -> int:
        """Start over (a new segment id): new nonce first, then clear every word."""
        self.nonce = secrets.randbits(62)
        self.gens[1] = self.nonce
        self.gens[HEADER_WORDS:] = 0
        return self.nonce

    def set_word(self, offset: int, value: int) -> None:
        self._words[HEADER_WORDS + offset // self.page_size] = value

    def word(self, offset: int) -> int:
        return self._words[HEADER_WORDS + offset // self.page_size]

    def words(self, offsets: list) -> list:
        """:meth:`word` of each of ``offsets``."""
        words = np.frombuffer(self._words, np.uint64)
        found = words[HEADER_WORDS + np.array(offsets, np.int64) // self.page_size].tolist()
        del words                           # the mapping may be closed
        return found

    def set_words(self, offsets: list, values: list) -> None:
        """:meth:`set_word` of each of ``offsets`` (distinct)."""
        words = np.frombuffer(self._words, np.uint64)
        words[HEADER_WORDS + np.array(offsets, np.int64) // self.page_size] = values
        del words                           # the mapping may be closed

    def view(self, offset: int, length: int) -> memoryview:
        return self.data[offset:offset + length]

    def close(self) -> None:
        """Unmap and unlink both objects. A view still held elsewhere (a zero-copy
        read reply ZeroMQ has not released yet) keeps its mapping alive until it
        is dropped; the names are unlinked now either way."""
        if self._closed:
            return
        self._closed = True
        try:
            self._words.release()
        except BufferError:
            pass
        self._words = None
        self.gens = None  # type: ignore[assignment]
        self.data = None  # type: ignore[assignment]
        for shm in (self._shm, self._gen_shm):
            _close_quietly(shm)
            try:
                shm.unlink()
            except FileNotFoundError:
                try:
                    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
                except Exception:
                    pass


def _no_room(need: int, free: int) -> OSError:
    mib = 1 << 20
    return OSError(errno.ENOSPC, f"a segment of {need / mib:,.1f} MiB (with its generation table) "
                   f"does not fit in {SHM_DIR}: {free / mib:,.1f} MiB free; use a smaller size or "
                   "give the host more shared memory (e.g. docker run --shm-size)")


def _close_quietly(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        # Exported views remain: drop our references instead; the mmap object
        # unmaps itself when the last view goes (and SharedMemory.__del__ has
        # nothing left to complain about).
        shm._buf = None  # type: ignore[attr-defined]
        shm._mmap = None  # type: ignore[attr-defined]
        if getattr(shm, "_fd", -1) >= 0:
            os.close(shm._fd)  # type: ignore[attr-defined]
            shm._fd = -1  # type: ignore[attr-defined]


#: a client maps the pages of segments up to this size when it maps them
#: (``MAP_POPULATE``, about 75 ms per GiB, once); larger ones fault their
#: pages in at first touch
POPULATE_BYTES = 4 << 30

#: regions next to each other in a segment that :meth:`LocalSegment.read_many`
#: copies in its array passes go into one buffer of its ``take``, one memcpy,
#: up to this many bytes (what a plain get's buffers cut from a slab,
#: :class:`~kvproto.runtime.datapath.ReadBuffers`)
READ_RUN_BYTES = 64 << 10

#: from this many regions :meth:`LocalSegment.read_many` checks their words
#: in array passes (about 20 NumPy calls, 25-35 us whatever the count); fewer
#: are checked one by one (0.1-0.3 us more a region, the same below ~128)
READ_ARRAYS_FROM = 128


class LocalSegment:
    """A reader's read-only mapping of a storage node's segment on this host
    (or a direct writer's writable one)."""

    def __init__(self, shm: str, gen_shm: str, capacity: int, page_size: int,
                 writable: bool = False) -> None:
        if _posixshmem is None:
            raise OSError("POSIX shared memory is not available")
        self.capacity = capacity
        self.page_size = page_size
        self.writable = writable
        pages = capacity // page_size
        self._maps: list[mmap.mmap] = []
        self._bytes = self._words = None
        try:
            data = self._map(shm, capacity)
            gens = self._map(gen_shm, 8 * (HEADER_WORDS + pages))
        except BaseException:
            self.close()
            raise
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._gens = np.frombuffer(gens, dtype=np.uint64)
        # the same memory as plain views: a word read is a Python int and a
        # small copy one memcpy, without a NumPy object per read
        self._bytes = memoryview(data)
        self._words = memoryview(gens).cast("Q")
        if (int(self._gens[0]) != MAGIC or int(self._gens[2]) != page_size
                or int(self._gens[3]) != pages):
            self.close()
            raise OSError(f"{gen_shm!r} is not the generation table of this segment")

    def _map(self, name: str, size: int) -> mmap.mmap:
        flags = os.O_RDWR if self.writable else os.O_RDONLY
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"shared memory {name!r} is smaller than {size} bytes")
            # Map every page now (the node allocated them all): a copy into a
            # region this process never touched would otherwise take a page
            # fault per 4 KiB, which makes a first write about 4x slower.
            populate = getattr(mmap, "MAP_POPULATE", 0) if self.capacity <= POPULATE_BYTES else 0
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate,
                           prot=mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0))
        finally:
            os.close(fd)
        self._maps.append(mm)
        return mm

    def _seqlocked(self, offset: int, length: int, token: int, nonce: int, copy) -> bool:
        """The seqlock of every read: ``copy(src)`` (``src`` a byte view of the
        region) runs only if the region is complete, and the result counts
        only if it still is afterwards (same generation word, same segment nonce).
        A mapping closed meanwhile (its node gone, pruned by another lookup of
        the same batch) has nothing complete in it."""
        words = self._words
        if words is None or offset < 0 or offset % self.page_size \
                or offset + length > self.capacity:
            return False
        idx = HEADER_WORDS + offset // self.page_size
        want = gen_word(token, True)
        if words[1] != nonce or words[idx] != want:
            return False
        copy(self._bytes[offset:offset + length])
        return words[idx] == want and words[1] == nonce

    def read(self, offset: int, length: int, token: int, nonce: int) -> Optional[memoryview]:
        """Copy the region out (one memcpy) if it is complete and stays so during
        the copy; else ``None``."""
        out = []
        if not self._seqlocked(offset, length, token, nonce, lambda src: out.append(np.array(src))):
            return None
        return memoryview(out[0])

    @property
    def array(self) -> np.ndarray:
        """The whole segment as a uint8 array (to page-lock it for a device)."""
        return self._data

    def region(self, offset: int, length: int) -> Optional[np.ndarray]:
        """The region's bytes as a writable array (a direct writer's destination),
        or ``None`` for a read-only mapping or a region outside the segment."""
        if not self.writable or self._data is None or offset < 0 \
                or offset % self.page_size or offset + length > self.capacity:
            return None
        return self._data[offset:offset + length]

    def assigned(self, offset: int, token: int, nonce: int) -> bool:
        """Whether the node has applied the region's assign to ``token`` (and
        nobody reported a write yet): a direct writer may write it."""
        words = self._words
        return words is not None and words[1] == nonce \
            and words[HEADER_WORDS + offset // self.page_size] == gen_word(token, False)

    def write(self, offset: int, view: memoryview) -> bool:
        """Copy ``view`` (a flat byte view) into the region at ``offset`` (one
        memcpy): a direct writer's copy; False for a read-only mapping or a
        region outside the segment."""
        if type(view) is not memoryview or view.format != "B" or view.ndim != 1:
            view = memoryview(view).cast("B")
        if not self.writable or self._bytes is None or offset < 0 \
                or offset % self.page_size or offset + view.nbytes > self.capacity:
            return False
        self._bytes[offset:offset + view.nbytes] = view
        return True

    def report_written(self, offset: int, token: int) -> None:
        """A direct writer's report: its copy into the region is complete."""
        self._words[HEADER_WORDS + offset // self.page_size] = gen_word(token, True)

    def consume(self, offset: int, length: int, token: int, nonce: int, consume) -> bool:
        """Let ``consume(src)`` copy the region out itself (a DMA), ``src`` a
        read-only view of it: True if the region was complete before and after
        (the seqlock, as for :meth:`read`); ``consume`` runs only if it was before."""
        return self._seqlocked(offset, length, token, nonce, lambda src: consume(memoryview(src)))

    def read_into(self, offset: int, length: int, token: int, nonce: int, dest: memoryview) -> bool:
        """:meth:`read` into ``dest`` (the caller's memory, at least ``length``
        bytes): True if the region was complete and stayed so during the copy;
        on False ``dest``'s first ``length`` bytes are undefined."""
        if type(dest) is not memoryview or dest.format != "B" or dest.ndim != 1:
            dest = np.frombuffer(dest, dtype=np.uint8, count=length).data

        def copy(src: memoryview) -> None:
            dest[:length] = src         # one memcpy between byte views
        return self._seqlocked(offset, length, token, nonce, copy)

    def read_many(self, offsets, lengths, tokens, nonce: int, take) -> list:
        """:meth:`read_into` of several regions, each into a fresh buffer
        ``take(length)`` (writable bytes), in one pass: per region that buffer
        as a byte view, or ``None`` where the seqlock refused it (the checks
        of :meth:`_seqlocked`: the nonce before the first copy and after the
        last; each region's word before its copy and after it, region by
        region below :data:`READ_ARRAYS_FROM` regions, else in a pass over
        the words before the first copy and one after the last, the regions
        next to each other then copied together: one buffer of ``take``, one
        memcpy, :data:`READ_RUN_BYTES` at most)."""
        words, data, n = self._words, self._bytes, len(offsets)
        if words is None or words[1] != nonce:
            return [None] * n
        if n < READ_ARRAYS_FROM:
            page, capacity, out = self.page_size, self.capacity, []
            for offset, length, token in zip(offsets, lengths, tokens):
                at, done = HEADER_WORDS + offset // page, gen_word(token, True)
                if offset < 0 or offset % page or offset + length > capacity \
                        or words[at] != done:
                    out.append(None)
                    continue
                buf = take(length)
                if type(buf) is not memoryview:
                    buf = memoryview(buf)
                buf[:] = data[offset:offset + length]
                out.append(buf if words[at] == done else None)
        else:
            # the columns as unsigned 64-bit ints (a reply's are checked so)
            offs, lens, toks = (np.array(c, dtype=np.uint64) for c in (offsets, lengths, tokens))
            page, capacity = np.uint64(self.page_size), np.uint64(self.capacity)
            fits = (offs % page == 0) & (lens <= capacity) \
                & (offs <= capacity - np.minimum(lens, capacity)) & (toks < np.uint64(1 << 63))
            at = HEADER_WORDS + np.where(fits, offs, 0) // page
            gens = np.frombuffer(words, dtype=np.uint64)
            done = (toks << np.uint64(1)) | np.uint64(1)      # gen_word(token, True)
            out = [None] * n
            run: list = []          # regions next to each other in the segment
            start = end = -1
            for i in np.flatnonzero(fits & (gens[at] == done)).tolist():
                offset, length = offsets[i], lengths[i]
                if offset != end or end + length - start > READ_RUN_BYTES:
                    if run:
                        _copy_run(data, take, offsets, lengths, run, start, end, out)
                    run, start = [], offset
                run.append(i)
                end = offset + length
            if run:
                _copy_run(data, take, offsets, lengths, run, start, end, out)
            out = [buf if ok else None for buf, ok in zip(out, (gens[at] == done).tolist())]
        if words[1] != nonce:
            return [None] * n
        return out

    def close(self) -> None:
        self._data = None
        self._gens = None
        for view in (self._bytes, self._words):
            if view is not None:
                try:
                    view.release()
                except BufferError:
                    pass
        self._bytes = self._words = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass
        self._maps = []


def _copy_run(data: memoryview, take, offsets, lengths, run: list, start: int, end: int,
              out: list) -> None:
    """Copy the regions ``run`` (indexes into ``offsets``/``lengths``), which
    fill ``[start, end)`` of the segment ``data`` one after the other, into
    one buffer of ``take``: ``out[i]`` the view of region ``i`` in it."""
    buf = take(end - start)
    if type(buf) is not memoryview:
        buf = memoryview(buf)
    buf[:] = data[start:end]
    if len(run) == 1:
        out[run[0]] = buf
        return
    for i in run:
        at = offsets[i] - start
        out[i] = buf[at:at + lengths[i]]


WRITER_PREFIX = "kvpw_"


class WriterLock:
    """A direct writer's proof of life: an exclusive ``flock`` on a file in
    ``/dev/shm`` named :attr:`name`, held until :meth:`close` or the process's
    death (the kernel drops it either way)."""

    def __init__(self) -> None:
        import fcntl
        self.name = f"{WRITER_PREFIX}{secrets.token_hex(8)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)   # releases the lock
            self._fd = -1


def writer_alive(name: str) -> bool:
    """Whether the direct writer named ``name`` (a :class:`WriterLock`) still
    lives: its lock is held. A name that is not a writer lock's, or whose file
    is gone, is a dead writer."""
    import fcntl
    if not name.startswith(WRITER_PREFIX) or "/" in name:
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            os.unlink(os.path.join(SHM_DIR, name))   # its writer is gone: tidy up
        except OSError:
            pass
        return False
    finally:
        os.close(fd)
