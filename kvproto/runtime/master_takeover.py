"""A new master's takeover (``spec/Failover.tla``): it takes the term it won
(``ObtainTerm``), fences every storage node the coordinator lists
(``Fence``), rebuilds the directory from the fenced nodes' indexes
(``Recover``), has them purge what older terms left unpublished, and opens
(``Open``); and it steps down when a node knows a newer term
(``HigherTermSeen``). :class:`MasterTakeover` is a part of
:class:`~kvproto.runtime.master.MasterCore`, as the request handlers
(:class:`~kvproto.runtime.master_requests.MasterRequests`) are: it uses the
core's state and stepping.

Leases across a takeover (``spec/Lease.tla``, ``Takeover``): a new master
knows none of the old master's leases, so every object it recovers counts as
leased for one lease TTL plus a margin after it opens (``Remove`` and eviction
refuse it); lease ids carry the term, so a renewal of an older term's lease is
refused instead of extending another lease.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np

from kvproto import errors
from kvproto.cores.leases import LeaseCore
from kvproto.cores.recovery import IndexColumns, Rebuild
from kvproto.runtime import wire
from kvproto.runtime.allocator import Placer
from kvproto.runtime.master_records import Command, SegmentInfo
from kvproto.runtime.repairs import PublishTerms
from kvproto.statemachines import failover as fm
from kvproto.statemachines.publish import Replica

log = logging.getLogger("kvproto.master")


class FenceRound:
    """A new master's fence: the nodes the coordinator listed, their answers."""

    __slots__ = ("started", "deadline", "nodes", "infos", "rebuild", "failed")

    def __init__(self, nodes: dict, now: float, timeout: float) -> None:
        self.started = now
        self.deadline = now + timeout
        self.nodes = dict(nodes)                     # segment -> endpoint
        self.infos: dict[str, dict] = {}             # segment -> registration body
        self.rebuild = Rebuild()                     # the indexes, joined as they come
        self.failed: set[str] = set()

    def answered(self) -> bool:
        return len(self.infos) + len(self.failed) >= len(self.nodes)


class MasterTakeover:
    """The takeover of :class:`~kvproto.runtime.master.MasterCore`
    (``take_term`` to ``_recover``, and ``step_down``); see the module
    docstring."""

    def take_term(self, term: int, nodes: dict[str, str]) -> None:
        """Spec ``ObtainTerm`` (this master won ``term``), then ``Fence``: send
        ``fence`` to every storage node the coordinator lists (``segment ->
        endpoint``). Each answers with its index; recovery follows when all
        answered or ``fence_timeout`` passed (:meth:`_maybe_recover`). Without
        a coordinator a master takes term 1 with no nodes and opens at once."""
        new, effects = fm.master_step(self.failover, fm.ObtainTerm(term))
        if effects and isinstance(effects[0], fm.Refused):
            raise effects[0].error
        self.failover = new
        # lease ids carry the term: a renewal of an older master's lease id
        # names no lease here (LeaseExpired), never another client's
        self._next_lease = (term << self.LEASE_ID_BITS) + 1
        now = self.clock()
        self._round = FenceRound(nodes, now, self.fence_timeout)
        log.info("term %d: fencing %d storage node(s)", term, len(nodes))
        for segment, endpoint in sorted(nodes.items()):
            self.opened.append((segment, endpoint))
            cmd_id = self._next_cmd
            self._next_cmd += 1
            self._commands[cmd_id] = Command(cmd_id, segment, "fence", [], None, now)
            self.outbox.append((segment, "fence", cmd_id, {"segment": segment, "term": term}))
        self._maybe_recover()

    def _drained_by_purge(self, segment: str, draining) -> None:
        """The purge's answer lists the regions draining at its node after it:
        those the fence answer listed as draining, or as about to drain in the
        purge, that it no longer lists are free again (drained, or freed
        outright: their writer had written or died)."""
        if type(draining) is not list or not all(
                type(d) is list and len(d) == 2 and type(d[0]) is int for d in draining):
            log.error("segment %s: purge reply: draining regions are not [offset, length] "
                      "pairs", segment)
            return
        still = {d[0] for d in draining}
        held = self.draining.get(segment, {})
        for offset in [o for o in held if o not in still]:
            length = held.pop(offset)
            if segment in self.segments:
                self.placer.release([Replica(segment, offset, length)])

    def _fence_or_purge_reply(self, cmd: Command, reply: wire.Reply) -> None:
        segment = cmd.segment
        if cmd.op == "purge":
            if reply.status == 0:
                self.last_failover["purged"] = self.last_failover.get("purged", 0) + reply.body.get("purged", 0)
                self.last_failover["bytes_purged"] = (self.last_failover.get("bytes_purged", 0)
                                                      + reply.body.get("freed", 0))
                if "draining" in reply.body:
                    self._drained_by_purge(segment, reply.body["draining"])
            else:
                log.error("segment %s refused the purge: %s", segment, reply.error())
            return
        rnd = self._round
        if rnd is None or self.failover.phase is not fm.Phase.FENCING or segment not in rnd.nodes:
            return
        try:
            if reply.status != 0:
                raise reply.error()
            info = {k: reply.body[k] for k in ("segment", "capacity", "endpoint", "host", "shm",
                                               "gen_shm", "nonce", "page_size", "next_token")}
            draining = reply.body.get("draining", [])
            if type(draining) is not list or not all(
                    type(d) is list and len(d) == 2 and all(type(x) is int for x in d) for d in draining):
                raise errors.MalformedFrame("fence reply: draining regions are not [offset, length] pairs")
            info["draining"] = draining
            info["columns"] = reply.body.get("columns") is True
            objects = reply.body.get("objects")
            if info["segment"] != segment or type(objects) is not int or objects < 0 \
                    or type(info["next_token"]) is not int or info["next_token"] < 1:
                raise errors.MalformedFrame("fence reply for another segment, without its index "
                                            "or without a next token")
            # decoded and joined (a key listed twice refuses the node) as it comes
            rnd.rebuild.add(segment, IndexColumns.from_frames(reply.payloads, objects))
        except (errors.KvError, KeyError, ValueError, TypeError) as err:
            log.warning("segment %s not fenced (%s): its objects are lost", segment, err)
            rnd.failed.add(segment)
        else:
            self.failover, _ = fm.master_step(self.failover, fm.FenceAcked(segment))
            rnd.infos[segment] = info
        if rnd.answered():
            self._maybe_recover()

    def _maybe_recover(self) -> None:
        """Spec ``Recover`` then ``Open``, once the fence round settled: the
        directory is rebuilt from the fenced nodes' indexes (published objects
        only); a node that did not answer is lost, with its objects; every
        fenced node purges unpublished allocations of older terms (sent before
        any allocation of this term on the same connection)."""
        rnd = self._round
        now = self.clock()
        if rnd is None or self.failover.phase is not fm.Phase.FENCING:
            return
        if not rnd.answered() and now < rnd.deadline:
            return
        self._recover(rnd, now)

    def _recover(self, rnd: FenceRound, now: float) -> None:
        fenced_at, term = now, self.failover.term
        live = frozenset(rnd.infos)
        for segment in set(rnd.nodes) - live:
            self.closed.append(segment)
        for cmd_id, cmd in list(self._commands.items()):
            if cmd.op == "fence":
                del self._commands[cmd_id]
        # the phase machine steps Recover (its effects are the purges); the
        # directory it would rebuild from the indexes (rebuild_directory) is
        # rebuilt on columns by its checked twin, cores.recovery.Rebuild
        new, effects = fm.master_step(self.failover, fm.Recover(live, {}))
        if effects and isinstance(effects[0], fm.Refused):
            raise effects[0].error  # cannot happen: live is exactly the acked nodes
        self.failover = new
        # tokens continue above every token a fenced node's regions ever
        # carried (freed ones included: a same-host reader may still hold one)
        next_token = max((rnd.infos[s]["next_token"] for s in live), default=1)
        mismatches: list = []
        terms: dict = {}
        self.directory = rnd.rebuild.directory({s: rnd.infos[s]["capacity"] for s in live},
                                               next_token, mismatches=mismatches, terms=terms)
        # the recovered objects' publishing terms by token, ours from here on
        self.publish_terms = PublishTerms(term, self.directory.next_token, terms)
        rnd.rebuild = None
        # a replica whose index records another checksum than the one listed
        # is not listed: its region is freed at its node (after the purge,
        # before any assign of this term: one connection)
        frees = [(node, offset, self.directory.objects[key].token,
                  self.directory.objects[key].length) for key, node, offset in mismatches]
        if self.trace is not None:
            self.trace.opened(self.directory, term, frees)
        if mismatches:
            self.counters["checksum_mismatches"] += len(mismatches)
            log.warning("term %d: %d replica(s) left out, their checksum differs from the "
                        "replica listed: %s", term, len(mismatches),
                        ", ".join(f"{key!r} on {node}" for key, node, _ in mismatches[:10]))
            for node, offset, token, length in frees:
                self._queue.append((node, "free", [offset, token, length]))
        used = self.directory.regions()
        # regions still draining for a direct writer of an older term are not free
        self.draining = defaultdict(dict)
        for s in live:
            draining = rnd.infos[s].get("draining", ())
            if draining:
                used[s] = np.concatenate((used[s], np.array(draining, np.int64).reshape(-1, 2)))
            for offset, length in draining:
                self.draining[s][offset] = length
        self.placer = Placer()
        self.repairs.in_flight.clear()   # a new directory has no repairs in flight
        self.repairs.stale = True
        for s in live:
            info = rnd.infos[s]
            self.placer.add(s, info["capacity"], info["page_size"], used[s])
            self.segments[s] = SegmentInfo(info, now)   # seen: at the end of recovery, below
        # the lease table caches every recovered object, with no lease known
        # (spec Takeover): each counts as leased for one TTL and a margin, the
        # longest an old master's lease may still run; all equally recent (ties
        # by row)
        ttl = self.leases.ttl
        self.leases = LeaseCore.inherit(self.directory, ttl, max(self.leases.now, self.clock()),
                                        quiet=ttl * (1 + self.INHERIT_MARGIN_FRACTION)
                                        + self.INHERIT_MARGIN_S)
        if self.tenants is not None:   # each tenant's objects, named by their keys
            self._tenant_drop(len(self._tenant_drops))
            self.tenants.recovered(*self.directory.requested_bytes())
        # a large recovery takes a while: the nodes count as heard from now
        recovered_at = self.clock()
        for s in live:
            self.segments[s].last_seen = recovered_at
        for purge in effects:
            cmd_id = self._next_cmd
            self._next_cmd += 1
            self._commands[cmd_id] = Command(cmd_id, purge.node, "purge", [], None, recovered_at)
            self.outbox.append((purge.node, "purge", cmd_id, {"segment": purge.node, "term": term,
                                                              "below": purge.below}))
        self._flush()      # the frees of replicas left out for their checksum
        self.failover, _ = fm.master_step(self.failover, fm.Open())
        self.opened_at = self.clock()
        lost = sum(1 for s in rnd.nodes if s not in live)
        self.last_failover = {
            "term": term, "fence_s": fenced_at - rnd.started,
            "recover_s": recovered_at - fenced_at, "open_s": self.clock() - rnd.started,
            "nodes_fenced": len(live), "nodes_lost": lost,
            "recovered": len(self.directory.objects), "purged": 0, "bytes_purged": 0,
            "checksum_mismatches": len(mismatches)}
        if rnd.nodes:
            log.info("term %d open: %d object(s) recovered from %d node(s), %d node(s) lost, "
                     "in %.3fs", term, len(self.directory.objects), len(live), lost,
                     self.last_failover["open_s"])
        self._round = None

    def step_down(self, why: errors.KvError) -> None:
        """Spec: a master refused for a higher term steps down (``HigherTermSeen``);
        it serves nothing more. The server replaces this core with a standby one."""
        if self.failover.phase is fm.Phase.STANDBY:
            return
        term = self.failover.term
        new, _ = fm.master_step(self.failover, fm.HigherTermSeen(term + 1))
        self.failover = new
        log.warning("term %d: stepping down (%s)", term, why)
