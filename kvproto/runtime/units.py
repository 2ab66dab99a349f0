"""Byte sizes given as ints or human strings.

``parse_size`` accepts a non-negative ``int`` or a string made of a number and
an optional unit (case-insensitive, spaces allowed between them):

* binary units: ``KiB MiB GiB TiB`` and the single letters ``K M G T``
  (as ``dd`` and most CLIs read them): powers of 1024;
* decimal units: ``KB MB GB TB``: powers of 1000;
* ``B`` or no unit: bytes.

Fractions are allowed when they name a whole number of bytes
(``"1.5KiB"`` is 1536; ``"0.5B"`` is refused).
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: "int | str") -> int:
    """Return ``value`` as a number of bytes; raise ``ValueError`` if it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"not a size: {value!r}")
    number, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}")
    if "." in number:
        whole, _, frac = number.partition(".")
        # exact rational arithmetic: (whole.frac) * mult must be an integer
        denom = 10 ** len(frac)
        num = int(whole or "0") * denom + int(frac or "0")
        total, rem = divmod(num * mult, denom)
        if rem:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        return total
    return int(number) * mult


def format_size(n: int) -> str:
    """Short human form of ``n`` bytes, binary units (for logs and stats)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"
