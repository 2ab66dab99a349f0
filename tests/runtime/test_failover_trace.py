"""The fence and recover steps of a master takeover checked by TLC against
``spec/Failover.tla`` (``kvproto trace failover``, :mod:`kvproto.checking.failtrace`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

import kvproto
from kvproto.runtime import tracing

import test_master_failover as failover
from runtime_helpers import wait_for

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc, pytest.mark.runtime]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def takeover_run(children, raw, tmp_path) -> Path:
    """Two masters and two storage nodes as processes, every one recording
    (``KVPROTO_TRACE``: each master its file, each node one beside it): puts,
    an attempt left unpublished, the first master killed, the second fences
    the nodes, recovers and serves; the directory of the run's files."""
    url = f"file://{tmp_path}/coordinator"
    out = tmp_path / "run"
    out.mkdir()
    env = os.environ.get(tracing.ENV)
    try:
        os.environ[tracing.ENV] = str(out / "first.trace")
        a, a_addr = failover.start_master(children, url)
        wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
        os.environ[tracing.ENV] = str(out / "second.trace")
        b, b_addr = failover.start_master(children, url)
        os.environ[tracing.ENV] = str(out / "nodes.trace")
        for _ in range(2):
            failover.start_storage(children, url)
    finally:
        if env is None:
            os.environ.pop(tracing.ENV, None)
        else:
            os.environ[tracing.ENV] = env
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    try:
        wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 2,
                 what="the storage nodes registered")
        client.put(b"a", failover.value(b"a"), replicas=2)
        client.put(b"b", failover.value(b"b"))
        client.remove(b"b")
        client.put(b"c", failover.value(b"c"))
        # an attempt that is never published: the new master purges it
        rep = client._call_master("put_start", {"client": "stalled", "replicas": 1,
                                                "items": [[b"pending", 3000]]},
                                  time.monotonic() + 5)
        assert rep.body["items"][0][0] == 0
        a.stop(signal.SIGKILL)
        wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20, what="the standby open")
        assert bytes(client.get(b"a")) == failover.value(b"a")
        client.put(b"d", failover.value(b"d"))
        client.put(b"e", failover.value(b"e"))
        client.remove(b"d")
    finally:
        client.close()
    return out


def test_dump(children, raw, tmp_path):
    out = takeover_run(children, raw, tmp_path)
    for f in sorted(out.iterdir()):
        dst = Path("/tmp/ft") / f.name
        shutil.copy(f, dst)
