"""Runtime mutants: named faults in the runtime glue, each of which a named
set of tests must catch (``kvproto mutate``, docs/assurance.md "Mutants").

A :class:`Mutant` is a source patch (one or more :class:`Edit`\\ s: a file, an
exact snippet of it, its replacement) and the pytest node ids that must fail
once it is applied. :func:`run` copies the source tree (``kvproto/``,
``tests/``, ``spec/``, ``pyproject.toml``) to a temporary directory, applies
one mutant there (never to the working tree), and runs its tests with
``PYTHONPATH`` pointing at the copy (so the processes the tests spawn run the
mutant too): the mutant is *killed* when pytest reports a failed test, and
*survives* when its tests pass. Before the mutants, the same tests run on an
unmutated copy and must pass (a kill by a test that fails anyway proves
nothing).

Each snippet must occur exactly once in the current source
(:func:`problems`), so that a refactor cannot silently disable a mutant: the
test that checks this names the mutant to re-anchor.

The mutants mirror the weakened TLA+ models where the runtime has a twin of
the guarded rule (``twin``), and the glue the specs do not reach: the
same-host read's seqlock, the reader's acceptance check, eviction order,
token floors across terms, and the client's retries.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

#: what is copied for a mutant's run (relative to the source tree's root)
COPIED = ("kvproto", "tests", "spec", "pyproject.toml")


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of ``original`` in ``path`` by ``replacement``."""

    path: str
    original: str
    replacement: str


@dataclass(frozen=True)
class Mutant:
    """A named fault: its edits, what it breaks, and the tests that must fail."""

    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    #: the weakened model (spec/*.cfg) whose guard this mutant removes, if any
    twin: str = ""


def _one(path: str, original: str, replacement: str) -> tuple[Edit, ...]:
    return (Edit(path, original, replacement),)


SHM = "kvproto/runtime/shm.py"
CLIENT = "kvproto/runtime/client.py"
LINK = "kvproto/runtime/client_link.py"
CLIENT_LEASES = "kvproto/runtime/client_leases.py"
CLIENT_PUTS = "kvproto/runtime/client_puts.py"
MASTER = "kvproto/runtime/master.py"
REQUESTS = "kvproto/runtime/master_requests.py"
TAKEOVER = "kvproto/runtime/master_takeover.py"
STORAGE = "kvproto/runtime/storage.py"
STORAGE_SERVER = "kvproto/runtime/storage_server.py"
LEASE_CORE = "kvproto/cores/leases.py"
TENANCY_CORE = "kvproto/cores/tenancy.py"
LEASES = "tests/runtime/test_leases.py"
SAME_HOST = "tests/runtime/test_same_host_reads.py"
FAILOVER = "tests/runtime/test_failover_cores.py"
TENANCY = "tests/runtime/test_tenancy_runtime.py"
TENANCY_DIFF = "tests/cores/test_tenancy_core.py"
REPAIR = "tests/runtime/test_repair_runtime.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "same-host-read-no-recheck",
        "a same-host read keeps its copy without checking the generation word "
        "and nonce again after the copy",
        _one(SHM, "        return words[idx] == want and words[1] == nonce\n",
             "        return True\n"),
        (f"{SAME_HOST}::test_a_region_rewritten_during_the_copy_is_not_kept",
         f"{SAME_HOST}::test_a_same_host_read_torn_by_a_rewrite_falls_back_to_the_network")),
    Mutant(
        "same-host-read-ignores-nonce",
        "a same-host read trusts a descriptor whose segment started over "
        "(a new nonce: the same token may name other bytes)",
        (Edit(SHM, "        if words[1] != nonce or words[idx] != want:\n",
              "        if words[idx] != want:\n"),
         Edit(SHM, "        return words[idx] == want and words[1] == nonce\n",
              "        return words[idx] == want\n")),
        (f"{SAME_HOST}::test_a_descriptor_of_a_segment_that_started_over_is_not_read",)),
    Mutant(
        "same-host-batch-read-no-recheck",
        "a plain get's batch read, in its array passes, keeps each copy without "
        "checking the region's generation word again after it",
        _one(SHM, "            out = [buf if ok else None for buf, ok in zip(out, (gens[at] == done).tolist())]\n",
             ""),
        (f"{SAME_HOST}::test_a_batch_read_keeps_only_regions_complete_before_and_after",)),
    Mutant(
        "same-host-batch-read-each-no-recheck",
        "a plain get's batch read of a few regions, region by region, keeps each "
        "copy without checking the region's generation word again after it",
        _one(SHM, "                out.append(buf if words[at] == done else None)\n",
             "                out.append(buf)\n"),
        (f"{SAME_HOST}::test_a_batch_read_keeps_only_regions_complete_before_and_after",)),
    Mutant(
        "same-host-batch-read-no-nonce-recheck",
        "a plain get's batch read keeps its copies without checking the nonce "
        "again after the last",
        _one(SHM, "        if words[1] != nonce:\n            return [None] * n\n", ""),
        (f"{SAME_HOST}::test_a_batch_read_keeps_only_regions_complete_before_and_after",)),
    Mutant(
        "same-host-batch-read-ignores-nonce",
        "a plain get's batch read trusts a descriptor whose segment started over",
        (Edit(SHM, "        if words is None or words[1] != nonce:\n",
              "        if words is None:\n"),
         Edit(SHM, "        if words[1] != nonce:\n            return [None] * n\n",
              "")),
        (f"{SAME_HOST}::test_a_batch_read_keeps_only_regions_complete_before_and_after",)),
    Mutant(
        "lease-deadline-from-reply",
        "the client times a lease from the read_begin reply instead of from "
        "when it sent the request",
        _one(CLIENT,
             "            sent = time.monotonic()            # the lease deadline runs from here\n"
             "            reply = self._lookup(\"read_begin\", self._read_body(ks), len(ks), deadline)\n",
             "            reply = self._lookup(\"read_begin\", self._read_body(ks), len(ks), deadline)\n"
             "            sent = time.monotonic()\n"),
        (f"{LEASES}::test_a_lease_is_timed_from_the_request_not_the_reply",),
        twin="Lease_Weak_DeadlineFromReply"),
    Mutant(
        "lease-deadline-from-reply-in-flight",
        "lookups in flight together (get_many over several requests) are timed "
        "from their replies instead of from when each request was sent",
        _one(LINK,
             "                yield reply, sent\n",
             "                yield reply, time.monotonic()\n"),
        (f"{LEASES}::test_lookups_in_flight_are_timed_from_their_requests",),
        twin="Lease_Weak_DeadlineFromReply"),
    Mutant(
        "accept-ignores-skew",
        "the reader's acceptance check ignores clock skew (accepts a transfer "
        "that completed within the TTL on its own clock)",
        _one(CLIENT_LEASES, "        judged = {done: lm.accept_transfer(sent, done, ttl, self.max_skew)\n",
             "        judged = {done: lm.accept_transfer(sent, done, ttl, 0.0)\n"),
        (f"{LEASES}::test_a_transfer_within_the_ttl_but_not_within_the_skew_margin_is_rejected",),
        twin="Lease_Weak_IgnoreSkew"),
    Mutant(
        "accept-everything",
        "the reader keeps the bytes of every leased transfer, however late",
        _one(CLIENT_LEASES, "        judged = {done: lm.accept_transfer(sent, done, ttl, self.max_skew)\n",
             "        judged = {done: True\n"),
        (f"{LEASES}::test_a_read_slower_than_its_lease_is_rejected_and_classified",)),
    Mutant(
        "node-write-older-token-to-owner",
        "a storage node takes a batched write of a region's length under a "
        "token older than the region's owner (an attempt that has moved on) "
        "as the owner's write: the late bytes land in the next attempt's region",
        _one(STORAGE, "                self._write_region(offset, token, payload)\n",
             "                region = self.node.region(offset)\n"
             "                if region is not None and token < region.token \\\n"
             "                        and len(payload) == region.length:\n"
             "                    token = region.token\n"
             "                self._write_region(offset, token, payload)\n"),
        ("tests/runtime/test_merged_trace.py::test_the_merged_run_is_a_behaviour_of_the_spec",),
        twin="Publish_Weak_NoStorageTokenCheck"),
    Mutant(
        "node-joins-without-term",
        "a storage node registers with a master without learning its term "
        "(no fence): it serves that master with a fence it never raised, and "
        "would take an older master's requests until one of this term arrives",
        _one(STORAGE_SERVER, "                    reply.status == 0 and not (type(term) is int and "
                             "self.core.fence_to(term))):\n",
             "                    reply.status == 0 and not (type(term) is int)):\n"),
        ("tests/runtime/test_failover_trace.py::test_a_takeover_run_is_a_behaviour_of_the_spec",)),
    Mutant(
        "put-end-record-token",
        "the master ends a put with the token its record holds now, not the "
        "token the writer named",
        (Edit(REQUESTS, "            err, _ = self._step(event_type(key, token, *checksum))\n",
              "            rec = self.directory.objects.get(key) if event_type is PutEnd else None\n"
              "            err, _ = self._step(event_type(key, token if rec is None else rec.token,\n"
              "                                           *checksum))\n"),
         Edit(REQUESTS, "        ends = given if all(len(item) == 3 for item in given) else \\\n"
                        "            [(key, token, checksum[0] if checksum else 0) "
                        "for key, token, *checksum in given]\n",
              "        objects = self.directory.objects\n"
              "        ends = [(key, token if (rec := objects.get(key)) is None else rec.token,\n"
              "                 checksum[0] if checksum else 0) for key, token, *checksum in given]\n")),
        ("tests/runtime/test_embedded.py::test_a_revoked_writer_cannot_publish_the_next_attempt",)),
    Mutant(
        "new-master-restarts-tokens",
        "a new master starts its tokens above the objects it recovered only, "
        "not above every token the nodes ever carried (a freed token is issued again)",
        _one(TAKEOVER, "        next_token = max((rnd.infos[s][\"next_token\"] for s in live), default=1)\n",
             "        next_token = 1\n"),
        (f"{FAILOVER}::TestFailoverCores::runTest",
         f"{FAILOVER}::test_a_freed_token_is_never_issued_again_by_the_next_master")),
    Mutant(
        "new-master-forgets-leases",
        "a new master counts nothing it recovered as leased (no quiet period), "
        "so it removes or evicts an object a lease of the old master may still protect",
        _one(TAKEOVER, "                                        quiet=ttl * (1 + self.INHERIT_MARGIN_FRACTION)\n"
                     "                                        + self.INHERIT_MARGIN_S)\n",
             "                                        quiet=0)\n"),
        ("tests/runtime/test_master_failover.py::"
         "test_a_new_master_keeps_what_it_recovered_leased_for_one_lease_ttl",
         "tests/runtime/test_takeover_trace.py::"
         "test_a_new_masters_lease_trace_is_a_behaviour_of_the_spec"),
        twin="Lease_Weak_ForgetLeasesOnTakeover"),
    Mutant(
        "node-forgets-tokens-seen",
        "a storage node does not report the highest token it was assigned, "
        "so the next master's token floor misses freed tokens",
        (Edit(STORAGE, "            if token > self.tokens_seen:     # at once: a later refusal may raise\n"
                       "                self.tokens_seen = token\n"
                       "            assigned += 1\n",
              "            assigned += 1\n"),
         Edit(STORAGE, "        self.tokens_seen = max(self.tokens_seen, *tokens)\n", "")),
        (f"{FAILOVER}::test_a_freed_token_is_never_issued_again_by_the_next_master",
         f"{FAILOVER}::TestFailoverCores::runTest")),
    Mutant(
        "evict-most-recent-first",
        "eviction takes the most recently used objects first",
        _one(MASTER, "capacity, self.leases.eviction_candidates(), high_watermark",
             "capacity, reversed(list(self.leases.eviction_candidates())), high_watermark"),
        (f"{LEASES}::test_eviction_spares_leased_objects_and_takes_them_after_release",)),
    Mutant(
        "evict-ignores-leases",
        "eviction under memory pressure takes leased objects",
        (Edit(LEASE_CORE, "        mask &= np.frombuffer(self._held, np.uint32, len(flags)) == 0\n",
              "        pass\n"),
         Edit(MASTER, "            if self.leases.reclaimable(key) is not None:\n"
                      "                continue\n",
              "            pass\n")),
        (f"{LEASES}::test_eviction_spares_leased_objects_and_takes_them_after_release",
         "tests/test_traces.py::test_a_recorded_lease_run_is_a_behaviour_of_the_spec"),
        twin="Lease_Weak_EvictIgnoresLeases"),
    Mutant(
        "put-retry-not-abandoned",
        "a put whose put_start timed out does not abandon the attempt the "
        "master may have granted, so its retry is refused KeyExists",
        _one(CLIENT_PUTS, "            self._abandon([k for _, k, _ in todo])\n            raise\n",
             "            raise\n"),
        ("tests/runtime/test_processes.py::test_a_put_that_timed_out_does_not_block_its_retry",)),
    Mutant(
        "put-ahead-not-abandoned",
        "a put_start sent ahead of its chunk (window) and left unanswered is "
        "asked again without abandoning the attempts the master may have "
        "granted, so the keys are refused KeyExists",
        _one(CLIENT_PUTS, "            if unanswered:\n"
                     "                self._abandon([k for _, k, _ in todo])\n",
             "            if unanswered:\n"
             "                pass\n"),
        ("tests/runtime/test_requests_in_flight.py::"
         "test_a_put_start_sent_ahead_and_left_unanswered_is_abandoned_and_asked_again",)),
    Mutant(
        "put-end-ahead-lost-counted-stored",
        "a chunk's put_end answered while the next chunk is written (window) "
        "that no master answers leaves its keys counted as stored and their "
        "attempts unrevoked",
        _one(CLIENT_PUTS, "            for i in ok:\n"
                     "                results[i] = err\n"
                     "            self._revoke([(item[0], item[1]) for item in body[\"items\"]])\n",
             "            pass\n"),
        ("tests/runtime/test_requests_in_flight.py::"
         "test_a_put_end_sent_ahead_that_goes_unanswered_fails_its_keys_and_revokes_them",)),
    Mutant(
        "get-no-relookup-on-stale-term",
        "a get whose descriptor a node refuses as StaleTerm (a new master took "
        "over) misses instead of looking the key up again at the new master",
        _one(CLIENT, "                    verify=verify) if relookup else [None] * len(stale)\n",
             "                    verify=verify) if False else [None] * len(stale)\n"),
        ("tests/runtime/test_embedded.py::test_a_get_with_a_stale_descriptor_looks_up_again",)),
    Mutant(
        "node-skips-read-ticket",
        "a storage node with tenants serves any authenticated tenant's read or "
        "load of a location whose token it is sent, without its read ticket",
        _one(STORAGE_SERVER, "                if req.op in self.TICKET_OPS:   # spec NodeAdmits, before anything runs\n",
             "                if False:\n"),
        (f"{TENANCY}::test_a_tenant_guessing_a_region_token_reads_nothing",),
        twin="Tenancy_Weak_FastPathSkipsGrant"),
    Mutant(
        "repair-listed-before-copy",
        "the master lists a repaired replica when it starts the repair, before "
        "its copier reported the copy complete",
        _one(MASTER, "            sched.started(started.repair, key, dst[0].segment, source, record.length, now)\n",
             "            sched.started(started.repair, key, dst[0].segment, source, record.length, now)\n"
             "            self._step(ListReplica(key, dst[0].segment, started.repair))\n"),
        (f"{REPAIR}::test_a_traced_run_with_repairs_is_a_behaviour_of_the_spec",),
        twin="Publish_Weak_ListBeforeCopy"),
    Mutant(
        "repair-stamps-own-term",
        "a repaired replica's publish mark carries the repairing master's term, "
        "not its object's publishing term, so the next takeover leaves the "
        "original out (its region leaks)",
        _one(MASTER, "            self.publish_terms.of(e.token)]))\n",
             "            self.failover.term]))\n"),
        (f"{FAILOVER}::test_a_repaired_replica_and_its_original_are_both_listed_after_the_next_takeover",),
        twin="Failover_Weak_RepairStampsOwnTerm"),
    Mutant(
        "route-back-keeps-writes",
        "a route back leaves the held namespace's writes in progress pending, "
        "so they still publish into a namespace that takes no writes",
        _one(REQUESTS, "                    self._step(PutRevoke(key, record.token))\n",
             "                    pass\n"),
        (f"{TENANCY}::test_an_upgrade_canary_prewarm_switch_route_back_and_drop",)),
    Mutant(
        "tenancy-renew-ignores-revoke",
        "the master's tenancy core renews a read whose tenant's grant on the "
        "namespace was revoked",
        _one(TENANCY_CORE,
             "        if not self.may_read(read.tenant, read.ns):\n"
             "            return errors.AccessDenied(\n"
             "                f\"tenant {read.tenant!r}'s grant on namespace {read.ns!r} was revoked\")\n",
             ""),
        (f"{TENANCY}::test_a_grant_then_its_revocation", f"{TENANCY_DIFF}::TestTenancy"),
        twin="Tenancy_Weak_RenewIgnoresRevoke"),
    Mutant(
        "tenancy-lost-keeps-reads",
        "the tenancy core's bulk drop of a lost segment's objects frees a read "
        "object without ending its reads (their bytes stay in flight, the reads "
        "name an object that is gone)",
        _one(TENANCY_CORE, "            if fast and size > 0 and not (readers and o in readers):\n",
             "            if fast and size > 0:\n"),
        ("tests/runtime/test_master_segment_loss.py::test_a_lost_segment_leaves_in_bulk_as_one_by_one",
         f"{TENANCY_DIFF}::TestTenancy")),
)


def by_name() -> dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}


def source_root() -> Optional[Path]:
    """The source tree kvproto was imported from, if it has its tests beside it."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "tests").is_dir() and (root / "kvproto").is_dir() else None


def problems(root: Path, mutants: tuple[Mutant, ...] = MUTANTS) -> list[str]:
    """Why a mutant cannot be applied as written: a snippet missing or found
    more than once, a test file that does not exist. Empty when all apply."""
    out = []
    for m in mutants:
        for e in m.edits:
            path = root / e.path
            if not path.is_file():
                out.append(f"{m.name}: {e.path} does not exist")
                continue
            n = path.read_text().count(e.original)
            if n != 1:
                first = e.original.strip().splitlines()[0]
                out.append(f"{m.name}: {e.path} has {n} copies of {first!r} (needs exactly 1)")
        for test in m.tests:
            file, _, name = test.partition("::")
            path = root / file
            if not path.is_file():
                out.append(f"{m.name}: test file {file} does not exist")
            elif not re.search(rf"^\s*(def|class) {re.escape(name.split('::')[0])}\b"
                               rf"|^{re.escape(name.split('::')[0])} = ", path.read_text(), re.M):
                out.append(f"{m.name}: {test} is not defined")
    return out


def copy_tree(root: Path, into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "states", ".hypothesis")
    for name in COPIED:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, into / name)


def apply(mutant: Mutant, tree: Path) -> None:
    """Apply ``mutant``'s edits to the copy at ``tree``."""
    for e in mutant.edits:
        path = tree / e.path
        text = path.read_text()
        if text.count(e.original) != 1:
            raise ValueError(f"{mutant.name}: the snippet does not occur exactly once in {e.path}")
        path.write_text(text.replace(e.original, e.replacement))


@dataclass
class Result:
    name: str
    status: str                 # killed, survived, timeout, error
    seconds: float
    by: list[str] = field(default_factory=list)   # the failed tests
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.status == "killed"

    def line(self) -> str:
        how = f"by {', '.join(self.by)}" if self.by else self.detail
        if self.by and self.detail:
            how += f" ({self.detail})"
        return f"{self.status:<8} {self.name:<30} {self.seconds:6.1f}s  {how}".rstrip()


def _pytest(tree: Path, tests: list[str], timeout: float) -> tuple[Optional[int], str]:
    # the "mutate" Hypothesis profile (tests/conftest.py) reports a failure unshrunk
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1",
               HYPOTHESIS_PROFILE="mutate")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider",
           "-p", "no:randomly", *tests]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def _failed(output: str) -> list[str]:
    return re.findall(r"^FAILED (\S+)", output, re.M)


def _first_error(output: str, limit: int = 100) -> str:
    """The first ``E`` line of pytest's report: what the failed test saw."""
    found = re.search(r"^E\s+(.+)$", output, re.M)
    if not found:
        return ""
    text = " ".join(found.group(1).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _last_line(output: str) -> str:
    lines = [l for l in output.strip().splitlines() if l.strip()]
    return lines[-1].strip("= ") if lines else "no output"


def run_one(mutant: Optional[Mutant], root: Path, tests: list[str], timeout: float) -> Result:
    """Run ``tests`` on a copy of ``root`` with ``mutant`` applied (None: unmutated)."""
    name = mutant.name if mutant is not None else "baseline"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvproto-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(root, tree)
        if mutant is not None:
            apply(mutant, tree)
        rc, output = _pytest(tree, tests, timeout)
    seconds = time.monotonic() - started
    if rc is None:
        return Result(name, "timeout", seconds, detail=f"its tests ran past {timeout:.0f}s")
    if rc == 0:
        return Result(name, "survived" if mutant else "passed", seconds, detail=_last_line(output))
    failed = _failed(output)
    if rc == 1 and failed:
        return Result(name, "killed" if mutant else "failed", seconds, by=failed,
                      detail=_first_error(output))
    return Result(name, "error", seconds, detail=f"pytest exit {rc}: {_last_line(output)}")


def run(mutants: tuple[Mutant, ...], root: Path, timeout: float = 300.0, baseline: bool = True,
        report: Callable[[str], None] = print) -> list[Result]:
    """Each mutant's tests on its own mutated copy; first (``baseline``) all of
    them on an unmutated copy, which must pass. Returns the mutants' results
    (empty when the baseline failed)."""
    if baseline:
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        base = run_one(None, root, tests, timeout)
        report(f"baseline: {len(tests)} test(s) on the unmutated tree {base.status} "
               f"in {base.seconds:.1f}s" + ("" if base.status == "passed" else f": {base.line()}"))
        if base.status != "passed":
            return []
    results = []
    for m in mutants:
        r = run_one(m, root, list(m.tests), timeout)
        report(r.line())
        results.append(r)
    return results


def score(results: list[Result]) -> str:
    killed = sum(r.killed for r in results)
    total = len(results)
    pct = 100.0 * killed / total if total else 0.0
    return f"score: {killed}/{total} mutants killed ({pct:.0f}%)"


# ---------------------------------------------------------------- command line

def add_arguments(parser) -> None:
    from kvproto.cli import _seconds
    parser.description = (
        "Apply named faults to the runtime one at a time, each on a temporary copy of the "
        "source tree (never the working tree), and run the tests that must catch it. "
        "Prints one line per mutant (killed or survived, by which test, seconds) and the "
        "score; exits 1 if any mutant survived. Needs a source checkout (kvproto/ with "
        "tests/ beside it).")
    parser.add_argument("--only", action="append", metavar="NAME", default=None,
                        help="run this mutant only (repeatable; see --list; default: all of them)")
    parser.add_argument("--list", action="store_true",
                        help="list the mutants and the tests that must kill each, then exit")
    parser.add_argument("--timeout", type=_seconds, default=300.0,
                        help="seconds each mutant's tests may run")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the tests on the unmutated tree")


def main(args) -> int:
    known = by_name()
    chosen = MUTANTS
    if args.only:
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"kvproto mutate: no mutant named {unknown[0]!r} (known: {', '.join(known)})",
                  file=sys.stderr)
            return 2
        chosen = tuple(known[n] for n in dict.fromkeys(args.only))
    if args.list:
        for m in chosen:
            twin = f" (twin of {m.twin})" if m.twin else ""
            print(f"{m.name}: {m.what}{twin}")
            for e in m.edits:
                print(f"    edits {e.path}")
            for t in m.tests:
                print(f"    killed by {t}")
        return 0
    root = source_root()
    if root is None:
        print("kvproto mutate: needs a source checkout (kvproto/ with tests/ beside it)",
              file=sys.stderr)
        return 2
    broken = problems(root, chosen)
    if broken:
        for line in broken:
            print(f"kvproto mutate: {line}", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(f"kvproto mutate: {len(chosen)} mutant(s) of {root}", flush=True)
    results = run(chosen, root, timeout=args.timeout, baseline=not args.no_baseline,
                  report=lambda line: print(line, flush=True))
    if not results:
        print("kvproto mutate: the tests fail on the unmutated tree; no mutant was run")
        return 1
    print(f"{score(results)} in {time.monotonic() - started:.0f}s")
    return 0 if all(r.killed for r in results) else 1
