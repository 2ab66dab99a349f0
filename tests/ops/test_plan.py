"""The planner's arithmetic: the worked example's figures, and properties of
the ledgers (conservation, monotonicity, what replicas and failure domains do)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings, strategies as st

from kvproto import errors
from kvproto.ops import plan as P

def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


def le(a: float, b: float) -> bool:
    """a <= b up to rounding."""
    return a <= b or close(a, b)


models = st.builds(P.Model, layers=st.integers(1, 128), kv_heads=st.integers(1, 64),
                   head_dim=st.sampled_from([64, 96, 128, 256]),
                   dtype=st.sampled_from(sorted(P.DTYPE_BYTES)))
lengths = st.lists(st.tuples(st.integers(1, 200_000), st.floats(0.01, 10)), min_size=1, max_size=4)
workloads = st.builds(P.Workload, request_rate=st.floats(0.1, 5000), prompt_tokens=lengths,
                      sharing=st.floats(0, 1), prefixes=st.integers(1, 100_000),
                      hot_fraction=st.floats(0.001, 1), hot_share=st.floats(0, 1),
                      retention_s=st.floats(1, 86_400))
chunks = st.sampled_from([16, 32, 64, 128, 256, 512, 1024])


@st.composite
def inputs(draw, replicas_max: int = 4):
    hosts = draw(st.integers(1, 64))
    domains = draw(st.integers(1, hosts))
    cluster = P.Cluster(hosts=hosts, failure_domains=domains,
                        memory_per_host=draw(st.integers(1 << 30, 1 << 42)),
                        segment_per_host=draw(st.integers(1 << 30, 1 << 41)),
                        l1_per_host=draw(st.integers(0, 1 << 40)), l1_in_segment=draw(st.booleans()),
                        staging_per_host=draw(st.integers(0, 1 << 36)),
                        nic_gbps=draw(st.floats(1, 1600)))
    replicas = draw(st.integers(1, min(replicas_max, hosts)))
    store = P.Store(chunk_tokens=draw(chunks), replicas=replicas,
                    hot_replicas=draw(st.integers(replicas, hosts)),
                    page_size=draw(st.sampled_from([512, 4096, 65536])))
    return draw(models), draw(workloads), store, cluster


def test_the_reference_model_is_128_kib_per_token():
    assert P.Model(32, 8, 128, "bf16").bytes_per_token == 128 * 1024 == 131072
    assert P.Model(32, 8, 128, "fp8").bytes_per_token == 64 * 1024
    assert P.Model(32, 8, 128, "float32").bytes_per_token == 256 * 1024


def test_the_default_plan_answers_with_the_reference_model():
    p = P.plan(P.Model(), P.Workload(), P.Store(), P.Cluster())
    assert p.bytes_per_token == 131072
    assert p.capacity.object_bytes == 256 * 131072 == 32 << 20
    # the hot-set question: mean bandwidth suffices, the busiest host misses the budget
    assert p.traffic.load_s <= p.cluster.slo_load_s < p.traffic.load_s_peak
    # the chunk question: 64 tokens reuse more, waste less, cost more objects
    q = P.with_chunk(p, 64)
    assert q.reuse > p.reuse
    assert q.tokens.shared_waste + q.tokens.tail_waste < p.tokens.shared_waste + p.tokens.tail_waste
    assert q.objects.stored > p.objects.stored and q.objects.master_items_s > p.objects.master_items_s
    assert q.traffic.per_host_peak / q.traffic.per_host < p.traffic.per_host_peak / p.traffic.per_host


@settings(max_examples=300, deadline=None)
@given(inputs())
def test_conservation(args):
    """Bytes per token x tokens = payload; objects x object size = payload;
    stored = objects x allocated x replicas (+ the hot extra)."""
    model, work, store, cluster = args
    p = P.plan(model, work, store, cluster)
    t, c, o, tr = p.tokens, p.capacity, p.objects, p.traffic
    assert close(tr.writes_payload, work.request_rate * t.written * model.bytes_per_token)
    assert close(tr.reads, work.request_rate * t.reused * model.bytes_per_token)
    assert close(o.written_s * c.object_bytes, tr.writes_payload)
    assert close(o.read_s * c.object_bytes, tr.reads)
    assert close(c.working_set, o.stored * c.object_bytes)
    assert close(c.working_set, tr.writes_payload * work.retention_s)
    assert close(c.stored, o.replicas_stored * c.allocated_bytes)
    assert close(c.stored, o.stored * store.replicas * c.allocated_bytes + c.hot_extra)
    assert close(o.page_slack, o.replicas_stored * (c.allocated_bytes - c.object_bytes))
    # tokens: reused <= shared <= prompt, stored <= prompt, written = stored - reused >= 0
    assert le(t.reused, t.shared) and le(t.shared, t.prompt) and le(t.stored, t.prompt)
    assert t.written >= -1e-9 and close(t.written + t.reused, t.stored)
    assert close(t.shared_waste + t.reused, t.shared) and close(t.tail_waste + t.stored, t.prompt)
    # every byte sent over the network is received by another host: out = in
    assert close(tr.per_host * cluster.hosts, tr.reads_network + tr.writes_network)
    # the repair copies exactly the lost replicas of objects that survive
    f = p.failure
    lost_replicas = o.replicas_stored * f.lost_hosts / cluster.hosts * c.allocated_bytes
    outright = o.stored * f.lost_outright * store.replicas * c.allocated_bytes
    assert abs(f.repair_bytes - max(lost_replicas - outright, 0.0)) <= 1e-9 * max(lost_replicas, 1.0)


@settings(max_examples=200, deadline=None)
@given(inputs(), st.integers(2, 4))
def test_replicas_multiply_capacity_and_write_traffic(args, k):
    model, work, store, cluster = args
    assume(k <= cluster.hosts)
    one = P.plan(model, work, replace(store, replicas=1, hot_replicas=1), cluster)
    many = P.plan(model, work, replace(store, replicas=k, hot_replicas=k), cluster)
    assert close(many.capacity.stored, k * one.capacity.stored)
    assert close(many.traffic.writes_replicas, k * one.traffic.writes_replicas)
    assert close(many.traffic.writes_replicas, k * many.traffic.writes_payload)
    assert close(many.capacity.working_set, one.capacity.working_set)   # the payload is the same
    assert close(many.capacity.index_per_host, k * one.capacity.index_per_host)


@settings(max_examples=200, deadline=None)
@given(inputs())
def test_losing_a_failure_domain_never_adds_capacity(args):
    model, work, store, cluster = args
    p = P.plan(model, work, store, cluster)
    f = p.failure
    whole = cluster.hosts * p.capacity.usable_per_host
    assert le(f.capacity_after, whole)
    assert f.survivors + f.lost_hosts == cluster.hosts
    assert 0 <= f.lost_outright <= f.lost_hosts / cluster.hosts + 1e-12
    # more (smaller) domains: the largest loss shrinks, what survives never does
    if cluster.failure_domains < cluster.hosts:
        finer = P.plan(model, work, store, replace(cluster, failure_domains=cluster.failure_domains + 1))
        assert finer.failure.lost_hosts <= f.lost_hosts
        assert le(f.capacity_after, finer.failure.capacity_after)
        assert le(finer.failure.lost_outright, f.lost_outright)
    if f.holds_all_replicas:
        assert f.holds_one_copy


@settings(max_examples=200, deadline=None)
@given(inputs(), st.floats(1.0, 10.0))
def test_more_requests_never_cost_less(args, factor):
    model, work, store, cluster = args
    a = P.plan(model, work, store, cluster)
    z = P.plan(model, replace(work, request_rate=work.request_rate * factor), store, cluster)
    for ledger, fields in (("traffic", ("reads", "writes_replicas", "per_host", "per_host_peak")),
                           ("objects", ("stored", "master_items_s", "master_requests_s", "wire_overhead_s")),
                           ("capacity", ("stored", "inflight_per_host", "host_committed"))):
        for name in fields:
            assert le(getattr(getattr(a, ledger), name), getattr(getattr(z, ledger), name)), name
    assert le(a.traffic.load_s, z.traffic.load_s)


@settings(max_examples=200, deadline=None)
@given(inputs(), st.sampled_from([2, 4, 8]))
def test_smaller_chunks_reuse_more_and_waste_less(args, k):
    model, work, store, cluster = args
    assume(store.chunk_tokens % k == 0)
    big = P.plan(model, work, store, cluster)
    small = P.with_chunk(big, store.chunk_tokens // k)
    assert le(big.tokens.reused, small.tokens.reused)
    assert le(small.tokens.shared_waste + small.tokens.tail_waste,
              big.tokens.shared_waste + big.tokens.tail_waste)
    assert le(big.tokens.stored, small.tokens.stored)
    # each key the master looks up names a smaller object: more keys per prompt
    assert le(big.objects.looked_up_s, small.objects.looked_up_s)


@settings(max_examples=200, deadline=None)
@given(inputs())
def test_the_busiest_host_carries_at_least_the_mean(args):
    model, work, store, cluster = args
    p = P.plan(model, work, store, cluster)
    tr = p.traffic
    assert le(tr.per_host, tr.per_host_peak)
    assert le(tr.utilisation, tr.utilisation_peak)
    assert le(tr.load_s, tr.load_s_peak)
    assert le(p.capacity.host_committed, p.capacity.host_naive)   # shared addresses once
    if store.hot == cluster.hosts:   # a hot replica on every host: hot reads never cross a NIC
        assert close(tr.per_host_peak, tr.per_host)


@settings(max_examples=150, deadline=None)
@given(inputs())
def test_more_hot_replicas_never_make_the_busiest_host_busier(args):
    model, work, store, cluster = args
    assume(store.hot < cluster.hosts)
    p = P.plan(model, work, store, cluster)
    q = P.plan(model, work, replace(store, hot_replicas=store.hot + 1), cluster)
    # the hot reads spread over more hosts, some become local; the extra copies cost writes
    hot_read = q.traffic.per_host_peak - q.traffic.writes_network / cluster.hosts
    assert le(hot_read, p.traffic.per_host_peak - p.traffic.writes_network / cluster.hosts)
    assert le(p.capacity.stored, q.capacity.stored)


@settings(max_examples=300, deadline=None)
@given(st.floats(0.01, 5000), st.integers(1, 512))
def test_expected_max_load(balls, bins):
    m = P.expected_max_load(balls, bins)
    assert le(balls / bins, m)                        # at least the mean
    assert le(m, balls + 12 * math.sqrt(balls) + 40)  # and no more than the balls allow (+ Poisson tail)
    more = P.expected_max_load(balls * 1.5, bins)
    assert le(m, more)                               # more balls: a fuller busiest bin
    assert le(more / (balls * 1.5), m / balls)        # ... but a smaller share of them
    if bins == 1:
        assert close(m, balls)


def test_expected_max_load_known_values():
    # one ball (or less) in 16 bins: the busiest holds all of it
    assert P.expected_max_load(1, 16) == 1.0
    assert P.expected_max_load(0.5, 16) == 0.5
    # 16 balls in 16 bins: about 3 (throwing them 100,000 times gives 3.08)
    assert 2.8 < P.expected_max_load(16, 16) < 3.3
    # many balls: mean + 1.766 standard deviations (the expected maximum of 16 normals)
    m = P.expected_max_load(160_000, 16)
    assert 10_000 + 1.70 * 100 < m < 10_000 + 1.83 * 100


@given(st.floats(0, 1e6), st.sampled_from([16, 64, 256, 1024]))
def test_whole_chunk_tokens(tokens, chunk):
    whole = P.whole_chunk_tokens(tokens, chunk)
    assert 0 <= whole <= tokens
    assert P.whole_chunk_tokens(tokens, chunk * 2) <= whole
    assert whole <= P.whole_chunk_tokens(tokens + 1, chunk)


def test_lost_outright_share():
    assert P.lost_outright_share(1, 16, 4) == pytest.approx(4 / 16)
    assert P.lost_outright_share(2, 16, 4) == pytest.approx(4 * 3 / (16 * 15))
    assert P.lost_outright_share(3, 16, 2) == 0.0
    assert P.lost_outright_share(2, 4, 4) == 1.0


@pytest.mark.parametrize("make, message", [
    (lambda: P.Model(layers=0), "layers must be a positive integer"),
    (lambda: P.Model(dtype="fp4"), "dtype 'fp4' is not one of"),
    (lambda: P.Workload(sharing=1.5), "sharing must be in [0, 1]"),
    (lambda: P.Workload(prompt_tokens=((0, 1.0),)), "prompt_tokens"),
    (lambda: P.Workload(prompt_tokens=((10, 0.0),)), "not all 0"),
    (lambda: P.Store(page_size=1000), "power of two"),
    (lambda: P.Store(replicas=3, hot_replicas=2), "hot_replicas (2) must be at least replicas (3)"),
    (lambda: P.Cluster(hosts=2, failure_domains=3), "3 failure domains need"),
    (lambda: P.Cluster(nic_gbps=float("nan")), "nic_gbps must be a positive number"),
    (lambda: P.plan(P.Model(), P.Workload(), P.Store(replicas=5), P.Cluster(hosts=4, failure_domains=2)),
     "5 replicas need as many hosts"),
])
def test_bad_inputs_are_typed_errors(make, message):
    with pytest.raises(errors.InvalidArgument) as err:
        make()
    assert message in str(err.value)
