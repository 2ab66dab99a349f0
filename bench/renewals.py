"""How long the embedded coordinator's renewals take, in place against replaced.

    PYTHONPATH=. python bench/renewals.py [--seconds 300] [--every 0.25]

Run it beside a load (a whole test suite on the same disk): in two fresh
directories of ``--dir``'s file system, one
:class:`~kvproto.runtime.coordinator.FileCoordinator` lease is renewed with
:meth:`~kvproto.runtime.coordinator.FileCoordinator.keepalive` (its record
written over in place) and the other by replacing its record (a new file
renamed over it, as every renewal did before), one after the other every
``--every`` seconds. Prints, for each kind, the renewals made, the median,
the 99th percentile and the longest, and how many took over 0.1 s and over
0.3 s; and how late the sleeps between them woke (the CPU's share of any
delay).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from kvproto.runtime.coordinator import FileCoordinator


class ReplacingCoordinator(FileCoordinator):
    """The file coordinator as it renewed before: the same ``keepalive``,
    whose renewal replaces the record instead of writing over it."""
    _renew = staticmethod(FileCoordinator._write)


def report(name: str, took: list[float]) -> str:
    took = sorted(took)
    return (f"{name:>9}: {len(took)} renewals, median {statistics.median(took) * 1e3:.2f} ms, "
            f"p99 {took[int(len(took) * 0.99)] * 1e3:.1f} ms, longest {took[-1] * 1e3:.1f} ms, "
            f"> 0.1 s: {sum(t > 0.1 for t in took)}, > 0.3 s: {sum(t > 0.3 for t in took)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--every", type=float, default=0.25)
    ap.add_argument("--dir", default=None, help="where to make the two directories (default: TMPDIR)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as a, tempfile.TemporaryDirectory(dir=args.dir) as b:
        in_place, replaced = FileCoordinator(a, ttl=1e6), ReplacingCoordinator(b, ttl=1e6)
        terms = in_place.campaign("in-place"), replaced.campaign("replaced")
        took: dict[str, list[float]] = {"in place": [], "replaced": []}
        late: list[float] = []
        stop = time.monotonic() + args.seconds
        while time.monotonic() < stop:
            for name, renew in (("in place", lambda: in_place.keepalive(terms[0])),
                                ("replaced", lambda: replaced.keepalive(terms[1]))):
                slept = time.monotonic()
                time.sleep(args.every / 2)
                start = time.monotonic()
                late.append(start - slept - args.every / 2)
                renew()
                took[name].append(time.monotonic() - start)
        in_place.close()
        replaced.close()
    for name, t in took.items():
        print(report(name, t))
    late.sort()
    print(f"    sleeps: {len(late)}, woke late by {statistics.median(late) * 1e3:.2f} ms median, "
          f"{late[-1] * 1e3:.1f} ms at most, > 0.1 s: {sum(t > 0.1 for t in late)}")


if __name__ == "__main__":
    main()
