"""Runtime traces checked by TLC (``kvproto trace check``, :mod:`kvproto.checking.traces`,
:mod:`kvproto.checking.leasetrace`).

A real run of an embedded cluster records its master's publish and lease
steps; TLC finds every step to be a step of ``spec/Publish.tla`` and of
``spec/Lease.tla``. The check can fail: a trace with one step changed by hand
is rejected at that step, and so is the run of a master whose directory
publishes whatever token ``PutEnd`` names, and the run of a master whose
eviction takes leased objects."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import pytest
import zmq
from hypothesis import given, settings, strategies as st

import kvproto
from kvproto import cli, errors
from kvproto.checking import leasetrace, traces
from kvproto.cores import leases as lease_core
from kvproto.cores.directory import DirectoryCore
from kvproto.runtime import tracing, wire
from kvproto.statemachines import publish as pm
from kvproto.statemachines.publish import Published

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc, pytest.mark.runtime]


class Raw:
    """Requests as a writer that misbehaves would send them."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.rid = 0

    def call(self, op: str, body: dict) -> wire.Reply:
        self.rid += 1
        self.sock.send_multipart([wire.encode_request(op, self.rid, body)])
        assert self.sock.poll(30_000), f"no reply to {op}"
        return wire.decode_reply(self.sock.recv_multipart())

    def item(self, op: str, body: dict):
        status, value = self.call(op, body).body["items"][0]
        return status, value

    def close(self) -> None:
        self.sock.close(linger=0)


def lines(path: Path, machine: str = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if machine is None or r["machine"] == machine]


def steps_of(path: Path, kind: str, machine: str = "publish") -> list[dict]:
    return [s for s in lines(path, machine) if s.get("event", {}).get("type") == kind]


def check_one(path: Path, machine: str) -> traces.Verdict:
    """One machine's verdict (one TLC run, where ``traces.check`` runs one a machine)."""
    recorded = traces.read(path)[machine]
    if machine == "lease":
        return leasetrace.check_lines(recorded)
    return traces.check_run(*traces.publish_run(recorded))


def stale_put_end(cluster, raw: Raw) -> tuple[int, int]:
    """Writer w1's attempt on ``c`` is revoked, w2 starts another (and then
    falls silent), and w1 ends its put with its stale token."""
    status, grant = raw.item("put_start", {"client": "w1", "replicas": 2, "items": [[b"c", 4096]]})
    assert status == 0
    t1 = grant["token"]
    assert raw.item("put_revoke", {"client": "w1", "items": [[b"c", t1]]})[0] == 0
    status, grant = raw.item("put_start", {"client": "w2", "replicas": 2, "items": [[b"c", 4096]]})
    assert status == 0
    raw.call("put_end", {"client": "w1", "items": [[b"c", t1]]})
    return t1, grant["token"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A short real run: puts, reads, a remove, a read of a removed key, a
    revoked attempt, a stale PutEnd, an attempt reclaimed by the writer
    timeout, and both segments lost as their nodes leave."""
    path = tmp_path_factory.mktemp("traces") / "run.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=2, segment_size="4MiB", writer_timeout=2.0) as cluster:
            c = cluster.client()
            raw = Raw(cluster.master_address)
            try:
                c.put(b"a", b"x" * 5000, replicas=2)
                c.put(b"b", b"y" * 100, replicas=2)
                assert bytes(c.get(b"a")) == b"x" * 5000
                t1, _ = stale_put_end(cluster, raw)
                c.remove(b"b")
                with pytest.raises(errors.KeyNotFound):
                    c.get(b"b")
                deadline = time.monotonic() + 60
                while not steps_of(path, "ReclaimAbandoned"):   # w2 fell silent
                    assert time.monotonic() < deadline, "the silent writer's attempt was not reclaimed"
                    time.sleep(0.1)
                c.put(b"c", b"z" * 3000, replicas=2)
                assert raw.item("put_end", {"client": "w1", "items": [[b"c", t1]]})[0] \
                    == errors.StaleToken.code
            finally:
                raw.close()
    return path


def test_a_run_records_every_kind_of_step(recorded):
    recorded_kinds = {s["event"]["type"] for s in lines(recorded) if "event" in s}
    assert recorded_kinds >= {"AddSegment", "PutStart", "PutEnd", "PutRevoke", "ReclaimAbandoned",
                              "ReadBegin", "Remove", "SegmentLost"}
    refused = [s for s in lines(recorded) if s.get("effects") and s["effects"][0]["type"] == "Refused"]
    assert {s["event"]["type"] for s in refused} >= {"PutEnd", "ReadBegin"}
    first = lines(recorded)[0]
    assert first == {"machine": "publish", "opened": {"next_token": 1, "objects": 0, "segments": {},
                                                      "free": {}, "term": 1, "directory": {}}}
    put = steps_of(recorded, "PutStart")[0]
    assert put["event"]["key"] == "a" and put["effects"][0]["type"] == "PutGranted"


@needs_java
def test_a_recorded_run_is_a_behaviour_of_the_spec(recorded, tmp_path, capsys):
    """Both machines' runs pass ``kvproto trace check`` (:func:`traces.check_each`),
    publish first."""
    assert cli.main(["trace", "check", "--keep", str(tmp_path), str(recorded)]) == 0, \
        capsys.readouterr()
    out = capsys.readouterr().out
    steps = len(lines(recorded, "publish")) - 1
    assert f"{recorded}: publish: all {steps} steps are steps of spec/Publish.tla (" in out
    assert f"{recorded}: lease: " in out and "spec/Lease.tla" in out
    assert out.index(": publish: ") < out.index(": lease: ") and out.count("\n") == 2
    assert "EXTENDS Publish" in (tmp_path / "PublishTrace.tla").read_text()
    assert "EXTENDS Lease" in (tmp_path / "LeaseTrace.tla").read_text()


def corrupt(path: Path, out: Path, kind: str, change, machine: str = "publish") -> int:
    """Write ``path`` to ``out`` with ``change`` applied to the first step of
    ``machine`` and ``kind`` it accepts (returns True); that step's number."""
    rows, n = lines(path), None
    for row in rows:
        if n is None and row["machine"] == machine and row.get("event", {}).get("type") == kind \
                and change(row):
            n = row["n"]
    assert n is not None, f"no {kind} step to corrupt"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return n


def _drop_a_free(row):
    frees = [e for e in row["effects"] if e["type"] == "FreeRegion"]
    if row["effects"][0]["type"] != "Removed" or not frees:
        return False
    row["effects"].remove(frees[0])      # the master forgot one replica's region
    return True


def _publish_the_stale_end(row):
    if row["effects"][0]["type"] != "Refused":
        return False
    key, token = row["event"]["key"], row["event"]["token"]
    row["effects"] = [{"type": "Published", "key": key, "token": token}]
    return True


def _grant_another_token(row):
    if row["effects"][0]["type"] != "PutGranted":
        return False
    row["effects"][0]["token"] += 5
    return True


def _refuse_a_read(row):
    if row["effects"][0]["type"] != "ReadGranted":
        return False
    row["effects"] = [{"type": "Refused", "error": {"type": "KeyNotFound", "message": "x"}}]
    return True


@needs_java
@pytest.mark.parametrize("kind, change", [
    ("Remove", _drop_a_free),
    ("PutEnd", _publish_the_stale_end),
    ("PutStart", _grant_another_token),
    ("ReadBegin", _refuse_a_read),
])
def test_a_step_changed_by_hand_is_rejected_with_its_number(recorded, tmp_path, kind, change):
    bad = tmp_path / "bad.trace"
    n = corrupt(recorded, bad, kind, change)
    verdict = check_one(bad, "publish")
    assert not verdict.ok
    assert verdict.failed_step == n, verdict.message
    assert f"step {n} " in verdict.message and kind in verdict.message


@needs_java
def test_a_master_that_publishes_any_token_leaves_the_spec(tmp_path, monkeypatch, capsys):
    """The directory publishes a pending key whatever token PutEnd names (a
    writer whose attempt was revoked publishes the next writer's object).
    Nothing in the run fails; its trace is rejected at the stale PutEnd."""
    def put_end_any_token(self, ev):
        row = self.rows.index.get(ev.key)
        if row is None or self._st[row] != 1:
            return directory._refused(errors.StaleToken("no pending attempt"))
        self._st[row] = 2
        return (Published(ev.key, ev.token),)

    from kvproto.cores import directory
    assert (directory.PENDING, directory.PUBLISHED) == (1, 2)
    monkeypatch.setattr(DirectoryCore, "_put_end", put_end_any_token)
    path = tmp_path / "mutant.trace"
    monkeypatch.setenv(tracing.ENV, str(path))
    with kvproto.embedded(storage_nodes=2, segment_size="4MiB") as cluster:
        raw = Raw(cluster.master_address)
        try:
            stale_put_end(cluster, raw)
        finally:
            raw.close()
    stale = steps_of(path, "PutEnd")[0]
    assert stale["effects"][0]["type"] == "Published"
    assert cli.main(["trace", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"publish: step {stale['n']} (line " in out, out
    assert "lease: all " in out, out                   # the lease steps are the spec's


# --- the lease machine -----------------------------------------------------------

KiB = 1024
TTL = 2.0


def fill(c, keys, size=100 * KiB) -> None:
    """Put ``size`` bytes under each key, waiting out NoSpace while the regions
    an eviction freed drain at their node."""
    for k in keys:
        deadline = time.monotonic() + 30
        while True:
            try:
                c.put(k, k * (size // len(k)) + b"." * (size % len(k)))
                break
            except errors.NoSpace:
                assert time.monotonic() < deadline, "the evicted regions were never freed"
                time.sleep(0.02)


@pytest.fixture(scope="module")
def leased(tmp_path_factory) -> Path:
    """A short real run of the lease table (one 1 MiB segment, a 2 s lease):
    gets (each a lease, released with the next request), a lease held and
    renewed while eviction passes over its object, its release and the
    eviction that then takes it, a lease left to expire (its renewal refused,
    its late release refused), and at the end an operator's forced remove of a
    leased object. Nothing is asserted here (a mutant may change the run)."""
    path = tmp_path_factory.mktemp("traces") / "leases.trace"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tracing.ENV, str(path))
        with kvproto.embedded(storage_nodes=1, segment_size="1MiB", lease_ttl=TTL) as cluster:
            c = cluster.client()
            keys = [f"ev{i}".encode() for i in range(12)]
            fill(c, keys[:9])                             # 900 KiB of 1 MiB: under 0.90
            (held,) = c.read_begin([keys[0]])             # ev0: held, and least recent below
            c.renew([held])
            for k in keys[1:9]:
                c.get(k)
            fill(c, keys[9:10])                           # past the watermark: ev1, ev2 go
            with contextlib.suppress(errors.LeaseExpired):   # what a mutant evicting ev0 answers
                c.release([held])
            fill(c, keys[10:12])                          # past it again: ev0 goes
            (late,) = c.read_begin([keys[11]])
            time.sleep(TTL + 0.1)                         # granted before this: expired
            c.renew([late])                               # LeaseExpired
            with pytest.raises(errors.LeaseExpired):
                c.release([late])
            c.read_begin([keys[10]])
            c.remove(keys[10], force=True)
    return path


def lease_kinds(path: Path) -> set:
    out = set()
    for s in lines(path, "lease"):
        if "event" in s:
            refused = s["effects"] and s["effects"][0]["type"] == "Refused"
            by = " by " + s["by"] if "by" in s else ""
            out.add(s["event"]["type"] + (" refused" if refused else "") + by)
    return out


def test_a_lease_run_records_every_kind_of_step(leased):
    assert lease_kinds(leased) >= {"Tick", "Put", "Grant", "Renew", "Renew refused", "Release",
                                   "Release refused", "Evict", "Remove", "Release by forced"}
    ended = [s for s in steps_of(leased, "Tick", "lease") if s["effects"]]
    assert ended and ended[0]["effects"][0]["type"] == "LeaseEnded"
    header = lines(leased, "lease")[0]["opened"]
    assert header["ttl"] == TTL and header["objects"] == 0


@needs_java
def test_a_recorded_lease_run_is_a_behaviour_of_the_spec(leased, tmp_path):
    """Every lease step up to the forced remove is a step of spec/Lease.tla;
    the forced remove (outside the spec) is where checking stops."""
    verdict = leasetrace.check_lines(traces.read(leased)["lease"], keep=tmp_path)
    forced = [s for s in lines(leased, "lease") if s.get("by") == "forced"][0]
    assert verdict.ok, verdict.message
    assert verdict.steps == forced["n"] - 1
    assert f"before step {forced['n']} are steps of spec/Lease.tla" in verdict.message
    assert "forced remove" in verdict.message
    cfg = (tmp_path / "LeaseTrace.cfg").read_text()
    assert "Pressure <- TracePressure" in cfg and "MaxSkew = 0" in cfg


def _grant_for_longer(row):
    """The master grants a lease for twice its TTL."""
    if row["effects"][0]["type"] != "LeaseGranted":
        return False
    row["effects"][0]["expires"] += TTL
    return True


def _forget_an_expiry(row):
    """A tick that reached a lease's expiry does not end it."""
    if not row["effects"]:
        return False
    row["effects"] = []
    return True


def _renew_the_expired(row):
    """The renewal of the lease that expired is granted."""
    if row["effects"][0]["type"] != "Refused":
        return False
    row["effects"] = [{"type": "LeaseRenewed", "holder": row["event"]["holder"], "key": "ev11",
                       "expires": 1e9}]
    return True


def _refuse_a_held_release(row):
    """The release of a lease the reader holds is refused."""
    if row["effects"][0]["type"] != "LeaseReleased":
        return False
    row["effects"] = [{"type": "Refused", "error": {"type": "LeaseExpired", "message": "x"}}]
    return True


@needs_java
@pytest.mark.parametrize("kind, change", [
    ("Grant", _grant_for_longer),
    ("Tick", _forget_an_expiry),
    ("Renew", _renew_the_expired),
    ("Release", _refuse_a_held_release),
])
def test_a_lease_step_changed_by_hand_is_rejected_with_its_number(leased, tmp_path, kind, change):
    bad = tmp_path / "bad.trace"
    n = corrupt(leased, bad, kind, change, machine="lease")
    verdict = check_one(bad, "lease")
    assert not verdict.ok
    assert verdict.failed_step == n, verdict.message
    assert f"step {n} " in verdict.message and kind in verdict.message


@needs_java
def test_a_master_whose_eviction_takes_leased_objects_leaves_the_spec(tmp_path, monkeypatch):
    """The runtime mutant ``evict-ignores-leases`` (kvproto mutate): eviction
    passes over no lease, so the object a reader holds is evicted, its lease
    dropped by the master. Nothing in the run fails (the reader has not read
    yet; its late release is answered LeaseExpired, as for any lease that ran
    out); its lease trace is rejected at the dropped lease's Release."""
    def candidates_with_leased(self):
        rows = sorted((self._last[row], row) for row in self.rows.index.values()
                      if self._flags[row] & lease_core.CACHED)
        for _, row in rows:
            yield self.rows.keys[row], self._size[row]

    monkeypatch.setattr(lease_core.LeaseCore, "eviction_candidates", candidates_with_leased)
    monkeypatch.setattr(lease_core.LeaseCore, "reclaimable", lambda self, key: None)
    path = tmp_path / "mutant.trace"
    monkeypatch.setenv(tracing.ENV, str(path))
    with kvproto.embedded(storage_nodes=1, segment_size="1MiB", lease_ttl=30.0) as cluster:
        c = cluster.client()
        keys = [f"ev{i}".encode() for i in range(10)]
        fill(c, keys[:9])
        (held,) = c.read_begin([keys[0]])
        for k in keys[1:9]:
            c.get(k)
        fill(c, keys[9:])                     # past the watermark: ev0 goes, leased
        assert not c.exists(keys[0])
    dropped = [s for s in lines(path, "lease") if s.get("by") == "dropped"
               and s["effects"][0]["type"] == "LeaseReleased"]
    assert dropped and dropped[0]["during"]["type"] == "Remove"
    verdict = traces.check(path)
    assert verdict["publish"].ok, verdict["publish"].message
    assert not verdict["lease"].ok and verdict["lease"].failed_step == dropped[0]["n"], \
        verdict["lease"].message
    assert "by the master (dropped" in verdict["lease"].message


def takeover_trace(path: Path, quiet: float) -> dict:
    """A new master's lease table over two recovered objects (spec
    ``Takeover``), stepped and recorded as the master does on its clock (lease
    TTL 2 s, opened at 100.0, inherited objects leased for ``quiet``): a read
    of ``a``, a remove of ``b`` early, the release, a remove of ``b`` late.
    Returns the recorded lease steps by their ``n``."""
    from kvproto.statemachines import lease as lm
    core = lease_core.LeaseCore.restored(2.0, 100.0, [(b"a", (b"a", 3), 10), (b"b", (b"b", 4), 10)],
                                         quiet=quiet)
    recorder = tracing.Recorder(str(path))
    for now, event in [(100.5, lm.Grant(("c", 1), b"a")), (100.8, lm.Remove(b"b")),
                       (101.0, lm.Release(("c", 1))), (102.3, lm.Remove(b"b"))]:
        recorder.lease(core, lm.Tick(now))
        recorder.lease(core, event)
    recorder.close()
    return {s["n"]: s for s in lines(path, "lease") if "n" in s}


@needs_java
def test_a_takeover_keeps_what_it_recovered_leased_for_one_ttl(tmp_path, capsys):
    """The table opens with its recovered objects listed; the trace starts
    from the spec's Put of each and its Takeover. A remove refused within the
    quiet period and accepted after it (2.3 s > one TTL) are the spec's."""
    path = tmp_path / "takeover.trace"
    steps = takeover_trace(path, quiet=2.0 * 1.02 + 0.1)       # the master's margin
    assert steps[4]["effects"][0]["error"]["type"] == "ObjectLeased"
    assert steps[8]["effects"][0]["type"] == "Reclaimed"
    header = lines(path, "lease")[0]["opened"]
    assert header["objects"] == 2 and header["inherited"] == [["a", ["a", 3]], ["b", ["b", 4]]]
    verdict = leasetrace.check_lines(traces.read(path)["lease"], keep=tmp_path)
    assert verdict.ok and verdict.steps == 8, verdict.message
    assert "MaxTakeovers = 1" in (tmp_path / "LeaseTrace.cfg").read_text()
    # a publish run whose opened line does not list the directory it recovered
    # (an older master's) is not checked, said on stderr (status 2), while the
    # lease run still is
    path.write_text('{"machine": "publish", "opened": {"next_token": 5, "objects": 2, '
                    '"segments": {}}}\n' + path.read_text())
    assert cli.main(["trace", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "lease: all 8 steps are steps of spec/Lease.tla" in out
    assert err.startswith("kvproto trace: publish: ") and "does not list" in err


@needs_java
def test_a_takeover_that_forgets_the_old_leases_leaves_the_spec(tmp_path):
    """The runtime twin of Lease_Weak_ForgetLeasesOnTakeover: the new table
    counts nothing it recovered as leased (no quiet period), so it removes
    ``b`` 0.8 s after the takeover, while a lease of the old master may still
    protect it. The lease trace is rejected at that remove."""
    path = tmp_path / "forgets.trace"
    steps = takeover_trace(path, quiet=0.0)
    assert steps[4]["effects"][0]["type"] == "Reclaimed"
    verdict = leasetrace.check_lines(traces.read(path)["lease"])
    assert not verdict.ok and verdict.failed_step == 4, verdict.message
    assert "Remove(key='b')" in verdict.message


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 50.0), st.booleans()), max_size=60),
       st.floats(0.01, 20.0))
def test_any_run_of_times_maps_onto_ticks(times, ttl):
    """Ticks and the expiries of grants among them (``t + ttl``): the map keeps
    the order of every two times, puts the start at 0 and every expiry TTL
    ticks after its grant."""
    start = 100.0
    points = [start + t for t, _ in times]
    links = [(start + t, start + t + ttl) for t, granted in times if granted]
    spec_ttl, ticks = leasetrace.abstract_times(start, points, links)
    assert ticks[start] == 0 and spec_ttl >= 1
    order = sorted(ticks)
    assert all(ticks[a] < ticks[b] for a, b in zip(order, order[1:]))
    assert all(ticks[b] - ticks[a] == spec_ttl for a, b in links)


def test_times_map_onto_ticks_keeping_order_and_the_ttl():
    ttl, ticks = leasetrace.abstract_times(10.0, [10.5, 11.0, 12.2, 12.6, 13.1],
                                           [(10.5, 12.5), (11.0, 13.0)])
    assert ticks[10.0] == 0
    assert ticks[12.5] - ticks[10.5] == ticks[13.0] - ticks[11.0] == ttl
    order = sorted(ticks)
    assert [ticks[t] for t in order] == sorted(set(ticks.values()))   # strictly increasing
    assert ticks[12.2] < ticks[12.5] < ticks[12.6] < ticks[13.0] < ticks[13.1]
    _, ticks = leasetrace.abstract_times(10.0, [9.0, 11.0], [(10.0, 12.0)])
    assert ticks[9.0] < ticks[10.0] == 0 < ticks[11.0] < ticks[12.0]   # a Tick refused going back


@pytest.mark.parametrize("content, says", [
    (None, "cannot read"),
    ("not json\n", "not a JSON line"),
    ('{"machine": "publish", "n": 1}\n', "no 'opened' line first"),
    ('{"machine": "publish", "opened": {"next_token": 4, "objects": 2, "segments": {}}}\n',
     "recovered directory of 2 object(s) that its 'opened' line does not list"),
    ('{"machine": "publish", "opened": {"next_token": 4, "objects": 1, "segments": {}, '
     '"directory": {"a": {"status": "published"}}}}\n',
     "an object of the opened directory the checker cannot read"),
    ('{"machine": "publish", "opened": {"next_token": 1, "objects": 0, "segments": {}}}\n' * 2,
     "holds 2 runs"),
    ('{"machine": "lease", "n": 1, "event": {"type": "Tick", "now": 1.0}, "effects": []}\n',
     "no lease 'opened' line first"),
    ('{"machine": "lease", "opened": {"ttl": 5.0, "now": 0.0, "quiet_until": 5.1, "objects": 3}}\n',
     "opened with 3 recovered object(s)"),
    ('{"machine": "lease", "opened": {"ttl": 5.0, "now": 0.0, "quiet_until": 0, "objects": 0}}\n' * 2,
     "holds 2 lease tables"),
])
def test_a_trace_that_cannot_be_checked_is_one_line_and_status_2(tmp_path, capsys, content, says):
    path = tmp_path / "t.trace"
    if content is not None:
        path.write_text(content)
    assert cli.main(["trace", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvproto trace: ") and says in err and len(err.splitlines()) == 1


def test_trace_needs_an_action_and_a_file(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["trace"])
    assert stop.value.code == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_a_trace_file_the_master_cannot_write_is_one_line_and_status_2(tmp_path, capsys):
    bad = tmp_path / "no-such-dir" / "run.trace"
    assert cli.main(["master", "--listen", "tcp://127.0.0.1:*", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvproto master: cannot write the trace to {bad}: No such file or directory\n"


def _r(segment: str, offset: int, length: int = 100) -> pm.Replica:
    return pm.Replica(segment, offset, length)


def recovered_run(path: Path) -> Path:
    """A master that opened (term 2) with ``a`` and ``b`` recovered (tokens 3
    and 5, on s1 and s2; s3 empty), stepped and recorded as the master does:
    a read of ``a``, s2 lost, ``a`` repaired onto s3 and its copy listed, a put
    of ``c``, ``b`` removed, a put of ``a`` refused (it exists)."""
    core = DirectoryCore.restored({"s1": 1 << 20, "s2": 1 << 20, "s3": 1 << 20},
                                  [(b"a", 3, 100, (_r("s1", 0), _r("s2", 0)), 7, 2),
                                   (b"b", 5, 100, (_r("s1", 4096), _r("s2", 4096)), 9, 2)], 6)
    recorder = tracing.Recorder(str(path))
    recorder.opened(core, 2)

    def step(event, report=None):
        effects = core.step(event)
        recorder.publish(event, effects, core, report)
        return effects

    step(pm.ReadBegin(b"a"))
    step(pm.ReadEnd(b"a", 3))
    step(pm.SegmentLost("s2"))
    (started,) = [e for e in step(pm.RepairStart(b"a", 3, _r("s3", 0)))
                  if isinstance(e, pm.RepairStarted)]
    step(pm.ListReplica(b"a", "s3", started.repair), report={"copied": True})
    (granted, *_) = step(pm.PutStart(b"c", 100, (_r("s1", 8192), _r("s3", 4096))))
    step(pm.PutEnd(b"c", granted.token))
    step(pm.Remove(b"b"))
    assert isinstance(step(pm.PutStart(b"a", 100, (_r("s1", 12288), _r("s3", 8192))))[0],
                      pm.Refused)
    recorder.close()
    return path


def test_the_opened_line_lists_the_directory_as_the_master_opened_it(tmp_path):
    header = lines(recovered_run(tmp_path / "t.trace"), "publish")[0]["opened"]
    assert (header["term"], header["objects"], header["next_token"]) == (2, 2, 6)
    assert header["free"] == {"s1": (1 << 20) - 200, "s2": (1 << 20) - 200, "s3": 1 << 20}
    a = header["directory"]["a"]
    assert (a["status"], a["token"], a["length"], a["checksum"], a["requested"]) == \
        ("published", 3, 100, 7, 2)
    assert [(r["segment"], r["offset"]) for r in a["replicas"]] == [("s1", 0), ("s2", 0)]
    assert header["recovered"] == [["a", ["s1", "s2"]], ["b", ["s1", "s2"]]]


@needs_java
def test_a_run_from_a_recovered_directory_is_a_behaviour_of_the_spec(tmp_path):
    path = recovered_run(tmp_path / "t.trace")
    verdict = traces.check(path, keep=tmp_path)["publish"]
    assert verdict.ok and verdict.steps == 9, verdict.message
    module = (tmp_path / "PublishTrace.tla").read_text()
    # tokens 3 and 5 are the spec's 1 and 2; the run's from 6 on follow them
    opened = next(l for l in module.splitlines() if l.startswith("Opened == "))
    assert opened.count('status |-> "published"') == 2, opened
    assert "token |-> 1]" in opened and "token |-> 2]" in opened and "next |-> 3," in opened


def _opened_with(path: Path, out: Path, change) -> Path:
    rows = lines(path)
    change(rows[0]["opened"])
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _overlap(header):
    """``b`` recorded on the offsets of ``a``: a region holds one object, so
    the other's replicas are not its bytes."""
    for r in header["directory"]["b"]["replicas"]:
        r["offset"] = 0


def _on_a_lost_segment(header):
    """s2, which holds replicas of both, recorded as lost."""
    header["lost"] = ["s2"]


def _reissued(header):
    """The next token recorded below ``b``'s: the master would issue it again."""
    header["next_token"] = 5


@needs_java
@pytest.mark.parametrize("change, invariant", [
    (_overlap, "PublishedHasAllReplicasComplete"), (_on_a_lost_segment, "SpaceAccounted"),
    (_reissued, "TokensIssued")])
def test_an_opened_directory_the_spec_cannot_reach_is_rejected(tmp_path, change, invariant):
    path = _opened_with(recovered_run(tmp_path / "t.trace"), tmp_path / "bad.trace", change)
    verdict = traces.check(path)["publish"]
    assert not verdict.ok and verdict.failed_step is None, verdict.message
    assert f"invariant {invariant} is violated (the directory the run opened with" \
        in verdict.message


@needs_java
def test_a_step_on_an_object_the_directory_did_not_recover_is_rejected(tmp_path):
    def forget_b(header):
        del header["directory"]["b"]
        header["objects"] = 1
    path = _opened_with(recovered_run(tmp_path / "t.trace"), tmp_path / "bad.trace", forget_b)
    verdict = traces.check(path)["publish"]
    # the first step that names b: its remove (s2's loss left it a replica on
    # s1, and named it in no effect)
    assert not verdict.ok and verdict.failed_step == 8, verdict.message
    assert "Remove(key='b') -> Removed" in verdict.message
