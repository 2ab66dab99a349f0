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

Storage-plane requests (a storage node's ``register``, heartbeats, drains and
``deregister``) are not a tenant's and carry no tenant credential.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Callable, Optional

from kvproto import errors
from kvproto.ops.tenants import (
    DEFAULT_NAMESPACE, UNLIMITED, Namespace, Registry, TenantConfig, object_key,
    split_object_key,
)
from kvproto.runtime import wire
from kvproto.statemachines import tenancy as tm

log = logging.getLogger("kvproto.master")

#: requests of the storage nodes, not of a tenant
STORAGE_PLANE = frozenset({"register", "storage_heartbeat", "storage_drained", "deregister"})
#: requests only a namespace's owner may make in it
OWNER_OPS = frozenset({"put_start", "put_end", "put_revoke", "put_abandon", "remove"})
#: lookups that need the owner or a read grant (``read_begin``: ``Begin`` per key)
LOOKUP_OPS = frozenset({"exists", "list"})


class Tenants:
    """The registry of a master and its checks (see the module docstring).
    ``clock`` is the master's: the machine's time is an argument of each step."""

    def __init__(self, configs: Sequence[TenantConfig], *, ttl: float,
                 clock: Callable[[], float]) -> None:
        self.clock = clock
        # memory is the allocator's and the eviction policy's: the registry
        # counts each tenant's bytes against its quotas, not the store's room
        self.registry = Registry(configs, capacity=UNLIMITED, ttl=ttl, now=clock())

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
        if op in LOOKUP_OPS and not tm.may_read(reg.state, tenant, ns):
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
        (owner, name), key = split_object_key(dkey)
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
            o = split_object_key(key)
            obj = state.objects.get(o)
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
        its reads end (``Release``) and its owner's bytes are freed (``Remove``)."""
        o = split_object_key(dkey)
        state = self.registry.state
        obj = state.objects.get(o)
        if obj is None:
            return
        for holder in sorted(state.readers.get(o, ()), key=repr):
            self.commit(tm.Release(holder))
        self.commit(tm.Remove(obj.owner, *o))

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
        for (ns, _), obj in self.registry.state.objects.items():
            held = per_ns.setdefault(obj.owner, {})
            held[ns[1]] = held.get(ns[1], 0) + obj.size
        for name, entry in usage.items():
            entry["namespaces"] = per_ns.get(name, {})
        return usage if tenant is None else {tenant: usage[tenant]}
