"""The layout of an engine's paged KV cache, as a small value.

Two arrangements. Blocks first (the default): one KV tensor of ``blocks x
layers x 2 (K, V) x block tokens x KV heads x head dim`` of bf16 or fp16,
contiguous, one block one contiguous run of :attr:`KVLayout.block_bytes`
bytes. Layers first (``layers_major``, what vLLM and SGLang keep): one tensor
per layer of ``blocks x 2 x block tokens x KV heads x head dim``; the bytes of
a run of blocks as stored are then layer by layer. Either way an object holds
:attr:`KVLayout.block_bytes` per block. :meth:`KVLayout.tag` is the stable text the
connector puts into keys, so that state written under one layout (model,
tensor-parallel rank, format version) is never read under another: after an
upgrade the same prefix under a new layout is a different key, not old bytes
read the new way.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvproto import errors

_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def _positive(_inst, attr, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attr.name} must be a positive int, not {value!r}")


@attrs.frozen
class KVLayout:
    """How the bytes of one KV block are interpreted."""

    num_layers: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)   # per tensor-parallel rank
    head_dim: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="bfloat16")
    block_size: int = attrs.field(default=16, validator=_positive)   # tokens per block
    tp_rank: int = 0
    tp_size: int = attrs.field(default=1, validator=_positive)
    version: int = attrs.field(default=1, validator=_positive)
    layers_major: bool = False

    @dtype.validator
    def _dtype(self, _attr, value) -> None:
        if value not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {value!r}")

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in 0..{self.tp_size - 1}")

    @property
    def block_shape(self) -> tuple:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def tensor_shape(self, num_blocks: int) -> tuple:
        return (num_blocks, *self.block_shape)

    @property
    def layer_block_shape(self) -> tuple:
        """One block of one layer (a layers-first tensor is ``(blocks, *this)``)."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return 2

    @property
    def block_bytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def tag(self, rank: bool = True) -> str:
        """Stable text naming the layout (for keys): layout version, layers, KV
        heads, head dim, dtype, block size, and tensor-parallel rank/size.

        ``rank=False`` names what every rank of one tensor-parallel group shares
        (``tp*/size``): a namespace holds that, and each object key of a chunk
        adds its own rank (:mod:`kvproto.engines.prefix`)."""
        tp = f"{self.tp_rank}/{self.tp_size}" if rank else f"*/{self.tp_size}"
        return (f"kvl{self.version}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
                f":{_DTYPES[self.dtype]}:B{self.block_size}:tp{tp}"
                + (":lm" if self.layers_major else ""))

    def check(self, kv: Any) -> int:
        """The number of blocks of ``kv`` (a tensor; for a layers-first layout,
        a sequence of one tensor per layer), or ``InvalidArgument`` when it is
        not of this layout."""
        if self.layers_major:
            return self._check_layers(kv)
        if isinstance(kv, (list, tuple)):
            raise errors.InvalidArgument("one tensor per layer needs a layers_major layout")
        shape = tuple(kv.shape)
        if len(shape) != 6 or shape[1:] != self.block_shape:
            raise errors.InvalidArgument(f"KV tensor shape {shape} is not (blocks, *{self.block_shape})")
        if kv.dtype != self.torch_dtype():
            raise errors.InvalidArgument(f"KV tensor dtype {kv.dtype} is not {self.dtype}")
        if not kv.is_contiguous():
            raise errors.InvalidArgument("KV tensor must be contiguous")
        return shape[0]

    def _check_layers(self, layers: Any) -> int:
        if not isinstance(layers, (list, tuple)) or len(layers) != self.num_layers:
            raise errors.InvalidArgument(f"a layers_major layout takes {self.num_layers} layer tensors")
        n = layers[0].shape[0]
        for t in layers:
            if tuple(t.shape) != (n, *self.layer_block_shape):
                raise errors.InvalidArgument(
                    f"layer tensor shape {tuple(t.shape)} is not (blocks, *{self.layer_block_shape})")
            if t.dtype != self.torch_dtype() or not t.is_contiguous() or t.device != layers[0].device:
                raise errors.InvalidArgument(f"layer tensors must be contiguous {self.dtype} on one device")
        return n
