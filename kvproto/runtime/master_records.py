"""The records the master keeps: per storage node (:class:`SegmentInfo`), per
client (:class:`ClientSession`), per reply waiting for the nodes
(:class:`Parked`) and per command sent to a node (:class:`Command`). The
request handlers (:mod:`kvproto.runtime.master_requests`), the takeover
(:mod:`kvproto.runtime.master_takeover`) and the rest of
:class:`~kvproto.runtime.master.MasterCore` share them.
"""

from __future__ import annotations

from typing import Any, Optional

ReplyTo = Any  # opaque: the server's routing identity


class SegmentInfo:
    __slots__ = ("segment", "endpoint", "host", "shm", "gen_shm", "nonce", "page_size",
                 "capacity", "last_seen", "columns")

    def __init__(self, body: dict, now: float) -> None:
        self.segment = body["segment"]
        self.endpoint = body["endpoint"]
        self.host = body["host"]
        self.shm = body["shm"]
        self.gen_shm = body["gen_shm"]
        self.nonce = body["nonce"]
        self.page_size = body["page_size"]
        self.capacity = body["capacity"]
        self.last_seen = now
        #: the node takes ``assign`` and ``publish`` as columns
        self.columns = body.get("columns", False)

    def wire(self) -> list:
        return [self.endpoint, self.host, self.shm, self.gen_shm, self.nonce,
                self.page_size, self.capacity]


class ClientSession:
    """What one client has in flight: pending attempts and read pins."""

    __slots__ = ("last_seen", "tokens", "pins")

    def __init__(self, now: float) -> None:
        self.last_seen = now
        #: token -> [key, last refresh] of its PENDING attempts; each attempt
        #: lapses on its own (``writer_timeout`` after its last refresh)
        self.tokens: dict[int, list] = {}
        self.pins: dict[tuple[bytes, int], int] = {}   # (key, token) -> pins held

    def empty(self) -> bool:
        return not self.tokens and not self.pins


class Parked:
    """A reply waiting for storage nodes: a ``put_end`` for their ``publish``
    acks, a ``remove`` for their ``free`` acks (what it acknowledges must be
    recorded at the nodes first). A ``put_start`` does not wait for its
    ``assign`` acks: the assigns leave before the grant does, on the one
    connection to each node, and a node holds a write that arrives before its
    region's assign until the assign is applied (``StorageServer``)."""

    __slots__ = ("reply_to", "request_id", "items", "waiting", "op", "keys", "columns")

    #: the request -> the storage command whose acks its reply waits for
    WAITS_FOR = {"put_start": None, "put_end": "publish", "remove": "free"}

    def __init__(self, reply_to: ReplyTo, request_id: int, items: list, op: str = "put_start") -> None:
        self.reply_to = reply_to
        self.request_id = request_id
        self.items = items
        self.waiting: set[int] = set()
        self.op = op
        self.keys: Optional[list] = None   # put_end: the key of each item
        self.columns = False               # put_end: answer the refused items only


class Command:
    """A command sent to a storage node (``assign``, ``free``, ``publish``,
    ``fence``, ``purge``); ``id`` is its request id."""

    __slots__ = ("id", "segment", "op", "regions", "parked", "sent_at")

    def __init__(self, cmd_id: int, segment: str, op: str, regions: list,
                 parked: Optional[Parked], sent_at: float) -> None:
        self.id = cmd_id
        self.sent_at = sent_at
        self.segment = segment
        self.op = op
        self.regions = regions
        self.parked = parked
