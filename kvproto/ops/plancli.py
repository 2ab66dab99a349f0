"""``kvproto plan``: the planner's inputs from flags or a TOML file, its ledgers as text.

Every input has a flag and a ``[section] key`` in the TOML file (the
:data:`FIELDS` table); a flag overrides the file, the file overrides the
defaults (the worked example of ``docs/planning.md``). Mistakes are one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from kvproto import errors
from kvproto.ops import plan as P
from kvproto.runtime.units import format_size, parse_size


class InputError(ValueError):
    """A planner input that cannot be used (one line for the user)."""


# --------------------------------------------------------------------------- inputs


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError
    return float(v)


def _size(v: Any) -> int:
    return parse_size(v)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "yes", "1", "false", "no", "0"):
        return v.lower() in ("true", "yes", "1")
    raise ValueError


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError
    return v


def _distribution(v: Any) -> tuple:
    """``4096``, ``"1024:0.5,4096:0.4,16384:0.1"`` or ``[[1024, 0.5], ...]``."""
    if isinstance(v, int) and not isinstance(v, bool):
        return ((v, 1.0),)
    if isinstance(v, str):
        pairs = []
        for part in v.split(","):
            tokens, _, weight = part.strip().partition(":")
            pairs.append((int(tokens), float(weight) if weight else 1.0))
        return tuple(pairs)
    if isinstance(v, list):
        out = []
        for item in v:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError
            out.append((_int(item[0]), _float(item[1])))
        return tuple(out)
    raise ValueError


# (section, key, flag, parse, help): the record field is ``key`` of section's record
FIELDS: list[tuple[str, str, str, Callable[[Any], Any], str]] = [
    ("model", "layers", "--layers", _int, "transformer layers"),
    ("model", "kv_heads", "--kv-heads", _int, "KV heads per layer"),
    ("model", "head_dim", "--head-dim", _int, "head dimension"),
    ("model", "dtype", "--dtype", _text, f"KV dtype: {', '.join(P.DTYPE_BYTES)}"),
    ("workload", "request_rate", "--rate", _float, "prompts per second, whole cluster"),
    ("workload", "prompt_tokens", "--prompt-tokens", _distribution,
     "prompt lengths: TOKENS or TOKENS:WEIGHT,... (e.g. 1024:0.5,4096:0.5)"),
    ("workload", "sharing", "--sharing", _float, "fraction of a prompt that is a prefix seen before"),
    ("workload", "prefixes", "--prefixes", _int, "distinct shared prefixes live"),
    ("workload", "hot_fraction", "--hot-fraction", _float, "the hot share of prefixes (e.g. 0.05)"),
    ("workload", "hot_share", "--hot-share", _float, "share of reads that go to the hot prefixes"),
    ("workload", "retention_s", "--retention", _float, "seconds a chunk must stay to be reused"),
    ("store", "chunk_tokens", "--chunk", _int, "tokens per chunk (one object)"),
    ("store", "replicas", "--replicas", _int, "replicas per object"),
    ("store", "hot_replicas", "--hot-replicas", _int, "replicas of the hot prefixes' objects"),
    ("store", "page_size", "--page-size", _int, "allocation granularity in bytes"),
    ("store", "high_watermark", "--high-watermark", _float, "the master evicts past this share"),
    ("store", "inflight_s", "--inflight", _float, "seconds a transfer holds its buffer"),
    ("store", "metadata_bytes", "--metadata-bytes", _float,
     f"master memory per object (measured {P.MEASURED.date})"),
    ("store", "index_bytes", "--index-bytes", _float,
     f"storage node memory per replica (measured {P.MEASURED.date})"),
    ("cluster", "hosts", "--hosts", _int, "hosts, each an engine and a storage node"),
    ("cluster", "memory_per_host", "--memory", _size, "memory per host (e.g. 1TiB)"),
    ("cluster", "segment_per_host", "--segment", _size, "storage segment per host (e.g. 512GiB)"),
    ("cluster", "l1_per_host", "--l1", _size, "engine's host-side KV cache per host"),
    ("cluster", "l1_in_segment", "--l1-in-segment", _bool,
     "the engine's L1 is the segment's memory (true/false)"),
    ("cluster", "staging_per_host", "--staging", _size, "registered staging buffers per host"),
    ("cluster", "nic_gbps", "--nic-gbps", _float, "NIC bandwidth per host and direction, Gbit/s"),
    ("cluster", "failure_domains", "--failure-domains", _int, "failure domains (hosts split evenly)"),
    ("cluster", "repair_share", "--repair-share", _float, "share of a NIC repair may use"),
    ("cluster", "slo_load_s", "--slo", _float, "seconds allowed to load a prompt's reused prefix"),
]
RECORDS = {"model": P.Model, "workload": P.Workload, "store": P.Store, "cluster": P.Cluster}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML file with [model] [workload] [store] [cluster] tables "
                             "(default: none, the built-in example and the flags)")
    group = parser.add_argument_group("inputs (flags override the file)")
    for section, key, flag, parse, help_text in FIELDS:
        default = getattr(RECORDS[section](), key) if key != "hot_replicas" else "replicas"
        if isinstance(default, tuple):
            default = ",".join(f"{t}:{w:g}" for t, w in default)
        elif parse is _size:
            default = format_size(default)
        group.add_argument(flag, dest=_dest(flag), default=None, metavar="V",
                           help=f"{help_text} (default {default})")
    parser.add_argument("--compare-chunk", type=int, default=None, metavar="TOKENS",
                        help="the chunk size to compare with (default: a quarter of --chunk)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--measure", type=int, nargs="?", const=200_000, default=None, metavar="N",
                        help="measure per-object memory on a running master and storage nodes "
                             "with N objects (default 200000) and plan with the figures")


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:     # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise InputError("reading a TOML file needs Python 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{path}: {err}") from None


def inputs(args: argparse.Namespace) -> dict[str, dict]:
    """The records' keyword arguments: defaults < TOML file < flags."""
    values: dict[str, dict] = {section: {} for section in RECORDS}
    fields = {(s, k): (flag, parse) for s, k, flag, parse, _ in FIELDS}
    if args.config is not None:
        doc = _read_toml(args.config)
        for section, table in doc.items():
            if section not in RECORDS or not isinstance(table, dict):
                raise InputError(f"{args.config}: unknown table [{section}] "
                                 f"(known: {', '.join(f'[{s}]' for s in RECORDS)})")
            for key, raw in table.items():
                if (section, key) not in fields:
                    known = ", ".join(k for s, k, *_ in FIELDS if s == section)
                    raise InputError(f"{args.config}: unknown key {key!r} in [{section}] (known: {known})")
                values[section][key] = _parse(fields[(section, key)][1], raw, f"[{section}] {key}")
    for section, key, flag, parse, _ in FIELDS:
        raw = getattr(args, _dest(flag), None)
        if raw is not None:
            values[section][key] = _parse(parse, raw, flag)
    return values


def _parse(parse: Callable[[Any], Any], raw: Any, where: str) -> Any:
    try:
        return parse(raw)
    except (ValueError, TypeError):
        raise InputError(f"{where}: cannot use {raw!r}") from None


def build(values: dict[str, dict]) -> P.Plan:
    records = {section: RECORDS[section](**kwargs) for section, kwargs in values.items()}
    return P.plan(records["model"], records["workload"], records["store"], records["cluster"])


def main(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    try:
        values = inputs(args)
        if args.measure is not None:
            from kvproto.ops.measure import measure_metadata
            if args.measure <= 0:
                raise InputError("--measure needs a positive number of objects")
            m = measure_metadata(args.measure)
            print(f"measured {m['date']} with `{m['command']}`: master {m['master_bytes_per_object']:.0f} "
                  f"bytes per object, storage node {m['node_bytes_per_replica']:.0f} bytes per replica "
                  f"({m['objects']:,} objects, {m['replicas']} replicas, {m['key_bytes']}-byte keys; "
                  f"{m['put_objects_s']:,.0f} puts/s meanwhile)\n", file=out)
            values["store"].setdefault("metadata_bytes", m["master_bytes_per_object"])
            values["store"].setdefault("index_bytes", m["node_bytes_per_replica"])
        p = build(values)
        compare = args.compare_chunk if args.compare_chunk is not None else max(1, p.store.chunk_tokens // 4)
        other = P.with_chunk(p, compare)
    except (InputError, errors.KvError) as err:
        print(f"kvproto plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_jsonable(p), indent=2, default=str), file=out)
    else:
        print(render(p, other), file=out)
    return 0


def _jsonable(p: P.Plan) -> dict:
    d = dataclasses.asdict(p)
    d["reuse"] = p.reuse
    d["capacity"]["fits"] = p.capacity.fits

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return clean(d)


# --------------------------------------------------------------------------- text


def b(n: float) -> str:
    """Bytes, binary units."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{n:.0f} B"


def rate(n: float) -> str:
    """Bytes per second, decimal units (as NICs are sold)."""
    for unit, mult in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if abs(n) >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{n:.0f} B/s"


def count(n: float) -> str:
    return f"{n:,.0f}"


def pct(x: float) -> str:
    if 0 < x < 0.001:
        return f"{100 * x:.2g}%"
    return f"{100 * x:.1f}%" if x < 10 else f"{100 * x:,.0f}%"


def secs(s: float) -> str:
    if math.isinf(s):
        return "never (saturated)"
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:,.0f} s"


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def render(p: P.Plan, other: P.Plan) -> str:
    m, w, s, c = p.model, p.workload, p.store, p.cluster
    t, cap, o, tr, f = p.tokens, p.capacity, p.objects, p.traffic, p.failure
    bw = c.nic_bytes_s
    lengths = ", ".join(f"{n:,} ({pct(q)})" for n, q in w.weighted())
    hot = f" ({s.hot} for hot objects)" if s.hot != s.replicas else ""
    lines = [
        f"model     {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} dim x "
        f"{P.canonical_dtype(m.dtype)} = {b(p.bytes_per_token)} per token (K and V)",
        f"store     chunk {s.chunk_tokens} tokens = {b(cap.object_bytes)} per object, "
        f"{s.replicas} replicas{hot}, eviction past {pct(s.high_watermark)}",
        f"cluster   {c.hosts} hosts in {c.failure_domains} failure domains, each {b(c.memory_per_host)} "
        f"and a {c.nic_gbps:g} Gb/s NIC ({rate(bw)})",
        f"workload  {w.request_rate:g} prompts/s of {lengths} tokens",
        f"          {pct(w.sharing)} of a prompt is a shared prefix; of {w.prefixes:,} prefixes the hot "
        f"{pct(w.hot_fraction)} take {pct(w.hot_share)} of reads;",
        f"          chunks must stay {w.retention_s:g} s to be reused",
        "",
        f"PER PROMPT  {count(t.prompt)} tokens on average: {count(t.shared)} shared, "
        f"{count(t.reused)} reused (loaded, not recomputed),",
        f"  {count(t.written)} written as new chunks; reuse {pct(p.reuse)} of prompt tokens. Partial "
        f"chunks waste {count(t.shared_waste)}",
        f"  shared tokens (recomputed though stored) and {count(t.tail_waste)} tail tokens "
        f"(never stored)",
        "",
        f"CAPACITY{'per host':>50}{'cluster':>12}",
        _row(f"working set: {w.retention_s:g} s of new chunks, one copy", cap.working_set / c.hosts,
             cap.working_set, b),
        _row(f"stored: x {s.replicas} replicas" + (f", hot x {s.hot}" if hot else "") + ", whole pages",
             cap.per_host, cap.stored, b),
        _row(f"usable: {b(c.segment_per_host)} segment x {s.high_watermark:g}", cap.usable_per_host,
             cap.usable_per_host * c.hosts, b) + f"  fits: {yes(cap.per_host <= cap.usable_per_host)}",
        _row(f"host memory ({b(c.memory_per_host)}): segment", c.segment_per_host, None, b),
        _row(f"  + engine L1, {b(c.l1_per_host)}" + (" inside the segment" if c.l1_in_segment else ""),
             cap.l1_per_host, None, b),
        _row("  + staging buffers", cap.staging_per_host, None, b),
        _row(f"  + in flight: {s.inflight_s:g} s of {rate((tr.reads + tr.writes_payload) / c.hosts)}",
             cap.inflight_per_host, None, b),
        _row(f"  + storage node index, {s.index_bytes:.0f} B per replica", cap.index_per_host, None, b),
        _row("  = committed, each address counted once", cap.host_committed, None, b)
        + f"  fits: {yes(cap.host_committed <= c.memory_per_host)}",
        _row("    (configured sizes added up instead)", cap.host_naive, None, b),
        _row(f"master directory, {s.metadata_bytes:.0f} B per object", None, cap.master_metadata, b)
        + "  (the master's machine)",
        "",
        "OBJECTS",
        f"  held {count(o.stored)} objects, {count(o.replicas_stored)} replicas; "
        f"{count(o.written_s)} written/s, {count(o.read_s)} read/s",
        f"  master: {count(o.master_items_s)} items/s ({count(o.looked_up_s)} keys looked up) in "
        f"{count(o.master_requests_s)} requests/s",
        f"  wire: {s.read_wire_bytes:.0f} B per object read, {s.write_wire_bytes:.0f} B per replica written "
        f"= {rate(o.wire_overhead_s)}, {pct(o.wire_overhead_share)} of payload",
        f"  page slack (allocated, not payload): {b(o.page_slack)}",
        "",
        f"TRAFFIC (per host: each NIC direction){'per host':>20}{'cluster':>12}",
        _row("reads of reused prefixes", tr.reads / c.hosts, tr.reads, rate),
        _row("  from another host (no replica on the reader's)", tr.reads_network / c.hosts,
             tr.reads_network, rate),
        _row("writes of new chunks, one copy", tr.writes_payload / c.hosts, tr.writes_payload, rate),
        _row(f"  x {s.replicas} replicas, each sent by the writer", tr.writes_replicas / c.hosts,
             tr.writes_replicas, rate),
        _row("  to another host", tr.writes_network / c.hosts, tr.writes_network, rate),
        _row("NIC of the average host", tr.per_host, None, rate) + f"  {pct(tr.utilisation)} busy",
        _row("NIC of the host busiest with the hot set", tr.per_host_peak, None, rate)
        + f"  {pct(tr.utilisation_peak)} busy",
        f"  loading a prompt's reused {b(t.reused * p.bytes_per_token)}: {secs(tr.load_s)} through the "
        f"average host, {secs(tr.load_s_peak)} through",
        f"  the busiest; budget {secs(c.slo_load_s)}: "
        + ("met" if tr.load_s_peak <= c.slo_load_s else
           "met on average, MISSED on the busiest" if tr.load_s <= c.slo_load_s else "MISSED"),
        "",
        f"FAILURE: the largest domain lost ({f.lost_hosts} of {c.hosts} hosts)",
        f"  objects with every replica in it: {pct(f.lost_outright)}, {b(f.bytes_lost_outright)}, "
        f"recomputed (placement ignores domains)",
        f"  repair: {b(f.repair_bytes)} of lost replicas copied from survivors in {secs(f.repair_s)} "
        f"at {pct(c.repair_share)} of their NICs",
        f"  each of {f.survivors} survivors' NICs: {rate(f.per_survivor)} ({pct(f.per_survivor / bw)}) "
        f"steady, {pct(f.utilisation_during_repair)} while repairing",
        f"  survivors' usable segments {b(f.capacity_after)}: every replica fits: "
        f"{yes(f.holds_all_replicas)}; one copy fits: {yes(f.holds_one_copy)}",
        "",
        *chunk_question(p, other),
        "",
        *hot_question(p),
    ]
    if p.notes:
        lines += ["", *(f"note: {n}" for n in p.notes)]
    return "\n".join(lines)


def _row(label: str, host: Optional[float], cluster: Optional[float], fmt) -> str:
    return (f"  {label:<48}{fmt(host) if host is not None else '':>10}"
            f"{fmt(cluster) if cluster is not None else '':>12}").rstrip()


def _ratio(tr: P.Traffic) -> float:
    return tr.per_host_peak / tr.per_host if tr.per_host else 1.0


def chunk_question(a: P.Plan, z: P.Plan) -> list[str]:
    """Chunk size ``a`` -> ``z``: each ledger line, and whether it improved."""
    rows = [
        ("reuse (share of prompt tokens loaded)", a.reuse, z.reuse, pct, +1),
        ("partial-chunk waste, tokens per prompt", a.tokens.shared_waste + a.tokens.tail_waste,
         z.tokens.shared_waste + z.tokens.tail_waste, count, -1),
        ("objects held", a.objects.stored, z.objects.stored, count, -1),
        ("master directory memory", a.objects.master_metadata, z.objects.master_metadata, b, -1),
        ("storage node index per host", a.capacity.index_per_host, z.capacity.index_per_host, b, -1),
        ("master items per second", a.objects.master_items_s, z.objects.master_items_s, count, -1),
        ("per-object bytes on the wire", a.objects.wire_overhead_s, z.objects.wire_overhead_s, rate, -1),
        ("new bytes written per second", a.traffic.writes_payload, z.traffic.writes_payload, rate, -1),
        ("busiest host / average host", _ratio(a.traffic), _ratio(z.traffic), lambda x: f"{x:.2f}", -1),
    ]
    out = [f"Q: chunk {a.store.chunk_tokens} -> {z.store.chunk_tokens} tokens: which ledgers improve, "
           "which worsen?",
           f"  {'':<38}{a.store.chunk_tokens:>12}{z.store.chunk_tokens:>12}"]
    for label, x, y, fmt, better in rows:
        verdict = "same" if math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) else \
            ("better" if (y - x) * better > 0 else "worse")
        factor = f" x{y / x:.2f}" if x and verdict != "same" and fmt is not pct and better < 0 \
            and not label.startswith("busiest") else ""
        out.append(f"  {label:<38}{fmt(x):>12}{fmt(y):>12}  {verdict}{factor}")
    return out


def hot_question(p: P.Plan) -> list[str]:
    """Why mean bandwidth suffices and the SLO can still fail; what more
    replicas of the hot objects do."""
    w, tr, c = p.workload, p.traffic, p.cluster
    counts = sorted({p.store.hot, 2 * p.store.hot, 4 * p.store.hot, c.hosts})
    out = [
        f"Q: the hot {pct(w.hot_fraction)} of prefixes take {pct(w.hot_share)} of reads: why can the "
        "SLO fail when mean",
        "   bandwidth suffices?",
        f"  The average NIC is {pct(tr.utilisation)} busy. The hot prefixes' {count(tr.hot_objects)} "
        f"objects have only {count(tr.hot_units)} replicas",
        f"  among {c.hosts} hosts, so the host holding most of them carries {_ratio(tr):.2f}x the "
        f"average: {pct(tr.utilisation_peak)} busy.",
        f"  Delay grows as 1/(1 - busy): a prompt loads in {secs(tr.load_s)} through the average host, "
        f"{secs(tr.load_s_peak)}",
        f"  through the busiest (budget {secs(c.slo_load_s)}); the prompts that wait there are the "
        f"hot ones, {pct(w.hot_share)} of reads.",
        "  More replicas of the hot objects spread their reads and put copies on readers' own hosts:",
        f"  {'hot replicas':>12}{'avg busy':>10}{'busiest':>10}{'ratio':>7}{'load avg':>10}"
        f"{'busiest':>10}{'extra bytes':>13}",
    ]
    for q in P.hot_replica_options(p, counts):
        qt = q.traffic
        out.append(f"  {q.store.hot:>12}{pct(qt.utilisation):>10}{pct(qt.utilisation_peak):>10}"
                   f"{_ratio(qt):>7.2f}{secs(qt.load_s):>10}{secs(qt.load_s_peak):>10}"
                   f"{b(q.capacity.hot_extra):>13}")
    return out
