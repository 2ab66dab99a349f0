"""Every error kvproto raises, each with a stable code on the wire.

A reply frame that carries an error carries ``(code, message)``; :func:`from_wire`
turns it back into the same type on the client. Codes are never reused or
renumbered: add new ones at the end of their block.
"""

from __future__ import annotations


class KvError(Exception):
    """Base of every kvproto error. ``code`` is what travels on the wire."""

    code = 1

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__.strip().splitlines()[0])

    @property
    def message(self) -> str:
        return str(self)

    def to_wire(self) -> tuple[int, str]:
        return (self.code, self.message)


# --- 10..19: frame validation (the request was never applied) ----------------

class MalformedFrame(KvError):
    """The frame could not be decoded or lacks required fields."""
    code = 10


class UnsupportedVersion(KvError):
    """The frame's protocol version is not spoken by this server."""
    code = 11


class UnknownMessage(KvError):
    """The frame names an operation this server does not know."""
    code = 12


class FrameTooLarge(KvError):
    """The frame exceeds the server's size limit."""
    code = 13


class DuplicateRequest(KvError):
    """A request id this connection already used: the frame is a copy of a
    request already served (delivered twice), and is not served again."""
    code = 14


# --- 20..39: publish protocol ------------------------------------------------

class KeyNotFound(KvError):
    """No published object has this key (a miss)."""
    code = 20


class KeyExists(KvError):
    """The key already has a published object or a put in progress."""
    code = 21


class StaleToken(KvError):
    """The put attempt's token no longer owns the allocation (revoked or reclaimed)."""
    code = 22


class NoSpace(KvError):
    """Not enough live segments with free space for the requested replicas."""
    code = 23


class ObjectBusy(KvError):
    """The object is being read and cannot be removed now."""
    code = 24


class NotPublished(KvError):
    """The object exists but is not published yet."""
    code = 25


class SegmentUnavailable(KvError):
    """The storage segment named in a request is unknown or lost."""
    code = 26


class RegionMismatch(KvError):
    """A storage node refused a read or write: the region is not owned by that token."""
    code = 27


class ChecksumMismatch(KvError):
    """Bytes read back do not match the checksum recorded at publish."""
    code = 28


class InvalidArgument(KvError):
    """A request field has the right type but an unacceptable value."""
    code = 29


class NoStorage(NoSpace):
    """No storage node has registered with this master: nothing can be stored yet.

    A kind of :class:`NoSpace` (``except NoSpace`` catches it) with its own code,
    so a client can tell "the cluster is full" from "the cluster has no storage
    node yet" (e.g. a node still starting: ``kvproto storage`` prints a
    ``ready`` line once it has registered)."""
    code = 30


# --- 40..49: transport -------------------------------------------------------

class RequestTimeout(KvError):
    """The peer did not answer within the caller's deadline."""
    code = 40


class ServerUnavailable(KvError):
    """No server could be reached at the given address."""
    code = 41


class InternalError(KvError):
    """The server failed while handling a valid request; it keeps serving."""
    code = 99


# --- 50..59: remote-load timeout, quarantine and drain (spec/Timeout.tla) ----

class TransferTimeout(KvError):
    """The load did not complete within the caller's deadline; its buffer is quarantined."""
    code = 50


class BufferQuarantined(KvError):
    """A timed-out transfer may still write this buffer; it is handed to no one until it drains."""
    code = 51


class StaleGeneration(KvError):
    """A callback or acknowledgement of a transfer generation no longer tracked; dropped."""
    code = 52


class BufferBusy(KvError):
    """The buffer is held by another request or is not in a state that allows this."""
    code = 53


class BufferNotReady(KvError):
    """The buffer's load has not completed (or its data was already consumed)."""
    code = 54


class TransferInFlight(KvError):
    """A transfer into this buffer or of this request is still in flight."""
    code = 55


class CleanupFailed(KvError):
    """Cancels of a timed-out transfer went unanswered; the transfer was (or must be) written off."""
    code = 56


class LeakBudgetExhausted(KvError):
    """The leak ledger is full: no further transfer may be written off until one drains."""
    code = 57


class RequestNotActive(KvError):
    """The request is draining or has ended (or was never started)."""
    code = 58


# --- 60..69: read leases (spec/Lease.tla) ------------------------------------

class ObjectLeased(KvError):
    """The object is under an unexpired read lease; it cannot be removed or evicted now."""
    code = 60


class LeaseExpired(KvError):
    """The read lease expired (or was released) at the master; it cannot be renewed or released."""
    code = 61


class LeaseHeld(KvError):
    """This lease holder already holds a lease; one read holds at most one lease."""
    code = 62


class LeaseDeadlinePassed(KvError):
    """The transfer completed after the reader's conservative lease deadline; its bytes are rejected."""
    code = 63


# --- 70..79: master failover (spec/Failover.tla) ----------------------------

class StaleTerm(KvError):
    """The request is stamped with a term lower than the highest this node has seen (a newer master fenced it)."""
    code = 70


class MasterNotOpen(KvError):
    """This master is not open for service (standby, fencing or recovering); treat a lookup as a miss."""
    code = 71


class FenceIncomplete(KvError):
    """Recovery needs every live storage node to have acknowledged the new term first."""
    code = 72


class MasterNotStandby(KvError):
    """Only a standby master may take a new term from the coordinator."""
    code = 73


class RecomputeLimited(KvError):
    """The engine's fall-back to recomputation is over its rate limit; retry later."""
    code = 74


class CoordinatorUnavailable(KvError):
    """The election/membership coordinator (e.g. etcd) could not be reached or did not answer."""
    code = 75


class MasterUnreachable(ServerUnavailable):
    """No master has served this client for longer than a master switch takes.

    Raised by the client, never sent by a server: the master it was given (or
    the one its coordinator names) answered nothing, or was not open, for the
    client's whole ``switch_window`` (without a coordinator: ``lookup_timeout``).
    A lookup that fails so is not a miss: "no master" is not "no such key"."""
    code = 76


# --- 80..89: tenants, namespaces and quotas (spec/Tenancy.tla) -----------------

class Unauthorized(KvError):
    """The request carries no credential, or one that authenticates no tenant."""
    code = 80


class AccessDenied(KvError):
    """The tenant may not do this: it does not own the namespace and holds no grant on it."""
    code = 81


class QuotaExceeded(KvError):
    """The request would take the tenant over one of its quotas (stored bytes, write bandwidth, bytes in flight)."""
    code = 82


class NamespaceClosed(KvError):
    """The namespace takes no writes now (it is retiring, or held for inspection after a route back)."""
    code = 83


class UnknownNamespace(KvError):
    """No namespace of this name exists (or it is not in a phase that allows this step)."""
    code = 84


class TicketRefused(KvError):
    """A storage node with tenants refuses a read without a valid read ticket of the
    requesting tenant for that location (missing, forged, another's, or expired)."""
    code = 85


# --- 90..99: engines: chunk objects and prefill -> decode hand-off -----------

class LayoutMismatch(KvError):
    """The stored KV was written under another layout than the reader's; it is refused."""
    code = 90


class HandoffUnavailable(KvError):
    """The decode side could not take over a prefill's hand-off (gone, incomplete or refused)."""
    code = 91


class HandoffRetained(KvError):
    """The hand-off is neither acknowledged by the decode side nor past its TTL; it is kept."""
    code = 92


_BY_CODE: dict[int, type[KvError]] = {}


def _register() -> None:
    for obj in list(globals().values()):
        if isinstance(obj, type) and issubclass(obj, KvError):
            if obj.code in _BY_CODE and _BY_CODE[obj.code] is not obj:
                raise RuntimeError(f"duplicate error code {obj.code}")
            _BY_CODE[obj.code] = obj


_register()


def from_wire(code: int, message: str) -> KvError:
    """Rebuild the typed error a peer sent; unknown codes become :class:`KvError`."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = KvError(message)
        err.code = code
        return err
    return cls(message)


def by_code(code: int) -> type[KvError]:
    return _BY_CODE[code]
