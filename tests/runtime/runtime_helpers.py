"""Helpers for the runtime tests: loopback only, every wait bounded.

A uniquely named module (not ``conftest``) so test files can import it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import zmq

import kvproto
from kvproto.checking.chaos.cluster import child_env  # noqa: F401 (the tests import it from here)
from kvproto.runtime import wire

REPO = Path(kvproto.__file__).resolve().parent.parent


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def space_returned(client, timeout: float = 10.0) -> None:
    """Until the allocator has back every region the directory freed: a
    direct writer's region returns once its node acknowledges the free
    (spec/DirectWrite.tla), a moment after the remove or eviction that freed
    it; a put in between may find no room."""
    wait_for(lambda: all(s["allocator_free"] == s["free"]
                         for s in client.stats()["segments"].values() if s["live"]),
             timeout, 0.005, "the freed regions to return")


class Raw:
    """A raw DEALER for sending arbitrary frames to a server."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self._rid = 1000

    def send_frames(self, frames, timeout: float = 5.0) -> wire.Reply:
        self.sock.send_multipart(frames, copy=False)
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError("no reply")
        return wire.decode_reply(self.sock.recv_multipart(copy=False))

    def call(self, op: str, body: dict, payloads=(), timeout: float = 5.0) -> wire.Reply:
        self._rid += 1
        reply = self.send_frames([wire.encode_request(op, self._rid, body), *payloads], timeout)
        assert reply.request_id == self._rid
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


class Child:
    """A ``python -c`` subprocess whose stdout lines we can wait for."""

    def __init__(self, code: str) -> None:
        import queue
        import threading
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=child_env(), cwd=str(REPO), text=True)
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def readline(self, timeout: float = 20.0) -> str:
        import queue
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child printed nothing in {timeout}s; stderr:\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"child exited ({self.proc.wait(5)}); stderr:\n{self.stderr()}")
        return line

    def stop(self, sig=None, timeout: float = 10.0) -> int:
        import signal as _signal
        if self.proc.poll() is None:
            self.proc.send_signal(sig or _signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def stderr(self) -> str:
        return "".join(self.err)


class Processes:
    """Children and raw connections a module fixture starts (``child``,
    ``raw``), closed and stopped, newest first, by ``close``."""

    def __init__(self) -> None:
        self.started: list[Child] = []
        self.opened: list[Raw] = []

    def child(self, code: str) -> Child:
        self.started.append(Child(code))
        return self.started[-1]

    def raw(self, endpoint: str) -> Raw:
        self.opened.append(Raw(endpoint))
        return self.opened[-1]

    def close(self) -> None:
        for r in self.opened:
            r.close()
        for c in reversed(self.started):
            c.stop()
