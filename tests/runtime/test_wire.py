"""The one validation path: every kind of bad frame gets its typed error."""

import msgpack
import pytest

from kvproto import errors
from kvproto.runtime import wire

V = wire.PROTOCOL_VERSION


def req(*header, payloads=()):
    return [msgpack.packb(list(header), use_bin_type=True), *payloads]


def decode(frames, ops=wire.MASTER_OPS, max_header=1 << 16, max_payload=0):
    return wire.decode_request(frames, max_header, max_payload, ops)


GOOD_PUT = {"client": "c", "replicas": 1, "items": [[b"k", 10]]}


def test_good_request():
    r = decode(req(V, "put_start", 7, GOOD_PUT))
    assert (r.op, r.request_id, r.payloads) == ("put_start", 7, [])
    assert r.body["items"] == [(b"k", 10)]


def test_good_write_with_payload():
    r = decode(req(V, "write", 1, {"segment": "s", "offset": 0, "token": 3, "term": 1}, payloads=[b"abc"]),
               ops=wire.STORAGE_OPS, max_payload=10)
    assert bytes(r.payloads[0]) == b"abc"


@pytest.mark.parametrize("frames,error,rid", [
    ([b""], errors.MalformedFrame, 0),
    ([b"\xc1garbage"], errors.MalformedFrame, 0),
    ([msgpack.packb([V, "stats", 5, {}])[:-2]], errors.MalformedFrame, 0),          # truncated
    ([msgpack.packb([V, "stats", 5, {}]) + b"x"], errors.MalformedFrame, 0),        # trailing bytes
    ([msgpack.packb({"op": "stats"})], errors.MalformedFrame, 0),
    ([msgpack.packb([V, "stats", 5])], errors.MalformedFrame, 0),
    (req("1", "stats", 5, {}), errors.MalformedFrame, 5),
    (req(V + 1, "stats", 5, {}), errors.UnsupportedVersion, 5),
    (req(V, 3, 5, {}), errors.MalformedFrame, 5),
    (req(V, "launch_missiles", 5, {}), errors.UnknownMessage, 5),
    (req(V, "write", 5, {}), errors.UnknownMessage, 5),                             # storage op at master
    (req(V, "stats", -1, {}), errors.MalformedFrame, 0),
    (req(V, "stats", "x", {}), errors.MalformedFrame, 0),
    (req(V, "stats", 5, []), errors.MalformedFrame, 5),
    (req(V, "put_start", 5, {"client": "c", "replicas": 1}), errors.MalformedFrame, 5),  # missing
    (req(V, "put_start", 5, {**GOOD_PUT, "replicas": "1"}), errors.MalformedFrame, 5),    # type
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [["k", 10]]}), errors.MalformedFrame, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"k"]]}), errors.MalformedFrame, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"k", 1.5]]}), errors.MalformedFrame, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"k", True]]}), errors.MalformedFrame, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "replicas": 0}), errors.InvalidArgument, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"k", -4]]}), errors.InvalidArgument, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"", 4]]}), errors.InvalidArgument, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": []}), errors.InvalidArgument, 5),
    (req(V, "put_start", 5, {**GOOD_PUT, "items": [[b"k" * 5000, 4]]}), errors.InvalidArgument, 5),
    ([msgpack.packb([V, "stats", 5, {}]), b"x"], errors.FrameTooLarge, 0),          # payload to master
    ([b"\x00" * ((1 << 16) + 1)], errors.FrameTooLarge, 0),
])
def test_rejected(frames, error, rid):
    with pytest.raises(errors.KvError) as info:
        decode(frames)
    assert type(info.value) is error
    assert info.value.request_id == rid


def test_a_put_end_item_may_carry_a_checksum_and_a_publish_region_too():
    """The checksum is an optional third item of put_end (fourth of publish):
    an older sender's items decode as before; a bad or an extra one is refused."""
    body = {"client": "c", "items": [[b"k", 3], [b"j", 4, (1 << 64) - 1]]}
    assert decode(req(V, "put_end", 1, body)).body["items"] == [(b"k", 3), (b"j", 4, (1 << 64) - 1)]
    for items, error in (([[b"k", 3, -1]], errors.InvalidArgument),
                         ([[b"k", 3, "sum"]], errors.MalformedFrame),
                         ([[b"k", 3, 1, 2]], errors.MalformedFrame),
                         ([[b"k"]], errors.MalformedFrame)):
        with pytest.raises(error):
            decode(req(V, "put_end", 1, {**body, "items": items}))
    with pytest.raises(errors.MalformedFrame):   # a revoke names no checksum
        decode(req(V, "put_revoke", 1, {**body, "items": [[b"k", 3, 1]]}))
    publish = {"segment": "s", "term": 1, "regions": [[0, b"k", 3], [4096, b"j", 4, 9]]}
    assert decode(req(V, "publish", 1, publish), ops=wire.STORAGE_OPS).body["regions"] == \
        [(0, b"k", 3), (4096, b"j", 4, 9)]



@pytest.mark.parametrize("fields", [(), ("regions", "columns")])
def test_assign_and_publish_take_regions_or_columns(fields):
    """An ``assign`` or ``publish`` carries its regions as rows or as columns,
    exactly one of the two: neither, or both, is MalformedFrame."""
    rows = {"regions": [[0, 4096, b"k", 1]],
            "columns": [[0], [4096], [b"k"], [1], [""]]}
    for name in ("regions", "columns"):
        body = {"segment": "s", "term": 1, name: rows[name]}
        assert decode(req(V, "assign", 1, body), ops=wire.STORAGE_OPS).body[name]
    body = {"segment": "s", "term": 1, **{n: rows[n] for n in fields}}
    with pytest.raises(errors.MalformedFrame) as caught:
        decode(req(V, "assign", 4, body), ops=wire.STORAGE_OPS)
    assert caught.value.request_id == 4


def test_payload_count_and_size_at_storage():
    body = {"segment": "s", "offset": 0, "token": 3, "term": 1}
    with pytest.raises(errors.MalformedFrame):
        decode(req(V, "write", 1, body), ops=wire.STORAGE_OPS, max_payload=10)
    with pytest.raises(errors.MalformedFrame):
        decode(req(V, "write", 1, body, payloads=[b"a", b"b"]), ops=wire.STORAGE_OPS, max_payload=10)
    with pytest.raises(errors.FrameTooLarge):
        decode(req(V, "write", 1, body, payloads=[b"x" * 11]), ops=wire.STORAGE_OPS, max_payload=10)
    with pytest.raises(errors.InvalidArgument):
        decode(req(V, "write", 1, {**body, "token": 0}, payloads=[b"x"]), ops=wire.STORAGE_OPS,
               max_payload=10)


def test_extra_fields_are_ignored_and_nesting_is_bounded():
    r = decode(req(V, "stats", 1, {"future": [1, 2, 3]}))
    assert r.body == {}
    deep = b"\x91" * 100000 + b"\xc0"   # 100k nested arrays
    with pytest.raises(errors.MalformedFrame):
        decode([deep], max_header=1 << 20)


def test_replies():
    rep = wire.decode_reply([wire.encode_error(9, errors.NoSpace("full"))])
    assert rep.request_id == 9 and isinstance(rep.error(), errors.NoSpace)
    with pytest.raises(errors.NoSpace):
        rep.raise_for_status()
    with pytest.raises(errors.MalformedFrame):
        wire.decode_reply([b"junk"])
    assert wire.item_result([errors.KeyExists.code, "x"])[0].__class__ is errors.KeyExists
    assert wire.item_result([0, {"a": 1}]) == (None, {"a": 1})


# The fast test of a field (``check.ok``, compiled from its schema) must
# accept exactly what the slow check accepts: a value it wrongly passed would
# reach a handler unchecked. Values are drawn near the schemas' shapes (ints
# at the bounds, short keys, arrays of 0..5 elements, nested).

from hypothesis import given, settings, strategies as st  # noqa: E402

_LEAVES = st.one_of(
    st.sampled_from([0, 1, -1, 0xFFFF, 0x10000, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64,
                     True, None, 1.0, "", "s", b"", b"k", b"x" * 32, b"y" * 33]),
    st.integers(-3, 1 << 20), st.binary(max_size=5), st.text(max_size=3))
_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=5), max_leaves=24)
_FIELDS = [(f"{op}.{name}", check) for table in (wire.MASTER_OPS, wire.STORAGE_OPS)
           for op, schema in table.items()
           for name, check in {**schema.fields, **schema.optional}.items()]


def _passes(check, value) -> bool:
    try:
        check(value, "v")
    except (errors.MalformedFrame, errors.InvalidArgument):
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(_VALUES)
def test_the_fast_test_of_every_field_agrees_with_its_check(value):
    for name, check in _FIELDS:
        assert check.ok(value) == _passes(check, value), (name, value)


@pytest.mark.parametrize("op,field,value,ok", [
    ("assign", "regions", [[0, 4096, b"k", 1]], True),
    ("assign", "regions", [[0, 4096, b"k", 0]], False),          # token 0
    ("assign", "regions", [[0, 4096, b"k", 1], [0, 4096, "k", 1]], False),
    ("assign", "regions", [], False),                              # min_items 1
    ("publish", "regions", [[0, b"k", 1, 5, 2]], True),            # two optional fields
    ("publish", "regions", [[0, b"k", 1, 5, 1 << 16]], False),     # requested > 0xFFFF
    ("publish", "regions", [[0, b"k", 1, 5, 2, 3]], True),         # a repair's publishing term
    ("publish", "regions", [[0, b"k", 1, 5, 2, -1]], False),       # a negative term
    ("publish", "regions", [[0, b"k", 1, 5, 2, 3, 0]], False),     # one field too many
    ("assign", "direct", [[4096, "w"]], True),
    ("assign", "direct", [[4096, ""]], False),                     # writer name empty
    ("assign", "columns", [[0, 4096], [4096, 8], [b"k", b"j"], [1, 2], ["", "w"]], True),
    ("assign", "columns", [[0], [4096], [b"k"], [1], [""]], True),          # one row
    ("assign", "columns", [[0], [4096, 8], [b"k"], [1], [""]], False),      # one row, one column of two
    ("assign", "columns", [[0], [4096], [b"k"], [1]], False),      # the writers column missing
    ("assign", "columns", [[0, 4096], [4096], [b"k"], [1], [""]], False),   # unequal lengths
    ("assign", "columns", [[], [], [], [], []], False),            # no region
    ("assign", "columns", [[0], [4096], [b"k"], [0], [""]], False),         # token 0
    ("assign", "columns", [[0], [4096], ["k"], [1], [""]], False),          # a key not bytes
    ("assign", "columns", [[True], [4096], [b"k"], [1], [""]], False),      # a bool offset
    ("assign", "columns", [[0], [4096], [b""], [1], [""]], False),          # an empty key
    ("assign", "columns", [[0], [4096], [b"k"], [1], ["w" * 65]], False),   # writer too long
    ("publish", "columns", [[0], [b"k"], [1], [5], [2], [0]], True),
    ("publish", "columns", [[0], [b"k"], [1], [5], [1 << 16], [0]], False),  # requested > 0xFFFF
    ("publish", "columns", [[0], [b"k"], [1], [-1], [2], [0]], False),       # a negative checksum
    ("publish", "columns", [[0], [b"k"], [1], [5], [2]], False),             # a column missing
    ("publish", "columns", [[0], [b"k"], [1], [5], [2], 0], False),          # a column not a list
])
def test_the_fast_test_of_nested_fields(op, field, value, ok):
    schema = wire.STORAGE_OPS[op]
    check = {**schema.fields, **schema.optional}[field]
    assert check.ok(value) is ok and _passes(check, value) is ok


GOOD_COLUMNS = {"errors": [[1, errors.KeyNotFound.code, "b'x'"]], "token": [5, 0, 6],
                "length": [10, 0, 20], "checksum": [0, 0, 9], "replicas": [1, 0, 2],
                "segment": ["a", "a", "b"], "offset": [0, 4096, 0], "lease": [3, 0, 4],
                "ttl": 2.0}


@pytest.mark.parametrize("change", [
    {"columns": None}, {"token": [5, 0]}, {"token": [5, 0, "6"]}, {"offset": [0, 4096]},
    {"replicas": [1, 0, 3]}, {"segment": ["a", "a", 7]}, {"errors": [[3, 1, "?"]]},
    {"errors": [[0, 0, "ok?"]]}, {"checksum": [0, 0, -1]}, {"lease": [3, 0]}, {"ttl": None},
    {"tickets": [[], [], "t"]}, {"length": None}, {"segment": ["a", ["a"], "b"]},
    {"offset": [0, 1.5, 0]}, {"lease": [3, 0, True, 1]},
])
def test_a_read_begin_answered_as_columns_is_checked(change):
    """What the client takes from a ``read_begin`` answered as columns is
    checked as a whole: a column missing, of the wrong type or length, or not
    matching the replicas' counts, is MalformedFrame."""
    n = 3
    assert wire.read_columns(wire.Reply(0, 1, {"columns": GOOD_COLUMNS}, []), n) is GOOD_COLUMNS
    columns = {k: v for k, v in {**GOOD_COLUMNS, **change}.items() if v is not None}
    body = {"columns": columns} if "columns" not in change else {"items": []}
    with pytest.raises(errors.MalformedFrame):
        wire.read_columns(wire.Reply(0, 1, body, []), n)
    with pytest.raises(errors.MalformedFrame):
        wire.read_columns(wire.Reply(0, 1, {"columns": GOOD_COLUMNS}, []), n + 1)


def test_columns_read_back_as_items():
    assert wire.read_items(GOOD_COLUMNS) == [
        [0, {"token": 5, "length": 10, "replicas": [["a", 0, 10]], "lease": 3, "ttl": 2.0}],
        [errors.KeyNotFound.code, "b'x'"],
        [0, {"token": 6, "length": 20, "replicas": [["a", 4096, 20], ["b", 0, 20]],
             "checksum": 9, "lease": 4, "ttl": 2.0}]]


GOOD_GRANTS = {"token": [5, 0, 6], "errors": [[1, errors.KeyExists.code, "b'x'"]],
               "segment": ["a", "b", "a", "b"], "offset": [0, 0, 4096, 8192],
               "direct": b"\x01\x00\x01\x00"}


@pytest.mark.parametrize("change", [
    {"columns": None}, {"token": [5, 0]}, {"token": [5, 0, "6"]}, {"token": [5, 7, 6]},
    {"token": [5, 0, 0]}, {"token": [5, 0, -6]}, {"offset": [0, 0, 4096]},
    {"offset": [0, 0, 4096, 1.5]}, {"segment": ["a", "b", "a", 7]}, {"segment": ["a", "b", "a", ""]},
    {"segment": "abab"}, {"direct": b"\x01\x00\x01"}, {"direct": b"\x01\x00\x02\x00"},
    {"direct": [1, 0, 1, 0]}, {"errors": [[3, 1, "?"]]}, {"errors": [[0, 1, "?"]]},
    {"errors": [[1, 0, "ok?"]]}, {"errors": [[1, 1, "?"], [1, 1, "?"]]}, {"errors": None},
])
def test_a_put_start_answered_as_columns_is_checked(change):
    """What the client takes from a ``put_start`` answered as columns is
    checked as a whole: a column missing, of the wrong type or length, a
    refused key with a token or a granted one without, is MalformedFrame."""
    good = wire.Reply(0, 1, {"columns": GOOD_GRANTS}, [])
    assert wire.put_columns(good, 3, 2) is GOOD_GRANTS
    columns = {k: v for k, v in {**GOOD_GRANTS, **change}.items() if v is not None}
    body = {"columns": columns} if "columns" not in change else {"items": []}
    with pytest.raises(errors.MalformedFrame):
        wire.put_columns(wire.Reply(0, 1, body, []), 3, 2)
    for n, replicas in ((4, 2), (3, 1)):
        with pytest.raises(errors.MalformedFrame):
            wire.put_columns(good, n, replicas)


def test_put_columns_read_back_as_items():
    assert wire.put_items(GOOD_GRANTS, [[b"k", 10], [b"x", 20], [b"j", 30]], 2) == [
        [0, {"token": 5, "replicas": [["a", 0, 10], ["b", 0, 10]], "direct": ["a"]}],
        [errors.KeyExists.code, "b'x'"],
        [0, {"token": 6, "replicas": [["a", 4096, 30], ["b", 8192, 30]], "direct": ["a"]}]]


@pytest.mark.parametrize("body", [
    {"items": [[0, True], [0, False], [0, True]]}, {"found": b"\x01\x00"},
    {"found": b"\x01\x00\x01\x00"}, {"found": b"\x01\x02\x01"}, {"found": "\x01\x00\x01"},
    {"found": [1, 0, 1]}, {"found": bytearray(b"\x01\x00\x01")}, {"found": None},
])
def test_an_exists_answered_as_found_bytes_is_checked(body):
    """An ``exists`` asked with ``found`` answers one byte per key, 1 for a
    published object and 0 for none; another length, type or byte is
    MalformedFrame."""
    good = wire.Reply(0, 1, {"found": b"\x01\x00\x01"}, [])
    assert wire.found_of(good, 3) == [True, False, True]
    assert wire.found_of(wire.Reply(0, 1, {"found": b""}, []), 0) == []
    with pytest.raises(errors.MalformedFrame):
        wire.found_of(wire.Reply(0, 1, body, []), 3)


@pytest.mark.parametrize("body", [
    {"items": [[0, None]] * 3}, {"errors": None}, {"errors": [[3, 2, "x"]]},
    {"errors": [[0, 2, "x"], [0, 3, "y"]]}, {"errors": [[0, 0, "x"]]}, {"errors": [[0, 2, 5]]},
    {"errors": [[-1, 2, "x"]]}, {"errors": [(0, 2, "x")]}, {"errors": [[0, 2]]},
])
def test_a_put_end_answered_with_its_refused_keys_is_checked(body):
    """A ``put_end`` asked with ``columns`` answers ``[index, code, message]``
    of each refused key; an index out of range or repeated, a zero code or
    another shape is MalformedFrame."""
    good = wire.Reply(0, 1, {"errors": [[1, errors.StaleToken.code, "gone"]]}, [])
    assert wire.put_end_refused(good, 3) == [[1, errors.StaleToken.code, "gone"]]
    assert wire.put_end_refused(wire.Reply(0, 1, {"errors": []}, []), 3) == []
    with pytest.raises(errors.MalformedFrame):
        wire.put_end_refused(wire.Reply(0, 1, body, []), 3)
