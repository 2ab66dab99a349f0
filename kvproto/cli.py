"""The ``kvproto`` command line.

``kvproto check`` model-checks every ``spec/*.cfg`` with TLC and compares each
verdict with the expectation in the cfg's header (see :mod:`kvproto.checking.tlc`);
``kvproto demo`` runs an embedded cluster; ``kvproto master`` and
``kvproto storage`` serve the runtime as separate processes; ``kvproto bench``
measures it (with ``--metrics-port``, Prometheus metrics too); ``kvproto stats``
prints a running cluster's figures; ``kvproto plan`` plans capacity, objects
and traffic per machine (:mod:`kvproto.ops`); ``kvproto tenant`` makes a
tenant's token or checks a tenants file, ``kvproto ns`` steps a tenant's namespaces
through their upgrade lifecycle; ``kvproto chaos`` runs the fault
matrix, ``kvproto fuzz`` fuzzes frames, ``kvproto mutate`` runs the
runtime mutants, ``kvproto trace check`` has TLC check a master's recorded
run and ``kvproto trace merge`` a master's run merged with its storage nodes'
(:mod:`kvproto.checking`);
``kvproto --version`` prints the installed package's version.

A mistake in the arguments, or a problem found while a server starts (an
address it cannot listen on, a port in use, a segment larger than the free
shared memory, a coordinator URL it cannot use, a master that refuses the
storage node's registration for good), prints one line to stderr naming the
problem and exits with status 2, without a traceback. Every option's help
shows its default.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvproto import errors
from kvproto.checking import tlc
from kvproto.checking.tla import TraceStep, describe_changes, format_state

DESCRIPTION = "Model-checked protocols and a ZeroMQ runtime for a shared KV-cache store."


class _Parser(argparse.ArgumentParser):
    """Reports a usage mistake in one line (and exit status 2), not the usage text."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps each paragraph of a description on its own; appends
    ``(default: ...)`` to an option's help unless it states one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(_HelpFormatter, self)._fill_text(p, width, indent)
                           for p in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default in (None, argparse.SUPPRESS)):
            return text
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def version() -> str:
    """The installed kvproto package's version."""
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed("kvproto")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvproto`` parser, with one sub-parser per command."""
    parser = _Parser(prog="kvproto", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvproto {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text,
                                 formatter_class=_HelpFormatter)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvproto`` and ``python -m kvproto``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


def _fail(command: str, message: object) -> int:
    """One line on stderr naming the problem; exit status 2."""
    text = " ".join(str(message).split()) or type(message).__name__
    print(f"kvproto {command}: {text}", file=sys.stderr)
    return 2


# --- argument types: a bad value is one line, exit status 2 ---------------------


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from ``parse``, which raises ValueError or a KvError."""
    from kvproto.errors import KvError

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, KvError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__.strip("_")
    return convert


def _number(text: str, kind: type = float, low: float = 0, low_ok: bool = False) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or value < low or (value == low and not low_ok):
        raise ValueError(f"{text!r} must be {'at least' if low_ok else 'more than'} {low}")
    return value


@_checked
def _seconds(text: str) -> float:
    return _number(text)


@_checked
def _count(text: str) -> int:
    return _number(text, int, 1, low_ok=True)


@_checked
def _count0(text: str) -> int:
    return _number(text, int, 0, low_ok=True)


@_checked
def _size(text: str) -> int:
    from kvproto.runtime.units import parse_size
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return size


@_checked
def _page_size(text: str) -> int:
    size = _number(text, int, 512, low_ok=True)
    if size & (size - 1):
        raise ValueError(f"{text!r} is not a power of two")
    return size


@_checked
def _listen(text: str) -> str:
    from kvproto.runtime.endpoints import check_listen
    return check_listen(text)


@_checked
def _master_address(text: str) -> str:
    from kvproto.runtime.endpoints import check_master
    return check_master(text)


@_checked
def _advertise(text: str) -> str:
    from kvproto.errors import InvalidArgument
    from kvproto.runtime.endpoints import check_master, coordinator_url
    if coordinator_url(check_master(text)):
        raise InvalidArgument(f"{text!r} is not an endpoint to advertise: use tcp://host:port or ipc://path")
    return text


@_checked
def _coordinator(text: str) -> str:
    from kvproto.runtime.coordinator import connect
    connect(text, create=False).close()     # the form only; nothing is contacted
    return text


def _start_failure(e: BaseException, listen: str) -> str:
    """A server's start-up error in words (a ZeroMQ error here comes from binding)."""
    import zmq
    if isinstance(e, zmq.ZMQError):
        return f"cannot listen on {listen}: {re.sub(r' [(]addr=.*', '', e.strerror)}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


# --- check ----------------------------------------------------------------------


def default_spec_dir() -> Path:
    """``./spec`` if it exists, else the ``spec/`` beside the installed package."""
    here = Path.cwd() / "spec"
    return here if here.is_dir() else Path(__file__).resolve().parent.parent / "spec"


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec-dir", type=Path, default=None,
                        help="folder of .tla/.cfg files (default: ./spec, else the package's spec/)")
    parser.add_argument("--model", action="append", default=[], metavar="SUBSTRING",
                        help="only models whose name contains SUBSTRING (repeatable; default: all)")
    parser.add_argument("--workers", type=_count, default=1, help="TLC worker threads")
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
    parser.description = (
        "Serve a master: the directory of objects and the allocator of the storage nodes' "
        "space; it never carries payload. It prints 'kvproto master listening on ENDPOINT' "
        "once it serves.\n\n"
        "With --coordinator, masters are elected: one is active, the others wait as "
        "standbys (each logs which master holds the term it waits for) and take over "
        "when the active one dies or hangs.")
    parser.add_argument("--listen", type=_listen, default="tcp://127.0.0.1:5555",
                        help="endpoint to bind: tcp://host:port (port * picks a free one) or ipc://path")
    parser.add_argument("--advertise", type=_advertise, default=None,
                        help="endpoint others reach this master at (default: the bound one)")
    parser.add_argument("--writer-timeout", type=_seconds, default=10.0,
                        help="seconds without heartbeats before a writer's allocations are reclaimed")
    parser.add_argument("--storage-timeout", type=_seconds, default=10.0,
                        help="seconds without heartbeats before a storage segment counts as lost")
    parser.add_argument("--coordinator", type=_coordinator, default=None,
                        help="elect one master through a coordinator: file:///dir (one host) "
                             "or etcd://host:port[/prefix] (default: none, a single master)")
    parser.add_argument("--standby", action="store_true",
                        help="with --coordinator: wait as a standby while another master is "
                             "active, and take over when it fails")
    parser.add_argument("--ttl", type=_seconds, default=2.0,
                        help="leadership lease in seconds (with --coordinator)")
    parser.add_argument("--log-level", default=None, type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="logging level (default: INFO with --coordinator, which logs "
                             "elections, fences and recoveries; WARNING otherwise)")
    parser.add_argument("--fence-timeout", type=_seconds, default=5.0,
                        help="seconds a new master waits for storage nodes' fence acks; "
                             "a node that does not answer is lost with its objects")
    parser.add_argument("--repair-rate", type=_size, default=256 << 20, metavar="BYTES",
                        help="repair copies read at most this many bytes a second from each "
                             "source node, leaving the rest to foreground reads (default: 256MiB)")
    parser.add_argument("--max-repairs", type=_count, default=4,
                        help="repair copies in flight at once (default: 4)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="append every step of the master's publish machine to FILE as JSON "
                             "lines, for 'kvproto trace check FILE' (default: off; also "
                             "KVPROTO_TRACE=FILE)")
    _tenants_argument(parser)
    _metrics_arguments(parser)


def _tenants_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="a tenants file (TOML, see 'kvproto tenant check'): every request "
                             "must carry a tenant's token (default: none, one shared key space)")
    parser.add_argument("--ticket-key", default=None, metavar="FILE",
                        help="with --tenants (required): the file holding the key of the read "
                             "tickets, the same for the master and every storage node "
                             "('kvproto tenant key' makes one)")


def _tenants(command: str, args: argparse.Namespace):
    """``{"tenants": ..., "ticket_key": ...}`` of ``--tenants`` and
    ``--ticket-key`` (empty without them), or ``None`` after printing the
    one-line mistake."""
    if args.tenants is None:
        if args.ticket_key is not None:
            print(f"kvproto {command}: --ticket-key goes with --tenants", file=sys.stderr)
            return None
        return {}
    if args.ticket_key is None:
        print(f"kvproto {command}: --tenants needs --ticket-key FILE, the key of the read "
              "tickets shared by the master and its storage nodes ('kvproto tenant key')",
              file=sys.stderr)
        return None
    from .errors import KvError
    from .ops.tenants import load_ticket_key, load_tenants
    try:
        return {"tenants": load_tenants(args.tenants),
                "ticket_key": load_ticket_key(args.ticket_key)}
    except KvError as err:
        print(f"kvproto {command}: {err}", file=sys.stderr)
        return None


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


def _server_gc() -> None:
    """A server process's collector: what it imported moves out of the
    collector's way (``gc.freeze``) and the youngest generation collects every
    50,000 allocations instead of 700, so the full collections, whose cost
    grows with the objects a server holds, run rarely (a batch put allocates
    thousands of short-lived objects a message)."""
    import gc
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def master(args: argparse.Namespace) -> int:
    import zmq
    from .errors import KvError
    from .runtime.embedded import run_master
    if _metrics_mistake("master", args):
        return 2
    tenants = _tenants("master", args)
    if tenants is None:
        return 2
    coordinator = None
    try:
        if args.coordinator:
            from .runtime.coordinator import connect
            coordinator = connect(args.coordinator, ttl=args.ttl)
            leader = coordinator.leader()
            if leader is not None and not args.standby:
                coordinator.close()
                return _fail("master", f"term {leader[0]} is held by {leader[1]}; "
                                       "start with --standby to wait for it")
        elif args.standby:
            return _fail("master", "--standby needs --coordinator")
        _server_gc()
        run_master(args.listen, writer_timeout=args.writer_timeout,
                   storage_timeout=args.storage_timeout, coordinator=coordinator,
                   advertise=args.advertise, fence_timeout=args.fence_timeout,
                   log_level=args.log_level or ("INFO" if coordinator is not None else "WARNING"),
                   metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                   trace=args.trace, repair_rate=args.repair_rate,
                   max_repairs=args.max_repairs, **tenants)
    except (KvError, OSError, zmq.ZMQError) as e:
        if coordinator is not None:
            coordinator.close()
        return _fail("master", _start_failure(e, args.listen))
    return 0


def _storage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve one storage segment (POSIX shared memory) for a master. It prints "
        "'kvproto storage listening on ENDPOINT' once it serves, then, once registered "
        "with its master, one line 'kvproto storage ready: segment ID, SIZE at ENDPOINT, "
        "master ADDRESS (term N)'; puts sent before that get NoStorage.")
    parser.add_argument("--master", type=_master_address, required=True,
                        help="the master's endpoint (tcp://host:port, ipc://path), or the "
                             "coordinator the masters use (file:///dir, etcd://host:port[/prefix]) "
                             "to follow failovers (required)")
    parser.add_argument("--size", type=_size, required=True,
                        help="segment size, e.g. 1GiB, 512MiB, 4G; it must fit in the free "
                             "space of /dev/shm (required)")
    parser.add_argument("--listen", type=_listen, default="tcp://127.0.0.1:*",
                        help="data endpoint to bind: tcp://host:port (port * picks a free one) "
                             "or ipc://path")
    parser.add_argument("--advertise", type=_advertise, default=None,
                        help="endpoint clients connect to (default: the bound one)")
    parser.add_argument("--page-size", type=_page_size, default=4096,
                        help="allocation granularity in bytes (a power of two >= 512)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="append every step of the node's region table and index to FILE "
                             "as JSON lines, for 'kvproto trace merge MASTER_FILE FILE' "
                             "(default: off; with KVPROTO_TRACE=MASTER_FILE, the node writes "
                             "MASTER_FILE.storage-<pid>-<n>)")
    _tenants_argument(parser)
    _metrics_arguments(parser)


def storage(args: argparse.Namespace) -> int:
    import zmq
    from .errors import KvError
    from .runtime.embedded import run_storage
    if _metrics_mistake("storage", args):
        return 2
    tenants = _tenants("storage", args)
    if tenants is None:
        return 2
    try:
        _server_gc()
        run_storage(args.master, args.size, listen=args.listen, advertise=args.advertise,
                    page_size=args.page_size, metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host, trace=args.trace, **tenants)
    except (KvError, OSError, zmq.ZMQError) as e:
        return _fail("storage", _start_failure(e, args.listen))
    return 0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from . import demo as demo_module
    parser.description = demo_module.__doc__.split("\n\n", 1)[1].replace("``", "")
    parser.add_argument("--writers", type=_count, default=4,
                        help="writer processes that put all their objects")
    parser.add_argument("--killed", type=_count0, default=2,
                        help="writer processes killed (SIGKILL) in the middle of their second put")
    parser.add_argument("--objects", type=_count, default=8,
                        help="8 MiB objects each surviving writer puts")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=2,
                        help="replicas of each object (there are 2 storage nodes)")
    parser.add_argument("--segment-size", type=_size, default="384MiB",
                        help="shared memory of each of the 2 storage nodes")
    parser.add_argument("--engine", action="store_true",
                        help="instead: a real model (tiny, random, from a config) reuses its prefix through "
                             "kvproto and hands it from prefill to decode; prints the prefix hit, the tokens "
                             "skipped, the time saved and the logits check (needs torch and transformers)")
    parser.add_argument("--model", choices=("llama", "qwen2"), default="llama",
                        help="with --engine: the model architecture")
    parser.add_argument("--prompt-tokens", type=_count, default=1025,
                        help="with --engine: tokens of the prompt")


def demo(args: argparse.Namespace) -> int:
    from . import demo as demo_module
    if args.engine:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            return _fail("demo", f"--engine needs torch and transformers (pip install 'kvproto[model]'): {e}")
        if args.prompt_tokens <= 4 * 128:
            return _fail("demo", f"--prompt-tokens {args.prompt_tokens}: the engine demo needs more than "
                                 "512 (4 chunks of 128 tokens)")
        return demo_module.engine(kind=args.model, prompt_tokens=args.prompt_tokens)
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


def _chaos_arguments(parser: argparse.ArgumentParser) -> None:
    from .checking.chaos import matrix
    matrix.add_arguments(parser)


def chaos(args: argparse.Namespace) -> int:
    from .checking.chaos import matrix
    return matrix.main(args)


def _fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    from .checking import fuzz as fuzz_module
    fuzz_module.add_arguments(parser)


def fuzz(args: argparse.Namespace) -> int:
    from .checking import fuzz as fuzz_module
    return fuzz_module.main(args)


def _mutate_arguments(parser: argparse.ArgumentParser) -> None:
    from .checking import mutants
    mutants.add_arguments(parser)


def mutate(args: argparse.Namespace) -> int:
    from .checking import mutants
    return mutants.main(args)


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    from .checking import failtrace, mergetrace, traces
    sub = traces.add_arguments(parser)
    mergetrace.add_arguments(sub)
    failtrace.add_arguments(sub)


def trace(args: argparse.Namespace) -> int:
    from .checking import failtrace, mergetrace, traces
    return {"merge": mergetrace, "failover": failtrace}.get(args.trace_command, traces).main(args)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from .ops import plancli
    plancli.add_arguments(parser)


def plan(args: argparse.Namespace) -> int:
    from .ops import plancli
    return plancli.main(args)


def _tenant_arguments(parser: argparse.ArgumentParser) -> None:
    from .ops import tenants
    tenants.add_arguments(parser)


def tenant(args: argparse.Namespace) -> int:
    from .ops import tenants
    return tenants.main(args)


def _ns_arguments(parser: argparse.ArgumentParser) -> None:
    from .ops import nscli
    nscli.add_arguments(parser)


def ns(args: argparse.Namespace) -> int:
    from .ops import nscli
    return nscli.main(args)


# --- subcommands ----------------------------------------------------------------

# name -> (help, add_arguments(parser), handler(args) -> exit code).
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    "check": ("model-check the TLA+ specs with TLC and compare each verdict with its expectation",
              _check_arguments, check),
    "demo": ("run an embedded cluster with writers killed mid-put and readers checking every "
             "byte, then a master failover",
             _demo_arguments, demo),
    "master": ("serve a master (the directory; never carries payload)", _master_arguments, master),
    "storage": ("serve one storage segment for a master", _storage_arguments, storage),
    "bench": ("measure put/get throughput against raw pyzmq and memcpy, and metadata rates",
              _bench_arguments, bench),
    "plan": ("plan capacity, objects and traffic per machine for a model, workload and cluster",
             _plan_arguments, plan),
    "stats": ("print a running cluster's figures (the metrics' names), once or every few seconds",
              _stats_arguments, stats),
    "tenant": ("make a tenant's secret token, or check a tenants file (quotas, namespaces, grants)",
               _tenant_arguments, tenant),
    "ns": ("a tenant's namespaces at a running master: list them, or create, prewarm, switch, "
           "route back or drop one (the upgrade lifecycle)", _ns_arguments, ns),
    "chaos": ("run the fault matrix: real processes, faults at chosen protocol phases, every "
              "read checked, nothing leaked", _chaos_arguments, chaos),
    "fuzz": ("fuzz the master's and storage nodes' frames: no crash, typed refusals, no state "
             "change", _fuzz_arguments, fuzz),
    "trace": ("check a master's recorded run (--trace FILE), or merged with its storage nodes' "
              "runs, with TLC: is every step a step of spec/Publish.tla?", _trace_arguments, trace),
    "mutate": ("apply named faults to the runtime one at a time and run the tests that must "
               "catch each; prints the score", _mutate_arguments, mutate),
}
