"""The Mooncake Store Python API (``mooncake.store``) on kvproto.

:class:`MooncakeDistributedStore` and :class:`ReplicateConfig` take the same
arguments and give the same return values as Mooncake's binding, so code
written for Mooncake runs on kvproto unchanged (through the ``PYTHONPATH``
shim in ``kvproto/engines/shim``, or by importing this module). Every call goes
through the public :class:`kvproto.Client` API; see ``docs/engines.md``
for which protocol step each one is.

Return codes are Mooncake's (``ErrorCode``): ``0`` success; a re-put of an
existing key returns ``0`` and keeps the first bytes; a miss is ``-704``
(``get`` returns ``b""``, ``get_buffer`` ``None``); a remove while a read lease
is held is ``-706``; an invalid argument or a destination buffer too small is
``-600``; out of space is ``-200``. :func:`return_code` maps each kvproto error.

``setup`` joins a kvproto master: ``master_server_addr`` is a kvproto
coordinator URL (``file:///dir``, ``etcd://host:port``) or a master address
(``tcp://host:port``, or Mooncake's bare ``host:port``). With
``global_segment_size > 0`` it also contributes a storage segment of that size,
served by a :class:`~kvproto.runtime.storage_server.StorageServer` in a thread of this
process, which deregisters (its objects are lost) on ``close()``.
``metadata_server``, ``protocol``, ``rdma_devices`` and ``local_buffer_size``
are accepted and not needed: kvproto has no separate metadata service, moves
bytes over ZeroMQ or same-host shared memory, and needs no staging buffer.

Zero-copy forms (``put_from``, ``get_into`` and their batches) take raw
addresses, turned into views and read into by :mod:`kvproto.engines.memory`.
"""

from __future__ import annotations

import enum
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any, Optional

import numpy

from kvproto import errors
from kvproto.engines.memory import load_into, memory_at, read_many
from kvproto.runtime.client import Client
from kvproto.runtime.embedded import ServerThread
from kvproto.runtime.endpoints import coordinator_url
from kvproto.runtime.storage_server import StorageServer
from kvproto.runtime.units import parse_size

# Mooncake's ErrorCode values that kvproto answers with
OK = 0
INTERNAL_ERROR = -1
SEGMENT_NOT_FOUND = -101
NO_AVAILABLE_HANDLE = -200      # out of space
INVALID_PARAMS = -600           # invalid argument, buffer too small
REPLICA_IS_NOT_READY = -703     # not published yet
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

_CODES: tuple[tuple[type, int], ...] = (
    (errors.KeyNotFound, OBJECT_NOT_FOUND),
    (errors.NoSpace, NO_AVAILABLE_HANDLE),
    ((errors.ObjectLeased, errors.ObjectBusy), OBJECT_HAS_LEASE),
    ((errors.InvalidArgument, errors.MalformedFrame, errors.FrameTooLarge), INVALID_PARAMS),
    (errors.NotPublished, REPLICA_IS_NOT_READY),
    (errors.SegmentUnavailable, SEGMENT_NOT_FOUND),
    ((errors.RequestTimeout, errors.ServerUnavailable, errors.MasterNotOpen,
      errors.CoordinatorUnavailable), RPC_FAIL),
    ((errors.TransferTimeout, errors.RegionMismatch, errors.ChecksumMismatch, errors.StaleToken,
      errors.StaleTerm, errors.LeaseExpired, errors.LeaseDeadlinePassed), TRANSFER_FAIL),
)


def return_code(err: BaseException) -> int:
    """Mooncake's return code for a kvproto error (``-1`` for any other)."""
    for types, code in _CODES:
        if isinstance(err, types):
            return code
    return INTERNAL_ERROR


class BufferHandle(numpy.ndarray):
    """A read's bytes, as Mooncake's ``BufferHandle``: the buffer protocol,
    ``ptr()`` (the address of the first byte) and ``size()`` (bytes)."""

    def ptr(self) -> int:
        return self.ctypes.data

    def size(self) -> int:      # a method, as in Mooncake (ndarray's is a property)
        return self.nbytes


def _handle(view: memoryview) -> BufferHandle:
    return numpy.frombuffer(view, dtype=numpy.uint8).view(BufferHandle)


class SoftPinAction(enum.Enum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Placement asked of a put. kvproto acts on ``replica_num`` (replicas on
    distinct segments); the soft-pin and preferred-segment fields are kept for
    compatibility and do not change placement."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: Optional[int] = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []

    def __repr__(self) -> str:
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{self.soft_pin_action.name}, preferred_segment: {self.preferred_segment!r} }}")


_SETUP_ORDER = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
                "protocol", "rdma_devices", "master_server_addr")
#: Mooncake reads KB/MB/GB/TB as powers of 1024
_MOONCAKE_UNITS = re.compile(r"(?i)([kmgt])b\s*$")


def _size(value: Any) -> int:
    if isinstance(value, str):
        value = _MOONCAKE_UNITS.sub(lambda m: m.group(1) + "iB", value.strip())
    return parse_size(value)


def _master_address(addr: str) -> str:
    if coordinator_url(addr) or "://" in addr:
        return addr
    return f"tcp://{addr}"


def _setup_config(args: tuple, kwargs: dict) -> dict:
    """The setup arguments as one dict, in either of Mooncake's two forms."""
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        config = dict(args[0])
        if "master_server_address" in config:             # LMCache's spelling
            config.setdefault("master_server_addr", config.pop("master_server_address"))
        return config
    if len(args) > 13 or any(isinstance(a, dict) for a in args):
        raise TypeError("setup(): takes a config dict, or Mooncake's positional arguments")
    config = dict(zip(_SETUP_ORDER, args))
    config.update(kwargs)
    return config


class MooncakeDistributedStore:
    """A Mooncake store client (and, optionally, a storage segment) on kvproto."""

    #: how long ``setup`` waits for the master and for the segment to register
    SETUP_TIMEOUT = 30.0

    def __init__(self) -> None:
        self._client: Optional[Client] = None
        self._segment: Optional[ServerThread] = None
        self._hostname = ""
        self._buffers: dict[int, int] = {}          # registered address -> size
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size,
        local_buffer_size, protocol, rdma_devices, master_server_addr)`` or
        ``setup(config: dict)``; 0, ``-600`` for a bad argument, ``-900`` when
        the master cannot be reached."""
        config = _setup_config(args, kwargs)
        try:
            host = str(config.get("local_hostname", "")) or "127.0.0.1"
            segment_size = _size(config.get("global_segment_size", 16 << 20))
            _size(config.get("local_buffer_size", 16 << 20))
            master = _master_address(str(config.get("master_server_addr") or "127.0.0.1:50051"))
        except ValueError:
            return INVALID_PARAMS
        if self._client is not None:
            return INVALID_PARAMS                          # already set up
        client = Client(master, timeout=self.SETUP_TIMEOUT)
        try:
            client.stats()
        except errors.KvError as err:
            client.close()
            return return_code(err)
        self._hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        if segment_size > 0:
            try:
                ip = socket.gethostbyname(self._hostname)
            except OSError:
                client.close()
                return INVALID_PARAMS
            thread = ServerThread("kvproto-mooncake-segment", lambda: StorageServer(
                master, segment_size, listen=f"tcp://{ip}:*"))
            try:
                node = thread.start_and_wait(self.SETUP_TIMEOUT)
                if not node.registered.wait(self.SETUP_TIMEOUT):
                    raise errors.ServerUnavailable("the segment did not register")
            except (errors.KvError, RuntimeError, OSError) as err:
                thread.stop()
                client.close()
                return return_code(err) if isinstance(err, errors.KvError) else INTERNAL_ERROR
            self._segment = thread
            self._hostname = node.endpoint.split("://", 1)[-1]
        self._client = client
        return OK

    def close(self) -> int:
        """Close the client; a contributed segment deregisters and its objects are lost."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.stop()
        return OK

    def health_check(self) -> int:
        try:
            self._need().stats()
            return OK
        except errors.KvError as err:
            return return_code(err)

    def get_hostname(self) -> str:
        """Where this store's segment serves (``host:port``), else its hostname."""
        return self._hostname

    def _need(self) -> Client:
        if self._client is None:
            raise errors.ServerUnavailable("setup() has not succeeded (or close() was called)")
        return self._client

    # ------------------------------------------------------------------ put

    @staticmethod
    def _replicas(config: Optional[ReplicateConfig]) -> int:
        return 1 if config is None else int(config.replica_num)

    def _put_code(self, err: Optional[BaseException]) -> int:
        if err is None or isinstance(err, errors.KeyExists):
            return OK                  # a re-put keeps the first bytes, as Mooncake does
        return return_code(err)

    def _put_many(self, items: list, config: Optional[ReplicateConfig]) -> list[int]:
        try:
            results = self._need().put_many(items, replicas=self._replicas(config))
        except errors.KvError as err:
            return [return_code(err)] * len(items)
        return [self._put_code(e) for e in results]

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        return self._put_many([(key, value)], config)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: Optional[ReplicateConfig] = None) -> int:
        """0 when every key is stored, else the first failure's code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put_many(list(zip(keys, values)), config) if c), OK)

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Store the concatenation of ``parts`` (copied once into one buffer)."""
        try:
            value = b"".join(memoryview(p).cast("B") for p in parts)
        except TypeError:
            return INVALID_PARAMS
        return self.put(key, value, config)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: Optional[ReplicateConfig] = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       config: Optional[ReplicateConfig] = None) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_put_from_multi_buffers(keys, [[p] for p in buffer_ptrs],
                                                 [[s] for s in sizes], config)

    def batch_put_from_multi_buffers(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: Optional[ReplicateConfig] = None) -> list[int]:
        """Put each key from its buffers, concatenated (one buffer is sent as is;
        several are copied once into one)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        codes: list[Optional[int]] = [None] * len(keys)
        items, where = [], []
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes)):
            try:
                if len(ptrs) != len(sizes) or not ptrs:
                    raise errors.InvalidArgument("one size per buffer")
                views = [memory_at(p, s) for p, s in zip(ptrs, sizes)]
            except errors.InvalidArgument:
                codes[i] = INVALID_PARAMS
                continue
            items.append((keys[i], views[0] if len(views) == 1 else b"".join(views)))
            where.append(i)
        for i, code in zip(where, self._put_many(items, config) if items else []):
            codes[i] = code
        return codes  # type: ignore[return-value]

    # ------------------------------------------------------------------ get

    def _get_many(self, keys: Sequence[str]) -> list:
        """The bytes (memoryview) of each key, or an int code."""
        try:
            client = self._need()
        except errors.KvError as err:
            return [return_code(err)] * len(keys)
        return [return_code(v) if isinstance(v, errors.KvError) else v for v in read_many(client, keys)]

    def get(self, key: str) -> bytes:
        """The bytes of ``key``; ``b""`` on a miss or a failure."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [b"" if isinstance(v, int) else bytes(v) for v in self._get_many(keys)]

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[Optional[BufferHandle]]:
        """A handle per key over the read's own bytes (no copy), ``None`` on a miss."""
        return [None if isinstance(v, int) else _handle(v) for v in self._get_many(keys)]

    def get_size(self, key: str) -> int:
        """The object's length in bytes, or ``-704`` on a miss."""
        client = self._need()
        try:
            lease = client.read_begin([key])[0]
            if lease is None:
                return OBJECT_NOT_FOUND
            try:
                return lease.length
            finally:
                client.release([lease])
        except errors.KvError as err:
            return return_code(err)

    def _load(self, keys: Sequence[str], targets: Sequence[Sequence[memoryview]]) -> list[int]:
        """Read each key into its target views: the bytes read or a code."""
        try:
            client = self._need()
        except errors.KvError as err:
            return [return_code(err)] * len(keys)
        return [r if isinstance(r, int) else return_code(r) for r in load_into(client, keys, targets)]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into ``size`` bytes at ``buffer_ptr``: the bytes read, or a code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_get_into_multi_buffers(keys, [[p] for p in buffer_ptrs],
                                                 [[s] for s in sizes])

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]]) -> list[int]:
        """Read each key across its buffers in order (a scatter)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        codes: list[Optional[int]] = [None] * len(keys)
        todo, targets = [], []
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes)):
            try:
                if len(ptrs) != len(sizes) or not ptrs:
                    raise errors.InvalidArgument("one size per buffer")
                targets.append([memory_at(p, s) for p, s in zip(ptrs, sizes)])
            except errors.InvalidArgument:
                codes[i] = INVALID_PARAMS
                continue
            todo.append(i)
        if todo:
            for i, code in zip(todo, self._load([keys[i] for i in todo], targets)):
                codes[i] = code
        return codes  # type: ignore[return-value]

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Note a buffer for zero-copy calls: ``-600`` if it overlaps one already
        registered. kvproto needs no registration (any address may be used)."""
        if not isinstance(buffer_ptr, int) or not isinstance(size, int) or buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAMS
        with self._lock:
            for ptr, n in self._buffers.items():
                if buffer_ptr < ptr + n and ptr < buffer_ptr + size:
                    return INVALID_PARAMS
            self._buffers[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            return OK if self._buffers.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    # ------------------------------------------------------------------ exists, remove

    def is_exist(self, key: str) -> int:
        """1 if ``key`` is published, 0 if not, -1 on a failure."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            return [int(b) for b in self._need().exists_many(list(keys))]
        except errors.KvError:
            return [-1] * len(keys)

    def remove(self, key: str, force: bool = False) -> int:
        """0, ``-704`` on a miss, ``-706`` while a read holds a lease on it
        (``force=True`` ends the leases first)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """:meth:`remove` of each key, in requests of many keys (``remove_many``)."""
        try:
            return [OK if err is None else return_code(err)
                    for err in self._need().remove_many(list(keys), force=bool(force))]
        except errors.KvError as err:
            return [return_code(err)] * len(keys)

    def _remove_listed(self, match) -> int:
        try:
            keys = self._need().keys()
        except errors.KvError as err:
            return return_code(err)
        chosen = [key for key in keys if match(key.decode("utf-8", "surrogateescape"))]
        return self.batch_remove(chosen).count(OK)

    def remove_by_regex(self, regex: str) -> int:
        """Remove every key ``regex`` finds a match in: the number removed
        (keys under a lease are skipped), or ``-600`` for a bad pattern."""
        try:
            pattern = re.compile(regex)
        except (re.error, TypeError):
            return INVALID_PARAMS
        return self._remove_listed(lambda k: pattern.search(k) is not None)

    def remove_all(self) -> int:
        """Remove every object: the number removed (keys under a lease are skipped)."""
        return self._remove_listed(lambda k: True)
