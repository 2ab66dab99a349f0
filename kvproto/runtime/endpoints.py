"""The address forms kvproto accepts, checked before any socket is made.

Where a master is named (``Client(master)``, ``kvproto storage --master``):

* ``tcp://host:port`` — a master's ZeroMQ endpoint (``host`` a name, an IPv4
  address or a bracketed IPv6 address; ``port`` 1..65535);
* ``ipc://path`` — the same over a Unix socket;
* ``etcd://host:port[/prefix]`` or ``file:///dir`` — the coordinator the masters
  are elected through (the current master is looked up there, and again after
  a failover).

Where a server binds (``--listen``): ``tcp://host:port`` where ``port`` may be
``*`` (a free port), or ``ipc://path``.

A wrong form raises :class:`~kvproto.errors.InvalidArgument` naming the
accepted forms, instead of a bare ``zmq.error.ZMQError`` at the first call.
"""

from __future__ import annotations

import re

from kvproto.errors import InvalidArgument

#: the forms a master may be named in, for error messages
MASTER_FORMS = "tcp://host:port, ipc://path, etcd://host:port[/prefix] or file:///dir"
#: the forms a server may bind, for error messages
LISTEN_FORMS = "tcp://host:port (port * picks a free one) or ipc://path"

_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+|\*)"
_TCP = re.compile(rf"^tcp://{_HOST}:(\d{{1,5}}|\*)$")


def coordinator_url(address: str) -> bool:
    """Whether ``address`` names a coordinator rather than a master."""
    return address.startswith(("file://", "etcd://"))


def _tcp(address: str, *, bind: bool) -> bool:
    m = _TCP.match(address)
    if m is None:
        return False
    host, port = m.groups()
    if "*" in (host, port) and not bind:
        return False
    return port == "*" or 0 < int(port) < 65536


def _ipc(address: str) -> bool:
    return address.startswith("ipc://") and len(address) > len("ipc://") and not address[6:].isspace()


def check_master(address: object) -> str:
    """``address`` if it names a master or a coordinator in an accepted form,
    else :class:`~kvproto.errors.InvalidArgument`. A coordinator URL is parsed
    by :func:`kvproto.runtime.coordinator.connect` (which checks it the same way)."""
    if not isinstance(address, str):
        raise InvalidArgument(f"a master address must be a string, not {type(address).__name__}; "
                              f"use {MASTER_FORMS}")
    if coordinator_url(address) or _tcp(address, bind=False) or _ipc(address):
        return address
    hint = ""
    if re.match(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$", address) and "://" not in address:
        hint = f" (did you mean tcp://{address}?)"
    raise InvalidArgument(f"{address!r} is not a master address: use {MASTER_FORMS}{hint}")


def check_listen(address: object) -> str:
    """``address`` if a server can bind it (:data:`LISTEN_FORMS`), else
    :class:`~kvproto.errors.InvalidArgument`."""
    if isinstance(address, str) and (_tcp(address, bind=True) or _ipc(address)):
        return address
    raise InvalidArgument(f"{address!r} is not an address to listen on: use {LISTEN_FORMS}")
