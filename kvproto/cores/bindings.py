"""The fast cores inside the spec's closed systems, for the conformance graphs.

Each reference module (:mod:`kvproto.statemachines.publish`, ``lease``,
``failover``, ``timeout``) defines its closed ``System``, the successor relation and the
stated mapping ``to_tla`` over its own step functions and values. Here the
same code runs with the fast cores in their place: every function of the
module, and the methods of its ``System`` and ``Constants``, are re-created
over a copy of the module's namespace in which the step functions
(``master_step``, ``storage_step``, ``node_step``, ``pool_step``) and the
constructors (``Directory``, ``RegionTable``, ``new_table``,
``restored_table``, ``StorageNode``, ``DirectTable``, ``new_pool``) name the
fast cores. Nothing of the closed system is written twice, so the graph
compared with TLC's is the fast core's and only the core differs.

A state of the closed system holds a :class:`Snapshot`, a core that is never
mutated again: a step copies the core and steps the copy (a refused step
returns the snapshot itself, as the reference returns its state). Snapshots
are equal, and hash, as their cores' :meth:`reference` values, so the
exploration merges the same states it merges for the reference; everything
the system and ``to_tla`` read of a state goes through the core's own views.

:data:`FAST_BINDINGS` maps each spec module with a fast core to its binding:
Publish (the master's :class:`~kvproto.cores.directory.DirectoryCore` and the
storage nodes' :class:`~kvproto.cores.storage.StorageNodeCore` region tables),
Lease (:class:`~kvproto.cores.leases.LeaseCore`), Failover (the storage
nodes' fence and index, :class:`~kvproto.cores.storage.StorageNodeCore`; the
master's failover phase machine stays the reference), DirectWrite (the
storage node's regions granted to direct writers,
:class:`~kvproto.cores.direct.DirectCore`) and Timeout (the client's pool,
:class:`~kvproto.cores.pool.PoolCore`; the storage node's transfers stay the
reference), and Tenancy (the master's tenants, namespaces, grants and quotas,
:class:`~kvproto.cores.tenancy.TenancyCore`; the lambdas of the spec's
actions run as they are, through the rebound ``System``).
"""

from __future__ import annotations

import types

from kvproto.checking.conformance import SpecBinding, memoised_step
from kvproto.cores.direct import DirectCore
from kvproto.cores.directory import DirectoryCore
from kvproto.cores.leases import LeaseCore
from kvproto.cores.pool import PoolCore
from kvproto.cores.storage import StorageNodeCore
from kvproto.cores.tenancy import TenancyCore
from kvproto.statemachines import directwrite, failover, lease, publish, tenancy_system, timeout
from kvproto.statemachines.refusal import Refused


class Snapshot:
    """A core that is never mutated again; reads go to the core."""

    __slots__ = ("core", "_value")

    def __init__(self, core) -> None:
        self.core = core
        self._value = None

    def value(self):
        """The core's reference value (computed once)."""
        if self._value is None:
            self._value = self.core.reference()
        return self._value

    def __getattr__(self, name):
        return getattr(self.core, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Snapshot) and self.value() == other.value()

    def __hash__(self) -> int:
        return hash(self.value())

    def __repr__(self) -> str:
        return f"Snapshot({self.value()!r})"


def stepped(snapshot: Snapshot, event) -> tuple:
    """``(snapshot, effects)`` as a reference step: the core copied and stepped."""
    core = snapshot.core.copy()
    effects = core.step(event)
    if effects and type(effects[0]) is Refused:
        return snapshot, effects
    return Snapshot(core), effects


#: :func:`stepped` taken once per equal (snapshot, event) in an exploration: for
#: the parts of a closed system that many of its states share.
shared_stepped = memoised_step(stepped)


def _clone(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__doc__ = fn.__doc__
    return new


def _own(fn, module) -> bool:
    return isinstance(fn, types.FunctionType) and fn.__code__.co_filename == module.__file__


def _recreate(fn, module, namespace: dict):
    """``fn`` over ``namespace`` when it is ``module``'s own (a memoised step
    re-created memoised), else None."""
    if _own(fn, module):
        return _clone(fn, namespace)
    wrapped = getattr(fn, "__wrapped__", None)
    if _own(wrapped, module):
        return memoised_step(_clone(wrapped, namespace))
    return None


def rebind(module, overrides: dict, classes=("System", "Constants")) -> dict:
    """A namespace in which ``module``'s functions and the methods of its
    ``classes`` (re-created as subclasses) run with ``overrides`` in place of
    the module's names."""
    namespace = dict(vars(module))
    for name, value in vars(module).items():
        fn = _recreate(value, module, namespace)
        if fn is not None:
            namespace[name] = fn
    for name in classes:
        cls = vars(module)[name]
        body: dict = {"__slots__": (), "__module__": __name__, "__doc__": cls.__doc__}
        for attr, value in vars(cls).items():
            if _own(value, module):
                body[attr] = _clone(value, namespace)
            elif isinstance(value, classmethod) and _own(value.__func__, module):
                body[attr] = classmethod(_clone(value.__func__, namespace))
        namespace[name] = type(cls)(name, (cls,), body)
    namespace.update(overrides)
    return namespace


def fast_binding(module, overrides: dict) -> SpecBinding:
    """``module.BINDING`` over the fast cores named in ``overrides``."""
    ns = rebind(module, overrides)
    ref = module.BINDING
    return SpecBinding(
        module=ref.module,
        constants=ns["Constants"].from_tla,
        initial=_clone(ref.initial, ns),
        successors=ns["successors"],
        to_tla=ns["to_tla"],
        actions={name: ns.get(fn.__name__, fn) for name, fn in ref.actions.items()},
        invariants={name: ns[fn.__name__] for name, fn in ref.invariants.items()},
    )


def _storage_node(term: int = 0, index=None) -> Snapshot:
    if index:
        raise ValueError("a fast storage node starts with an empty index")
    return Snapshot(StorageNodeCore(term=term))


def _region_table(segment: str, regions=None) -> Snapshot:
    if regions:
        raise ValueError("a fast region table starts empty")
    return Snapshot(StorageNodeCore(segment))


def _settled(snapshot: Snapshot) -> Snapshot:
    """``tenancy.settle`` of a snapshot: a settled copy, or itself."""
    now = snapshot.core.now
    if all(t.bucket.at == now for t in snapshot.core.tenants.values()):
        return snapshot
    core = snapshot.core.copy()
    core.settle()
    return Snapshot(core)


FAST_BINDINGS: dict[str, SpecBinding] = {
    "Publish": fast_binding(publish, {
        "master_step": shared_stepped, "storage_step": shared_stepped,
        "Directory": lambda: Snapshot(DirectoryCore()), "RegionTable": _region_table,
    }),
    "Lease": fast_binding(lease, {
        "master_step": shared_stepped,
        "new_table": lambda ttl: Snapshot(LeaseCore(ttl)),
        "restored_table": lambda ttl, now, objects, quiet=None:
            Snapshot(LeaseCore.restored(ttl, now, objects, quiet)),
    }),
    "Failover": fast_binding(failover, {
        "storage_step": shared_stepped, "StorageNode": _storage_node,
    }),
    "DirectWrite": fast_binding(directwrite, {
        "node_step": shared_stepped, "DirectTable": lambda: Snapshot(DirectCore()),
    }),
    "Timeout": fast_binding(timeout, {
        "pool_step": shared_stepped,
        "new_pool": lambda buffers, **limits: Snapshot(PoolCore(buffers, **limits)),
    }),
    # A tenancy system is its table alone: no state shares it with another.
    "Tenancy": fast_binding(tenancy_system, {
        "step": stepped, "add_tenant": stepped, "add_namespace": stepped, "settle": _settled,
        "new_tenancy": lambda ttl, capacity: Snapshot(TenancyCore(ttl, capacity)),
    }),
}
