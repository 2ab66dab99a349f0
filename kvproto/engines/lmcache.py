"""An LMCache remote-storage plug-in on kvproto (``plugin://kvproto``).

LMCache loads it from its configuration::

    remote_storage_plugins: ["kvproto"]
    extra_config:
      remote_storage_plugin.kvproto.module_path: kvproto.engines.lmcache
      remote_storage_plugin.kvproto.class_name: KvprotoConnector
      kvproto.master: tcp://10.0.0.1:5555      # or file:///dir, etcd://host:port
      kvproto.revision: "<model revision>"      # optional, part of the namespace
      kvproto.tenant: default                   # optional, part of the namespace
      kvproto.salt: ""                          # optional, part of the namespace
      kvproto.replicas: 1                       # optional
      kvproto.timeout: 30                       # optional, seconds per call

Each LMCache chunk key (already a chained prefix hash, with the model, world
size, worker and dtype in it) is stored under a kvproto namespace
(:mod:`kvproto.engines.prefix`) of the model, revision, LMCache's chunk layout
(shapes, dtypes, memory format, chunk size), tenant and salt, so a new revision
or layout never reads old objects. With LMCache's ``save_chunk_meta`` (its
default) an object is LMCache's ``RemoteMetadata`` followed by the KV bytes;
without it, the KV bytes alone (a partial last chunk is recognised by its
length). Puts are one ``put_many`` (a re-put of a stored chunk is a success),
gets one ``get_many``, lookups one ``exists_many`` counted as the longest
present prefix.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvproto import errors
from kvproto.engines.prefix import Namespace
from kvproto.runtime.client import Client

log = logging.getLogger("kvproto.engines.lmcache")

PREFIX = "kvproto."


def _contiguous_prefix(present: List[bool]) -> int:
    return present.index(False) if False in present else len(present)


class KvprotoConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over a :class:`kvproto.Client`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = dict(config.extra_config or {})
        master = extra.get(PREFIX + "master")
        if not master:
            raise ValueError(f"extra_config needs {PREFIX}master (a kvproto master address or "
                             f"coordinator URL)")
        meta = local_cpu_backend.metadata
        layout = (f"lmcache:{self.meta_fmt.name}:{[tuple(s) for s in self.meta_shapes]}:"
                  f"{[str(d) for d in self.meta_dtypes]}:chunk{meta.chunk_size}")
        self.namespace = Namespace(meta.model_name, str(extra.get(PREFIX + "revision", "")), layout,
                                   tenant=str(extra.get(PREFIX + "tenant", "default")),
                                   salt=str(extra.get(PREFIX + "salt", "")))
        self.replicas = int(extra.get(PREFIX + "replicas", 1))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.client = Client(str(master), timeout=float(extra.get(PREFIX + "timeout", 30.0)))
        #: puts that failed (other than "already stored"), by error name
        self.put_failures: dict[str, int] = {}

    def _key(self, key: CacheEngineKey) -> str:
        return self.namespace.engine_key(key.to_string())

    # ------------------------------------------------------------------ lookups

    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.client.exists(self._key(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many keys from the first one are present (the contiguous prefix)."""
        if not keys:
            return 0
        return _contiguous_prefix(self.client.exists_many([self._key(k) for k in keys]))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # ------------------------------------------------------------------ get

    def _memory_obj(self, view: memoryview) -> Optional[MemoryObj]:
        """A MemoryObj of LMCache's CPU backend holding the stored bytes ``view``."""
        if self.save_chunk_meta:
            head = self.remote_metadata_bytes
            meta = RemoteMetadata.deserialize(view[:head])
            if meta.length != view.nbytes - head:
                log.warning("stored object of %d bytes does not match its metadata", view.nbytes)
                return None
            obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            body = view[head:]
        else:
            if view.nbytes > self.full_chunk_size_bytes:
                return None
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            body = view
        if obj is None:
            log.warning("LMCache's CPU backend has no room for a remote chunk")
            return None
        target = obj.byte_array
        if not isinstance(target, memoryview):
            target = memoryview(target)
        target.cast("B")[:body.nbytes] = body
        if not self.save_chunk_meta:
            try:
                obj = self.reshape_partial_chunk(obj, body.nbytes)
            except ValueError:
                obj.ref_count_down()
                return None
        return obj

    def _get_many(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        try:
            views = self.client.get_many([self._key(k) for k in keys])
        except errors.KvError as err:
            log.warning("batched get of %d keys failed: %s", len(keys), err)
            return [None] * len(keys)
        return [None if v is None else self._memory_obj(v) for v in views]

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        if not keys:
            return []
        return await asyncio.to_thread(self._get_many, keys)

    # ------------------------------------------------------------------ put

    def _value(self, obj: MemoryObj) -> Any:
        data = obj.byte_array
        if not self.save_chunk_meta:
            return data
        head = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(),
                              obj.get_memory_format()).serialize()
        return b"".join((head, data))        # one copy

    def _put_many(self, keys: List[CacheEngineKey], objs: List[MemoryObj]) -> None:
        items = [(self._key(k), self._value(o)) for k, o in zip(keys, objs)]
        try:
            results = self.client.put_many(items, replicas=self.replicas)
        except errors.KvError as err:
            results = [err] * len(items)
        for (key, _), err in zip(items, results):
            if err is not None and not isinstance(err, errors.KeyExists):
                name = type(err).__name__
                self.put_failures[name] = self.put_failures.get(name, 0) + 1
                log.warning("put of %s failed: %s", key, err)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        if keys:
            await asyncio.to_thread(self._put_many, keys, memory_objs)

    # ------------------------------------------------------------------ the rest

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            self.client.remove(self._key(key))
            return True
        except errors.KvError:
            return False

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, else the kvproto error code."""
        try:
            await asyncio.to_thread(self.client.stats)
            return 0
        except errors.KvError as err:
            return err.code

    async def list(self) -> List[str]:
        """The LMCache keys stored in this connector's namespace."""
        prefix = self.namespace.engine_key("")
        keys = await asyncio.to_thread(self.client.keys, prefix.encode())
        return [k.decode()[len(prefix):] for k in keys]

    async def close(self) -> None:
        self.client.close()
