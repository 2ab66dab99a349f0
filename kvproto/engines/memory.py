"""Caller memory for the engines' zero-copy calls: raw addresses as views, and
reads that land in them.

:func:`memory_at` is the one place an address becomes a ``memoryview``;
:func:`load_into` the one place a read lands in caller memory (today
:func:`read_many` and one copy per target; a same-host path that copies
straight from the storage segment replaces it here alone).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Union

from kvproto import errors
from kvproto.runtime.client import Client


def memory_at(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at address ``ptr`` (no copy).
    The caller keeps the memory alive while the view is used."""
    if type(ptr) is not int or type(size) is not int or ptr <= 0 or size <= 0:
        raise errors.InvalidArgument(f"bad buffer: address {ptr!r}, size {size!r}")
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def read_many(client: Client, keys: Sequence) -> list[Union[memoryview, errors.KvError]]:
    """Per key its bytes, or the error (``KeyNotFound`` for a miss): one
    ``get_many``, and key by key only when that fails for a reason other than
    a miss, to tell the keys apart."""
    try:
        values = client.get_many(list(keys))
    except errors.KvError:
        values = []
        for key in keys:
            try:
                values.append(client.get(key))
            except errors.KvError as err:
                values.append(err)
    return [errors.KeyNotFound(f"{k!r}") if v is None else v for k, v in zip(keys, values)]


def load_into(client: Client, keys: Sequence, targets: Sequence[Sequence[memoryview]]
              ) -> list[Union[int, errors.KvError]]:
    """Read each key into its target views, filled in order (a scatter): per
    key the bytes read, or the error (``KeyNotFound`` for a miss,
    ``InvalidArgument`` when the targets are smaller than the object, and then
    nothing is written)."""
    out: list[Union[int, errors.KvError]] = []
    for key, value, views in zip(keys, read_many(client, keys), targets):
        if isinstance(value, errors.KvError):
            out.append(value)
        elif value.nbytes > sum(v.nbytes for v in views):
            out.append(errors.InvalidArgument(
                f"{key!r}: {value.nbytes} bytes do not fit in {sum(v.nbytes for v in views)}"))
        else:
            at = 0
            for view in views:
                n = min(view.nbytes, value.nbytes - at)
                view[:n] = value[at:at + n]
                at += n
            out.append(value.nbytes)
    return out
