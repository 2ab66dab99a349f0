"""Helpers for the engine tests."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys

from kvproto.engines.shim import PATH as SHIM_PATH


@contextlib.contextmanager
def fresh_import(paths, monkeypatch, mode=None, hide_real=False):
    """Import ``mooncake`` anew with ``paths`` first on sys.path; restore after."""
    def ours(name):
        return name == "mooncake" or name.startswith("mooncake.")
    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    old_path = list(sys.path)
    sys.path[:0] = paths
    if mode is None:
        monkeypatch.delenv("KVPROTO_MOONCAKE_SHIM", raising=False)
    else:
        monkeypatch.setenv("KVPROTO_MOONCAKE_SHIM", mode)
    if hide_real:   # as on a machine without Mooncake: nothing but the shim has it
        find = importlib.machinery.PathFinder.find_spec

        def find_spec(name, path=None, target=None):
            if name == "mooncake" and path is not None and SHIM_PATH not in path:
                return None
            return find(name, path, target)
        monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", find_spec)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path[:] = old_path
        monkeypatch.undo()
