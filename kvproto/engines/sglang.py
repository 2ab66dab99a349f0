"""An SGLang HiCache storage back end on kvproto.

SGLang loads it as the ``dynamic`` back end::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvproto",
        "module_path": "kvproto.engines.sglang", "class_name": "KvprotoHiCacheStorage",
        "kvproto_master": "tcp://10.0.0.1:5555"}'

and builds it as ``cls(storage_config, kwargs)``. Other ``extra_config`` keys:
``kvproto_revision``, ``kvproto_tenant``, ``kvproto_salt`` (namespace fields),
``kvproto_replicas``, ``kvproto_timeout`` (seconds per call).

SGLang's page keys are already chained prefix hashes; each is stored under a
kvproto namespace (:mod:`kvproto.engines.prefix`) of the model, revision,
tenant, salt and the rank layout, named as SGLang's own file back end names
it: per tensor-parallel rank (``tp<rank>/<size>``), except MLA, whose KV is
the same on every rank and shared; pipeline and attention context-parallel
ranks always split it. A page moved by ``batch_get_v1`` / ``batch_set_v1`` is
as many objects as the host pool gives buffers per page
(``get_page_buffer_meta``: K and V per page, or per layer and page), written
from and read into the host pool's memory by address.

Semantics follow SGLang's interface: ``set`` of a stored key is a success and
keeps the stored bytes; ``get`` fills ``target_location`` and returns it, or
``None`` on a miss; ``batch_exists`` counts the keys present from the first
one (for v1 pages: every object of the page present).
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvproto import errors
from kvproto.engines.memory import load_into, memory_at
from kvproto.engines.prefix import Namespace
from kvproto.runtime.client import Client

log = logging.getLogger("kvproto.engines.sglang")


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without copying a contiguous CPU tensor."""
    flat = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy())


def _layout(config: HiCacheStorageConfig) -> str:
    parts = ["sglang", "mla" if config.is_mla_model else f"tp{config.tp_rank}/{config.tp_size}"]
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}/{config.dcp_size}:page{config.logical_page_size}")
    return ":".join(parts)


class KvprotoHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a :class:`kvproto.Client`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        master = extra.get("kvproto_master")
        if not master:
            raise ValueError("extra_config needs kvproto_master (a kvproto master address or "
                             "coordinator URL)")
        self.storage_config = storage_config
        self.namespace = Namespace(storage_config.model_name or "unnamed",
                                   str(extra.get("kvproto_revision", "")), _layout(storage_config),
                                   tenant=str(extra.get("kvproto_tenant", "default")),
                                   salt=str(extra.get("kvproto_salt", "")))
        self.replicas = int(extra.get("kvproto_replicas", 1))
        self.client = Client(str(master), timeout=float(extra.get("kvproto_timeout", 30.0)))

    def _key(self, key: str, part: Optional[int] = None) -> str:
        return self.namespace.engine_key(key if part is None else f"{key}#{part}")

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ tensors

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Fill each target tensor with its key's bytes; ``None`` for a miss
        (or a stored object whose size is not the target's)."""
        targets = list(target_locations or [None] * len(keys))
        out: List[Optional[torch.Tensor]] = [None] * len(keys)
        todo = [i for i, t in enumerate(targets) if t is not None]
        if any(not targets[i].is_contiguous() for i in todo):
            raise ValueError("target tensors must be contiguous")
        if not todo:
            return out
        views = [[_as_bytes(targets[i])] for i in todo]
        for i, view, got in zip(todo, views, load_into(self.client, [self._key(keys[i]) for i in todo],
                                                       views)):
            if got == view[0].nbytes:
                out[i] = targets[i]
            elif not isinstance(got, errors.KeyNotFound):
                log.warning("get of %s: %s", keys[i], got)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """True when every key is stored (a key already stored counts)."""
        if values is None or len(values) != len(keys):
            return False
        return all(self._put([(self._key(k), _as_bytes(v)) for k, v in zip(keys, values)]))

    def _put(self, items: list) -> List[bool]:
        try:
            results = self.client.put_many(items, replicas=self.replicas)
        except errors.KvError as err:
            results = [err] * len(items)
        ok = []
        for (key, _), err in zip(items, results):
            if err is not None and not isinstance(err, errors.KeyExists):
                log.warning("put of %s: %s", key, err)
            ok.append(err is None or isinstance(err, errors.KeyExists))
        return ok

    # ------------------------------------------------------------------ lookups

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _page_parts(self) -> int:
        """Objects per page of the registered host pool (0 before one is registered)."""
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            return 0
        ptrs, _ = pool.get_page_buffer_meta(torch.arange(pool.page_size))
        return len(ptrs)

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """How many keys are present from the first one. A key stored as pages
        by ``batch_set_v1`` is present when all of its objects are."""
        if not keys:
            return 0
        parts = self._page_parts()
        names = [[self._key(k)] + [self._key(k, p) for p in range(parts)] for k in keys]
        present = self.client.exists_many([n for group in names for n in group])
        at, count = 0, 0
        for group in names:
            whole, pages = present[at], present[at + 1:at + len(group)]
            at += len(group)
            if not (whole or (pages and all(pages))):
                break
            count += 1
        return count

    # ------------------------------------------------------------------ host pool pages

    def _pages(self, keys: List[str], host_indices: torch.Tensor) -> tuple[list, list]:
        """Per key, its object keys and views of its page buffers in the host pool."""
        pool = self.mem_pool_host
        if len(keys) == 0 or len(host_indices) != len(keys) * pool.page_size:
            raise ValueError(f"{len(host_indices)} host indices for {len(keys)} pages of "
                             f"{pool.page_size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        parts, rest = divmod(len(ptrs), len(keys))
        if rest or not parts or len(sizes) != len(ptrs):
            raise ValueError(f"{len(ptrs)} page buffers for {len(keys)} keys")
        names, views = [], []
        for i, key in enumerate(keys):
            names.append([self._key(key, p) for p in range(parts)])
            views.append([memory_at(ptrs[i * parts + p], sizes[i * parts + p]) for p in range(parts)])
        return names, views

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Store each page from the host pool: per key, whether all of its objects are stored."""
        names, views = self._pages(keys, host_indices)
        flat = self._put([(n, v) for ns, vs in zip(names, views) for n, v in zip(ns, vs)])
        parts = len(names[0])
        return [all(flat[i * parts:(i + 1) * parts]) for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Load each page into the host pool: per key, whether every object loaded whole."""
        names, views = self._pages(keys, host_indices)
        flat_names = [n for ns in names for n in ns]
        flat_views = [[v] for vs in views for v in vs]
        got = load_into(self.client, flat_names, flat_views)
        parts = len(names[0])
        return [all(g == v[0].nbytes for g, v in zip(got[i * parts:(i + 1) * parts],
                                                     flat_views[i * parts:(i + 1) * parts]))
                for i in range(len(keys))]

    def clear(self) -> None:
        """Remove every object of this back end's namespace."""
        keys = self.client.keys(self.namespace.engine_key("").encode())
        for key, err in zip(keys, self.client.remove_many(keys)):
            if err is not None:
                log.warning("clear: %s stays: %s", key, err)

    def get_stats(self):
        return None
