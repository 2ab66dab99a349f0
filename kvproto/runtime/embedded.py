"""Run a whole store in this process, or one server per process.

:func:`embedded` starts a master and ``storage_nodes`` storage nodes, each in a
background thread of this process with its own ZeroMQ context, talking over
real TCP sockets on 127.0.0.1 with free ports (``transport="ipc"`` uses Unix
sockets in a temporary directory instead). Data never uses ``inproc``: an
inproc zero-copy read reply would alias the storage segment itself.

:func:`run_master` and :func:`run_storage` are what ``kvproto master`` and
``kvproto storage`` call: they serve in the calling thread until SIGINT or
SIGTERM (or until ``stop`` is set), then shut down cleanly (a storage node
deregisters and unlinks its shared memory). Both print one line,
``kvproto <role> listening on <endpoint>``, to stdout once they serve, so a
parent process can learn a port picked with ``tcp://127.0.0.1:*`` (with
``metrics_port``, a line ``kvproto <role> metrics on <url>`` comes first). A storage
node prints a second line once it has registered with its master and can be
given objects (puts before it get ``NoStorage``)::

    kvproto storage ready: segment <id>, <size> at <endpoint>, master <address> (term <n>)

A storage node the master refused for good (see :mod:`kvproto.runtime.storage`)
stops, and :func:`run_storage` raises the master's error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from kvproto.ops.tenants import load_tenants
from kvproto.runtime.client import Client
from kvproto.runtime.master_server import MasterServer
from kvproto.runtime.storage_server import StorageServer
from kvproto.runtime.units import format_size, parse_size

log = logging.getLogger("kvproto.embedded")


class ServerThread(threading.Thread):
    """Builds a server inside the thread (sockets stay in the thread that made them)."""

    def __init__(self, name: str, factory) -> None:
        super().__init__(name=name, daemon=True)
        self._factory = factory
        self.server: Any = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            self.server = self._factory()
        except BaseException as exc:
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            self.server.serve_forever()
        except BaseException:  # pragma: no cover - logged, the thread ends
            log.exception("%s crashed", self.name)

    def start_and_wait(self, timeout: float = 30.0) -> Any:
        self.start()
        if not self.ready.wait(timeout):
            raise RuntimeError(f"{self.name} did not start")
        if self.error is not None:
            raise self.error
        return self.server

    def stop(self, timeout: float = 10.0) -> None:
        if self.server is not None:
            self.server.stop()
        self.join(timeout)


class EmbeddedCluster:
    """A master and storage nodes running in threads of this process."""

    def __init__(self, storage_nodes: int = 2, segment_size: "int | str" = "256MiB", *,
                 writer_timeout: float = 10.0, storage_timeout: float = 10.0,
                 page_size: int = 4096, transport: str = "tcp", client_timeout: float = 30.0,
                 start_timeout: float = 30.0, storage_debug: bool = False,
                 lease_ttl: float = 5.0, high_watermark: float = 0.90,
                 free_fraction: float = 0.05, metrics: bool = False, tenants=None) -> None:
        if storage_nodes < 0:
            raise ValueError("storage_nodes must be >= 0")
        if transport not in ("tcp", "ipc"):
            raise ValueError("transport must be 'tcp' or 'ipc'")
        self.segment_size = parse_size(segment_size)
        self.client_timeout = client_timeout
        self._tmpdir = tempfile.mkdtemp(prefix="kvproto-") if transport == "ipc" else None
        self._clients: list[Client] = []
        self._threads: list[ServerThread] = []
        self.storage: list[StorageServer] = []
        #: with ``metrics``: where each server's (and the clients') Prometheus
        #: metrics are served: ``{"master": url, "storage-0": url, ..., "clients": url}``
        self.metrics_urls: dict[str, str] = {}
        self._exporters: list = []
        self._client_metrics = None
        self._stopped = False
        if isinstance(tenants, (str, os.PathLike)):
            tenants = load_tenants(tenants)
        tenants = tuple(tenants or ())
        #: the ticket key the master and the nodes share (with tenants)
        ticket_key = secrets.token_hex(32).encode() if tenants else None
        try:
            master_listen = self._endpoint("master")
            mt = ServerThread("kvproto-master", lambda: MasterServer(
                master_listen, writer_timeout=writer_timeout, storage_timeout=storage_timeout,
                lease_ttl=lease_ttl, high_watermark=high_watermark, free_fraction=free_fraction,
                tenants=tenants, ticket_key=ticket_key))
            self._threads.append(mt)
            self.master: MasterServer = mt.start_and_wait(start_timeout)
            self.master_address: str = self.master.address
            for n in range(storage_nodes):
                listen = self._endpoint(f"storage{n}")
                st = ServerThread(f"kvproto-storage-{n}", lambda listen=listen: StorageServer(
                    self.master_address, self.segment_size, listen=listen, page_size=page_size,
                    debug=storage_debug, tenants=tenants, ticket_key=ticket_key))
                self._threads.append(st)
                self.storage.append(st.start_and_wait(start_timeout))
            for node in self.storage:
                deadline = time.monotonic() + start_timeout
                while not node.registered.wait(0.05):
                    if node.refused is not None:
                        raise node.refused
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"storage node {node.endpoint} did not register")
            if metrics:
                self._serve_metrics()
        except BaseException:
            self.stop()
            raise

    def _serve_metrics(self) -> None:
        """Each server's metrics, and the clients', on free loopback ports."""
        from kvproto.ops import metrics
        named = [("master", metrics.serve_master, self.master)]
        named += [(f"storage-{n}", metrics.serve_storage, node) for n, node in enumerate(self.storage)]
        for name, serve, server in named:
            exporter = serve(server)
            self._exporters.append(exporter)
            self.metrics_urls[name] = exporter.url
        self._client_metrics = metrics.ClientCollector()
        exporter = metrics.serve_clients(self._client_metrics)
        self._exporters.append(exporter)
        self.metrics_urls["clients"] = exporter.url

    def _endpoint(self, name: str) -> str:
        if self._tmpdir is not None:
            return f"ipc://{os.path.join(self._tmpdir, name)}"
        return "tcp://127.0.0.1:*"

    def client(self, **kwargs: Any) -> Client:
        """A new client of this cluster (closed by :meth:`stop`)."""
        kwargs.setdefault("timeout", self.client_timeout)
        c = Client(self.master_address, **kwargs)
        self._clients.append(c)
        if self._client_metrics is not None:
            self._client_metrics.add(c)
        return c

    def stats(self) -> dict:
        with self.client() as c:
            return c.stats()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for c in self._clients:
            c.close()
        self._clients.clear()
        for exporter in self._exporters:
            exporter.close()
        self._exporters.clear()
        # storage nodes first (they deregister with the master), then the master
        for t in reversed(self._threads):
            t.stop()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def embedded(storage_nodes: int = 2, segment_size: "int | str" = "256MiB", **kwargs: Any) -> EmbeddedCluster:
    """Start a store in this process; use as a context manager (or call ``stop()``).

    Keyword arguments: ``writer_timeout``, ``storage_timeout`` (seconds, default
    10), ``page_size`` (allocation granularity, default 4096), ``transport``
    (``"tcp"`` or ``"ipc"``), ``client_timeout`` (default per-call timeout of
    clients made by ``.client()``), ``storage_debug`` (storage nodes accept the
    test-only ``debug`` fault-injection op; off by default), ``lease_ttl``
    (seconds, default 5), ``high_watermark`` / ``free_fraction`` (the master's
    eviction policy, default 0.90 / 0.05), ``metrics`` (serve Prometheus
    metrics of the master, each storage node and the clients made by
    ``.client()`` on free loopback ports, listed in ``.metrics_urls``; off by
    default; needs ``prometheus_client``), ``tenants`` (a tenants file's path,
    or its parsed tenants: every request must carry a tenant's token, given as
    ``.client(token=...)``; default: none).
    """
    return EmbeddedCluster(storage_nodes, segment_size, **kwargs)


@contextlib.contextmanager
def _until_signalled(server):
    """SIGINT/SIGTERM stop ``server`` while serving (main thread only).

    The handler only sets the server's stop flag: it must not take a lock, as a
    second signal (``timeout`` sends SIGTERM to the child *and* to its process
    group) can run it again in the middle of the first one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        server.stop()
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _metrics(server, role: str, port: Optional[int], host: str):
    """Serve ``server``'s metrics on ``host:port`` (``None``: not at all) and
    say where, before the ``listening`` line."""
    if port is None:
        return None
    from kvproto.ops import metrics
    exporter = (metrics.serve_master if role == "master" else metrics.serve_storage)(server, port, host)
    print(f"kvproto {role} metrics on {exporter.url}", flush=True)
    return exporter


def _serve(server, role: str, stop: Optional[threading.Event], log_level: "str | int") -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, stream=sys.stderr,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    done = threading.Event()
    if stop is not None:
        def watch():
            while not done.is_set():
                if stop.wait(0.1):
                    server.stop()
                    return
        threading.Thread(target=watch, daemon=True, name=f"kvproto-{role}-stop").start()
    if role == "storage":
        server.on_registered = _say_ready
    with _until_signalled(server):
        print(f"kvproto {role} listening on {server.address if role == 'master' else server.endpoint}",
              flush=True)
        try:
            server.serve_forever()
        finally:
            done.set()
    if getattr(server, "refused", None) is not None:
        raise server.refused


def _say_ready(server: StorageServer) -> None:
    """The storage node's ``ready`` line, once: its first registration."""
    server.on_registered = None
    print(f"kvproto storage ready: segment {server.segment}, "
          f"{format_size(server.memory.capacity)} at {server.endpoint}, "
          f"master {server.master} (term {server.core.term})", flush=True)


def run_master(listen: str = "tcp://127.0.0.1:5555", *, writer_timeout: float = 10.0,
               storage_timeout: float = 10.0, stop: Optional[threading.Event] = None,
               log_level: "str | int" = "WARNING", metrics_port: Optional[int] = None,
               metrics_host: str = "127.0.0.1", **kwargs: Any) -> None:
    """Serve a master on ``listen`` until SIGINT/SIGTERM (or ``stop`` is set).

    ``log_level`` applies when the process has no logging configured yet (it
    logs to stderr; ``INFO`` shows segments joining and leaving).
    ``metrics_port`` (0: a free one) serves Prometheus metrics on
    ``metrics_host``. Other keyword arguments go to
    :class:`~kvproto.runtime.master_server.MasterServer` (``max_header_bytes``)."""
    server = MasterServer(listen, writer_timeout=writer_timeout, storage_timeout=storage_timeout,
                          **kwargs)
    try:
        exporter = _metrics(server, "master", metrics_port, metrics_host)
    except BaseException:
        server.close()
        raise
    try:
        _serve(server, "master", stop, log_level)
    finally:
        if exporter is not None:
            exporter.close()


def run_storage(master: str, size: "int | str", *, listen: str = "tcp://127.0.0.1:*",
                advertise: Optional[str] = None, page_size: int = 4096,
                stop: Optional[threading.Event] = None, log_level: "str | int" = "WARNING",
                metrics_port: Optional[int] = None, metrics_host: str = "127.0.0.1",
                **kwargs: Any) -> None:
    """Serve one storage segment of ``size`` bytes for ``master`` until SIGINT/SIGTERM.

    ``listen`` is the data endpoint to bind; ``advertise`` is the endpoint clients
    and the master should connect to (default: the bound one; set it when
    binding ``0.0.0.0``). ``page_size`` is the allocation granularity (a power of
    two >= 512). ``metrics_port`` (0: a free one) serves Prometheus metrics on
    ``metrics_host``. Other keyword arguments go to
    :class:`~kvproto.runtime.storage_server.StorageServer` (``max_header_bytes``,
    ``register_timeout``).
    """
    server = StorageServer(master, size, listen=listen, advertise=advertise,
                           page_size=page_size, **kwargs)
    try:
        exporter = _metrics(server, "storage", metrics_port, metrics_host)
    except BaseException:
        server.close()
        raise
    try:
        _serve(server, "storage", stop, log_level)
    finally:
        if exporter is not None:
            exporter.close()
