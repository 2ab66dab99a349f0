"""Spec tooling: the TLC runner (:mod:`.tlc`), the TLA+ value parser
(:mod:`.tla`), the conformance harness that compares TLC's state graph with a
machine's (:mod:`.conformance`), the docs link checker (:mod:`.doccheck`), and
the checks on the running system (``docs/assurance.md``): the fault matrix
(:mod:`.chaos`), fuzzed frames (:mod:`.fuzz`, :mod:`.frames`), snapshots of
the server cores' protocol state (:mod:`.snapshot`) and the runtime mutants
(:mod:`.mutants`).

Nothing here is protocol: the machines in :mod:`kvproto.statemachines` import
only the value types and the binding record from here, and this package
imports nothing of theirs at import time.
"""
