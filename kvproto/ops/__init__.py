"""What operators use: the capacity planner (:mod:`kvproto.ops.plan`,
``kvproto plan``), Prometheus metrics (:mod:`kvproto.ops.metrics`,
``--metrics-port``), the live figures of a cluster (``kvproto stats``) and
tenants: the tenants file, credentials and the registry
(:mod:`kvproto.ops.tenants`, ``kvproto tenant``)."""
