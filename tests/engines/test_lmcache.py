"""LMCache on kvproto through LMCache's own RemoteBackend (dst_device="cpu"),
by both routes: the ``plugin://kvproto`` connector, and LMCache's Mooncake
connector (``mooncakestore://``) over the PYTHONPATH shim. Optional group
``engines``: skipped where lmcache is not importable."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

torch = pytest.importorskip("torch")

import kvproto  # noqa: E402
from engine_helpers import fresh_import  # noqa: E402
from kvproto.engines.shim import PATH as SHIM_PATH  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.runtime]


@pytest.fixture(scope="module", autouse=True)
def lmcache_imported():
    """LMCache, imported when this module's tests run rather than when they are
    collected: its import takes seconds, and every worker collects every module."""
    global CacheEngineKey, LMCacheEngineConfig, MemoryFormat, LMCacheMetadata
    global LocalCPUBackend, RemoteBackend
    pytest.importorskip("lmcache.v1.storage_backend.remote_backend",
                        reason="lmcache is not importable (install the 'engines' extra)")
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)          # layers, K/V, tokens, heads, head dim


@pytest.fixture(scope="module")
def cluster():
    with kvproto.embedded(storage_nodes=1, segment_size="64MiB") as c:
        yield c


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


class Engine:
    """LMCache's CPU backend and a RemoteBackend built from one config."""

    def __init__(self, loop, extra: dict, model: str = "m", **config) -> None:
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, extra_config=extra, **config)
        self.meta = LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=SHAPE,
                                    chunk_size=CHUNK)
        self.loop = loop
        self.cpu = LocalCPUBackend(self.config, self.meta, dst_device="cpu")
        self.remote = RemoteBackend(self.config, self.meta, loop, self.cpu, dst_device="cpu",
                                    plugin_name=config.get("remote_storage_plugins", [None])[0]
                                    if "remote_url" not in config else None)
        assert self.remote.connection is not None, "the connector did not start"
        self.held: list = []       # memory objects this test owns a reference to

    def hold(self, obj):
        if obj is not None:
            self.held.append(obj)
        return obj

    def get(self, key):
        return self.hold(self.remote.get_blocking(key))

    def get_many(self, keys):
        return [self.hold(o) for o in self.remote.batched_get_blocking(keys)]

    def chunk(self, seed: int, tokens: int = CHUNK):
        obj = self.cpu.allocate(self.meta.get_shapes(tokens), self.meta.get_dtypes(), MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(torch.bfloat16))
        return self.hold(obj)

    def key(self, h: int) -> CacheEngineKey:
        return CacheEngineKey(self.meta.model_name, 1, 0, h, torch.bfloat16)

    def put(self, keys, objs) -> None:
        for k, o in zip(keys, objs):
            self.remote.submit_put_task(k, o).result(30)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        for obj in self.held:
            obj.ref_count_down()
        self.remote.close()


def plugin_extra(cluster, **more) -> dict:
    return {"remote_storage_plugin.kvproto.module_path": "kvproto.engines.lmcache",
            "remote_storage_plugin.kvproto.class_name": "KvprotoConnector",
            "kvproto.master": cluster.master_address, **more}


@pytest.fixture
def salt():
    return uuid.uuid4().hex


@pytest.mark.parametrize("save_chunk_meta", [True, False])
def test_plugin_route_round_trip(cluster, loop, salt, save_chunk_meta):
    e = Engine(loop, plugin_extra(cluster, **{"kvproto.salt": salt, "save_chunk_meta": save_chunk_meta}),
               remote_storage_plugins=["kvproto"])
    try:
        conn = e.remote.connection
        keys = [e.key(h) for h in (11, 12, 13)]
        objs = [e.chunk(1), e.chunk(2), e.chunk(3, tokens=CHUNK // 2)]     # a partial last chunk
        e.put(keys[:1] + keys[2:], objs[:1] + objs[2:])
        assert e.remote.contains(keys[0]) and not e.remote.contains(keys[1])
        got = e.get(keys[0])
        assert torch.equal(got.tensor, objs[0].tensor)
        # a lookup counts the present prefix: chunk 1 is missing, so chunk 2 does not count
        assert e.run(conn.batched_async_contains("l1", keys)) == 1
        assert conn.batched_contains(keys) == 1
        e.put(keys[1:2], objs[1:2])
        assert e.run(conn.batched_async_contains("l2", keys)) == 3
        many = e.get_many(keys)
        assert [torch.equal(m.tensor, o.tensor) for m, o in zip(many, objs)] == [True] * 3
        assert many[2].tensor.shape[2] == CHUNK // 2
        assert sorted(e.run(conn.list())) == sorted(k.to_string() for k in keys)
        assert e.run(conn.ping()) == 0 and conn.support_ping()
        assert conn.remove_sync(keys[0]) and not conn.remove_sync(keys[0])
        assert not conn.exists_sync(keys[0]) and e.get(keys[0]) is None
        assert conn._connector.put_failures == {}
    finally:
        e.close()


def test_plugin_namespace_keeps_revisions_apart(cluster, loop, salt):
    old = Engine(loop, plugin_extra(cluster, **{"kvproto.salt": salt, "kvproto.revision": "r1"}),
                 remote_storage_plugins=["kvproto"])
    new = Engine(loop, plugin_extra(cluster, **{"kvproto.salt": salt, "kvproto.revision": "r2"}),
                 remote_storage_plugins=["kvproto"])
    try:
        key = old.key(7)
        old.put([key], [old.chunk(7)])
        assert old.remote.contains(key)
        assert not new.remote.contains(key) and new.get(key) is None
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("save_chunk_meta", [True, False])
def test_mooncakestore_route_over_the_shim(cluster, loop, monkeypatch, save_chunk_meta):
    """LMCache's own Mooncake connector, unchanged, on kvproto: the shim is
    first on sys.path (forced past a real Mooncake, where one is installed)."""
    extra = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
             "global_segment_size": "16MB", "local_buffer_size": "16MB", "protocol": "tcp",
             "master_server_address": cluster.master_address, "save_chunk_meta": save_chunk_meta,
             "transfer_timeout": 10}
    with fresh_import([SHIM_PATH], monkeypatch, mode="force"):
        e = Engine(loop, extra, model=f"m-{uuid.uuid4().hex[:8]}", remote_url="mooncakestore://x")
    try:
        conn = e.remote.connection
        assert "MooncakestoreConnector" in repr(conn)
        keys = [e.key(h) for h in (21, 22)]
        objs = [e.chunk(21), e.chunk(22)]
        e.put(keys, objs)
        assert e.run(conn.batched_async_contains("l", keys)) == 2
        many = e.get_many(keys)
        assert [torch.equal(m.tensor, o.tensor) for m, o in zip(many, objs)] == [True, True]
        assert e.get_many([e.key(99)]) == [None]
    finally:
        e.close()
