"""Pure, sans-IO protocol state machines, one module per spec in ``spec/``.

:data:`BINDINGS` maps each TLA+ module name to the binding that the
conformance test and the docs checker use.
"""

from kvproto.statemachines import (directwrite, failover, handoff, lease, publish, repair, tenancy_system,
                                   timeout)

BINDINGS = {b.module: b for b in (publish.BINDING, timeout.BINDING, lease.BINDING,
                                  failover.BINDING, directwrite.BINDING, handoff.BINDING,
                                  tenancy_system.BINDING, repair.BINDING)}
