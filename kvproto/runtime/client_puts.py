"""The put path of a :class:`~kvproto.runtime.client.Client`: ``put_start``
(the master allocates and grants a token per attempt), the writes
(:func:`~kvproto.runtime.datapath.write_all`: straight into a same-host
segment, or one message per storage node), ``put_end`` (publish), and the
revoke or abandon of what was not ended. A call of more keys than ``batch``
goes in chunks; with a ``window`` above one the next chunk's ``put_start`` is
in flight while this chunk is written, and this chunk's ``put_end`` while the
next one is. :class:`ClientPuts` is a part of
:class:`~kvproto.runtime.client.Client`: it uses the client's state, its lock
and its requests to the master.
"""

from __future__ import annotations

import time
from typing import Optional

import zmq

from kvproto import errors
from kvproto.runtime import datapath, wire
from kvproto.runtime.shm import WriterLock


def grants_of(reply: wire.Reply, todo: list, replicas: int, results: list) -> dict:
    """The grants of a ``put_start`` answered as columns for ``todo``'s
    ``(i, key, view)``: ``i -> (key, view, token, replicas)``, each replica
    ``(segment, offset, direct)`` (``direct`` 1 where the segment is granted to
    this client as a direct writer; the length is the view's); a refused
    key's error set in ``results``."""
    columns = wire.put_columns(reply, len(todo), replicas)
    for at, code, message in columns["errors"]:
        results[todo[at][0]] = errors.from_wire(code, message)
    rows, at = list(zip(columns["segment"], columns["offset"], columns["direct"])), 0
    grants: dict[int, tuple] = {}
    for (i, k, v), token in zip(todo, columns["token"]):
        if token:
            grants[i] = (k, v, token, rows[at:at + replicas])
            at += replicas
    return grants


class ClientPuts:
    """The put path of :class:`~kvproto.runtime.client.Client` (see the
    module docstring)."""

    def _put_chunks(self, todo: list, replicas: int, deadline: float, results: list) -> None:
        """Put ``todo`` (``(i, key, view)``, results by ``i``) ``batch`` keys a
        chunk: a chunk whose ``put_start`` failed stores nothing, each of its
        keys gets that error. With a ``window`` above one, the next chunk's
        ``put_start`` is sent once this chunk's grants are in, and a chunk's
        ``put_end`` is answered while the next chunk is written (its answer
        awaited after those writes); every answer is in before this returns."""
        chunks = [todo[at:at + self.batch] for at in range(0, len(todo), self.batch)]
        ahead: list = []        # the next chunk's put_start, sent before this chunk's writes
        ending: list = []       # a chunk's put_end, sent, its answer awaited after the next writes
        with self._lock, self._activity():
            try:
                for k, chunk in enumerate(chunks):
                    following = chunks[k + 1] if k + 1 < len(chunks) and self.window > 1 else None
                    try:
                        self._put_chunk(chunk, replicas, deadline, results, ahead, following,
                                        ending)
                    except errors.KvError as err:   # the chunk's put_start failed: nothing stored
                        for i, _, _ in chunk:
                            results[i] = results[i] or err
            finally:
                while ending:
                    self._put_ended(*ending.pop(), deadline, results)
                for sent, keys in ahead:            # never awaited: its grants end now
                    self._early.pop(sent[1], None)
                    self._abandon(keys)

    def _put_start_body(self, todo: list, replicas: int) -> dict:
        body = {"client": self.client_id, "replicas": replicas, "columns": True,
                "items": [[k, v.nbytes] for _, k, v in todo]}
        writer = self._writer_lock()
        if writer is not None:
            body["writer"], body["host"] = writer.name, self._writable.host
        return body

    def _put_started(self, todo: list, replicas: int, deadline: float, ahead: list,
                     sums: Optional[dict]) -> wire.Reply:
        """The master's answer to ``todo``'s ``put_start``: the one sent ahead
        (``ahead``, taken from it) if the master served it, else asked now. A
        put_start the master may have granted without this client getting the
        tokens (unanswered) has its attempts abandoned first, so that the
        request asked again is not ``KeyExists``. With ``sums``, the
        checksums of ``todo``'s bytes are computed while the master works on
        the request (:func:`~kvproto.runtime.datapath.checksums`)."""
        hashing = None if sums is None else (lambda: datapath.checksums(todo, sums))
        if ahead:
            if hashing is not None:
                hashing()
                hashing = None
            reply, unanswered = self._await_ahead(ahead.pop()[0], deadline)
            if reply is not None:
                return reply
            if unanswered:
                self._abandon([k for _, k, _ in todo])
        try:
            return self._call_master("put_start", self._put_start_body(todo, replicas), deadline,
                                     meanwhile=hashing)
        except errors.RequestTimeout:
            # the master may have granted attempts whose tokens never
            # reached us: end them now, so that a retry is not KeyExists
            self._abandon([k for _, k, _ in todo])
            raise

    def _writer_lock(self) -> Optional[WriterLock]:
        """This client's direct-writer lock (made at its first put), or None
        when it does not write directly."""
        if self._writer is None and self._writable.enabled:
            try:
                self._writer = WriterLock()
            except OSError:
                self._writable.enabled = False
        return self._writer

    def _put_chunk(self, todo: list, replicas: int, deadline: float, results: list,
                   ahead: list, following: Optional[list], ending: list) -> None:
        """One ``put_start``, the writes and one ``put_end`` of ``todo``; with
        ``following``, that chunk's ``put_start`` is sent once this one's
        grants are in (into ``ahead``), so the master allocates it while this
        client writes, and this chunk's ``put_end`` is sent without awaiting
        its answer (into ``ending``, which the caller ends); the ``put_end``
        already there, the chunk before's, is awaited after this chunk's
        writes (its caller holds the lock and the heartbeat)."""
        sums: Optional[dict] = {} if self.checksums else None
        reply = self._put_started(todo, replicas, deadline, ahead, sums)
        self._note_interval(reply)
        term = reply.body.get("term", 0)
        grants = grants_of(reply, todo, replicas, results)
        if following is not None and self.master:
            ahead.append((self._send_ahead("put_start",
                                           self._put_start_body(following, replicas)),
                          [k for _, k, _ in following]))
        ended: set[int] = set()
        self._in_flight = tuple(g[2] for g in grants.values()) + tuple(
            item[1] for _, body, _ in ending for item in body["items"])
        try:
            failed = datapath.write_all(self, grants, reply.body.get("segments", {}),
                                        deadline, term, sums)
            for i, err in failed.items():
                results[i] = err
            while ending:
                self._put_ended(*ending.pop(), deadline, results)
            ok = [i for i in grants if i not in failed]
            if ok:
                body = {"client": self.client_id, "columns": True,
                        "items": [[grants[i][0], grants[i][2], sums.get(i, 0)]
                                  if sums is not None else [grants[i][0], grants[i][2]]
                                  for i in ok]}
                sent = self._send_ahead("put_end", body) \
                    if following is not None and self.master else None
                ended.update(ok)        # from here on revoked, if need be, by _put_ended
                if sent is not None:
                    ending.append((sent, body, ok))
                else:
                    self._put_ended(None, body, ok, deadline, results)
        finally:
            self._in_flight = ()
            self._revoke([(grants[i][0], grants[i][2]) for i in grants if i not in ended])

    def _put_ended(self, sent: Optional[tuple], body: dict, ok: list, deadline: float,
                   results: list) -> None:
        """The answer to the ``put_end`` of ``ok`` (``body``, whose items
        name each attempt's key and token in ``ok``'s order): the one
        :meth:`_send_ahead` sent (``sent``) if the master served it, else
        asked now; each refused key's error set in ``results``. A ``put_end``
        no master answered fails its keys, and their attempts are revoked."""
        try:
            reply = self._await_ahead(sent, deadline)[0] if sent is not None else None
            if reply is None:
                reply = self._call_master("put_end", body, deadline)
        except errors.KvError as err:
            for i in ok:
                results[i] = err
            self._revoke([(item[0], item[1]) for item in body["items"]])
            return
        for at, code, message in wire.put_end_refused(reply, len(ok)):
            results[ok[at]] = errors.from_wire(code, message)

    def _revoke(self, attempts: list[tuple[bytes, int]], wait: float = 2.0) -> None:
        """Best effort: give up ``attempts`` (the master reclaims them anyway when
        this client falls silent)."""
        if not attempts:
            return
        try:
            self._call_master("put_revoke", {"client": self.client_id,
                                             "items": [[k, t] for k, t in attempts]},
                              time.monotonic() + wait)
        except errors.KvError:
            pass

    def _abandon(self, keys: list[bytes]) -> None:
        """End this client's pending attempts on ``keys`` whose tokens it never
        received (``put_abandon``). Fire-and-forget, on the master connection,
        so it is handled before this client's next request; the master also
        ends such attempts by their own deadline."""
        try:
            self._send(self._master(), "put_abandon", {"client": self.client_id, "keys": keys})
        except (errors.KvError, zmq.ZMQError):
            pass
