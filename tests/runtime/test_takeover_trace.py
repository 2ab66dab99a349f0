"""The lease trace of a master that takes over (``kvproto trace check``,
:mod:`kvproto.checking.leasetrace`): real processes, the first master killed
while a reader holds a lease it granted; the new master's lease table opens
with what it recovered, inherited, and its recorded steps are a behaviour of
``spec/Lease.tla`` from the spec's ``Takeover``. The trace is checked before
what the client saw, so that a new master that forgets the old leases (the
mutant ``new-master-forgets-leases``) is caught by the trace."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

import kvproto
from kvproto import errors
from kvproto.checking import traces
from kvproto.runtime import tracing

import test_master_failover as failover
from runtime_helpers import wait_for

LEASE_TTL = 1.5


@pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
def test_a_new_masters_lease_trace_is_a_behaviour_of_the_spec(children, raw, tmp_path, monkeypatch):
    url = f"file://{tmp_path}/coordinator"
    path = tmp_path / "second.trace"
    a, a_addr = failover.start_master(children, url, LEASE_TTL)
    wait_for(lambda: failover.open_at(url, a_addr, raw), what="the first master open")
    monkeypatch.setenv(tracing.ENV, str(path))        # only the second master records
    b, b_addr = failover.start_master(children, url, LEASE_TTL)
    monkeypatch.delenv(tracing.ENV)
    failover.start_storage(children, url)
    client = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    wait_for(lambda: sum(s["live"] for s in client.stats()["segments"].values()) == 1,
             what="the storage node registered")
    client.put(b"held", failover.value(b"held"))
    client.put(b"other", failover.value(b"other"))
    reader = kvproto.Client(url, timeout=5.0, lookup_timeout=1.0)
    (held,) = reader.read_begin([b"held"])
    a.stop(signal.SIGKILL)
    wait_for(lambda: failover.open_at(url, b_addr, raw), timeout=20, what="the standby open")
    try:                                                  # the old master's lease may still run
        client.remove(b"held")
        early = "removed"
    except errors.ObjectLeased:
        early = "refused"
    assert bytes(client.get(b"other")) == failover.value(b"other")   # a lease of this master
    assert isinstance(reader.renew([held])[0], errors.LeaseExpired)  # an older term's lease id
    if early == "refused":
        wait_for(lambda: failover._removed(client, b"held"), timeout=10,
                 what="the remove after the quiet period")
    client.flush_releases()
    reader.close()
    client.close()

    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    opened = [s for s in recorded if s["machine"] == "lease" and "opened" in s]
    assert len(opened) == 1 and opened[0]["opened"]["objects"] == 2
    assert sorted(k for k, _ in opened[0]["opened"]["inherited"]) == ["held", "other"]
    verdicts = traces.check_each(path)
    assert isinstance(verdicts["publish"], traces.TraceError)     # a recovered directory
    lease = verdicts["lease"]
    assert lease.ok and lease.steps > 0, lease.message
    removed = [s for s in recorded if s["machine"] == "lease"
               and s.get("event", {}).get("type") == "Remove"]
    assert removed and removed[0]["event"]["key"] == "held"
    assert early == "refused"        # what the client saw (checked after the trace, which
                                     # rejects a new master that removed it at once)

