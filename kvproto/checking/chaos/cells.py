"""The cells of the fault matrix: one fault, aimed at one protocol phase, each.

A cell says which faults to arm (fault-proxy rules, see
:mod:`kvproto.checking.chaos.proxy`) and when: every ``period`` seconds once
the previous ones fired or lapsed, and for cells that take servers down only
while the cluster is whole again (an open master, a standby, every storage
node registered). Rules aimed at servers name their pid; rules aimed at
clients name the ``sender`` of a request or the ``receiver`` of a reply, which
the proxy finds in the frames.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

#: master -> storage node commands
CONTROL = ["assign", "free", "publish", "fence", "purge"]
#: a client's writes to a storage node: one region, or a batch of them
WRITES = ["write", "writes"]


class Context:
    """What a cell may look at when it arms its faults."""

    def __init__(self, cluster, rng: random.Random, folder: str = "") -> None:
        self.cluster = cluster
        self.settings = cluster.settings
        self.rng = rng
        self.folder = folder    # the cell's journals
        self.armed = 0          # how many times this cell armed its faults
        self.started = 0.0      # when its traffic began (monotonic)

    def ms(self, seconds: float) -> int:
        return int(seconds * 1000)

    def leader(self):
        return self.cluster.open_leader()

    def standby(self, leader) -> Optional[object]:
        return next((m for m in self.cluster.masters if m is not leader and m.alive()), None)

    def whole(self) -> bool:
        """Two masters alive and none stopped, every storage node registered."""
        return not self.broken()

    def broken(self) -> str:
        """Why the cluster is not whole ("" when it is)."""
        c = self.cluster
        masters = len([m for m in c.masters if m.alive()])
        if masters < 2:
            return f"{masters} master(s) alive"
        dead = [s.name for s in c.storage if not s.alive()]
        if dead:
            return f"storage node(s) {', '.join(dead)} dead"
        stopped = c.proxy.call("stats")["stopped"]
        if stopped:
            return f"pid(s) {stopped} stopped by the proxy"
        live = c.live_segments()
        if live < len(c.storage):
            return f"{live} of {len(c.storage)} segments live at the open master"
        return ""


class Cell:
    def __init__(self, name: str, about: str, rules: Callable[[Context], list],
                 period: float = 1.0, whole: bool = False, once: bool = False,
                 window: float = 4.0, duplicates: bool = False, first_after: float = 0.5,
                 loses_loads: bool = False, injects: bool = True) -> None:
        self.name = name
        self.about = about
        self.rules = rules
        self.period = period          # seconds between arming
        self.whole = whole            # arm only while the cluster is whole
        self.once = once              # arm once, for the whole run
        self.window = window          # seconds an armed rule waits for its frame
        #: whether requests may be delivered twice: then a refusal a client
        #: heard may have been followed by a copy that took effect
        self.duplicates = duplicates
        #: whether a load's reply and its cancels can be lost for good (its
        #: node killed): its buffer is written off or, past the leak budget,
        #: quarantined; counted apart, not as a leak
        self.loses_loads = loses_loads
        #: whether it injects faults through the proxy (a run goes on until one fired)
        self.injects = injects
        #: seconds of traffic before the first fault (so something is stored)
        self.first_after = 0.0 if once else first_after


def _rotate(ctx: Context, choices: list):
    return choices[ctx.armed % len(choices)]


# ---------------------------------------------------------------- clients

def writer_kill_before_write(ctx: Context) -> list:
    return [_rotate(ctx, [
        # a network writer, as its write reaches a node
        dict(route="storage", direction="request", ops=WRITES, action="kill", target="sender",
             forward=False),
        # any writer (a direct writer too, which copies into shared memory), as
        # its grant comes back
        dict(route="master", direction="reply", ops="put_start", action="kill", target="receiver",
             forward=False),
    ])]


def writer_kill_before_put_end(ctx: Context) -> list:
    return [dict(route="master", direction="request", ops="put_end", action="kill",
                 target="sender", forward=False)]


def writer_stop_past_timeout(ctx: Context) -> list:
    # the writer sleeps through its attempt's deadline; its write arrives after
    # the attempt was reclaimed (and its region maybe granted again)
    stop = ctx.ms(ctx.settings.writer_timeout * 2.5)
    return [_rotate(ctx, [
        dict(route="storage", direction="request", ops=WRITES, action="stop", target="sender",
             stop_ms=stop, hold=True),
        dict(route="storage", direction="reply", ops=WRITES, action="stop", target="receiver",
             stop_ms=stop, forward=True),
        # a direct writer too: stopped as its grant comes back, before it writes
        dict(route="master", direction="reply", ops="put_start", action="stop", target="receiver",
             stop_ms=stop, forward=True),
    ])]


def reader_kill_mid_read(ctx: Context) -> list:
    return [dict(route="storage", direction="reply", ops="read", action="kill",
                 target="receiver", forward=False)]


def reader_stop_past_lease(ctx: Context) -> list:
    stop = ctx.ms(ctx.settings.lease_ttl * 2.5)
    return [_rotate(ctx, [
        dict(route="storage", direction="request", ops="read", action="stop", target="sender",
             stop_ms=stop, hold=True),
        dict(route="storage", direction="reply", ops="read", action="stop", target="receiver",
             stop_ms=stop, forward=True),
    ])]


# ---------------------------------------------------------------- masters

def master_kill(ctx: Context) -> list:
    leader = ctx.leader()
    if leader is None:
        return []
    return [_rotate(ctx, [
        # the publish mark is on its way to a node; the writer's put_end is unanswered
        dict(route="storage", direction="request", ops="publish", action="kill",
             target=leader.pid, forward=True),
        # a grant was made and acknowledged by the nodes; the writer never hears it
        dict(route="master", direction="reply", ops="put_start", action="kill",
             target=leader.pid, forward=False),
        # a node freed a removed object's region; the remover is never answered
        dict(route="storage", direction="reply", ops="free", action="kill",
             target=leader.pid, forward=False),
    ])]


def master_stop(ctx: Context) -> list:
    leader = ctx.leader()
    if leader is None:
        return []
    # paused past its leadership TTL with a request queued in its socket (a
    # standby takes over meanwhile); woken, it must acknowledge nothing
    return [dict(route="master", direction="request", ops=_rotate(ctx, ["remove", "put_end", "put_start"]),
                 action="stop", target=leader.pid, stop_ms=ctx.ms(ctx.settings.ttl * 3), forward=True)]


def fence_recover(ctx: Context) -> list:
    leader = ctx.leader()
    standby = ctx.standby(leader) if leader is not None else None
    if leader is None or standby is None:
        return []
    s = ctx.settings
    trigger = dict(route="master", direction="request", ops="put_start", action="kill",
                   target=leader.pid, forward=False)
    during = _rotate(ctx, [
        # the new master dies while fencing; a replacement takes over
        dict(route="storage", direction="request", ops="fence", action="kill",
             target=standby.pid, forward=False),
        # one node's fence answer comes after the fence timeout: it is left out of recovery
        dict(route="storage", direction="reply", ops="fence", action="delay",
             delay_ms=ctx.ms(s.fence_timeout * 2.5)),
        # the new master dies in recovery, while its purges are on their way
        dict(route="storage", direction="request", ops="purge", action="kill",
             target=standby.pid, forward=True),
        # the new master is paused while fencing, past its leadership TTL
        dict(route="storage", direction="request", ops="fence", action="stop",
             target=standby.pid, stop_ms=ctx.ms(s.ttl * 3), forward=True),
    ])
    return [during, trigger]


# ---------------------------------------------------------------- storage nodes

def _node(ctx: Context):
    live = [n for n in ctx.cluster.storage if n.alive()]
    return ctx.rng.choice(live) if live else None


def _busy_node(ctx: Context):
    """The live node new objects go to: the master places on the segment with
    the most free space, so a node fuller than the others (e.g. next to a
    fresh replacement) may see no write, assign or read for seconds. Falls
    back to :func:`_node` when the master's figures are not at hand."""
    live = [n for n in ctx.cluster.storage if n.alive()]
    stats = ctx.cluster.master_stats(ctx.leader()) if live else None
    if not stats:
        return _node(ctx)
    free = {}
    for name, seg in stats.get("segments", {}).items():
        for n in live:
            if f":{n.pid}:" in name and seg.get("live"):
                free[n.name] = seg.get("free", 0)
    if not free:
        return _node(ctx)
    most = max(free.values())
    return ctx.rng.choice([n for n in live if free.get(n.name) == most])


def storage_kill(ctx: Context) -> list:
    node = _busy_node(ctx)
    if node is None:
        return []
    return [dict(route=node.route, direction="request", ops=_rotate(ctx, [WRITES, "assign", "read"]),
                 action="kill", target=node.pid, forward=False)]


def storage_stop(ctx: Context) -> list:
    node = _busy_node(ctx)
    if node is None:
        return []
    return [dict(route=node.route, direction="request", ops=WRITES + ["read", "assign"],
                 action="stop", target=node.pid, forward=True,
                 stop_ms=ctx.ms(ctx.settings.storage_timeout * _rotate(ctx, [2.0, 0.5])))]


# ---------------------------------------------------------------- network

def net_drop(ctx: Context) -> list:
    return [dict(action="drop", probability=0.02, count=0)]


def net_delay(ctx: Context) -> list:
    return [dict(action="delay", probability=0.02, delay_ms=400, count=0),
            dict(action="delay", probability=0.15, delay_ms=40, count=0)]


def net_duplicate(ctx: Context) -> list:
    # not the master's commands to its nodes: the runtime relies on their one
    # connection delivering each once and in order (ZeroMQ over TCP does); a
    # stale copy of an assign would take a region the master has freed
    return [dict(action="duplicate", probability=0.05, delay_ms=20, count=0, except_ops=CONTROL)]


def net_reorder(ctx: Context) -> list:
    return [dict(action="reorder", probability=0.05, delay_ms=100, count=0)]


def net_partition(ctx: Context) -> list:
    s = ctx.settings
    node = _node(ctx)
    leader = ctx.leader()
    choices = []
    if node is not None:
        # a node cut off from everyone past the storage timeout, or only from its master
        choices.append(dict(route=node.route, action="drop", count=0,
                            for_ms=ctx.ms(s.storage_timeout * 1.5)))
        choices.append(dict(route=node.route, ops=CONTROL, action="drop", count=0,
                            for_ms=ctx.ms(s.storage_timeout * 0.75)))
    if leader is not None:
        # the master cut off from clients and nodes for a while (it keeps its term)
        choices.append(dict(route=leader.route, action="drop", count=0, for_ms=ctx.ms(s.ttl * 1.5)))
    return [_rotate(ctx, choices)] if choices else []


CELLS: dict[str, Cell] = {c.name: c for c in [
    Cell("none", "no faults: the control cell", lambda ctx: [], once=True, injects=False),
    Cell("writer-kill-before-write", "kill -9 of a writer between put_start and its write "
         "(as its write reaches a node, or as its grant comes back)",
         writer_kill_before_write),
    Cell("writer-kill-before-put-end", "kill -9 of a writer between its writes and put_end",
         writer_kill_before_put_end),
    Cell("writer-stop-past-timeout", "SIGSTOP of a writer past the writer timeout, "
         "before its write arrives or before it hears the ack", writer_stop_past_timeout, period=1.5),
    Cell("reader-kill-mid-read", "kill -9 of a reader during a read's transfer", reader_kill_mid_read),
    Cell("reader-stop-past-lease", "SIGSTOP of a reader past its lease, before its read "
         "arrives or while the bytes come back", reader_stop_past_lease, period=1.5),
    Cell("master-kill", "kill -9 of the active master as a publish, a grant or a free is "
         "in flight", master_kill, whole=True, period=2.0),
    Cell("master-stop", "SIGSTOP of the active master past its leadership TTL with a remove, "
         "put_end or put_start queued", master_stop, whole=True, period=2.0),
    Cell("fence-recover", "the new master killed, paused or left without a node's answer "
         "during fence and recovery", fence_recover, whole=True, period=2.0, window=8.0),
    Cell("storage-kill", "kill -9 of a storage node as a write, assign or read arrives",
         storage_kill, whole=True, period=2.0, loses_loads=True),
    Cell("storage-stop", "SIGSTOP of a storage node, past or within the storage timeout",
         storage_stop, whole=True, period=2.0),
    Cell("net-drop", "2% of all frames dropped", net_drop, once=True),
    Cell("net-delay", "frames delayed: 15% by 40 ms, 2% by 400 ms", net_delay, once=True),
    Cell("net-duplicate", "5% of frames (not the master's commands to nodes) delivered twice",
         net_duplicate, once=True, duplicates=True),
    Cell("net-reorder", "5% of frames overtaken by another connection's", net_reorder, once=True),
    Cell("net-partition", "a storage node, its control link or the master cut off, then healed",
         net_partition, whole=True, period=2.0),
]}
