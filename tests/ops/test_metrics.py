"""Prometheus metrics: real master and storage processes scraped over HTTP on
loopback, an embedded cluster's clients (lease rejections by reason,
quarantined buffers), ``kvproto stats``, and the metric table against
docs/metrics.md and the counters the processes keep."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import kvproto
from kvproto import cli, errors
from kvproto.ops import metrics as M
from kvproto.runtime.client import LEASE_COUNTERS, Client
from kvproto.runtime.master import COUNTERS as MASTER_COUNTER_NAMES
from kvproto.runtime.storage import StorageCore

pytestmark = pytest.mark.runtime

REPO = Path(kvproto.__file__).resolve().parent.parent
KiB = 1 << 10


def scrape(url: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of one GET of ``url`` (labels as exposed, sorted)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def series(name: str, **labels: str) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class Proc:
    """A ``python -m kvproto ...`` process whose stdout lines we read with a deadline."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvproto", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(l) for l in self.proc.stdout], daemon=True).start()

    def line(self, timeout: float = 30.0) -> str:
        try:
            return self.lines.get(timeout=timeout).strip()
        except queue.Empty:
            raise AssertionError(f"no output from {self.proc.args}") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def procs():
    started: list[Proc] = []

    def spawn(*args: str) -> Proc:
        p = Proc(*args)
        started.append(p)
        return p
    yield spawn
    for p in reversed(started):
        p.stop()


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_scraping_a_master_and_a_storage_process(procs):
    master = procs("master", "--listen", "tcp://127.0.0.1:*", "--metrics-port", "0")
    m_url = master.line().removeprefix("kvproto master metrics on ")
    assert m_url.startswith("http://127.0.0.1:") and m_url.endswith("/metrics")
    address = master.line().removeprefix("kvproto master listening on ")
    node = procs("storage", "--master", address, "--size", "8MiB", "--metrics-port", "0")
    s_url = node.line().removeprefix("kvproto storage metrics on ")
    assert node.line().startswith("kvproto storage listening on ")
    wait_for(lambda: scrape(m_url)[series("kvproto_master_segments_total", event="joined")] == 1,
             what="the node to register")
    m0, s0 = scrape(m_url), scrape(s_url)

    with Client(address, timeout=10.0, local_reads=False, local_writes=False) as client:   # the network paths
        for i in range(5):
            client.put(b"k%d" % i, bytes([i]) * (64 * KiB))
        for i in range(5):
            assert bytes(client.get(b"k%d" % i)) == bytes([i]) * (64 * KiB)
        assert client.get_many([b"missing"]) == [None]
        client.remove(b"k0")
    m1, s1 = scrape(m_url), scrape(s_url)

    def moved(after, before, key):
        return after.get(key, 0) - before.get(key, 0)

    assert moved(m1, m0, series("kvproto_master_puts_total", outcome="published")) == 5
    assert moved(m1, m0, series("kvproto_master_lookups_total", result="hit")) == 5
    assert moved(m1, m0, series("kvproto_master_lookups_total", result="miss")) == 1
    assert moved(m1, m0, series("kvproto_master_leases_total", event="granted")) == 5
    assert moved(m1, m0, "kvproto_master_removes_total") == 1
    assert moved(m1, m0, series("kvproto_master_request_seconds_count", op="put_start")) == 5
    assert moved(m1, m0, series("kvproto_master_request_seconds_count", op="read_begin")) == 6
    assert m1[series("kvproto_master_request_seconds_sum", op="put_start")] > 0
    assert m1["kvproto_master_objects"] == 4
    assert m1["kvproto_master_term"] == 1
    assert m1[series("kvproto_master_phase", phase="open")] == 1
    stored = [v for k, v in m1.items() if k.startswith("kvproto_stored_bytes{")]
    assert stored == [4 * 64 * KiB]
    assert m1["process_resident_memory_bytes"] > 0

    assert moved(s1, s0, series("kvproto_storage_served_total", op="write")) == 5
    assert moved(s1, s0, series("kvproto_storage_served_total", op="read")) == 5
    assert moved(s1, s0, series("kvproto_storage_bytes_total", direction="written")) == 5 * 64 * KiB
    assert moved(s1, s0, series("kvproto_storage_regions_total", event="freed")) == 1
    assert moved(s1, s0, series("kvproto_storage_request_seconds_count", op="writes")) == 5
    assert moved(s1, s0, series("kvproto_storage_request_seconds_count", op="read")) == 5
    assert s1["kvproto_storage_regions"] == 4 and s1["kvproto_storage_term"] == 1
    assert s1["kvproto_storage_capacity_bytes"] == 8 << 20


def test_embedded_cluster_clients_lease_rejections_and_quarantined_buffers():
    with kvproto.embedded(storage_nodes=1, segment_size="4MiB", storage_debug=True, lease_ttl=0.3,
                          metrics=True) as cluster:
        assert set(cluster.metrics_urls) == {"master", "storage-0", "clients"}
        writer = cluster.client()
        reader = cluster.client(local_reads=False)
        writer.put(b"slow", b"a" * (64 * KiB))
        node = cluster.storage[0]
        node.faults["read_delay_ms"] = 600            # the transfer outlives the 0.3 s lease
        with pytest.raises(errors.LeaseExpired):
            reader.get(b"slow")
        node.faults["read_delay_ms"] = 0
        assert bytes(reader.get(b"slow")) == b"a" * (64 * KiB)
        c = scrape(cluster.metrics_urls["clients"])
        assert c[series("kvproto_client_leased_reads_total", result="rejected")] == 1
        assert c[series("kvproto_client_leased_reads_total", result="accepted")] == 1
        assert c[series("kvproto_client_lease_rejections_total", reason="network-slow")] == 1
        assert c[series("kvproto_client_lease_rejections_total", reason="lease-too-short")] == 0
        assert c[series("kvproto_client_lease_rejections_total", reason="queued-too-long")] == 0
        assert c[series("kvproto_client_read_phase_seconds_total", phase="transferring")] >= 0.5
        assert c[series("kvproto_client_master_seconds_count", op="read_begin")] == 2
        assert c[series("kvproto_client_master_seconds_count", op="put_start")] == 1

        # a load that times out leaves its buffer quarantined until the cancel is acked
        engine = writer.transfer_engine(buffers=1, buffer_size=64 * KiB)
        collector = M.ClientCollector([writer], pools={"engine": engine})
        node.faults["delay_ms"] = 400
        request = engine.request()
        buf = request.acquire()
        with pytest.raises(errors.TransferTimeout):
            writer.get_into(b"slow", buf, timeout=0.1)
        samples = {(n, tuple(sorted(l.items()))): v for n, l, v in M.client_samples(*collector.snapshot())}
        assert samples[("kvproto_client_transfer_events_total", (("event", "timed_out"), ("pool", "engine")))] == 1
        held = {s: samples[("kvproto_client_buffers", (("pool", "engine"), ("state", s)))]
                for s in ("free", "held", "quarantined", "leaked")}
        assert sum(held.values()) == 1 and held["held"] == 0 and held["leaked"] == 0
        assert request.drain(2.0)
        node.faults["delay_ms"] = 0

        m = scrape(cluster.metrics_urls["master"])
        assert m[series("kvproto_master_leases_total", event="granted")] == 2
        s = scrape(cluster.metrics_urls["storage-0"])
        assert s[series("kvproto_storage_injected_faults_total", fault="read_delayed")] == 1
        assert s["kvproto_storage_cancels_total"] == 1
    # the exporters stop with the cluster
    with pytest.raises(OSError):
        urllib.request.urlopen(cluster.metrics_urls["master"], timeout=2)


def test_a_scrape_while_the_master_is_busy_reads_consistent_figures():
    with kvproto.embedded(storage_nodes=1, segment_size="16MiB", metrics=True) as cluster:
        client = cluster.client()
        stop = threading.Event()

        def hammer():
            i = 0
            while not stop.is_set():
                client.put(b"h%d" % i, b"x" * 600)
                client.get_many([b"h%d" % i, b"nope"])
                if i > 20:
                    client.remove(b"h%d" % (i - 20))
                i += 1
        t = threading.Thread(target=hammer)
        t.start()
        try:
            last = 0.0
            for _ in range(30):
                m = scrape(cluster.metrics_urls["master"])
                published = m[series("kvproto_master_puts_total", outcome="published")]
                assert published >= last     # a counter never goes back
                last = published
        finally:
            stop.set()
            t.join(10)
        assert last > 0


def test_kvproto_stats_prints_the_same_figures(capsys):
    with kvproto.embedded(storage_nodes=2, segment_size="8MiB") as cluster:
        client = cluster.client()
        client.put(b"a", b"z" * 5000, replicas=2)
        client.get(b"a")
        assert cli.main(["stats", "--master", cluster.master_address]) == 0
        out = capsys.readouterr().out
        assert re.search(r'kvproto_master_puts_total\{outcome="published"\}\s+1$', out, re.M)
        assert re.search(r"^  kvproto_master_objects\s+1$", out, re.M)
        # the client shares the nodes' host: it wrote both replicas itself
        assert len(re.findall(r'kvproto_storage_direct_regions_total\{event="published"\}\s+1$', out, re.M)) == 2
        assert len(re.findall(r"^storage ", out, re.M)) == 2
        # live: a second round shows each counter's rate
        assert cli.main(["stats", "--master", cluster.master_address, "--watch", "0.2",
                         "--count", "2"]) == 0
        out = capsys.readouterr().out
        assert out.count("master tcp://") == 2 and "/s" in out
        # the same samples the collectors build
        assert cli.main(["stats", "--master", cluster.master_address, "--json"]) == 0
        assert '"kvproto_master_objects", {}, 1' in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["stats", "--master", "tcp://127.0.0.1:1", "--watch", "0"], "--watch needs a positive"),
    (["stats", "--master", "localhost"], "--master 'localhost' is not tcp://host:port"),
    (["master", "--listen", "tcp://127.0.0.1:*", "--metrics-port", "70000"], "is not a port"),
    (["storage", "--master", "tcp://127.0.0.1:1", "--size", "1MiB", "--metrics-port", "-1"],
     "is not a port"),
])
def test_mistakes_are_one_line_and_status_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_metrics_port_in_use_is_one_line_and_status_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["master", "--listen", "tcp://127.0.0.1:*", "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvproto master: metrics on 127.0.0.1:{port}: ") and err.count("\n") == 1


def test_an_unreachable_master_is_one_line(capsys):
    assert cli.main(["stats", "--master", "tcp://127.0.0.1:1", "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvproto stats: ") and err.count("\n") == 1


# --------------------------------------------------------------------------- the table


def test_every_counter_the_processes_keep_is_exported():
    assert set(M.MASTER_COUNTERS) == set(MASTER_COUNTER_NAMES)
    assert set(M.STORAGE_COUNTERS) == set(StorageCore.COUNTERS)
    with Client("tcp://127.0.0.1:1") as client:
        failover = set(client.failover_counters) | set(client.transfer_counters) \
            | set(client.checksum_counters)
    assert set(M.CLIENT_COUNTERS) | set(M.CLIENT_DERIVED) == set(LEASE_COUNTERS) | failover
    for table in (M.MASTER_COUNTERS, M.STORAGE_COUNTERS, M.CLIENT_COUNTERS):
        for name, labels in table.values():
            assert M.METRICS[name].kind == M.C and set(labels) == set(M.METRICS[name].labels)


def test_docs_metrics_lists_every_metric_and_no_other():
    doc = (REPO / "docs" / "metrics.md").read_text()
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"^\| `(kvproto_\w+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    assert set(rows) == set(M.METRICS)
    for name, (kind, labels) in rows.items():
        metric = M.METRICS[name]
        assert kind == metric.kind, name
        assert [l.strip("` ") for l in labels.split(",") if l.strip()] == list(metric.labels), name
