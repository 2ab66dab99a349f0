"""Tenants on a store of real processes (spec/Tenancy.tla; docs/protocols/tenancy.md,
"In the runtime"): ``kvproto master --tenants FILE`` and ``kvproto storage
--tenants FILE``, clients with tokens."""

from __future__ import annotations

import pytest

import kvproto
from kvproto import errors
from kvproto.ops.metrics import master_samples
from kvproto.runtime import wire

from runtime_helpers import Child, wait_for

pytestmark = pytest.mark.runtime

ALPHA, BETA, GAMMA = "alpha-token-7Qx2mZ0pW", "beta-token-Rk4vN8sLc", "gamma-token-3HdY9uTfe"
DELTA = "delta-token-Vb7pQ2wKe"
QUOTA = 64 << 10        # gamma's stored bytes
RATE = 64 << 10         # delta's write bandwidth (bytes per second) and burst

TENANTS = f"""
[tenants.alpha]
tokens = ["{ALPHA}"]
namespaces = ["default", "shared", "model-r1"]

[tenants.beta]
tokens = ["{BETA}"]

[tenants.gamma]
tokens = ["{GAMMA}"]
stored = {QUOTA}

[tenants.delta]
tokens = ["{DELTA}"]
write_rate = {RATE}
write_burst = {RATE}
"""


def _cli(*args: str) -> Child:
    return Child(f"""
        import sys
        from kvproto.cli import main
        sys.exit(main({list(args)!r}))
    """)


TICKET_KEY = "a1" * 32     # the read tickets' key, shared by the master and the nodes


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenancy") / "tenants.toml"
    path.write_text(TENANTS)
    key = path.parent / "ticket.key"
    key.write_text(TICKET_KEY + "\n")
    tenancy = ("--tenants", str(path), "--ticket-key", str(key))
    started = [_cli("master", "--listen", "tcp://127.0.0.1:*", *tenancy)]
    try:
        line = started[0].readline()
        assert line.startswith("kvproto master listening on tcp://127.0.0.1:"), line
        address = line.rsplit(" ", 1)[1]
        for _ in range(2):
            node = _cli("storage", "--master", address, "--size", "4MiB", *tenancy)
            started.append(node)
            assert node.readline().startswith("kvproto storage listening on")
        alpha = kvproto.Client(address, token=ALPHA, timeout=10.0)
        wait_for(lambda: sum(s["live"] for s in alpha.stats()["segments"].values()) == 2,
                 timeout=20.0, what="two storage nodes")
        clients: list = [alpha]

        def client(token, **kwargs):
            c = kvproto.Client(address, token=token, timeout=10.0, **kwargs)
            clients.append(c)
            return c
        yield address, client, started
        for c in clients:
            c.close()
    finally:
        for child in reversed(started):
            child.stop()


def test_a_stolen_key_name_names_another_object(store):
    _, client, _ = store
    alpha, beta = client(ALPHA), client(BETA)
    alpha.put(b"prompt-1", b"A" * 5000, replicas=2)
    beta.put(b"prompt-1", b"B" * 3000)          # the same key string: beta's own object
    assert bytes(alpha.get(b"prompt-1")) == b"A" * 5000
    assert bytes(beta.get(b"prompt-1")) == b"B" * 3000
    assert beta.keys(b"prompt-") == [b"prompt-1"] and alpha.keys(b"prompt-") == [b"prompt-1"]
    beta.remove(b"prompt-1")                     # removes beta's, never alpha's
    assert not beta.exists(b"prompt-1")
    assert bytes(alpha.get(b"prompt-1")) == b"A" * 5000
    # beta naming alpha's namespace: no read without a grant, no write at all
    thief = client(BETA, namespace="alpha/default")
    for attempt in (lambda: thief.get(b"prompt-1"), lambda: thief.exists(b"prompt-1"),
                    lambda: thief.keys(), lambda: thief.put(b"prompt-1", b"X"),
                    lambda: thief.remove(b"prompt-1")):
        with pytest.raises(errors.AccessDenied):
            attempt()
    assert bytes(alpha.get(b"prompt-1")) == b"A" * 5000


def test_a_grant_then_its_revocation(store):
    _, client, _ = store
    owner = client(ALPHA, namespace="shared")
    reader = client(BETA, namespace="alpha/shared")
    owner.put(b"doc", b"D" * 4096)
    with pytest.raises(errors.AccessDenied):
        reader.get(b"doc")
    owner.grant("beta")
    assert bytes(reader.get(b"doc")) == b"D" * 4096
    with pytest.raises(errors.AccessDenied):     # a read grant is read-only
        reader.put(b"doc-2", b"x")
    leases = reader.read_begin([b"doc"])         # a read in flight when the grant goes
    owner.revoke("beta")
    with pytest.raises(errors.AccessDenied):     # the next read is refused at once
        reader.get(b"doc")
    assert isinstance(reader.renew(leases)[0], errors.AccessDenied)   # and no renewal
    reader.release(leases)                       # the read in flight ends under its lease
    with pytest.raises(errors.AccessDenied):     # only the owner grants
        client(BETA).grant("gamma", namespace="alpha/shared")
    assert bytes(owner.get(b"doc")) == b"D" * 4096


def test_a_tenant_past_its_stored_bytes_is_refused_and_nothing_changes(store):
    _, client, _ = store
    gamma = client(GAMMA)
    gamma.put(b"first", b"g" * (QUOTA - 1000))
    before = gamma.stats()
    with pytest.raises(errors.QuotaExceeded):
        gamma.put(b"second", b"g" * 2000)
    after = gamma.stats()
    assert after["tenants"] == before["tenants"]
    assert after["tenants"]["gamma"]["held"] == QUOTA - 1000
    assert after["objects"] == before["objects"] and after["pending"] == before["pending"]
    assert not gamma.exists(b"second")
    assert set(after["tenants"]) == {"gamma"}    # a tenant sees its own usage only
    assert ("kvproto_stored_bytes", {"segment": "", "tenant": "gamma", "namespace": "default"},
            QUOTA - 1000) in master_samples(after)
    gamma.remove(b"first")                       # freed bytes count again
    gamma.put(b"second", b"g" * 2000)
    assert gamma.stats()["tenants"]["gamma"]["held"] == 2000


def _items(reply):
    assert reply.status == 0, reply.body
    err, value = wire.item_result(reply.body["items"][0])
    return err, value


def test_an_upgrade_canary_prewarm_switch_route_back_and_drop(store, raw):
    address, client, _ = store
    old = client(ALPHA, namespace="model-r1")
    old.put(b"prefix-1", b"1" * 3000, replicas=2)
    old.put(b"only-old", b"o" * 100)
    old.ns_create("model-r2", previous="model-r1")          # a canary
    new = client(ALPHA, namespace="model-r2")
    assert not new.exists(b"prefix-1")                       # old and new never cross
    new.put(b"prefix-1", b"2" * 2000)                        # a canary write, the same key
    assert bytes(old.get(b"prefix-1")) == b"1" * 3000
    assert bytes(new.get(b"prefix-1")) == b"2" * 2000
    with pytest.raises(errors.KeyNotFound):
        new.get(b"only-old")
    with pytest.raises(errors.InvalidArgument):              # a canary is not switched
        old.ns_switch("model-r2")
    old.ns_prewarm("model-r2")
    new.put(b"hot", b"h" * 500)                              # recomputed into the new one
    assert new.keys() == [b"hot", b"prefix-1"] and old.keys() == [b"only-old", b"prefix-1"]
    # only the owner steps its namespaces
    beta = client(BETA)
    for attempt in (lambda: beta.ns_switch("alpha/model-r2"),
                    lambda: beta.ns_create("alpha/x", previous="alpha/model-r1"),
                    lambda: beta.ns_create("x", previous="alpha/model-r1")):
        with pytest.raises(errors.AccessDenied):
            attempt()
    assert "alpha/model-r2" not in beta.ns_list()
    old.ns_switch("model-r2")
    listed = old.ns_list()
    assert listed["model-r2"]["phase"] == "live" and listed["model-r1"]["phase"] == "retiring"
    with pytest.raises(errors.NamespaceClosed):              # the retiring one takes no writes
        old.put(b"late", b"x")
    wait_for(lambda: not old.exists(b"prefix-1"), what="the retiring namespace aging out")
    assert alpha_counter(old, "aged_out") >= 2
    new.put(b"after-switch", b"a" * 700)
    # a write in progress in the new namespace when it is routed back
    master = raw(address)
    started = master.call("put_start", {
        "client": "inspector", "replicas": 1, "items": [[b"in-progress", 100]],
        "cred": ALPHA.encode(), "ns": "model-r2"})
    err, grant = _items(started)
    assert err is None
    (seg, offset, _), = grant["replicas"]
    wrote = raw(started.body["segments"][seg][0]).call(      # its bytes are written ...
        "write", {"segment": seg, "offset": offset, "token": grant["token"],
                  "term": started.body["term"], "cred": ALPHA.encode()}, payloads=[b"w" * 100])
    assert wrote.status == 0, wrote.body
    old.ns_route_back("model-r2")                            # ... but not yet published
    listed = old.ns_list()
    assert listed["model-r1"]["phase"] == "live" and listed["model-r2"]["phase"] == "held"
    err, _ = _items(master.call("put_end", {"client": "inspector", "cred": ALPHA.encode(),
                                            "ns": "model-r2",
                                            "items": [[b"in-progress", grant["token"]]]}))
    assert isinstance(err, errors.StaleToken)                # abandoned at the route back
    assert not new.exists(b"in-progress")
    with pytest.raises(errors.NamespaceClosed):              # writes to it stop
        new.put(b"more", b"x")
    # its objects are kept, readable by their owner for inspection, and not removable
    assert new.keys() == [b"after-switch", b"hot", b"prefix-1"]
    assert bytes(new.get(b"prefix-1")) == b"2" * 2000
    with pytest.raises(errors.NamespaceClosed):
        new.remove(b"hot")
    old.put(b"prefix-1", b"3" * 1000)                        # the old one is live again
    assert bytes(old.get(b"prefix-1")) == b"3" * 1000
    assert bytes(new.get(b"prefix-1")) == b"2" * 2000
    assert listed["model-r2"]["objects"] == 3
    old.ns_drop("model-r2")                                  # inspection over: it ages out
    wait_for(lambda: not new.keys(), what="the dropped namespace aging out")
    assert old.ns_list()["model-r2"]["phase"] == "retiring"
    assert bytes(old.get(b"prefix-1")) == b"3" * 1000


def alpha_counter(client, name):
    return client.stats()["counters"][name]


def test_the_ns_command_steps_and_lists_namespaces(store, tmp_path, monkeypatch, capsys):
    from kvproto import cli
    address, client, _ = store
    token = tmp_path / "token"
    token.write_text(GAMMA + "\n")
    assert cli.main(["ns", "create", "gamma-r2", "--from", "default", "--master", address,
                     "--token-file", str(token)]) == 0
    monkeypatch.setenv("KVPROTO_TOKEN", GAMMA)
    assert cli.main(["ns", "prewarm", "gamma-r2", "--master", address]) == 0
    capsys.readouterr()
    assert cli.main(["ns", "list", "--master", address]) == 0
    out = capsys.readouterr().out
    assert "gamma-r2: warming, 0 object(s), 0 bytes, upgrades default" in out
    assert GAMMA not in out
    for mistake in (["ns", "switch", "--master", address],                     # no name
                    ["ns", "create", "x", "--master", address],                # no --from
                    ["ns", "switch", "no-such", "--master", address],          # refused
                    ["ns", "create", "bad/name!", "--from", "default", "--master", address],
                    ["ns", "drop", "gamma-r2", "--master", address],           # not held
                    ["ns", "list", "--master", address, "--token-file", str(tmp_path / "none")]):
        assert cli.main(mistake) == 2, mistake
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvproto ns") and GAMMA not in err
    monkeypatch.setenv("KVPROTO_TOKEN", "not-a-token")
    assert cli.main(["ns", "list", "--master", address]) == 2
    assert "credential" in capsys.readouterr().err
    assert client(GAMMA).ns_list()["gamma-r2"]["phase"] == "warming"


def _p50(samples):
    return sorted(samples)[len(samples) // 2]


def test_a_tenant_hammering_past_its_write_bandwidth_leaves_another_tenants_gets_alone(
        store, tmp_path):
    import json
    import time
    address, client, _ = store
    beta = client(BETA)
    keys = [b"warm-%d" % i for i in range(16)]
    for k in keys:
        beta.put(k, k * 200)

    def gets(rounds):
        took = []
        for i in range(rounds):
            k = keys[i % len(keys)]
            started = time.perf_counter()
            assert bytes(beta.get(k)) == k * 200         # every one of beta's gets succeeds
            took.append(time.perf_counter() - started)
        return took

    gets(50)
    baseline = _p50(gets(300))
    stop = tmp_path / "stop"
    hammer = Child(f"""
        import json, os, kvproto
        from kvproto import errors
        c = kvproto.Client({address!r}, token={DELTA!r}, timeout=10.0)
        accepted, refused, other, i = [], [], [], 0
        while not os.path.exists({str(stop)!r}):
            key = b"h-%d" % i
            i += 1
            try:
                c.put(key, b"x" * 16384)
                accepted.append(key.decode())
            except errors.QuotaExceeded:
                refused.append(key.decode())
                if len(refused) == 1:
                    print("hammering", flush=True)
            except errors.KvError as err:
                other.append(repr(err))
        print(json.dumps({{"accepted": accepted, "refused": refused, "other": other}}), flush=True)
        c.close()
    """)
    try:
        assert hammer.readline(timeout=60.0) == "hammering"
        under = gets(300)
        stop.touch()
        result = json.loads(hammer.readline(timeout=60.0))
    finally:
        stop.touch()
        hammer.stop()
    assert not result["other"], result["other"][:3]
    assert len(result["refused"]) > 10 * len(result["accepted"]) > 0
    # a refused write changed nothing: delta holds exactly what it was let write
    delta = client(DELTA)
    assert delta.stats()["tenants"]["delta"]["held"] == 16384 * len(result["accepted"])
    assert sorted(delta.keys(b"h-")) == sorted(k.encode() for k in result["accepted"])
    # generous, relative to the baseline of this run (and a floor of 1 ms for it)
    assert _p50(under) <= 10 * max(baseline, 0.001), (baseline, _p50(under))


def test_tenants_objects_survive_a_master_failover(tmp_path):
    import signal
    url = f"file://{tmp_path}/coordinator"
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "ticket.key").write_text(TICKET_KEY)
    tenancy = ("--tenants", str(tmp_path / "tenants.toml"),
               "--ticket-key", str(tmp_path / "ticket.key"))
    masters = ("master", "--listen", "tcp://127.0.0.1:*", "--coordinator", url, "--ttl", "1",
               "--fence-timeout", "3", *tenancy)
    started: list = []
    clients: list = []

    def client(token, **kwargs):
        c = kvproto.Client(url, token=token, timeout=20.0, local_reads=False, **kwargs)
        clients.append(c)
        return c
    try:
        first = _cli(*masters)
        started.append(first)
        assert first.readline().startswith("kvproto master listening on")
        standby = _cli(*masters, "--standby")
        started.append(standby)
        assert standby.readline().startswith("kvproto master listening on")
        for _ in range(2):
            node = _cli("storage", "--master", url, "--size", "4MiB", *tenancy)
            started.append(node)
            assert node.readline().startswith("kvproto storage listening on")
        alpha = client(ALPHA)
        wait_for(lambda: sum(s["live"] for s in alpha.stats()["segments"].values()) == 2,
                 timeout=30.0, what="two storage nodes")
        alpha.put(b"kept", b"A" * 5000, replicas=2)
        client(BETA).put(b"kept", b"B" * 3000)
        alpha.ns_create("model-r2", previous="model-r1")       # a namespace made at run time
        client(ALPHA, namespace="model-r2").put(b"kept", b"N" * 1000)
        client(GAMMA).put(b"first", b"g" * (QUOTA - 1000))
        first.stop(signal.SIGKILL)

        def took_over():
            try:
                failover = alpha.stats(timeout=2.0)["failover"]
            except errors.KvError:
                return False
            return failover["term"] >= 2 and failover["phase"] == "open"
        wait_for(took_over, timeout=60.0, what="the standby taking over")
        # each tenant's objects, rebuilt from their keys, under the same rules
        assert bytes(alpha.get(b"kept")) == b"A" * 5000         # under a new master's tickets
        assert bytes(client(BETA).get(b"kept")) == b"B" * 3000
        assert bytes(client(ALPHA, namespace="model-r2").get(b"kept")) == b"N" * 1000
        with pytest.raises(errors.AccessDenied):
            client(BETA, namespace="alpha/default").get(b"kept")
        gamma = client(GAMMA)
        assert gamma.stats()["tenants"]["gamma"]["held"] == QUOTA - 1000
        with pytest.raises(errors.QuotaExceeded):               # its bytes count again
            gamma.put(b"second", b"g" * 2000)
        assert alpha.stats()["tenants"]["alpha"]["held"] == 2 * 5000 + 1000
        # a namespace made at run time is back live, with no predecessor
        assert alpha.ns_list()["model-r2"] == {"phase": "live", "objects": 1, "bytes": 1000,
                                               "previous": None, "grants": []}
    finally:
        for c in clients:
            c.close()
        for child in reversed(started):
            child.stop()


def test_a_new_master_sets_up_what_it_recovered_and_orphans_what_no_tenant_reaches():
    from kvproto.ops.tenants import object_key, parse_tenants
    from kvproto.runtime.tenanted import Tenants
    tenants = Tenants(parse_tenants({"tenants": {"alpha": {"tokens": [ALPHA], "stored": 10000},
                                                 "beta": {"tokens": [BETA]}}}),
                      ttl=5.0, clock=lambda: 1.0, ticket_key=TICKET_KEY.encode())

    # each as the directory charges it: its length times the replica count
    # its put requested. "a" (3000 bytes) lost one of its two replicas before
    # the takeover: charged for both, as its put was (the repair restores one
    # its owner already pays for)
    objects = [(object_key(("alpha", "default"), b"a"), 3000 * 2),
               (object_key(("alpha", "later"), b"b"), 1000),     # made at run time
               (object_key(("alpha", "default"), b"big"), 5000),  # over alpha's quota
               (object_key(("zeta", "default"), b"z"), 10),       # no such tenant
               (object_key(("zeta", "default"), b"z2"), 10),      # (its namespace tried once)
               (b"plain-key", 10),                                # no namespace at all
               (b"", 10),
               (object_key(("alpha", "default"), b"c"), 1000)]
    tenants.recovered([k for k, _ in objects], [n for _, n in objects])
    orphans = [objects[2][0], objects[3][0], objects[4][0], b"plain-key", b""]
    assert tenants.orphans == orphans
    assert tenants.usage("alpha")["alpha"]["held"] == 8000
    assert tenants.usage("alpha")["alpha"]["namespaces"] == {"default": 7000, "later": 1000}
    assert tenants.namespaces("alpha")["later"]["phase"] == "live"
    assert tenants.aged(lambda k: k not in (b"plain-key", b"")) == orphans[:3]   # still present
    for key in orphans:                    # removing an orphan touches no tenant
        tenants.removed(key)
    assert tenants.usage()["alpha"]["held"] == 8000 and tenants.usage()["beta"]["held"] == 0


def test_a_bad_or_missing_token_is_unauthorized_and_the_store_keeps_serving(store, raw):
    address, client, _ = store
    alpha = client(ALPHA)
    alpha.put(b"kept", b"K" * 100)
    for token in (None, "not-a-token-of-anyone"):
        stranger = client(token)
        with pytest.raises(errors.Unauthorized):
            stranger.put(b"kept", b"x")
        with pytest.raises(errors.Unauthorized):
            stranger.stats()
    segments = [s["endpoint"] for s in alpha.stats()["segments"].values() if s["live"]]
    for endpoint in segments:                    # storage nodes authenticate too
        node = raw(endpoint)
        assert node.call("stats", {}).status == errors.Unauthorized.code
        assert node.call("stats", {"cred": b"wrong"}).status == errors.Unauthorized.code
        assert node.call("stats", {"cred": BETA.encode()}).status == 0
    assert bytes(alpha.get(b"kept")) == b"K" * 100
    assert alpha.stats()["counters"]["unauthorized"] >= 4


def test_tokens_never_reach_a_repr_or_the_servers_logs(store):
    _, client, started = store
    alpha = client(ALPHA)
    assert ALPHA not in repr(alpha) and ALPHA[:16] not in repr(alpha)
    alpha.put(b"logged", b"1")
    for child in started:
        assert not any(t[:16] in child.stderr() for t in (ALPHA, BETA, GAMMA))


def test_without_a_tenants_file_the_store_is_one_shared_key_space():
    with kvproto.embedded(1, "4MiB") as cluster:
        plain, with_token = cluster.client(), cluster.client(token=ALPHA)
        plain.put(b"k", b"v")
        assert bytes(with_token.get(b"k")) == b"v"     # a token is not asked for
        assert "tenants" not in plain.stats()
        with pytest.raises(errors.InvalidArgument):    # nor are namespaces kept apart
            cluster.client(namespace="other").get(b"k")
        with pytest.raises(errors.InvalidArgument):
            plain.grant("beta")
        with pytest.raises(errors.InvalidArgument):    # nor an upgrade lifecycle
            plain.ns_list()


def test_eviction_never_takes_a_tenant_within_its_reserve():
    from kvproto.ops.tenants import parse_tenants
    tenants = parse_tenants({"tenants": {
        "alpha": {"tokens": [ALPHA], "reserve": "8MiB"},
        "beta": {"tokens": [BETA]}}})
    with kvproto.embedded(1, "4MiB", tenants=tenants, high_watermark=0.5,
                          free_fraction=0.1) as cluster:
        alpha, beta = cluster.client(token=ALPHA), cluster.client(token=BETA)
        for i in range(6):                       # the least recently used: alpha's
            alpha.put(b"a-%d" % i, b"a" * (256 << 10))
        for i in range(6):                       # past the high watermark
            beta.put(b"b-%d" % i, b"b" * (256 << 10))
        assert alpha.stats()["counters"]["evictions"] > 0
        assert all(alpha.exists(b"a-%d" % i) for i in range(6))
        assert not all(beta.exists(b"b-%d" % i) for i in range(6))


@pytest.mark.parametrize("command", [["master", "--listen", "tcp://127.0.0.1:*"],
                                     ["storage", "--master", "tcp://127.0.0.1:1", "--size", "1MiB"]])
def test_a_bad_tenants_file_is_one_line_and_status_2(command, tmp_path, capsys):
    from kvproto import cli
    bad = tmp_path / "tenants.toml"
    bad.write_text('[tenants.alpha]\ntokens = ["t0k3n-of-alpha"]\nstored = "lots"\n')
    key, short = tmp_path / "ticket.key", tmp_path / "short.key"
    key.write_text(TICKET_KEY)
    short.write_text("k3y-too-short")
    good = tmp_path / "good.toml"
    good.write_text(TENANTS)
    for args, says in (([*command, "--tenants", str(bad), "--ticket-key", str(key)],
                        "tenants.alpha.stored"),
                       ([*command, "--tenants", str(good)], "--ticket-key"),
                       ([*command, "--ticket-key", str(key)], "goes with --tenants"),
                       ([*command, "--tenants", str(good), "--ticket-key", str(short)],
                        "at least 32"),
                       ([*command, "--tenants", str(good), "--ticket-key", str(tmp_path / "no")],
                        "cannot read ticket key file")):
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
        assert "t0k3n" not in err and "k3y" not in err and TICKET_KEY not in err


def test_tenant_key_prints_a_ticket_key_a_node_loads(tmp_path, capsys):
    from kvproto import cli
    from kvproto.ops.tenants import load_ticket_key
    assert cli.main(["tenant", "key"]) == 0
    key = capsys.readouterr().out.strip()
    assert len(key) == 64 and int(key, 16) >= 0
    (tmp_path / "k").write_text(key + "\n")
    assert load_ticket_key(tmp_path / "k") == key.encode()


def test_a_tenant_guessing_a_region_token_reads_nothing(store, raw):
    import time
    from kvproto.ops.tenants import REPAIR_READER, Tickets
    _, client, _ = store
    alpha = client(ALPHA, local_reads=False)     # every read goes through a node's check
    alpha.put(b"secret", b"S" * 4096, replicas=2)
    assert bytes(alpha.get(b"secret")) == b"S" * 4096          # served under its tickets
    lease = alpha.read_begin([b"secret"])[0]
    assert len(lease.tickets) == 2
    term = alpha.stats()["failover"]["term"]
    (seg, offset, length), (other_seg, other_offset, _) = lease.replicas
    node = raw(lease.segments[seg][0])
    where = {"segment": seg, "offset": offset, "token": lease.token, "term": term,
             "length": length}
    load = {**where, "owner": "guesser", "xfer": 1, "buffer": "b0"}
    counters = lambda: node.call("stats", {"cred": ALPHA.encode()}).body["counters"]  # noqa: E731
    before = counters()
    now_ms = int(time.time() * 1000)
    forged = Tickets(b"not-the-store-key-but-as-long-as-one-0123")
    refused = [
        (BETA, None),                                    # beta guessed the location and token
        (BETA, lease.tickets[0]),                        # ... and stole alpha's ticket
        (BETA, forged.issue("beta", seg, offset, lease.token, now_ms + 60_000)),
        (BETA, [now_ms + 60_000, lease.tickets[0][1]]),  # alpha's MAC, a later expiry
        (ALPHA, None),                                   # the owner, without its ticket
        (ALPHA, lease.tickets[1]),                       # the other replica's ticket
        (ALPHA, Tickets(TICKET_KEY.encode()).issue(      # a ticket of the key, expired
            "alpha", seg, offset, lease.token, now_ms - 1)),
    ]
    for tenant, ticket in refused:
        for op, body in (("read", where), ("load", load)):
            body = {**body, "cred": tenant.encode(), **({"ticket": ticket} if ticket else {})}
            reply = node.call(op, body)
            assert reply.status == errors.TicketRefused.code, (tenant, op, reply.body)
            assert not reply.payloads
    after = counters()
    assert after["tickets_refused"] - before["tickets_refused"] == 2 * len(refused)
    for name in ("reads", "loads", "bytes_read", "refused"):     # nothing else ran
        assert after[name] == before[name], name
    # a read with no credential is a repair copier's: served only under a
    # ticket issued to the repair reader, never under a tenant's; and no
    # tenant reads under a repair reader's ticket
    repair = Tickets(TICKET_KEY.encode()).issue(REPAIR_READER, seg, offset, lease.token,
                                                now_ms + 60_000)
    for body in ({**where}, {**where, "ticket": lease.tickets[0]},
                 {**where, "cred": ALPHA.encode(), "ticket": repair},
                 {**where, "ticket": Tickets(TICKET_KEY.encode()).issue(
                     REPAIR_READER, seg, offset, lease.token, now_ms - 1)}):
        reply = node.call("read", body)
        assert reply.status == errors.TicketRefused.code and not reply.payloads, body
    assert counters()["reads"] == before["reads"]
    copied = node.call("read", {**where, "ticket": repair})
    assert copied.status == 0 and bytes(copied.payloads[0]) == b"S" * 4096
    served = node.call("read", {**where, "cred": ALPHA.encode(), "ticket": lease.tickets[0]})
    assert served.status == 0 and bytes(served.payloads[0]) == b"S" * 4096
    renewed = alpha.renew([lease])                               # a renewal renews the tickets
    assert renewed == [None] and lease.tickets[0][0] >= now_ms
    assert raw(lease.segments[other_seg][0]).call("read", {
        **where, "segment": other_seg, "offset": other_offset, "cred": ALPHA.encode(),
        "ticket": lease.tickets[1]}).status == 0
    alpha.release([lease])
    # a transfer engine's loads carry their tickets too
    engine = alpha.transfer_engine(buffers=1, buffer_size=8192)
    request = engine.request()
    buf = request.acquire()
    got = request.consume(request.get_into(b"secret", buf, timeout=10.0))
    assert bytes(got[:4096]) == b"S" * 4096
    request.finish()
    engine.close()
