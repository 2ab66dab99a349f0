"""A vLLM v1 KV connector on kvproto.

Loaded out of tree::

    KVTransferConfig(kv_connector="KvprotoConnector",
                     kv_connector_module_path="kvproto.engines.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"kvproto.master": "tcp://127.0.0.1:5555"})

The shape is vLLM's ``KVConnectorBase_V1`` (vLLM 0.32); the base class is
taken from vLLM when it is importable, otherwise a stand-in with the same
methods is used, so this module imports without vLLM.

Scheduler side (one instance, role ``SCHEDULER``):

* ``get_num_new_matched_tokens`` keys the prompt's full chunks in the
  namespace (model, revision, this layout, tenant, the request's cache salt)
  and asks ``exists_many`` about every object of every chunk, all
  tensor-parallel ranks and layer groups: the hit is the longest contiguous
  run of complete chunks from the start, beyond what vLLM computed itself.
  The prompt's last token is never offered (vLLM computes at least one).
  A lookup that fails (no master, a master switch) is a miss. Loads are
  synchronous (``False``): they run in the step that uses them.
* ``update_state_after_alloc`` records which of the request's blocks the
  hit's tokens go to; ``build_connector_meta`` sends the workers, per request,
  the chunks to load (and into which blocks) and the chunks that become
  complete in this step and are not yet stored (saved from which blocks).

Worker side (one instance per worker, role ``WORKER``):

* ``register_kv_caches`` takes vLLM's per-layer views (``[blocks, heads,
  tokens, K+V]``, manager blocks possibly split into kernel blocks) and
  checks them against the layout the namespace names;
* ``start_load_kv`` starts loading this rank's objects, layer group by layer
  group, on a loader thread (:meth:`ChunkStore.load`: loads under the Timeout
  protocol, every object's digest, layout tag and chunk checked);
  ``wait_for_layer_load`` waits for the layer's group and scatters its
  verified bytes into the layer's blocks;
* ``save_kv_layer`` gathers the layer's blocks of each chunk to save (one
  ``index_select`` per layer and request); ``wait_for_save`` copies each
  layer group's gathered bytes into its object and hands the batch to a saver
  thread (one ``put_many``);
* ``get_block_ids_with_load_errors`` reports every block of every chunk from
  the first one that did not load completely (missing, corrupt, another
  layout, timed out): vLLM's ``kv_load_failure_policy`` then recomputes them
  (``recompute``) or fails the request (``fail``). A timed-out load's bytes
  land, if ever, in the transfer engine's host buffer, which stays
  quarantined until the load drains and is never consumed: they can never
  reach a block of vLLM's, which vLLM is free to recompute at once.

Bytes move in one place per direction: :meth:`KvprotoConnector._gather` and
:meth:`KvprotoConnector._publish` (save), :meth:`ChunkStore.load` with
:meth:`KvprotoConnector._keep` and :meth:`KvprotoConnector._scatter` (load).
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import attrs

from kvproto import errors
from kvproto.engines.chunks import ChunkStore, group_layers, lookup, tensor_copy
from kvproto.engines.prefix import Chunk, Namespace

log = logging.getLogger("kvproto.engines.vllm")

try:   # the real base class when vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):   # type: ignore[no-redef]
        """vLLM's roles: the same names and values."""
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:   # type: ignore[no-redef]
        """What the scheduler side sends the workers each step."""

    class KVConnectorBase_V1:   # type: ignore[no-redef]
        """The part of vLLM's ``KVConnectorBase_V1`` this connector relies on."""

        def __init__(self, vllm_config, role, kv_cache_config) -> None:
            if vllm_config.kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

_PREFIX = "kvproto."
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "u8",
           "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2"}


# --------------------------------------------------------------------------- metadata


@attrs.frozen
class ChunkTask:
    """One chunk of one request: load it into, or save it from, ``blocks``
    (vLLM block ids of the chunk's blocks ``first``, ``first + 1``, ...; the
    chunk's blocks before ``first`` were computed by vLLM itself)."""

    chunk: Chunk
    first: int
    blocks: tuple


@attrs.frozen
class RequestTasks:
    req_id: str
    chunks: tuple        # ChunkTask, in chunk order
    salt: str = ""       # the request's cache salt (part of its namespace)


@attrs.define
class KvprotoConnectorMetadata(KVConnectorMetadata):
    """One step's work: per request the chunks to load and to save."""

    loads: list = attrs.field(factory=list)     # RequestTasks
    saves: list = attrs.field(factory=list)     # RequestTasks


# --------------------------------------------------------------------------- configuration


def _extra(config, name: str, default=None):
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    return extra.get(_PREFIX + name, default)


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.get(name, name)


def layout_tag(kv_cache_config, tp_size: int) -> str:
    """The layout of this engine's KV pages: layers, KV heads, head sizes (K and
    V), dtype, block size, tensor-parallel size, and the page order (one block
    per page: heads, then tokens, then K and V side by side)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise errors.InvalidArgument(f"the kvproto connector handles one KV cache group, not {len(groups)} "
                                     "(hybrid models are not supported)")
    spec = groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    return (f"vllm1:L{len(groups[0].layer_names)}:H{spec.num_kv_heads}:D{spec.head_size}+{head_v}"
            f":{_dtype_name(spec.dtype)}:B{spec.block_size}:tp*/{tp_size}:page-hnc")


def _layer_order(names) -> list[str]:
    def index(name: str):
        m = re.search(r"\.(\d+)\.", f".{name}.")
        return (int(m.group(1)) if m else 1 << 30, name)
    return sorted(names, key=index)


# --------------------------------------------------------------------------- the connector


@attrs.define
class _Tracked:
    """The scheduler's view of one request."""

    salt: str
    chunks: list            # full chunks of the prompt (less its last token)
    blocks: list            # vLLM block ids, in order
    stored: int = 0         # chunks [0, stored) are stored or being saved
    local: int = 0          # tokens vLLM computed itself at the lookup
    load_to: int = 0        # tokens [local, load_to) come from the store this step


class KvprotoConnector(KVConnectorBase_V1):
    """vLLM's KV connector on kvproto (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        master = _extra(cfg, "master")
        if not master:
            raise errors.InvalidArgument("kv_connector_extra_config needs 'kvproto.master': a master "
                                         "address (tcp://host:port) or a coordinator URL")
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.chunk_tokens = int(_extra(cfg, "chunk_tokens", 256))
        if self.chunk_tokens < self.block_size or self.chunk_tokens % self.block_size:
            raise errors.InvalidArgument(f"kvproto.chunk_tokens ({self.chunk_tokens}) must be a multiple "
                                         f"of the block size ({self.block_size})")
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.num_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        groups = int(_extra(cfg, "layer_groups", 1))
        self.groups = group_layers(self.num_layers, groups)
        model = _extra(cfg, "model") or str(vllm_config.model_config.model)
        revision = _extra(cfg, "revision") or str(getattr(vllm_config.model_config, "revision", None) or "")
        self.namespace = Namespace(model, revision, layout_tag(kv_cache_config, self.tp_size),
                                   str(_extra(cfg, "tenant", "default")), ranks=self.tp_size,
                                   layer_groups=groups)
        role_name = getattr(cfg, "kv_role", "kv_both")
        self.saves = role_name in ("kv_both", "kv_producer")
        self.loads = role_name in ("kv_both", "kv_consumer")
        from kvproto.runtime.client import Client
        self.client = Client(master, timeout=float(_extra(cfg, "timeout", 10.0)))
        self._timeout = float(_extra(cfg, "timeout", 10.0))
        self._replicas = int(_extra(cfg, "replicas", 1))
        self._buffers = int(_extra(cfg, "buffers", 8))
        self.store: Optional[ChunkStore] = None
        self.counters = {"lookups": 0, "lookup_failures": 0, "hit_tokens": 0, "loaded_chunks": 0,
                         "failed_chunks": 0, "saved_objects": 0, "save_failures": 0}
        # scheduler side
        self._requests: dict[str, _Tracked] = {}
        # worker side
        self.rank = 0
        self._layers: dict[str, int] = {}
        self._caches: dict[str, Any] = {}
        self._split = 1
        self._loader = self._saver = None
        self._load_state: Optional[_StepLoads] = None
        self._invalid: set = set()
        self._staged: dict = {}
        self._saving: list = []
        self._lock = threading.Lock()
        if role == KVConnectorRole.WORKER:
            self.rank = int(_extra(cfg, "rank", _tp_rank()))
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvproto-vllm-load")
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvproto-vllm-save")

    # ================================================================== scheduler side

    def _namespace(self, salt: str) -> Namespace:
        return self.namespace.with_salt(salt) if salt else self.namespace

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        salt = str(getattr(request, "cache_salt", None) or "")
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tokens = list(request.prompt_token_ids or [])
            chunks = self._namespace(salt).chunks(tokens[:max(len(tokens) - 1, 0)], self.chunk_tokens,
                                                  partial=False)
            tracked = self._requests[request.request_id] = _Tracked(salt, chunks, [])
        hit = 0
        if self.loads and tracked.chunks:
            self.counters["lookups"] += 1
            try:
                hit = lookup(self.client, self._namespace(salt), tracked.chunks)
            except errors.KvError as e:   # no master, a switch: a miss, never a failed request
                self.counters["lookup_failures"] += 1
                log.warning("kvproto lookup failed, treated as a miss: %s", e)
        tracked.stored = max(tracked.stored, hit)
        tracked.local = num_computed_tokens
        hit_tokens = tracked.chunks[hit - 1].end if hit else 0
        return max(0, hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        if num_external_tokens > 0:
            tracked.blocks = list(blocks.get_block_ids()[0])
            tracked.load_to = tracked.local + num_external_tokens
            self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KvprotoConnectorMetadata:
        meta = KvprotoConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.blocks = list(new.block_ids[0])
            self._plan(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                tracked.blocks = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.blocks.extend(new_blocks[0])
            self._plan(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
        return meta

    def _plan(self, meta: KvprotoConnectorMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """Add the request's loads of this step and the chunks it completes."""
        bpc, bs = self.blocks_per_chunk, self.block_size
        if tracked.load_to > tracked.local:
            tasks = []
            for c in tracked.chunks:
                if c.end <= tracked.local or c.start >= tracked.load_to:
                    continue
                first = (max(c.start, tracked.local) - c.start) // bs
                last = (min(c.end, tracked.load_to) - c.start) // bs
                tasks.append(ChunkTask(c, first, tuple(tracked.blocks[c.start // bs + first:
                                                                      c.start // bs + last])))
            meta.loads.append(RequestTasks(req_id, tuple(tasks), tracked.salt))
            tracked.local = tracked.load_to
        if self.saves:
            tasks = []
            while tracked.stored < len(tracked.chunks) and tracked.chunks[tracked.stored].end <= computed:
                c = tracked.chunks[tracked.stored]
                blocks = tuple(tracked.blocks[c.start // bs:c.start // bs + bpc])
                if len(blocks) < bpc:
                    break
                tasks.append(ChunkTask(c, 0, blocks))
                tracked.stored += 1
            if tasks:
                meta.saves.append(RequestTasks(req_id, tuple(tasks), tracked.salt))

    def update_connector_output(self, connector_output) -> None:
        """Chunks whose blocks failed to load are recomputed by vLLM: store
        them again once they are (the worker removed objects that failed their check)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        bs = self.block_size
        for tracked in self._requests.values():
            for c in tracked.chunks[:tracked.stored]:
                if invalid.intersection(tracked.blocks[c.start // bs:c.end // bs]):
                    tracked.stored = c.index
                    break

    def request_finished(self, request, block_ids):
        self._requests.pop(request.request_id, None)
        return False, None

    # ================================================================== worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        head_v = getattr(spec, "head_size_v", None) or spec.head_size
        names = _layer_order(kv_caches)
        if len(names) != self.num_layers:
            raise errors.InvalidArgument(f"{len(names)} KV caches registered, {self.num_layers} layers expected")
        num_blocks = self._kv_cache_config.num_blocks
        for i, name in enumerate(names):
            t = kv_caches[name]
            if t.dim() != 4 or t.shape[0] % num_blocks or t.shape[1] != spec.num_kv_heads \
                    or t.shape[3] != spec.head_size + head_v \
                    or t.shape[0] // num_blocks * t.shape[2] != self.block_size \
                    or _dtype_name(t.dtype) != _dtype_name(spec.dtype):
                raise errors.InvalidArgument(
                    f"layer {name}: KV cache {tuple(t.shape)} {t.dtype} is not [blocks, "
                    f"{spec.num_kv_heads} heads, block tokens, {spec.head_size}+{head_v}] "
                    f"{spec.dtype} ({self.namespace.layout})")
            self._layers[name] = i
            self._caches[name] = t
        first = kv_caches[names[0]]
        self._split = first.shape[0] // num_blocks
        self._page = (spec.num_kv_heads, self.block_size, spec.head_size + head_v)
        self._dtype = first.dtype
        page_bytes = first.element_size() * spec.num_kv_heads * self.block_size * (spec.head_size + head_v)
        self._page_bytes = page_bytes
        payload = max(len(g) for g in self.groups) * self.blocks_per_chunk * page_bytes
        self.store = ChunkStore(self.client, self.namespace, payload, replicas=self._replicas,
                                timeout=self._timeout, buffers=self._buffers)

    def _group_of(self, layer: int) -> int:
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g
        raise KeyError(layer)

    def _pages(self, cache):
        """A layer's cache with one manager block per index of dim 0."""
        if self._split == 1:
            return cache
        return cache.unflatten(0, (cache.shape[0] // self._split, self._split))

    # ------------------------------------------------------------------ load

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvprotoConnectorMetadata) or not meta.loads or self.store is None:
            return
        state = _StepLoads(meta.loads, len(self.groups))
        self._load_state = state
        state.future = self._loader.submit(self._load_step, state)

    def _load_step(self, state: "_StepLoads") -> None:
        """The loader thread: group by group, every request's chunks."""
        try:
            for g in range(len(self.groups)):
                for r, req in enumerate(state.requests):
                    limit = state.usable[r]
                    chunks = [t.chunk for t in req.chunks[:limit]]
                    if chunks:
                        result = self.store.load(chunks, lambda i, gg, p, r=r: self._keep(state, r, i, gg, p),
                                                 rank=self.rank, groups=[g],
                                                 namespace=self._namespace(req.salt))
                        state.usable[r] = min(limit, result.usable)
                        for (i, _), e in result.errors.items():
                            log.info("kvproto load of %s chunk %d group %d failed: %s", req.req_id, i, g, e)
                state.done[g].set()
        finally:
            for ev in state.done:
                ev.set()

    def _keep(self, state: "_StepLoads", r: int, i: int, g: int, payload: memoryview) -> None:
        """Keep a verified object's bytes until its layers are scattered."""
        layers = len(self.groups[g])
        t = tensor_copy(payload, self._dtype).view(layers, self.blocks_per_chunk, *self._page)
        state.kept[r, i, g] = t

    def wait_for_layer_load(self, layer_name: str) -> None:
        state = self._load_state
        if state is None or layer_name not in self._layers:
            return
        layer = self._layers[layer_name]
        g = self._group_of(layer)
        state.done[g].wait()
        self._scatter(state, layer_name, layer, g)

    def _scatter(self, state: "_StepLoads", name: str, layer: int, g: int) -> None:
        """Write the loaded chunks' pages of one layer into its blocks."""
        import torch
        cache = self._caches[name]
        pages = self._pages(cache)
        j = layer - self.groups[g].start
        for r, req in enumerate(state.requests):
            for i, task in enumerate(req.chunks[:state.usable[r]]):
                kept = state.kept.get((r, i, g))
                if kept is None or not task.blocks:
                    continue
                src = kept[j, task.first:task.first + len(task.blocks)].to(cache.device)
                ids = torch.tensor(task.blocks, dtype=torch.long, device=cache.device)
                if self._split == 1:
                    pages.index_copy_(0, ids, src)
                else:   # a page of block tokens back into its kernel blocks
                    h, n, c = self._page
                    parts = src.view(len(task.blocks), h, self._split, n // self._split, c).transpose(1, 2)
                    pages.index_copy_(0, ids, parts)
        state.scattered.add((layer, g))

    def _finish_loads(self) -> None:
        """Wait for the step's loads; record the blocks that did not load."""
        state, self._load_state = self._load_state, None
        if state is None:
            return
        state.future.result()
        for r, req in enumerate(state.requests):
            usable = state.usable[r]
            for g, layers in enumerate(self.groups):   # a layer vLLM never waited for was not written
                if any((layer, g) not in state.scattered for layer in layers):
                    usable = 0
            self.counters["loaded_chunks"] += usable
            self.counters["failed_chunks"] += len(req.chunks) - usable
            for task in req.chunks[usable:]:
                self._invalid.update(task.blocks)

    def get_block_ids_with_load_errors(self) -> set:
        self._finish_loads()
        out, self._invalid = self._invalid, set()
        return out

    # ------------------------------------------------------------------ save

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvprotoConnectorMetadata) or not meta.saves or self.store is None \
                or layer_name not in self._layers:
            return
        self._gather(meta, layer_name, kv_layer)

    def _gather(self, meta: KvprotoConnectorMetadata, name: str, kv_layer) -> None:
        """One layer's pages of every chunk to save, into the chunk's object."""
        import torch
        layer = self._layers[name]
        g = self._group_of(layer)
        j = layer - self.groups[g].start
        pages = self._pages(kv_layer)
        for req in meta.saves:
            for task in req.chunks:
                key = (req.req_id, task.chunk.index, g)
                stage = self._staged.get(key)
                if stage is None:
                    stage = self._staged[key] = torch.empty(
                        (len(self.groups[g]), self.blocks_per_chunk, *self._page), dtype=self._dtype,
                        device=kv_layer.device)
                ids = torch.tensor(task.blocks, dtype=torch.long, device=kv_layer.device)
                got = pages.index_select(0, ids)
                if self._split > 1:
                    h, n, c = self._page
                    got = got.transpose(1, 2).reshape(len(task.blocks), h, n, c)
                stage[j].copy_(got)

    def wait_for_save(self) -> None:
        self._finish_loads()
        meta = self._connector_metadata
        staged, self._staged = self._staged, {}
        if not isinstance(meta, KvprotoConnectorMetadata) or not staged:
            return
        import torch
        requests = {req.req_id: req for req in meta.saves}
        chunks = {(req.req_id, t.chunk.index): t.chunk for req in meta.saves for t in req.chunks}
        batches: dict = {}
        for (req_id, index, g), stage in staged.items():
            obj = self.store.new_object(stage.numel() * stage.element_size())
            torch.from_numpy(obj.payload).view(stage.dtype).view(stage.shape).copy_(stage)   # one d2h
            batches.setdefault(requests[req_id].salt, []).append((chunks[req_id, index], self.rank, g, obj))
        self._saving = [f for f in self._saving if not f.done()]
        self._saving.append(self._saver.submit(self._publish, batches))

    def _publish(self, batches: dict) -> None:
        """The saver thread: one ``put_many`` per namespace of a step's objects."""
        results = []
        for salt, parts in batches.items():
            try:
                results += self.store.save(parts, self._namespace(salt))
            except errors.KvError as e:
                results += [e] * len(parts)
        with self._lock:
            for e in results:
                self.counters["saved_objects" if e is None else "save_failures"] += 1
        for e in results:
            if e is not None:
                log.info("kvproto save failed: %s", e)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until every save handed to the saver thread has been stored or failed."""
        for f in list(self._saving):
            f.result(timeout)

    # ------------------------------------------------------------------ the rest

    def get_finished(self, finished_req_ids):
        return None, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        return True   # wait_for_layer_load / save_kv_layer run between layers

    def shutdown(self) -> None:
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
        self.client.close()


class _StepLoads:
    """One step's loads on the worker: what the loader thread produced."""

    def __init__(self, requests: list, groups: int) -> None:
        self.requests = list(requests)
        self.usable = [len(r.chunks) for r in self.requests]   # shrinks as loads fail
        self.kept: dict = {}
        self.done = [threading.Event() for _ in range(groups)]
        self.scattered: set = set()
        self.future = None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore
        return int(get_tensor_model_parallel_rank())
    except Exception:   # noqa: BLE001 - not in a vLLM worker: a single rank
        return 0
