"""Snapshots of a server core's protocol state, to show a request changed nothing.

:func:`snapshot` turns an object into plain, comparable values: every field
it holds, recursively (dicts, lists, sets, ``__slots__`` and ``__dict__``
objects), with frozen values (attrs-frozen machine states, ``immutables.Map``,
tuples of them) kept as they are, since they cannot change in place, and a
fast core (:mod:`kvproto.cores`) taken as its ``reference()``, the equal frozen
value (its rows and columns are layout, not state). It sees every field the
core has, not a list someone has to keep up to date: a field added to a core
is covered the day it is added.

* :func:`master_snapshot`: a :class:`~kvproto.runtime.master.MasterCore` —
  the directory, the lease table, the client sessions (attempts and pins), the
  allocators' free extents, the registered segments, the failover phase, the
  commands and replies waiting for storage nodes, the id counters;
* :func:`storage_snapshot`: a :class:`~kvproto.runtime.storage.StorageCore` —
  the region table, the failover index and fence (its ``StorageNodeCore``),
  the direct writers' table, the transfer tables, the highest token seen, and
  the segment's bytes and generation words.

Left out, as observations rather than protocol state: ``counters`` (a refused
request is counted), the clock and the description of the last failover.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import attrs
import immutables

#: fields that are observations or machinery, not protocol state
OBSERVATIONS = frozenset({"counters", "clock", "last_failover", "observe"})


@attrs.frozen
class _Frozen:
    pass


def _frozen(value: Any) -> bool:
    """An immutable value: an ``immutables.Map``, a frozenset or an
    attrs-frozen instance (the machines' states are all of these)."""
    if isinstance(value, (immutables.Map, frozenset)):
        return True
    cls = type(value)
    return attrs.has(cls) and cls.__setattr__ is _Frozen.__setattr__


def snapshot(value: Any, exclude: frozenset = OBSERVATIONS, _seen: frozenset = frozenset()) -> Any:
    """A comparable copy of ``value``'s state (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if _frozen(value):
        return value
    if _core(value):
        return snapshot(value.reference(), exclude, _seen)
    if isinstance(value, (bytearray, memoryview)):
        return hashlib.blake2b(value, digest_size=16).digest()
    if callable(value) and not hasattr(value, "__dict__") and not hasattr(value, "__slots__"):
        return None
    if id(value) in _seen:
        return "<cycle>"
    seen = _seen | {id(value)}
    if isinstance(value, OrderedDict):
        return ("ordered", [(k, snapshot(v, exclude, seen)) for k, v in value.items()])
    if isinstance(value, dict):   # keys are hashable, hence compared as they are
        return {k: snapshot(v, exclude, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [snapshot(v, exclude, seen) for v in value])
    if isinstance(value, set):
        return ("set", frozenset(value))
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):       # numpy arrays
        return hashlib.blake2b(value.tobytes(), digest_size=16).digest()
    fields: dict[str, Any] = {}
    for name in _field_names(value):
        if name in exclude or name.startswith("__"):
            continue
        try:
            field = getattr(value, name)
        except AttributeError:
            continue
        if callable(field) and not hasattr(field, "__self__") and not _is_state(field):
            continue
        if hasattr(field, "__self__") and hasattr(field, "__func__"):   # bound methods
            continue
        fields[name] = snapshot(field, exclude, seen)
    return (type(value).__name__, fields)


def _core(value: Any) -> bool:
    """A fast core: mutable, compared through its frozen ``reference()``."""
    cls = type(value)
    return cls.__module__.startswith("kvproto.cores.") and callable(getattr(cls, "reference", None))


def _is_state(value: Any) -> bool:
    return isinstance(value, (dict, list, set, tuple)) or hasattr(value, "__dict__") or \
        hasattr(value, "__slots__")


def _field_names(value: Any) -> list[str]:
    names = list(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return names


def master_snapshot(core) -> Any:
    """The protocol state of a ``MasterCore``."""
    return snapshot(core)


def storage_snapshot(core) -> Any:
    """The protocol state of a ``StorageCore``, its segment's bytes included."""
    memory = core.memory
    name, fields = snapshot(core, OBSERVATIONS | {"memory"})
    fields["memory"] = (hashlib.blake2b(memory.data, digest_size=16).digest(),
                        hashlib.blake2b(memory.gens.tobytes(), digest_size=16).digest())
    return name, fields


def differences(before: Any, after: Any, path: str = "", limit: int = 5) -> list[str]:
    """Where two snapshots differ (the first ``limit`` paths)."""
    out: list[str] = []
    _diff(before, after, path or "state", out, limit)
    return out


def _diff(a: Any, b: Any, path: str, out: list, limit: int) -> None:
    if len(out) >= limit or a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                out.append(f"{path}[{k!r}] {'added' if k not in a else 'removed'}")
            else:
                _diff(a[k], b[k], f"{path}[{k!r}]", out, limit)
        return
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0]:
        _diff(a[1], b[1], f"{path}.{a[0]}" if isinstance(a[0], str) else path, out, limit)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, limit)
        return
    out.append(f"{path}: {str(a)[:120]} -> {str(b)[:120]}")
