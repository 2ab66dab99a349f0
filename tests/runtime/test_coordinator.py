"""Master election and node membership (kvproto.runtime.coordinator), on both
backends: a directory on one host and a real etcd on loopback."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest

from kvproto import errors
from kvproto.runtime.coordinator import (Coordinator, EtcdCoordinator, FileCoordinator,
                                         connect)
from runtime_helpers import wait_for

pytestmark = pytest.mark.runtime

# etcd grants whole seconds (the test server's minimum is 1 s) and removes
# expired keys up to ~0.5 s late. The directory backend takes any TTL; its
# renewals write in place (test_file_renewals_write_in_place), which took
# tens of milliseconds at most beside a whole test suite.
TTL = {"file": 1.0, "etcd": 1.0}


@pytest.fixture(params=["file", "etcd"])
def make(request, tmp_path):
    """make() -> a new Coordinator on this test's store (one per simulated process)."""
    url = f"file://{tmp_path}/coord" if request.param == "file" else request.getfixturevalue("etcd")
    opened: list[Coordinator] = []

    def make_one() -> Coordinator:
        c = connect(url, ttl=TTL[request.param])
        opened.append(c)
        return c
    make_one.url = url
    make_one.ttl = TTL[request.param]
    yield make_one
    for c in opened:
        c.close()


def wait_expired(c: Coordinator) -> None:
    wait_for(lambda: c.leader() is None, timeout=c.ttl + 3, what="the leadership to expire")


def test_single_election(make):
    a, b = make(), make()
    assert a.leader() is None
    term = a.campaign("tcp://a:1")
    assert isinstance(term, int) and term > 0
    assert a.leader() == b.leader() == (term, "tcp://a:1")
    assert b.campaign("tcp://b:1") is None
    assert a.campaign("tcp://a:1") is None        # no second term for a live leader either
    assert a.keepalive(term)
    assert b.leader() == (term, "tcp://a:1")


def test_keepalive_holds_leadership_past_ttl(make):
    a, b = make(), make()
    term = a.campaign("A")
    end = time.monotonic() + 2.5 * a.ttl
    while time.monotonic() < end:
        assert a.keepalive(term)
        assert b.campaign("B") is None
        time.sleep(a.ttl / 4)
    assert b.leader() == (term, "A")


def test_takeover_after_expiry_has_a_higher_term(make):
    a, b = make(), make()
    t1 = a.campaign("A")
    wait_expired(b)
    t2 = b.campaign("B")
    assert t2 is not None and t2 > t1
    assert a.leader() == (t2, "B")
    assert not a.keepalive(t1)                      # another master took over
    assert b.keepalive(t2)
    assert a.campaign("A") is None


def test_expired_leader_cannot_renew_even_if_nobody_took_over(make):
    a = make()
    t1 = a.campaign("A")
    wait_expired(a)
    assert not a.keepalive(t1)
    assert a.leader() is None
    t2 = a.campaign("A")
    assert t2 is not None and t2 > t1


def test_resign_lets_a_standby_win_at_once(make):
    a, b = make(), make()
    t1 = a.campaign("A")
    a.resign(t1)
    assert b.leader() is None
    t2 = b.campaign("B")
    assert t2 is not None and t2 > t1
    assert not a.keepalive(t1)
    a.resign(t1)                                    # stale: leaves the new leader alone
    assert a.leader() == (t2, "B") and b.keepalive(t2)
    b.resign(t2)
    t3 = a.campaign("A")
    assert t3 is not None and t3 > t2               # the term never goes back after resign


def test_node_registration_refresh_and_expiry(make):
    a, b = make(), make()
    assert b.nodes() == {}
    a.register_node("seg-a", "tcp://127.0.0.1:7001")
    a.register_node("odd/seg b", "tcp://127.0.0.1:7002")
    a.register_node("seg-a", "tcp://127.0.0.1:7001")          # idempotent
    assert b.nodes() == {"seg-a": "tcp://127.0.0.1:7001", "odd/seg b": "tcp://127.0.0.1:7002"}

    # seg-a is refreshed every ttl/3; "odd/seg b" is not and expires.
    deadline = time.monotonic() + a.ttl + 3
    while "odd/seg b" in b.nodes():
        assert time.monotonic() < deadline, "an unrefreshed node did not expire"
        a.register_node("seg-a", "tcp://127.0.0.1:7001")
        time.sleep(a.ttl / 3)
    assert b.nodes() == {"seg-a": "tcp://127.0.0.1:7001"}

    a.register_node("seg-a", "tcp://127.0.0.1:7009")          # a restarted node moved
    assert b.nodes() == {"seg-a": "tcp://127.0.0.1:7009"}
    a.drop_node("seg-a")
    assert b.nodes() == {}
    a.drop_node("seg-a")                                       # dropping twice is fine
    a.register_node("seg-a", "tcp://127.0.0.1:7010")          # and it may come back
    assert b.nodes() == {"seg-a": "tcp://127.0.0.1:7010"}


def _campaigner(url: str, ttl: float, name: str, rounds: int, barrier, results) -> None:
    c = connect(url, ttl=ttl)
    try:
        for r in range(rounds):
            barrier.wait(30)
            results.put((r, name, c.campaign(name)))
    finally:
        c.close()


def test_concurrent_processes_elect_exactly_one(make):
    """Several processes campaign at the same instant, round after round: each
    round exactly one wins, and the winners' terms strictly increase."""
    n, rounds = 5, 3
    watcher = make()
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=_campaigner, daemon=True,
                         args=(make.url, make.ttl, f"m{i}", rounds, barrier, results))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        last = 0
        for r in range(rounds):
            barrier.wait(30)
            got = [results.get(timeout=30) for _ in range(n)]
            assert {g[0] for g in got} == {r}
            winners = [(name, term) for _, name, term in got if term is not None]
            assert len(winners) == 1, f"round {r}: {got}"
            name, term = winners[0]
            assert term > last
            assert watcher.leader() in ((term, name), None)     # None: already expired
            last = term
            if r + 1 < rounds:
                wait_expired(watcher)
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _master(url: str, ttl: float, results) -> None:
    c = connect(url, ttl=ttl)
    term = c.campaign("paused")
    results.put(("term", term, time.monotonic()))
    while term is not None:
        ok = c.keepalive(term)
        results.put(("keepalive", ok, time.monotonic()))
        if not ok:
            break
        time.sleep(ttl / 4)
    c.close()


def test_paused_master_steps_down_after_resuming(make):
    """A master stopped with SIGSTOP loses its lease; a standby takes over with a
    higher term; once resumed, the old master's next keepalive says step down."""
    standby = make()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    p = ctx.Process(target=_master, args=(make.url, make.ttl, results), daemon=True)
    p.start()
    try:
        kind, t1, _ = results.get(timeout=10)
        assert kind == "term" and t1 is not None
        assert results.get(timeout=10)[:2] == ("keepalive", True)   # now sleeping, outside any call
        os.kill(p.pid, signal.SIGSTOP)
        wait_expired(standby)
        t2 = standby.campaign("standby")
        assert t2 is not None and t2 > t1
        resumed = time.monotonic()
        os.kill(p.pid, signal.SIGCONT)
        while True:
            kind, ok, at = results.get(timeout=10)
            if at > resumed:
                assert ok is False, "a resumed master renewed a lease that had expired"
                break
        p.join(10)
        assert p.exitcode == 0
        assert standby.leader() == (t2, "standby") and standby.keepalive(t2)
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()


# --- connect() ---------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "", "/tmp/coord", "http://127.0.0.1:2379", "zk://127.0.0.1:2181",
    "file://relative/dir", "file:relative", "file:///", "file:///tmp/x?mode=1",
    "etcd://127.0.0.1", "etcd://:2379", "etcd://127.0.0.1:notaport", "etcd://127.0.0.1:99999",
])
def test_connect_rejects_bad_urls(url):
    with pytest.raises(errors.InvalidArgument):
        connect(url)


def test_connect_picks_the_backend(tmp_path):
    f = connect(f"file://{tmp_path}/c", ttl=1.5)
    assert isinstance(f, FileCoordinator) and f.ttl == 1.5
    f.close()
    e = connect("etcd://127.0.0.1:2379")
    assert isinstance(e, EtcdCoordinator) and e.url == "etcd://127.0.0.1:2379/kvproto"
    e.close()
    e = connect("etcd://127.0.0.1:2379/my/prefix/", ttl=0.3)
    assert e.url == "etcd://127.0.0.1:2379/my/prefix" and e.ttl == 1.0    # whole seconds
    e.close()
    with pytest.raises(errors.InvalidArgument):
        connect(f"file://{tmp_path}/c", ttl=0)


# --- backend specifics --------------------------------------------------------

def test_file_lease_from_another_boot_is_expired(tmp_path):
    c = connect(f"file://{tmp_path}", ttl=5)
    (tmp_path / "state.json").write_text(json.dumps(
        {"term": 41, "address": "old", "expires": time.monotonic() + 1e6, "boot": "another-boot"}))
    assert c.leader() is None
    assert c.campaign("new") == 42
    c.close()


def test_file_renewals_write_in_place(tmp_path):
    """A keepalive and a node's refresh write over their record (same file,
    same size); a new term replaces the record. Replacing a file waits on
    the disk's journal, which under load has taken longer than a lease."""
    c = connect(f"file://{tmp_path}", ttl=5)
    state, node = tmp_path / "state.json", tmp_path / "nodes" / "seg.json"
    term = c.campaign("A")
    c.register_node("seg", "tcp://x:1")
    held = {p: open(p, "rb") for p in (state, node)}       # the files as they are now
    size = {p: p.stat().st_size for p in held}
    expires = json.loads(held[state].read())["expires"]
    assert c.keepalive(term)
    c.register_node("seg", "tcp://x:2")
    assert all(os.fstat(f.fileno()).st_ino == p.stat().st_ino for p, f in held.items())
    assert {p: p.stat().st_size for p in held} == size
    assert json.loads(os.pread(held[state].fileno(), 4096, 0))["expires"] > expires
    assert json.loads(os.pread(held[node].fileno(), 4096, 0))["endpoint"] == "tcp://x:2"
    assert c.leader() == (term, "A") and c.nodes() == {"seg": "tcp://x:2"}
    c.resign(term)
    assert c.campaign("B") == term + 1
    assert os.fstat(held[state].fileno()).st_ino != state.stat().st_ino
    for f in held.values():
        f.close()
    c.close()


def test_file_renewal_over_a_longer_record_leaves_no_tail(tmp_path):
    """A record longer than the padding (written by hand here) is written
    over whole: what the renewal leaves past its own bytes is blank."""
    c = connect(f"file://{tmp_path}", ttl=5)
    term = c.campaign("A")
    state = json.loads((tmp_path / "state.json").read_text())
    state["address"] = "tcp://" + "a" * 400
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert c.keepalive(term)
    assert c.leader() == (term, state["address"])
    c.register_node("seg", "tcp://" + "n" * 400)
    c.register_node("seg", "tcp://short:1")
    assert c.nodes() == {"seg": "tcp://short:1"}
    c.close()


def test_a_file_reader_neither_waits_on_the_lock_nor_reads_a_renewal_half_done(tmp_path):
    """leader() takes no lock: a master stopped while holding it (here: the
    lock held by another open file) does not stop clients from finding it;
    and renewals written in place meanwhile never show as a wrong or missing
    leader (a renewal that emptied the file first would)."""
    master = connect(f"file://{tmp_path}", ttl=60)
    term = master.campaign("tcp://127.0.0.1:5555")
    reader = connect(f"file://{tmp_path}", ttl=60, create=False)
    with open(tmp_path / "lock") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        found = []
        t = threading.Thread(target=lambda: found.append(reader.leader()), daemon=True)
        t.start()
        t.join(5)
        assert found == [(term, "tcp://127.0.0.1:5555")]
    stop, renewed = threading.Event(), []

    def renew():
        while not stop.is_set():
            renewed.append(master.keepalive(term))
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        seen = {reader.leader() for _ in range(3000)}
    finally:
        stop.set()
        renewer.join()
    assert renewed and all(renewed)
    assert seen == {(term, "tcp://127.0.0.1:5555")}
    reader.close()
    master.close()


def test_a_file_reader_creates_nothing(tmp_path):
    """A client's coordinator only reads: it creates no lock file, even
    where the directory exists."""
    reader = connect(f"file://{tmp_path}", ttl=5, create=False)
    assert reader.leader() is None
    assert os.listdir(tmp_path) == []
    master = connect(f"file://{tmp_path}", ttl=5)
    term = master.campaign("A")
    assert reader.leader() == (term, "A")
    reader.close()
    master.close()


def test_etcd_unreachable_raises_coordinator_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = connect(f"etcd://127.0.0.1:{port}", ttl=1)
    for call in (lambda: c.campaign("A"), c.leader, c.nodes, lambda: c.resign(5),
                 lambda: c.register_node("s", "tcp://x:1"), lambda: c.drop_node("s")):
        with pytest.raises(errors.CoordinatorUnavailable):
            call()
    assert c.keepalive(5) is False
    c.close()


def test_etcd_dying_under_the_leader(private_etcd):
    c = connect(private_etcd.url, ttl=1)
    term = c.campaign("A")
    assert term is not None and c.keepalive(term)
    private_etcd.stop()
    assert c.keepalive(term) is False               # leadership can no longer be confirmed
    with pytest.raises(errors.CoordinatorUnavailable):
        c.leader()
    c.close()


def test_coordinator_unavailable_is_wire_stable():
    assert errors.CoordinatorUnavailable.code == 75
    err = errors.from_wire(*errors.CoordinatorUnavailable("etcd down").to_wire())
    assert type(err) is errors.CoordinatorUnavailable and err.message == "etcd down"
