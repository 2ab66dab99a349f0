"""Tenants on a store of real processes (spec/Tenancy.tla; docs/protocols/tenancy.md,
"In the runtime"): ``kvproto master --tenants FILE`` and ``kvproto storage
--tenants FILE``, clients with tokens."""

from __future__ import annotations

import pytest

import kvproto
from kvproto import errors
from kvproto.ops.metrics import master_samples

from runtime_helpers import Child, wait_for

pytestmark = pytest.mark.runtime

ALPHA, BETA, GAMMA = "alpha-token-7Qx2mZ0pW", "beta-token-Rk4vN8sLc", "gamma-token-3HdY9uTfe"
QUOTA = 64 << 10        # gamma's stored bytes

TENANTS = f"""
[tenants.alpha]
tokens = ["{ALPHA}"]
namespaces = ["default", "shared"]

[tenants.beta]
tokens = ["{BETA}"]

[tenants.gamma]
tokens = ["{GAMMA}"]
stored = {QUOTA}
"""


def _cli(*args: str) -> Child:
    return Child(f"""
        import sys
        from kvproto.cli import main
        sys.exit(main({list(args)!r}))
    """)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenancy") / "tenants.toml"
    path.write_text(TENANTS)
    started = [_cli("master", "--listen", "tcp://127.0.0.1:*", "--tenants", str(path))]
    try:
        line = started[0].readline()
        assert line.startswith("kvproto master listening on tcp://127.0.0.1:"), line
        address = line.rsplit(" ", 1)[1]
        for _ in range(2):
            node = _cli("storage", "--master", address, "--size", "4MiB", "--tenants", str(path))
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
    assert cli.main([*command, "--tenants", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tenants.alpha.stored" in err and "t0k3n" not in err
