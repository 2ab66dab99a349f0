"""The read leases a :class:`~kvproto.runtime.client.Client` holds
(``spec/Lease.tla``): :class:`ReadLease`, what the master granted; the
releases a get holds back and sends with the client's next request (or a
heartbeat); renewing and releasing leases taken with ``read_begin``; the
reader's check after a transfer; and the phase budget a rejected read is
classified against. :class:`ClientLeases` is
a part of :class:`~kvproto.runtime.client.Client`: it uses the client's state,
its lock and its requests to the master.
"""

from __future__ import annotations

import time
from itertools import repeat
from typing import Optional, Sequence

import zmq

from kvproto import errors
from kvproto.runtime import datapath, wire
from kvproto.statemachines import lease as lm


class ReadLease:
    """A read lease the master granted (``read_begin``): where the bytes are,
    the lease id and TTL, and ``sent``, the local time the request (or the last
    accepted renewal) was sent: the deadline runs from there, never from the reply.
    At a store with tenants, ``tickets`` holds the read ticket of each replica
    (in the order of ``replicas``; a ``read`` or ``load`` of it carries it as
    ``ticket``), renewed with the lease."""

    __slots__ = ("key", "lease", "ttl", "sent", "token", "length", "replicas", "segments",
                 "tickets")

    def __init__(self, key: bytes, lease: int, ttl: float, sent: float, token: int,
                 length: int, replicas: list, segments: dict,
                 tickets: Optional[list] = None) -> None:
        self.key, self.lease, self.ttl, self.sent = key, lease, ttl, sent
        self.token, self.length, self.replicas, self.segments = token, length, replicas, segments
        self.tickets = tickets

    def deadline(self, max_skew: float) -> float:
        """The local time by which the last byte must have been read."""
        return lm.local_deadline(self.sent, self.ttl, max_skew)

    def __repr__(self) -> str:
        return f"ReadLease({self.key!r}, lease={self.lease}, ttl={self.ttl})"


LEASE_COUNTERS = ("lease_reads", "lease_accepted", "lease_rejected",
                  *(f"rejected_{r.value}" for r in lm.RejectReason),
                  "renewals", "renewals_refused", "releases",
                  "queued_s", "transferring_s", "verifying_s")


class ClientLeases:
    """The lease bookkeeping of :class:`~kvproto.runtime.client.Client` (see
    the module docstring)."""

    def flush_releases(self, *, timeout: Optional[float] = None) -> None:
        """Release now the leases this client's reads took and still holds back
        (they otherwise go with its next request or within a heartbeat), and
        wait until the master has released them, e.g. before another client
        removes what this one read (that client's request comes on another
        connection, which the master may serve first). Raises what a request
        to the master raises."""
        with self._lock:
            leases = self._take_releases()
            if leases:
                self._call_master("release", {"client": self.client_id, "leases": leases},
                                  self._deadline(timeout))

    def _release_now(self) -> None:
        """Send the held-back lease releases (fire-and-forget, so they reach the
        master before this client's next request on the same connection)."""
        leases = self._take_releases()
        if not leases:
            return
        try:
            self._send(self._master(), "release", {"client": self.client_id, "leases": leases})
        except (errors.KvError, zmq.ZMQError):
            pass

    def _take_releases(self) -> list:
        """The held-back lease releases, which are then no longer held back
        (counted as released): for a ``release`` request, or to go with a
        ``read_begin``."""
        leases, self._unreleased = self._unreleased, []
        self.lease_counters["releases"] += len(leases)
        return leases

    def _budget(self, ttl: float) -> lm.LeaseBudget:
        if self.lease_budget is not None:
            return self.lease_budget
        # the budget the TTL would be recommended for: queue and transfer
        # halves of (ttl - 2 * max_skew) / 1.25, no verification phase
        half = max(ttl - 2 * self.max_skew, 1e-9) / 1.25 / 2
        return lm.LeaseBudget(half, half, 0.0, self.max_skew)

    def renew(self, leases: Sequence[ReadLease], *, timeout: Optional[float] = None
              ) -> list[Optional[errors.KvError]]:
        """Extend unexpired leases to a new TTL from now; a renewed lease's
        deadline restarts from when the renewal was sent. An expired one gets
        ``LeaseExpired`` (it cannot be rescued)."""
        if not leases:
            return []
        with self._lock:
            sent = time.monotonic()
            reply = self._call_master("renew", {"client": self.client_id,
                                                "leases": [l.lease for l in leases]},
                                      self._deadline(timeout))
            out: list[Optional[errors.KvError]] = []
            for l, item in zip(leases, wire.items_of(reply, len(leases))):
                err, value = wire.item_result(item)
                if err is None:
                    l.sent, l.ttl = sent, float(value["ttl"])
                    l.tickets = value.get("tickets", l.tickets)
                    self.lease_counters["renewals"] += 1
                else:
                    self.lease_counters["renewals_refused"] += 1
                out.append(err)
            return out

    def release(self, leases: Sequence[ReadLease], *, timeout: Optional[float] = None) -> None:
        """End the leases (the objects stay cached); one round trip. Raises
        ``LeaseExpired`` if one had already ended (the others are released)."""
        if not leases:
            return
        with self._lock:
            reply = self._call_master("release", {"client": self.client_id,
                                                  "leases": [l.lease for l in leases]},
                                      self._deadline(timeout))
            self.lease_counters["releases"] += len(leases)
            for item in wire.items_of(reply, len(leases)):
                err, _ = wire.item_result(item)
                if err is not None:   # already ended (expired, or a forced remove)
                    raise err

    def _check_leases(self, ks: list, leases: list, ttl: float, sent: float, started: float,
                      done_at: dict, results: list, skip: set) -> Optional[errors.KvError]:
        """The reader's acceptance check (``accept_transfer``) per leased key
        (``leases[i]``, 0 for none; not the keys in ``skip``); a late
        transfer's bytes are dropped, its rejection classified and counted."""
        c = self.lease_counters
        first: Optional[errors.KvError] = None
        queued = max(started - sent, 0.0)
        verified = time.monotonic()         # nothing reads the store after the transfer
        read = range(len(results)) if 0 not in leases and datapath.all_present(results) else \
            [i for i, (lease_id, got) in enumerate(zip(leases, results))
             if lease_id and got is not None]
        if skip:
            read = [i for i in read if i not in skip]
        if not read:
            return None
        dones = list(map(done_at.get, read, repeat(verified, len(read))))
        # the keys a batch read at once share their completion time: each
        # time is judged once (``accept_transfer`` depends on nothing else)
        judged = {done: lm.accept_transfer(sent, done, ttl, self.max_skew)
                  for done in dict.fromkeys(dones)}
        late = [] if all(judged.values()) else \
            [(i, done) for i, done in zip(read, dones) if not judged[done]]
        for i, done in late:
            results[i] = None              # never hand out bytes read past the lease
            phases = lm.ReadPhases(queued, max(done - started, 0.0), max(verified - done, 0.0))
            reason = lm.classify_rejection(phases, self._budget(ttl))
            c["lease_rejected"] += 1
            c[f"rejected_{reason.value}"] += 1
            first = first or errors.LeaseExpired(
                f"read of {ks[i]!r} completed {done - sent:.3f}s after its request, past its "
                f"lease ({ttl:.3f}s - skew {self.max_skew:.3f}s): {reason.value}")
        c["lease_accepted"] += len(read) - len(late)
        done = dones[-1]
        self.last_read = lm.ReadPhases(queued, max(done - started, 0.0), max(verified - done, 0.0))
        c["lease_reads"] += len(read)
        c["queued_s"] += queued * len(read)
        for done in judged:
            n = dones.count(done)
            c["transferring_s"] += n * max(done - started, 0.0)
            c["verifying_s"] += n * max(verified - done, 0.0)
        return first
