"""The fault matrix's processes: a fault proxy, two masters, storage nodes, workers.

Every server is a separate process on loopback (the coordinator is the
embedded ``file://`` one, or an etcd given in the settings) and is reached only through
the fault proxy (:mod:`kvproto.checking.chaos.proxy`): a master advertises its
proxy front end in the coordinator (the embedded ``file://`` one), a storage
node advertises its own, so clients, storage nodes and masters all talk
through it. The harness itself asks servers for their ``stats`` on their real
endpoints, around the proxy.

Processes that die (a fault killed them) are replaced by :meth:`Cluster.heal`:
a master by a new standby, a storage node by a new node (a new segment), a
worker by a new incarnation with fresh keys.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import zmq

from kvproto.checking.chaos.proxy import ProxyControl
from kvproto.runtime import wire

PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Proc:
    """One child process; its stdout lines are queued, its stderr goes to a log file."""

    def __init__(self, role: str, name: str, argv: list[str], log: Path) -> None:
        self.role = role
        self.name = name
        self.log = log
        self.stderr = open(log, "ab")
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr,
                                      env=child_env(), cwd=str(PACKAGE_ROOT), text=True,
                                      start_new_session=True)
        self.pid = self.popen.pid
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.listen = ""      # the real endpoint
        self.address = ""     # the advertised one (the proxy's front end)
        self.route = ""
        self.shm: list[str] = []
        self.killed_by_us = False

    def _pump(self) -> None:
        for line in self.popen.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def line(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"{self.name} printed no {prefix!r} line in {timeout:.0f}s "
                                   f"(see {self.log})") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.popen.wait()}) before {prefix!r} "
                                   f"(see {self.log})")
            if line.startswith(prefix):
                return line

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self.close()

    def close(self) -> None:
        if not self.stderr.closed:
            self.stderr.close()


class Settings:
    """Sizes and timeouts of one matrix cluster (short, so faults resolve fast)."""

    def __init__(self, **overrides: Any) -> None:
        self.storage_nodes = 3
        self.segment_size = 24 << 20
        self.ttl = 1.0                  # the masters' leadership lease (coordinator)
        self.writer_timeout = 1.0
        self.storage_timeout = 2.0
        self.fence_timeout = 1.0
        self.lease_ttl = 1.0
        self.client_timeout = 4.0
        self.lookup_timeout = 1.0
        self.switch_window = 6.0
        #: the masters' coordinator: None for an embedded ``file://`` one in
        #: the work folder, or an ``etcd://host:port/prefix`` URL
        self.coordinator: Optional[str] = None
        #: whether every master and storage node records its steps to its own
        #: file in the work folder's ``traces/`` (``--trace``)
        self.trace = False
        for name, v in overrides.items():
            if not hasattr(self, name):
                raise ValueError(f"unknown setting {name!r}")
            setattr(self, name, v)

    def quiet_after(self) -> float:
        """How long after the last fault every timer has run out: an abandoned
        attempt's writer timeout, a lost node's storage timeout, a takeover
        (leadership TTL, fence timeout) and the leases a new master inherits."""
        return (self.writer_timeout + self.storage_timeout + self.ttl + self.fence_timeout
                + self.lease_ttl) * 1.5 + 2.0


class Cluster:
    """The proxy, two masters and ``storage_nodes`` storage nodes, under ``workdir``."""

    def __init__(self, workdir: Path, settings: Settings, seed: int = 0) -> None:
        self.workdir = Path(workdir)
        self.settings = settings
        self.seed = seed
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.traces = self.workdir / "traces"
        if settings.trace:
            self.traces.mkdir(exist_ok=True)
        self.coordinator = settings.coordinator or f"file://{self.workdir / 'coordinator'}"
        self.ctx = zmq.Context()
        self.masters: list[Proc] = []
        self.storage: list[Proc] = []
        self.retired: list[Proc] = []
        self._names: dict[str, int] = {}
        self.replaced = {"master": 0, "storage": 0}
        self.proxy_proc: Optional[Proc] = None
        self.proxy: Optional[ProxyControl] = None

    # ------------------------------------------------------------------ start

    def _name(self, role: str) -> str:
        n = self._names.get(role, 0)
        self._names[role] = n + 1
        return f"{role}-{n}"

    def start(self, timeout: float = 120.0) -> None:
        py = sys.executable
        self.proxy_proc = Proc("proxy", "proxy", [py, "-m", "kvproto.checking.chaos.proxy",
                                                  "tcp://127.0.0.1:*", str(self.seed)],
                               self.workdir / "logs" / "proxy.log")
        control = self.proxy_proc.line("kvproto fault proxy control on", timeout).rsplit(" ", 1)[1]
        self.proxy = ProxyControl(control, self.ctx)
        first = self.spawn_master()
        self.wait(lambda: self.open_leader() is first, timeout, "the first master to open")
        self.spawn_master()
        for _ in range(self.settings.storage_nodes):
            self.spawn_storage()
        self.wait(lambda: self.live_segments() >= self.settings.storage_nodes, timeout,
                  "the storage nodes to register")

    def _config(self, role: str, name: str) -> dict:
        s = self.settings
        port = free_port()
        listen = f"tcp://127.0.0.1:{port}"
        advertise = self.proxy.route(name, listen)
        config = {"coordinator": self.coordinator, "listen": listen, "advertise": advertise,
                  "ttl": s.ttl, "log_level": "INFO"}
        if role == "master":
            config.update(writer_timeout=s.writer_timeout, storage_timeout=s.storage_timeout,
                          fence_timeout=s.fence_timeout, lease_ttl=s.lease_ttl)
        else:
            config.update(size=s.segment_size)
        if s.trace:
            config["trace"] = str(self.traces / f"{name}.trace")
        return config

    def _spawn(self, role: str) -> Proc:
        name = self._name(role)
        config = self._config(role, name)
        proc = Proc(role, name, [sys.executable, "-m", "kvproto.checking.chaos.launch", role,
                                 json.dumps(config)], self.workdir / "logs" / f"{name}.log")
        proc.listen, proc.address, proc.route = config["listen"], config["advertise"], name
        if role == "storage":
            proc.shm = proc.line("kvproto storage shm").split()[3:]
        proc.line(f"kvproto {role} listening on")
        self.proxy.call("allow", pids=[proc.pid])
        return proc

    def spawn_master(self) -> Proc:
        proc = self._spawn("master")
        self.masters.append(proc)
        return proc

    def spawn_storage(self) -> Proc:
        proc = self._spawn("storage")
        self.storage.append(proc)
        return proc

    # ------------------------------------------------------------------ looking

    def call(self, endpoint: str, op: str, body: Optional[dict] = None,
             timeout: float = 2.0) -> Optional[wire.Reply]:
        """One request to a server's real endpoint (around the proxy); None if silent."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(endpoint)
            sock.send(wire.encode_request(op, 1, body or {}))
            if not sock.poll(int(timeout * 1000)):
                return None
            return wire.decode_reply(sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def leader(self) -> Optional[Proc]:
        """The master the coordinator names, if it is one of ours and alive."""
        from kvproto.runtime.coordinator import connect
        coord = connect(self.coordinator, ttl=self.settings.ttl, create=False)
        try:
            named = coord.leader()
        finally:
            coord.close()
        if named is None:
            return None
        return next((m for m in self.masters if m.address == named[1] and m.alive()), None)

    def master_stats(self, proc: Optional[Proc] = None) -> Optional[dict]:
        proc = proc or self.leader()
        if proc is None:
            return None
        reply = self.call(proc.listen, "stats")
        return reply.body if reply is not None and reply.status == 0 else None

    def open_leader(self) -> Optional[Proc]:
        proc = self.leader()
        stats = self.master_stats(proc) if proc is not None else None
        if stats is None or stats.get("failover", {}).get("phase") != "open":
            return None
        return proc

    def live_segments(self) -> int:
        stats = self.master_stats(self.open_leader())
        if stats is None:
            return 0
        return sum(1 for s in stats.get("segments", {}).values() if s.get("live"))

    def node_stats(self, proc: Proc) -> Optional[dict]:
        reply = self.call(proc.listen, "stats")
        return reply.body if reply is not None and reply.status == 0 else None

    @staticmethod
    def wait(predicate, timeout: float, what: str, interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    # ------------------------------------------------------------------ faults

    def heal(self) -> list[str]:
        """Replace dead masters and storage nodes; returns what was replaced."""
        if self.proxy_proc is not None and not self.proxy_proc.alive():
            raise RuntimeError(f"the fault proxy died (see {self.proxy_proc.log})")
        done = []
        for group, spawn in ((self.masters, self.spawn_master), (self.storage, self.spawn_storage)):
            for proc in [p for p in group if not p.alive()]:
                group.remove(proc)
                self.retire(proc)
                done.append(proc.name)
                self.replaced[proc.role] += 1
                spawn()
        return done

    def retire(self, proc: Proc) -> None:
        """A dead server: its route goes, and a storage node's shared memory is unlinked."""
        self.proxy.call("unroute", name=proc.route)
        for name in proc.shm:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        proc.close()
        self.retired.append(proc)

    def stop(self) -> None:
        for proc in self.masters + self.storage:
            proc.signal(signal.SIGCONT)
        for proc in self.storage + self.masters:
            proc.stop()
        for proc in self.storage + [p for p in self.retired if p.role == "storage"]:
            for name in proc.shm:
                try:
                    os.unlink(f"/dev/shm/{name}")
                except FileNotFoundError:
                    pass
        if self.proxy is not None:
            try:
                self.proxy.call("quit")
            except (TimeoutError, RuntimeError):
                pass
            self.proxy.close()
        if self.proxy_proc is not None:
            self.proxy_proc.stop()
        self.ctx.destroy(linger=0)
