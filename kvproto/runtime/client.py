"""The client: writes and reads object bytes directly to and from storage nodes.

A put is ``put_start`` (master: allocate, issue a token, tell the storage
nodes) -> one ``write`` per replica, all in flight at once, each carrying the
caller's buffer as a zero-copy frame -> wait for every ack -> ``put_end``
(master: publish). If anything fails, or the caller is interrupted, the client
sends ``put_revoke`` for every attempt it did not end and reports the typed
error. While a put or a read is in flight a background thread sends
``heartbeat`` so the master does not reclaim the attempt (it does so when the
client goes silent for the master's ``writer_timeout``).

A get is ``read_begin`` (master: pin, hand out replica descriptors) -> read
one replica -> ``read_end`` (fire-and-forget). A replica on a storage node of
this host (same host id) is read straight from the node's shared memory: one
memcpy guarded by the generation-table seqlock (:mod:`kvproto.runtime.shm`);
otherwise, or if that check fails, a ``read`` request is sent and the reply's
payload frame is returned without copying. The next replica is tried if one
fails.

Return values: ``get`` returns a ``memoryview`` (format ``B``, 1-D) equal to what
was put — over a private copy for a shared-memory read, or read-only over the
received ZeroMQ frame for a network read (no copy); ``get_many`` returns a list
with a memoryview per key and ``None`` for a miss; ``put_many`` returns one
``None`` (stored) or error instance per key; ``exists_many`` returns bools. A
miss raises :class:`~kvproto.errors.KeyNotFound`.

A call of more keys than ``batch`` sends several requests; the lookups of
``exists_many`` and ``get_many`` go ``window`` at a time, the next sent
before the answer to one is read (``ClientLink._lookups``), and a
``put_many`` sends a chunk's ``put_start`` while the chunk before it is
written (:mod:`kvproto.runtime.client_puts`).

``read_end`` is fire-and-forget, so for a moment after a ``get`` returns the
object may still be pinned: a ``remove`` sent on *another* client's connection
right then can get :class:`~kvproto.errors.ObjectBusy` (the same client's own
requests are ordered after its ``read_end``). Keys are bytes (a ``str`` is
UTF-8 encoded), 1 to 4096 bytes; empty objects are refused (``InvalidArgument``).

Failures are typed errors of :mod:`kvproto.errors`. ``put_many`` reports every
outcome per key and raises only for a bad ``replicas`` argument; a
``RequestTimeout`` from ``put_end`` means the outcome is unknown for that key
(it was revoked if it was not yet published). ``get_many`` returns ``None`` for
misses and raises the first error that is not a miss, after releasing its pins.

Every call takes ``timeout`` (seconds; default the client's ``timeout``) and
raises :class:`~kvproto.errors.RequestTimeout` when it runs out waiting for the
master, :class:`~kvproto.errors.TransferTimeout` when it runs out waiting for a
storage node's data transfer. Each replica write of a put is a tracked transfer
of the Timeout protocol (``spec/Timeout.tla``): on its timeout the client sends
the node a ``cancel`` (the node discards the write if it has not run) and
revokes the attempt. Loads into destination buffers go through a
:class:`~kvproto.runtime.transfers.TransferEngine` (``transfer_engine()``,
``get_into()``), which quarantines a timed-out load's buffer until its
completion or the node's cancel acknowledgement arrives. Sockets use
``LINGER 0``; a socket that timed out is closed and replaced, so a dead peer
never wedges the client. A :class:`Client` may be shared by threads (calls are
serialised by a lock); use one client per thread for parallel transfers.

No such key, or no master. A lookup (``get``, ``get_many``, ``exists``) that
the master cannot answer while it may be switching (not open, silent for
``lookup_timeout``, none named by the coordinator) is a miss, counted in
``failover_counters["switch_misses"]``. A master that serves no call for the
*switch window* is unreachable: every call, lookups included, then raises
:class:`~kvproto.errors.MasterUnreachable` (counted in
``failover_counters["unreachable"]``) until a master serves one again. With a
coordinator the window is ``switch_window`` (10 s: the masters' leadership TTL,
2 s, plus a new master's fence timeout, 5 s, plus its recovery). Without one no
switch can happen and the window is ``lookup_timeout`` (2 s): a dead or wrong
master address fails the first call after 2 s. A ``put`` (or any other call)
waits for a silent master only that long too, not its whole ``timeout``: while
it waits the client probes the master with ``heartbeat`` requests, and a master
that answers them (its reply is parked on storage nodes) is waited for until
the call's deadline. A coordinator that cannot be reached while no master is
known raises :class:`~kvproto.errors.CoordinatorUnavailable`, at once if the
client never reached it. Addresses are checked when the client is made:
``tcp://host:port``, ``ipc://path``, ``etcd://host:port[/prefix]``,
``file:///dir`` (see :mod:`kvproto.runtime.endpoints`); anything else is
:class:`~kvproto.errors.InvalidArgument`.

Buffers: any C-contiguous bytes-like object (bytes, bytearray, memoryview,
numpy arrays) is sent as is; a non-contiguous one is copied once first. The
caller must not modify the buffer while ``put`` runs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any, Iterable, Optional

import zmq

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.endpoints import check_master, coordinator_url
from kvproto.runtime import datapath
from kvproto.runtime.client_leases import LEASE_COUNTERS, ClientLeases, ReadLease
from kvproto.runtime.client_link import ClientLink
from kvproto.runtime.client_puts import ClientPuts
from kvproto.runtime.client_tenants import TenantCalls
from kvproto.runtime.shm import WriterLock, host_id
from kvproto.statemachines import lease as lm
from kvproto.statemachines.failover import RecomputeLimiter

Key = Any  # bytes-like or str


def _as_key(key: Key) -> bytes:
    if isinstance(key, bytes):
        k = key
    elif isinstance(key, str):
        k = key.encode()
    elif isinstance(key, (bytearray, memoryview)):
        k = bytes(key)
    else:
        raise errors.InvalidArgument(f"a key must be bytes or str, not {type(key).__name__}")
    if not 1 <= len(k) <= wire.MAX_KEY_BYTES:
        raise errors.InvalidArgument(f"key length {len(k)} not in [1, {wire.MAX_KEY_BYTES}]")
    return k


def _as_keys(keys: list) -> list:
    """:func:`_as_key` of each key; a list of plain bytes keys of allowed
    lengths is checked in a few C passes and copied as it is."""
    if keys and set(map(type, keys)) == {bytes} \
            and 1 <= min(map(len, keys)) and max(map(len, keys)) <= wire.MAX_KEY_BYTES:
        return list(keys)
    return [_as_key(k) for k in keys]


def _as_view(data: Any) -> memoryview:
    """A flat byte view of ``data`` without copying (unless it is not contiguous);
    a :class:`~kvproto.runtime.datapath.Fill` stays as it is."""
    if isinstance(data, datapath.Fill):
        return data
    try:
        mv = memoryview(data)
    except TypeError:
        raise errors.InvalidArgument(f"value of type {type(data).__name__} is not bytes-like") from None
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if not mv.nbytes:
        raise errors.InvalidArgument("cannot put an empty object")
    return mv


def _destination(buffer):
    """Where a read lands: the caller's memory as a writable view, or a
    :class:`~kvproto.runtime.datapath.Consume` that moves the bytes itself."""
    return buffer if isinstance(buffer, datapath.Consume) else datapath.writable_view(buffer)


def put_retrying(client: "Client", key: Key, data: Any, within: float, *, replicas: int = 1,
                 pause: float = 0.0) -> float:
    """``client.put``, attempted again (after ``pause`` seconds) while it fails,
    e.g. while a standby master takes over, for up to ``within`` seconds; the
    last error is raised past that. Returns the seconds it took."""
    started = time.perf_counter()
    while True:
        try:
            client.put(key, data, replicas=replicas)
            return time.perf_counter() - started
        except errors.KvError:
            if time.perf_counter() - started > within:
                raise
            time.sleep(pause)


class Client(ClientLink, ClientLeases, ClientPuts, TenantCalls):
    """A connection to one kvproto master (and, on demand, its storage nodes)."""

    #: with a coordinator, how often (seconds) the client asks it who the master
    #: is, also while it waits for a silent master
    LEADER_RECHECK = 0.5

    def __init__(self, master: str, *, timeout: float = 30.0, local_reads: bool = True,
                 local_writes: bool = True,
                 context: Optional[zmq.Context] = None, leases: bool = True,
                 max_skew: float = 0.002, lease_budget: Optional[lm.LeaseBudget] = None,
                 lookup_timeout: float = 2.0, switch_window: float = 10.0,
                 recompute_rate: float = 100.0, recompute_burst: float = 100.0,
                 token: "str | bytes | None" = None, namespace: str = "default",
                 checksums: bool = True, batch: int = 4096, window: int = 4) -> None:
        if max_skew < 0:
            raise ValueError("max_skew must be >= 0")
        if not (isinstance(batch, int) and 1 <= batch <= wire.MAX_BATCH):
            raise errors.InvalidArgument(f"batch must be in [1, {wire.MAX_BATCH}], not {batch!r}")
        if not (isinstance(window, int) and window >= 1):
            raise errors.InvalidArgument(f"window must be a positive number of requests, not {window!r}")
        #: keys per master request: a call of more keys sends several, so that
        #: one request never holds the master's loop for long
        self.batch = batch
        #: lookups of one call (``exists_many``, ``get_many``) in flight at
        #: once: the master serves the next while this client reads an answer
        #: (above one, ``put_many`` also sends a chunk's put_start ahead)
        self.window = window
        #: requests sent ahead of their turn (``_send_ahead``: lookups in
        #: flight, a put's next put_start) by id: the reply when it was read
        #: while another request was awaited, else ``None``
        self._early: dict = {}
        for name, value in (("timeout", timeout), ("lookup_timeout", lookup_timeout),
                            ("switch_window", switch_window)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise errors.InvalidArgument(f"{name} must be a positive number of seconds, not {value!r}")
        #: ``master`` is the master's address (``tcp://host:port``,
        #: ``ipc://path``), or a coordinator URL (``etcd://host:port[/prefix]``,
        #: ``file:///dir``) through which the client finds the current master,
        #: and finds it again after a failover; anything else is InvalidArgument
        check_master(master)
        if token is not None and not (isinstance(token, (str, bytes)) and 0 < len(token) <= 1024):
            raise errors.InvalidArgument("token must be a non-empty str or bytes of at most "
                                         "1024 characters")
        if not isinstance(namespace, str) or not 0 < len(namespace) <= 129:
            raise errors.InvalidArgument("namespace must be a name (or owner/name)")
        #: the tenant's secret token (``kvproto tenant token``), sent as ``cred``
        #: with every request to the master and the storage nodes; private:
        #: never shown by ``repr`` nor logged
        self.__token = token.encode() if isinstance(token, str) else token
        #: the namespace this client's keys live in (``owner/name``: another
        #: tenant's, readable under its grant)
        self.namespace = namespace
        self._coordinator = None
        self._leader_checked = 0.0
        if coordinator_url(master):
            from kvproto.runtime.coordinator import connect
            self._coordinator = connect(master, create=False)
            master = ""
        #: a lookup unanswered this long is a miss (the master may be switching)
        self.lookup_timeout = float(lookup_timeout)
        #: with a coordinator: how long no master may serve this client (none
        #: named, the named one not open, or silent) before calls raise
        #: MasterUnreachable instead of missing; a switch takes the masters'
        #: leadership TTL (2 s by default) plus the new master's fence timeout
        #: (5 s) plus its recovery. Without a coordinator no switch can happen:
        #: the window is ``lookup_timeout``
        self.switch_window = float(switch_window)
        self._unserved_since: Optional[float] = None   # first call no master served
        self._coordinator_reached = False
        #: the engine's fall-back to recomputation, rate-limited (``may_recompute``)
        self.recompute = RecomputeLimiter(float(recompute_rate), float(recompute_burst))
        self.failover_counters = {"masters_found": 0, "switch_misses": 0, "stale_term_relookups": 0,
                                  "unreachable": 0, "recomputes_allowed": 0, "recomputes_refused": 0}
        #: gets take a read lease (and check it after the transfer); off: a pin
        self.leases = leases
        #: bound on this client's error measuring one read against the master's clock
        self.max_skew = float(max_skew)
        #: the phase budget rejections are classified against (default: the
        #: master's TTL split between queueing and transfer, see ``_budget``)
        self.lease_budget = lease_budget
        self.lease_counters: dict[str, float] = dict.fromkeys(LEASE_COUNTERS, 0)
        #: how each replica's bytes moved: written into a same-host segment by
        #: this client itself or sent to the node; read out of a same-host
        #: segment or over the network
        self.transfer_counters = dict.fromkeys(
            ("direct_writes", "network_writes", "local_reads", "network_reads"), 0)
        #: a put sends the checksum of each object's bytes with ``put_end``
        #: (one pass over them); off: objects are published with none
        self.checksums = bool(checksums)
        #: replicas read with ``verify=True``: bytes that match the checksum
        #: recorded at publish, that do not (ChecksumMismatch, or the next
        #: replica tried), and objects published without one (not checked)
        self.checksum_counters = dict.fromkeys(
            ("checksum_verified", "checksum_mismatches", "checksum_absent"), 0)
        #: phases of the last leased read (queued, transferring, verifying), seconds
        self.last_read: Optional[lm.ReadPhases] = None
        #: ``observe(op, seconds)`` after each round trip to a master (metrics; None: off)
        self.observe = None
        self.master = master
        self.timeout = float(timeout)
        self.local_reads = local_reads
        self.client_id = f"{socket.gethostname()[:40]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.RLock()
        self._rid = 0
        self._master_sock: Optional[zmq.Socket] = None
        self._data: dict[str, zmq.Socket] = {}
        self._pollers: dict[frozenset, zmq.Poller] = {}
        #: this host's storage segments, mapped for same-host reads, and for
        #: direct writes (spec/DirectWrite.tla) under this client's writer lock
        self._local = datapath.LocalSegments(host_id(), local_reads)
        #: the memory plain gets copy same-host objects into (reused once idle)
        self.read_buffers = datapath.ReadBuffers()
        self._writable = datapath.LocalSegments(host_id(), local_writes, writable=True)
        self._writer: Optional[WriterLock] = None
        #: ids of leases this client is done with, released with its next
        #: master request (a lease that outlives its read only protects longer)
        self._unreleased: list[int] = []
        self._closed = False
        # tracked writes (Timeout protocol): generation per write, cancelled on timeout
        self._put_owner = f"{self.client_id}/put"
        self._put_gen = 0
        self._engines: list = []
        # heartbeats
        self._active = 0
        self._active_lock = threading.Lock()
        self._hb_interval = 1.0
        #: tokens of the put attempts being written now; the heartbeats name
        #: them, and only a named attempt's deadline restarts at the master
        self._in_flight: tuple[int, ...] = ()
        self._hb_stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._release_now()
            self._closed = True
            for engine in self._engines:
                engine.close()
            self._engines.clear()
            self._hb_stop.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=5)
            if self._master_sock is not None:
                self._master_sock.close(linger=0)
                self._master_sock = None
            for sock in self._data.values():
                sock.close(linger=0)
            self._data.clear()
            self._local.close()
            self._writable.close()
            self.read_buffers.clear()
            if self._writer is not None:
                self._writer.close()
            if self._coordinator is not None:
                self._coordinator.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Client({self.master or 'coordinator'!r}, namespace={self.namespace!r}, "
                f"{'with' if self.__token else 'without'} a token)")

    def _stamped(self, op: str, body: dict) -> dict:
        """``body`` with this client's credential (and namespace, for an op
        naming keys), as every request carries them."""
        if self.__token is None and self.namespace == "default":
            return body
        body = dict(body)
        if self.__token is not None:
            body["cred"] = self.__token
        if self.namespace != "default" and op in wire.KEYED_OPS:
            body["ns"] = self.namespace
        return body

    def may_recompute(self) -> bool:
        """Whether the engine may recompute a missed block now: a token bucket
        (``recompute_rate`` per second, bursts of ``recompute_burst``) bounds
        the fall-back while lookups miss, e.g. during a master failover."""
        with self._lock:
            self.recompute, allowed = self.recompute.take(time.monotonic())
        self.failover_counters["recomputes_allowed" if allowed else "recomputes_refused"] += 1
        return allowed

    # ------------------------------------------------------------------ put

    def put(self, key: Key, data: Any, replicas: int = 1, *, timeout: Optional[float] = None) -> None:
        """Store ``data`` under ``key`` on ``replicas`` storage nodes. ``data``
        is bytes-like, or a :class:`~kvproto.runtime.datapath.Fill` that
        produces the bytes straight into their destination (a GPU's DMA into
        a same-host segment)."""
        err = self._put_batch([(key, data)], replicas, timeout)[0]
        if err is not None:
            raise err

    def put_many(self, items: Iterable[tuple[Key, Any]], replicas: int = 1, *,
                 timeout: Optional[float] = None) -> list[Optional[errors.KvError]]:
        """Store several objects; returns per key ``None`` (stored) or the error."""
        return self._put_batch(list(items), replicas, timeout)

    def _put_batch(self, items: list, replicas: int, timeout: Optional[float]) -> list:
        deadline = self._deadline(timeout)
        results: list[Optional[errors.KvError]] = [None] * len(items)
        if type(replicas) is not int or not 1 <= replicas <= wire.MAX_REPLICAS:
            raise errors.InvalidArgument(f"replicas must be an int in [1, {wire.MAX_REPLICAS}]")
        todo: list[tuple[int, bytes, memoryview]] = []
        for i, (key, data) in enumerate(items):
            try:
                todo.append((i, _as_key(key), _as_view(data)))
            except errors.KvError as err:
                results[i] = err
        self._put_chunks(todo, replicas, deadline, results)
        return results

    # ------------------------------------------------------------------ get

    def get(self, key: Key, *, timeout: Optional[float] = None, verify: bool = False) -> memoryview:
        """The bytes stored under ``key``; raises ``KeyNotFound`` on a miss.

        ``verify=True`` hashes the bytes after the copy and compares them with
        the checksum the writer recorded at publish: a replica that differs
        is counted (``checksum_counters``) and the next one tried; when none
        matches, ``ChecksumMismatch`` is raised. Off by default: it is one
        more pass over every byte read (see docs/protocols/publish.md)."""
        return self._get_batch([key], self._deadline(timeout), raise_miss=True, verify=verify)[0]

    def get_many(self, keys: Iterable[Key], *, timeout: Optional[float] = None,
                 verify: bool = False) -> list[Optional[memoryview]]:
        """The bytes of each key, ``None`` for a miss (other failures raise;
        ``verify`` as for :meth:`get`)."""
        return self._get_chunks(list(keys), self._deadline(timeout), None, verify)

    def get_into(self, key: Key, buffer, *, timeout: Optional[float] = None,
                 verify: bool = False):
        """Read ``key`` into ``buffer`` and return the number of bytes read.

        ``buffer`` is the caller's memory (``bytearray``, a writable
        ``memoryview``, a NumPy array, a CPU tensor; pinned or not) at least as
        large as the object: a same-host replica is copied into it with one
        memcpy, a remote one with one copy out of the received frame. A miss
        raises ``KeyNotFound``; a read whose lease may have expired in flight
        raises ``LeaseExpired`` (the buffer's contents are then undefined).

        A :class:`~kvproto.runtime.datapath.Consume` moves the bytes itself
        (a GPU's DMA straight out of a same-host segment, then a scatter), under
        the same checks. A :class:`~kvproto.runtime.transfers.PoolBuffer` of
        this client's transfer engine is loaded through the engine instead
        (its timeout quarantines the buffer until the load drains), and
        returned. ``verify`` as for :meth:`get`, checked in ``buffer`` after
        the copy (not for a ``Consume`` nor a transfer engine's buffer:
        ``InvalidArgument``)."""
        engine = getattr(buffer, "engine", None)
        if engine is not None:
            if verify:
                raise errors.InvalidArgument("verify=True needs the bytes in host memory; "
                                             "a transfer engine's load is not verified")
            if engine not in self._engines:
                raise errors.InvalidArgument(f"buffer {buffer!r} is not from a transfer engine of this client")
            from kvproto.runtime.transfers import EngineRequest
            return EngineRequest(engine, buffer.request).get_into(key, buffer, timeout=timeout)
        return self._get_batch([key], self._deadline(timeout), raise_miss=True,
                               into=[_destination(buffer)], verify=verify)[0]

    def get_many_into(self, keys: Iterable[Key], buffers: Iterable, *,
                      timeout: Optional[float] = None, verify: bool = False) -> list[Optional[int]]:
        """:meth:`get_into` for several keys, one buffer each: per key the
        number of bytes read, or ``None`` for a miss (other failures raise)."""
        keys, views = list(keys), [_destination(b) for b in buffers]
        if len(keys) != len(views):
            raise errors.InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
        return self._get_chunks(keys, self._deadline(timeout), views, verify)

    #: lease ids held back before they are released on their own
    RELEASE_BATCH = 1024

    def _get_chunks(self, keys: list, deadline: float, into: Optional[list],
                    verify: bool) -> list:
        """``get_many`` (into ``into``'s buffers if given): :meth:`_get_batch`
        of each ``batch`` keys, their lookups in flight ``window`` at a time
        (:meth:`~kvproto.runtime.client_link.ClientLink._lookups`). After a
        failure no further lookup is sent, and the leases and pins of those
        already answered are let go unread; then it raises."""
        if len(keys) <= self.batch:
            return self._get_batch(keys, deadline, False, into=into, verify=verify)
        self._check_into(into, verify)
        n = self.batch
        chunks = [_as_keys(keys[at:at + n]) for at in range(0, len(keys), n)]
        out: list = []
        failed: list = []

        def bodies():
            for ks in chunks:
                if failed:
                    return
                yield self._read_body(ks), len(ks)
        with self._lock, self._activity():
            for at, (reply, sent) in enumerate(self._lookups("read_begin", bodies(), deadline)):
                ks = chunks[at]
                if failed:
                    if reply is not None:
                        self._let_go(ks, wire.read_columns(reply, len(ks)))
                    continue
                try:
                    out.extend(self._read_reply(ks, reply, sent, deadline, False, True,
                                                None if into is None else into[at * n:at * n + n],
                                                verify))
                except errors.KvError as err:
                    failed.append(err)
        if failed:
            raise failed[0]
        return out

    def _check_into(self, into: Optional[list], verify: bool) -> None:
        if verify and into is not None and any(isinstance(d, datapath.Consume) for d in into):
            raise errors.InvalidArgument("verify=True needs the bytes in host memory; a Consume "
                                         "moves them itself")

    def _get_batch(self, keys: list, deadline: float, raise_miss: bool,
                   relookup: bool = True, into: Optional[list] = None,
                   verify: bool = False) -> list:
        """One lookup and read of ``keys`` (into ``into``'s buffers if given)."""
        if not keys:
            return []
        self._check_into(into, verify)
        ks = _as_keys(keys)
        with self._lock, self._activity():
            sent = time.monotonic()            # the lease deadline runs from here
            reply = self._lookup("read_begin", self._read_body(ks), len(ks), deadline)
            return self._read_reply(ks, reply, sent, deadline, raise_miss, relookup, into, verify)

    def _read_body(self, ks: list) -> dict:
        """A ``read_begin`` of ``ks``, carrying the lease releases held back."""
        body = {"client": self.client_id, "keys": ks, "columns": True}
        if self.leases:
            body["lease"] = True
        if self._unreleased:
            body["release"] = self._take_releases()
        return body

    def _read_reply(self, ks: list, reply: Optional[wire.Reply], sent: float, deadline: float,
                    raise_miss: bool, relookup: bool, into: Optional[list],
                    verify: bool) -> list:
        """The read of ``ks`` after its lookup's ``reply`` (sent at ``sent``). A
        lookup the master cannot answer (it is switching: not open, silent past
        ``lookup_timeout``; ``reply`` None) is a miss for every key; a replica
        that refuses a descriptor's stale term is looked up again once (at the
        new master), then missed. The leases it took are released with the
        client's next lookup (or :meth:`_release_now`)."""
        results: list = [None] * len(ks)
        if reply is None:
            if raise_miss:
                raise errors.KeyNotFound(f"{ks[0]!r}: a miss while the master switches")
            return results
        self._note_interval(reply)
        term = reply.body.get("term", 0)
        segments = reply.body.get("segments", {})
        grants = wire.read_columns(reply, len(ks))
        leases = grants.get("lease")
        first_error: Optional[errors.KvError] = None
        for i, code, message in grants["errors"]:
            err = errors.from_wire(code, message)
            if raise_miss or not isinstance(err, errors.KeyNotFound):
                first_error = first_error or err
        try:
            started = time.monotonic()
            done_at: dict[int, float] = {}
            errs = datapath.read_all(self, ks, grants, segments, deadline, results, done_at,
                                     term, into, verify)
            stale = [i for i in sorted(errs) if isinstance(errs[i], errors.StaleTerm)]
            if stale:
                # the descriptor's master was replaced: look up again (once)
                self.failover_counters["stale_term_relookups"] += len(stale)
                self._find_master()
                again = self._get_batch(
                    [ks[i] for i in stale], deadline, False, relookup=False,
                    into=None if into is None else [into[i] for i in stale],
                    verify=verify) if relookup else [None] * len(stale)
                for i, got in zip(stale, again):
                    results[i] = got
                    del errs[i]
                    if got is None and raise_miss:
                        first_error = first_error or errors.KeyNotFound(f"{ks[i]!r}")
            for i in sorted(errs):
                first_error = first_error or errs[i]
            # a key read again was judged by its second read's own lease
            if leases:
                first_error = self._check_leases(ks, leases, float(grants["ttl"]), sent,
                                                 started, done_at, results,
                                                 set(stale)) or first_error
        finally:
            self._let_go(ks, grants)
        if first_error is not None:
            raise first_error
        return results

    def _let_go(self, ks: list, grants: dict) -> None:
        """Release what a lookup's ``grants`` hold once their reads are done
        (or will not be made): leases with the next lookup, pins with
        ``read_end`` (fire-and-forget: its reply is dropped by a later
        ``_gather``)."""
        leases = grants.get("lease")
        if leases is not None:
            self._unreleased.extend(filter(None, leases))
        pins = [] if leases is not None else \
            [[ks[i], token] for i, token in enumerate(grants["token"]) if token]
        try:
            if pins:
                self._send(self._master(), "read_end", {"client": self.client_id, "items": pins})
            if len(self._unreleased) >= self.RELEASE_BATCH:
                self._release_now()
        except (errors.KvError, zmq.ZMQError):
            pass

    # ------------------------------------------------------------------ transfer engine

    def transfer_engine(self, buffers: int = 16, buffer_size: int = 64 << 10, **kwargs: Any):
        """A new :class:`~kvproto.runtime.transfers.TransferEngine` over a pool of
        ``buffers`` host buffers of ``buffer_size`` bytes (closed with the client).
        Keyword arguments: ``max_cancels``, ``max_leaked``, ``cancel_interval``,
        ``memory`` (host memory to slice the buffers from)."""
        from kvproto.runtime.transfers import TransferEngine
        if self._closed:
            raise errors.ServerUnavailable("the client is closed")
        engine = TransferEngine(self, buffers, buffer_size, **kwargs)
        self._engines.append(engine)
        return engine

    # ------------------------------------------------------------------ the rest

    def exists(self, key: Key, *, timeout: Optional[float] = None) -> bool:
        """Whether ``key`` names a published object."""
        return self.exists_many([key], timeout=timeout)[0]

    def exists_many(self, keys: Iterable[Key], *, timeout: Optional[float] = None) -> list[bool]:
        ks = [_as_key(k) for k in keys]
        deadline = self._deadline(timeout)
        out: list[bool] = []
        chunks = [ks[at:at + self.batch] for at in range(0, len(ks), self.batch)]
        with self._lock:
            for chunk, (reply, _) in zip(chunks, self._lookups(
                    "exists", (({"keys": c, "found": True}, len(c)) for c in chunks), deadline)):
                out.extend([False] * len(chunk) if reply is None
                           else wire.found_of(reply, len(chunk)))
        return out

    def keys(self, prefix: Key = b"", *, page: int = 4096,
             timeout: Optional[float] = None) -> list[bytes]:
        """Every published key that starts with ``prefix``, in key order, fetched
        from the master ``page`` keys per request (a listing, not a snapshot:
        keys published or removed meanwhile may or may not appear)."""
        prefix = _as_key(prefix) if prefix else b""
        if not 1 <= page <= wire.MAX_BATCH:
            raise errors.InvalidArgument(f"page must be in [1, {wire.MAX_BATCH}], not {page}")
        deadline = self._deadline(timeout)
        out: list[bytes] = []
        with self._lock:
            while True:
                body = {"limit": page, "prefix": prefix, "after": out[-1] if out else b""}
                reply = self._call_master("list", body, deadline)
                out.extend(reply.body["keys"])
                if not reply.body["more"]:
                    return out

    # ------------------------------------------------------------------ leases (low level)

    def read_begin(self, keys: Iterable[Key], *, timeout: Optional[float] = None
                   ) -> list[Optional[ReadLease]]:
        """Take a read lease per key (``None`` for a miss) without reading; the
        caller reads, may :meth:`renew`, must :meth:`release`, and must judge its
        transfer with ``kvproto.statemachines.lease.accept_transfer(lease.sent,
        completed, lease.ttl, client.max_skew)``."""
        ks = [_as_key(k) for k in keys]
        with self._lock:
            sent = time.monotonic()
            reply = self._call_master("read_begin", {"client": self.client_id, "keys": ks,
                                                     "lease": True}, self._deadline(timeout))
            segments = reply.body.get("segments", {})
            out: list[Optional[ReadLease]] = []
            for k, item in zip(ks, wire.items_of(reply, len(ks))):
                err, g = wire.item_result(item)
                if err is not None:
                    if not isinstance(err, errors.KeyNotFound):
                        raise err
                    out.append(None)
                    continue
                out.append(ReadLease(k, g["lease"], float(g["ttl"]), sent, g["token"],
                                     g["length"], list(g["replicas"]), segments,
                                     g.get("tickets")))
            return out

    def remove(self, key: Key, *, force: bool = False, timeout: Optional[float] = None) -> None:
        """Delete a published object (``KeyNotFound``, ``NotPublished``,
        ``ObjectBusy``, ``ObjectLeased``). ``force=True`` (operators) ends the
        object's read leases first; the master logs it."""
        err = self.remove_many([key], force=force, timeout=timeout)[0]
        if err is not None:
            raise err

    def remove_many(self, keys: Iterable[Key], *, force: bool = False,
                    timeout: Optional[float] = None) -> list[Optional[errors.KvError]]:
        """:meth:`remove` of each key, ``batch`` keys a request: per key
        ``None`` (removed) or the error it was refused with (a request no
        master served raises, as for :meth:`remove`)."""
        ks = [_as_key(k) for k in keys]
        deadline = self._deadline(timeout)
        out: list[Optional[errors.KvError]] = []
        with self._lock:
            for at in range(0, len(ks), self.batch):
                body: dict = {"keys": ks[at:at + self.batch]}
                if force:
                    body["force"] = True
                reply = self._call_master("remove", body, deadline)
                out.extend(wire.item_result(item)[0]
                           for item in wire.items_of(reply, len(body["keys"])))
        return out

    def stats(self, *, timeout: Optional[float] = None) -> dict:
        """The master's counters and per-segment space, and under ``"client"``
        this client's lease counters (reads checked, accepted, rejected by
        reason, renewals, releases, time queued/transferring/verifying)."""
        with self._lock:
            body = dict(self._call_master("stats", {}, self._deadline(timeout)).body)
            body["client"] = dict(self.lease_counters)
            return body
