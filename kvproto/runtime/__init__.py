"""The ZeroMQ runtime of the publish protocol (see each module's docstring).

``embedded``/``Client`` are the public entry points; ``run_master`` and
``run_storage`` serve one process each (``kvproto master`` / ``kvproto storage``).
Imports are lazy so ``import kvproto.runtime.units`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Client": "kvproto.runtime.client",
    "embedded": "kvproto.runtime.embedded",
    "EmbeddedCluster": "kvproto.runtime.embedded",
    "run_master": "kvproto.runtime.embedded",
    "run_storage": "kvproto.runtime.embedded",
    "MasterServer": "kvproto.runtime.master_server",
    "StorageServer": "kvproto.runtime.storage_server",
    "parse_size": "kvproto.runtime.units",
    "TransferEngine": "kvproto.runtime.transfers",
    "BufferPool": "kvproto.runtime.transfers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
