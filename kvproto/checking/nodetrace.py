"""A storage node's recorded run, read for the merged check of a master's run
(:mod:`kvproto.checking.mergetrace`): the files beside a master's, the region
steps a node took under the master's term (each with the token its request
carried, and the frees of its purge marked), and its region table when that
term began, replayed from its steps before."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional

from kvproto.checking.tracerun import TraceError, accepted, machine_lines

__all__ = ["NodeRun", "node_files", "read_node", "read_nodes", "replay"]

#: the node steps that are steps of the region table (``publish.storage_step``)
REGION_STEPS = ("AssignRegion", "FreeRegion", "WriteReplica", "ReadReplica")
#: the steps a request to the node asks for, by the ``op`` of its ``asked`` line
ASKED = {"WriteReplica": "write", "ReadReplica": "read"}
#: the node's steps that carry a term (raising its fence as ``Fence`` does)
STAMPED = ("StampedAllocate", "StampedPublish", "StampedFree")


def node_files(master: "str | Path") -> list[Path]:
    """The node files a master's ``KVPROTO_TRACE`` file has beside it."""
    return sorted(Path(p) for p in glob.glob(glob.escape(str(master)) + ".storage-*"))


class NodeRun:
    """A node file's part in the run of a master of ``term`` (:func:`read_node`)."""

    def __init__(self) -> None:
        #: every segment the file opened
        self.segments: set = set()
        #: segment -> offset -> (token, written): the node's region table when
        #: its term reached the run's (its fence of the master's term), replayed
        #: from its steps before; empty where the node never reached that term
        self.table: dict = {}
        #: the region steps it took under the run's term, each with its line
        self.steps: list[tuple[int, dict]] = []


def read_node(path: "str | Path", term: int = 1) -> NodeRun:
    """A node file's region steps under ``term`` (from its fence of ``term`` to
    its first fence of a later one) and its region table before them.

    The node's term is its ``opened`` line's, raised by each accepted
    ``Fence`` and stamped step. A step records the token its request carried
    (``asked``); a ``FreeRegion`` the node took itself for its
    ``PurgeUnpublished`` (the region of an allocation the purge dropped, by
    its index) is marked ``purge``."""
    lines = machine_lines(path, "storage")
    if not lines or "opened" not in lines[0][1]:
        raise TraceError(f"{path} does not start where a storage node opened its segment")
    out = NodeRun()
    at, asked, index, purged, reached = 0, None, {}, set(), False
    for number, obj in lines:
        if "opened" in obj:
            segment, at = obj["opened"]["segment"], obj["opened"].get("term", 0)
            out.segments.add(segment)
            if at < term:                 # a new segment, empty: the old one is gone
                out.table = {segment: {}}
            asked, index, purged = None, {}, set()
            reached = reached or at == term
            continue
        if "asked" in obj:
            asked = obj["asked"]
            continue
        if not isinstance(obj.get("event"), dict) or not isinstance(obj.get("effects"), list):
            raise TraceError(f"{path}:{number}: a step needs 'event' and 'effects'")
        ev, ok = obj["event"], accepted(obj)
        kind = ev.get("type")
        if ok and (kind == "Fence" or kind in STAMPED):
            at = max(at, ev["term"])
        if at > term:
            break
        reached = reached or at == term
        if ok and kind == "StampedAllocate":
            index[ev["key"]] = (ev["offset"], ev["token"])
        elif ok and kind == "StampedFree":
            index.pop(ev["key"], None)
        elif ok and kind == "PurgeUnpublished":
            purged = {index.pop(k) for k in obj["effects"][0]["keys"] if k in index}
            continue
        if kind not in REGION_STEPS:
            asked, purged = None, set()
            continue
        if asked is not None and ASKED.get(kind) == asked.get("op") \
                and asked.get("offset") == ev.get("offset"):
            obj = {**obj, "asked": asked.get("token")}
        asked = None
        if kind == "FreeRegion" and (ev["offset"], ev["token"]) in purged:
            purged.discard((ev["offset"], ev["token"]))
            obj = {**obj, "purge": True}
        else:
            purged = set()
        if at < term:
            replay(out.table.get(ev["segment"]), kind, ev, ok)
        else:
            out.steps.append((number, obj))
    if not reached:
        out.table = {}
    return out


def replay(regions: Optional[dict], kind: str, ev: dict, ok: bool) -> None:
    """A region step applied to ``regions`` (offset -> (token, written)) as
    the node's core applied it (a refused step changes nothing)."""
    if regions is None or not ok:
        return
    if kind == "AssignRegion":
        regions[ev["offset"]] = (ev["token"], False)
    elif kind == "FreeRegion":
        regions.pop(ev["offset"], None)
    elif kind == "WriteReplica":
        regions[ev["offset"]] = (ev["token"], True)


def read_nodes(paths: list, term: int) -> tuple[set, list[list[tuple[int, dict]]], dict]:
    """:func:`read_node` of each file: the segments they cover, each one's
    region steps under ``term``, and their region tables before them (by segment)."""
    segments, node_steps, tables = set(), [], {}
    for path in paths:
        node = read_node(path, term)
        segments |= node.segments
        node_steps.append(node.steps)
        tables.update(node.table)
    return segments, node_steps, tables
