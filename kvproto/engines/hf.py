"""A Hugging Face transformers model's prefix KV in kvproto.

:class:`PrefixCache` saves the KV of a prompt's prefix chunk by chunk from a
``DynamicCache`` and restores it into a fresh ``DynamicCache``, through
:class:`~kvproto.engines.chunks.ChunkStore` (checked objects, loads under the
Timeout protocol, the contiguous-reuse rule). The engine then runs only the
tokens after the restored prefix.

A chunk object holds, for the layers of its layer group, keys then values of
its tokens: ``[layers, 2, kv heads, tokens, head dim]`` in the model's dtype,
the layout ``DynamicCache`` keeps (batch 1). Its layout tag names model shape
and dtype, so a cache of another model or dtype is never read. Only full
chunks are stored, and never the prompt's last token: the engine always
computes at least one token, whose logits it needs.

Needs torch and transformers (the ``model`` extra); nothing here is imported
by the rest of kvproto.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import attrs

from kvproto.engines.chunks import ChunkStore, LoadResult, group_layers, tensor_copy
from kvproto.engines.prefix import Chunk, Namespace

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def model_shape(config) -> tuple[int, int, int]:
    """``(layers, kv heads, head dim)`` of a transformers model config."""
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers, heads, head_dim


def layout_tag(config, dtype) -> str:
    """The layout tag of this model's cache chunks (``hf1:L..:H..:D..:dtype:lhtd``)."""
    layers, heads, head_dim = model_shape(config)
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {name}")
    return f"hf1:L{layers}:H{heads}:D{head_dim}:{_DTYPES[name]}:l2htd"


@attrs.frozen
class Restored:
    """What :meth:`PrefixCache.restore` found: ``cache`` (a ``DynamicCache``
    holding the first ``tokens`` tokens, or ``None`` when nothing is reused),
    ``hit`` (chunks the lookup said were complete), ``result`` (the load)."""

    cache: Any
    tokens: int
    hit: int
    result: Optional[LoadResult]


class PrefixCache:
    """Save and restore a transformers model's prefix KV through kvproto.

    ``model`` and ``revision`` name the weights; with the layout tag, the
    tenant and the salt they make the namespace (:mod:`kvproto.engines.prefix`).
    """

    def __init__(self, client, model: str, config, dtype, *, revision: str = "",
                 chunk_size: int = 256, layer_groups: int = 1, tenant: str = "default",
                 salt: str = "", replicas: int = 1, timeout: float = 5.0, buffers: int = 8) -> None:
        self.config = config
        self.dtype = dtype
        self.layers, self.heads, self.head_dim = model_shape(config)
        self.chunk_size = chunk_size
        self.groups = group_layers(self.layers, layer_groups)
        self.namespace = Namespace(model, revision, layout_tag(config, dtype), tenant, salt,
                                   ranks=1, layer_groups=layer_groups)
        itemsize = _itemsize(dtype)
        self._token_bytes = 2 * self.heads * self.head_dim * itemsize   # per layer
        payload = max(len(g) for g in self.groups) * self._token_bytes * chunk_size
        self.store = ChunkStore(client, self.namespace, payload, replicas=replicas,
                                timeout=timeout, buffers=buffers)

    def chunks(self, tokens: Sequence[int]) -> list[Chunk]:
        """The full chunks of ``tokens`` that leave at least one token to compute."""
        return self.namespace.chunks(list(tokens)[:max(len(tokens) - 1, 0)], self.chunk_size,
                                     partial=False)

    # ------------------------------------------------------------------ packing

    def pack(self, chunks: Sequence[Chunk], cache) -> list:
        """The ``(chunk, rank, group, object)`` parts of ``chunks`` from ``cache``'s
        KV (one copy per layer into each object's payload)."""
        import torch
        parts = []
        for chunk in chunks:
            for g, layers in enumerate(self.groups):
                obj = self.store.new_object(len(layers) * self._token_bytes * chunk.tokens)
                dst = torch.from_numpy(obj.payload).view(self.dtype).view(
                    len(layers), 2, self.heads, chunk.tokens, self.head_dim)
                for j, layer in enumerate(layers):
                    dst[j, 0].copy_(cache.layers[layer].keys[0, :, chunk.start:chunk.end])
                    dst[j, 1].copy_(cache.layers[layer].values[0, :, chunk.start:chunk.end])
                parts.append((chunk, 0, g, obj))
        return parts

    def unpacker(self, chunks: Sequence[Chunk]):
        """``(sink, build)``: ``sink`` for :meth:`ChunkStore.load` keeps each
        verified object's KV; ``build(n)`` is a fresh ``DynamicCache`` of the
        first ``n`` chunks."""
        import torch
        from transformers import DynamicCache
        pieces: dict = {}

        def sink(i: int, g: int, payload: memoryview) -> None:
            t = tensor_copy(payload, self.dtype)
            pieces[i, g] = t.view(len(self.groups[g]), 2, self.heads, chunks[i].tokens,
                                  self.head_dim)

        def build(n: int):
            cache = DynamicCache(config=self.config)
            for g, layers in enumerate(self.groups):
                kv = torch.cat([pieces[i, g] for i in range(n)], dim=3)
                for j, layer in enumerate(layers):
                    cache.update(kv[j, 0].unsqueeze(0).contiguous(), kv[j, 1].unsqueeze(0).contiguous(),
                                 layer)
            return cache
        return sink, build

    # ------------------------------------------------------------------ save and restore

    def save(self, tokens: Sequence[int], cache, *, skip: int = 0) -> list:
        """Store the chunks of ``tokens`` whose KV ``cache`` holds (chunk ``skip``
        on); returns per object ``None`` or its error."""
        chunks = [c for c in self.chunks(tokens)[skip:] if c.end <= cache.get_seq_length()]
        return self.store.save(self.pack(chunks, cache))

    def restore(self, tokens: Sequence[int], *, lookup: bool = True) -> Restored:
        """A fresh ``DynamicCache`` holding the longest prefix of ``tokens`` that
        loaded and verified completely. ``lookup=False`` skips the
        ``exists_many`` (every chunk is tried)."""
        chunks = self.chunks(tokens)
        hit = self.store.lookup(chunks) if lookup else len(chunks)
        if not hit:
            return Restored(None, 0, 0, None)
        sink, build = self.unpacker(chunks)
        result = self.store.load(chunks[:hit], sink)
        if not result.usable:
            return Restored(None, 0, hit, result)
        return Restored(build(result.usable), result.tokens(chunks), hit, result)

    def close(self) -> None:
        self.store.close()


def _itemsize(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()
