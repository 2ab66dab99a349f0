"""The capacity planner: three ledgers (capacity, objects, traffic)
brought down to each machine, then checked with the largest failure domain
removed.

Pure arithmetic: no I/O, no clock. Four frozen records describe the inputs
(:class:`Model`, :class:`Workload`, :class:`Store`, :class:`Cluster`);
:func:`plan` returns a :class:`Plan`; :func:`hot_replica_options` answers the
hot-set question for several replica counts. ``kvproto plan``
(:mod:`kvproto.ops.plancli`) reads the inputs from flags or a TOML file and
prints the ledgers.

What the arithmetic assumes, each one line of code below:

* A prompt is cut into chunks of ``chunk_tokens`` from its first token; only
  whole chunks are stored, and a chunk's key names every token before it
  (prefix hashing, as vLLM and LMCache do), so a shared prefix is reused in
  whole chunks only.
* Lengths vary: the end of a prompt, or of its shared prefix, falls at a
  uniformly random place in its last chunk, so on average ``(C - 1) / 2`` of
  its tokens are in no whole chunk (:func:`whole_chunk_tokens`); one shorter
  than a chunk has no whole chunk at all.
* Every host runs an engine and a storage node (Mooncake's layout); requests
  and objects spread evenly over hosts. A reader reads a replica on its own
  host through shared memory, without the NIC (kvproto's client does). A
  writer sends every replica itself (kvproto's put), from one source buffer.
* Placement ignores failure domains (kvproto's placer picks the segments
  with the most free space): an object whose replicas all sit in the lost
  domain is lost outright and recomputed; the other lost replicas are
  repaired by copying from a survivor.
* The hot prefixes' objects land on hosts at random: the busiest host
  carries the expected maximum of balls thrown into bins
  (:func:`expected_max_load`, Poisson approximation).
* Loading a request's reused bytes over a NIC at utilisation ``u`` takes
  ``bytes / bandwidth / (1 - u)`` (the M/M/1 response time): the simplest
  model in which delay explodes as a link nears saturation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from kvproto.errors import InvalidArgument

#: bytes per element of each KV-cache dtype
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                 "float8": "fp8", "e4m3": "fp8"}


@dataclass(frozen=True)
class Measured:
    """Per-object metadata figures measured from running processes
    (:func:`kvproto.ops.measure.measure_metadata`) and per-object wire bytes
    encoded with the runtime's own wire format (:func:`kvproto.ops.measure.wire_overhead`)."""

    master_bytes_per_object: float   # master process memory (anonymous RSS) per published object
    node_bytes_per_replica: float    # storage node process memory (outside its segment) per replica
    read_wire_bytes: int             # headers and descriptors on the wire per object read
    write_wire_bytes: int            # the same per replica written (its share of put_start/put_end too)
    objects: int
    replicas: int
    key_bytes: int
    date: str
    command: str


#: The recorded figures (``kvproto plan --measure 200000`` on the date given;
#: overridable with ``--metadata-bytes`` / ``--index-bytes``).
MEASURED = Measured(
    master_bytes_per_object=1121.0, node_bytes_per_replica=462.0,
    read_wire_bytes=344, write_wire_bytes=294,
    objects=200_000, replicas=2, key_bytes=64, date="2026-11-30",
    command="kvproto plan --measure 200000")


@dataclass(frozen=True)
class Model:
    """The KV cache of one token: K and V of every layer and KV head."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        _positive_int(self, "layers", "kv_heads", "head_dim")
        if canonical_dtype(self.dtype) is None:
            raise InvalidArgument(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[canonical_dtype(self.dtype)]


@dataclass(frozen=True)
class Workload:
    """Prompts per second over the whole cluster and what they share.

    ``prompt_tokens`` is the prompt-length distribution: ``(tokens, weight)``
    pairs (weights are normalised). ``sharing`` is the fraction of each prompt
    that is a prefix already seen (a system prompt, a document, a
    conversation's history). ``prefixes`` distinct shared prefixes are live;
    the ``hot_fraction`` most popular of them take ``hot_share`` of the reads.
    ``retention_s`` is how long a stored chunk must stay to be reused."""

    request_rate: float = 150.0
    prompt_tokens: tuple = ((1024, 0.5), (4096, 0.4), (16384, 0.1))
    sharing: float = 0.6
    prefixes: int = 40
    hot_fraction: float = 0.05
    hot_share: float = 0.8
    retention_s: float = 120.0

    def __post_init__(self) -> None:
        pairs = tuple((t, w) for t, w in self.prompt_tokens)
        if not pairs or any(type(t) is not int or t <= 0 for t, _ in pairs):
            raise InvalidArgument("prompt_tokens needs (tokens, weight) pairs with tokens a positive int")
        if any(not _finite(w) or w < 0 for _, w in pairs) or sum(w for _, w in pairs) <= 0:
            raise InvalidArgument("prompt_tokens weights must be >= 0 and not all 0")
        object.__setattr__(self, "prompt_tokens", pairs)
        _positive(self, "request_rate", "retention_s")
        _positive_int(self, "prefixes")
        _fraction(self, "sharing", "hot_share")
        if not _finite(self.hot_fraction) or not 0 < self.hot_fraction <= 1:
            raise InvalidArgument(f"hot_fraction must be in (0, 1], not {self.hot_fraction!r}")

    def weighted(self):
        """``(tokens, probability)`` per bucket."""
        total = sum(w for _, w in self.prompt_tokens)
        return [(t, w / total) for t, w in self.prompt_tokens]


@dataclass(frozen=True)
class Store:
    """How the store keeps the cache: chunking, replication, eviction, and the
    per-object costs (measured defaults, see :data:`MEASURED`)."""

    chunk_tokens: int = 256
    replicas: int = 2
    hot_replicas: Optional[int] = None     # replicas of the hot prefixes' objects (default: replicas)
    page_size: int = 4096
    high_watermark: float = 0.90           # the master evicts past this share of a segment
    inflight_s: float = 0.05               # how long a transfer holds its buffer (Little's law)
    metadata_bytes: float = MEASURED.master_bytes_per_object
    index_bytes: float = MEASURED.node_bytes_per_replica
    read_wire_bytes: float = MEASURED.read_wire_bytes
    write_wire_bytes: float = MEASURED.write_wire_bytes

    def __post_init__(self) -> None:
        _positive_int(self, "chunk_tokens", "replicas", "page_size")
        if self.page_size & (self.page_size - 1):
            raise InvalidArgument(f"page_size must be a power of two, not {self.page_size}")
        if self.hot_replicas is not None:
            _positive_int(self, "hot_replicas")
            if self.hot_replicas < self.replicas:
                raise InvalidArgument(f"hot_replicas ({self.hot_replicas}) must be at least "
                                      f"replicas ({self.replicas})")
        if not _finite(self.high_watermark) or not 0 < self.high_watermark <= 1:
            raise InvalidArgument(f"high_watermark must be in (0, 1], not {self.high_watermark!r}")
        _non_negative(self, "inflight_s", "metadata_bytes", "index_bytes", "read_wire_bytes",
                      "write_wire_bytes")

    @property
    def hot(self) -> int:
        return self.replicas if self.hot_replicas is None else self.hot_replicas


@dataclass(frozen=True)
class Cluster:
    """The machines. Each host's memory holds its storage segment, the
    engine's host-side KV cache (L1; the same addresses as the segment when
    ``l1_in_segment``), registered staging buffers and buffers in flight."""

    hosts: int = 16
    memory_per_host: int = 1 << 40
    segment_per_host: int = 512 << 30
    l1_per_host: int = 128 << 30
    l1_in_segment: bool = True
    staging_per_host: int = 4 << 30
    nic_gbps: float = 100.0                # per host, each direction
    failure_domains: int = 4               # hosts split evenly (racks, power feeds)
    repair_share: float = 0.25             # of a survivor's NIC that repair may take
    slo_load_s: float = 0.05               # budget for loading one prompt's reused prefix

    def __post_init__(self) -> None:
        _positive_int(self, "hosts", "memory_per_host", "segment_per_host", "failure_domains")
        _non_negative(self, "l1_per_host", "staging_per_host")
        _positive(self, "nic_gbps", "slo_load_s")
        if not _finite(self.repair_share) or not 0 < self.repair_share <= 1:
            raise InvalidArgument(f"repair_share must be in (0, 1], not {self.repair_share!r}")
        if self.failure_domains > self.hosts:
            raise InvalidArgument(f"{self.failure_domains} failure domains need at least as many "
                                  f"hosts, not {self.hosts}")

    @property
    def nic_bytes_s(self) -> float:
        return self.nic_gbps * 1e9 / 8

    @property
    def largest_domain(self) -> int:
        return -(-self.hosts // self.failure_domains)


# --------------------------------------------------------------------------- ledgers


@dataclass(frozen=True)
class Tokens:
    """What one prompt (on average) reuses, writes and wastes, in tokens."""

    prompt: float             # tokens in the prompt
    shared: float             # of which a prefix seen before
    reused: float             # of which in whole chunks of that prefix: loaded, not recomputed
    stored: float             # tokens of the prompt in whole chunks (what the store can hold of it)
    written: float            # new whole chunks' tokens: stored - reused
    shared_waste: float       # shared tokens in a partial chunk: recomputed though seen before
    tail_waste: float         # the prompt's last partial chunk: never stored


@dataclass(frozen=True)
class Capacity:
    """Bytes held. Cluster totals and per host (objects spread evenly)."""

    object_bytes: int         # one chunk's KV
    allocated_bytes: int      # the same rounded up to whole pages
    working_set: float        # payload written within the retention, one copy
    hot_extra: float          # bytes of the hot objects' extra replicas
    stored: float             # allocated bytes of every replica (working set x replicas + hot extra)
    per_host: float           # stored / hosts: what each segment must hold
    usable_per_host: float    # segment x high watermark
    index_per_host: float     # storage node memory for its replicas' metadata
    master_metadata: float    # the master's memory for the directory (on its own machine)
    inflight_per_host: float  # transfer buffers held (Little's law: bytes/s through the engine x hold time)
    staging_per_host: int
    l1_per_host: int          # engine L1 not shared with the segment (0 when it is the segment)
    host_committed: float     # segment + separate L1 + staging + in flight + index, each address once
    host_naive: float         # the same adding configured sizes, shared addresses twice
    host_memory: int

    @property
    def fits(self) -> bool:
        return self.per_host <= self.usable_per_host and self.host_committed <= self.host_memory


@dataclass(frozen=True)
class Objects:
    """Object counts and what each object costs, in memory and on the wire."""

    stored: float             # objects held (one per chunk written within the retention)
    replicas_stored: float    # with every replica (the storage nodes' index entries)
    written_s: float          # new objects per second
    read_s: float             # objects loaded per second
    looked_up_s: float        # keys the master looks up per second (every whole chunk of each prompt)
    master_items_s: float     # items the master handles per second: lookups, put start+end, releases
    master_requests_s: float  # requests to the master per second (one batch per step per prompt)
    master_metadata: float    # bytes of master memory
    wire_overhead_s: float    # header and descriptor bytes per second on the wire
    wire_overhead_share: float  # the same as a share of the payload moved
    page_slack: float         # allocated minus payload, all replicas


@dataclass(frozen=True)
class Traffic:
    """Bytes per second; per host is per NIC direction (out equals in on average)."""

    reads: float              # reused bytes loaded, cluster
    reads_network: float      # of which from another host
    writes_payload: float     # new bytes written, one copy
    writes_replicas: float    # bytes written to storage: every replica (and the hot objects' extra ones)
    writes_network: float     # of which to another host
    per_host: float           # network bytes per host and direction, on average
    per_host_peak: float      # on the host busiest with the hot set's replicas
    utilisation: float        # per_host / NIC
    utilisation_peak: float
    load_s: float             # a prompt's reused bytes at the average utilisation (inf: saturated)
    load_s_peak: float        # the same through the busiest host
    hot_objects: float
    hot_units: float          # hot objects x their replicas: the balls thrown into hosts


@dataclass(frozen=True)
class Failure:
    """The largest failure domain lost."""

    lost_hosts: int
    survivors: int
    capacity_after: float     # survivors x usable segment
    lost_outright: float      # share of objects with every replica in the lost domain (recomputed)
    bytes_lost_outright: float
    repair_bytes: float       # replicas lost whose object survives: copied from a survivor
    repair_s: float           # at repair_share of the survivors' NICs (inf: no survivor)
    per_survivor: float       # steady network bytes/s per survivor (the lost hosts' share moves over)
    utilisation_during_repair: float
    holds_all_replicas: bool  # survivors hold every replica again after repair
    holds_one_copy: bool      # survivors hold at least one copy of the working set


@dataclass(frozen=True)
class Plan:
    model: Model
    workload: Workload
    store: Store
    cluster: Cluster
    bytes_per_token: int
    tokens: Tokens
    capacity: Capacity
    objects: Objects
    traffic: Traffic
    failure: Failure
    notes: tuple = field(default=())

    @property
    def reuse(self) -> float:
        """Share of prompt tokens loaded instead of recomputed."""
        return self.tokens.reused / self.tokens.prompt


# --------------------------------------------------------------------------- arithmetic


def canonical_dtype(name: str) -> Optional[str]:
    if not isinstance(name, str):
        return None
    name = name.lower()
    name = DTYPE_ALIASES.get(name, name)
    return name if name in DTYPE_BYTES else None


def whole_chunk_tokens(tokens: float, chunk: int) -> float:
    """Expected tokens in whole chunks of a span of about ``tokens`` tokens
    starting at a chunk boundary: none below one chunk, else all but the
    ``(chunk - 1) / 2`` tokens its end leaves in a partial chunk on average.
    Never above ``tokens``; never falls as ``tokens`` grows or ``chunk`` shrinks."""
    return 0.0 if tokens < chunk else tokens - (chunk - 1) / 2


def expected_max_load(balls: float, bins: int) -> float:
    """Expected largest bin when ``balls`` land in ``bins`` at random: the
    maximum of ``bins`` independent Poisson(``balls / bins``) counts, and at
    least one whole ball (or all of them, when there is less than one). Exact
    for one bin; never below the mean ``balls / bins``."""
    if balls <= 0:
        return 0.0
    lam = balls / bins
    if bins == 1:
        return lam
    spread = 12 * math.sqrt(lam) + 40
    lo = max(0, math.floor(lam - spread))
    hi = math.ceil(lam + spread)
    # tails T(k) = P(X > k), summed from the top so tiny tails stay exact
    log_lam = math.log(lam)
    pmf = [math.exp(k * log_lam - lam - math.lgamma(k + 1)) for k in range(lo, hi + 1)]
    total, tail = float(lo), 0.0
    tails = []
    for p in reversed(pmf):
        tails.append(tail)
        tail += p
    for t in reversed(tails):   # k = lo .. hi: P(max > k) = 1 - (1 - T(k))^bins
        total += 1.0 if t >= 1 else -math.expm1(bins * math.log1p(-t))
    return max(total, lam, min(balls, 1.0))


def load_time(nbytes: float, bandwidth: float, utilisation: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``bandwidth`` bytes/s that is
    ``utilisation`` busy (M/M/1 response time); ``inf`` when saturated."""
    if nbytes <= 0:
        return 0.0
    if utilisation >= 1:
        return math.inf
    return nbytes / bandwidth / (1 - utilisation)


def lost_outright_share(replicas: int, hosts: int, lost: int) -> float:
    """Share of objects whose ``replicas`` distinct hosts (of ``hosts``) are
    all among the ``lost`` ones, placement ignoring domains."""
    r = min(replicas, hosts)
    if lost >= hosts:
        return 1.0
    return math.comb(lost, r) / math.comb(hosts, r)


def prompt_tokens(workload: Workload, chunk: int) -> Tokens:
    prompt = shared = reused = stored = 0.0
    for tokens, p in workload.weighted():
        s = workload.sharing * tokens
        prompt += p * tokens
        shared += p * s
        reused += p * whole_chunk_tokens(s, chunk)
        stored += p * whole_chunk_tokens(tokens, chunk)
    return Tokens(prompt=prompt, shared=shared, reused=reused, stored=stored,
                  written=stored - reused, shared_waste=shared - reused, tail_waste=prompt - stored)


def plan(model: Model, workload: Workload, store: Store, cluster: Cluster) -> Plan:
    """The three ledgers and the failure check (see the module docstring)."""
    notes = []
    n = cluster.hosts
    if store.replicas > n or store.hot > n:
        raise InvalidArgument(f"{max(store.replicas, store.hot)} replicas need as many hosts, not {n}")
    bpt = model.bytes_per_token
    chunk = store.chunk_tokens
    tok = prompt_tokens(workload, chunk)
    rate = workload.request_rate
    r, hr = store.replicas, store.hot

    # --- objects
    object_bytes = chunk * bpt
    allocated = -(-object_bytes // store.page_size) * store.page_size
    written_s = rate * tok.written / chunk
    stored_objects = written_s * workload.retention_s
    hot_prefixes = max(1, math.ceil(workload.hot_fraction * workload.prefixes))
    hot_objects = min(hot_prefixes * tok.reused / chunk, stored_objects)
    if hot_prefixes * tok.reused / chunk > stored_objects:
        notes.append("the hot prefixes hold more chunks than the retention keeps: "
                     "raise retention_s or lower prefixes")
    extra_replicas = hot_objects * (hr - r)
    replicas_stored = stored_objects * r + extra_replicas
    read_s = rate * tok.reused / chunk
    looked_up_s = rate * tok.stored / chunk
    prompts_writing = rate if tok.written > 0 else 0.0
    prompts_reading = rate if tok.reused > 0 else 0.0
    master_items_s = looked_up_s + 2 * written_s + read_s       # read_begin keys, put start+end, release
    master_requests_s = rate + 2 * prompts_writing + prompts_reading

    # --- traffic
    reads = rate * tok.reused * bpt
    hot_reads = workload.hot_share * reads
    local, hot_local = r / n, hr / n          # a reader on a host with a replica reads it locally
    hot_net = hot_reads * (1 - hot_local)
    cold_net = (reads - hot_reads) * (1 - local)
    payload_s = rate * tok.written * bpt
    extra_s = extra_replicas * allocated / workload.retention_s   # hot copies made within the retention
    writes_replicas = payload_s * r + extra_s
    writes_net = writes_replicas * (1 - 1 / n)                    # the writer's own node holds 1/n of them
    per_host = (hot_net + cold_net + writes_net) / n
    hot_units = hot_objects * min(hr, n)
    busiest = expected_max_load(hot_units, n) / hot_units if hot_units > 0 else 1 / n
    peak = (cold_net + writes_net) / n + hot_net * busiest
    bw = cluster.nic_bytes_s
    reused_bytes = tok.reused * bpt
    traffic = Traffic(
        reads=reads, reads_network=hot_net + cold_net, writes_payload=payload_s,
        writes_replicas=writes_replicas, writes_network=writes_net, per_host=per_host,
        per_host_peak=peak, utilisation=per_host / bw, utilisation_peak=peak / bw,
        load_s=load_time(reused_bytes, bw, per_host / bw),
        load_s_peak=load_time(reused_bytes, bw, peak / bw),
        hot_objects=hot_objects, hot_units=hot_units)

    wire_s = read_s * store.read_wire_bytes + written_s * r * store.write_wire_bytes
    moved = traffic.reads_network + writes_net
    objects = Objects(
        stored=stored_objects, replicas_stored=replicas_stored, written_s=written_s, read_s=read_s,
        looked_up_s=looked_up_s, master_items_s=master_items_s, master_requests_s=master_requests_s,
        master_metadata=stored_objects * store.metadata_bytes, wire_overhead_s=wire_s,
        wire_overhead_share=wire_s / moved if moved > 0 else 0.0,
        page_slack=replicas_stored * (allocated - object_bytes))

    # --- capacity
    working_set = stored_objects * object_bytes
    stored = replicas_stored * allocated
    inflight = (reads + payload_s) / n * store.inflight_s    # a put's replicas share its one buffer
    l1 = 0 if cluster.l1_in_segment else cluster.l1_per_host
    index = replicas_stored * store.index_bytes / n
    committed = cluster.segment_per_host + l1 + cluster.staging_per_host + inflight + index
    naive = (cluster.segment_per_host + cluster.l1_per_host + cluster.staging_per_host
             + (reads + payload_s * r) / n * store.inflight_s + index)
    capacity = Capacity(
        object_bytes=object_bytes, allocated_bytes=allocated, working_set=working_set,
        hot_extra=extra_replicas * allocated, stored=stored, per_host=stored / n,
        usable_per_host=cluster.segment_per_host * store.high_watermark, index_per_host=index,
        master_metadata=objects.master_metadata, inflight_per_host=inflight,
        staging_per_host=cluster.staging_per_host, l1_per_host=l1, host_committed=committed,
        host_naive=naive, host_memory=cluster.memory_per_host)

    # --- the largest failure domain lost
    lost = cluster.largest_domain
    survivors = n - lost
    q = lost_outright_share(r, n, lost)
    # every replica on a lost host, less those of objects lost outright
    repair_bytes = max(replicas_stored * lost / n - stored_objects * q * r, 0.0) * allocated
    after = survivors * capacity.usable_per_host
    steady = per_host * n / survivors if survivors else math.inf
    repair_s = repair_bytes / (survivors * bw * cluster.repair_share) if survivors else math.inf
    during = (steady + (bw * cluster.repair_share if repair_bytes > 0 else 0.0)) / bw
    failure = Failure(
        lost_hosts=lost, survivors=survivors, capacity_after=after, lost_outright=q,
        bytes_lost_outright=stored_objects * q * object_bytes, repair_bytes=repair_bytes,
        repair_s=repair_s if repair_bytes > 0 else 0.0, per_survivor=steady,
        utilisation_during_repair=during,
        holds_all_replicas=survivors > 0 and stored * (1 - q) <= after,
        holds_one_copy=survivors > 0 and stored_objects * (1 - q) * allocated <= after)

    if capacity.per_host > capacity.usable_per_host:
        notes.append("the working set does not fit below the eviction watermark: "
                     "the store evicts what engines will ask for")
    if committed > cluster.memory_per_host:
        notes.append("a host's committed memory exceeds its memory")
    return Plan(model=model, workload=workload, store=store, cluster=cluster, bytes_per_token=bpt,
                tokens=tok, capacity=capacity, objects=objects, traffic=traffic, failure=failure,
                notes=tuple(notes))


def with_chunk(p: Plan, chunk: int) -> Plan:
    """The same inputs with another chunk size."""
    return plan(p.model, p.workload, replace(p.store, chunk_tokens=chunk), p.cluster)


def hot_replica_options(p: Plan, counts) -> list[Plan]:
    """The plan again with each count of replicas for the hot prefixes' objects."""
    return [plan(p.model, p.workload, replace(p.store, hot_replicas=c), p.cluster)
            for c in counts if c <= p.cluster.hosts]


# --------------------------------------------------------------------------- checks


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive_int(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if type(v) is not int or v <= 0:
            raise InvalidArgument(f"{name} must be a positive integer, not {v!r}")


def _positive(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not _finite(v) or v <= 0:
            raise InvalidArgument(f"{name} must be a positive number, not {v!r}")


def _non_negative(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not _finite(v) or v < 0:
            raise InvalidArgument(f"{name} must be a number >= 0, not {v!r}")


def _fraction(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not _finite(v) or not 0 <= v <= 1:
            raise InvalidArgument(f"{name} must be in [0, 1], not {v!r}")
