"""What a new user and an operator meet first: addresses, "no master" versus a
miss, the command line's one-line errors, the storage node's ready line, the
README's snippets, the help text and the demo."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import textwrap
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version as installed_version

import pytest
import zmq

import kvproto
from kvproto import cli, errors
from kvproto.runtime import shm, wire
from kvproto.runtime.coordinator import connect

from runtime_helpers import REPO, child_env, wait_for

pytestmark = pytest.mark.runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"      # nothing listens there


# --------------------------------------------------------------------------
# Client addresses (issue 10, item 5)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["not-an-endpoint", "tcp://", "127.0.0.1:5555",
                                     "http://127.0.0.1:1", "tcp://127.0.0.1:*", "tcp://host:0",
                                     "tcp://host:70000", "ipc://", "", None])
def test_a_bad_master_address_is_refused_naming_the_accepted_forms(address):
    with pytest.raises(errors.InvalidArgument) as refused:
        kvproto.Client(address)
    for form in ("tcp://host:port", "ipc://path", "etcd://host:port[/prefix]", "file:///dir"):
        assert form in str(refused.value)
    if address == "127.0.0.1:5555":
        assert "did you mean tcp://127.0.0.1:5555?" in str(refused.value)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://node-7.local:1",
                                     "ipc:///tmp/kvproto.sock"])
def test_good_master_addresses_are_accepted(address):
    kvproto.Client(address).close()


def test_a_client_creates_no_coordinator_directory(tmp_path):
    where = tmp_path / "no" / "such" / "dir"
    c = kvproto.Client(f"file://{where}", lookup_timeout=0.2)
    try:
        for call in (lambda: c.get(b"k"), lambda: c.put(b"k", b"v"), lambda: c.exists(b"k")):
            with pytest.raises(errors.CoordinatorUnavailable, match="no such directory"):
                call()
        assert not (tmp_path / "no").exists()
    finally:
        c.close()


def test_an_unreachable_etcd_is_coordinator_unavailable_not_a_miss():
    c = kvproto.Client(f"etcd://127.0.0.1:{free_port()}", lookup_timeout=0.2)
    try:
        with pytest.raises(errors.CoordinatorUnavailable):
            c.put(b"k", b"v")              # was MasterNotOpen
        with pytest.raises(errors.CoordinatorUnavailable):
            c.get(b"k")                    # was a miss (KeyNotFound)
        assert c.failover_counters["switch_misses"] == 0
        assert c.failover_counters["unreachable"] == 2
    finally:
        c.close()


# --------------------------------------------------------------------------
# "No master" is not "no such key" (item 4)
# --------------------------------------------------------------------------


def test_a_dead_master_without_coordinator_is_unreachable_not_an_empty_cache():
    c = kvproto.Client(dead_address(), lookup_timeout=0.5)   # timeout stays 30 s
    try:
        for call in (lambda: c.get(b"k"), lambda: c.get_many([b"k"]), lambda: c.exists(b"k"),
                     lambda: c.put(b"k", b"v"), lambda: c.remove(b"k")):
            t = time.monotonic()
            with pytest.raises(errors.MasterUnreachable, match="answered nothing"):
                call()
            assert time.monotonic() - t < 5      # lookup_timeout, not the 30 s timeout
        assert c.failover_counters["unreachable"] == 5
        assert c.failover_counters["switch_misses"] == 0
        # a typed error with a stable code, a kind of ServerUnavailable
        assert errors.MasterUnreachable.code == 76
        assert isinstance(errors.from_wire(76, "x"), errors.ServerUnavailable)
    finally:
        c.close()


def test_a_live_master_whose_reply_waits_for_storage_is_not_unreachable(raw):
    """The client probes a silent master; one that answers the probes (its
    put_start is parked on a storage node that never acks) is waited for."""
    ctx = zmq.Context.instance()
    silent_node = ctx.socket(zmq.ROUTER)       # takes commands, never answers
    silent_node.linger = 0
    port = silent_node.bind_to_random_port("tcp://127.0.0.1")
    try:
        with kvproto.embedded(storage_nodes=0, storage_timeout=3.0) as cluster:
            node = raw(cluster.master_address)
            assert node.call("register", {
                "segment": "silent", "capacity": 1 << 20, "endpoint": f"tcp://127.0.0.1:{port}",
                "host": "elsewhere", "shm": "none", "gen_shm": "none", "nonce": 1,
                "page_size": 4096}).status == 0
            c = cluster.client(lookup_timeout=1.0)
            t = time.monotonic()
            with pytest.raises(errors.KvError) as failed:
                c.put(b"k", b"v", timeout=6)
            took = time.monotonic() - t
            assert not isinstance(failed.value, errors.MasterUnreachable), failed.value
            assert took > 2.5, took                   # waited past lookup_timeout for the master
            assert c.failover_counters["unreachable"] == 0
    finally:
        silent_node.close(linger=0)


def test_with_a_coordinator_a_switch_is_a_miss_until_the_window_ends(tmp_path):
    url = f"file://{tmp_path}/coordinator"
    holder = connect(url, ttl=60)
    term = holder.campaign(dead_address())      # names a master that answers nothing
    c = kvproto.Client(url, lookup_timeout=0.2, switch_window=3.0)
    try:
        t = time.monotonic()
        with pytest.raises(errors.KeyNotFound, match="switches"):
            c.get(b"k")                           # within the window: a miss
        assert c.get_many([b"k"]) == [None]
        assert c.exists(b"k") is False
        assert c.failover_counters["switch_misses"] == 3
        assert time.monotonic() - t < 3.0, "the test machine is too slow for this window"
        wait_for(lambda: time.monotonic() - t > 3.1, what="the window to pass")
        with pytest.raises(errors.MasterUnreachable, match="switch_window"):
            c.get(b"k")
        with pytest.raises(errors.MasterUnreachable):
            c.put(b"k", b"v")
        assert c.failover_counters["unreachable"] == 2

        # a master that opens serves the client again: misses and errors stop
        holder.resign(term)
        from kvproto.runtime.embedded import run_master
        stop = threading.Event()
        server = threading.Thread(target=run_master, args=("tcp://127.0.0.1:*",),
                                  kwargs={"coordinator": connect(url, ttl=1.0), "stop": stop})
        server.start()
        try:
            wait_for(lambda: _exists_or_none(c) is False, timeout=20, what="a master serving")
            assert c.get_many([b"k"]) == [None]   # now a real miss: no such key
            assert c._unserved_since is None
        finally:
            stop.set()
            server.join(10)
    finally:
        c.close()
        holder.close()


def _exists_or_none(c):
    try:
        return c.exists(b"k")
    except errors.MasterUnreachable:
        return None


# --------------------------------------------------------------------------
# The command line (items 6 and 8)
# --------------------------------------------------------------------------


def kvproto_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvproto", *args], capture_output=True, text=True,
                          env=child_env(), cwd=str(REPO), timeout=timeout)


def one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["storage", "--master", "tcp://127.0.0.1:5555", "--size", "abc"], ["--size", "abc"]),
    (["storage", "--master", "tcp://127.0.0.1:5555", "--size", "0"], ["--size", "0"]),
    (["storage", "--master", "tcp://127.0.0.1:5555", "--size", "1MiB", "--listen", "bogus"],
     ["--listen", "bogus", "tcp://host:port"]),
    (["storage", "--master", "127.0.0.1:5555", "--size", "1MiB"], ["--master", "tcp://127.0.0.1:5555"]),
    (["storage", "--master", "tcp://127.0.0.1:5555", "--size", "1MiB", "--page-size", "1000"],
     ["--page-size", "power of two"]),
    (["storage", "--size", "1MiB"], ["--master"]),
    (["master", "--listen", "bogus"], ["--listen", "bogus"]),
    (["master", "--coordinator", "http://127.0.0.1:2379"], ["--coordinator", "file or etcd"]),
    (["master", "--ttl", "0"], ["--ttl"]),
    (["master", "--writer-timeout", "-1"], ["--writer-timeout"]),
    (["master", "--standby"], ["--standby needs --coordinator"]),
    (["demo", "--writers", "0"], ["--writers"]),
    (["demo", "--replicas", "3"], ["--replicas"]),
    (["bench", "--sizes", "abc"], ["--sizes"]),
    (["check", "--workers", "0"], ["--workers"]),
    (["nonsense"], ["nonsense"]),
])
def test_cli_mistakes_are_one_line_and_exit_status_2(args, words, capsys):
    try:
        code = cli.main(args)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def test_cli_mistakes_as_a_process():
    one_line_exit_2(kvproto_cli("storage", "--master", "tcp://127.0.0.1:5555", "--size", "abc"),
                    "kvproto storage", "--size")


def test_a_port_in_use_is_one_line_for_master_and_storage():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        one_line_exit_2(kvproto_cli("master", "--listen", taken), "cannot listen on " + taken, "in use")
        one_line_exit_2(kvproto_cli("storage", "--master", "tcp://127.0.0.1:5555", "--size", "1MiB",
                                    "--listen", taken), "cannot listen on " + taken, "in use")


def test_a_segment_larger_than_dev_shm_is_refused_at_start(capsys):
    free = shm.shm_free()
    assert free is not None
    too_big = str(free + (1 << 30))
    assert cli.main(["storage", "--master", "tcp://127.0.0.1:5555", "--size", too_big]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "does not fit in /dev/shm" in line and "MiB free" in line


def test_a_full_dev_shm_at_allocation_is_enospc_and_leaks_nothing(monkeypatch):
    """posix_fallocate reserves the pages: no SIGBUS later when /dev/shm fills meanwhile."""
    before = set(os.listdir(shm.SHM_DIR))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as refused:
        shm.SegmentMemory(1 << 20, 4096)
    assert refused.value.errno == errno.ENOSPC and "/dev/shm" in str(refused.value)
    assert set(os.listdir(shm.SHM_DIR)) <= before


def test_a_bad_coordinator_at_master_start_is_one_line(capsys):
    assert cli.main(["master", "--coordinator", f"etcd://127.0.0.1:{free_port()}"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvproto master: etcd at etcd://127.0.0.1:")


def _refusing_master(reason: errors.KvError):
    """A fake master that refuses every ``register`` with ``reason``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    seen = []

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                identity, *frames = sock.recv_multipart()
                req = wire.decode_request(frames, wire.MASTER_MAX_HEADER, 0)
                seen.append(req.op)
                sock.send_multipart([identity, wire.encode_error(req.request_id, reason)])
        sock.close(linger=0)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", stop, seen


def test_a_permanent_refusal_stops_the_storage_node_with_the_reason(capsys):
    address, stop, seen = _refusing_master(errors.InvalidArgument("page_size must be a power of two >= 512"))
    try:
        t = time.monotonic()
        assert cli.main(["storage", "--master", address, "--size", "1MiB"]) == 2
        assert time.monotonic() - t < 10
    finally:
        stop.set()
    line, = capsys.readouterr().err.strip().splitlines()
    assert f"the master at {address} refused this node" in line and "power of two" in line
    assert seen == ["register"]                 # once: no "starting over" loop


def test_a_node_that_cannot_reach_its_master_names_the_address(caplog):
    from kvproto.runtime.storage_server import StorageServer
    address = dead_address()
    server = StorageServer(address, "1MiB", register_timeout=0.2)
    caplog.set_level(logging.WARNING, logger="kvproto.storage")
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        wait_for(lambda: any(address in r.getMessage() for r in caplog.records), what="a log line")
    finally:
        server.stop()
        thread.join(10)
    assert any(f"no answer from the master at {address}" in r.getMessage() for r in caplog.records)


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvproto {installed_version('kvproto')}"


def test_help_has_no_rst_markup_and_shows_every_default():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "``" not in parser.format_help()
    for name, command in subparsers.choices.items():
        text = command.format_help()
        assert "``" not in text, name
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._get_help_string(action)
            assert action.help, (name, action.dest)
            assert "default" in shown or "required" in shown, (name, action.option_strings, shown)


# --------------------------------------------------------------------------
# Start-up: the ready line, NoStorage, NoSpace in words (item 7)
# --------------------------------------------------------------------------


def test_storage_prints_ready_once_registered_and_puts_before_get_no_storage(children):
    with kvproto.embedded(storage_nodes=0) as cluster:
        c = cluster.client()
        with pytest.raises(errors.NoStorage, match="no storage node has registered"):
            c.put(b"early", b"x")
        with pytest.raises(errors.NoSpace):           # a kind of NoSpace
            c.put(b"early", b"x")
        node = children(f"""
            import sys
            sys.argv = ["kvproto", "storage", "--master", {cluster.master_address!r}, "--size", "4MiB"]
            from kvproto.cli import main
            raise SystemExit(main())
        """)
        listening = node.readline()
        assert listening.startswith("kvproto storage listening on tcp://127.0.0.1:")
        endpoint = listening.rsplit(" ", 1)[1]
        ready = node.readline()
        m = re.fullmatch(r"kvproto storage ready: segment (\S+), 4MiB at (\S+), master (\S+) \(term 1\)",
                         ready)
        assert m and m.group(2) == endpoint and m.group(3) == cluster.master_address, ready
        c.put(b"late", b"x")                          # registered: the put goes through
        assert bytes(c.get(b"late")) == b"x"
        assert m.group(1) in c.stats()["segments"]


def test_no_space_says_how_many_nodes_the_replicas_need():
    with kvproto.embedded(storage_nodes=2, segment_size="1MiB") as cluster:
        c = cluster.client()
        with pytest.raises(errors.NoSpace) as refused:
            c.put(b"k", b"x", replicas=3)
        assert not isinstance(refused.value, errors.NoStorage)
        assert "3 replicas need 3 live storage nodes; only 2 registered" in str(refused.value)
        with pytest.raises(errors.NoSpace, match="can hold"):
            c.put(b"big", b"x" * (2 << 20), replicas=2)


def test_a_standby_logs_whom_it_waits_for(tmp_path, caplog):
    from kvproto.runtime.master_server import MasterServer
    url = f"file://{tmp_path}/coordinator"
    holder = connect(url, ttl=60)
    term = holder.campaign("tcp://127.0.0.1:9")
    server = MasterServer(coordinator=connect(url, ttl=1.0))
    caplog.set_level(logging.INFO, logger="kvproto.master")
    try:
        for _ in range(3):
            server._next_lead = 0.0
            server._once(10)
    finally:
        server.close()
        holder.close()
    waiting = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waiting == [f"standby at {server.address}: waiting while term {term} is held by "
                       "tcp://127.0.0.1:9"]          # once per leader, not every campaign


# --------------------------------------------------------------------------
# The README and the demo (items 8 and 9)
# --------------------------------------------------------------------------


def readme_python_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    # a block may be indented (inside a list item): take it as its indent sets it
    return [textwrap.dedent(body) for _, body in
            re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


def test_every_readme_python_snippet_compiles_and_imports_what_it_uses():
    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        compile(block, "README.md", "exec")
        if "kvproto." in block:
            assert "import kvproto" in block, block


def test_the_readme_embedded_cluster_snippets_run():
    blocks = [b for b in readme_python_blocks() if "kvproto.embedded(" in b]
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_the_demo_passes_and_says_what_it_checked(capsys):
    from kvproto import demo
    assert demo.main(writers=1, killed=1, objects=2, writer_timeout=1.0, failover_part=False) == 0
    out = capsys.readouterr().out
    assert re.search(r"objects published: +3 \(the master counts 3; expected 1 x 2 \+ 1\)", out), out
    assert re.search(r"reads afterwards: +3 verified, 1 misses, of 4 keys", out), out
    assert re.search(r"reclaimed: +1 allocations \(expected 1\)", out), out
    assert "never published" in out and "writer timeout" in out
    assert "GB/s" not in out
    assert out.rstrip().endswith("demo passed")


def test_kvproto_bench_runs_its_payload_and_metadata_sections():
    """A short run of the sections the README names, end to end."""
    out = subprocess.run([sys.executable, "-m", "kvproto", "bench", "--only", "payload,metadata",
                          "--sizes", "1", "--repeat", "2", "--meta-keys", "64",
                          "--memory-objects", "0"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 MiB" in out.stdout and "batch 128" in out.stdout and "exists" in out.stdout
    assert out.stdout.count("CPU per key, master / storage node / client:") == 3
    assert "batch 128, 4 in flight" in out.stdout


def test_kvproto_bench_runs_its_rebuild_sections():
    """A short run of the takeover sections: the in-process rebuild with two
    replicas per object, then with and without tenants (it checks that the
    registry took every object), and the end-to-end one, whose storage nodes
    fill their own indexes before the active master is killed."""
    out = subprocess.run([sys.executable, "-m", "kvproto", "bench", "--only", "rebuild,rebuild-e2e",
                          "--rebuild-objects", "2000", "--rebuild-replicas", "2",
                          "--rebuild-repeat", "1", "--e2e-objects", "5000"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2,000 published objects on 4 nodes (2 replica(s) each) recovered" in out.stdout
    assert "with tenants (2,000 objects in one tenant's namespace" in out.stdout
    assert "the registry's load" in out.stdout and "raw dict of the keys" in out.stdout
    assert "the standby recovered 5,000 in" in out.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "bench").glob("*.py")))
def test_every_bench_script_imports(script):
    """The scripts under bench/ are run by hand, not by the suite: each at
    least imports what it names (a function that moved module breaks one)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", REPO / "bench" / script)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
