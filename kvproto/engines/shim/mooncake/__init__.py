"""kvproto's stand-in for the ``mooncake`` package: ``mooncake.store`` on kvproto.

Put the directory that holds this package (``kvproto/engines/shim``, printed by
``python -m kvproto.engines.shim``) first on ``PYTHONPATH`` and unchanged code
that does ``from mooncake.store import MooncakeDistributedStore,
ReplicateConfig`` runs on :mod:`kvproto.engines.mooncake`.

It never silently breaks a real Mooncake installed further along ``sys.path``:

* no real ``mooncake`` found: ``mooncake.store`` is kvproto's;
* a real one found, ``KVPROTO_MOONCAKE_SHIM`` unset: the shim steps aside. The
  real package is loaded in its place, so Mooncake keeps working exactly as
  installed, and a ``RuntimeWarning`` says that kvproto is *not* in use;
* a real one found, ``KVPROTO_MOONCAKE_SHIM=force``: ``mooncake.store`` is
  kvproto's, and the package path continues into the real package, so its
  other modules (``mooncake.engine``, ...) still import from it.

Any other value of ``KVPROTO_MOONCAKE_SHIM`` is refused with ``ImportError``.
"""

import importlib.machinery
import importlib.util
import os
import sys
import warnings

_SHIM_ROOT = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODE = os.environ.get("KVPROTO_MOONCAKE_SHIM", "")
if _MODE not in ("", "force"):
    raise ImportError(f"KVPROTO_MOONCAKE_SHIM={_MODE!r}: only 'force' (or unset) is understood")


def _real_spec():
    """The spec of a real ``mooncake`` package elsewhere on ``sys.path``, or None."""
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _SHIM_ROOT]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None or spec.origin in (None, "namespace"):
        return None
    return spec


_real = _real_spec()
if _real is not None and _MODE != "force":
    warnings.warn(
        f"kvproto's mooncake shim ({_SHIM_ROOT}) is on sys.path, but a real mooncake is installed "
        f"({os.path.dirname(_real.origin)}): using the real one. Set KVPROTO_MOONCAKE_SHIM=force "
        f"to run mooncake.store on kvproto anyway, or take the shim off PYTHONPATH.",
        RuntimeWarning, stacklevel=2)
    _module = importlib.util.module_from_spec(_real)
    sys.modules[__name__] = _module
    _real.loader.exec_module(_module)
else:
    if _real is not None:
        __path__.extend(_real.submodule_search_locations or [])  # noqa: F821
    #: what this package is: kvproto's stand-in, and the real package beside it if any
    KVPROTO_SHIM = True
    REAL_MOONCAKE = None if _real is None else os.path.dirname(_real.origin)
