"""The tenants' calls of a :class:`~kvproto.runtime.client.Client`
(``spec/Tenancy.tla``): grants of read access to this tenant's namespaces
and the upgrade lifecycle of a namespace (create, prewarm, switch, route
back, drop, list). :class:`TenantCalls` is a part of
:class:`~kvproto.runtime.client.Client`: it uses the client's requests to the
master (``_call_master``) and its lock.
"""

from __future__ import annotations

from typing import Optional


class TenantCalls:
    """The tenants' calls of :class:`~kvproto.runtime.client.Client` (see the
    module docstring)."""

    def grant(self, grantee: str, *, namespace: Optional[str] = None,
              timeout: Optional[float] = None) -> None:
        """Let tenant ``grantee`` read this tenant's ``namespace`` (default:
        the client's own), read-only, until :meth:`revoke` (spec
        ``GrantRead``). Only the namespace's owner may."""
        self._grant_or_revoke("grant", grantee, namespace, timeout)

    def revoke(self, grantee: str, *, namespace: Optional[str] = None,
               timeout: Optional[float] = None) -> None:
        """End ``grantee``'s grant (spec ``RevokeRead``): its next read or
        renewal is refused; a read already granted ends with its lease."""
        self._grant_or_revoke("revoke", grantee, namespace, timeout)

    def _grant_or_revoke(self, op: str, grantee: str, namespace: Optional[str],
                         timeout: Optional[float]) -> None:
        body = {"ns": namespace or self.namespace, "grantee": grantee}
        with self._lock:
            self._call_master(op, body, self._deadline(timeout))

    # ------------------------------------------------------------------ the upgrade lifecycle

    def ns_create(self, name: str, *, previous: Optional[str] = None,
                  timeout: Optional[float] = None) -> None:
        """Create this tenant's namespace ``name`` as a canary upgrading its
        live namespace ``previous`` (default: the client's own; spec
        ``Create``). Which requests go to the canary (e.g. a fraction of the
        writes) is the caller's choice: a client with ``namespace=name``
        writes and reads there, and only there."""
        self._namespace_call("ns_create", {"ns": name, "previous": previous or self.namespace},
                             timeout)

    def ns_prewarm(self, name: str, *, timeout: Optional[float] = None) -> None:
        """The canary ``name`` is healthy: hot prefixes are recomputed into it
        (spec ``PreWarm``)."""
        self._namespace_call("ns_prewarm", {"ns": name}, timeout)

    def ns_switch(self, name: str, *, timeout: Optional[float] = None) -> None:
        """``name`` goes live; the namespace it upgrades retires: no more
        writes, its reads go on and its objects age out (spec ``Switch``)."""
        self._namespace_call("ns_switch", {"ns": name}, timeout)

    def ns_route_back(self, name: str, *, timeout: Optional[float] = None) -> None:
        """The namespace ``name`` upgrades is live again; ``name`` is held: its
        writes in progress are abandoned, it takes no more, and its published
        objects stay readable by the owner until :meth:`ns_drop` (spec
        ``RouteBack``)."""
        self._namespace_call("ns_route_back", {"ns": name}, timeout)

    def ns_drop(self, name: str, *, timeout: Optional[float] = None) -> None:
        """Inspection of the held namespace ``name`` is over: it retires and
        its objects age out (spec ``Drop``)."""
        self._namespace_call("ns_drop", {"ns": name}, timeout)

    def ns_list(self, *, timeout: Optional[float] = None) -> dict:
        """The namespaces this tenant owns or may read (another tenant's as
        ``owner/name``): phase, the namespace it upgrades, objects and bytes
        held, and for its own the tenants holding read grants."""
        return self._namespace_call("ns_list", {}, timeout)["namespaces"]

    def _namespace_call(self, op: str, body: dict, timeout: Optional[float]) -> dict:
        with self._lock:
            return self._call_master(op, body, self._deadline(timeout)).body
