"""Runtime traces checked by TLC (``kvproto trace check``, :mod:`kvproto.checking.traces`).

A real run of an embedded cluster records its master's publish steps; TLC
finds every step to be a step of ``spec/Publish.tla``. The check can fail: a
trace with one step's effects changed by hand is rejected at that step, and so
is the run of a master whose directory publishes whatever token ``PutEnd``
names."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import zmq

import kvproto
from kvproto import cli, errors
from kvproto.checking import traces
from kvproto.cores.directory import DirectoryCore
from kvproto.runtime import tracing, wire
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


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(path: Path, kind: str) -> list[dict]:
    return [s for s in lines(path) if s.get("event", {}).get("type") == kind]


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
    assert first == {"machine": "publish", "opened": {"next_token": 1, "objects": 0, "segments": {}}}
    put = steps_of(recorded, "PutStart")[0]
    assert put["event"]["key"] == "a" and put["effects"][0]["type"] == "PutGranted"


@needs_java
def test_a_recorded_run_is_a_behaviour_of_the_spec(recorded, tmp_path, capsys):
    verdict = traces.check(recorded, keep=tmp_path)
    assert verdict.ok, verdict.message
    assert verdict.steps == len(lines(recorded)) - 1
    assert "EXTENDS Publish" in (tmp_path / "PublishTrace.tla").read_text()
    assert cli.main(["trace", "check", str(recorded)]) == 0
    assert f"all {verdict.steps} steps are steps of spec/Publish.tla" in capsys.readouterr().out


def corrupt(path: Path, out: Path, kind: str, change) -> int:
    """Write ``path`` to ``out`` with ``change`` applied to the first step of
    ``kind`` it accepts (returns True); that step's number."""
    rows, n = lines(path), None
    for row in rows:
        if n is None and row.get("event", {}).get("type") == kind and change(row):
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
    verdict = traces.check(bad)
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
    verdict = traces.check(path)
    assert not verdict.ok and verdict.failed_step == stale["n"], verdict.message
    assert cli.main(["trace", "check", str(path)]) == 1
    assert f"step {stale['n']} " in capsys.readouterr().out


@pytest.mark.parametrize("content, says", [
    (None, "cannot read"),
    ("not json\n", "not a JSON line"),
    ('{"machine": "publish", "n": 1}\n', "no 'opened' line first"),
    ('{"machine": "publish", "opened": {"next_token": 4, "objects": 2, "segments": {}}}\n',
     "recovered directory of 2 object(s)"),
    ('{"machine": "publish", "opened": {"next_token": 1, "objects": 0, "segments": {}}}\n' * 2,
     "holds 2 runs"),
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
