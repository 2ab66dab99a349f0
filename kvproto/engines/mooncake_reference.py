"""The real Mooncake Store as a reference, where it is installed
(``pip install mooncake-transfer-engine-non-cuda``; it needs the system
libraries ``libibverbs1`` and ``libnuma1``): for differential tests and for
benchmarks against kvproto's Mooncake API in the same run.

:func:`real_store` imports Mooncake's own ``mooncake.store`` (never kvproto's
shim) or says why it cannot; :class:`ReferenceMaster` runs the package's
``mooncake_master`` binary with its built-in HTTP metadata server on free
loopback ports, and gives the ``setup`` arguments of a store that joins it.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import tempfile
import time
from typing import Any, Optional


def real_store() -> tuple[Optional[Any], str]:
    """``(module, "")`` for Mooncake's ``mooncake.store``, or ``(None, why not)``."""
    try:
        package = importlib.import_module("mooncake")
    except ImportError as exc:
        return None, f"mooncake is not installed ({exc})"
    if getattr(package, "KVPROTO_SHIM", False):
        return None, "mooncake is kvproto's shim, not the real package"
    try:
        return importlib.import_module("mooncake.store"), ""
    except ImportError as exc:     # e.g. libibverbs.so.1 missing
        return None, f"mooncake.store does not load: {exc}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ReferenceMaster:
    """``mooncake_master`` with its HTTP metadata server, on loopback; a context manager."""

    def __init__(self, lease_ttl_ms: int = 10_000, start_timeout: float = 30.0) -> None:
        module, why = real_store()
        if module is None:
            raise RuntimeError(why)
        binary = os.path.join(os.path.dirname(module.__file__), "mooncake_master")
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"no executable mooncake_master at {binary}")
        self.rpc_port, self.http_port, metrics = _free_port(), _free_port(), _free_port()
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", f"--metrics_port={metrics}",
             f"--default_kv_lease_ttl={lease_ttl_ms}"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while not (_listening(self.rpc_port) and _listening(self.http_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start: {self.log()[-2000:]}")
            time.sleep(0.1)

    def setup_config(self, segment_size: int, local_buffer_size: int = 64 << 20) -> dict:
        """The ``setup(config)`` dict of a store joining this master."""
        return {"local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
                "global_segment_size": str(segment_size), "local_buffer_size": str(local_buffer_size),
                "protocol": "tcp", "master_server_addr": f"127.0.0.1:{self.rpc_port}"}

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> "ReferenceMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
