"""The ``kvproto`` command line.

``kvproto check`` model-checks every ``spec/*.cfg`` with TLC and compares each
verdict with the expectation in the cfg's header (see :mod:`kvproto.checking.tlc`);
``kvproto demo`` runs an embedded cluster; ``kvproto master`` and
``kvproto storage`` serve the runtime as separate processes (with
``--metrics-port``, Prometheus metrics too); ``kvproto bench`` measures it;
``kvproto stats`` prints a running cluster's figures; ``kvproto plan`` plans
capacity, objects and traffic per machine (:mod:`kvproto.ops`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kvproto import errors
from kvproto.checking import tlc
from kvproto.checking.tla import TraceStep, describe_changes, format_state


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvproto`` and ``python -m kvproto``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvproto", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(handler=handler)
    args = parser.parse_args(argv)
    return args.handler(args)


# --- check ----------------------------------------------------------------------


def default_spec_dir() -> Path:
    """``./spec`` if it exists, else the ``spec/`` beside the installed package."""
    here = Path.cwd() / "spec"
    return here if here.is_dir() else Path(__file__).resolve().parent.parent / "spec"


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec-dir", type=Path, default=None,
                        help="folder of .tla/.cfg files (default: ./spec, else the package's spec/)")
    parser.add_argument("--model", action="append", default=[], metavar="SUBSTRING",
                        help="only models whose name contains SUBSTRING (repeatable)")
    parser.add_argument("--workers", type=int, default=1, help="TLC worker threads (default 1)")
    parser.add_argument("--show-traces", action="store_true",
                        help="print every counterexample, not only unexpected ones")


def check(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run TLC on each model; exit 0 only if every verdict matched its expectation."""
    out = out or sys.stdout
    spec_dir = args.spec_dir or default_spec_dir()
    try:
        models = [m for m in tlc.discover(spec_dir)
                  if not args.model or any(s in m.name for s in args.model)]
    except ValueError as e:
        print(f"kvproto check: {e}", file=sys.stderr)
        return 2
    if not models:
        print(f"kvproto check: no models in {spec_dir}"
              + (f" matching {', '.join(args.model)}" if args.model else ""), file=sys.stderr)
        return 2

    results = []
    for model in models:
        print(f"checking {model.name} (expect {model.expectation}) ...", file=out, flush=True)
        progress = _ProgressDisplay(model.name, out)
        try:
            result = tlc.run(model, workers=args.workers, on_output=progress.line, on_tick=progress.tick)
        except FileNotFoundError as e:
            progress.clear()
            print(f"kvproto check: {e}", file=sys.stderr)
            return 2
        progress.clear()
        results.append(result)
        print(_result_line(result), file=out)
        if result.verdict == "error" and not result.matches:
            print(_indent(_error_excerpt(result.output), "    "), file=out)
        elif result.trace and (args.show_traces or not result.matches):
            print("    counterexample:", file=out)
            print(_indent(format_trace(result.trace), "      "), file=out)
    print(file=out)
    print(_summary(results), file=out)
    return 0 if all(r.matches for r in results) else 1


class _ProgressDisplay:
    """Shows a model's progress: one rewritten line on a TTY, else occasional lines."""

    HEARTBEAT_S = 10.0

    def __init__(self, name: str, out: TextIO) -> None:
        self.name = name
        self.out = out
        self.tty = out.isatty()
        self.last: tlc.Progress | None = None
        self.last_print = 0.0
        self.dirty = False

    def line(self, text: str) -> None:
        progress = tlc.parse_progress(text)
        if progress is None:
            return
        self.last = progress
        if not self.tty:
            print(f"  {self.name}: {text}", file=self.out, flush=True)

    def tick(self, elapsed: float) -> None:
        status = f"  {self.name}: {elapsed:.0f}s"
        if self.last is not None:
            status += (f", {self.last.distinct_states:,} distinct states, "
                       f"{self.last.queued:,} queued, depth {self.last.depth}")
        if self.tty:
            self.out.write("\r\x1b[K" + status)
            self.out.flush()
            self.dirty = True
        elif elapsed - self.last_print >= self.HEARTBEAT_S:
            print(status + " (running)", file=self.out, flush=True)
            self.last_print = elapsed

    def clear(self) -> None:
        if self.dirty:
            self.out.write("\r\x1b[K")
            self.out.flush()


def _result_line(result: tlc.TlcResult) -> str:
    states = "?" if result.distinct_states is None else f"{result.distinct_states:,}"
    depth = "?" if result.depth is None else str(result.depth)
    verdict = "as expected" if result.matches else f"UNEXPECTED (expected {result.model.expectation})"
    return (f"  {result.model.name}: {states} distinct states, depth {depth}, "
            f"{result.seconds:.1f}s: {result.outcome} - {verdict}")


def format_trace(steps: list[TraceStep]) -> str:
    """A counterexample as numbered steps, each showing only what it changed."""
    lines = []
    for prev, step in zip([None, *steps], steps):
        if step.back_to is not None:
            lines.append(f"{step.index}. {step.action}, back to state {step.back_to}")
        elif step.action == "Stuttering":
            lines.append(f"{step.index}. Stuttering (nothing changes from here on)")
            continue
        else:
            lines.append(f"{step.index}. {step.action}")
        if prev is None:
            lines.append(format_state(step.state, indent="     "))
        else:
            changes = describe_changes(prev.state, step.state)
            lines += [f"     {c}" for c in changes] or ["     (no variable changes)"]
    return "\n".join(lines)


def _error_excerpt(output: str, max_lines: int = 30) -> str:
    """TLC's output from its first ``Error:`` line (or its tail, if there is none)."""
    lines = output.rstrip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Error:")), None)
    return "\n".join(lines[first:first + max_lines] if first is not None else lines[-max_lines:])


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _summary(results: list[tlc.TlcResult]) -> str:
    header = ("model", "expected", "got", "distinct states", "depth", "seconds", "result")
    rows = [header] + [
        (
            r.model.name,
            r.model.expectation,
            r.outcome,
            "?" if r.distinct_states is None else f"{r.distinct_states:,}",
            "?" if r.depth is None else str(r.depth),
            f"{r.seconds:.1f}",
            "ok" if r.matches else "UNEXPECTED",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {3, 4, 5}
    lines = [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    matched = sum(r.matches for r in results)
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"{matched} of {len(results)} models as expected")
    return "\n".join(lines)


# --- runtime ---------------------------------------------------------------------


def _master_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="tcp://127.0.0.1:5555", help="endpoint to bind")
    parser.add_argument("--advertise", default=None,
                        help="endpoint others reach this master at (default: the bound one)")
    parser.add_argument("--writer-timeout", type=float, default=10.0,
                        help="seconds without heartbeats before a writer's allocations are reclaimed")
    parser.add_argument("--storage-timeout", type=float, default=10.0,
                        help="seconds without heartbeats before a storage segment counts as lost")
    parser.add_argument("--coordinator", default=None,
                        help="elect one master through a coordinator: file:///dir (one host) "
                             "or etcd://host:port[/prefix]")
    parser.add_argument("--standby", action="store_true",
                        help="with --coordinator: wait as a standby while another master is "
                             "active, and take over when it fails")
    parser.add_argument("--ttl", type=float, default=2.0,
                        help="leadership lease in seconds (with --coordinator)")
    parser.add_argument("--log-level", default=None,
                        help="logging level (default: INFO with --coordinator, which logs "
                             "elections, fences and recoveries; WARNING otherwise)")
    parser.add_argument("--fence-timeout", type=float, default=5.0,
                        help="seconds a new master waits for storage nodes' fence acks; "
                             "a node that does not answer is lost with its objects")
    _metrics_arguments(parser)


def _metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on this port (0: a free one; "
                             "default: none; see docs/metrics.md)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics port binds (default 127.0.0.1; 0.0.0.0 for all)")


def _metrics_mistake(command: str, args: argparse.Namespace) -> bool:
    """Print the one-line mistake in the metrics flags, if any."""
    if args.metrics_port is None:
        return False
    if not 0 <= args.metrics_port <= 65535:
        print(f"kvproto {command}: --metrics-port {args.metrics_port} is not a port (0-65535)",
              file=sys.stderr)
        return True
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        print(f"kvproto {command}: --metrics-port needs the prometheus_client package "
              "(pip install 'kvproto[metrics]')", file=sys.stderr)
        return True
    return False


def master(args: argparse.Namespace) -> int:
    from .runtime.embedded import run_master
    if _metrics_mistake("master", args):
        return 2
    coordinator = None
    if args.coordinator:
        from .runtime.coordinator import connect
        coordinator = connect(args.coordinator, ttl=args.ttl)
        leader = coordinator.leader()
        if leader is not None and not args.standby:
            print(f"kvproto master: term {leader[0]} is held by {leader[1]}; "
                  "start with --standby to wait for it", file=sys.stderr)
            return 1
    elif args.standby:
        print("kvproto master: --standby needs --coordinator", file=sys.stderr)
        return 2
    try:
        run_master(args.listen, writer_timeout=args.writer_timeout,
                   storage_timeout=args.storage_timeout, coordinator=coordinator,
                   advertise=args.advertise, fence_timeout=args.fence_timeout,
                   log_level=args.log_level or ("INFO" if coordinator is not None else "WARNING"),
                   metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    except errors.InvalidArgument as err:   # the metrics port cannot be served
        print(f"kvproto master: {err}", file=sys.stderr)
        return 2
    return 0


def _storage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", required=True,
                        help="the master's endpoint, or the coordinator the masters use "
                             "(file:///dir, etcd://host:port[/prefix]) to follow failovers")
    parser.add_argument("--size", required=True, help="segment size, e.g. 1GiB")
    parser.add_argument("--listen", default="tcp://127.0.0.1:*", help="data endpoint to bind")
    parser.add_argument("--advertise", default=None,
                        help="endpoint clients connect to (default: the bound one)")
    parser.add_argument("--page-size", type=int, default=4096,
                        help="allocation granularity in bytes (a power of two >= 512)")
    _metrics_arguments(parser)


def storage(args: argparse.Namespace) -> int:
    from .runtime.embedded import run_storage
    if _metrics_mistake("storage", args):
        return 2
    try:
        run_storage(args.master, args.size, listen=args.listen, advertise=args.advertise,
                    page_size=args.page_size, metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host)
    except errors.InvalidArgument as err:   # the metrics port cannot be served
        print(f"kvproto storage: {err}", file=sys.stderr)
        return 2
    return 0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--killed", type=int, default=2, help="writers killed mid-put")
    parser.add_argument("--objects", type=int, default=8, help="8 MiB objects per writer")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--segment-size", default="384MiB")


def demo(args: argparse.Namespace) -> int:
    from . import demo as demo_module
    return demo_module.main(writers=args.writers, killed=args.killed, objects=args.objects,
                            replicas=args.replicas, segment_size=args.segment_size)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from . import bench as bench_module
    bench_module.add_arguments(parser)


def bench(args: argparse.Namespace) -> int:
    from . import bench as bench_module
    return bench_module.main(args)


def _stats_arguments(parser: argparse.ArgumentParser) -> None:
    from .ops import stats as stats_module
    stats_module.add_arguments(parser)


def stats(args: argparse.Namespace) -> int:
    from .ops import stats as stats_module
    return stats_module.main(args)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from .ops import plancli
    plancli.add_arguments(parser)


def plan(args: argparse.Namespace) -> int:
    from .ops import plancli
    return plancli.main(args)


# --- subcommands ----------------------------------------------------------------

# name -> (help, add_arguments(parser), handler(args) -> exit code).
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    "check": ("model-check the TLA+ specs with TLC and compare each verdict with its expectation",
              _check_arguments, check),
    "demo": ("run an embedded cluster with writers killed mid-put and readers checking every byte",
             _demo_arguments, demo),
    "master": ("serve a master (the directory; never carries payload)", _master_arguments, master),
    "storage": ("serve one storage segment for a master", _storage_arguments, storage),
    "bench": ("measure put/get throughput against raw pyzmq and memcpy, and metadata rates",
              _bench_arguments, bench),
    "plan": ("plan capacity, objects and traffic per machine for a model, workload and cluster",
             _plan_arguments, plan),
    "stats": ("print a running cluster's figures (the metrics' names), once or every few seconds",
              _stats_arguments, stats),
}
