"""A master's tenancy checks (``spec/Tenancy.tla``; docs/protocols/tenancy.md,
"In the runtime").

A master started with a tenants file (``kvproto master --tenants FILE``) holds
a :class:`Tenants`: the :class:`~kvproto.ops.tenants.Registry` (the tenancy
machine's state) and the glue between it and the master's requests.

* :meth:`Tenants.admit`, on every request before anything else runs:
  authenticate the credential (``Unauthorized``: nothing else runs), then
  name everything the request names in the tenant's own words: its client
  sessions (``tenant/client``, so no tenant can end another's attempts or
  pins) and its keys (:func:`~kvproto.ops.tenants.object_key` of the
  namespace it names and the key, so the same key string in two namespaces
  names two objects). Only the owner of a namespace writes or removes in it;
  ``exists`` and ``list`` need the owner or a read grant.
* Each registry step comes *before* the publish or lease machine's step it
  guards. A check that must pass first is taken with
  :meth:`~kvproto.ops.tenants.Registry.check` (nothing changes) and committed
  with :meth:`~kvproto.ops.tenants.Registry.step` once the guarded step is
  accepted, so a refused request changes neither machine.
* The publish machine's effects are mirrored: a publish is ``WriteEnd``, a
  pending attempt revoked, reclaimed or lost is ``WriteAbort``, a published
  object removed, evicted or lost is ``Remove`` by its owner (after its reads
  are released: the bytes are gone).

Storage-plane requests (a storage node's ``register``, heartbeats, drains,
repair reports and ``deregister``) are not a tenant's and carry no tenant credential.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Container, Hashable, Iterable, Iterator, Sequence
from typing import Callable, Optional

from kvproto import errors
from kvproto.ops.tenants import (
    DEFAULT_NAMESPACE, REPAIR_READER, UNLIMITED, Namespace, Registry, TenantConfig, Tickets,
    namespace_name, object_key, split_object_key,
)
from kvproto.runtime import wire
from kvproto.statemachines import tenancy as tm

log = logging.getLogger("kvproto.master")

#: requests of the storage nodes, not of a tenant
STORAGE_PLANE = frozenset({"register", "storage_heartbeat", "storage_drained", "repair_done",
                           "deregister"})
#: requests only a namespace's owner may make in it
OWNER_OPS = frozenset({"put_start", "put_end", "put_revoke", "put_abandon", "remove"})
#: lookups that need the owner or a read grant (``read_begin``: ``Begin`` per key)
LOOKUP_OPS = frozenset({"exists", "list"})
#: the upgrade lifecycle's ops after ``ns_create``: the machine's step of each
LIFECYCLE = {"ns_prewarm": tm.PreWarm, "ns_switch": tm.Switch, "ns_route_back": tm.RouteBack,
             "ns_drop": tm.Drop}
#: how many objects of retiring namespaces one pass of :meth:`Tenants.aged` names
AGE_OUT_BATCH = 4096


class Tenants:
    """The registry of a master and its checks (see the module docstring).
    ``clock`` is the master's: the machine's time is an argument of each step."""

    def __init__(self, configs: Sequence[TenantConfig], *, ttl: float,
                 clock: Callable[[], float], ticket_key: Optional[bytes] = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        #: the read tickets this master issues (``ticket_key``, shared with its
        #: storage nodes; none given: a key of its own, which no node accepts)
        self.tickets = Tickets(ticket_key or secrets.token_bytes(32))
        self.wall = wall
        # memory is the allocator's and the eviction policy's: the registry
        # counts each tenant's bytes against its quotas, not the store's room
        self.registry = Registry(configs, capacity=UNLIMITED, ttl=ttl, now=clock())
        #: retiring namespaces that may still hold objects (spec ``AgeOut``)
        self.aging: set[Namespace] = set()
        #: directory keys a new master recovered that the registry cannot
        #: take (:meth:`recovered`): removed once their inherited leases end
        self.orphans: list[bytes] = []

    def __repr__(self) -> str:
        return f"Tenants({self.registry!r})"

    # ------------------------------------------------------------------ requests

    def admit(self, op: str, body: dict) -> dict:
        """Authenticate ``body``'s credential and name what it names in its
        tenant's words (in place): ``tenant``, ``namespace``, the client
        session, the directory keys. Raises the typed refusal."""
        if op in STORAGE_PLANE:
            return body
        reg = self.registry
        tenant = reg.authenticate(body.get("cred"))
        body["tenant"] = tenant
        if "client" in body:
            body["client"] = f"{tenant}/{body['client']}"
        if op not in wire.KEYED_OPS:
            return body
        ns = reg.namespace(tenant, body.get("ns", DEFAULT_NAMESPACE))
        body["namespace"] = ns
        if op in OWNER_OPS and ns[0] != tenant:
            raise errors.AccessDenied(f"tenant {tenant!r} does not own namespace "
                                      f"{'/'.join(ns)!r}: only its owner writes or removes in it")
        if op in LOOKUP_OPS and not reg.state.may_read(tenant, ns):
            raise errors.AccessDenied(f"tenant {tenant!r} holds no grant on namespace "
                                      f"{'/'.join(ns)!r}")
        if "keys" in body:
            body["keys"] = [self.key(ns, k) for k in body["keys"]]
        if "items" in body:
            # [key, length], [key, token] or [key, token, checksum]
            body["items"] = [(self.key(ns, item[0]), *item[1:]) for item in body["items"]]
        if op == "list":
            body["prefix"] = object_key(ns, body.get("prefix", b""))
            body["after"] = object_key(ns, body.get("after", b""))
        return body

    @staticmethod
    def key(ns: Namespace, key: bytes) -> bytes:
        """The directory key of ``key`` in ``ns`` (bounded like any key)."""
        okey = object_key(ns, key)
        if len(okey) > wire.MAX_KEY_BYTES:
            raise errors.InvalidArgument(f"key of {len(key)} bytes: with its namespace it "
                                         f"exceeds {wire.MAX_KEY_BYTES} bytes")
        return okey

    @staticmethod
    def prefix(ns: Namespace) -> bytes:
        """What every directory key of ``ns`` starts with."""
        return object_key(ns, b"")

    @staticmethod
    def strip(ns: Namespace, keys: list) -> list:
        """Directory keys of ``ns`` as its tenant named them."""
        n = len(object_key(ns, b""))
        return [k[n:] for k in keys]

    def check(self, event: tm.Event) -> tm.Event:
        """``event`` if the machine accepts it now (nothing changes), else its
        typed refusal."""
        self.registry.check(event, self.clock())
        return event

    def commit(self, event: tm.Event) -> None:
        """Step a checked event, once the step it guards was accepted."""
        try:
            self.registry.step(event, self.clock())
        except errors.KvError as err:  # cannot happen while the tables agree
            log.error("tenancy machine refused %r: %s", event, err)

    def write_start(self, tenant: str, dkey: bytes, size: int) -> tm.WriteStart:
        """Spec ``WriteStart``, checked before the allocation: the owner, a
        writable namespace, the quotas (bytes held, write bandwidth, in flight)."""
        ns, key = split_object_key(dkey)
        return self.check(tm.WriteStart(tenant, ns, key, size))

    def begin(self, holder: Hashable, tenant: str, dkey: bytes) -> tm.Begin:
        """Spec ``Begin``, checked before ``ReadBegin``: the grant, then the
        object in the read's own namespace, then the in-flight quota."""
        ns, key = split_object_key(dkey)
        return self.check(tm.Begin(holder, tenant, ns, key))

    def renew(self, holder: Hashable, tenant: str) -> Optional[tm.Renew]:
        """Spec ``Renew``, checked before the lease machine's: the reader may
        still read the namespace (a revoked grant's lease is not renewed)."""
        read = self.registry.state.reads.get(holder)
        if read is None:
            return None
        if read.tenant != tenant:
            raise errors.AccessDenied(f"lease {holder!r} is not tenant {tenant!r}'s")
        return self.check(tm.Renew(holder))

    def read_tickets(self, tenant: str, token: int, replicas: Sequence) -> list:
        """One read ticket per replica (``segment``, ``offset``) of the object
        ``token`` names, for ``tenant``, expiring one lease TTL from now on
        the wall clock (spec ``Begin``'s ticket; checked by the nodes:
        ``NodeAdmits``)."""
        expires = int((self.wall() + self.registry.state.ttl) * 1000)
        return [self.tickets.issue(tenant, r.segment, r.offset, token, expires) for r in replicas]

    def repair_ticket(self, segment: str, offset: int, token: int, ttl: float) -> list:
        """The read ticket of a repair copy's source replica (``segment``,
        ``offset``) of the object ``token`` names, issued to
        :data:`~kvproto.ops.tenants.REPAIR_READER` and expiring ``ttl``
        seconds from now (the repair's timeout: it cannot outlive the copy).
        A repair is the store's, not a tenant's: it needs no grant and spends
        none of the owner's quotas (docs/protocols/tenancy.md)."""
        expires = int((self.wall() + ttl) * 1000)
        return self.tickets.issue(REPAIR_READER, segment, offset, token, expires)

    def renewed_tickets(self, holder: Hashable, objects) -> list:
        """Fresh read tickets for renewed read ``holder`` (its lease runs one
        TTL from now), from the directory's record of its object."""
        read = self.registry.state.reads.get(holder)
        record = objects.get(object_key(read.src, read.key)) if read is not None else None
        if record is None:
            return []
        return self.read_tickets(read.tenant, record.token, record.replicas)

    def release(self, holder: Hashable) -> None:
        """Spec ``Release``: the read ended (released or its lease expired)."""
        if holder in self.registry.state.reads:
            self.commit(tm.Release(holder))

    def may_remove(self, tenant: str, dkey: bytes, force: bool) -> None:
        """Spec ``Remove``'s check by the namespace's owner, before the lease
        machine's; ``force`` (the owner's) passes an object under a lease."""
        ns, key = split_object_key(dkey)
        try:
            self.check(tm.Remove(tenant, ns, key))
        except errors.ObjectLeased:
            if not force:
                raise

    def may_evict(self, dkey: bytes) -> bool:
        """Whether the watermark policy may take ``dkey``: its owner holds more
        than its reserve (a tenant within its reserve never loses bytes to
        eviction, spec ``FairEviction``), and ``Remove`` by the owner is accepted."""
        o = _split(dkey)
        if o is None:
            return False
        (owner, name), key = o
        t = self.registry.state.tenants.get(owner)
        if t is None or t.held <= t.quota.reserve:
            return False
        try:
            self.check(tm.Remove(owner, (owner, name), key))
        except errors.KvError:
            return False
        return True

    def fair(self, candidates: Iterable[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
        """The eviction ``candidates`` (``(key, size)``, in the policy's order)
        the watermark policy may take one after another: each owner's bytes
        only while it holds more than its reserve, counting those already
        taken (spec ``FairEviction``; a tenant within its reserve never loses
        bytes to eviction)."""
        state = self.registry.state
        held = {name: t.held for name, t in state.tenants.items()}
        for key, size in candidates:
            o = _split(key)
            obj = state.objects.get(o) if o is not None else None
            if obj is None or held[obj.owner] <= state.tenants[obj.owner].quota.reserve:
                continue
            held[obj.owner] -= obj.size
            yield key, size

    # ------------------------------------------------------------------ the publish machine's effects

    def published(self, dkey: bytes) -> None:
        """Spec ``WriteEnd``."""
        self.commit(tm.WriteEnd(*split_object_key(dkey)))

    def abandoned(self, dkey: bytes) -> None:
        """Spec ``WriteAbort``: a pending attempt revoked, reclaimed or lost."""
        self.commit(tm.WriteAbort(*split_object_key(dkey)))

    def removed(self, dkey: bytes) -> None:
        """A published object left the directory (removed, evicted or lost):
        :meth:`removed_many` of it alone."""
        self.removed_many((dkey,))

    def removed_many(self, dkeys: Iterable[bytes]) -> None:
        """Published objects left the directory (removed, evicted or a lost
        segment's): for each, its reads end (``Release``) and its owner's
        bytes are freed (``AgeOut`` in a retiring namespace, else ``Remove``
        by its owner), in one pass (``TenancyCore.drop_many``). Keys of no
        tenant's object (orphans, see :meth:`recovered`) are passed over."""
        for refused in self.registry.drop_many(_walk(dkeys), self.clock()):
            log.error("tenancy machine refused a drop: %s", refused.error)

    # ------------------------------------------------------------------ the upgrade lifecycle

    def create(self, body: dict) -> None:
        """Spec ``Create``: namespace ``body["ns"]`` of the requesting tenant, a
        canary upgrading its live namespace ``body["previous"]``."""
        tenant = body["tenant"]
        owner, _, name = body["ns"].rpartition("/")
        if owner and owner != tenant:
            raise errors.AccessDenied(f"tenant {tenant!r} creates namespaces of its own only")
        previous = self.registry.namespace(tenant, body["previous"])
        self.registry.step(tm.Create(tenant, (tenant, namespace_name(name)), previous),
                           self.clock())

    def lifecycle(self, op: str, body: dict) -> tm.Event:
        """The step of ``op`` (:data:`LIFECYCLE`) by the tenant on the
        namespace it names, checked (nothing changes): commit it with
        :meth:`advance`."""
        tenant = body["tenant"]
        return self.check(LIFECYCLE[op](tenant, self.registry.namespace(tenant, body["ns"])))

    def advance(self, event: tm.Event) -> None:
        """Commit a checked lifecycle step; a namespace it retires starts aging
        out (:meth:`aged`)."""
        self.commit(event)
        self.aging |= {ns for ns, rec in self.registry.state.namespaces.items()
                       if rec.phase is tm.Phase.RETIRING}

    def aged(self, present: Callable[[bytes], bool]) -> list[bytes]:
        """Directory keys to remove now, at most :data:`AGE_OUT_BATCH`: the
        orphans still ``present`` in the directory, then the objects of
        retiring namespaces that spec ``AgeOut`` takes now (unleased,
        published); a retiring namespace with nothing left stops aging."""
        self.orphans = [k for k in self.orphans if present(k)]
        out: list[bytes] = self.orphans[:AGE_OUT_BATCH]
        if not self.aging:
            return out
        state, now = self.registry.state, self.clock()
        left: set = set()
        for (ns, key), obj in state.objects.items():
            if ns not in self.aging:
                continue
            left.add(ns)
            if len(out) < AGE_OUT_BATCH:
                try:
                    self.registry.check(tm.AgeOut(ns, key), now)
                except errors.KvError:
                    continue
                out.append(object_key(ns, key))
        self.aging &= left
        return out

    def recovered(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """A new master's registry learns the objects it recovered: their
        directory ``keys`` (a key names the namespace, so the owner) and
        ``sizes`` (what each put was charged: its length times the replica
        count it requested; a replica lost and repaired is neither refunded
        nor charged): each is set up as published (``AddObject``, its replicas'
        bytes held; all in one ``TenancyCore.add_many``). A namespace the
        tenants file does not name (created at run time under an earlier
        master) is set up live with no predecessor (``AddNamespace``, before
        its objects): lifecycle phases and grants made at run time are not
        kept across a failover. An object of no tenant of the file, or over
        its owner's stored-bytes quota, is an orphan: no tenant can reach it,
        and the master removes it once its inherited leases end."""
        now, reg = self.clock(), self.registry
        unnamed: list = []       # (position, why) of the keys no namespace takes, in order
        named = _recovered(keys, sizes, lambda ns: self._set_up(ns, now), unnamed)
        refused = reg.add_many(named, now)
        if not (unnamed or refused):
            return
        skipped = [i for i, _ in unnamed]
        why = dict(unnamed)
        for j, effect in refused:
            why[_position(j, skipped)] = effect.error
        for i in sorted(why):
            dkey = keys[i]
            self.orphans.append(dkey)
            log.warning("recovered object %r belongs to no tenant's namespace it fits: %s",
                        dkey, why[i])

    def _set_up(self, ns: Namespace, now: float) -> None:
        """Spec ``AddNamespace`` of ``ns`` if the registry lacks it (a
        recovered object's namespace); raises the refusal."""
        if ns not in self.registry.state.namespaces:
            self.registry.step(tm.AddNamespace(ns[0], ns), now)
            log.warning("namespace %s/%s of recovered objects is not in the tenants file: it "
                        "is live again, with no predecessor", *ns)

    def namespaces(self, tenant: str) -> dict:
        """The namespaces ``tenant`` owns or may read (``owner/name`` for
        another's): phase, the namespace it upgrades, objects and bytes held,
        and, for its own, the tenants holding read grants."""
        state = self.registry.state
        held = state.per_namespace()
        out = {}
        for ns, rec in state.namespaces.items():
            if not state.may_read(tenant, ns):
                continue
            entry = {"phase": rec.phase.value, "objects": held.get(ns, (0, 0))[0],
                     "bytes": held.get(ns, (0, 0))[1],
                     "previous": rec.previous[1] if rec.previous is not None else None}
            if rec.owner == tenant:
                entry["grants"] = sorted(rec.grants)
            out[ns[1] if rec.owner == tenant else "/".join(ns)] = entry
        return out

    # ------------------------------------------------------------------ grants and usage

    def grant(self, body: dict, revoke: bool = False) -> None:
        """Spec ``GrantRead`` / ``RevokeRead`` by the namespace's owner."""
        tenant = body["tenant"]
        ns = self.registry.namespace(tenant, body["ns"])
        event = (tm.RevokeRead if revoke else tm.GrantRead)(tenant, ns, body["grantee"])
        self.registry.step(event, self.clock())

    def usage(self, tenant: Optional[str] = None) -> dict:
        """Per tenant (only ``tenant``'s, if given): bytes held and in flight,
        write tokens, quota, and bytes held per namespace."""
        usage = self.registry.usage()
        per_ns: dict = {}
        for ns, (_, size) in self.registry.state.per_namespace().items():
            per_ns.setdefault(ns[0], {})[ns[1]] = size
        for name, entry in usage.items():
            entry["namespaces"] = per_ns.get(name, {})
        return usage if tenant is None else {tenant: usage[tenant]}


class Losses:
    """The tenants' accounting of lost segments' objects still owed
    (:meth:`Tenants.removed_many` of each), carried out a slice per turn of
    the master's loop: each loss's keys as it came (one list or array) and a
    cursor, losses in order. No set of the owed keys is built: a key is owed
    while the registry holds it as published and the directory does not (the
    tables agree otherwise), which a put of the key asks (:meth:`settle`)
    only while something is owed. ``len``: keys not yet reached."""

    __slots__ = ("tenants", "_queue", "_left", "_ahead")

    def __init__(self, tenants: Optional[Tenants]) -> None:
        self.tenants = tenants
        self._queue: deque = deque()     # [keys, cursor] of each loss, in order
        self._left = 0
        #: keys whose accounting a put carried out ahead of their loss's turn,
        #: with how many times (each passes over that many of its entries)
        self._ahead: dict = {}

    def __len__(self) -> int:
        return self._left

    def __repr__(self) -> str:
        return f"Losses({self._left} keys owed in {len(self._queue)} loss(es))"

    def add(self, keys) -> None:
        """Owe the accounting of ``keys`` (a list, or an array with
        ``tolist``), after everything owed already."""
        if len(keys):
            self._queue.append([keys, 0])
            self._left += len(keys)

    def carry_out(self, limit: int) -> None:
        """Carry out the accounting of the next ``limit`` keys owed (one
        :meth:`Tenants.removed_many`), passing over those a put settled."""
        batch: list = []
        queue = self._queue
        while limit > 0 and queue:
            entry = queue[0]
            keys, at = entry
            part = keys[at:at + limit]
            if at + len(part) >= len(keys):
                queue.popleft()
            else:
                entry[1] = at + len(part)
            part = part.tolist() if hasattr(part, "tolist") else list(part)
            batch = part if not batch else batch + part
            limit -= len(part)
        self._left -= len(batch)
        if self._ahead:
            batch = [k for k in batch if not self._passed(k)]
            if not queue:            # nothing owed: no entry left to pass over
                self._ahead.clear()
        self.tenants.removed_many(batch)

    def _passed(self, key: bytes) -> bool:
        """Whether ``key``'s entry is one a put settled ahead (counted off)."""
        n = self._ahead.get(key)
        if n is None:
            return False
        if n == 1:
            del self._ahead[key]
        else:
            self._ahead[key] = n - 1
        return True

    def settle(self, dkey: bytes, directory: Container[bytes]) -> None:
        """Before a put of ``dkey``: if its accounting is owed (the registry
        holds it as published, ``directory`` does not hold it), carry it out
        now; its entry is passed over when its loss's turn comes."""
        if not self._left or dkey in directory:
            return
        o = _split(dkey)
        obj = self.tenants.registry.state.objects.get(o) if o is not None else None
        if obj is None or obj.status is not tm.Status.PUBLISHED:
            return
        self.tenants.removed(dkey)
        self._ahead[dkey] = self._ahead.get(dkey, 0) + 1


def _walk(dkeys: Iterable[bytes], set_up: Optional[Callable[[Namespace], None]] = None,
          unnamed: Optional[Callable[[int, errors.KvError], None]] = None
          ) -> Iterator[tuple[Namespace, bytes]]:
    """:func:`_split` of each of ``dkeys`` that names an object of a
    namespace (``set_up`` first, if given: it raises if the registry cannot
    take the namespace), in order; ``unnamed(position, why)``, if given, of
    each other one. Each distinct namespace prefix is decoded and set up once."""
    prefixes: dict = {}        # prefix -> namespace, or the error of setting it up
    prefix, ns, end = None, None, 0
    for i, dkey in enumerate(dkeys):
        if prefix is not None and dkey.startswith(prefix):   # the previous key's namespace
            yield ns, dkey[end:]
            continue
        prefix = None
        try:
            end = 2 + dkey[0] + dkey[1 + dkey[0]]
        except IndexError:
            got = _NOT_NAMED
        else:
            p = dkey[:end]
            got = prefixes.get(p)
            if got is None:
                o = _split(dkey)
                if o is None:
                    got = _NOT_NAMED
                else:
                    got = o[0]
                    if set_up is not None:
                        try:
                            set_up(got)
                        except errors.KvError as err:
                            got = err
                    prefixes[p] = got
        if isinstance(got, errors.KvError):
            if unnamed is not None:
                unnamed(i, got)
            continue
        prefix, ns = p, got
        yield ns, dkey[end:]


def _recovered(keys: Sequence[bytes], sizes: Sequence[int], set_up: Callable[[Namespace], None],
               unnamed: list) -> Iterator[tuple[Namespace, bytes, int]]:
    """``(namespace, key, size)`` of each directory key of ``keys`` (its
    size in ``sizes``) that names a namespace the registry takes
    (:func:`_walk` with ``set_up``), in order; ``(position, error)`` of each
    other one is appended to ``unnamed``."""
    walked = _walk(keys, set_up, lambda i, why: unnamed.append((i, why)))
    for j, (ns, key) in enumerate(walked):
        # the keys before this one: j named ones, and the unnamed so far
        yield ns, key, sizes[j + len(unnamed)]


def _position(j: int, skipped: list) -> int:
    """The position in a sequence of its ``j``-th item left after the items
    at positions ``skipped`` (ascending) were taken out."""
    for s in skipped:
        if s > j:
            break
        j += 1
    return j


_NOT_NAMED = errors.InvalidArgument("not a key of a namespace")


def _split(dkey: bytes) -> Optional[tuple[Namespace, bytes]]:
    """:func:`~kvproto.ops.tenants.split_object_key`, or ``None`` for a key
    no namespace names (recovered from a store that had no tenants)."""
    try:
        ns, key = split_object_key(dkey)
    except (IndexError, UnicodeDecodeError):
        return None
    return (ns, key) if object_key(ns, key) == dkey else None
