"""Recording what the master feeds its publish and lease machines, as JSON lines.

A :class:`Recorder` writes one line per step of the master's directory (the
fast core held to ``publish.master_step``): the event, the effects the core
returned (a refused event is recorded with its single ``Refused`` effect; it
changed nothing), and what the step left of the directory for every key the
event or its effects name; and one line per step of its lease table (the core
held to ``lease.master_step``): the event and its effects. ``kvproto trace
check FILE`` (:mod:`kvproto.checking.traces`) has TLC check that the recorded
steps are a behaviour of ``spec/Publish.tla`` and of ``spec/Lease.tla``.

Recording is off unless a :class:`~kvproto.runtime.master.MasterCore` is given
``trace=PATH`` (``kvproto master --trace FILE``) or the environment names a
file in ``KVPROTO_TRACE``; off, the master pays one ``if`` per step. Lines
are appended (a master restarted on the same file adds a run) and written
through (line-buffered), so a killed master leaves every step it took.

Encoding (:func:`encode`): an event, effect or record is an object with
``"type"`` (its class name) and its fields; bytes (keys) are decoded as
Latin-1, so each byte is one character and ``b"k1"`` reads ``"k1"``; tuples
are lists; an enum is its value; an error is ``{"type": its class name,
"message": ...}``. Lines:

* ``{"machine": "publish", "opened": {"next_token": N, "objects": N,
  "segments": {name: capacity}, "free": {name: free bytes}, "term": T,
  "directory": {key: record}}}`` when the master opens its directory under
  term ``T`` (at start, and after each takeover's recovery): its segment
  ledgers as its allocator starts from (``"lost"``: the names of any not
  live) and, for a directory of up to :data:`INHERITED_LISTED` objects, each
  object's record as a step's ``"after"`` has it (status, token, replicas,
  length, checksum, requested, reads, repairs); a recovered directory's
  objects are also listed in ``"recovered"``: ``[key, [segment of each
  replica]]`` each; ``"frees"``: the regions the recovery frees itself (a
  replica left out, its node's index recording another checksum), each
  ``{"segment", "offset", "token", "length"}``, sent before any command of
  the run;
* ``{"machine": "publish", "n": N, "event": ..., "effects": [...],
  "after": {"next_token": N, "objects": {key: record or null}}}`` per step;
  a step the master took on a repair copier's report (``repair_done``:
  ``ListReplica``, or ``RepairCancel`` of a failed copy) also has
  ``"report": {"copied": true}`` (the copy is complete) or ``{"copied":
  false, "error": code}``;
* ``{"machine": "lease", "opened": {"ttl": T, "now": T, "quiet_until": T,
  "objects": N}}`` before the first step of a lease table (at start, and
  after each takeover, whose table holds every recovered object, inherited:
  up to :data:`INHERITED_LISTED` of them are listed in ``"inherited"``);
* ``{"machine": "lease", "n": N, "event": ..., "effects": [...]}`` per step
  of the lease table (a ``Tick`` whenever the master reads its clock for it).
  A ``Release`` the master feeds itself, not asked by the lease's reader, has
  ``"by"``: ``"dropped"`` (its object left the directory: removed, evicted or
  lost with its segment; ``"during"`` names that publish step, ``{"n": N,
  "type": ...}``) or ``"forced"`` (an operator's forced remove).

Times are the master's clock (seconds, ``time.monotonic`` by default), as the
lease table holds them; a holder is ``[client, lease id]`` and a region
``[key, token]``.

A storage node records the steps of its core
(:class:`~kvproto.cores.storage.StorageNodeCore`, held to
``publish.storage_step`` and ``failover.storage_step``) with a
:class:`StorageRecorder`: ``kvproto storage --trace FILE``, or, with
``KVPROTO_TRACE=FILE`` in its environment, the file :func:`node_path` names
beside the master's (``FILE.storage-<pid>-<n>``: one file per node, also for
the nodes of one process). Lines:

* ``{"machine": "storage", "opened": {"segment": S, "term": T}}`` when the
  node opens a segment (at start, and each time it starts over under a new
  segment id);
* ``{"machine": "storage", "n": N, "segment": S, "event": ..., "effects":
  [...]}`` per step of its core, accepted or refused; and, numbered with
  them, a request refused at the node's fence before any step of its core
  (``StorageCore._check_term``) as ``"event": {"type": "StaleRequest",
  "op": OP, "term": T}`` with its ``Refused`` (``StaleTerm``) effect.
* ``{"machine": "storage", "asked": {"op": "write" or "read", "segment": S,
  "offset": O, "token": T}}`` when a write (a client's, or a repair copy's)
  or a read of a region arrives, before the steps it causes: the token the
  request carries, which the checker holds the step to.

``kvproto trace merge FILE [NODE_FILE ...]`` (:mod:`kvproto.checking.mergetrace`)
merges a master's run and its nodes' steps under its term into one behaviour
of ``spec/Publish.tla``: a node's steps before its fence of that term give
the region table it starts from (so a node records from its opening).
"""

from __future__ import annotations

import enum
import itertools
import json
import os
from typing import Any

import attrs

from kvproto import errors

#: the environment variable that turns recording on (a file path)
ENV = "KVPROTO_TRACE"

#: a directory or a lease table that opens with at most this many objects (a
#: takeover's) lists them in its ``opened`` line (``directory``, ``inherited``)
INHERITED_LISTED = 1000


def encode(value: Any) -> Any:
    """``value`` as JSON data (see the module docstring)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("latin-1")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, errors.KvError):
        return {"type": type(value).__name__, "message": str(value)}
    if attrs.has(type(value)):
        out = {"type": type(value).__name__}
        for field in attrs.fields(type(value)):
            out[field.name] = encode(getattr(value, field.name))
        return out
    if isinstance(value, (tuple, list, frozenset, set)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(encode(k)): encode(v) for k, v in value.items()}
    return value


def _keys(event, effects) -> list:
    """The keys an event and its effects name, in order, once each."""
    keys = [getattr(event, "key", None)] + [getattr(e, "key", None) for e in effects]
    return list(dict.fromkeys(k for k in keys if k is not None))


class _Lines:
    """A trace file: JSON lines appended and written through."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as e:
            raise errors.InvalidArgument(f"cannot write the trace to {path}: "
                                         f"{e.strerror or e}") from None

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


class Recorder(_Lines):
    """Appends the master's publish and lease steps to ``path`` (one JSON line each)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._n = 0
        self._published = None   # the event type of the last publish step
        self._ln = 0
        self._table = None       # the lease table last stepped

    def opened(self, directory, term=None, frees=()) -> None:
        """The master opened ``directory`` (empty, or recovered at a takeover)
        under ``term``; ``frees``: the regions its recovery frees itself,
        ``(segment, offset, token, length)`` each, in the order sent."""
        ledgers = directory.segments
        opened = {"next_token": directory.next_token, "objects": len(directory.objects),
                  "segments": {name: ledger.capacity for name, ledger in ledgers.items()},
                  "free": {name: ledger.free for name, ledger in ledgers.items()}}
        lost = [name for name, ledger in ledgers.items() if not ledger.live]
        if lost:
            opened["lost"] = lost
        if term is not None:
            opened["term"] = term
        if frees:
            opened["frees"] = [{"segment": s, "offset": o, "token": t, "length": n}
                               for s, o, t, n in frees]
        if len(directory.objects) <= INHERITED_LISTED:
            items = directory.objects.items()
            opened["directory"] = {encode(key): encode(record) for key, record in items}
            if term is not None and items:
                opened["recovered"] = [[encode(key), [r.segment for r in record.replicas]]
                                       for key, record in items]
        self._write({"machine": "publish", "opened": opened})

    def publish(self, event, effects: tuple, directory, report=None) -> None:
        """One step of the directory: ``event`` in, ``effects`` out; ``report``:
        the copier's report the master took it on (``ListReplica``,
        ``RepairCancel``)."""
        self._n += 1
        self._published = type(event).__name__
        objects = directory.objects
        after = {encode(k): encode(objects.get(k)) for k in _keys(event, effects)}
        line = {"machine": "publish", "n": self._n, "event": encode(event),
                "effects": encode(effects),
                "after": {"next_token": directory.next_token, "objects": after}}
        if report is not None:
            line["report"] = report
        self._write(line)

    def lease(self, table, event, by=None) -> tuple:
        """Step the lease ``table`` (a :class:`~kvproto.cores.leases.LeaseCore`)
        with ``event`` and record the step; return its effects. The first step
        of a new table (the master's first, or a takeover's) is preceded by its
        ``opened`` line."""
        if table is not self._table:
            self._table = table
            opened = {"ttl": table.ttl, "now": table.now, "quiet_until": table.quiet_until,
                      "objects": len(table.objects)}
            if 0 < len(table.objects) <= INHERITED_LISTED:
                opened["inherited"] = [[encode(key), encode(obj.region)]
                                       for key, obj in table.objects.items() if obj.inherited]
            self._write({"machine": "lease", "opened": opened})
        effects = table.step(event)
        self._ln += 1
        line = {"machine": "lease", "n": self._ln, "event": encode(event),
                "effects": encode(effects)}
        if by is not None:
            line["by"] = by
            if by == "dropped":
                line["during"] = {"n": self._n, "type": self._published}
        self._write(line)
        return effects


_nodes = itertools.count(1)


def node_path(path: str) -> str:
    """The file a storage node records to when ``KVPROTO_TRACE`` names ``path``
    (the master's): ``path.storage-<pid>-<n>``, one per node."""
    return f"{path}.storage-{os.getpid()}-{next(_nodes)}"


class StorageRecorder(_Lines):
    """Appends a storage node's core steps to ``path`` (one JSON line each)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._n = 0

    def opened(self, segment: str, term: int) -> None:
        """The node opened ``segment`` (at start, or starting over)."""
        self._write({"machine": "storage", "opened": {"segment": segment, "term": term}})

    def asked(self, op: str, segment: str, offset: int, token: int) -> None:
        """A request to write or read the region at ``offset`` under ``token``
        arrived (before the node steps its core for it)."""
        self._write({"machine": "storage", "asked": {"op": op, "segment": segment,
                                                     "offset": offset, "token": token}})

    def step(self, segment: str, event, effects: tuple) -> None:
        """One step of the node's core: ``event`` in, ``effects`` out."""
        self._n += 1
        self._write({"machine": "storage", "n": self._n, "segment": segment,
                     "event": encode(event), "effects": encode(effects)})

    def stale(self, segment: str, op: str, term: int, error) -> None:
        """A request ``op`` stamped with ``term`` refused at the node's fence
        before any step of its core (it changed nothing)."""
        self._n += 1
        self._write({"machine": "storage", "n": self._n, "segment": segment,
                     "event": {"type": "StaleRequest", "op": op, "term": term},
                     "effects": [{"type": "Refused", "error": encode(error)}]})
