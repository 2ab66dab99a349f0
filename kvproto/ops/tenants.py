"""Tenants for a store: credentials, quotas and namespaces from a TOML file,
and the registry that holds the tenancy machine's state (``spec/Tenancy.tla``,
:mod:`kvproto.statemachines.tenancy`) for a master.

A tenants file::

    [tenants.alpha]
    tokens = ["<secret>"]            # one per client; or token_sha256 = ["<hex digest>"]
    stored = "4GiB"                  # bytes held: published or being written
    write_rate = "200MiB"            # write bandwidth, bytes per second
    write_burst = "1GiB"             # bucket size: the largest burst (and put)
    in_flight = "512MiB"             # bytes of transfers in flight
    reserve = "1GiB"                 # no other tenant's write evicts alpha below this
    namespaces = ["default", "llama3-8b-r2"]
    grants = { default = ["beta"] }  # beta may read alpha/default

Every quota is optional (unlimited; ``reserve`` 0); ``namespaces`` defaults to
``["default"]``. Sizes are bytes or strings like ``"4GiB"``. Names are 1 to 64
characters of letters, digits, ``.``, ``_`` and ``-``; another tenant's
namespace is named ``owner/name``.

Credentials: a token is a secret string (:func:`new_token` makes one). The
registry keeps only SHA-256 digests of tokens: :meth:`Credentials.authenticate`
compares the presented token's digest with each of them by
:func:`hmac.compare_digest`. A token is never logged, never put in an error
message and never shown by ``repr``.

Read tickets: with each read it grants, the master hands the reader a
ticket per replica, an HMAC-SHA256 under the store's ticket key of (tenant,
segment, offset, put token, expiry); a storage node with tenants serves a
``read`` or ``load`` only under a valid, unexpired ticket of the requesting
tenant for that location (:class:`Tickets`; the spec's ``NodeAdmits``). The
ticket key is a file the operator gives the master and every storage node
(``--ticket-key FILE``; :func:`new_ticket_key` makes one, ``kvproto tenant
key``); it never travels on the wire. A replica repair's copy is read by a
storage node, not by a tenant: the master issues its ticket to
:data:`REPAIR_READER`, a name no tenant can have, and the source node serves
a read that carries no credential only under such a ticket.

Objects of a tenanted store are named in the master's directory by
:func:`object_key` ``(namespace, key)``: the same key in two namespaces names
two objects, and nothing a client sends can name an object of a namespace it
did not name.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import attrs
import msgpack

from kvproto import errors
from kvproto.cores.tenancy import TenancyCore
from kvproto.runtime.units import parse_size
from kvproto.statemachines import tenancy as tm

UNLIMITED = 1 << 62
DEFAULT_NAMESPACE = "default"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}\Z")
_FIELDS = {"tokens", "token_sha256", "stored", "write_rate", "write_burst", "in_flight",
           "reserve", "namespaces", "grants"}

Namespace = tuple[str, str]      # (owner, name): the machine's namespace id


def new_token() -> str:
    """A fresh secret token (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def token_digest(token: Union[str, bytes]) -> bytes:
    """The SHA-256 digest the registry keeps instead of the token."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def object_key(ns: Namespace, key: bytes) -> bytes:
    """The directory key of ``key`` in namespace ``ns``: length-prefixed owner
    and namespace name, then the key. Injective: two different
    ``(namespace, key)`` pairs never share a directory key."""
    owner, name = (part.encode() for part in ns)
    return bytes([len(owner)]) + owner + bytes([len(name)]) + name + key


def split_object_key(okey: bytes) -> tuple[Namespace, bytes]:
    """The inverse of :func:`object_key`."""
    n = okey[0]
    owner = okey[1:1 + n]
    m = okey[1 + n]
    name = okey[2 + n:2 + n + m]
    return (owner.decode(), name.decode()), okey[2 + n + m:]


@attrs.frozen
class TenantConfig:
    """One tenant of a tenants file. ``digests`` (of its tokens) are never shown."""

    name: str
    quota: tm.Quota
    namespaces: tuple[str, ...] = (DEFAULT_NAMESPACE,)
    grants: tuple[tuple[str, str], ...] = ()          # (namespace name, grantee)
    digests: tuple[bytes, ...] = attrs.field(default=(), repr=False)


def _problem(where: str, what: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{where}: {what}")


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise _problem(where, f"{value!r} is not a name (1 to 64 letters, digits, '.', '_', '-')")
    return value


def namespace_name(value: Any) -> str:
    """``value`` if it names a namespace (1 to 64 letters, digits, ``.``,
    ``_``, ``-``), else :class:`~kvproto.errors.InvalidArgument`."""
    return _name(value, "namespace")


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise _problem(where, "expected a list of names")
    return [_name(v, where) for v in value]


def _amount(value: Any, where: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        amount = parse_size(value) if isinstance(value, str) else int(value)
    except (ValueError, TypeError):
        raise _problem(where, f"{value!r} is not a size (bytes, or e.g. '4GiB')") from None
    if amount < 0:
        raise _problem(where, "must not be negative")
    return amount


def _digests(entry: Mapping, where: str) -> tuple[bytes, ...]:
    tokens, hashed = entry.get("tokens", []), entry.get("token_sha256", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise _problem(f"{where}.tokens", "expected a list of non-empty strings")
    if not isinstance(hashed, list) or not all(isinstance(h, str) and _HEX_DIGEST.match(h)
                                               for h in hashed):
        raise _problem(f"{where}.token_sha256", "expected a list of 64 lowercase hex digits each")
    digests = tuple(token_digest(t) for t in tokens) + tuple(bytes.fromhex(h) for h in hashed)
    if not digests:
        raise _problem(where, "has no tokens (give tokens or token_sha256)")
    return digests


def parse_tenants(data: Mapping) -> tuple[TenantConfig, ...]:
    """The tenants of a parsed tenants file; a mistake raises
    :class:`~kvproto.errors.InvalidArgument` naming where it is (never a
    token)."""
    tenants = data.get("tenants")
    if set(data) - {"tenants"} or not isinstance(tenants, dict) or not tenants:
        raise _problem("tenants file", "expected [tenants.NAME] tables and nothing else")
    configs, seen = [], {}
    for name, entry in tenants.items():
        where = f"tenants.{_name(name, 'tenants')}"
        if not isinstance(entry, dict):
            raise _problem(where, "expected a table")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise _problem(where, f"unknown field(s) {', '.join(sorted(unknown))}")
        digests = _digests(entry, where)
        for d in digests:
            if d in seen:
                raise _problem(where, f"a token is also one of tenant {seen[d]!r}'s")
            seen[d] = name
        limits = {f: _amount(entry.get(f, UNLIMITED), f"{where}.{f}")
                  for f in ("stored", "write_rate", "write_burst", "in_flight", "reserve")
                  if f in entry or f != "reserve"}
        quota = tm.Quota(limits["stored"], limits["write_rate"], limits["write_burst"],
                         limits["in_flight"], limits.get("reserve", 0))
        namespaces = _names(entry.get("namespaces", [DEFAULT_NAMESPACE]), f"{where}.namespaces")
        if not namespaces or len(set(namespaces)) != len(namespaces):
            raise _problem(f"{where}.namespaces", "expected distinct names, at least one")
        grants = entry.get("grants", {})
        if not isinstance(grants, dict):
            raise _problem(f"{where}.grants", "expected a table: namespace = [tenants]")
        pairs = []
        for ns, grantees in grants.items():
            if ns not in namespaces:
                raise _problem(f"{where}.grants", f"{ns!r} is not one of its namespaces")
            pairs += [(ns, g) for g in _names(grantees, f"{where}.grants.{ns}")]
        configs.append(TenantConfig(name, quota, tuple(namespaces), tuple(pairs), digests))
    names = {c.name for c in configs}
    for c in configs:
        for ns, grantee in c.grants:
            if grantee not in names or grantee == c.name:
                raise _problem(f"tenants.{c.name}.grants.{ns}", f"{grantee!r} is not another tenant")
    return tuple(configs)


def load_tenants(path: Union[str, Path]) -> tuple[TenantConfig, ...]:
    """Read and check a tenants file (TOML)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read tenants file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise errors.InvalidArgument(f"tenants file {path} is not TOML: {e}") from None
    return parse_tenants(data)


class Credentials:
    """Which tenant a token authenticates. Holds digests, never tokens."""

    def __init__(self, configs: Iterable[TenantConfig]) -> None:
        self._entries = tuple((d, c.name) for c in configs for d in c.digests)

    def __repr__(self) -> str:
        return (f"Credentials({len({t for _, t in self._entries})} tenants, "
                f"{len(self._entries)} tokens)")

    def authenticate(self, token: Union[str, bytes, None]) -> str:
        """The tenant ``token`` authenticates, or :class:`~kvproto.errors.Unauthorized`.

        The presented token's digest is compared with every stored digest by
        :func:`hmac.compare_digest`, with no early exit, so the time taken
        depends on the number of tokens, not on which one (if any) matched or
        how much of it did. A store holds few tokens (one per client)."""
        if not token:
            raise errors.Unauthorized("the request carries no credential")
        digest, found = token_digest(token), None
        for stored, tenant in self._entries:
            if hmac.compare_digest(digest, stored):
                found = tenant
        if found is None:
            raise errors.Unauthorized("the request's credential authenticates no tenant")
        return found


class Registry:
    """A store's tenants: their credentials, and the tenancy machine's state,
    a :class:`~kvproto.cores.tenancy.TenancyCore` (``state``: read it as the
    frozen :class:`~kvproto.statemachines.tenancy.Tenancy`; ``reference()``
    gives that value), changed only by its steps. Time is an argument of
    every step."""

    def __init__(self, configs: Sequence[TenantConfig], *, capacity: int, ttl: float,
                 now: float = 0) -> None:
        self.credentials = Credentials(configs)
        self.state = TenancyCore(ttl, capacity)
        if now:
            self.state.step(tm.Tick(now))
        set_up: list = []
        for c in configs:
            set_up.append(tm.AddTenant(c.name, c.quota))
            set_up += [tm.AddNamespace(c.name, (c.name, ns)) for ns in c.namespaces]
        for c in configs:
            set_up += [tm.GrantRead(c.name, (c.name, ns), g) for ns, g in c.grants]
        for event in set_up:
            self.step(event, now)

    def __repr__(self) -> str:
        return f"Registry({len(self.state.tenants)} tenants, {len(self.state.namespaces)} namespaces)"

    def authenticate(self, token: Union[str, bytes, None]) -> str:
        return self.credentials.authenticate(token)

    def namespace(self, tenant: str, name: str) -> Namespace:
        """The namespace a request of ``tenant`` names: ``name`` (its own) or
        ``owner/name`` (another tenant's, readable under a grant)."""
        owner, _, ns = name.rpartition("/")
        ns_id = (owner or tenant, ns)
        if ns_id not in self.state.namespaces:
            raise errors.UnknownNamespace(f"no namespace {name!r}")
        return ns_id

    def step(self, event: tm.Event, now: float) -> tuple:
        """Bring the machine's clock to ``now``, apply ``event`` and return its
        effects; a refusal raises its typed error and changes nothing (the
        clock included)."""
        self.check(event, now)
        if now > self.state.now:
            self.state.step(tm.Tick(now))
        return self.state.step(event)

    def check(self, event: tm.Event, now: float) -> None:
        """Raise the typed error :meth:`step` would refuse ``event`` with,
        changing nothing. For a check that must pass before another machine's
        step, committed (:meth:`step`) only once that one is."""
        err = self.state.refusal(event, now)
        if err is not None:
            raise err

    def drop_many(self, objects: Iterable[tuple], now: float) -> tuple:
        """:meth:`TenancyCore.drop_many <kvproto.cores.tenancy.TenancyCore.drop_many>`
        of ``objects`` (``(namespace, key)``) at ``now``: its refusals (each
        of those objects stays)."""
        if now > self.state.now:
            self.state.step(tm.Tick(now))
        return self.state.drop_many(objects)

    def add_many(self, objects: Iterable[tuple], now: float) -> list:
        """:meth:`TenancyCore.add_many <kvproto.cores.tenancy.TenancyCore.add_many>`
        of ``objects`` (``(namespace, key, size)``) at ``now``: ``(i, Refused)``
        of each refused one (it is not added)."""
        if now > self.state.now:
            self.state.step(tm.Tick(now))
        return self.state.add_many(objects)

    def usage(self) -> dict[str, dict[str, Any]]:
        """Per tenant: bytes held and in flight, and its quota (no secrets)."""
        return {name: {"held": t.held, "in_flight": t.in_flight,
                       "write_tokens": t.bucket.level(self.state.now),
                       "quota": attrs.asdict(t.quota)}
                for name, t in self.state.tenants.items()}


TICKET_KEY_MIN = 32      # characters of a ticket key file (its text is the key)


def new_ticket_key() -> str:
    """A fresh ticket key: 256 random bits as 64 hex digits."""
    return secrets.token_hex(32)


def load_ticket_key(path: Union[str, Path]) -> bytes:
    """The ticket key in file ``path`` (its text, surrounding blanks dropped);
    a file that cannot be read or holds fewer than :data:`TICKET_KEY_MIN`
    characters is :class:`~kvproto.errors.InvalidArgument` (the key is never
    shown)."""
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read ticket key file {path}: {e.strerror}") from None
    if len(key) < TICKET_KEY_MIN:
        raise errors.InvalidArgument(f"ticket key file {path} holds {len(key)} characters; a key "
                                     f"needs at least {TICKET_KEY_MIN} ('kvproto tenant key')")
    return key


#: the reader a repair copy's read ticket names (not a tenant name: a tenant's
#: credential never authenticates it, so no tenant can read under such a ticket)
REPAIR_READER = "@repair"


class Tickets:
    """Read tickets under one key (spec ``NodeAdmits``): the master issues,
    storage nodes check. A ticket is ``[expires, mac]``: ``expires`` in
    milliseconds of the wall clock (``time.time()``; the master's and the
    nodes' clocks must agree to well within a lease TTL), ``mac`` the
    HMAC-SHA256 of (tenant, segment, offset, put token, expires). The key is
    never shown."""

    def __init__(self, key: bytes) -> None:
        if len(key) < TICKET_KEY_MIN:
            raise ValueError(f"a ticket key has at least {TICKET_KEY_MIN} bytes")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "Tickets(...)"

    def _mac(self, tenant: str, segment: str, offset: int, token: int, expires: int) -> bytes:
        text = msgpack.packb([tenant, segment, offset, token, expires])
        return hmac.new(self._key, text, hashlib.sha256).digest()

    def issue(self, tenant: str, segment: str, offset: int, token: int, expires: int) -> list:
        """The ticket letting ``tenant`` read the region of ``token`` at
        ``(segment, offset)`` until ``expires`` (ms)."""
        return [expires, self._mac(tenant, segment, offset, token, expires)]

    def admit(self, tenant: str, body: dict, now_ms: int) -> None:
        """Whether a storage node serves ``tenant``'s ``read``/``load``
        ``body``: its ``ticket`` names this tenant, segment, offset and token
        and has not expired; else :class:`~kvproto.errors.TicketRefused`."""
        ticket = body.get("ticket")
        if ticket is None:
            raise errors.TicketRefused("a read at a store with tenants needs the read ticket "
                                       "the master issued with it")
        expires, mac = ticket
        good = self._mac(tenant, body["segment"], body["offset"], body["token"], expires)
        if not hmac.compare_digest(good, mac):
            raise errors.TicketRefused("the read ticket is not the requesting tenant's for this "
                                       "location")
        if now_ms >= expires:
            raise errors.TicketRefused(f"the read ticket expired {now_ms - expires} ms ago: "
                                       "read again")


def describe(configs: Sequence[TenantConfig]) -> list[str]:
    """One line per tenant, for an operator: quotas, namespaces, grants and how
    many tokens (never the tokens)."""
    def size(v: int) -> str:
        return "unlimited" if v >= UNLIMITED else str(v)
    lines = []
    for c in configs:
        q = c.quota
        grants = ", ".join(f"{ns}->{g}" for ns, g in c.grants) or "none"
        lines.append(f"{c.name}: {len(c.digests)} token(s); stored {size(q.stored)}, "
                     f"write {size(q.write_rate)}/s (burst {size(q.write_burst)}), in flight "
                     f"{size(q.in_flight)}, reserve {q.reserve}; namespaces "
                     f"{', '.join(c.namespaces)}; grants {grants}")
    return lines



# --------------------------------------------------------------------------- kvproto tenant


def add_arguments(parser) -> None:
    """``kvproto tenant token`` and ``kvproto tenant check FILE``."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("token", help="print a new secret token and the SHA-256 digest a "
                                     "tenants file may hold instead of it")
    actions.add_parser("key", help="print a new ticket key, for the file given to the master "
                                   "and every storage node as --ticket-key")
    check = actions.add_parser("check", help="check a tenants file and print each tenant's "
                                             "quotas, namespaces and grants (never its tokens)")
    check.add_argument("file", help="the tenants file (TOML)")


def main(args, out=None) -> int:
    import sys
    out = out or sys.stdout
    if args.action == "key":
        print(new_ticket_key(), file=out)
        return 0
    if args.action == "token":
        token = new_token()
        print(f"token:  {token}\nsha256: {token_digest(token).hex()}", file=out)
        return 0
    try:
        configs = load_tenants(args.file)
    except errors.KvError as err:
        print(f"kvproto tenant check: {err}", file=sys.stderr)
        return 2
    for line in describe(configs):
        print(line, file=out)
    return 0
