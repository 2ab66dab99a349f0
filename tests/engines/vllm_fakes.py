"""A stand-in for vLLM around the kvproto connector: configs shaped like
vLLM 0.32's, a fake model whose KV of a token depends on every token before
it, and an engine that calls the connector's methods in the order vLLM's
scheduler and model runner do (kv_connector_model_runner_mixin, the
attention layer's maybe_transfer_kv_layer, Scheduler.schedule and
update_from_output), with vLLM's "recompute" load-failure policy."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from kvproto.engines.vllm import KvprotoConnector, KVConnectorRole

LAYER = "model.layers.{}.self_attn.attn"


def configs(master: str, *, layers: int = 4, heads: int = 2, head: int = 8, block: int = 16,
            chunk: int = 32, groups: int = 2, role: str = "kv_both", tp: int = 1,
            num_blocks: int = 64, dtype=torch.float32, **extra):
    spec = SimpleNamespace(block_size=block, num_kv_heads=heads, head_size=head, head_size_v=head,
                           dtype=dtype)
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=[LAYER.format(i) for i in range(layers)])])
    extra_config = {"kvproto.master": master, "kvproto.chunk_tokens": chunk,
                    "kvproto.layer_groups": groups, "kvproto.timeout": 2.0}
    extra_config.update({f"kvproto.{k}": v for k, v in extra.items()})
    transfer = SimpleNamespace(kv_connector="KvprotoConnector",
                               kv_connector_module_path="kvproto.engines.vllm", kv_role=role,
                               kv_connector_extra_config=extra_config)
    vllm_config = SimpleNamespace(kv_transfer_config=transfer,
                                  model_config=SimpleNamespace(model="fake-model", revision=None),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return vllm_config, kv_cache_config


def true_kv(tokens: list[int], layer: int, rank: int, heads: int, head: int, dtype) -> torch.Tensor:
    """The fake model's K and V of every position: ``[tokens, heads, 2 * head]``,
    a function of the layer, the rank and every token up to the position."""
    out = torch.empty((len(tokens), heads, 2 * head), dtype=dtype)
    h = hashlib.blake2b(f"{layer}/{rank}".encode(), digest_size=8)
    for p, t in enumerate(tokens):
        h.update(t.to_bytes(4, "little"))
        g = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") >> 1)
        out[p] = torch.randn((heads, 2 * head), generator=g).to(dtype)
    return out


class FakeBlocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


class Engine:
    """One engine: a scheduler-side connector, one worker-side connector per
    tensor-parallel rank, paged KV per layer and rank, a block allocator."""

    def __init__(self, master: str, *, tp: int = 1, split: int = 1, budget: int = 1 << 30, **kw):
        self.vllm_config, self.kv_cache_config = configs(master, tp=tp, **kw)
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.spec, self.block, self.split, self.budget = spec, spec.block_size, split, budget
        self.layers = self.kv_cache_config.kv_cache_groups[0].layer_names
        n = self.kv_cache_config.num_blocks
        self.free = list(range(n))
        self.scheduler = KvprotoConnector(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.workers, self.kv = [], []
        for rank in range(tp):
            self.vllm_config.kv_transfer_config.kv_connector_extra_config["kvproto.rank"] = rank
            w = KvprotoConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            # [manager blocks x split kernel blocks, heads, kernel block tokens, K+V]
            kv = {name: torch.zeros((n * split, spec.num_kv_heads, self.block // split, 2 * spec.head_size),
                                    dtype=spec.dtype) for name in self.layers}
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kv.append(kv)
        self.computed_positions: list[int] = []     # positions the fake model computed
        self.invalid_reported: set = set()

    # ------------------------------------------------------------------ the model

    def _write(self, rank: int, name: str, layer: int, tokens, blocks, start: int, end: int) -> None:
        truth = true_kv(tokens[:end], layer, rank, self.spec.num_kv_heads, self.spec.head_size, self.spec.dtype)
        cache = self.kv[rank][name]
        k = self.block // self.split
        for p in range(start, end):
            b, off = divmod(p, self.block)
            sub, off = divmod(off, k)
            cache[blocks[b] * self.split + sub, :, off] = truth[p]

    def kv_of(self, rank: int, layer: int, blocks, end: int) -> torch.Tensor:
        """This engine's KV of positions [0, end) of a request, ``[tokens, heads, K+V]``."""
        cache = self.kv[rank][self.layers[layer]]
        k = self.block // self.split
        rows = []
        for p in range(end):
            b, off = divmod(p, self.block)
            sub, off = divmod(off, k)
            rows.append(cache[blocks[b] * self.split + sub, :, off])
        return torch.stack(rows)

    # ------------------------------------------------------------------ one request

    def run(self, req_id: str, tokens: list[int], salt=None) -> dict:
        """Prefill ``tokens`` in steps of at most ``budget`` tokens; return what happened."""
        request = SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), cache_salt=salt)
        ext, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert is_async is False
        blocks = [self.free.pop(0) for _ in range(-(-len(tokens) // self.block))]
        self.scheduler.update_state_after_alloc(request, FakeBlocks(blocks), ext)
        computed, first, steps, loaded_upto = ext, True, 0, ext
        while computed < len(tokens):
            n = min(self.budget, len(tokens) - computed)
            if first:
                out = SimpleNamespace(
                    scheduled_new_reqs=[SimpleNamespace(req_id=req_id, prompt_token_ids=list(tokens),
                                                        block_ids=(list(blocks),), num_computed_tokens=computed)],
                    scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                          num_computed_tokens=[]),
                    num_scheduled_tokens={req_id: n}, finished_req_ids=set())
            else:
                out = SimpleNamespace(
                    scheduled_new_reqs=[],
                    scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(),
                                                          new_block_ids=[None], num_computed_tokens=[computed]),
                    num_scheduled_tokens={req_id: n}, finished_req_ids=set())
            meta = self.scheduler.build_connector_meta(out)
            invalid = self._worker_step(meta, tokens, blocks, computed, computed + n)
            self.scheduler.update_connector_output(SimpleNamespace(invalid_block_ids=invalid))
            steps += 1
            first = False
            if invalid:   # vLLM's "recompute" policy: back to the first invalid block
                self.invalid_reported |= invalid
                idx = min(i for i, b in enumerate(blocks) if b in invalid)
                loaded_upto = min(loaded_upto, idx * self.block)
                computed = min(computed, idx * self.block)
                continue
            computed += n
        self.scheduler.request_finished(request, blocks)
        for w in self.workers:
            w.flush(10)
        return {"external": ext, "blocks": blocks, "steps": steps, "loaded": loaded_upto}

    def _worker_step(self, meta, tokens, blocks, start: int, end: int) -> set:
        """The model runner's calls for one step, every rank."""
        invalid: set = set()
        forward_context = SimpleNamespace(attn_metadata={})
        for rank, w in enumerate(self.workers):
            w.bind_connector_metadata(meta)
            w.start_load_kv(forward_context)
            for layer, name in enumerate(self.layers):
                w.wait_for_layer_load(name)                      # attention layer entry
                self._write(rank, name, layer, tokens, blocks, start, end)
                w.save_kv_layer(name, self.kv[rank][name], None)  # attention layer exit
            w.wait_for_save()
            assert w.get_finished(set()) == (None, None)
            invalid |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        self.computed_positions.extend(range(start, end))
        return invalid

    def close(self) -> None:
        for c in [self.scheduler, *self.workers]:
            c.shutdown()
