"""Start one server of the fault matrix: ``python -m kvproto.checking.chaos.launch ROLE CONFIG_JSON``.

``master``: :func:`kvproto.runtime.embedded.run_master` with a coordinator.
``storage``: a :class:`~kvproto.runtime.storage_server.StorageServer` that follows the
coordinator; it prints its shared-memory names first, so the harness can
unlink them after a ``kill -9`` (a killed node cannot).

With ``"trace": FILE`` in the config, the server records its steps to FILE
(:mod:`kvproto.runtime.tracing`).

Both print ``kvproto ROLE listening on ENDPOINT`` once they serve and stop on
SIGTERM; the endpoint is the advertised one (the fault proxy's front end).
"""

from __future__ import annotations

import json
import logging
import signal
import sys


def master(config: dict) -> None:
    from kvproto.runtime.coordinator import connect
    from kvproto.runtime.embedded import run_master
    run_master(config["listen"], advertise=config["advertise"],
               coordinator=connect(config["coordinator"], ttl=config["ttl"]),
               writer_timeout=config["writer_timeout"], storage_timeout=config["storage_timeout"],
               fence_timeout=config["fence_timeout"], lease_ttl=config["lease_ttl"],
               log_level=config.get("log_level", "INFO"), trace=config.get("trace"))


def storage(config: dict) -> None:
    from kvproto.runtime.storage_server import StorageServer
    logging.basicConfig(level=config.get("log_level", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = StorageServer(config["coordinator"], config["size"], listen=config["listen"],
                           advertise=config["advertise"], page_size=config.get("page_size", 4096),
                           trace=config.get("trace"))
    print(f"kvproto storage shm {server.memory.name} {server.memory.gen_name}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    print(f"kvproto storage listening on {server.endpoint}", flush=True)
    server.serve_forever()


def main(argv: list[str]) -> int:
    role, config = argv[0], json.loads(argv[1])
    {"master": master, "storage": storage}[role](config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
