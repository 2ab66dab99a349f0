"""A master handling batched requests with the cores' batch steps answers,
changes and commands exactly as one handling each key's steps one at a time
(no sockets).

Two masters on one clock get the same random requests — ``put_start`` (new,
repeated, existing and unplaceable keys, a direct writer on a node's host),
``put_end`` (right and wrong tokens, checksums, repeated items), ``read_begin``
(pinned and leased, missing keys, releases carried along, answered as items
or as columns), ``release`` (held,
unknown and repeated leases), ``read_end``, ``exists`` (answered as items or
as one byte per key, each the directory's ``Readable``) and ``remove`` — the
storage nodes accepting or refusing commands. One takes the batch steps
(``MasterCore.batched``), the other not; after every request their replies,
the commands sent (in order), the directory, the lease table, the sessions,
the allocators, the direct regions and the counters must be equal.
"""

from __future__ import annotations

import random

import pytest

from kvproto import errors
from kvproto.runtime import wire
from kvproto.runtime.master import MasterCore
from kvproto.statemachines.publish import Status

SEGMENTS = ("seg-0", "seg-1", "seg-2")
KEYS = [b"key/%04d" % i for i in range(60)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def new_master(clock: Clock, batched: bool, columns: tuple = ("seg-1",)) -> MasterCore:
    """A master with the three nodes; those in ``columns`` take ``assign``
    and ``publish`` as columns."""
    core = MasterCore(writer_timeout=5.0, storage_timeout=5.0, lease_ttl=2.0, clock=clock)
    core.batched = batched
    for n, seg in enumerate(SEGMENTS):
        core.handle("register", {"segment": seg, "capacity": 64 * 4096, "host": f"host-{n % 2}",
                                 "endpoint": f"tcp://127.0.0.1:{9000 + n}", "shm": f"shm-{n}",
                                 "gen_shm": f"gen-{n}", "nonce": n, "page_size": 4096,
                                 **({"columns": True} if seg in columns else {})})
    return core


def rows_of(op: str, body: dict) -> list:
    """A command's regions as full rows (an assign's with its direct writer
    or "", a publish's with 0 for what it leaves out), whether it carries them
    as rows or as columns."""
    if "columns" in body:
        return [list(r) for r in zip(*body["columns"])]
    if op == "assign":
        direct = dict(body.get("direct", ()))
        return [[*r, direct.get(r[0], "")] for r in body["regions"]]
    if op == "publish":
        return [[*r, *[0] * (6 - len(r))] for r in body["regions"]]
    return body["regions"]


def state(core: MasterCore) -> tuple:
    sessions = {c: (dict(s.tokens), dict(s.pins)) for c, s in core.sessions.items()}
    allocators = {s: a.extents() for s, a in core.placer.allocators.items()}
    return (core.directory.reference(), core.leases.reference(), sessions, allocators,
            dict(core._direct), dict(core._owner), core._next_lease, dict(core.counters))


class Pair:
    """The two masters, fed alike."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.clock = rng, Clock()
        self.cores = (new_master(self.clock, True), new_master(self.clock, False))
        assert self.cores[0]._batched() and not self.cores[1]._batched()

    def call(self, op: str, body: dict):
        seed, replies = self.rng.random(), []
        for core in self.cores:
            try:
                reply = core.handle(op, dict(body), reply_to="r", request_id=1)
            except errors.KvError as err:
                reply = (err.code, {"error": str(err), "items": []})
            replies.append((reply, deliver(core, random.Random(seed))))
        assert replies[0] == replies[1], (op, body)
        assert state(self.cores[0]) == state(self.cores[1]), (op, body)
        reply, ready = replies[0]
        return reply[1] if reply is not None else ready[-1][3]


def deliver(core: MasterCore, refuse: random.Random) -> list:
    """Acknowledge every command, a region refused now and then (the same ones
    for both masters); the commands sent and the replies made ready."""
    sent = []
    while core.outbox:
        segment, op, cmd_id, body = core.outbox.pop(0)
        sent.append((segment, op, cmd_id, body))
        results = [wire.error_item(errors.NoSpace("refused by the test"))
                   if refuse.random() < 0.03 else wire.ok_item() for _ in rows_of(op, body)]
        answer, count = {"results": results}, refuse.random() < 0.5
        if count and body.get("tally") and not any(item[0] for item in results):
            answer = {"accepted": len(results)}         # as a node asked with tally may
        core.storage_reply(segment, wire.Reply(0, cmd_id, answer, []))
    ready, core.ready[:] = list(core.ready), []
    return sent + ready


def run(pair: Pair, steps: int) -> None:
    rng = pair.rng
    pending: list = []      # (key, token) granted, maybe ended
    leases: list = []
    for _ in range(steps):
        op = rng.choice(["put_start", "put_start", "put_end", "put_end", "read", "read",
                         "release", "read_end", "exists", "remove", "time"])
        keys = [rng.choice(KEYS) for _ in range(rng.randint(0, 20))]
        if op == "put_start":
            body = {"client": rng.choice(["c1", "c2"]), "replicas": rng.choice([1, 2, 2, 3, 4]),
                    "items": [[k, rng.choice([1, 4096, 5000, 70000, 64 * 4096 + 1])]
                              for k in keys]}
            if rng.random() < 0.3:
                body.update(writer=f"w{rng.randint(0, 1)}", host=f"host-{rng.randint(0, 2)}")
            if rng.random() < 0.5:
                body["columns"] = True
            reply = pair.call("put_start", body)
            items = reply["items"] if "items" in reply else wire.put_items(wire.put_columns(
                wire.Reply(0, 1, reply, []), len(keys), body["replicas"]), body["items"],
                body["replicas"])
            pending += [(k, item[1]["token"]) for (k, _), item in zip(body["items"], items)
                        if item[0] == 0]
        elif op == "put_end":
            chosen = [rng.choice(pending) for _ in range(rng.randint(0, 12))] if pending else []
            items = [[k, t if rng.random() < 0.9 else t + 1] + ([rng.randint(0, 1 << 64 - 1)]
                                                                  if rng.random() < 0.5 else [])
                     for k, t in chosen]
            body = {"client": rng.choice(["c1", "c2"]), "items": items}
            if rng.random() < 0.5:
                body["columns"] = True       # the refused keys only
            ended = pair.call("put_end", body)
            if items:
                assert ("errors" in ended) == ("columns" in body)
        elif op == "read":
            body = {"client": rng.choice(["r1", "r2"]), "keys": keys,
                    "lease": rng.random() < 0.7, "columns": len(keys) % 2 == 1}
            if leases and rng.random() < 0.3:
                body["release"] = [leases.pop(rng.randrange(len(leases)))[1]]
            reply = pair.call("read_begin", body)
            if body["columns"]:
                # what the client checks of the columns, and the items they stand for
                columns = wire.read_columns(wire.Reply(0, 1, reply, []), len(keys))
                reply = {"items": wire.read_items(columns)}
            for item in reply["items"]:
                if item[0] == 0 and "lease" in item[1]:
                    leases.append((body["client"], item[1]["lease"]))
        elif op == "release":
            if leases:
                client = rng.choice(["r1", "r2"])
                ids = [rng.choice(leases)[1] for _ in range(rng.randint(0, 8))] + [10 ** 6]
                pair.call("release", {"client": client, "leases": ids})
        elif op == "read_end":
            pair.call("read_end", {"client": rng.choice(["r1", "r2"]),
                                   "items": [[k, t] for k, t in pending[-5:]]})
        elif op == "exists":
            # one byte per key asked with found, else an item per key; both
            # the directory's Readable(k)
            found = pair.call("exists", {"keys": keys, "found": True})["found"]
            assert pair.call("exists", {"keys": keys})["items"] == [[0, b == 1] for b in found]
            objects = pair.cores[0].directory.reference().objects
            assert found == bytes(k in objects and objects[k].status is Status.PUBLISHED
                                  for k in keys)
        elif op == "remove":
            pair.call("remove", {"keys": keys[:4]})
        else:
            pair.clock.t += rng.choice([0.0, 0.5, 3.0])


@pytest.mark.parametrize("seed", range(12))
def test_the_batch_steps_answer_and_change_as_the_single_steps(seed):
    pair = Pair(random.Random(seed))
    run(pair, 150)
    counters = pair.cores[0].counters
    assert counters["puts_published"] and counters["reads"] and counters["lease_grants"] \
        and counters["misses"] and counters["storage_refusals"]


def test_the_comparison_sees_a_batch_step_that_differs(monkeypatch):
    """A batched put_end that forgets to count its publishes is told apart."""
    from kvproto.runtime.master_requests import MasterRequests
    plain = MasterRequests._put_end_batch

    def uncounted(self, given):
        before = self.counters["puts_published"]
        items = plain(self, given)
        self.counters["puts_published"] = before
        return items

    monkeypatch.setattr(MasterRequests, "_put_end_batch", uncounted)
    with pytest.raises(AssertionError):
        for seed in range(12):
            run(Pair(random.Random(seed)), 150)


def test_a_remove_of_no_keys_changes_the_lease_table_in_neither():
    """A leased read's lease has run out by the time a remove names no key:
    one key at a time, no key means no tick of the lease clock, and the
    batch path must not tick it either (the lease stays until a later step)."""
    pair = Pair(random.Random(0))
    pair.call("put_start", {"client": "c1", "replicas": 1, "items": [[KEYS[0], 4096]]})
    token = pair.cores[0].directory.objects[KEYS[0]].token
    pair.call("put_end", {"client": "c1", "items": [[KEYS[0], token]]})
    pair.call("read_begin", {"client": "r1", "keys": [KEYS[0]], "lease": True})
    pair.clock.t += 3.0
    pair.call("remove", {"keys": []})


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("leased", [True, False])
def test_a_read_answered_as_columns_stands_for_the_same_items(batched, leased):
    """The same read_begin to two masters in the same state, one asking for
    columns: the columns pass the client's check and give the other's items,
    and both masters end in the same state."""
    clock, cores = Clock(), []
    for _ in range(2):
        core = new_master(clock, batched)
        for replicas, keys in ((1, KEYS[:4]), (2, KEYS[4:8])):
            core.handle("put_start", {"client": "w", "replicas": replicas,
                                      "items": [[k, 4096 + i] for i, k in enumerate(keys)]})
            deliver(core, random.Random(0))
            tokens = list(core.sessions["w"].tokens)
            core.handle("put_end", {"client": "w", "items": [[k, t, 7 * t] for k, t in
                                                             zip(keys, tokens)]})
            deliver(core, random.Random(0))
        cores.append(core)
    keys = [KEYS[0], b"absent", KEYS[5], KEYS[3], KEYS[5], KEYS[9]]
    body = {"client": "r", "keys": keys, "lease": leased}
    _, items = cores[0].handle("read_begin", dict(body))
    _, columns = cores[1].handle("read_begin", {**body, "columns": True})
    assert "items" not in columns and "columns" not in items
    given = columns.pop("columns")
    assert wire.read_items(wire.read_columns(wire.Reply(0, 1, {"columns": given}, []), len(keys))) \
        == items.pop("items")
    assert given["errors"] == [[1, errors.KeyNotFound.code, "b'absent'"],
                               [5, errors.KeyNotFound.code, repr(KEYS[9])]]
    assert given["replicas"] == [1, 0, 2, 1, 2, 0] and given["token"][1] == 0
    assert ("lease" in given) == leased
    assert columns == items and state(cores[0]) == state(cores[1])


@pytest.mark.parametrize("columns", [True, False])
def test_a_lease_the_table_refuses_is_answered_typed_and_its_id_left_unused(monkeypatch, columns):
    """The directory and the lease table disagree (a bug the tables' agreement
    rules out): the read is refused with the lease table's error, the other
    reads keep the ids they would have had."""
    from kvproto.cores.leases import LeaseCore
    core = new_master(Clock(), True)
    core.handle("put_start", {"client": "w", "replicas": 1, "items": [[k, 10] for k in KEYS[:3]]})
    deliver(core, random.Random(1))
    tokens = list(core.sessions["w"].tokens)
    core.handle("put_end", {"client": "w", "items": [[k, t] for k, t in zip(KEYS[:3], tokens)]})
    deliver(core, random.Random(1))
    plain = LeaseCore.grant_many

    def refusing(self, items):
        got = plain(self, items)
        return [errors.LeaseHeld("refused by the test") if n == 1 else g
                for n, g in enumerate(got)]

    monkeypatch.setattr(LeaseCore, "grant_many", refusing)
    first = core._next_lease
    _, body = core.handle("read_begin", {"client": "r", "keys": [KEYS[0], b"absent", *KEYS[1:3]],
                                         "lease": True, "columns": columns})
    items = wire.read_items(body["columns"]) if columns else body["items"]
    assert [item[0] for item in items] == [0, errors.KeyNotFound.code, errors.LeaseHeld.code, 0]
    assert [items[0][1]["lease"], items[3][1]["lease"]] == [first, first + 2]
    assert core.counters["lease_grants"] == 2


COMMANDS = ("assign", "publish", "free")


def test_a_node_that_takes_columns_gets_the_rows_others_get():
    """The same puts (a direct writer's among them), acknowledged alike: the
    assigns and publishes a master sends nodes registered with ``columns``
    carry, column by column, the rows it sends nodes registered without."""
    rng = random.Random(3)
    cores = [new_master(Clock(), True, columns) for columns in ((), SEGMENTS)]
    sent = [[], []]
    for step in range(30):
        keys = KEYS[step * 2:step * 2 + 2]
        body = {"client": "w", "replicas": 2, "items": [[k, 4096] for k in keys],
                **({"writer": "w0", "host": "host-0"} if step % 2 else {})}
        seed = rng.random()
        for core, out in zip(cores, sent):
            reply = core.handle("put_start", dict(body), reply_to="r", request_id=1)
            tokens = [item[1]["token"] for item in reply[1]["items"]]
            core.handle("put_end", {"client": "w", "items": [[k, t, 7] for k, t in zip(keys, tokens)]},
                        reply_to="r", request_id=2)
            out += [(seg, op, rows_of(op, b), "columns" in b)
                    for seg, op, _, b in deliver(core, random.Random(seed)) if op in COMMANDS]
    assert [c[:3] for c in sent[0]] == [c[:3] for c in sent[1]]
    assert not any(c[3] for c in sent[0])
    assert all(c[3] for c in sent[1] if c[1] in ("assign", "publish")) and sent[1]


@pytest.mark.parametrize("accepted", [2, 0, True, "1"])
def test_a_tally_that_is_not_the_count_of_the_regions_is_a_bad_reply(accepted):
    """A node asked with ``tally`` answers ``{"accepted": n}`` for all n
    regions accepted; any other count or type refuses every region (the
    assign's attempt is revoked, its put_end is StaleToken)."""
    core = new_master(Clock(), True, SEGMENTS)
    reply = core.handle("put_start", {"client": "c", "replicas": 1, "items": [[b"k", 10]]})
    token = reply[1]["items"][0][1]["token"]
    segment, op, cmd_id, body = core.outbox.pop()
    assert op == "assign" and body["tally"]
    core.storage_reply(segment, wire.Reply(0, cmd_id, {"accepted": accepted}, []))
    assert core.counters["storage_refusals"] == 1
    ended = core.handle("put_end", {"client": "c", "items": [[b"k", token]]})
    assert ended[1]["items"][0][0] == errors.StaleToken.code
