"""Prefill -> decode hand-off on kvproto (``spec/Handoff.tla``,
``docs/protocols/handoff.md``).

A prefill worker hands one request's KV to a decode worker. This is not the
shared cache: the hand-off's objects have their own key space, one per
request::

    kvph1/<tenant>/<expiry, ms since the epoch>/<request>/c<chunk>r<rank>g<group>   the parts
    kvph1/<tenant>/<expiry, ms since the epoch>/<request>/t                         the ticket

and their own retention: they are reclaimed once the decode side took the KV
over and acknowledged it (it removes them itself: consumed once), or, once
the expiry in their keys passed, by a sweep (:func:`sweep`, run by any
process; the sender runs one). Because the expiry is in every key, a sweep
finds expired parts even when their ticket is gone.

* :class:`HandoffSender` (prefill): :meth:`~HandoffSender.offer` stores every
  part (chunk objects: :mod:`kvproto.engines.chunks`, each checked by its
  digest, layout tag and chunk identity when read), then the ticket; the
  hand-off exists for readers only once its ticket does (spec ``Publish``).
  With ``publish_chunks`` the request also stores its leading full chunks
  into the long-term cache, as separate objects of the cache's namespace
  (the per-request choice). The descriptor it returns is what the
  router passes to the decode worker.
* :class:`HandoffReceiver` (decode): :meth:`~HandoffReceiver.take` makes at
  most ``attempts`` take-over attempts; each takes a read lease on the ticket
  (so that no sweep reclaims the hand-off under the read: the master refuses
  to remove a leased object), loads and checks every part, and either takes
  the KV over (then acknowledges by removing the hand-off) or fails; once the
  attempts are spent it recomputes if the process's recompute budget allows
  (by default the client's ``may_recompute``, the token bucket that also
  bounds the fall-back during a master failover), else the request is refused.

Every decision is a step of the machines of
:mod:`kvproto.statemachines.handoff` (``Taker``, ``Retention``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Optional

import attrs

from kvproto import errors
from kvproto.engines.chunks import ChunkStore, Sink
from kvproto.engines.prefix import Chunk
from kvproto.statemachines import handoff as H
from kvproto.statemachines.refusal import Refused

PREFIX = "kvph1"
_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise errors.InvalidArgument(f"{what} must be 1..128 of A-Z a-z 0-9 . _ : -, not {value!r}")
    return value


@attrs.frozen
class HandoffKeys:
    """The key space of one request's hand-off (used by :class:`ChunkStore`
    in place of a cache namespace)."""

    tenant: str
    expiry_ms: int
    request: str
    ranks: int = 1
    layer_groups: int = 1

    @property
    def prefix(self) -> str:
        return f"{PREFIX}/{self.tenant}/{self.expiry_ms:013d}/{self.request}/"

    @property
    def ticket(self) -> str:
        return self.prefix + "t"

    @property
    def parts(self) -> int:
        return self.ranks * self.layer_groups

    def object_key(self, chunk: Chunk, rank: int = 0, group: int = 0) -> str:
        return f"{self.prefix}c{chunk.index}r{rank}g{group}"

    def object_keys(self, chunk: Chunk) -> tuple:
        return tuple(self.object_key(chunk, r, g) for r in range(self.ranks) for g in range(self.layer_groups))

    @classmethod
    def of(cls, descriptor: dict) -> "HandoffKeys":
        """The key space a descriptor (:meth:`HandoffSender.offer`) names."""
        try:
            return cls(_name(descriptor["tenant"], "tenant"), int(descriptor["expiry_ms"]),
                       _name(descriptor["request"], "request"), int(descriptor["ranks"]),
                       int(descriptor["groups"]))
        except (KeyError, TypeError, ValueError) as e:
            raise errors.InvalidArgument(f"not a hand-off descriptor: {descriptor!r} ({e})") from None


def _remove_all(client, keys: Sequence[str]) -> bool:
    """Remove ``keys`` (the ticket first); False when one was refused because a
    read holds it (the rest is left for the next try)."""
    for key in keys:
        try:
            client.remove(key)
        except errors.KeyNotFound:
            continue
        except (errors.ObjectLeased, errors.ObjectBusy, errors.NotPublished):
            return False
    return True


# --------------------------------------------------------------------------- prefill


class HandoffSender:
    """The prefill side: stores hand-offs in ``store``'s client (``store`` is
    the model's :class:`ChunkStore`, whose namespace is the long-term cache)."""

    def __init__(self, store: ChunkStore, *, tenant: str = "default", ttl: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not ttl > 0:
            raise errors.InvalidArgument(f"ttl must be > 0 seconds, not {ttl!r}")
        self.store, self.client = store, store.client
        self.tenant = _name(tenant, "tenant")
        self.ttl, self.clock = float(ttl), clock
        self.retention: dict[str, H.Retention] = {}

    def offer(self, request: str, tokens: int, parts: Sequence[tuple], *, rank_count: int = 1,
              groups: int = 1, publish_chunks: int = 0) -> dict:
        """Store ``request``'s KV (``(chunk, rank, group, object)`` parts covering
        ``tokens`` tokens) as a hand-off, then its ticket; the leading
        ``publish_chunks`` chunks also go into the long-term cache. Returns the
        descriptor for the decode side (``HandoffUnavailable`` when a part could
        not be stored: the stored ones expire with the hand-off)."""
        request = _name(request, "request")
        keys = HandoffKeys(self.tenant, int((self.clock() + self.ttl) * 1000), request, rank_count, groups)
        failed = [e for e in self.store.save(parts, keys) if e is not None]
        if failed:
            raise errors.HandoffUnavailable(f"{len(failed)} of {len(parts)} parts were not stored: {failed[0]}")
        cached = [p for p in parts if p[0].index < publish_chunks]
        if cached:   # the long-term copy: the cache's own objects and retention
            self.store.save(cached)
        descriptor = {"tenant": self.tenant, "expiry_ms": keys.expiry_ms, "request": request,
                      "ranks": rank_count, "groups": groups, "tokens": int(tokens),
                      "chunks": len({p[0].index for p in parts}), "layout": self.store.layout,
                      "last": max(parts, key=lambda p: p[0].index)[0].digest.hex() if parts else ""}
        self.client.put(keys.ticket, json.dumps(descriptor).encode())
        self.retention[request], _ = H.retention_step(H.Retention(), H.Publish(cache=bool(cached)))
        return descriptor

    def sweep(self) -> set:
        """:func:`sweep` of this sender's tenant (run it every few seconds)."""
        gone = sweep(self.client, self.tenant, now=self.clock())
        for request in gone:
            self.retention.pop(request, None)
        return gone


def sweep(client, tenant: str = "default", *, now: Optional[float] = None, skew: float = 1.0) -> set:
    """Reclaim every hand-off of ``tenant`` whose expiry passed (by more than
    ``skew`` seconds of clock error): its ticket first, then its parts. A
    hand-off whose ticket a take-over holds a read lease on is left alone
    (the master refuses the remove). Returns the requests reclaimed."""
    now = time.time() if now is None else now
    groups: dict[str, list[str]] = {}
    for raw in client.keys(f"{PREFIX}/{_name(tenant, 'tenant')}/".encode()):
        key = raw.decode()
        parts = key.split("/")
        if len(parts) != 5:
            continue
        groups.setdefault("/".join(parts[:4]), []).append(key)
    done = set()
    for prefix, keys in groups.items():
        expiry_ms = int(prefix.split("/")[2])
        state = H.Retention(obj=H.Obj.STORED, expired=now * 1000 > expiry_ms + skew * 1000)
        state, effects = H.retention_step(state, H.Reclaim(acked=False))
        if effects and isinstance(effects[0], Refused):
            continue                                    # retained: neither acked nor expired
        keys.sort(key=lambda k: not k.endswith("/t"))   # the ticket first
        if _remove_all(client, keys):
            done.add(prefix.split("/")[3])
    return done


# --------------------------------------------------------------------------- decode


@attrs.frozen
class TakeOver:
    """How :meth:`HandoffReceiver.take` ended: ``outcome`` is ``"taken"`` (the
    sink has every part), ``"recompute"`` or ``"refused"`` (``error`` says why);
    ``attempts`` made, and per attempt what failed."""

    outcome: str
    attempts: int
    failures: tuple
    error: Optional[errors.KvError] = None

    @property
    def taken(self) -> bool:
        return self.outcome == "taken"


class HandoffReceiver:
    """The decode side: takes hand-offs over through ``store`` (the model's
    :class:`ChunkStore`, whose layout the hand-off must have)."""

    def __init__(self, store: ChunkStore, *, attempts: int = 3, retry_interval: float = 0.2,
                 may_recompute: Optional[Callable[[], bool]] = None) -> None:
        if attempts < 1:
            raise errors.InvalidArgument(f"attempts must be >= 1, not {attempts}")
        self.store, self.client = store, store.client
        self.attempts = attempts
        self.retry_interval = float(retry_interval)
        self.may_recompute = may_recompute or self.client.may_recompute

    def take(self, descriptor: dict, chunks: Sequence[Chunk], sink: Sink, *, rank: int = 0) -> TakeOver:
        """Take over the hand-off ``descriptor`` names: its parts of ``chunks``
        (this rank's, every layer group) go to ``sink`` (called again for a part
        a later attempt loads again). Then acknowledge by removing it."""
        keys = HandoffKeys.of(descriptor)
        taker = H.Taker(self.attempts)
        failures: list = []
        while True:
            lease, why = self._find(keys, descriptor, chunks)
            taker, effects = H.take_step(taker, H.Attempt(found=lease is not None))
            (effect,) = effects
            if isinstance(effect, H.Read):
                try:
                    # a part that fails its check is left to the hand-off's retention
                    result = self.store.load(chunks, sink, rank=rank, namespace=keys, drop_bad=False)
                    ok = result.usable == len(chunks)
                    why = None if ok else next(iter(result.errors.values()), errors.HandoffUnavailable(
                        f"{result.usable} of {len(chunks)} chunks loaded"))
                finally:
                    self._release(lease)
                taker, (effect,) = H.take_step(taker, H.ReadDone() if ok else H.ReadFailed())
                if isinstance(effect, H.TookOver):
                    taker, _ = H.take_step(taker, H.Ack())
                    self._reclaim(keys, chunks)
                    return TakeOver("taken", taker.attempts, tuple(failures))
            failures.append(why)
            if taker.attempts_left:
                time.sleep(self.retry_interval)
                continue
            taker, (effect,) = H.take_step(taker, H.FallBack(allowed=self.may_recompute()))
            if isinstance(effect, H.Recompute):
                return TakeOver("recompute", taker.attempts, tuple(failures))
            return TakeOver("refused", taker.attempts, tuple(failures), effect.error)

    def _find(self, keys: HandoffKeys, descriptor: dict, chunks: Sequence[Chunk]):
        """A read lease on the ticket, once it is there and matches; else ``(None, why)``."""
        try:
            (lease,) = self.client.read_begin([keys.ticket])
        except errors.KvError as e:
            return None, e
        if lease is None:
            return None, errors.KeyNotFound(f"no hand-off ticket {keys.ticket}")
        try:
            ticket = json.loads(bytes(self.client.get(keys.ticket)))
            if ticket.get("layout") != self.store.layout:
                raise errors.LayoutMismatch(f"the hand-off is {ticket.get('layout')!r}, "
                                            f"this engine {self.store.layout!r}")
            if ticket.get("chunks") != len(chunks) or ticket.get("tokens") != chunks[-1].end \
                    or ticket.get("last") != chunks[-1].digest.hex():
                raise errors.HandoffUnavailable(f"the hand-off holds {ticket.get('tokens')} tokens in "
                                                f"{ticket.get('chunks')} chunks, not these {chunks[-1].end}")
        except (errors.KvError, ValueError) as e:
            self._release(lease)
            return None, e if isinstance(e, errors.KvError) else errors.ChecksumMismatch(str(e))
        return lease, None

    def _release(self, lease) -> None:
        try:
            self.client.release([lease])
        except errors.KvError:
            pass

    def _reclaim(self, keys: HandoffKeys, chunks: Sequence[Chunk]) -> None:
        """Consumed once: the acknowledged take-over removes the hand-off (a part
        still being released by the read is left to the sweep)."""
        state, effects = H.retention_step(H.Retention(obj=H.Obj.STORED), H.Reclaim(acked=True))
        assert not (effects and isinstance(effects[0], Refused))
        parts = [keys.ticket] + [k for c in chunks for k in keys.object_keys(c)]
        deadline = time.monotonic() + 1.0
        while not _remove_all(self.client, parts) and time.monotonic() < deadline:
            time.sleep(0.01)
