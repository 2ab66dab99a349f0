"""SGLang's HiCache storage interface on kvproto, loaded the way SGLang loads
it (backend ``dynamic``), checked against SGLang's own file back end on the
same operation sequences. Optional group ``engines``: skipped where SGLang's
``hicache_storage`` module is not importable."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

import kvproto  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.runtime]


@pytest.fixture(scope="module", autouse=True)
def sglang_imported():
    """SGLang's storage modules, imported when this module's tests run rather
    than when they are collected: their import takes seconds, and every worker
    collects every module."""
    global hs, factory
    hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                             reason="sglang is not importable (install the 'engines' extra)")
    factory = pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

PAGE = 4            # tokens per page
TOKEN_BYTES = 32    # K and V of one token: 2 x 16 bytes


def storage_config(extra: dict, tp_rank: int = 0, mla: bool = False) -> "hs.HiCacheStorageConfig":
    return hs.HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                   is_page_first_layout=True, model_name="org/model",
                                   extra_config=extra)


class HostPool:
    """A page-first host KV pool: per token a K half and a V half; per page
    one K buffer and one V buffer, as SGLang's ``get_page_buffer_meta`` gives."""

    page_size = PAGE

    def __init__(self, tokens: int) -> None:
        self.k = torch.zeros(tokens * TOKEN_BYTES // 2, dtype=torch.uint8)
        self.v = torch.zeros(tokens * TOKEN_BYTES // 2, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices):
        half = TOKEN_BYTES // 2
        ptrs, sizes = [], []
        for at in range(0, len(indices), PAGE):
            first = int(indices[at])
            ptrs += [self.k.data_ptr() + first * half, self.v.data_ptr() + first * half]
            sizes += [PAGE * half, PAGE * half]
        return ptrs, sizes

    def page(self, first: int) -> bytes:
        half = TOKEN_BYTES // 2
        return bytes(self.k[first * half:(first + PAGE) * half]) + bytes(self.v[first * half:(first + PAGE) * half])


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="32MiB") as c:
        yield c


def kvproto_backend(cluster, salt: str, **config):
    extra = {"backend_name": "kvproto", "module_path": "kvproto.engines.sglang",
             "class_name": "KvprotoHiCacheStorage", "kvproto_master": cluster.master_address,
             "kvproto_salt": salt}
    backend = factory.StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), None)
    return backend


def test_loaded_as_the_dynamic_backend(cluster):
    from kvproto.engines.sglang import KvprotoHiCacheStorage
    b = kvproto_backend(cluster, uuid.uuid4().hex)
    try:
        assert type(b) is KvprotoHiCacheStorage
        with pytest.raises(ValueError, match="kvproto_master"):
            KvprotoHiCacheStorage(storage_config({}), {})
    finally:
        b.close()


def test_tensor_interface(cluster):
    b = kvproto_backend(cluster, uuid.uuid4().hex)
    try:
        value = torch.arange(64, dtype=torch.float16)
        assert b.set("k1", value) and b.set("k1", torch.zeros(64, dtype=torch.float16))   # kept
        target = torch.empty(64, dtype=torch.float16)
        assert b.get("k1", target) is target and torch.equal(target, value)
        assert b.get("none", torch.empty(64, dtype=torch.float16)) is None
        assert b.batch_set(["k2", "k3"], [value + 1, value + 2])
        got = b.batch_get(["k2", "none", "k3"], [torch.empty(64, dtype=torch.float16) for _ in range(3)])
        assert torch.equal(got[0], value + 1) and got[1] is None and torch.equal(got[2], value + 2)
        assert b.exists("k1") and not b.exists("none")
        assert b.batch_exists(["k1", "k2", "none", "k3"]) == 2
        b.clear()
        assert b.batch_exists(["k1", "k2", "k3"]) == 0
    finally:
        b.close()


def test_zero_copy_pages_from_and_into_the_host_pool(cluster):
    salt = uuid.uuid4().hex
    writer, reader = kvproto_backend(cluster, salt), kvproto_backend(cluster, salt)
    try:
        src, dst = HostPool(16), HostPool(16)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        src.k.copy_(torch.randint(0, 255, src.k.shape, dtype=torch.uint8))
        src.v.copy_(torch.randint(0, 255, src.v.shape, dtype=torch.uint8))
        keys = ["p0", "p1", "p2"]
        assert writer.batch_set_v1(keys[:1] + keys[2:], torch.tensor(list(range(0, 4)) + list(range(8, 12)))) \
            == [True, True]
        assert reader.batch_exists(keys) == 1                # p1 missing: p2 does not count
        assert writer.batch_set_v1(keys[1:2], torch.arange(4, 8)) == [True]
        assert reader.batch_exists(keys) == 3 and reader.exists("p2")
        # read the pages into other slots of the reader's pool
        assert reader.batch_get_v1(keys + ["none"], torch.arange(0, 16)) == [True, True, True, False]
        for n in range(3):
            assert dst.page(4 * n) == src.page(4 * n)
        with pytest.raises(ValueError):
            reader.batch_get_v1(keys, torch.arange(0, 8))     # not a page per key
    finally:
        writer.close()
        reader.close()


def test_ranks_and_revisions_do_not_share_pages(cluster):
    salt = uuid.uuid4().hex
    r0, r1 = kvproto_backend(cluster, salt, tp_rank=0), kvproto_backend(cluster, salt, tp_rank=1)
    m0, m1 = kvproto_backend(cluster, salt, tp_rank=0, mla=True), kvproto_backend(cluster, salt, tp_rank=1, mla=True)
    try:
        assert r0.set("k", torch.ones(4)) and not r1.exists("k")            # per-rank KV
        assert m0.set("k", torch.ones(4)) and m1.exists("k")                # MLA KV is shared
    finally:
        for b in (r0, r1, m0, m1):
            b.close()


# --- differential: SGLang's own file back end as the reference ---------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("batch_set"), st.lists(st.integers(0, 5), min_size=1, max_size=3), st.integers(0, 3)),
    st.tuples(st.just("get"), st.integers(0, 5)),
    st.tuples(st.just("batch_get"), st.lists(st.integers(0, 5), min_size=1, max_size=4)),
    st.tuples(st.just("exists"), st.integers(0, 5)),
    st.tuples(st.just("batch_exists"), st.lists(st.integers(0, 5), min_size=1, max_size=5)),
), max_size=12)


def run_ops(backend, ops) -> list:
    def value(k, v):
        return torch.full((16,), float(k * 10 + v), dtype=torch.float32)
    out = []
    for op in ops:
        name = op[0]
        if name == "set":
            out.append(backend.set(f"k{op[1]}", value(op[1], op[2])))
        elif name == "batch_set":
            keys = list(dict.fromkeys(op[1]))
            out.append(backend.batch_set([f"k{k}" for k in keys], [value(k, op[2]) for k in keys]))
        elif name == "get":
            got = backend.get(f"k{op[1]}", torch.empty(16))
            out.append(None if got is None else got.tolist())
        elif name == "batch_get":
            got = backend.batch_get([f"k{k}" for k in op[1]], [torch.empty(16) for _ in op[1]])
            out.append([None if g is None else g.tolist() for g in got])
        elif name == "exists":
            out.append(backend.exists(f"k{op[1]}"))
        else:
            out.append(backend.batch_exists([f"k{k}" for k in op[1]]))
    return out


@settings(max_examples=25, deadline=None)
@given(ops=OPS)
def test_same_operations_same_results_as_sglang_file_backend(cluster, tmp_path_factory, ops):
    ref = hs.HiCacheFile(storage_config({"file_storage_path": str(tmp_path_factory.mktemp("hicache"))}))
    ours = kvproto_backend(cluster, uuid.uuid4().hex)
    try:
        assert run_ops(ours, ops) == run_ops(ref, ops)
    finally:
        ours.close()
