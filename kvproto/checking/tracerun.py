"""What the trace checkers share (:mod:`kvproto.checking.traces`,
:mod:`kvproto.checking.leasetrace`, :mod:`kvproto.checking.mergetrace`,
:mod:`kvproto.checking.failtrace`): reading a trace file, their errors and
verdicts, runtime names numbered as model values, and running TLC on a
generated trace module."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import attrs

from kvproto.checking import tlc
from kvproto.checking.tla import ModelValue, format_value


class TraceError(ValueError):
    """A trace file that cannot be checked (unreadable, or outside what the
    checker maps onto the spec's constants)."""


def json_lines(path: "str | Path") -> list[tuple[int, object]]:
    """The JSON values of a trace file's non-blank lines, each with its line
    number; an unreadable file or a line that is not JSON is a ``TraceError``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{number}: not a JSON line ({e.msg})") from None
    return out


def machine_lines(path: "str | Path", machine: str) -> list[tuple[int, dict]]:
    """The lines of ``path`` recorded by ``machine`` (``"storage"``, ...)."""
    return [(n, obj) for n, obj in json_lines(path)
            if isinstance(obj, dict) and obj.get("machine") == machine]


def accepted(step: dict) -> bool:
    """Whether a recorded step was accepted (a refusal is one ``Refused`` effect)."""
    effects = step["effects"]
    return not (effects and effects[0].get("type") == "Refused")


@attrs.frozen
class Verdict:
    """What TLC found for one machine's recorded run."""

    ok: bool
    steps: int                      # recorded steps in the run
    message: str
    failed_step: Optional[int] = None   # the recorded ``n`` of the first unmatched step
    line: Optional[int] = None          # its line in the file
    distinct_states: Optional[int] = None
    seconds: float = 0.0
    machine: str = "publish"
    windows: int = 1                    # TLC runs the run was checked in (kvproto.checking.windows)
    stopped: str = ""                   # why steps after ``steps`` were not checked


class Numbered:
    """Runtime names -> model values ``prefix1, prefix2, ...`` by first appearance."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.names: dict = {}

    def __call__(self, name) -> ModelValue:
        if name not in self.names:
            self.names[name] = ModelValue(f"{self.prefix}{len(self.names) + 1}")
        return self.names[name]

    def values(self) -> list[ModelValue]:
        return list(self.names.values())


def spec_dir(spec: str) -> Path:
    """The ``spec/`` directory beside the package, holding ``spec``.tla."""
    here = Path(__file__).resolve().parent.parent.parent / "spec"
    if not (here / f"{spec}.tla").is_file():
        raise TraceError(f"spec/{spec}.tla not found beside the package ({here})")
    return here


def run_module(spec: str, name: str, module: str, cfg: str, *, keep: Optional[Path] = None,
               on_output: Optional[Callable[[str], None]] = None,
               also: Optional[dict[str, str]] = None) -> tlc.TlcResult:
    """Write the trace module ``name`` (extending ``spec``, or a module of
    ``also``: module name -> text, written beside it) and its cfg beside a
    copy of ``spec/<spec>.tla`` (in ``keep``, else a temporary directory) and
    have TLC check it."""
    source = spec_dir(spec)
    with tempfile.TemporaryDirectory(prefix="kvproto-trace-") as tmp:
        where = Path(keep) if keep is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / f"{spec}.tla", where / f"{spec}.tla")
        for other, text in (also or {}).items():
            (where / f"{other}.tla").write_text(text)
        (where / f"{name}.tla").write_text(module)
        (where / f"{name}.cfg").write_text(cfg)
        return tlc.run(tlc.Model.from_cfg(where / f"{name}.cfg"), on_output=on_output)


def first_unmatched(result: tlc.TlcResult, spec: str) -> Optional[tuple[int, str]]:
    """Where TLC left a trace module whose ``pos`` counts the steps taken:
    the index of the recorded step it could not take (deadlock) or that led
    to a state the spec forbids (safety), and what went wrong; ``None`` for
    any other verdict."""
    if result.verdict not in ("deadlock", "safety") or not result.trace:
        return None
    pos = result.trace[-1].state["pos"]
    if result.verdict == "deadlock":
        return pos - 1, f"is not a step of spec/{spec}.tla from the state the steps before it reached"
    return pos - 2, f"leads to a state the spec forbids ({result.violated})"


def failure(result: tlc.TlcResult) -> TraceError:
    """The error for a TLC run that neither passed nor found the trace wanting."""
    lines = [l for l in result.output.splitlines() if l.strip()]
    return TraceError("TLC could not check the generated trace module: " + " | ".join(lines[-6:]))


def module_text(template: str, model, **more: str) -> str:
    """A trace module from ``template``: the model's values and its records as
    the constant sequence ``Trace``, and the texts ``more`` names."""
    trace = "<<\n    " + ",\n    ".join(format_value(r) for r in model.records) + "\n  >>" \
        if model.records else "<<>>"
    return template % {"values": ", ".join(v.name for v in model.model_values), "trace": trace,
                       **more}


def cfg_text(model, invariants, overrides: tuple[str, ...] = ()) -> str:
    """The cfg of a trace module: the model's constants and values, then
    ``overrides`` (``Name <- Def`` lines), with deadlock checking on."""
    lines = ["\\* expect: ok", "\\* deadlock: check", "CONSTANTS"]
    lines += [f"    {name} = {format_value(value)}" for name, value in model.constants.items()]
    lines += [f"    {v.name} = {v.name}" for v in model.model_values]
    lines += [f"    {o}" for o in overrides]
    lines += ["INIT TraceInit", "NEXT TraceNext", "INVARIANTS"] + [f"    {n}" for n in invariants]
    return "\n".join(lines) + "\n"


def outcome(effects: list) -> str:
    """A recorded step's effects in a few words: ``refused StaleToken``, or their types."""
    if effects and effects[0].get("type") == "Refused":
        return f"refused {effects[0]['error']['type']}"
    return ", ".join(e["type"] for e in effects) or "no effects"
