"""kvproto: model-checked protocols for a shared KV-cache store."""

# Runtime entry points, imported lazily so that ``import kvproto`` (and the
# state machines) never load ZeroMQ: ``kvproto.embedded(...)``, ``kvproto.Client``.
import importlib as _importlib

_LAZY = {
    "embedded": ("kvproto.runtime.embedded", "embedded"),
    "Client": ("kvproto.runtime.client", "Client"),
}
_SUBMODULES = ("errors", "runtime", "statemachines")


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(_importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
