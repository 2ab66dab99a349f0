"""The vLLM v1 connector driven by a stand-in for vLLM (tests/engines/vllm_fakes.py)
that calls its methods in vLLM's order: one engine computes and saves a prompt,
a fresh engine finds it (exists_many over every rank's and layer group's
object), loads it layer group by layer group and ends with the same KV, byte
for byte, having computed only the tokens after the hit. Failed loads
(corrupt, missing, another layout, timed out) come back as the blocks vLLM
must recompute; a timed-out load's buffer stays quarantined until it drains
and its late bytes never reach a block."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import kvproto  # noqa: E402
from kvproto import errors  # noqa: E402
from kvproto.engines import vllm as connector  # noqa: E402
from kvproto.engines.prefix import Namespace  # noqa: E402
from vllm_fakes import Engine, configs  # noqa: E402

BLOCK, CHUNK = 16, 32
PROMPT = 100           # chunks of the first 99 tokens: 3 full chunks (96 tokens)


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="32MiB", storage_debug=True) as c:
        yield c


@pytest.fixture
def engines(cluster):
    made = []

    def make(**kw) -> Engine:
        e = Engine(cluster.master_address, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n,), generator=g).tolist()


def same_kv(a: Engine, ra: dict, b: Engine, rb: dict, end: int) -> bool:
    return all(torch.equal(a.kv_of(rank, layer, ra["blocks"], end), b.kv_of(rank, layer, rb["blocks"], end))
               for rank in range(len(a.workers)) for layer in range(len(a.layers)))


def keys_of(engine: Engine, tokens, chunk: int, salt: str = "") -> tuple:
    ns = engine.scheduler.namespace
    ns = ns.with_salt(salt) if salt else ns
    return ns.object_keys(ns.chunks(tokens[:-1], CHUNK, partial=False)[chunk])


# --------------------------------------------------------------------------- the round trip


@pytest.mark.parametrize("split", [1, 2], ids=["pages", "kernel-blocks"])
def test_a_fresh_engine_loads_the_saved_prefix_byte_for_byte(engines, split):
    tokens = prompt(split)
    a = engines(split=split, budget=40)           # chunked prefill: saves across three steps
    ra = a.run("a", tokens)
    assert ra["external"] == 0 and ra["steps"] == 3
    b = engines(split=split)
    rb = b.run("b", tokens)
    assert rb["external"] == 96 and rb["loaded"] == 96
    assert b.computed_positions == list(range(96, PROMPT))     # only the tail was computed
    assert same_kv(a, ra, b, rb, PROMPT)
    assert b.workers[0].counters["loaded_chunks"] == 3 and not b.invalid_reported
    assert a.workers[0].counters["saved_objects"] == 3 * 2     # 3 chunks x 2 layer groups


def test_a_local_prefix_hit_loads_only_the_blocks_beyond_it(engines):
    tokens = prompt(11)
    a = engines()
    a.run("a", tokens)
    b = engines()
    request = type("R", (), {"request_id": "b", "prompt_token_ids": tokens, "cache_salt": None})()
    assert b.scheduler.get_num_new_matched_tokens(request, 48) == (48, False)
    assert b.scheduler.get_num_new_matched_tokens(request, 96) == (0, False)
    blocks = list(range(7))
    b.scheduler.update_state_after_alloc(request, type("B", (), {"get_block_ids": lambda s: (blocks,)})(), 0)
    b.scheduler.get_num_new_matched_tokens(request, 48)
    b.scheduler.update_state_after_alloc(request, type("B", (), {"get_block_ids": lambda s: (blocks,)})(), 48)
    from types import SimpleNamespace
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="b", prompt_token_ids=tokens,
                                                              block_ids=(blocks,), num_computed_tokens=96)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                new_block_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens={"b": 4}, finished_req_ids=set())
    meta = b.scheduler.build_connector_meta(out)
    (req,) = meta.loads
    # chunk 1 (tokens 32-63) loads only its second block (48-63); chunk 2 both
    assert [(t.chunk.index, t.first, t.blocks) for t in req.chunks] == [(1, 1, (3,)), (2, 0, (4, 5))]
    assert meta.saves == []


def test_tensor_parallel_ranks_each_save_and_load_their_own_objects(cluster, engines):
    tokens = prompt(3)
    a = engines(tp=2)
    ra = a.run("a", tokens)
    b = engines(tp=2)
    rb = b.run("b", tokens)
    assert rb["external"] == 96 and same_kv(a, ra, b, rb, PROMPT)
    assert not torch.equal(b.kv_of(0, 0, rb["blocks"], 96), b.kv_of(1, 0, rb["blocks"], 96))
    # one rank's object of chunk 1 gone: the chunk is incomplete for every rank
    client = cluster.client()
    client.remove(keys_of(a, tokens, 1)[3])                  # rank 1, layer group 1
    c = engines(tp=2)
    rc = c.run("c", tokens)
    assert rc["external"] == 32 and same_kv(a, ra, c, rc, PROMPT)


def test_a_cache_salt_is_part_of_the_namespace(engines):
    tokens = prompt(4)
    engines().run("a", tokens, salt="tenant-1")
    assert engines().run("b", tokens)["external"] == 0
    assert engines().run("c", tokens, salt="tenant-2")["external"] == 0
    assert engines().run("d", tokens, salt="tenant-1")["external"] == 96


def test_roles_and_a_layout_change(engines):
    tokens = prompt(5)
    engines(role="kv_consumer").run("a", tokens)               # a consumer never saves
    assert engines().run("b", tokens)["external"] == 0
    assert engines(role="kv_producer").run("c", tokens)["external"] == 0   # nor does a producer look up
    assert engines().run("d", tokens)["external"] == 96
    # another dtype, block size or layer grouping is another namespace
    assert engines(dtype=torch.bfloat16).run("e", tokens)["external"] == 0
    assert engines(groups=1).run("f", tokens)["external"] == 0


# --------------------------------------------------------------------------- failed loads


def test_a_corrupt_object_is_recomputed_then_stored_again(cluster, engines):
    tokens = prompt(6)
    a = engines()
    ra = a.run("a", tokens)
    client = cluster.client()
    key = keys_of(a, tokens, 1)[1]                           # chunk 1, layer group 1
    (lease,) = client.read_begin([key])
    node = next(n for n in cluster.storage if n.core.segment == lease.replicas[0][0])
    node.memory.data[lease.replicas[0][1] + 200] ^= 0x55
    client.release([lease])
    b = engines()
    rb = b.run("b", tokens)
    assert rb["external"] == 96                               # the lookup cannot tell
    assert rb["loaded"] == 32                                 # the load can
    assert b.invalid_reported == set(rb["blocks"][2:6])       # chunks 1 and 2: blocks 2..5
    # the step that used the failed load is redone from the first invalid block
    assert b.computed_positions == list(range(96, PROMPT)) + list(range(32, PROMPT))
    assert same_kv(a, ra, b, rb, PROMPT)
    # the bad object was removed and stored again from the recomputed blocks
    c = engines()
    rc = c.run("c", tokens)
    assert rc["loaded"] == 96 and same_kv(a, ra, c, rc, PROMPT)


def test_a_missing_middle_chunk_and_a_foreign_layout(cluster, engines):
    tokens = prompt(7)
    a = engines()
    a.run("a", tokens)
    client = cluster.client()
    client.remove(keys_of(a, tokens, 1)[0])
    b = engines()
    assert b.run("b", tokens)["external"] == 32               # the lookup stops at the gap
    # an object under the right key, written as another layout, is refused
    tokens = prompt(8)
    a.run("a2", tokens)
    key = keys_of(a, tokens, 2)[0]
    body = bytes(client.get(key))
    client.remove(key)
    chunk = a.scheduler.namespace.chunks(tokens[:-1], CHUNK, partial=False)[2]
    hlen = int.from_bytes(body[6:8], "little")
    from kvproto.engines.chunks import encode
    client.put(key, encode("vllm1:another-layout", chunk, body[hlen:]))
    c = engines()
    rc = c.run("c", tokens)
    assert rc["external"] == 96 and rc["loaded"] == 64
    assert c.invalid_reported == set(rc["blocks"][4:6])


def test_a_timed_out_load_is_recomputed_and_its_late_bytes_never_land(cluster, engines):
    tokens = prompt(9)
    a = engines()
    ra = a.run("a", tokens)
    node = cluster.storage[0]
    b = engines(timeout=0.3)
    worker = b.workers[0]
    node.faults["reply_delay_ms"] = 1200                      # every load lands late
    try:
        rb = b.run("b", tokens)
        assert rb["external"] == 96 and rb["loaded"] == 0
        assert b.invalid_reported == set(rb["blocks"][:6])
        # the load timed out: its buffer was quarantined until the node's cancel
        # acknowledgement (or the late reply) drained it
        assert worker.store.engine.counts()["timed_out"] >= 1
        recomputed = {n: t.clone() for n, t in b.kv[0].items()}
    finally:
        node.faults["reply_delay_ms"] = 0
    assert worker.store.engine.wait_idle(10)                   # the late completions drained ...
    counts = worker.store.engine.counts()
    assert counts["quarantined"] == counts["leaked"] == 0 and counts["free"] == 8
    assert all(torch.equal(b.kv[0][n], recomputed[n]) for n in recomputed)   # ... and wrote nothing
    assert same_kv(a, ra, b, rb, PROMPT)
    rc = engines().run("c", tokens)                           # the store was never wrong
    assert rc["loaded"] == 96


def test_a_lookup_without_a_master_is_a_miss(cluster):
    vllm_config, kv_cache_config = configs("tcp://127.0.0.1:9", timeout=0.5)
    sched = connector.KvprotoConnector(vllm_config, connector.KVConnectorRole.SCHEDULER, kv_cache_config)
    sched.client.lookup_timeout = 0.2
    request = type("R", (), {"request_id": "x", "prompt_token_ids": prompt(10), "cache_salt": None})()
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert time.monotonic() - t0 < 5
    sched.shutdown()


# --------------------------------------------------------------------------- configuration


def test_configuration_mistakes_are_refused_clearly(cluster):
    def build(role=connector.KVConnectorRole.SCHEDULER, **kw):
        vllm_config, kv_cache_config = configs(cluster.master_address, **kw)
        return connector.KvprotoConnector(vllm_config, role, kv_cache_config)

    vllm_config, kv_cache_config = configs(cluster.master_address)
    del vllm_config.kv_transfer_config.kv_connector_extra_config["kvproto.master"]
    with pytest.raises(errors.InvalidArgument, match="kvproto.master"):
        connector.KvprotoConnector(vllm_config, connector.KVConnectorRole.SCHEDULER, kv_cache_config)
    with pytest.raises(errors.InvalidArgument, match="multiple of the block size"):
        build(chunk=24)
    worker = build(role=connector.KVConnectorRole.WORKER)
    with pytest.raises(errors.InvalidArgument, match="is not"):
        worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(64, 2, 16, 8)
                                   for i in range(4)})
    worker.shutdown()


def test_the_layout_tag_names_the_page_layout():
    _, kv_cache_config = configs("tcp://127.0.0.1:1")
    assert connector.layout_tag(kv_cache_config, 2) == "vllm1:L4:H2:D8+8:fp32:B16:tp*/2:page-hnc"
    ns = Namespace("m", "r", connector.layout_tag(kv_cache_config, 1))
    assert ns.layout.startswith("vllm1:")


def test_the_module_imports_without_vllm():
    # vLLM is not installed in the shared environment: the stand-in base is in use
    if connector.HAVE_VLLM:
        pytest.skip("vLLM is installed here: the real base class is in use")
    assert connector.KVConnectorRole.SCHEDULER.value == 0
    assert issubclass(connector.KvprotoConnector, connector.KVConnectorBase_V1)
