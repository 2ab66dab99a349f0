"""Spec tooling: the TLC runner (:mod:`.tlc`), the TLA+ value parser
(:mod:`.tla`), the conformance harness that compares TLC's state graph with a
machine's (:mod:`.conformance`) and the docs link checker (:mod:`.doccheck`).

Nothing here is protocol: the machines in :mod:`kvproto.statemachines` import
only the value types and the binding record from here, and this package
imports nothing of theirs at import time.
"""
