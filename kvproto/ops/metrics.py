"""Prometheus metrics of the master, storage nodes and clients.

The processes already count what matters: :class:`~kvproto.runtime.master.MasterCore`
keeps ``counters`` and answers ``stats()``, :class:`~kvproto.runtime.storage.StorageCore`
keeps ``counters``, a :class:`~kvproto.runtime.client.Client` keeps
``lease_counters`` and ``failover_counters``, a transfer pool answers
``counts()``. The collectors here read those when Prometheus scrapes, in the
exporter's HTTP thread; the request path gains only one latency observation
per request, through the servers' and the client's ``observe`` hook (``None``,
and free, when metrics are off).

Reading from another thread: the cores' dicts are copied with ``dict(d)``
(one step under the interpreter lock) and ``MasterCore.stats()`` reads only
immutable maps, lengths and such copies; a read that still meets a dict
changing size is retried.

Every metric is declared once in :data:`METRICS` (name, type, labels, help);
``docs/metrics.md`` documents each, and a test holds the two to each other.
:func:`master_samples`, :func:`storage_samples` and :func:`client_samples`
turn the processes' own figures into samples; the collectors and
``kvproto stats`` both use them, so both show the same figures.

Use: ``kvproto master --metrics-port 9100`` / ``kvproto storage
--metrics-port 9101``; ``kvproto.embedded(metrics=True)`` (each server on a
free loopback port, see ``cluster.metrics_urls``); for an engine's clients,
``ClientCollector([client], pools={"engine": engine})`` registered in the
engine's own registry, or served with :func:`serve_clients`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from kvproto import errors

# --------------------------------------------------------------------------- the metrics


@dataclass(frozen=True)
class Metric:
    kind: str                 # "counter", "gauge" or "histogram"
    labels: tuple
    help: str


def _m(kind: str, labels: tuple, help_text: str) -> Metric:
    return Metric(kind, labels, help_text)


C, G, H = "counter", "gauge", "histogram"

#: every metric kvproto exports: name -> (type, labels, help)
METRICS: dict[str, Metric] = {
    # master: requests
    "kvproto_master_request_seconds": _m(H, ("op",), "Time the master's loop spent handling a request, by operation (its count is the request rate)."),
    "kvproto_master_rejected_total": _m(C, (), "Requests refused before decoding: malformed, too large, unknown operation."),
    "kvproto_master_duplicates_dropped_total": _m(C, (), "Copies of a request the network delivered twice on one connection (same request id), dropped unserved."),
    "kvproto_master_refusals_total": _m(C, (), "Events the publish machine refused, each answered with its typed error (misses included)."),
    "kvproto_master_not_open_refusals_total": _m(C, (), "Requests refused because the master was not open (standby, fencing, recovering)."),
    "kvproto_master_unauthorized_total": _m(C, (), "Requests refused because their credential authenticates no tenant (a master with a tenants file)."),
    "kvproto_master_aged_out_total": _m(C, (), "Objects of retiring namespaces removed by the age-out pass (spec/Tenancy.tla AgeOut)."),
    # master: objects
    "kvproto_master_objects": _m(G, (), "Objects in the directory (pending and published)."),
    "kvproto_master_pending_puts": _m(G, (), "Allocations granted and not yet published or revoked."),
    "kvproto_master_clients": _m(G, (), "Client sessions with something in flight."),
    "kvproto_master_puts_total": _m(C, ("outcome",), "Puts by outcome: started (granted), published, revoked (by the writer), reclaimed (writer silent)."),
    "kvproto_master_lookups_total": _m(C, ("result",), "Read lookups (read_begin keys): hit (a published object) or miss."),
    "kvproto_master_read_ends_total": _m(C, ("by",), "Read pins ended by the reader, or reclaimed from a silent one."),
    "kvproto_master_removes_total": _m(C, (), "Objects removed on request."),
    "kvproto_master_forced_removes_total": _m(C, (), "Removes forced past unexpired leases (operators)."),
    "kvproto_master_evictions_total": _m(C, (), "Objects evicted past the high watermark (least recently used, unleased)."),
    "kvproto_master_eviction_short_total": _m(C, (), "Eviction rounds that could not free enough (everything left was leased or pinned)."),
    "kvproto_master_storage_refusals_total": _m(C, (), "Storage node refusals of the master's commands (assign, free, publish)."),
    # master: leases
    "kvproto_master_leases_total": _m(C, ("event",), "Read leases: granted, renewed, renewal_refused, released, expired."),
    "kvproto_master_leased_remove_refusals_total": _m(C, (), "Removes refused because the object was under a lease."),
    "kvproto_master_leases_held": _m(G, (), "Read leases currently held."),
    "kvproto_master_lease_ttl_seconds": _m(G, (), "The lease time-to-live the master grants."),
    # master: space
    "kvproto_master_used_bytes": _m(G, (), "Bytes allocated on live segments (the eviction ledger)."),
    "kvproto_master_capacity_bytes": _m(G, (), "Capacity of live segments."),
    "kvproto_master_high_watermark_ratio": _m(G, (), "Share of capacity past which the master evicts."),
    "kvproto_stored_bytes": _m(G, ("segment", "tenant", "namespace"), "Bytes allocated to objects: by segment (tenant and namespace empty), and with a tenants file also by tenant and namespace (segment empty; replicas counted)."),
    "kvproto_tenant_bytes": _m(G, ("tenant", "kind"), "A tenant's bytes against its quotas (a master with a tenants file): held (published or being written, replicas counted), in_flight (writes not yet published, reads not yet released), quota_stored, quota_in_flight."),
    "kvproto_segment_capacity_bytes": _m(G, ("segment",), "A segment's capacity."),
    "kvproto_segment_free_extent_bytes": _m(G, ("segment",), "Free bytes in whole free pages of a segment (what can still be allocated)."),
    "kvproto_segment_live": _m(G, ("segment",), "1 while the segment is live, 0 once lost."),
    "kvproto_master_segments_total": _m(C, ("event",), "Segments joined and lost."),
    # master: failover
    "kvproto_master_term": _m(G, (), "The term this master holds (0: standby)."),
    "kvproto_master_phase": _m(G, ("phase",), "1 for the master's current failover phase: standby, fencing, recovered, open."),
    "kvproto_master_terms_won_total": _m(C, (), "Terms this master process won (each a fence and a recovery)."),
    "kvproto_master_publish_marks_total": _m(C, ("result",), "Publishes recorded in the storage nodes' indexes: ok or refused."),
    "kvproto_master_stale_term_refusals_total": _m(C, (), "Commands a storage node refused for a stale term (a newer master exists)."),
    "kvproto_master_checksum_mismatches_total": _m(C, (), "Replicas a takeover left out because their node's index records another checksum than the replica listed."),
    # master: replica repair
    "kvproto_master_repairs_total": _m(C, ("event",), "Repairs of objects below their requested replica count (spec/Publish.tla): started, listed (on the copier's report of a complete copy), cancelled (every repair ended unlisted), failed (the copier reported an error), timed_out (not reported in time)."),
    "kvproto_master_repair_reports_refused_total": _m(C, (), "Copier reports refused because they named a repair no longer in flight (a late report of a cancelled copy); nothing is listed."),
    "kvproto_master_repaired_bytes_total": _m(C, (), "Bytes of the repaired replicas listed."),
    "kvproto_master_repairs_in_flight": _m(G, (), "Repair copies in flight now (at most the master's max_repairs)."),
    "kvproto_master_repairs_queued": _m(G, (), "Objects below their requested count waiting for a repair (from the last scan)."),
    "kvproto_failover_last_term": _m(G, (), "Term of the last takeover."),
    "kvproto_failover_last_seconds": _m(G, ("stage",), "The last takeover's duration: fence (until the nodes answered), recover (rebuilding the directory), open (term to open)."),
    "kvproto_failover_last_nodes": _m(G, ("state",), "Storage nodes at the last takeover: fenced, or lost (did not answer)."),
    "kvproto_failover_last_objects": _m(G, ("what",), "Objects at the last takeover: recovered, or purged (unpublished)."),
    "kvproto_failover_last_purged_bytes": _m(G, (), "Bytes of unpublished allocations purged at the last takeover."),
    # storage node
    "kvproto_storage_request_seconds": _m(H, ("op",), "Time the node spent on a request, by operation (its count is the request rate)."),
    "kvproto_storage_info": _m(G, ("segment", "endpoint"), "1, labelled with the segment this node serves and its endpoint."),
    "kvproto_storage_term": _m(G, (), "The highest master term this node has seen (its fence)."),
    "kvproto_storage_capacity_bytes": _m(G, (), "The segment's capacity."),
    "kvproto_storage_regions": _m(G, (), "Regions allocated in the segment."),
    "kvproto_storage_indexed_objects": _m(G, (), "Entries in the node's failover index."),
    "kvproto_storage_used_bytes": _m(G, (), "Bytes allocated in the segment (kvproto stats only: summed over regions on request)."),
    "kvproto_storage_published_objects": _m(G, (), "Published objects in the index (kvproto stats only)."),
    "kvproto_storage_transfers_in_progress": _m(G, (), "Tracked transfers arrived and not yet run (scrapes only)."),
    "kvproto_storage_served_total": _m(C, ("op",), "Data requests served: write, read, load."),
    "kvproto_storage_direct_regions_total": _m(C, ("event",), "Regions of direct writers (spec/DirectWrite.tla): granted, published (after the writer's report), draining (freed while the writer may still write), drained."),
    "kvproto_storage_bytes_total": _m(C, ("direction",), "Payload bytes written into and read out of the segment."),
    "kvproto_storage_regions_total": _m(C, ("event",), "Regions assigned and freed at the master's command."),
    "kvproto_storage_refusals_total": _m(C, (), "Requests the region table or the fence refused (typed errors)."),
    "kvproto_storage_rejected_total": _m(C, (), "Requests refused before decoding."),
    "kvproto_storage_unauthorized_total": _m(C, (), "Requests refused because their credential authenticates no tenant (a node with a tenants file)."),
    "kvproto_storage_ticket_refusals_total": _m(C, (), "Reads and loads refused for lack of a valid read ticket (a node with a tenants file)."),
    "kvproto_storage_stale_reads_total": _m(C, (), "Reads refused because the region's generation no longer names the token."),
    "kvproto_storage_stale_term_refusals_total": _m(C, (), "Requests refused for a term below the fence."),
    "kvproto_storage_cancels_total": _m(C, (), "Cancels acknowledged."),
    "kvproto_storage_discarded_total": _m(C, (), "Transfers a cancel stopped before they ran (never written or sent)."),
    "kvproto_storage_publish_marks_total": _m(C, (), "Publishes recorded in the node's index."),
    "kvproto_storage_fences_total": _m(C, (), "Fences by a new master's term."),
    "kvproto_storage_purged_total": _m(C, (), "Unpublished allocations purged after a failover."),
    "kvproto_storage_purged_bytes_total": _m(C, (), "Bytes freed by those purges."),
    "kvproto_storage_repairs_total": _m(C, ("event",), "Repair copies into this segment: started (the master's repair command accepted), copied (pulled from the source, checked and written), failed (reported to the master with their error)."),
    "kvproto_storage_repaired_bytes_total": _m(C, (), "Bytes written into this segment by repair copies (not counted as client writes)."),
    "kvproto_storage_injected_faults_total": _m(C, ("fault",), "Test-only faults: dropped, duplicated, read_delayed replies."),
    # client
    "kvproto_client_master_seconds": _m(H, ("op",), "Round trip of a request to the master, by operation, as the client saw it."),
    "kvproto_client_leased_reads_total": _m(C, ("result",), "Leased reads checked after their transfer: accepted, or rejected (bytes dropped)."),
    "kvproto_client_lease_rejections_total": _m(C, ("reason",), "Rejected leased reads by reason: lease-too-short, network-slow, queued-too-long."),
    "kvproto_client_lease_renewals_total": _m(C, ("result",), "Lease renewals: ok or refused."),
    "kvproto_client_lease_releases_total": _m(C, (), "Leases released after a read."),
    "kvproto_client_read_phase_seconds_total": _m(C, ("phase",), "Time leased reads spent queued, transferring and verifying."),
    "kvproto_client_masters_found_total": _m(C, (), "Times the client found a new master through the coordinator."),
    "kvproto_client_switch_misses_total": _m(C, (), "Keys missed because the master was switching."),
    "kvproto_client_transfers_total": _m(C, ("path",), "Replica bytes moved, by path: direct_write (into a same-host segment by the client), network_write, local_read (out of a same-host segment), network_read."),
    "kvproto_client_master_unreachable_total": _m(C, (), "Calls refused with MasterUnreachable: no master served past the switch window."),
    "kvproto_client_stale_term_relookups_total": _m(C, (), "Keys looked up again after a node refused a stale term."),
    "kvproto_client_recomputes_total": _m(C, ("decision",), "Fall-backs to recomputation: allowed or refused by the rate limit."),
    "kvproto_client_checksums_total": _m(C, ("result",), "Replicas read with verify=True: verified (the bytes match the checksum recorded at publish), mismatch (ChecksumMismatch, or the next replica tried), absent (no checksum recorded: not checked)."),
    "kvproto_client_buffers": _m(G, ("pool", "state"), "Pool buffers by state: free, held (by a request, incl. loading), quarantined (timed out, not drained), leaked (written off)."),
    "kvproto_client_buffers_loading": _m(G, ("pool",), "Pool buffers with a transfer in flight."),
    "kvproto_client_transfers_tracked": _m(G, ("pool",), "Transfers the pool still tracks."),
    "kvproto_client_transfer_events_total": _m(C, ("pool", "event"), "Pool transfer events: timed_out, stale_dropped (late callbacks), written_off, recovered."),
}

#: MasterCore counter -> (metric, labels)
MASTER_COUNTERS: dict[str, tuple[str, dict]] = {
    "puts_started": ("kvproto_master_puts_total", {"outcome": "started"}),
    "puts_published": ("kvproto_master_puts_total", {"outcome": "published"}),
    "puts_revoked": ("kvproto_master_puts_total", {"outcome": "revoked"}),
    "reclaimed": ("kvproto_master_puts_total", {"outcome": "reclaimed"}),
    "abandoned": ("kvproto_master_puts_total", {"outcome": "abandoned"}),
    "reads": ("kvproto_master_lookups_total", {"result": "hit"}),
    "misses": ("kvproto_master_lookups_total", {"result": "miss"}),
    "read_ends": ("kvproto_master_read_ends_total", {"by": "reader"}),
    "reads_reclaimed": ("kvproto_master_read_ends_total", {"by": "reclaimed"}),
    "removes": ("kvproto_master_removes_total", {}),
    "removes_forced": ("kvproto_master_forced_removes_total", {}),
    "evictions": ("kvproto_master_evictions_total", {}),
    "eviction_short": ("kvproto_master_eviction_short_total", {}),
    "segments_joined": ("kvproto_master_segments_total", {"event": "joined"}),
    "segments_lost": ("kvproto_master_segments_total", {"event": "lost"}),
    "storage_refusals": ("kvproto_master_storage_refusals_total", {}),
    "rejected": ("kvproto_master_rejected_total", {}),
    "duplicates_dropped": ("kvproto_master_duplicates_dropped_total", {}),
    "refused": ("kvproto_master_refusals_total", {}),
    "lease_grants": ("kvproto_master_leases_total", {"event": "granted"}),
    "lease_renewals": ("kvproto_master_leases_total", {"event": "renewed"}),
    "lease_renewals_refused": ("kvproto_master_leases_total", {"event": "renewal_refused"}),
    "lease_releases": ("kvproto_master_leases_total", {"event": "released"}),
    "lease_expiries": ("kvproto_master_leases_total", {"event": "expired"}),
    "leased_refusals": ("kvproto_master_leased_remove_refusals_total", {}),
    "publish_marks": ("kvproto_master_publish_marks_total", {"result": "ok"}),
    "publish_mark_refusals": ("kvproto_master_publish_marks_total", {"result": "refused"}),
    "stale_term_refusals": ("kvproto_master_stale_term_refusals_total", {}),
    "not_open": ("kvproto_master_not_open_refusals_total", {}),
    "unauthorized": ("kvproto_master_unauthorized_total", {}),
    "aged_out": ("kvproto_master_aged_out_total", {}),
    "checksum_mismatches": ("kvproto_master_checksum_mismatches_total", {}),
    "repairs_started": ("kvproto_master_repairs_total", {"event": "started"}),
    "repairs_listed": ("kvproto_master_repairs_total", {"event": "listed"}),
    "repairs_cancelled": ("kvproto_master_repairs_total", {"event": "cancelled"}),
    "repairs_failed": ("kvproto_master_repairs_total", {"event": "failed"}),
    "repairs_timed_out": ("kvproto_master_repairs_total", {"event": "timed_out"}),
    "repair_reports_refused": ("kvproto_master_repair_reports_refused_total", {}),
    "bytes_repaired": ("kvproto_master_repaired_bytes_total", {}),
}

#: StorageCore counter -> (metric, labels)
STORAGE_COUNTERS: dict[str, tuple[str, dict]] = {
    "assigned": ("kvproto_storage_regions_total", {"event": "assigned"}),
    "freed": ("kvproto_storage_regions_total", {"event": "freed"}),
    "writes": ("kvproto_storage_served_total", {"op": "write"}),
    "reads": ("kvproto_storage_served_total", {"op": "read"}),
    "loads": ("kvproto_storage_served_total", {"op": "load"}),
    "bytes_written": ("kvproto_storage_bytes_total", {"direction": "written"}),
    "bytes_read": ("kvproto_storage_bytes_total", {"direction": "read"}),
    "refused": ("kvproto_storage_refusals_total", {}),
    "rejected": ("kvproto_storage_rejected_total", {}),
    "unauthorized": ("kvproto_storage_unauthorized_total", {}),
    "tickets_refused": ("kvproto_storage_ticket_refusals_total", {}),
    "stale_reads": ("kvproto_storage_stale_reads_total", {}),
    "stale_terms": ("kvproto_storage_stale_term_refusals_total", {}),
    "cancels": ("kvproto_storage_cancels_total", {}),
    "discarded": ("kvproto_storage_discarded_total", {}),
    "published": ("kvproto_storage_publish_marks_total", {}),
    "fences": ("kvproto_storage_fences_total", {}),
    "purged": ("kvproto_storage_purged_total", {}),
    "bytes_purged": ("kvproto_storage_purged_bytes_total", {}),
    "dropped": ("kvproto_storage_injected_faults_total", {"fault": "dropped"}),
    "duplicated": ("kvproto_storage_injected_faults_total", {"fault": "duplicated"}),
    "reads_delayed": ("kvproto_storage_injected_faults_total", {"fault": "read_delayed"}),
    "direct_granted": ("kvproto_storage_direct_regions_total", {"event": "granted"}),
    "direct_published": ("kvproto_storage_direct_regions_total", {"event": "published"}),
    "draining": ("kvproto_storage_direct_regions_total", {"event": "draining"}),
    "drained": ("kvproto_storage_direct_regions_total", {"event": "drained"}),
    "repairs_started": ("kvproto_storage_repairs_total", {"event": "started"}),
    "repairs_copied": ("kvproto_storage_repairs_total", {"event": "copied"}),
    "repairs_failed": ("kvproto_storage_repairs_total", {"event": "failed"}),
    "bytes_repaired": ("kvproto_storage_repaired_bytes_total", {}),
}

#: Client.lease_counters / failover_counters / transfer_counters /
#: checksum_counters -> (metric, labels)
CLIENT_COUNTERS: dict[str, tuple[str, dict]] = {
    "lease_accepted": ("kvproto_client_leased_reads_total", {"result": "accepted"}),
    "lease_rejected": ("kvproto_client_leased_reads_total", {"result": "rejected"}),
    "rejected_lease-too-short": ("kvproto_client_lease_rejections_total", {"reason": "lease-too-short"}),
    "rejected_network-slow": ("kvproto_client_lease_rejections_total", {"reason": "network-slow"}),
    "rejected_queued-too-long": ("kvproto_client_lease_rejections_total", {"reason": "queued-too-long"}),
    "renewals": ("kvproto_client_lease_renewals_total", {"result": "ok"}),
    "renewals_refused": ("kvproto_client_lease_renewals_total", {"result": "refused"}),
    "releases": ("kvproto_client_lease_releases_total", {}),
    "queued_s": ("kvproto_client_read_phase_seconds_total", {"phase": "queued"}),
    "transferring_s": ("kvproto_client_read_phase_seconds_total", {"phase": "transferring"}),
    "verifying_s": ("kvproto_client_read_phase_seconds_total", {"phase": "verifying"}),
    "masters_found": ("kvproto_client_masters_found_total", {}),
    "switch_misses": ("kvproto_client_switch_misses_total", {}),
    "unreachable": ("kvproto_client_master_unreachable_total", {}),
    "stale_term_relookups": ("kvproto_client_stale_term_relookups_total", {}),
    "recomputes_allowed": ("kvproto_client_recomputes_total", {"decision": "allowed"}),
    "recomputes_refused": ("kvproto_client_recomputes_total", {"decision": "refused"}),
    "direct_writes": ("kvproto_client_transfers_total", {"path": "direct_write"}),
    "network_writes": ("kvproto_client_transfers_total", {"path": "network_write"}),
    "local_reads": ("kvproto_client_transfers_total", {"path": "local_read"}),
    "network_reads": ("kvproto_client_transfers_total", {"path": "network_read"}),
    "checksum_verified": ("kvproto_client_checksums_total", {"result": "verified"}),
    "checksum_mismatches": ("kvproto_client_checksums_total", {"result": "mismatch"}),
    "checksum_absent": ("kvproto_client_checksums_total", {"result": "absent"}),
}
#: lease counters that are sums of others (not exported twice)
CLIENT_DERIVED = ("lease_reads",)

PHASES = ("standby", "fencing", "recovered", "open")

#: latency buckets: the master answers in microseconds, a storage node's memcpy
#: of a large object takes milliseconds
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
           0.1, 0.25, 0.5, 1.0, 2.5)

Sample = tuple  # (name, labels: dict, value)


# --------------------------------------------------------------------------- samples


def _counters(counters: Mapping[str, float], table: Mapping[str, tuple[str, dict]]) -> list[Sample]:
    return [(name, dict(labels), counters.get(key, 0)) for key, (name, labels) in table.items()]


def master_samples(s: Mapping[str, Any]) -> list[Sample]:
    """A master's ``stats()`` (or its ``stats`` reply) as samples."""
    out = _counters(s.get("counters", {}), MASTER_COUNTERS)
    add = lambda name, value, **labels: out.append((name, labels, value))  # noqa: E731
    add("kvproto_master_objects", s.get("objects", 0))
    add("kvproto_master_pending_puts", s.get("pending", 0))
    add("kvproto_master_clients", s.get("clients", 0))
    leases = s.get("leases", {})
    add("kvproto_master_leases_held", leases.get("held", 0))
    add("kvproto_master_lease_ttl_seconds", leases.get("ttl", 0))
    add("kvproto_master_used_bytes", leases.get("used", 0))
    add("kvproto_master_capacity_bytes", leases.get("capacity", 0))
    add("kvproto_master_high_watermark_ratio", leases.get("high_watermark", 0))
    for segment, seg in sorted(s.get("segments", {}).items()):
        add("kvproto_stored_bytes", seg["used"], segment=segment, tenant="", namespace="")
        add("kvproto_segment_capacity_bytes", seg["capacity"], segment=segment)
        add("kvproto_segment_free_extent_bytes", seg.get("free_extent_bytes", 0), segment=segment)
        add("kvproto_segment_live", int(bool(seg["live"])), segment=segment)
    for tenant, usage in sorted(s.get("tenants", {}).items()):
        for namespace, held in sorted(usage.get("namespaces", {}).items()):
            add("kvproto_stored_bytes", held, segment="", tenant=tenant, namespace=namespace)
        quota = usage.get("quota", {})
        for kind, value in (("held", usage.get("held", 0)), ("in_flight", usage.get("in_flight", 0)),
                            ("quota_stored", quota.get("stored", 0)),
                            ("quota_in_flight", quota.get("in_flight", 0))):
            add("kvproto_tenant_bytes", value, tenant=tenant, kind=kind)
    repairs = s.get("repairs", {})
    add("kvproto_master_repairs_in_flight", repairs.get("in_flight", 0))
    add("kvproto_master_repairs_queued", repairs.get("queued", 0))
    failover = s.get("failover", {})
    add("kvproto_master_term", failover.get("term") or 0)
    for phase in PHASES:
        add("kvproto_master_phase", int(failover.get("phase") == phase), phase=phase)
    last = failover.get("last") or {}
    if last:
        add("kvproto_failover_last_term", last.get("term", 0))
        for stage in ("fence", "recover", "open"):
            add("kvproto_failover_last_seconds", last.get(f"{stage}_s", 0.0), stage=stage)
        add("kvproto_failover_last_nodes", last.get("nodes_fenced", 0), state="fenced")
        add("kvproto_failover_last_nodes", last.get("nodes_lost", 0), state="lost")
        add("kvproto_failover_last_objects", last.get("recovered", 0), what="recovered")
        add("kvproto_failover_last_objects", last.get("purged", 0), what="purged")
        add("kvproto_failover_last_purged_bytes", last.get("bytes_purged", 0))
    return out


def storage_samples(s: Mapping[str, Any]) -> list[Sample]:
    """A storage node's figures (:func:`storage_snapshot`, or its ``stats`` reply) as samples."""
    out = _counters(s.get("counters", {}), STORAGE_COUNTERS)
    add = lambda name, value, **labels: out.append((name, labels, value))  # noqa: E731
    add("kvproto_storage_info", 1, segment=s.get("segment", ""), endpoint=s.get("endpoint", ""))
    add("kvproto_storage_term", s.get("term", 0))
    add("kvproto_storage_capacity_bytes", s.get("capacity", 0))
    add("kvproto_storage_regions", s.get("regions", 0))
    add("kvproto_storage_indexed_objects", s.get("indexed", 0))
    for key, name in (("used", "kvproto_storage_used_bytes"), ("published", "kvproto_storage_published_objects"),
                      ("transfers", "kvproto_storage_transfers_in_progress")):
        if key in s:
            add(name, s[key])
    return out


def client_samples(counters: Mapping[str, float], pools: Mapping[str, Mapping[str, int]]) -> list[Sample]:
    """A process's clients' summed lease and failover counters, and its
    transfer pools' ``counts()`` by pool name, as samples."""
    out = _counters(counters, CLIENT_COUNTERS)
    for pool, c in sorted(pools.items()):
        for state in ("free", "held", "quarantined", "leaked"):
            out.append(("kvproto_client_buffers", {"pool": pool, "state": state}, c.get(state, 0)))
        out.append(("kvproto_client_buffers_loading", {"pool": pool}, c.get("loading", 0)))
        out.append(("kvproto_client_transfers_tracked", {"pool": pool}, c.get("transfers", 0)))
        for event in ("timed_out", "stale_dropped", "written_off", "recovered"):
            out.append(("kvproto_client_transfer_events_total", {"pool": pool, "event": event},
                        c.get(event, 0)))
    return out


def storage_snapshot(core) -> dict:
    """What a scrape reads of a :class:`~kvproto.runtime.storage.StorageCore`:
    only figures kept as they change or O(1) to read (the ``stats`` request
    also sums the regions, which costs as much as the node holds objects)."""
    return {"segment": core.segment, "endpoint": core.endpoint, "capacity": core.memory.capacity,
            "term": core.term, "indexed": len(core.node.index), "regions": len(core.node.regions),
            "transfers": core.xfer_records(), "counters": dict(core.counters)}


def _read(fn: Callable[[], Any], tries: int = 5) -> Any:
    """``fn()`` from the scrape thread; a dict that changed size meanwhile is read again."""
    for attempt in range(tries):
        try:
            return fn()
        except RuntimeError:
            if attempt == tries - 1:
                raise


# --------------------------------------------------------------------------- collectors


def families(samples: Iterable[Sample]):
    """Prometheus metric families of ``samples`` (in :data:`METRICS` order)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    grouped: dict[str, list] = {}
    for name, labels, value in samples:
        grouped.setdefault(name, []).append((labels, value))
    for name, metric in METRICS.items():
        rows = grouped.get(name)
        if not rows:
            continue
        cls = CounterMetricFamily if metric.kind == C else GaugeMetricFamily
        family = cls(name, metric.help, labels=list(metric.labels))
        for labels, value in rows:
            family.add_metric([str(labels.get(label, "")) for label in metric.labels], float(value))
        yield family


class MasterCollector:
    """Reads a :class:`~kvproto.runtime.master_server.MasterServer`'s core at scrape time
    (the core is replaced when the master steps down, so it is looked up each time)."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = _read(self.server.core.stats)
        yield from families(master_samples(stats))
        won = CounterMetricFamily("kvproto_master_terms_won_total",
                                  METRICS["kvproto_master_terms_won_total"].help)
        won.add_metric([], float(len(self.server.terms_held)))
        yield won


class StorageCollector:
    """Reads a :class:`~kvproto.runtime.storage_server.StorageServer`'s core at scrape time."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        yield from families(storage_samples(_read(lambda: storage_snapshot(self.server.core))))


class ClientCollector:
    """The clients of one process (counters summed) and its transfer pools
    (anything with ``counts()``: a :class:`~kvproto.runtime.transfers.TransferEngine`,
    a GPU block pool), each under its ``pool`` label."""

    def __init__(self, clients: Iterable = (), pools: Optional[Mapping[str, Any]] = None) -> None:
        self._lock = threading.Lock()
        self.clients: list = []
        self.pools: dict[str, Any] = dict(pools or {})
        #: set by :func:`serve_clients`: each client's master round trips are timed
        self.observe: Optional[Callable[[str, float], None]] = None
        for client in clients:
            self.add(client)

    def add(self, client) -> None:
        with self._lock:
            self.clients.append(client)
            if self.observe is not None:
                client.observe = self.observe

    def timed(self, observe: Callable[[str, float], None]) -> None:
        """Time every client's master round trips with ``observe``, also of clients added later."""
        with self._lock:
            self.observe = observe
            for client in self.clients:
                client.observe = observe

    def add_pool(self, name: str, pool) -> None:
        with self._lock:
            self.pools[name] = pool

    def snapshot(self) -> tuple[dict, dict]:
        with self._lock:
            clients, pools = list(self.clients), dict(self.pools)
        total: dict[str, float] = {}
        for client in clients:
            for d in (_read(lambda: dict(client.lease_counters)), _read(lambda: dict(client.failover_counters)),
                      _read(lambda: dict(client.transfer_counters)),
                      _read(lambda: dict(client.checksum_counters))):
                for key, value in d.items():
                    total[key] = total.get(key, 0) + value
        return total, {name: pool.counts() for name, pool in pools.items()}

    def collect(self):
        yield from families(client_samples(*self.snapshot()))


# --------------------------------------------------------------------------- exposition


class Latency:
    """A request-latency histogram by operation; :meth:`observe` is the
    servers' and client's ``observe`` hook."""

    def __init__(self, name: str, registry) -> None:
        from prometheus_client import Histogram

        self.histogram = Histogram(name, METRICS[name].help, ["op"], registry=registry, buckets=BUCKETS)
        self._by_op: dict[str, Any] = {}

    def observe(self, op: str, seconds: float) -> None:
        child = self._by_op.get(op)
        if child is None:   # ops come from the wire schema's fixed table
            child = self._by_op[op] = self.histogram.labels(op)
        child.observe(seconds)


class Exporter:
    """An HTTP ``/metrics`` endpoint on ``host:port`` (0: a free port) with its
    own registry holding ``collectors``, a latency histogram when
    ``latency`` names one, and the process's CPU and memory."""

    def __init__(self, collectors: Iterable, *, latency: Optional[str] = None, port: int = 0,
                 host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        self.registry = CollectorRegistry(auto_describe=True)
        for collector in collectors:
            self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        self.latency = Latency(latency, self.registry) if latency else None
        try:
            self._httpd, self._thread = start_http_server(port, host, self.registry)
        except OSError as err:
            raise errors.InvalidArgument(f"metrics on {host}:{port}: {err.strerror or err}") from None
        self.host = host
        self.port: int = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_master(server, port: int = 0, host: str = "127.0.0.1") -> Exporter:
    """Expose a :class:`~kvproto.runtime.master_server.MasterServer`'s metrics."""
    exporter = Exporter([MasterCollector(server)], latency="kvproto_master_request_seconds",
                        port=port, host=host)
    server.observe = exporter.latency.observe
    return exporter


def serve_storage(server, port: int = 0, host: str = "127.0.0.1") -> Exporter:
    """Expose a :class:`~kvproto.runtime.storage_server.StorageServer`'s metrics."""
    exporter = Exporter([StorageCollector(server)], latency="kvproto_storage_request_seconds",
                        port=port, host=host)
    server.observe = exporter.latency.observe
    return exporter


def serve_clients(collector: ClientCollector, port: int = 0, host: str = "127.0.0.1") -> Exporter:
    """Expose a process's clients; each client's master round trips are timed."""
    exporter = Exporter([collector], latency="kvproto_client_master_seconds", port=port, host=host)
    collector.timed(exporter.latency.observe)
    return exporter
