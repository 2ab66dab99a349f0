"""Prefill -> decode hand-off (``spec/Handoff.tla``) as pure,
sans-IO state machines.

A hand-off carries one request's KV from a prefill worker to a decode worker.
It is not the shared cache: its objects live in their own key space, are read
once, and are reclaimed once the decode side acknowledged its take-over or
their short TTL passed, never under a take-over's read (the read holds a read
lease, and the master refuses to remove a leased object). Publishing the same
KV into the long-term cache is each request's own choice, as separate objects
with the cache's retention.

Two machines, one per side, each stepped by the runtime
(:mod:`kvproto.engines.handoff`):

* :class:`Taker`, the decode side of one request (:func:`take_step`): at most
  ``max_attempts`` take-over attempts (:class:`Attempt`, a miss when the
  hand-off was not found), each read ending :class:`ReadFailed` or
  :class:`ReadDone`, then :class:`Ack`; once the attempts are spent,
  :class:`FallBack`: recompute if the process's shared recompute budget
  allowed it (the runtime asks its
  :class:`~kvproto.statemachines.failover.RecomputeLimiter`), else the
  request is refused;
* :class:`Retention`, one hand-off's objects (:func:`retention_step`):
  :class:`Publish`, :class:`Expire`, :class:`Reclaim` (refused unless the
  decode side acknowledged its take-over or the TTL passed: :func:`may_reclaim`)
  and :class:`Lose`.

:class:`System` composes them, with the store's read lease and a recompute
budget shared by every request, into the closed system the spec describes: its
actions (:data:`ACTIONS`) and invariants (:data:`INVARIANTS`) carry the spec's
names. Every step is ``(state, event) -> (state, effects)``; a refused event
returns the state unchanged and one :class:`Refused` effect.

Pure: no I/O, no clocks, no randomness.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Callable, Optional, Union

import attrs
import immutables

from kvproto import errors
from kvproto.checking.conformance import SpecBinding, emit
from kvproto.checking.tla import Fn, ModelValue, model_names
from kvproto.statemachines.refusal import Refused, accepted as _accepted, refuse as _refuse  # noqa: F401 (re-exported)

# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


class Obj(str, enum.Enum):
    NONE = "none"              # not (completely) stored yet
    STORED = "stored"          # every part and the ticket are published
    RECLAIMED = "reclaimed"    # removed by its retention
    LOST = "lost"              # a storage node holding it went away


class Cache(str, enum.Enum):
    NONE = "none"              # the request did not publish into the long-term cache
    PUBLISHED = "published"    # it did: separate objects, the cache's retention
    DROPPED = "dropped"        # never, unless the hand-off and the cache share objects


class Dec(str, enum.Enum):
    IDLE = "idle"              # between attempts (or before the first)
    READING = "reading"        # an attempt is reading the hand-off under a lease
    TAKEN = "taken"            # every part loaded and verified
    ACKED = "acked"            # take-over acknowledged (done)
    RECOMPUTED = "recomputed"  # attempts spent; recomputing (done)
    FAILED = "failed"          # attempts spent, budget spent: refused (done)


ENDED = frozenset({Dec.ACKED, Dec.RECOMPUTED, Dec.FAILED})


@attrs.frozen
class Taker:
    """The decode side of one request."""

    max_attempts: int
    dec: Dec = Dec.IDLE
    attempts: int = 0

    @property
    def attempts_left(self) -> int:
        return self.max_attempts - self.attempts


@attrs.frozen
class Retention:
    """One hand-off's objects, as their reclaimer sees them."""

    obj: Obj = Obj.NONE
    cache: Cache = Cache.NONE
    expired: bool = False


# --------------------------------------------------------------------------
# Events and effects
# --------------------------------------------------------------------------


@attrs.frozen
class Attempt:
    """``Attempt``: the decode side looked for the hand-off; ``found``: it is there."""

    found: bool


@attrs.frozen
class ReadFailed:
    """``ReadFails``: a part was missing, lost, corrupt or too slow."""


@attrs.frozen
class ReadDone:
    """``ReadDone``: every part loaded and verified."""


@attrs.frozen
class Ack:
    """``Ack``: the decode side acknowledges its take-over."""


@attrs.frozen
class FallBack:
    """``Recompute`` / ``Refuse``: the attempts are spent; ``allowed`` says
    whether the shared recompute budget gave one recompute."""

    allowed: bool


TakerEvent = Union[Attempt, ReadFailed, ReadDone, Ack, FallBack]


@attrs.frozen
class Publish:
    """``Publish``: every part and the ticket are stored; ``cache``: the request
    also published its KV into the long-term cache."""

    cache: bool = False


@attrs.frozen
class Expire:
    """``Expire``: the hand-off's TTL passed."""


@attrs.frozen
class Reclaim:
    """``Reclaim``: remove the hand-off's objects; ``acked``: the decode side
    acknowledged its take-over (only the decode side itself knows)."""

    acked: bool = False


@attrs.frozen
class Lose:
    """``Lose``: a storage node holding the hand-off went away."""


RetentionEvent = Union[Publish, Expire, Reclaim, Lose]


@attrs.frozen
class Read:
    """Read the hand-off (under a read lease), this is attempt ``attempt``."""

    attempt: int


@attrs.frozen
class Missed:
    """The hand-off was not there; ``left`` attempts remain."""

    left: int


@attrs.frozen
class Retry:
    """The read failed; ``left`` attempts remain."""

    left: int


@attrs.frozen
class TookOver:
    """The decode side has the request's KV: acknowledge, then reclaim."""


@attrs.frozen
class Recompute:
    """Recompute the request (one recompute taken from the budget)."""


@attrs.frozen
class Refuse:
    """Refuse the request: no take-over and no recompute left."""

    error: errors.KvError


@attrs.frozen
class Removable:
    """The hand-off's objects may be removed now."""


# --------------------------------------------------------------------------
# The decode side
# --------------------------------------------------------------------------


def take_step(t: Taker, ev: TakerEvent):
    """One step of the decode side of one request (spec actions ``Attempt``,
    ``ReadFails``, ``ReadDone``, ``Ack``, ``Recompute``, ``Refuse``)."""
    if isinstance(ev, Attempt):
        if t.dec is not Dec.IDLE:
            return _refuse(t, errors.InvalidArgument(f"an attempt while {t.dec.value}"))
        if t.attempts >= t.max_attempts:
            return _refuse(t, errors.HandoffUnavailable(f"all {t.max_attempts} attempts were made"))
        n = t.attempts + 1
        if ev.found:
            return attrs.evolve(t, dec=Dec.READING, attempts=n), (Read(n),)
        return attrs.evolve(t, attempts=n), (Missed(t.max_attempts - n),)
    if isinstance(ev, (ReadFailed, ReadDone)):
        if t.dec is not Dec.READING:
            return _refuse(t, errors.InvalidArgument(f"a read ended while {t.dec.value}"))
        if isinstance(ev, ReadDone):
            return attrs.evolve(t, dec=Dec.TAKEN), (TookOver(),)
        return attrs.evolve(t, dec=Dec.IDLE), (Retry(t.attempts_left),)
    if isinstance(ev, Ack):
        if t.dec is not Dec.TAKEN:
            return _refuse(t, errors.InvalidArgument(f"an ack while {t.dec.value}"))
        return attrs.evolve(t, dec=Dec.ACKED), (Removable(),)
    if isinstance(ev, FallBack):
        if t.dec is not Dec.IDLE or t.attempts < t.max_attempts:
            return _refuse(t, errors.InvalidArgument(
                f"no fall-back while {t.dec.value} with {t.attempts_left} attempts left"))
        if ev.allowed:
            return attrs.evolve(t, dec=Dec.RECOMPUTED), (Recompute(),)
        return attrs.evolve(t, dec=Dec.FAILED), (Refuse(errors.RecomputeLimited(
            f"the take-over failed {t.max_attempts} times and the recompute budget is spent")),)
    raise TypeError(f"not a decode-side event: {ev!r}")


# --------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------


def may_reclaim(s: Retention, acked: bool) -> bool:
    """Spec ``MayReclaim``: the take-over was acknowledged, or the TTL passed."""
    return acked or s.expired


def reclaimed_cache(s: Retention) -> Cache:
    """Spec ``CacheAfterReclaim``: the long-term copy is other objects; it stays."""
    return s.cache


def retention_step(s: Retention, ev: RetentionEvent):
    """One step of a hand-off's objects (spec ``Publish``, ``Expire``,
    ``Reclaim``, ``Lose``). The read lease that also guards ``Reclaim`` is the
    master's (a remove under a lease is refused), not this machine's."""
    if isinstance(ev, Publish):
        if s.obj is not Obj.NONE:
            return _refuse(s, errors.KeyExists("the hand-off was already published"))
        return attrs.evolve(s, obj=Obj.STORED, cache=Cache.PUBLISHED if ev.cache else Cache.NONE), ()
    if s.obj is not Obj.STORED:
        return _refuse(s, errors.KeyNotFound(f"the hand-off is {s.obj.value}"))
    if isinstance(ev, Expire):
        if s.expired:
            return _refuse(s, errors.InvalidArgument("the hand-off already expired"))
        return attrs.evolve(s, expired=True), (Removable(),)
    if isinstance(ev, Reclaim):
        if not may_reclaim(s, ev.acked):
            return _refuse(s, errors.HandoffRetained("neither acknowledged nor past its TTL"))
        return attrs.evolve(s, obj=Obj.RECLAIMED, cache=reclaimed_cache(s)), ()
    if isinstance(ev, Lose):
        return attrs.evolve(s, obj=Obj.LOST), ()
    raise TypeError(f"not a retention event: {ev!r}")


# --------------------------------------------------------------------------
# The closed system of the spec
# --------------------------------------------------------------------------


@attrs.frozen
class Request:
    retention: Retention
    taker: Taker


@attrs.frozen(cache_hash=True)
class System:
    requests: immutables.Map     # request -> Request
    budget: int                  # recomputes left
    total: int                   # the spec's Budget

    @classmethod
    def initial(cls, requests, max_attempts: int, budget: int) -> "System":
        return cls(immutables.Map({r: Request(Retention(), Taker(max_attempts)) for r in requests}),
                   budget, budget)

    def _with(self, r: str, req: Request, **changes) -> "System":
        return attrs.evolve(self, requests=self.requests.set(r, req), **changes)


def _take(sys: System, r: str, ev: TakerEvent) -> Optional[System]:
    req = sys.requests[r]
    taker, effects = take_step(req.taker, ev)
    return sys._with(r, attrs.evolve(req, taker=taker)) if _accepted(effects) else None


def _keep(sys: System, r: str, ev: RetentionEvent) -> Optional[System]:
    req = sys.requests[r]
    retention, effects = retention_step(req.retention, ev)
    return sys._with(r, attrs.evolve(req, retention=retention)) if _accepted(effects) else None


def not_read(req: Request) -> bool:
    """Spec ``NotRead``: no take-over holds a read lease on the hand-off."""
    return req.taker.dec is not Dec.READING


def sys_publish(sys: System, r: str, p: bool) -> Optional[System]:
    return _keep(sys, r, Publish(p))


def sys_attempt(sys: System, r: str) -> Optional[System]:
    return _take(sys, r, Attempt(sys.requests[r].retention.obj is Obj.STORED))


def sys_read_fails(sys: System, r: str) -> Optional[System]:
    return _take(sys, r, ReadFailed())


def sys_read_done(sys: System, r: str) -> Optional[System]:
    """Spec ``ReadDone``: only while the hand-off is still stored."""
    if sys.requests[r].retention.obj is not Obj.STORED:
        return None
    return _take(sys, r, ReadDone())


def sys_ack(sys: System, r: str) -> Optional[System]:
    return _take(sys, r, Ack())


def sys_expire(sys: System, r: str) -> Optional[System]:
    return _keep(sys, r, Expire())


def sys_reclaim(sys: System, r: str) -> Optional[System]:
    req = sys.requests[r]
    if not not_read(req):
        return None                  # the master refuses: ObjectLeased
    return _keep(sys, r, Reclaim(acked=req.taker.dec is Dec.ACKED))


def sys_lose(sys: System, r: str) -> Optional[System]:
    return _keep(sys, r, Lose())


def may_recompute(budget: int) -> bool:
    """Spec ``MayRecompute``."""
    return budget > 0


def sys_recompute(sys: System, r: str) -> Optional[System]:
    if not may_recompute(sys.budget):
        return None
    new = _take(sys, r, FallBack(allowed=True))
    return None if new is None else attrs.evolve(new, budget=sys.budget - 1)


def sys_refuse(sys: System, r: str) -> Optional[System]:
    if sys.budget != 0:
        return None
    return _take(sys, r, FallBack(allowed=False))


#: The spec's actions, each a function on :class:`System` returning the
#: successor or ``None`` when the action is not enabled.
ACTIONS: dict[str, Callable[..., Optional[System]]] = {
    "Publish": sys_publish,
    "Attempt": sys_attempt,
    "ReadFails": sys_read_fails,
    "ReadDone": sys_read_done,
    "Ack": sys_ack,
    "Expire": sys_expire,
    "Reclaim": sys_reclaim,
    "Lose": sys_lose,
    "Recompute": sys_recompute,
    "Refuse": sys_refuse,
}

# --------------------------------------------------------------------------
# Invariants (spec names in INVARIANTS)
# --------------------------------------------------------------------------


def type_ok(sys: System) -> bool:
    """Spec ``TypeOK``."""
    return all(isinstance(q.retention.obj, Obj) and isinstance(q.retention.cache, Cache)
               and isinstance(q.taker.dec, Dec) and q.taker.attempts >= 0
               for q in sys.requests.values())


def no_reclaim_before_ack_or_expiry(sys: System) -> bool:
    """Spec ``NoReclaimBeforeAckOrExpiry``."""
    return all(q.retention.obj is not Obj.RECLAIMED or q.taker.dec is Dec.ACKED or q.retention.expired
               for q in sys.requests.values())


def no_reclaim_under_read(sys: System) -> bool:
    """Spec ``NoReclaimUnderRead``."""
    return all(q.taker.dec is not Dec.READING or q.retention.obj is not Obj.RECLAIMED
               for q in sys.requests.values())


def take_over_of_published(sys: System) -> bool:
    """Spec ``TakeOverOfPublished``."""
    return all(q.taker.dec not in (Dec.TAKEN, Dec.ACKED) or q.retention.obj is not Obj.NONE
               for q in sys.requests.values())


def retries_bounded(sys: System) -> bool:
    """Spec ``RetriesBounded``."""
    return all(q.taker.attempts <= q.taker.max_attempts for q in sys.requests.values())


def recompute_only_after_retries(sys: System) -> bool:
    """Spec ``RecomputeOnlyAfterRetries``."""
    return all(q.taker.dec is not Dec.RECOMPUTED or q.taker.attempts == q.taker.max_attempts
               for q in sys.requests.values())


def recompute_within_budget(sys: System) -> bool:
    """Spec ``RecomputeWithinBudget``."""
    done = sum(q.taker.dec is Dec.RECOMPUTED for q in sys.requests.values())
    return sys.budget >= 0 and done + sys.budget == sys.total


def cache_outlives_handoff(sys: System) -> bool:
    """Spec ``CacheOutlivesHandoff``."""
    return all(q.retention.cache is not Cache.DROPPED for q in sys.requests.values())


INVARIANTS: dict[str, Callable[[System], bool]] = {
    "TypeOK": type_ok,
    "NoReclaimBeforeAckOrExpiry": no_reclaim_before_ack_or_expiry,
    "NoReclaimUnderRead": no_reclaim_under_read,
    "TakeOverOfPublished": take_over_of_published,
    "RetriesBounded": retries_bounded,
    "RecomputeOnlyAfterRetries": recompute_only_after_retries,
    "RecomputeWithinBudget": recompute_within_budget,
    "CacheOutlivesHandoff": cache_outlives_handoff,
}

# --------------------------------------------------------------------------
# Model constants, successors and the mapping (conformance)
# --------------------------------------------------------------------------


@attrs.frozen
class Constants:
    requests: tuple[str, ...]
    max_attempts: int
    budget: int

    @classmethod
    def from_tla(cls, consts: Mapping) -> "Constants":
        return cls(model_names(consts["Requests"]), consts["MaxAttempts"], consts["Budget"])

    def initial(self) -> System:
        return System.initial(self.requests, self.max_attempts, self.budget)


def successors(sys: System, c: Constants) -> Iterator[tuple[str, System]]:
    """All ``(action name, next state)`` pairs, as TLC's ``Next`` generates them."""
    for r in c.requests:
        for p in (False, True):
            yield from emit("Publish", sys_publish(sys, r, p))
        for name in ("Attempt", "ReadFails", "ReadDone", "Ack", "Expire", "Reclaim", "Lose",
                     "Recompute", "Refuse"):
            yield from emit(name, ACTIONS[name](sys, r))


def to_tla(sys: System, c: Constants) -> Fn:
    """The stated mapping: requests are model values of the same name; each
    state is the spec's string; ``expired`` is the set of expired requests."""
    reqs = [(ModelValue(r), sys.requests[r]) for r in c.requests]
    return Fn.of({
        "obj": Fn.of({m: q.retention.obj.value for m, q in reqs}),
        "cache": Fn.of({m: q.retention.cache.value for m, q in reqs}),
        "dec": Fn.of({m: q.taker.dec.value for m, q in reqs}),
        "attempts": Fn.of({m: q.taker.attempts for m, q in reqs}),
        "expired": frozenset(m for m, q in reqs if q.retention.expired),
        "budget": sys.budget,
    })


BINDING = SpecBinding(
    module="Handoff",
    constants=Constants.from_tla,
    initial=lambda c: [c.initial()],
    successors=successors,
    to_tla=to_tla,
    actions=ACTIONS,
    invariants=INVARIANTS,
)
