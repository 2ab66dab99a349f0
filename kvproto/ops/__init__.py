"""What operators use: the capacity planner (:mod:`kvproto.ops.plan`,
``kvproto plan``), Prometheus metrics (:mod:`kvproto.ops.metrics`,
``--metrics-port``) and the live figures of a cluster (``kvproto stats``)."""
