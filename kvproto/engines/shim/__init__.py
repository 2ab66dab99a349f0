"""The ``PYTHONPATH`` shim: this directory holds a ``mooncake`` package whose
``mooncake.store`` is :mod:`kvproto.engines.mooncake`. :data:`PATH` is the
directory to put on ``PYTHONPATH`` (``python -m kvproto.engines.shim`` prints it)."""

import os

PATH = os.path.dirname(os.path.abspath(__file__))
