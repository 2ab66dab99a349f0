r"""A long recorded run checked whole, in windows chained state to state.

One TLC run walks at most a window of a run's steps (each checker maps a run
onto a bounded model, :data:`kvproto.checking.traces.LIMITS`, and TLC
re-evaluates the spec's invariants over all of it in every state). A longer
run is split into consecutive windows, each checked by its own TLC run; for
the publish machine (:func:`kvproto.checking.traces.check_windows`):

* window 1 starts where the run opened (``OpenedInit`` of its ``opened``
  line); window ``i + 1`` starts in the state window ``i`` ended in, built
  from the recorded steps (:func:`kvproto.checking.traces.boundary`) as an
  ``opened`` header (the
  directory each step's ``after`` left, the segments joined and lost, the
  next token, and the writers still busy with a pending put), which the
  trace module starts from as a takeover's run starts from the directory it
  recovered;
* window ``i`` must end in exactly that state: its module holds it as
  ``End`` and TLC checks the invariant ``WindowEnd`` (every state the
  window ends in is the next window's initial state, every variable of the
  spec; a writer left holding an attempt that no longer owns its key, which
  no later step can take, is not carried over). So the windows chain, and
  together they are a check of the whole run: a step the spec does not
  allow fails in its window, named by its recorded number;
* each window is renumbered on its own (its keys, segments, slots and
  tokens: those its start state holds first), so the model of a window is as
  small as its own steps, however long the run.

The lease table's windows (:func:`kvproto.checking.leasetrace.check_windows`)
chain the same way, and end only where the table is quiet (no read in
progress, so no lease held), where its state is the objects cached. The
merged master-and-nodes check (:func:`kvproto.checking.mergetrace.check_windows`)
ends its windows where no put or repair has anything written on a traced
node, and checks the nodes' tables and commands there (``NodesWindowEnd``).

The failover check (:func:`kvproto.checking.failtrace.check`) chains its
windows without this module's loop: its nodes record their own steps, not
the spec's state, so no boundary can be built from the recorded lines;
instead TLC prints every state a window ends in and the next window starts
in exactly those, and a window may end after any step.

A window is the longest run of steps from its start that fits the model's
limits, up to ``size`` steps (:func:`longest_fit`), cut back to the last
point where a window may end. Checking stops early, and the verdict says
where and why, when a window of even one step does not fit (a directory past
the limits), where no window may end, where the checker's world ends (a
lease ended by an operator's forced remove), or after ``max_windows``
windows (a cap for short CI runs).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from kvproto.checking.tla import ParseError, parse_value
from kvproto.checking.tracerun import TraceError, Verdict

#: steps per window unless told: one TLC run of a window takes seconds
SIZE = 1000


def longest_fit(n: int, fits: Callable[[int], None]) -> tuple[int, str]:
    """The largest ``k <= n`` for which ``fits(k)`` raises no :class:`TraceError`
    (fits is monotone: a prefix of a run that fits fits), and the error of
    ``k + 1`` ("" when ``k == n``)."""
    try:
        fits(n)
        return n, ""
    except TraceError as e:
        why = " ".join(str(e).split())
    lo, hi = 0, n - 1          # fits(lo) is taken to hold for lo == 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            fits(mid)
            lo = mid
        except TraceError as e:
            hi, why = mid - 1, " ".join(str(e).split())
    return lo, why


def check(header: dict, steps: list[tuple[int, dict]], *, spec: str,
          fits: Callable[[dict, list], object], run: Callable[..., Verdict],
          boundary: Callable[[dict, list], dict],
          cut: Optional[Callable[[dict, list], int]] = None, size: int = SIZE,
          max_windows: Optional[int] = None, keep: Optional[Path] = None,
          machine: str = "publish") -> Verdict:
    """Check a run (its ``header`` and ``steps``) against ``spec/<spec>.tla``
    window by window (see the module docstring): ``fits(start, part)`` raises
    :class:`TraceError` for a window past the model's limits, ``run(start,
    part, end=..., keep=...)`` is one window's TLC check (``end``: the state
    it must end in, None for the last), ``boundary(start, part)`` the state
    a window ends in; ``cut(start, part)`` (default: ``len(part)``) the
    most steps of ``part`` after which a window may end. The verdict's
    ``steps`` are the steps checked; a run
    checked only in part says where it stopped and why. ``keep``: each
    window's module and cfg in ``keep/window-N`` (in ``keep`` for a run of
    one window)."""
    if size < 1:
        raise TraceError("a window needs at least one step")
    if not steps:                   # a run of its opening alone: one TLC run checks it
        return run(header, steps, end=None, keep=keep)
    start, window, at = header, 0, 0
    states, seconds, stopped = 0, 0.0, ""
    while at < len(steps):
        if max_windows is not None and window == max_windows:
            stopped = f"at most {max_windows} window(s) of {size} steps are checked"
            break
        k, why = longest_fit(min(size, len(steps) - at),
                             lambda k, h=start, a=at: fits(h, steps[a:a + k]))
        if k == 0:
            if window == 0:     # not one step fits: the run cannot be checked, as before
                raise TraceError(why)
            stopped = why
            break
        if cut is not None and at + k < len(steps):
            k = cut(start, steps[at:at + k])
            if k == 0:
                stopped = (f"no point where a window may end in the {size} steps from step "
                           f"{steps[at][1].get('n')}")
                break
        part = steps[at:at + k]
        end = boundary(start, part) if at + k < len(steps) else None
        window += 1
        where = keep if keep is None or (window == 1 and end is None) \
            else Path(keep) / f"window-{window}"
        verdict = run(start, part, end=end, keep=where)
        states += verdict.distinct_states or 0
        seconds += verdict.seconds
        if not verdict.ok:
            message = verdict.message
            if "WindowEnd is violated" in message:     # WindowEnd, NodesWindowEnd
                message = (f"window {window} (steps {part[0][1].get('n')} to "
                           f"{part[-1][1].get('n')}) did not end in the state its recorded "
                           "steps left (the next window's start)")
            elif window > 1 or end is not None:
                message += f" (window {window}, from step {part[0][1].get('n')})"
            return Verdict(False, steps=at + k, message=message, failed_step=verdict.failed_step,
                           line=verdict.line, distinct_states=states, seconds=seconds,
                           machine=verdict.machine, windows=window)
        if verdict.steps < k:           # the checker stopped where the spec's world ends
            at, stopped = at + verdict.steps, verdict.stopped or verdict.message
            break
        at, start = at + k, end
    windows = f" in {window} windows" if window > 1 else ""
    if at == len(steps):
        message = f"all {at} steps are steps of spec/{spec}.tla{windows}"
    else:
        n = steps[at][1].get("n")
        message = (f"the {at} steps before step {n} are steps of spec/{spec}.tla{windows}; "
                   f"step {n} and after are not checked: {stopped}")
    return Verdict(True, steps=at, message=message, distinct_states=states, seconds=seconds,
                   machine=machine, windows=window, stopped=stopped)


_END = re.compile(r'<<\s*"WindowEnd"')


def printed_ends(output: str, names: tuple[str, ...]) -> list[dict]:
    """The states a window's TLC run printed where it ended: each a line
    ``<< "WindowEnd",`` and the indented lines after it (a record of the
    variables, printed by ``PrintT`` in an invariant ``WindowEnd``), as
    ``{name: value}`` for ``names``."""
    ends, block = [], None
    for line in output.splitlines() + [""]:
        if block is not None and line[:1].isspace():
            block.append(line)
            continue
        if block is not None:
            try:
                _, state = parse_value("\n".join(block))
                ends.append({name: state[name] for name in names})
            except (ParseError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"TLC printed a window's end the checker cannot read ({e})") \
                    from None
            block = None
        if _END.match(line):
            block = [line]
    return ends
