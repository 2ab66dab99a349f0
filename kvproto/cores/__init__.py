"""Fast, mutable, compact cores the runtime runs, each held to its reference machine.

* :mod:`kvproto.cores.directory` — the master's directory
  (reference: ``publish.Directory`` + ``publish.master_step``);
  its bulk constructors in :mod:`kvproto.cores.directory_build`, its results in
  the reference's shape in :mod:`kvproto.cores.directory_views`;
* :mod:`kvproto.cores.leases` — the master's lease table
  (reference: ``lease.LeaseTable`` + ``lease.master_step``);
* :mod:`kvproto.cores.storage` — a storage node's region table and index
  (references: ``publish.RegionTable`` + ``publish.storage_step`` and
  ``failover.StorageNode`` + ``failover.storage_step``);
* :mod:`kvproto.cores.pool` — the client's pool of destination buffers
  (reference: ``timeout.Pool`` + ``timeout.pool_step``);
* :mod:`kvproto.cores.tenancy` — the master's tenants, namespaces, grants and
  quotas (reference: ``tenancy.Tenancy`` + ``tenancy.step``);
* :mod:`kvproto.cores.rows` — the key -> row numbering the cores share;
* :mod:`kvproto.cores.bindings` — the cores inside the specs' closed systems
  (``FAST_BINDINGS``), for the conformance graphs.

How they are held to the references: ``docs/cores.md``.
"""
