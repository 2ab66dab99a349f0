"""The tenants file, credentials, the write-bandwidth bucket and the registry
(kvproto/ops/tenants.py, kvproto/statemachines/tenancy.py): property tests,
typed one-line mistakes, and tokens that never show up in a log, an error, a
repr or the CLI's output."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from kvproto import cli, errors
from kvproto.ops import tenants as ten
from kvproto.statemachines import tenancy as tm

ALPHA = ten.new_token()
ALPHA2 = ten.new_token()
BETA = ten.new_token()
TOKENS = (ALPHA, ALPHA2, BETA)

FILE = f"""
[tenants.alpha]
tokens = ["{ALPHA}", "{ALPHA2}"]
stored = "64KiB"
write_rate = "16KiB"
write_burst = "32KiB"
in_flight = "48KiB"
reserve = "8KiB"
namespaces = ["default", "llama-r2"]
grants = {{ default = ["beta"] }}

[tenants.beta]
token_sha256 = ["{ten.token_digest(BETA).hex()}"]
stored = 4096
"""


def toml(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def parse(text: str):
    return ten.parse_tenants(toml(text))


def registry(now: float = 0) -> ten.Registry:
    return ten.Registry(parse(FILE), capacity=1 << 20, ttl=2.0, now=now)


# --- the bucket --------------------------------------------------------------------

@given(rate=st.sampled_from([0, 0.5, 3, 100]), burst=st.integers(1, 50),
       steps=st.lists(st.tuples(st.sampled_from([0, 0.1, 0.5, 1, 7]), st.integers(1, 20)),
                      max_size=60))
def test_bucket_lets_through_at_most_burst_plus_rate_times_window(rate, burst, steps):
    bucket, now, taken = tm.Bucket(rate, burst, burst, 0), 0.0, []
    for dt, n in steps:
        now += dt
        level = bucket.level(now)
        assert 0 <= level <= burst
        after = bucket.take(now, n)
        assert (after is None) == (level < n)         # refused exactly when short
        if after is not None:
            assert after.level(now) == pytest.approx(level - n)
            bucket = after
            taken.append((now, n))
    for i, (start, _) in enumerate(taken):
        for j in range(i, len(taken)):
            window = taken[j][0] - start
            assert sum(n for _, n in taken[i:j + 1]) <= burst + rate * window + 1e-9


def test_a_full_bucket_stays_full_and_refills_at_its_rate():
    b = tm.Bucket(rate=2, burst=10, tokens=10, at=0)
    assert b.level(100) == 10
    b = b.take(0, 10)
    assert b.level(0) == 0 and b.level(2.5) == 5 and b.level(9) == 10
    assert b.take(1, 3) is None and b.take(1.5, 3).level(1.5) == 0


# --- credentials ---------------------------------------------------------------------

def test_every_token_authenticates_its_tenant_and_nothing_else_does():
    creds = ten.Credentials(parse(FILE))
    assert [creds.authenticate(t) for t in TOKENS] == ["alpha", "alpha", "beta"]
    assert creds.authenticate(BETA.encode()) == "beta"
    for bad in ("", None, b"", ALPHA[:-1], ALPHA + "x", ten.token_digest(ALPHA).hex(), "beta"):
        with pytest.raises(errors.Unauthorized):
            creds.authenticate(bad)


@given(st.text(min_size=1, max_size=60))
def test_a_random_token_authenticates_no_tenant(token):
    with pytest.raises(errors.Unauthorized):
        ten.Credentials(parse(FILE)).authenticate(token)


def test_tokens_never_reach_a_log_an_error_a_repr_or_the_cli(caplog, tmp_path, capsys):
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    seen = []
    with caplog.at_level(logging.DEBUG):
        configs = ten.load_tenants(path)
        reg = ten.Registry(configs, capacity=1 << 20, ttl=2.0)
        for token in TOKENS + ("wrong", ALPHA[:-1]):          # ... and a token with a typo
            try:
                reg.authenticate(token)
            except errors.Unauthorized as err:
                seen.append(str(err))
        with pytest.raises(errors.InvalidArgument) as err:   # a token given twice: named by tenant
            parse(f'[tenants.a]\ntokens = ["{ALPHA}"]\n[tenants.b]\ntokens = ["{ALPHA}"]\n')
        seen.append(str(err.value))
        assert "a token is also one of tenant 'a'" in seen[-1]
        for event in (tm.WriteStart("alpha", ("alpha", "default"), b"k", 1 << 30),
                      tm.Begin("r", "beta", ("alpha", "llama-r2"), b"k")):
            with pytest.raises(errors.KvError) as err:
                reg.step(event, 1.0)
            seen.append(str(err.value))
        seen += [repr(reg), repr(reg.credentials), repr(configs), *ten.describe(configs), str(reg.usage())]
        assert cli.main(["tenant", "check", str(path)]) == 0
    out = capsys.readouterr()
    text = "\n".join(seen + [caplog.text, out.out, out.err])
    assert "alpha" in text and "beta" in text               # the capture is not empty
    for token in TOKENS:                                      # not even a part of one
        assert not any(token[i:i + 16] in text for i in range(len(token) - 15))


# --- the tenants file ----------------------------------------------------------------

def test_a_tenants_file_gives_quotas_namespaces_and_grants():
    alpha, beta = parse(FILE)
    assert alpha.quota == tm.Quota(stored=64 << 10, write_rate=16 << 10, write_burst=32 << 10,
                                   in_flight=48 << 10, reserve=8 << 10)
    assert alpha.namespaces == ("default", "llama-r2") and alpha.grants == (("default", "beta"),)
    assert beta.namespaces == ("default",) and beta.quota.stored == 4096
    assert beta.quota.write_rate == ten.UNLIMITED and beta.quota.reserve == 0
    assert len(alpha.digests) == 2 and len(beta.digests) == 1


@pytest.mark.parametrize("text, where", [
    ("", "expected [tenants.NAME] tables"),
    ("[tenants.a]\nstored = 1\n", "tenants.a: has no tokens"),
    ('[tenants.a]\ntokens = ["t"]\nstroed = 1\n', "unknown field(s) stroed"),
    ('[tenants.a]\ntokens = ["t"]\nstored = "lots"\n', "tenants.a.stored: 'lots' is not a size"),
    ('[tenants.a]\ntokens = ["t"]\nreserve = -1\n', "tenants.a.reserve: must not be negative"),
    ('[tenants."a/b"]\ntokens = ["t"]\n', "'a/b' is not a name"),
    ('[tenants.a]\ntokens = ["t"]\nnamespaces = ["x", "x"]\n', "expected distinct names"),
    ('[tenants.a]\ntokens = ["t"]\ngrants = { x = ["b"] }\n', "'x' is not one of its namespaces"),
    ('[tenants.a]\ntokens = ["t"]\ngrants = { default = ["zed"] }\n', "'zed' is not another tenant"),
    ('[tenants.a]\ntokens = ["t"]\n[tenants.b]\ntokens = ["t"]\n', "a token is also one of tenant 'a'"),
    ('[tenants.a]\ntoken_sha256 = ["abc"]\n', "64 lowercase hex digits"),
])
def test_a_mistake_in_the_file_is_one_typed_line(text, where):
    with pytest.raises(errors.InvalidArgument) as err:
        ten.parse_tenants(toml(text))
    assert where in str(err.value) and "\n" not in str(err.value)


def test_kvproto_tenant_check_and_token(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text(FILE)
    assert cli.main(["tenant", "check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("alpha: 2 token(s); stored 65536") and "grants default->beta" in lines[0]
    assert lines[1].startswith("beta: 1 token(s); stored 4096, write unlimited")
    path.write_text("[tenants.a]\n")
    assert cli.main(["tenant", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tokens" in err
    out = io.StringIO()
    assert ten.main(SimpleNamespace(action="token"), out) == 0
    token, digest = (line.split()[1] for line in out.getvalue().splitlines())
    assert ten.token_digest(token).hex() == digest and len(token) >= 40


# --- namespaces name objects ---------------------------------------------------------

names = st.text(alphabet="abcxyz09._-", min_size=1, max_size=8)


@given(a=st.tuples(names, names, st.binary(max_size=12)), b=st.tuples(names, names, st.binary(max_size=12)))
def test_object_keys_are_injective_and_invertible(a, b):
    ka, kb = ten.object_key(a[:2], a[2]), ten.object_key(b[:2], b[2])
    assert (ka == kb) == (a == b)
    assert ten.split_object_key(ka) == (a[:2], a[2])


def test_the_same_key_in_two_tenants_names_two_objects_and_grants_come_from_the_file():
    reg = registry()
    a, b = reg.namespace("alpha", "default"), reg.namespace("beta", "default")
    assert a == ("alpha", "default") and reg.namespace("beta", "alpha/default") == a
    with pytest.raises(errors.UnknownNamespace):
        reg.namespace("beta", "alpha/nope")
    for ns in (a, b):
        reg.step(tm.WriteStart(ns[0], ns, b"stolen", 100), 0.5)
        reg.step(tm.WriteEnd(ns, b"stolen"), 0.5)
    assert ten.object_key(a, b"stolen") != ten.object_key(b, b"stolen")
    # beta reads alpha/default under the file's grant, and gets alpha's object
    (granted,) = reg.step(tm.Begin("r1", "beta", a, b"stolen"), 1.0)
    assert (granted.src, granted.size) == (a, 100)
    # beta may not overwrite alpha's object, nor write into alpha's namespace at all
    with pytest.raises(errors.AccessDenied):
        reg.step(tm.WriteStart("beta", a, b"stolen", 100), 1.0)
    # alpha holds no grant on beta's namespace
    with pytest.raises(errors.AccessDenied):
        reg.step(tm.Begin("r2", "alpha", b, b"stolen"), 1.0)


def test_a_refused_step_raises_its_error_and_changes_nothing():
    reg = registry()
    ns = reg.namespace("alpha", "default")
    reg.step(tm.WriteStart("alpha", ns, b"a", 30 << 10), 0.0)       # 30 KiB of a 32 KiB burst
    before = reg.state.reference()
    with pytest.raises(errors.QuotaExceeded, match="write bandwidth"):
        reg.step(tm.WriteStart("alpha", ns, b"b", 4 << 10), 0.1)       # 1.6 KiB refilled
    assert reg.state.reference() == before                          # the clock included
    reg.step(tm.WriteStart("alpha", ns, b"b", 4 << 10), 0.25)       # 4 KiB refilled by then
    assert reg.usage()["alpha"]["held"] == 34 << 10


@given(beta=st.lists(st.tuples(st.sampled_from([0.0, 0.05, 0.3]), st.integers(1, 2048)), max_size=25),
       alpha=st.lists(st.tuples(st.integers(0, 24), st.integers(1, 16 << 10)), max_size=60))
def test_a_tenant_hammering_writes_never_changes_what_another_is_admitted(beta, alpha):
    """Quotas isolate: beta's writes are admitted or refused exactly as they
    would be with alpha idle, however hard alpha writes (memory has room)."""
    def run(with_alpha: bool) -> list:
        reg, now, answers = registry(), 0.0, []
        a, b = reg.namespace("alpha", "default"), reg.namespace("beta", "default")
        for i, (dt, size) in enumerate(beta):
            now += dt
            if with_alpha:
                for j, (_, asize) in enumerate(x for x in alpha if x[0] == i):
                    try:
                        reg.step(tm.WriteStart("alpha", a, b"a%d.%d" % (i, j), asize), now)
                        reg.step(tm.WriteEnd(a, b"a%d.%d" % (i, j)), now)
                    except errors.QuotaExceeded:
                        pass
            try:
                reg.step(tm.WriteStart("beta", b, b"b%d" % i, size), now)
                reg.step(tm.WriteEnd(b, b"b%d" % i), now)
                answers.append("ok")
            except errors.KvError as err:
                answers.append(type(err).__name__)
        return answers
    assert run(True) == run(False)
