"""Long runs checked whole, window by window (:mod:`kvproto.checking.windows`).

A publish run and a lease run of some 1,500 steps each, recorded as the
master records them, are checked in windows chained state to state: every
step is checked, those past step 1,000 too. One step changed by hand past
step 1,100 (the first 1,000 steps, all a check of one TLC run used to walk,
are those of the run that passes whole) is rejected with its number, in
whichever window it falls, every step before it passing; a window whose end
is not where the next one starts fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvproto.checking import failtrace, leasetrace, traces
from kvproto.checking.tla import Fn, ModelValue
from kvproto.cores import leases as lease_core
from kvproto.cores.directory import DirectoryCore
from kvproto.runtime import tracing
from kvproto.statemachines import lease as lm
from kvproto.statemachines import publish as pm

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
pytestmark = [pytest.mark.tlc]

KEYS = 12


def _r(segment: str, offset: int, length: int = 100) -> pm.Replica:
    return pm.Replica(segment, offset, length)


def long_run(path: Path, rounds: int = 26) -> Path:
    """A master's run of ``rounds`` rounds on three segments, each: a put of
    every key (one revoked and put again, one left pending past the round's
    end), a read of each, a stale ``PutEnd`` refused, and each published key
    removed; s3 lost in the last round. About 60 steps a round."""
    core = DirectoryCore.restored({"s1": 1 << 20, "s2": 1 << 20, "s3": 1 << 20}, [], 1)
    recorder = tracing.Recorder(str(path))
    recorder.opened(core, 1)

    def step(event):
        effects = core.step(event)
        recorder.publish(event, effects, core)
        return effects

    def put(key: bytes, slot: int) -> int:
        segments = ("s1", "s2") if slot % 2 else ("s2", "s3")
        (granted, *_) = step(pm.PutStart(key, 100, tuple(_r(s, slot * 4096) for s in segments)))
        return granted.token

    pending = None
    for r in range(rounds):
        for j in range(KEYS):
            key = f"k{j}".encode()
            if pending is not None and pending[0] == key:
                step(pm.PutEnd(key, pending[1]))       # the put left pending last round
                pending = None
                continue
            token = put(key, j)
            if j == 3:
                step(pm.PutRevoke(key, token))
                token = put(key, j)
            if j == 5 and r % 2 == 0:
                pending = (key, token)                 # ended next round
                continue
            step(pm.PutEnd(key, token))
            if j == 7:
                step(pm.PutEnd(key, token))            # again: refused, it is published
        if r == rounds - 1:
            step(pm.SegmentLost("s3"))      # the objects on s2 and s3 keep their s2 replica
        for j in range(KEYS):
            key = f"k{j}".encode()
            if pending is not None and pending[0] == key:
                continue
            step(pm.ReadBegin(key))
            step(pm.ReadEnd(key, core.objects[key].token))
            step(pm.Remove(key))
    recorder.close()
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    return long_run(tmp_path_factory.mktemp("windows") / "long.trace")


def run_of(path: Path):
    return traces.publish_run(traces.read(path)["publish"])


def test_the_run_is_longer_than_one_window(recorded):
    header, steps = run_of(recorded)
    assert len(steps) > 1400
    kinds = {s["event"]["type"] for _, s in steps[1000:]}
    assert kinds >= {"PutStart", "PutEnd", "PutRevoke", "ReadBegin", "Remove", "SegmentLost"}


def test_a_boundary_is_the_directory_the_steps_left():
    """The state after some steps as a header: the objects, the lost segment
    dropped from the objects that kept other replicas (their records are not
    in its step), the busy writers of pending puts."""
    header = {"next_token": 1, "objects": 0, "segments": {"s1": 1, "s2": 1}, "directory": {}}
    rec = {"status": "pending", "token": 1, "replicas": [{"segment": "s1", "offset": 0},
                                                         {"segment": "s2", "offset": 0}],
           "requested": 2, "repairs": [], "reads": 0}
    grant = {"type": "PutGranted", "key": "a", "token": 1, "replicas": rec["replicas"]}
    steps = [(2, {"n": 1, "event": {"type": "PutStart", "key": "a"}, "effects": [grant],
                  "after": {"next_token": 2, "objects": {"a": rec}}})]
    at = traces.boundary(header, steps)
    assert at["next_token"] == 2 and at["directory"] == {"a": rec}
    assert at["writers"] == [{"key": "a", "token": 1, "replicas": rec["replicas"]}]
    published = {**rec, "status": "published"}
    steps += [(3, {"n": 2, "event": {"type": "PutEnd", "key": "a", "token": 1},
                   "effects": [{"type": "Published", "key": "a", "token": 1}],
                   "after": {"next_token": 2, "objects": {"a": published}}}),
              (4, {"n": 3, "event": {"type": "SegmentLost", "segment": "s2"}, "effects": [],
                   "after": {"next_token": 2, "objects": {}}})]
    at = traces.boundary(header, steps)
    assert at["writers"] == [] and at["lost"] == ["s2"]
    assert at["directory"]["a"]["replicas"] == [{"segment": "s1", "offset": 0}]
    assert header["directory"] == {}                    # the header is left as it was


def test_a_run_not_one_step_of_which_fits_cannot_be_checked():
    """A directory past the bounds (40 objects) from its first step: an error,
    as a run too large for one TLC run was before windows."""
    directory = {f"k{i}": {"status": "published", "token": i + 1, "requested": 1,
                           "replicas": [{"segment": "s1", "offset": i}], "repairs": [],
                           "reads": 0} for i in range(40)}
    header = {"next_token": 41, "objects": 40, "segments": {"s1": 1}, "directory": directory}
    steps = [(2, {"n": 1, "event": {"type": "Remove", "key": "k0"},
                  "effects": [{"type": "Removed", "key": "k0", "token": 1}],
                  "after": {"next_token": 41, "objects": {"k0": None}}})]
    with pytest.raises(traces.TraceError, match="the run has 40 keys; at most 32"):
        traces.check_windows(header, steps)


@needs_java
def test_a_long_run_is_checked_whole_in_windows(recorded, tmp_path):
    header, steps = run_of(recorded)
    size = 790        # two windows, the first ending with a put left pending
    assert traces.boundary(header, steps[:size])["writers"]
    verdict = traces.check_windows(header, steps, size=size, keep=tmp_path)
    assert verdict.ok, verdict.message
    assert verdict.steps == len(steps)
    windows_run = -(-len(steps) // size)
    assert f"all {len(steps)} steps are steps of spec/Publish.tla in {windows_run} windows" \
        in verdict.message
    # each window after the first starts where the one before it ended,
    # writers busy with the puts left pending there
    second = (tmp_path / "window-2" / "PublishTrace.tla").read_text()
    assert "WindowEnd" in (tmp_path / "window-1" / "PublishTrace.cfg").read_text()
    assert "WindowEnd" not in (tmp_path / f"window-{windows_run}" / "PublishTrace.cfg").read_text()
    assert "writers |->" in second


@needs_java
def test_a_window_cap_is_said(recorded):
    header, steps = run_of(recorded)
    verdict = traces.check_windows(header, steps, size=150, max_windows=1)
    assert verdict.ok and verdict.steps == 150 and verdict.windows == 1, verdict.message
    n = steps[150][1]["n"]
    assert f"step {n} and after are not checked: at most 1 window(s) of 150 steps" \
        in verdict.message


@needs_java
def test_a_window_that_ends_elsewhere_than_the_next_starts_fails(recorded, monkeypatch):
    """The chaining is checked: a start state for window 2 that is not where
    window 1 ended (a pending put's writer left out) fails window 1."""
    header, steps = run_of(recorded)
    real = traces.boundary
    size = next(k for k in range(100, 400) if real(header, steps[:k])["writers"])

    def forget_a_writer(start, part):
        at = real(start, part)
        return {**at, "writers": at["writers"][1:]}

    monkeypatch.setattr(traces, "boundary", forget_a_writer)
    verdict = traces.check_windows(header, steps[:2 * size], size=size)
    assert not verdict.ok
    assert verdict.message.startswith(f"window 1 (steps 1 to {size}) did not end in the state"), \
        verdict.message


def corrupt_after(path: Path, out: Path, after: int, kind: str, change) -> int:
    """``path`` to ``out`` with ``change`` applied to the first step of
    ``kind`` numbered above ``after`` for which it returns True; its number."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    n = None
    for row in rows:
        if n is None and row.get("n", 0) > after and row.get("event", {}).get("type") == kind \
                and change(row):
            n = row["n"]
    assert n is not None
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return n


def _publish_the_refused(row):
    if row["effects"][0]["type"] != "Refused":
        return False
    ev = row["event"]
    row["effects"] = [{"type": "Published", "key": ev["key"], "token": ev["token"]}]
    return True


def _keep_a_region(row):
    frees = [e for e in row["effects"] if e["type"] == "FreeRegion"]
    if not frees:
        return False
    row["effects"].remove(frees[0])
    return True


@needs_java
@pytest.mark.parametrize("kind, change", [
    ("PutEnd", _publish_the_refused),
    pytest.param("Remove", _keep_a_region, marks=pytest.mark.soak)])
def test_a_step_changed_past_step_1000_is_rejected_with_its_number(recorded, tmp_path,
                                                                   kind, change):
    bad = tmp_path / "bad.trace"
    n = corrupt_after(recorded, bad, 1100, kind, change)
    header, steps = run_of(bad)
    # rejected at that step: every step before it (the first 1,000 among
    # them) passed, in the windows before its own
    verdict = traces.check_windows(header, steps, size=400)
    assert not verdict.ok
    assert verdict.failed_step == n, verdict.message
    assert f"step {n} " in verdict.message
    assert (n - 1) // 400 >= 1 and f"(window {(n - 1) // 400 + 1}, from step " in verdict.message


# --- the lease table ---------------------------------------------------------------


def long_lease_run(path: Path, rounds: int = 130) -> Path:
    """A lease table's run (TTL 2 s) as the master records it, each round:
    the clock read, an object put, two reads of it (one renewed, one
    released after its lease expired), a miss, and the object of five rounds
    before removed, or evicted every third round. About 11 steps a round."""
    table = lease_core.new_table(2.0)
    recorder = tracing.Recorder(str(path))
    now = 0.0

    def step(event):
        return recorder.lease(table, event)

    def tick(dt: float) -> None:
        nonlocal now
        now += dt
        step(lm.Tick(now))

    for r in range(rounds):
        key = f"k{r % 40}"                          # put again 40 rounds on
        tick(0.25)
        step(lm.Put(key, (key, r + 1)))
        step(lm.Grant(("c", 2 * r), key))
        step(lm.Grant(("d", 2 * r + 1), key))
        tick(0.5)
        step(lm.Renew(("c", 2 * r)))
        step(lm.Release(("c", 2 * r)))
        tick(2.5)                                   # the other lease expired
        step(lm.Release(("d", 2 * r + 1)))          # refused: a release of an ended lease
        step(lm.Grant(("e", r), "gone"))            # a miss
        if r >= 5:
            old = f"k{(r - 5) % 40}"
            step(lm.Evict(old) if r % 3 == 0 else lm.Remove(old))
    recorder.close()
    return path


@pytest.fixture(scope="module")
def leased(tmp_path_factory) -> Path:
    return long_lease_run(tmp_path_factory.mktemp("windows") / "lease.trace")


def lease_run_of(path: Path):
    return leasetrace.lease_run(traces.read(path)["lease"])


def test_a_lease_window_ends_only_where_no_read_is_in_progress(leased):
    header, steps = lease_run_of(leased)
    assert len(steps) > 1400
    assert leasetrace.quiet_cut(header, steps[:5]) == 2       # then two reads in progress
    k = leasetrace.quiet_cut(header, steps[:10])
    assert k == 10 and steps[k - 1][1]["event"]["type"] == "Grant"    # after the miss
    at = leasetrace.boundary(header, steps[:k])
    assert at["cached"] == [["k0", ["k0", 1]]] and at["now"] == 3.25


@needs_java
def test_a_long_lease_run_is_checked_whole_in_windows(leased, tmp_path):
    header, steps = lease_run_of(leased)
    verdict = leasetrace.check_windows(header, steps, size=400, keep=tmp_path)
    assert verdict.ok, verdict.message
    assert verdict.steps == len(steps) and verdict.windows >= 4, verdict.message
    assert f"all {len(steps)} steps are steps of spec/Lease.tla in {verdict.windows} windows" \
        in verdict.message
    # windows end where no read is in progress: within a few steps of 400
    second = (tmp_path / "window-2" / "LeaseTrace.tla").read_text()
    assert "Cached == (key1 :> slot" in second
    assert "WindowEnd" in (tmp_path / "window-1" / "LeaseTrace.cfg").read_text()


def _release_the_expired(row):
    """A release of an expired lease recorded as accepted."""
    if row["effects"][0]["type"] != "Refused":
        return False
    row["effects"] = [{"type": "LeaseReleased", "holder": row["event"]["holder"],
                       "key": "k0"}]
    return True


@needs_java
def test_a_lease_step_changed_past_step_1000_is_rejected_with_its_number(leased, tmp_path):
    bad = tmp_path / "bad.trace"
    n = corrupt_after(leased, bad, 1100, "Release", _release_the_expired)
    header, steps = lease_run_of(bad)
    verdict = leasetrace.check_windows(header, steps, size=600)   # every step before it passes
    assert not verdict.ok and verdict.failed_step == n, verdict.message
    assert verdict.windows >= 2, verdict.message
    assert f"step {n} " in verdict.message and "(window " in verdict.message


# --- the failover check ------------------------------------------------------------


def long_failover_run(folder: Path, terms: int = 3, rounds: int = 4) -> tuple[list, list]:
    """Two storage nodes' files and their masters' file of a run of ``terms``
    takeovers, each: every node fenced, its older unpublished allocation
    purged and the objects of the term before removed, then ``rounds`` puts
    on each node (allocated, published, read, removed; the last kept across
    the next takeover, which recovers it) and an allocation left unpublished."""
    rows = {s: [{"machine": "storage", "opened": {"segment": s, "term": 0}}] for s in "ab"}
    held = {s: [] for s in rows}
    left = {s: [] for s in rows}
    masters, token = [], 0

    def step(s, ev, effects):
        rows[s].append({"machine": "storage", "n": len(rows[s]), "segment": s, "event": ev,
                        "effects": effects})

    def stamped(s, kind, key, t, **more):
        step(s, {"type": kind, "key": key, "term": t, **more},
             [{"type": "StorageAccepted", "key": key, "term": t}])

    for t in range(1, terms + 1):
        names = sorted({k for keys in held.values() for k in keys})
        masters.append({"machine": "publish", "opened": {
            "next_token": token + 1, "objects": len(names), "term": t,
            "recovered": [[k, [s for s in rows if k in held[s]]] for k in names]}})
        for s in rows:
            step(s, {"type": "Fence", "term": t}, [{"type": "FenceAck", "term": t}])
        for s in rows:
            if t > 1:
                step(s, {"type": "PurgeUnpublished", "below": t},
                     [{"type": "Purged", "keys": left[s], "freed": 100 * len(left[s])}])
            for key in held[s]:
                stamped(s, "StampedFree", key, t)
            held[s], left[s] = [], []
        for r in range(rounds):
            for s in rows:
                token += 1
                stamped(s, "StampedAllocate", f"x{r}", t, offset=0, length=100, token=token)
                stamped(s, "StampedPublish", f"x{r}", t)
                step(s, {"type": "ReadReplica", "segment": s, "offset": 0, "token": token},
                     [{"type": "Accepted", "segment": s, "offset": 0, "token": token}])
                if r == rounds - 1:
                    held[s].append(f"x{r}")
                else:
                    stamped(s, "StampedFree", f"x{r}", t)
        for s in rows:
            token += 1
            stamped(s, "StampedAllocate", f"left{t}", t, offset=4096, length=100, token=token)
            left[s].append(f"left{t}")
    folder.mkdir(parents=True, exist_ok=True)
    for s in rows:
        (folder / f"{s}.trace").write_text("".join(json.dumps(r) + "\n" for r in rows[s]))
    (folder / "masters.trace").write_text("".join(json.dumps(m) + "\n" for m in masters))
    return [folder / "a.trace", folder / "b.trace"], [folder / "masters.trace"]


@pytest.fixture(scope="module")
def takeovers(tmp_path_factory) -> tuple[list, list]:
    return long_failover_run(tmp_path_factory.mktemp("failover"))


#: merged steps per failover window in these tests: the run is three of them
FAILOVER_WINDOW = 50


def test_a_failover_run_is_longer_than_two_windows(takeovers):
    model = failtrace.FailoverModel(*_failover_model_args(*takeovers))
    assert 2 * FAILOVER_WINDOW < len(model.records) <= 3 * FAILOVER_WINDOW
    acts = {r["act"] for r in model.records[FAILOVER_WINDOW:]}
    assert acts >= {"Fence", "PurgeUnpublished", "Recover", "StampedAllocate", "StampedPublish",
                    "StampedFree", "Read"}


def _failover_model_args(nodes, masters):
    read, files = [], []
    for path in nodes:
        for segment in failtrace.read_node(path):
            read.append(segment)
            files.append(path)
    return read, files, [o for m in masters for o in failtrace.read_master(m)]


def test_a_failover_window_carries_what_a_later_step_or_invariant_reads():
    """Between windows a key stays in the model while anything of it can
    matter (a node's entry, a serving master's, a purge owed, an acknowledged
    publish on a live node); otherwise its ``told`` and a standby master's
    stale entry are set aside and come back when a later window names it."""
    k1, k2, k3 = (ModelValue(f"k{i}") for i in (1, 2, 3))
    m1, m2, n1, n2 = (ModelValue(v) for v in ("m1", "m2", "n1", "n2"))
    none = failtrace.NONE
    told = {k1: Fn.of({"what": "published", "node": n1}),
            k2: Fn.of({"what": "published", "node": n2}),
            k3: Fn.of({"what": "removed", "node": none})}
    entry = Fn.of({"nodes": frozenset({n2}), "pub": True})
    state = {"phase": Fn.of({m1: "standby", m2: "open"}), "live": frozenset({n1}),
             "idx": Fn.of({n1: Fn.of({k: none for k in told}), n2: Fn.of({k: none for k in told})}),
             "dir": Fn.of({m1: Fn.of({k1: none, k2: entry, k3: none}),
                           m2: Fn.of({k: none for k in told})}),
             "pending": Fn.of({n1: frozenset(), n2: frozenset()}), "desc": (),
             "told": Fn.of(told)}
    # k1: its publish was acknowledged on live n1; k2's on n2, lost; k3 removed
    assert [failtrace._empty(state, k) for k in (k1, k2, k3)] == [False, True, True]
    assert not failtrace._empty({**state, "pending": Fn.of({n1: frozenset({k3}),
                                                             n2: frozenset()})}, k3)
    aside = {k: failtrace._aside(state, k) for k in (k2, k3)}
    later = failtrace._on_keys(state, {k1}, aside)
    assert later["told"] == Fn.of({k1: told[k1]}) and later["dir"][m1] == Fn.of({k1: none})
    again = failtrace._on_keys(later, {k1, k2, k3}, aside)
    assert again["told"] == state["told"] and again["dir"] == state["dir"]
    assert again["idx"] == state["idx"]


@needs_java
def test_a_long_failover_run_is_checked_whole_in_windows(takeovers, tmp_path):
    nodes, masters = takeovers
    verdict = failtrace.check(nodes, masters, size=FAILOVER_WINDOW, keep=tmp_path)
    assert verdict.ok, verdict.message
    assert verdict.windows == 3 and "and 3 term(s) are steps of spec/Failover.tla in 3 windows" \
        in verdict.message, verdict.message
    # windows 2 and 3 start where the one before ended; the last prints no end
    for w in (2, 3):
        assert "INIT WindowInit" in (tmp_path / f"window-{w}" / "FailoverTrace.cfg").read_text()
    assert "WindowEnd" in (tmp_path / "window-2" / "FailoverTrace.cfg").read_text()
    assert "WindowEnd" not in (tmp_path / "window-3" / "FailoverTrace.cfg").read_text()
    assert "pending |-> (n1 :> {" in (tmp_path / "window-2" / "FailoverTrace.tla").read_text()


@needs_java
def test_a_failover_step_forged_past_the_first_window_is_rejected_with_its_place(
        takeovers, tmp_path):
    """Node b's purge at the first takeover (in window 2), recorded as
    dropping nothing: the allocation it keeps was made in window 1, and what
    the spec's Recover purged is carried to the next window, so the purge
    fails, named by its number in b's file and its place in the whole merged
    run; window 1 passes (alone too, capped at one window: and says so)."""
    nodes, masters = takeovers
    rows = [json.loads(line) for line in nodes[1].read_text().splitlines()]
    forged = next(r for r in rows if r.get("event", {}).get("type") == "PurgeUnpublished"
                  and r["event"]["below"] == 2)
    forged["effects"][0]["keys"] = []
    bad = tmp_path / "b.trace"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = failtrace.FailoverModel(*_failover_model_args([nodes[0], bad], masters))
    at = next(i for i, (path, n, _, _) in enumerate(model.origins, 1)
              if path == bad and n == forged["n"])
    assert FAILOVER_WINDOW < at <= 2 * FAILOVER_WINDOW
    first = failtrace.check([nodes[0], bad], masters, size=FAILOVER_WINDOW, max_windows=1)
    assert first.ok and first.steps == FAILOVER_WINDOW, first.message
    assert "the rest are not checked: at most 1 window(s) of 50 steps" in first.message
    verdict = failtrace.check([nodes[0], bad], masters, size=FAILOVER_WINDOW)
    assert not verdict.ok and verdict.failed_step == forged["n"], verdict.message
    assert verdict.message.startswith(f"b.trace step {forged['n']} "), verdict.message
    assert f"(merged step {at} of {len(model.records)}, window 2 of steps " \
        f"{FAILOVER_WINDOW + 1} to {2 * FAILOVER_WINDOW})" in verdict.message, verdict.message
    assert verdict.windows == 2


@needs_java
@pytest.mark.soak
def test_a_failover_run_past_the_old_cap_is_checked_whole(tmp_path):
    """A run of some 6,500 merged steps (one TLC run took at most 5,000) is
    checked whole in windows of the default 1,000."""
    nodes, masters = long_failover_run(tmp_path, terms=4, rounds=200)
    verdict = failtrace.check(nodes, masters)
    assert verdict.ok, verdict.message
    assert verdict.steps > 6000 and verdict.windows == -(-verdict.steps // 1000)
    assert f"in {verdict.windows} windows" in verdict.message
