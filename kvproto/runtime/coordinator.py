"""Master election and storage-node membership.

One master (the directory) is active at a time; standby masters wait. A
:class:`Coordinator` hands out strictly increasing *terms*: a master that wins
:meth:`~Coordinator.campaign` gets a term higher than every term issued before,
and keeps its leadership only while it renews the lease (:meth:`~Coordinator.keepalive`)
within ``ttl``. A master that stops renewing (crash, SIGSTOP) loses the lease and
a standby may win with a higher term; the old master learns it from ``keepalive``
returning False and must step down.

Storage nodes register ``segment -> endpoint`` under the same kind of lease
(:meth:`~Coordinator.register_node`, refreshed every ``ttl/4``) so a new master
finds every live node with :meth:`~Coordinator.nodes`.

Every call is a plain blocking call; the coordinator runs no threads. Callers
renew and poll themselves (standbys poll :meth:`~Coordinator.leader` or
:meth:`~Coordinator.campaign`). A master should treat its leadership as lost
``ttl`` after the start of its last successful ``keepalive``, whatever the
coordinator says later.

Two backends, chosen by :func:`connect`:

* ``file:///abs/dir`` — :class:`FileCoordinator`, embedded, processes on one host.
* ``etcd://host:port[/prefix]`` — :class:`EtcdCoordinator`, multi-host.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional

import etcd3gw
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease

from kvproto.errors import CoordinatorUnavailable, InvalidArgument


class Coordinator(ABC):
    """Master election (terms under a lease) and live storage-node membership."""

    ttl: float  # lease TTL in seconds
    url: str

    @abstractmethod
    def campaign(self, address: str) -> Optional[int]:
        """One attempt: if no master holds an unexpired leadership, become the leader
        with a new term strictly greater than every term issued before (by any
        process) and record ``address`` as the master's address; return the term.
        Else None."""

    @abstractmethod
    def keepalive(self, term: int) -> bool:
        """Renew our leadership of ``term``; False if ``term`` is no longer the current
        leadership (expired and/or another term was issued) — the caller must step down."""

    @abstractmethod
    def resign(self, term: int) -> None:
        """Give up leadership of ``term`` (if still held) so a standby can win at once."""

    @abstractmethod
    def leader(self) -> Optional[tuple[int, str]]:
        """The current ``(term, address)`` with an unexpired leadership, or None."""

    @abstractmethod
    def register_node(self, segment: str, endpoint: str) -> None:
        """Register or refresh (idempotent; call it every ttl/4) a storage node."""

    @abstractmethod
    def drop_node(self, segment: str) -> None:
        """Remove a storage node's registration at once."""

    @abstractmethod
    def nodes(self) -> dict[str, str]:
        """Live (unexpired) storage nodes: segment -> endpoint."""

    @abstractmethod
    def close(self) -> None:
        """Release local resources. Leases are not given up: they expire on their own."""


def connect(url: str, ttl: float = 2.0, *, create: bool = True) -> Coordinator:
    """``file:///abs/dir`` -> :class:`FileCoordinator`, ``etcd://host:port[/prefix]``
    -> :class:`EtcdCoordinator`. Anything else raises :class:`InvalidArgument`.
    Nothing is contacted yet: an unreachable etcd shows on the first call.
    ``create=False`` (clients, which only read who the master is) never
    creates a ``file://`` directory; a missing one shows on the first call as
    :class:`CoordinatorUnavailable`."""
    if not (isinstance(ttl, (int, float)) and ttl > 0 and math.isfinite(ttl)):
        raise InvalidArgument(f"coordinator ttl must be a positive number, not {ttl!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidArgument(f"bad coordinator url {url!r}: {e}") from None
    if parts.query or parts.fragment:
        raise InvalidArgument(f"bad coordinator url {url!r}: no query or fragment allowed")
    if parts.scheme == "file":
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/") or path == "/":
            raise InvalidArgument(f"bad coordinator url {url!r}: expected file:///absolute/dir")
        return FileCoordinator(path, ttl, create=create)
    if parts.scheme == "etcd":
        if not parts.hostname or port is None:
            raise InvalidArgument(f"bad coordinator url {url!r}: expected etcd://host:port[/prefix]")
        prefix = parts.path.rstrip("/") or "/kvproto"
        return EtcdCoordinator(parts.hostname, port, prefix, ttl)
    raise InvalidArgument(f"bad coordinator url {url!r}: scheme must be file or etcd")


# --- one host: a directory --------------------------------------------------

#: bytes a file coordinator's record is padded to (with spaces, which JSON
#: ignores), so that renewing it in place keeps the file's size
RECORD = 256


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class FileCoordinator(Coordinator):
    """Coordinator state in a directory shared by the processes of one host.

    * ``lock`` — held with ``flock`` around each short read-modify-write.
    * ``state.json`` — ``{term, address, expires, boot}``: replaced atomically
      (and synced) when the term or the leader changes, written over in place
      when a keepalive renews it.
    * ``nodes/<quoted segment>.json`` — ``{segment, endpoint, expires, boot}``,
      written over in place when the node refreshes it.

    A renewal writes in place because replacing a file (a new file, a rename)
    waits on the file system's journal: beside a whole test suite on a 2-core
    machine, replacing renewals have taken up to 1.14 s (longer than a 1 s
    lease) and in-place ones 34 ms at most (``bench/renewals.py``). Records
    are padded with spaces to :data:`RECORD` bytes, so a renewal keeps the
    file's size; a record of usual length lies within the first 512 bytes,
    one disk sector, which a disk writes whole, so a crash during a renewal
    leaves the old record or the new one on disk.

    ``expires`` is ``time.monotonic()`` time, which Linux shares between the
    processes of one boot; records written under another boot count as expired.
    Leadership is the lease in ``state.json``, never a held lock, so a paused
    master loses it after ``ttl``. The term counter never goes down (resign keeps
    it) as long as the directory is kept.
    A process stopped *inside* one of those short critical sections (not between
    calls) holds the lock until it resumes or dies, and blocks the others meanwhile.

    Masters and storage nodes create the directory (``create=True``); a client
    only reads :meth:`leader` and creates nothing: a directory that does not
    exist raises :class:`CoordinatorUnavailable` there.
    """

    def __init__(self, directory: str, ttl: float = 2.0, *, create: bool = True) -> None:
        self.ttl = float(ttl)
        self.url = "file://" + urllib.parse.quote(directory)
        self._dir = directory
        self._state = os.path.join(directory, "state.json")
        self._nodes = os.path.join(directory, "nodes")
        if create:
            os.makedirs(self._nodes, exist_ok=True)
        self._boot = _boot_id()
        self._mutex = threading.Lock()
        self._lockf: Optional[Any] = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex:
            if self._lockf is None:
                os.makedirs(self._nodes, exist_ok=True)
                self._lockf = open(os.path.join(self._dir, "lock"), "a+")
            fcntl.flock(self._lockf.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lockf.fileno(), fcntl.LOCK_UN)

    def _live(self, rec: dict[str, Any], now: float) -> bool:
        return rec.get("boot") == self._boot and rec.get("expires", 0) > now

    @staticmethod
    def _read(path: str) -> Optional[dict[str, Any]]:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    @staticmethod
    def _write(path: str, rec: dict[str, Any], sync: bool = False) -> None:
        """Replace the record at ``path`` by ``rec`` atomically (a new file renamed over it)."""
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(json.dumps(rec).encode().ljust(RECORD))
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    @staticmethod
    def _renew(path: str, rec: dict[str, Any]) -> None:
        """Write ``rec`` over the record at ``path`` in place (one ``pwrite``,
        padded with spaces to the file's size), or as :meth:`_write` where
        there is none. Called under the lock, which every other writer and
        reader holds too, except :meth:`leader` (:meth:`_read_settled`)."""
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            FileCoordinator._write(path, rec)
            return
        try:
            data = json.dumps(rec).encode()
            os.pwrite(fd, data.ljust(max(os.fstat(fd).st_size, RECORD)), 0)
        finally:
            os.close(fd)

    @staticmethod
    def _read_settled(path: str) -> Optional[dict[str, Any]]:
        """The record at ``path``, read without the lock (a client must not
        wait on a master stopped inside it): read again until two reads
        agree, since a renewal writing it in place may be read half done.
        Such a renewal changes only ``expires`` (the term and the address
        before it stay as they are), so even a read that agreed with a
        half-done one could misjudge only whether the lease has run out."""
        last = None
        for _ in range(100):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return None
            if data == last:
                break
            last = data
        try:
            return json.loads(last)
        except ValueError:          # no two reads agreed, the last one half done
            return None

    def _read_state(self) -> dict[str, Any]:
        return self._read(self._state) or {"term": 0, "address": "", "expires": 0, "boot": self._boot}

    def campaign(self, address: str) -> Optional[int]:
        with self._locked():
            st = self._read_state()
            now = time.monotonic()
            if self._live(st, now):
                return None
            term = int(st["term"]) + 1
            self._write(self._state, {"term": term, "address": address,
                                      "expires": now + self.ttl, "boot": self._boot}, sync=True)
            return term

    def keepalive(self, term: int) -> bool:
        with self._locked():
            st = self._read_state()
            now = time.monotonic()
            if st["term"] != term or not self._live(st, now):
                return False
            st["expires"] = now + self.ttl
            self._renew(self._state, st)
            return True

    def resign(self, term: int) -> None:
        with self._locked():
            st = self._read_state()
            if st["term"] == term and st["expires"] != 0:
                st["expires"] = 0
                self._write(self._state, st, sync=True)

    def leader(self) -> Optional[tuple[int, str]]:
        if not os.path.isdir(self._dir):
            raise CoordinatorUnavailable(f"{self.url}: no such directory (no master has used it)")
        st = self._read_settled(self._state) or {"expires": 0}
        if self._live(st, time.monotonic()):
            return (int(st["term"]), st["address"])
        return None

    def _node_path(self, segment: str) -> str:
        return os.path.join(self._nodes, urllib.parse.quote(segment, safe="") + ".json")

    def register_node(self, segment: str, endpoint: str) -> None:
        with self._locked():
            self._renew(self._node_path(segment), {
                "segment": segment, "endpoint": endpoint,
                "expires": time.monotonic() + self.ttl, "boot": self._boot})

    def drop_node(self, segment: str) -> None:
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._node_path(segment))

    def nodes(self) -> dict[str, str]:
        live: dict[str, str] = {}
        with self._locked():
            now = time.monotonic()
            for name in os.listdir(self._nodes):
                if not name.endswith(".json"):
                    continue
                path = os.path.join(self._nodes, name)
                rec = self._read(path)
                if rec is None:
                    continue
                if self._live(rec, now):
                    live[rec["segment"]] = rec["endpoint"]
                else:
                    os.unlink(path)
        return live

    def close(self) -> None:
        if self._lockf is not None:
            self._lockf.close()


# --- many hosts: etcd --------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class EtcdCoordinator(Coordinator):
    """Coordinator on an etcd v3 cluster (through its HTTP gateway, via ``etcd3gw``).

    * ``<prefix>/leader`` = the master's address, attached to an etcd lease of
      ``ttl`` seconds and created only if absent. The term is the key's
      ``create_revision``: etcd's revision only grows, so each new leader's term
      is higher than every earlier one.
    * ``<prefix>/nodes/<segment>`` = endpoint, one lease per registered segment.

    etcd counts TTLs in whole seconds and raises a TTL below its minimum (about
    2 s with its default heartbeat and election timeout) to that minimum; ``ttl``
    is rounded up and then reports what etcd granted. etcd removes an expired
    lease's keys within about half a second of expiry. Standbys learn of an
    expired leader by polling :meth:`leader` or :meth:`campaign`.

    Any call that cannot reach etcd raises :class:`CoordinatorUnavailable`,
    except :meth:`keepalive`, which returns False.
    """

    def __init__(self, host: str, port: int, prefix: str = "/kvproto", ttl: float = 2.0) -> None:
        self.ttl = float(max(1, math.ceil(ttl)))
        self.url = f"etcd://{host}:{port}{prefix}"
        self._leader_key = f"{prefix}/leader"
        self._node_prefix = f"{prefix}/nodes/"
        self._client = etcd3gw.client(host=host, port=port, timeout=max(1.0, self.ttl))
        self._node_leases: dict[str, int] = {}

    @contextlib.contextmanager
    def _reach(self) -> Iterator[None]:
        try:
            yield
        except Etcd3Exception as e:
            detail = e.detail_text or " ".join(str(a) for a in e.args)
            raise CoordinatorUnavailable(f"etcd at {self.url}: {type(e).__name__}: {detail}") from e

    @staticmethod
    def _not_found(e: Etcd3Exception) -> bool:
        """etcd refused because the lease no longer exists."""
        return "not found" in (e.detail_text or "")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._client.post(self._client.get_url(path), json=body)

    def _grant(self) -> int:
        r = self._post("/lease/grant", {"TTL": int(self.ttl), "ID": 0})
        self.ttl = max(self.ttl, float(r.get("TTL", self.ttl)))
        return int(r["ID"])

    def _refresh(self, lease: int) -> bool:
        r = self._post("/lease/keepalive", {"ID": lease})
        return int(r.get("result", {}).get("TTL", 0)) > 0

    def _revoke(self, lease: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease})
        except Etcd3Exception as e:
            if not self._not_found(e):
                raise

    def _leader_kv(self) -> Optional[tuple[str, dict[str, Any]]]:
        got = self._client.get(self._leader_key, metadata=True)
        if not got:
            return None
        value, meta = got[0]
        return value.decode(), meta

    def campaign(self, address: str) -> Optional[int]:
        with self._reach():
            if self._leader_kv() is not None:
                return None
            lease = self._grant()
            key = _b64(self._leader_key)
            r = self._client.transaction({
                "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                "success": [{"request_put": {"key": key, "value": _b64(address), "lease": lease}}],
                "failure": [],
            })
            if not r.get("succeeded"):
                self._revoke(lease)
                return None
            return int(r["header"]["revision"])

    def keepalive(self, term: int) -> bool:
        try:
            kv = self._leader_kv()
            if kv is None or int(kv[1]["create_revision"]) != term:
                return False
            # The key lives exactly as long as its lease: a renewed lease means
            # the key (and so the term) is still there.
            return self._refresh(int(kv[1]["lease"]))
        except (Etcd3Exception, KeyError, ValueError):
            return False

    def resign(self, term: int) -> None:
        with self._reach():
            kv = self._leader_kv()
            if kv is not None and int(kv[1]["create_revision"]) == term:
                self._revoke(int(kv[1]["lease"]))

    def leader(self) -> Optional[tuple[int, str]]:
        with self._reach():
            kv = self._leader_kv()
        if kv is None:
            return None
        return (int(kv[1]["create_revision"]), kv[0])

    def register_node(self, segment: str, endpoint: str) -> None:
        with self._reach():
            lease = self._node_leases.get(segment)
            if lease is None or not self._refresh(lease):
                lease = self._grant()
                self._node_leases[segment] = lease
            try:
                self._client.put(self._node_prefix + segment, endpoint, lease=Lease(lease, self._client))
            except Etcd3Exception as e:
                if not self._not_found(e):
                    raise
                # Expired between the refresh and the put: start over with a new lease.
                lease = self._grant()
                self._node_leases[segment] = lease
                self._client.put(self._node_prefix + segment, endpoint, lease=Lease(lease, self._client))

    def drop_node(self, segment: str) -> None:
        with self._reach():
            lease = self._node_leases.pop(segment, None)
            if lease is not None:
                self._revoke(lease)
            self._client.delete(self._node_prefix + segment)

    def nodes(self) -> dict[str, str]:
        with self._reach():
            got = self._client.get_prefix(self._node_prefix)
        n = len(self._node_prefix)
        return {meta["key"][n:].decode(): value.decode() for value, meta in got}

    def close(self) -> None:
        self._client.session.close()



# --------------------------------------------------------------------------
# A loopback etcd (tests, benchmarks, demos on one machine)
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """One etcd server on loopback in ``datadir``, on free ports, with a short
    heartbeat (50 ms, election 500 ms) so leases of 1 s are granted. ``url``
    is its ``etcd://127.0.0.1:PORT``. Raises RuntimeError when etcd (Debian
    package ``etcd-server``) is missing or does not answer within 20 s."""

    def __init__(self, datadir: "os.PathLike[str] | str") -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.access(binary, os.X_OK):
            raise RuntimeError("etcd not found (expected /usr/bin/etcd): install the Debian package "
                               "etcd-server (./run does)")
        datadir = pathlib.Path(datadir)
        client, peer = _free_port(), _free_port()
        self.url = f"etcd://127.0.0.1:{client}"
        self.log = datadir / "etcd.log"
        c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, "--name", "default", "--data-dir", str(datadir / "data"),
                 "--listen-client-urls", c, "--advertise-client-urls", c,
                 "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                 "--initial-cluster", f"default={p}",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not answer within 20 s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
