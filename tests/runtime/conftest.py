"""Fixtures for the runtime tests (helpers live in :mod:`runtime_helpers`)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kvproto.runtime.coordinator import LocalEtcd
from runtime_helpers import Child, Raw


@pytest.fixture
def raw():
    opened = []

    def make(endpoint: str) -> Raw:
        r = Raw(endpoint)
        opened.append(r)
        return r
    yield make
    for r in opened:
        r.close()


@pytest.fixture
def children():
    started: list[Child] = []

    def spawn(code: str) -> Child:
        c = Child(code)
        started.append(c)
        return c
    yield spawn
    for c in reversed(started):
        c.stop()


# --- etcd, for the coordinator tests -----------------------------------------

class EtcdServer(LocalEtcd):
    """A loopback etcd for the tests: one that cannot start fails the test (never skips).

    Each pytest-xdist worker starts its own (the session fixture is per worker),
    on ports free when it starts; another worker may take one of them before
    etcd binds it, so a start that fails is tried again on new ports."""

    def __init__(self, datadir: Path, attempts: int = 3) -> None:
        for attempt in range(1, attempts + 1):
            tried = datadir / f"etcd-{attempt}"
            tried.mkdir()
            try:
                super().__init__(tried)
                return
            except RuntimeError as err:   # missing, exited (a port taken) or silent
                if attempt == attempts or not str(err).startswith("etcd exited"):
                    pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def etcd(etcd_server):
    """``etcd://127.0.0.1:PORT/<prefix>`` with a prefix of this test's own."""
    return f"{etcd_server.url}/kvproto-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_etcd(tmp_path):
    """An etcd of this test's own (it may stop it); stopped at the end."""
    server = EtcdServer(tmp_path)
    yield server
    server.stop()
