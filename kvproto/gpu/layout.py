"""The layout of an engine's paged KV cache, as a small value.

A KV tensor is ``blocks x layers x 2 (K, V) x block tokens x KV heads x head
dim`` of bf16 or fp16, contiguous; one block is one contiguous run of
:attr:`KVLayout.block_bytes` bytes. :meth:`KVLayout.tag` is the stable text the
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

    def tag(self) -> str:
        """Stable text naming the layout (for keys)."""
        return (f"kvl{self.version}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
                f":{_DTYPES[self.dtype]}:B{self.block_size}:tp{self.tp_rank}/{self.tp_size}")

    def check(self, kv: Any) -> int:
        """The number of blocks of ``kv``, or ``InvalidArgument`` when ``kv`` is
        not a contiguous tensor of this layout."""
        shape = tuple(kv.shape)
        if len(shape) != 6 or shape[1:] != self.block_shape:
            raise errors.InvalidArgument(f"KV tensor shape {shape} is not (blocks, *{self.block_shape})")
        if kv.dtype != self.torch_dtype():
            raise errors.InvalidArgument(f"KV tensor dtype {kv.dtype} is not {self.dtype}")
        if not kv.is_contiguous():
            raise errors.InvalidArgument("KV tensor must be contiguous")
        return shape[0]
