"""The wire format of the kvproto runtime, and its one validation path.

Every message is a multipart ZeroMQ message::

    request: [header, payload...]   header = msgpack [PROTOCOL_VERSION, op: str, request_id: int, body: map]
    reply:   [header, payload...]   header = msgpack [PROTOCOL_VERSION, status: int, request_id: int, body: map]

``status`` is 0 for success, otherwise an error code of :mod:`kvproto.errors`
and ``body`` is ``{"message": str}``. Payload frames carry object bytes and are
never packed into msgpack (so they can be sent and received without a copy).
Batch operations answer one *item* per key in ``body["items"]``: ``[0, value]``
for success, ``[code, message]`` for a per-key error (a ``read_begin`` asked
with ``columns`` answers one list per field instead: :data:`READ_COLUMNS`; an
``exists`` asked with ``found``, one byte per key: :func:`found_of`; a
``put_start`` asked with ``columns``, one list per field: :data:`PUT_COLUMNS`; a
``put_end`` asked with ``columns``, its refused keys only: :func:`put_end_refused`). A
master sends ``assign`` and ``publish`` to a node that registered with
``columns`` as one list per field (``columns``,
:func:`~kvproto.runtime.schema.columns_of`) instead
of a row per region (``regions``); a node takes either, exactly one, and
answers one asked with ``tally`` ``{"accepted": n}`` when it accepts all n. A
request id names one request on its connection (a sender numbers every
request afresh, a retry included; 0 asks for no reply): the master serves an
id once, and answers a copy :class:`~kvproto.errors.DuplicateRequest`.

:func:`decode_request` is the only way a server turns frames into a request. It
checks, in this order, and raises the typed error of the first failure:

1. sizes: header frame ``> max_header_bytes`` or total payload
   ``> max_payload_bytes`` -> :class:`~kvproto.errors.FrameTooLarge`
   (checked before anything is decoded);
2. the header decodes as msgpack and is a 4-element array
   -> :class:`~kvproto.errors.MalformedFrame`;
3. version -> :class:`~kvproto.errors.UnsupportedVersion`;
4. op is a known string for *this server* -> :class:`~kvproto.errors.UnknownMessage`;
5. request id and body types, every required field present with the right
   type (and exactly one of an op's ``one_of`` fields), the number of payload
   frames -> :class:`~kvproto.errors.MalformedFrame`;
6. field values in range (non-negative ints, non-empty keys, batch sizes)
   -> :class:`~kvproto.errors.InvalidArgument`.

The raised error carries ``request_id`` (the request's id when it could be read,
else 0) so the server can still address its error reply. Unknown extra body
fields are ignored (forward compatibility). The per-op schemas live in
:data:`MASTER_OPS` and :data:`STORAGE_OPS`; each server passes its table.
"""

from __future__ import annotations

from array import array
from typing import Any, Mapping, Optional, Sequence

import msgpack
import zmq

from kvproto import errors
from kvproto.runtime.schema import (
    MAX_BATCH, MAX_KEY_BYTES, MAX_NAME, MAX_REPLICAS, UINT63, UINT64, OpSchema, binary, boolean,
    columns_of, list_of, text, tuple_of, uint,
)

#: 2: a fence reply's index travels as columns (``IndexColumns``), ``put_end``
#: and ``publish`` items may carry a checksum. 3: ``read_begin`` and ``renew``
#: items carry read tickets, ``read`` and ``load`` take one (a node with
#: tenants refuses a read without), and the ``ns_*`` ops. Mixed versions refuse
#: each other with ``UnsupportedVersion`` instead of misreading a frame.
PROTOCOL_VERSION = 3

#: default limits (servers may configure their own)
MASTER_MAX_HEADER = 16 << 20
STORAGE_MAX_HEADER = 1 << 20  # > MasterCore.COMMAND_MAX_BYTES + slack
REPLY_MAX_HEADER = 64 << 20


KEY = binary()
TOKEN = uint(UINT63, 1)
#: an object's checksum (``kvproto.runtime.datapath.checksum``): 64 bits, 0 = none
CHECKSUM = uint(UINT64)
KEYS = list_of(KEY, min_items=1)
CLIENT = text(128, 1)
SEGMENT = text(256, 1)

#: a tenant's credential (its secret token, ``kvproto.ops.tenants``): optional
#: on every op; a master or storage node started with a tenants file refuses a
#: request without a valid one (``Unauthorized``)
CRED = binary(1024, 1)
#: the namespace a key-bearing master op names (default ``default``;
#: ``owner/name`` for another tenant's)
NAMESPACE = text(129, 1)

MASTER_OPS: dict[str, OpSchema] = {
    # storage node -> master
    # ``held``: allocations the segment still holds (0: it is empty);
    # ``columns: true``: the node takes ``assign`` and ``publish`` as columns
    "register": OpSchema({
        "segment": SEGMENT, "capacity": uint(min_value=1), "endpoint": text(MAX_NAME, 1),
        "host": text(), "shm": text(), "gen_shm": text(), "nonce": uint(),
        "page_size": uint(1 << 30, 1),
    }, optional={"held": uint(), "columns": boolean()}),
    "storage_heartbeat": OpSchema({"segment": SEGMENT}),
    # regions that drained for their direct writer (spec/DirectWrite.tla Drain): free now
    "storage_drained": OpSchema({"segment": SEGMENT, "offsets": list_of(uint(), min_items=1)}),
    # a repair's copier is done (spec/Publish.tla ListReplica): ``error``
    # ([code, message]) when its copy failed, so the master cancels it
    "repair_done": OpSchema({"segment": SEGMENT, "key": KEY, "repair": TOKEN},
                            optional={"error": tuple_of(uint(), text(4096))}),
    "deregister": OpSchema({"segment": SEGMENT}),
    # writer / reader -> master
    # ``writer``/``host``: the client may write replicas on its own host itself
    # (its writer lock's name and its host id; spec/DirectWrite.tla)
    # ``columns: true`` asks for the grants as columns (:data:`PUT_COLUMNS`)
    "put_start": OpSchema({
        "client": CLIENT, "replicas": uint(MAX_REPLICAS, 1),
        "items": list_of(tuple_of(KEY, uint(min_value=1)), min_items=1),
    }, optional={"writer": text(64, 1), "host": text(MAX_NAME, 1), "columns": boolean()}),
    # [key, token, checksum]: the checksum of the bytes written (optional; 0 = none);
    # ``columns: true`` asks for the refused keys only (:func:`put_end_refused`)
    "put_end": OpSchema({"client": CLIENT, "items": list_of(
        tuple_of(KEY, TOKEN, optional=(CHECKSUM,)), min_items=1)}, optional={"columns": boolean()}),
    "put_revoke": OpSchema({"client": CLIENT, "items": list_of(tuple_of(KEY, TOKEN), min_items=1)}),
    # revoke this client's own pending attempts on ``keys``, whose tokens it never received
    "put_abandon": OpSchema({"client": CLIENT, "keys": KEYS}),
    # ``lease: true`` asks for a read lease per key (lease id + TTL) instead of a pin
    # ``release``: leases this client is done with, ended before the lookup
    # ``columns: true`` asks for the grants as columns (:data:`READ_COLUMNS`)
    "read_begin": OpSchema({"client": CLIENT, "keys": KEYS},
                           optional={"lease": boolean(), "release": list_of(uint(UINT63, 1)),
                                     "columns": boolean()}),
    "renew": OpSchema({"client": CLIENT, "leases": list_of(uint(UINT63, 1), min_items=1)}),
    "release": OpSchema({"client": CLIENT, "leases": list_of(uint(UINT63, 1), min_items=1)}),
    "read_end": OpSchema({"client": CLIENT, "items": list_of(tuple_of(KEY, TOKEN), min_items=1)}),
    # ``found: true`` asks for the answer as one byte per key (:func:`found_of`)
    "exists": OpSchema({"keys": KEYS}, optional={"found": boolean()}),
    # published keys in key order, after ``after``, starting with ``prefix``, at most ``limit``
    "list": OpSchema({"limit": uint(MAX_BATCH, 1)},
                     optional={"prefix": binary(MAX_KEY_BYTES, 0), "after": binary(MAX_KEY_BYTES, 0)}),
    "remove": OpSchema({"keys": KEYS}, optional={"force": boolean()}),
    # ``tokens``: the client's put attempts still being written (each one's deadline restarts)
    "heartbeat": OpSchema({"client": CLIENT}, optional={"tokens": list_of(TOKEN)}),
    "stats": OpSchema({}),
    # the owner of namespace ``ns`` lets tenant ``grantee`` read it, or stops
    # letting it (spec/Tenancy.tla GrantRead, RevokeRead); needs a tenants file
    "grant": OpSchema({"ns": NAMESPACE, "grantee": text(64, 1)}),
    "revoke": OpSchema({"ns": NAMESPACE, "grantee": text(64, 1)}),
    # the upgrade lifecycle of the owner's namespaces (spec/Tenancy.tla Create,
    # PreWarm, Switch, RouteBack, Drop); ``ns_list``: the tenant's namespaces
    # and their phases; all need a tenants file
    "ns_create": OpSchema({"ns": NAMESPACE, "previous": NAMESPACE}),
    "ns_prewarm": OpSchema({"ns": NAMESPACE}),
    "ns_switch": OpSchema({"ns": NAMESPACE}),
    "ns_route_back": OpSchema({"ns": NAMESPACE}),
    "ns_drop": OpSchema({"ns": NAMESPACE}),
    "ns_list": OpSchema({}),
}

#: the master ops that only a master with tenants serves
TENANT_OPS = frozenset({"grant", "revoke", "ns_create", "ns_prewarm", "ns_switch",
                        "ns_route_back", "ns_drop", "ns_list"})

#: the master ops that name keys: they take ``ns``
KEYED_OPS = frozenset({"put_start", "put_end", "put_revoke", "put_abandon", "read_begin",
                       "read_end", "exists", "list", "remove"})

#: a tracked transfer (``spec/Timeout.tla``): who issued it and its generation
#: (transfer id), unique per ``owner``
OWNER = text(256, 1)
XFER = uint(UINT63, 1)

#: a master's term (``spec/Failover.tla``): every control command and every data
#: request is stamped with one; a storage node refuses one below the highest it has seen
TERM = uint()
#: a read ticket: [expires (ms of the wall clock), HMAC-SHA256]
TICKET = tuple_of(uint(), binary(32, 32))

STORAGE_OPS: dict[str, OpSchema] = {
    # master -> storage node (control), each stamped with the master's term
    # ``direct``: [offset, writer] of the regions whose writer writes them itself
    # ``regions``: [offset, length, key, token] each; or ``columns`` (to a node
    # that registered with ``columns``): [offsets, lengths, keys, tokens,
    # writers], a writer "" where the region is not a direct writer's.
    # ``tally: true`` (an ``assign`` or ``publish``) asks for ``{"accepted":
    # n}`` instead of ``results`` when every one of its n regions is accepted
    "assign": OpSchema({"segment": SEGMENT, "term": TERM}, optional={
        "regions": list_of(tuple_of(uint(), uint(min_value=1), KEY, TOKEN), min_items=1),
        "columns": columns_of(uint(), uint(min_value=1), KEY, TOKEN, text(64)),
        "direct": list_of(tuple_of(uint(), text(64, 1))), "tally": boolean()},
        one_of=("regions", "columns")),
    "free": OpSchema({"segment": SEGMENT, "term": TERM,
                      "regions": list_of(tuple_of(uint(), TOKEN, uint()), min_items=1)}),
    # mark written regions published (after the master's PutEnd or
    # ListReplica): [offset, key, token, checksum, requested, by] (the checksum,
    # the requested replica count and the publishing term optional; 0 = none;
    # ``by``: a repaired replica's, the object's publishing term, spec
    # Failover RepairedEntry); or ``columns``: the six as columns, 0 where none
    "publish": OpSchema({"segment": SEGMENT, "term": TERM}, optional={
        "regions": list_of(tuple_of(uint(), KEY, TOKEN, optional=(CHECKSUM, uint(0xFFFF), TERM)),
                           min_items=1),
        "columns": columns_of(uint(), KEY, TOKEN, CHECKSUM, uint(0xFFFF), TERM),
        "tally": boolean()}, one_of=("regions", "columns")),
    # failover: learn a new master's term and answer the node's index (Fence);
    # drop unpublished allocations of terms below ``below`` (Recover's purge)
    # copy an object into a region assigned for its repair (spec/Publish.tla
    # CopyReplica): [offset, key, token, length, repair, source endpoint,
    # source segment, source offset, checksum, ticket]; the node answers at once and
    # reports the copy with ``repair_done``. ``ticket`` (a store with tenants):
    # the source read's ticket, issued to the repair reader
    "repair": OpSchema({"segment": SEGMENT, "term": TERM, "regions": list_of(
        tuple_of(uint(), KEY, TOKEN, uint(min_value=1), TOKEN, text(MAX_NAME, 1), SEGMENT,
                 uint(), CHECKSUM, optional=(TICKET,)), min_items=1)}),
    "fence": OpSchema({"segment": SEGMENT, "term": TERM}),
    "purge": OpSchema({"segment": SEGMENT, "term": TERM, "below": TERM}),
    # client -> storage node (data), stamped with the term of the master that
    # granted the region or handed out the descriptor. A write naming ``owner``
    # and ``xfer`` is a tracked transfer that a ``cancel`` can stop (both or neither).
    "write": OpSchema({"segment": SEGMENT, "offset": uint(), "token": TOKEN, "term": TERM},
                      payloads=1, optional={"owner": OWNER, "xfer": XFER}),
    # several writes to this node in one message, one payload frame each, in
    # region order: [offset, token, xfer] (each a tracked transfer of ``owner``)
    "writes": OpSchema({"segment": SEGMENT, "term": TERM, "owner": OWNER,
                        "regions": list_of(tuple_of(uint(), TOKEN, XFER), min_items=1)},
                       payloads=-1),
    # ``ticket``: the read ticket of the master's read_begin for this replica
    # ([expires ms, HMAC]; kvproto.ops.tenants.Tickets), which a node with
    # tenants requires of ``read`` and ``load``
    "read": OpSchema({"segment": SEGMENT, "offset": uint(), "token": TOKEN, "term": TERM,
                      "length": uint(min_value=1)}, optional={"ticket": TICKET}),
    # a tracked read into the client's destination ``buffer``: answered with the
    # bytes and ``{"xfer": gen, "buffer": buffer}`` (the completion), or not at
    # all once cancelled
    "load": OpSchema({"segment": SEGMENT, "offset": uint(), "token": TOKEN, "term": TERM,
                      "length": uint(min_value=1), "owner": OWNER, "xfer": XFER,
                      "buffer": text(256, 1)}, optional={"ticket": TICKET}),
    # stop transfer ``xfer`` of ``owner`` if it still runs, then acknowledge
    # (``{"xfer": gen, "acked": true}``)
    "cancel": OpSchema({"owner": OWNER, "xfer": XFER}),
    "stats": OpSchema({}),
}

for _op, _schema in MASTER_OPS.items():
    _schema.optional["cred"] = CRED
    if _op in KEYED_OPS:
        _schema.optional["ns"] = NAMESPACE
for _schema in STORAGE_OPS.values():
    _schema.optional["cred"] = CRED
del _op, _schema

#: test-only fault injection, accepted only by a storage node built with ``debug=True``
DEBUG_OPS: dict[str, OpSchema] = {
    "debug": OpSchema({}, optional={
        "delay_ms": uint(60_000), "reply_delay_ms": uint(60_000), "read_delay_ms": uint(60_000),
        "drop": uint(1 << 20),
        "duplicate": uint(1 << 20), "duplicate_delay_ms": uint(60_000),
        "cred": CRED}),       # a node with tenants authenticates it too
}


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------

def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_request(op: str, request_id: int, body: Mapping[str, Any]) -> bytes:
    return pack([PROTOCOL_VERSION, op, request_id, body])


def encode_reply(request_id: int, status: int = 0, body: Optional[Mapping[str, Any]] = None) -> bytes:
    return pack([PROTOCOL_VERSION, status, request_id, {} if body is None else body])


def encode_error(request_id: int, err: errors.KvError) -> bytes:
    code, message = err.to_wire()
    return encode_reply(request_id, code, {"message": message})


def ok_item(value: Any = None) -> list:
    return [0, value]


def error_item(err: errors.KvError) -> list:
    return list(err.to_wire())


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------

class Request:
    """A validated request. ``payloads`` are zero-copy memoryviews of the frames."""

    __slots__ = ("op", "request_id", "body", "payloads")

    def __init__(self, op: str, request_id: int, body: dict, payloads: list) -> None:
        self.op = op
        self.request_id = request_id
        self.body = body
        self.payloads = payloads

    def __repr__(self) -> str:
        return f"Request({self.op!r}, {self.request_id}, {self.body!r}, {len(self.payloads)} payload(s))"


class Reply:
    """A structurally valid reply (``status`` 0 = ok)."""

    __slots__ = ("status", "request_id", "body", "payloads")

    def __init__(self, status: int, request_id: int, body: dict, payloads: list) -> None:
        self.status = status
        self.request_id = request_id
        self.body = body
        self.payloads = payloads

    def error(self) -> errors.KvError:
        message = self.body.get("message", "")
        return errors.from_wire(self.status, message if isinstance(message, str) else "")

    def raise_for_status(self) -> "Reply":
        if self.status:
            raise self.error()
        return self


def _view(frame: Any) -> memoryview:
    """A zero-copy byte view of a frame (bytes, memoryview or zmq.Frame)."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    mv = buf if buf is not None else memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _fail(err: errors.KvError, request_id: int = 0) -> errors.KvError:
    err.request_id = request_id  # type: ignore[attr-defined]
    return err


def _unpack_header(view: memoryview) -> Any:
    try:
        # max_*_len default to len(view): nothing larger than the frame is allocated
        return msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # truncated, extra data, bad utf-8, depth, ...
        raise _fail(errors.MalformedFrame(f"header is not msgpack: {exc.__class__.__name__}")) from None


def decode_request(frames: Sequence[Any], max_header_bytes: int, max_payload_bytes: int,
                   ops: Mapping[str, OpSchema] = MASTER_OPS) -> Request:
    """Validate ``frames`` (header first, routing identity already removed).

    Returns a :class:`Request` or raises a typed :class:`~kvproto.errors.KvError`
    with attribute ``request_id`` (see the module docstring for the order of
    checks). Never raises anything else.
    """
    if not frames:
        raise _fail(errors.MalformedFrame("empty message"))
    header = _view(frames[0])
    if len(header) > max_header_bytes:
        raise _fail(errors.FrameTooLarge(f"header of {len(header)} bytes > {max_header_bytes}"))
    payloads = [_view(f) for f in frames[1:]]
    total = sum(len(p) for p in payloads)
    if total > max_payload_bytes:
        raise _fail(errors.FrameTooLarge(f"payload of {total} bytes > {max_payload_bytes}"))
    obj = _unpack_header(header)
    if type(obj) is not list or len(obj) != 4:
        raise _fail(errors.MalformedFrame("header must be [version, op, request_id, body]"))
    version, op, request_id, body = obj
    rid = request_id if type(request_id) is int and 0 <= request_id <= UINT64 else 0
    if type(version) is not int:
        raise _fail(errors.MalformedFrame("version must be an int"), rid)
    if version != PROTOCOL_VERSION:
        raise _fail(errors.UnsupportedVersion(
            f"version {version} (this server speaks {PROTOCOL_VERSION})"), rid)
    if type(op) is not str:
        raise _fail(errors.MalformedFrame("op must be a string"), rid)
    schema = ops.get(op)
    if schema is None:
        raise _fail(errors.UnknownMessage(f"unknown op {op[:64]!r}"), rid)
    if type(request_id) is not int or not 0 <= request_id <= UINT64:
        raise _fail(errors.MalformedFrame("request_id must be a uint64"))
    if type(body) is not dict:
        raise _fail(errors.MalformedFrame("body must be a map"), rid)
    if schema.payloads >= 0 and len(payloads) != schema.payloads:
        raise _fail(errors.MalformedFrame(
            f"{op} takes {schema.payloads} payload frame(s), got {len(payloads)}"), rid)
    checked = {}
    try:
        for name, check in schema.fields.items():
            if name not in body:
                raise errors.MalformedFrame(f"{op}: missing field {name!r}")
            value = body[name]
            if check.ok(value):
                checked[name] = value if check.norm is None else check.norm(value)
            else:
                checked[name] = check(value, f"{op}.{name}")
        for name, check in schema.optional.items():
            if name in body:
                value = body[name]
                if check.ok(value):
                    checked[name] = value if check.norm is None else check.norm(value)
                else:
                    checked[name] = check(value, f"{op}.{name}")
    except errors.KvError as err:
        raise _fail(err, rid) from None
    if schema.one_of and sum(name in checked for name in schema.one_of) != 1:
        raise _fail(errors.MalformedFrame(f"{op} takes exactly one of {', '.join(schema.one_of)}"), rid)
    if schema.payloads < 0 and len(payloads) != len(checked["regions"]):
        raise _fail(errors.MalformedFrame(
            f"{op} names {len(checked['regions'])} region(s) but carries {len(payloads)} "
            "payload frame(s)"), rid)
    return Request(op, request_id, checked, payloads)


def decode_reply(frames: Sequence[Any], max_header_bytes: int = REPLY_MAX_HEADER) -> Reply:
    """Validate a reply's structure; raises :class:`~kvproto.errors.MalformedFrame`."""
    if not frames:
        raise errors.MalformedFrame("empty reply")
    header = _view(frames[0])
    if len(header) > max_header_bytes:
        raise errors.FrameTooLarge(f"reply header of {len(header)} bytes")
    obj = _unpack_header(header)
    if type(obj) is not list or len(obj) != 4:
        raise errors.MalformedFrame("reply header must be [version, status, request_id, body]")
    version, status, request_id, body = obj
    if version != PROTOCOL_VERSION:
        raise errors.UnsupportedVersion(f"reply version {version!r}")
    if type(status) is not int or type(request_id) is not int or type(body) is not dict:
        raise errors.MalformedFrame("bad reply header types")
    return Reply(status, request_id, body, [_view(f) for f in frames[1:]])


def item_result(item: Any) -> tuple[Optional[errors.KvError], Any]:
    """Split one batch item into ``(error, value)``."""
    if type(item) is not list or len(item) != 2 or type(item[0]) is not int:
        return errors.MalformedFrame("bad batch item"), None
    code, value = item
    if code:
        return errors.from_wire(code, value if isinstance(value, str) else ""), None
    return None, value


def items_of(reply: Reply, expected: int) -> list:
    items = reply.body.get("items")
    if type(items) is not list or len(items) != expected:
        raise errors.MalformedFrame(f"reply has {len(items) if isinstance(items, list) else 'no'} "
                                    f"items, expected {expected}")
    return items


def found_of(reply: Reply, expected: int) -> list[bool]:
    """The answer of an ``exists`` asked with ``found`` for ``expected`` keys:
    ``body["found"]``, one byte per key in the request's order, 1 where the key
    names a published object and 0 where not. A reply of another shape raises
    :class:`~kvproto.errors.MalformedFrame`."""
    found = reply.body.get("found")
    if type(found) is not bytes or len(found) != expected or found.translate(None, b"\0\1"):
        raise errors.MalformedFrame(f"exists reply's found is not {expected} bytes of 0 or 1")
    return list(map(bool, found))


#: A ``read_begin`` asked with ``columns`` answers its keys as columns, one
#: list per field with an entry per key in the request's order, instead of an
#: item per key: ``errors`` the keys refused, ``[index, code, message]``
#: (their other entries 0); ``token``, ``length``, ``checksum`` (0: none) and
#: ``replicas`` (how many); ``segment`` and ``offset`` every key's replicas in
#: turn (a replica's length is its object's). A leased read adds ``lease`` (the
#: ids) and ``ttl`` (one for the request); a store with tenants ``tickets``
#: (each key's, one per replica). :func:`read_items` turns them into items;
#: :func:`read_columns` is the client's check of them.
READ_COLUMNS = ("token", "length", "checksum", "replicas", "offset")
READ_ERRORS = list_of(tuple_of(uint(MAX_BATCH), uint(UINT63, 1), text(1 << 20)))
READ_TICKETS = list_of(list_of(TICKET, MAX_REPLICAS))


def read_items(columns: dict) -> list:
    """The items of a ``read_begin`` reply (one per key: ``[0, grant]`` or an
    error) from its :data:`READ_COLUMNS`."""
    items: list = [[0, None]] * len(columns["token"])
    for i, code, message in columns["errors"]:
        items[i] = [code, message]
    lease, tickets, at = columns.get("lease"), columns.get("tickets"), 0
    segment, offset = columns["segment"], columns["offset"]
    for i, (token, length, checksum, n) in enumerate(zip(
            columns["token"], columns["length"], columns["checksum"], columns["replicas"])):
        if items[i][0]:
            continue
        item = {"token": token, "length": length,
                "replicas": [[segment[k], offset[k], length] for k in range(at, at + n)]}
        at += n
        if checksum:
            item["checksum"] = checksum
        if tickets is not None:
            item["tickets"] = tickets[i]
        if lease is not None:
            item["lease"], item["ttl"] = lease[i], columns["ttl"]
        items[i] = [0, item]
    return items


def read_columns(reply: Reply, expected: int) -> dict:
    """The columns of a ``read_begin`` reply for ``expected`` keys (see
    :data:`READ_COLUMNS`), checked a column at a time; a reply of another
    shape raises :class:`~kvproto.errors.MalformedFrame`."""
    columns = reply.body.get("columns")
    if type(columns) is not dict:
        raise errors.MalformedFrame("read_begin reply has no columns")
    ints = [*READ_COLUMNS, *(["lease"] if "lease" in columns else [])]
    for name in ints:
        try:   # unsigned 64-bit ints, in one pass in C
            if type(columns.get(name)) is not list or array("Q", columns[name]) is None:
                raise TypeError
        except (TypeError, OverflowError):
            raise errors.MalformedFrame(f"read_begin reply's column {name!r} is not unsigned "
                                        "ints") from None
    segments = columns.get("segment")
    try:    # a few segments named over and over: each name checked once
        names = set(segments) if type(segments) is list else None
    except TypeError:
        names = None
    if names is None or not all(SEGMENT.ok(s) for s in names) \
            or not READ_ERRORS.ok(columns.get("errors")) \
            or ("tickets" in columns and not READ_TICKETS.ok(columns["tickets"])):
        raise errors.MalformedFrame("read_begin reply's segments, errors or tickets are malformed")
    if any(len(columns[name]) != expected for name in ints if name != "offset") \
            or ("tickets" in columns and len(columns["tickets"]) != expected) \
            or len(segments) != sum(columns["replicas"]) or len(columns["offset"]) != len(segments) \
            or any(i >= expected for i, _, _ in columns["errors"]):
        raise errors.MalformedFrame(f"read_begin reply's columns do not describe {expected} keys")
    if "lease" in columns and not (type(columns.get("ttl")) in (int, float) and columns["ttl"] > 0):
        raise errors.MalformedFrame("read_begin reply has leases but no ttl")
    return columns


#: A ``put_start`` asked with ``columns`` answers its grants as columns
#: instead of an item per key: ``token`` one per key in the request's order
#: (0 where refused), ``errors`` the keys refused (``[index, code, message]``),
#: ``segment`` and ``offset`` the granted keys' replicas in turn (as many per
#: key as the request's ``replicas``; a replica's length is its key's in the
#: request), ``direct`` one byte per replica, 1 where its segment is granted
#: to the client as a direct writer. :func:`put_items` turns them into items;
#: :func:`put_columns` is the client's check of them.
PUT_COLUMNS = ("token", "errors", "segment", "offset", "direct")


def put_items(columns: dict, items: list, replicas: int) -> list:
    """The items of a ``put_start`` reply from its :data:`PUT_COLUMNS`
    (``items``: the request's ``[key, length]`` each)."""
    out: list = [None] * len(items)
    for i, code, message in columns["errors"]:
        out[i] = [code, message]
    segment, offset, direct, at = columns["segment"], columns["offset"], columns["direct"], 0
    for i, ((_, length), token) in enumerate(zip(items, columns["token"])):
        if token:
            span, at = range(at, at + replicas), at + replicas
            grant = {"token": token, "replicas": [[segment[j], offset[j], length] for j in span]}
            if any(direct[j] for j in span):
                grant["direct"] = [segment[j] for j in span if direct[j]]
            out[i] = [0, grant]
    return out


def put_end_refused(reply: Reply, expected: int) -> list:
    """The answer of a ``put_end`` asked with ``columns`` for ``expected``
    keys: ``body["errors"]``, ``[index, code, message]`` of each key refused,
    every other key published. Another shape raises
    :class:`~kvproto.errors.MalformedFrame`."""
    refused = reply.body.get("errors")
    if not READ_ERRORS.ok(refused) or len({i for i, _, _ in refused}) != len(refused) \
            or any(i >= expected for i, _, _ in refused):
        raise errors.MalformedFrame(f"put_end reply's errors do not name keys of {expected}")
    return refused


def put_columns(reply: Reply, expected: int, replicas: int) -> dict:
    """The columns of a ``put_start`` reply for ``expected`` keys of
    ``replicas`` replicas each (:data:`PUT_COLUMNS`), checked a column at a
    time; another shape raises :class:`~kvproto.errors.MalformedFrame`."""
    columns = reply.body.get("columns")
    if type(columns) is not dict:
        raise errors.MalformedFrame("put_start reply has no columns")
    token, refused, segment, offset, direct = map(columns.get, PUT_COLUMNS)
    try:   # unsigned 64-bit ints and a few segments named over and over, in C
        if type(token) is not list or type(offset) is not list or type(segment) is not list \
                or array("Q", token) is None or array("Q", offset) is None:
            raise TypeError
        names = set(segment)
    except (TypeError, OverflowError):
        raise errors.MalformedFrame("put_start reply's ints or segments are malformed") from None
    if not all(SEGMENT.ok(s) for s in names) or not READ_ERRORS.ok(refused) \
            or type(direct) is not bytes or direct.translate(None, b"\0\1"):
        raise errors.MalformedFrame("put_start reply's segments, errors or direct are malformed")
    at = {i for i, _, _ in refused}
    if len(token) != expected or len(at) != len(refused) or token.count(0) != len(refused) \
            or any(i >= expected or token[i] for i in at) \
            or not len(segment) == len(offset) == len(direct) == (expected - len(at)) * replicas:
        raise errors.MalformedFrame(f"put_start reply's columns do not describe {expected} keys")
    return columns


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def waiting(sock: "zmq.Socket", limit: Optional[int] = None, polled: bool = False):
    """The multipart messages already waiting on ``sock`` (at most ``limit``),
    received without blocking and without copying their frames. The socket's
    ``EVENTS`` says whether one waits, so an empty socket costs no exception;
    ``polled``: a poll has just said one waits, so the first is received
    without asking (each ask is two system calls)."""
    n, events = 0, sock.get      # the plain int, not the PollEvent flag (half the cost)
    while limit is None or n < limit:
        if not (polled and n == 0) and not events(_EVENTS) & _POLLIN:
            return
        try:
            yield sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        n += 1
