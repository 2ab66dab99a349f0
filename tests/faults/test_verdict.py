"""The fault matrix's judge (kvproto/checking/chaos/verdict.py) and its values:
each thing the matrix must catch is caught, and what is allowed is allowed."""

from __future__ import annotations

import pytest

from kvproto.checking.chaos.verdict import History, Report, judge
from kvproto.checking.chaos.workers import value, verify

pytestmark = pytest.mark.faults


def test_a_value_names_its_key_and_generation():
    data = value(b"k", 3, 1000)
    assert verify(b"k", data) == (3, "")
    assert verify(b"k", memoryview(data)) == (3, "")
    assert verify(b"other", data)[0] is None                       # another key's bytes
    torn = bytearray(data)
    torn[500:] = value(b"k", 4, 1000)[500:]                        # half of a newer generation
    assert "digest" in verify(b"k", torn)[1]
    assert verify(b"k", data[:-1])[0] is None                      # cut short
    assert verify(b"k", b"\0" * 1000)[1] == "no magic"             # a zeroed region
    assert value(b"k", 1, 1000) != value(b"k", 2, 1000)


def put(key, gen, out="ok", t0=0.0, t1=1.0):
    return [{"op": "put?", "key": key, "gen": gen, "t0": t0},
            {"op": "put", "key": key, "gen": gen, "t0": t0, "t1": t1, "out": out}]


def remove(key, gen, out="ok", t0=2.0, t1=3.0):
    return [{"op": "remove?", "key": key, "gen": gen, "t0": t0},
            {"op": "remove", "key": key, "gen": gen, "t0": t0, "t1": t1, "out": out}]


def get(key, res, t0=4.0, t1=5.0):
    return {"op": "get", "keys": [key], "t0": t0, "t1": t1, "out": "ok", "res": [res]}


def verdict(records, final, placements=None, live=(), duplicates=False):
    h = History(duplicates)
    h.add(records)
    return judge(Report("t"), h, final, placements or {}, set(live), "")


def test_an_acknowledged_put_that_is_gone_is_lost():
    r = verdict(put("a", 1), {})
    assert r.lost_puts == 1 and r.acked_lost == 1 and r.failed


def test_unless_every_node_it_was_on_is_gone():
    r = verdict(put("a", 1), {}, placements={"a": ["s1", "s2"]}, live={"s3"})
    assert r.lost_puts == 0 and r.lost_with_nodes == 1 and not r.failed
    r = verdict(put("a", 1), {}, placements={"a": ["s1", "s2"]}, live={"s2"})
    assert r.lost_puts == 1


def test_an_acknowledged_remove_undone_is_lost():
    r = verdict(put("a", 1) + remove("a", 1), {"a": 1})
    assert r.lost_removes == 1 and r.failed


def test_a_read_of_a_removed_generation_after_the_remove_was_acknowledged():
    records = put("a", 1) + remove("a", 1, t1=3.0) + [get("a", 1, t0=4.0)]
    assert verdict(records, {}).stale_reads == 1
    # a read that began before the acknowledgement may see it
    records = put("a", 1) + remove("a", 1, t1=3.0) + [get("a", 1, t0=2.5)]
    assert verdict(records, {}).stale_reads == 0


def test_wrong_bytes_and_unexplained_objects():
    r = verdict(put("a", 1) + [get("a", "wrong: payload digest mismatch")], {"a": 1})
    assert r.wrong_bytes == 1 and r.failed
    assert verdict(put("a", 1) + [get("a", 7)], {"a": 1}).unexplained == 1    # never begun
    assert verdict([], {"stray": 1}).unexplained == 1
    assert verdict(put("a", 1), {"a": "wrong: bytes of another key"}).wrong_bytes == 1


def test_unknown_outcomes_allow_either_state():
    for final in ({}, {"a": 1}):
        assert not verdict(put("a", 1, out="RequestTimeout"), final).failed
        assert not verdict(put("a", 1)[:1], final).failed                     # killed mid-put
        assert not verdict(put("a", 1) + remove("a", 1, out="MasterNotOpen"), final).failed
        # a remove sent again to a new master is told KeyNotFound: it may have happened
        assert not verdict(put("a", 1) + remove("a", 1, out="KeyNotFound"), final).failed


def test_a_refusal_is_certain_unless_requests_may_be_duplicated():
    records = put("a", 1) + remove("a", 1, out="ObjectLeased")
    assert verdict(records, {}).lost_puts == 1
    assert not verdict(records, {}, duplicates=True).failed
    assert verdict(put("a", 1, out="KeyExists"), {"a": 1}).unexplained == 1


def test_a_later_generation_replaces_an_earlier_one():
    records = put("a", 1) + remove("a", 1) + put("a", 2, t0=6, t1=7)
    assert not verdict(records, {"a": 2}).failed
    assert verdict(records, {"a": 1}).lost_removes == 1
    assert verdict(records, {}).lost_puts == 1


def test_client_exceptions_are_failures():
    r = verdict([{"op": "exception", "error": "TypeError: x", "trace": "...", "t": 1.0}], {})
    assert r.exceptions == 1 and r.failed


def test_a_batch_killed_in_the_middle_leaves_each_begun_key_unknown():
    """A put_many journals a put? per key before the call: a worker killed
    before the answers leaves every one of them unknown (present or not),
    and a key whose put ended keeps its own outcome."""
    begun = [{"op": "put?", "key": k, "gen": 1, "t0": 0.0} for k in "abc"]
    ended = [{"op": "put", "key": "a", "gen": 1, "t0": 0.0, "t1": 1.0, "out": "ok"}]
    for final in ({"a": 1}, {"a": 1, "b": 1, "c": 1}, {"a": 1, "c": 1}):
        assert not verdict(begun + ended, final).failed
    assert verdict(begun + ended, {"b": 1, "c": 1}).failed          # the acknowledged a lost
