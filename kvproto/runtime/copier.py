"""A storage node's repair copier (``spec/Publish.tla`` ``CopyReplica``).

The master starts a repair by assigning a region of this node's segment to
the object's token (``RepairStart``'s ``AssignRegion``) and then sending a
``repair`` command naming a live source replica. The node checks that the
region is assigned to that token and unwritten, answers the command at once,
and pulls the object from the source node with a plain network ``read`` —
the read path a client uses, under the object's token and the master's term,
so the source hands out only a complete, published replica's bytes. At a store
with tenants the read carries no tenant credential but the read ticket the
master sent with the command, issued to ``REPAIR_READER`` for the source
replica's location and token and expiring with the repair's timeout; the
source checks it as it checks any read ticket (``NodeAdmits``). When the
bytes arrive they are checked against the object's checksum (when it has one)
and written into the region by ``WriteReplica`` (the node's own token check),
and the node reports ``repair_done`` with the repair's id; the master lists
the replica only on that report (``ListReplica``), and refuses a report of a
repair no longer in flight. A copy that fails (the source refuses or stays
silent for :attr:`Copier.timeout`, the bytes do not match, the region was
freed meanwhile) is reported with its error, and the master cancels the
repair (``RepairCancel``).

:class:`Copier` owns the DEALER sockets to the source nodes (one per source
endpoint) and never blocks: the node's loop polls them with its ROUTER and
collects the answers with :meth:`Copier.answered`.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import attrs
import zmq

from kvproto import errors
from kvproto.runtime import wire


@attrs.frozen
class Copy:
    """One repair copy: the destination region and the source replica."""

    repair: int
    key: bytes
    token: int
    offset: int
    length: int
    source: str           # the source node's endpoint
    source_segment: str
    source_offset: int
    checksum: int = 0     # the object's checksum (0: none to check)
    #: the source read's ticket (a store with tenants): issued by the master to
    #: ``REPAIR_READER`` for the source replica's location and token
    ticket: Optional[list] = None


class Copier:
    """Pulls repair copies from their source nodes without blocking."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, timeout: float = 10.0) -> None:
        self.ctx, self.poller, self.timeout = ctx, poller, float(timeout)
        self._socks: dict[str, zmq.Socket] = {}
        self._pending: dict[int, tuple[Copy, float]] = {}   # request id -> (copy, deadline)
        self._rid = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pending)

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self._socks[endpoint] = sock
        return sock

    def start(self, copy: Copy, term: int) -> None:
        """Send the source the read of ``copy``'s replica, stamped with ``term``."""
        rid = next(self._rid)
        body = {"segment": copy.source_segment, "offset": copy.source_offset,
                "token": copy.token, "term": term, "length": copy.length}
        if copy.ticket is not None:
            body["ticket"] = copy.ticket
        try:
            self._socket(copy.source).send(wire.encode_request("read", rid, body), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass   # answered by the timeout
        self._pending[rid] = (copy, time.monotonic() + self.timeout)

    def answered(self) -> list[tuple[Copy, Optional[memoryview], Optional[errors.KvError]]]:
        """``(copy, bytes, None)`` for each copy whose source answered with its
        bytes, ``(copy, None, error)`` for each refused or timed out."""
        out: list = []
        for sock in self._socks.values():
            for frames in wire.waiting(sock, 64):
                try:
                    reply = wire.decode_reply(frames)
                except errors.KvError:
                    continue
                pending = self._pending.pop(reply.request_id, None)
                if pending is None:
                    continue   # timed out already
                copy = pending[0]
                if reply.status:
                    out.append((copy, None, reply.error()))
                elif len(reply.payloads) != 1 or len(reply.payloads[0]) != copy.length:
                    out.append((copy, None, errors.MalformedFrame("the source sent no object")))
                else:
                    out.append((copy, memoryview(reply.payloads[0]), None))
        now = time.monotonic()
        for rid, (copy, deadline) in list(self._pending.items()):
            if now > deadline:
                del self._pending[rid]
                out.append((copy, None, errors.RequestTimeout(
                    f"source {copy.source_segment} silent for {self.timeout:.1f}s")))
        return out

    def close(self) -> None:
        for sock in self._socks.values():
            self.poller.unregister(sock)
            sock.close(linger=0)
        self._socks.clear()
        self._pending.clear()
