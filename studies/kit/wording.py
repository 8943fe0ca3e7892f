"""Lists of names and numbers in running text, as the book's glued sentences and
tables write them."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_EVEN, Decimal

__all__ = ["name_list", "fixed", "pct"]


def name_list(names: list[str]) -> str:
    """Names in running text: "A", "A and B", "A, B and C"; "none" for no names."""
    if not names:
        return "none"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def fixed(x: float, digits: int = 1) -> str:
    """``x`` with ``digits`` decimals, the one rounding of every number the book prints
    from a record: half to even on the value the record states (``x`` read to nine
    decimals first, so that the binary float of 61.65 is the tie it stands for):
    ``fixed(61.65) == "61.6"``, ``fixed(61.75) == "61.8"``,
    ``fixed(64.25) == "64.2"``."""
    if not isinstance(digits, int) or digits < 0:
        raise ValueError(f"digits must be an integer >= 0, got {digits!r}")
    if not math.isfinite(x):
        return str(x)
    q = Decimal(1).scaleb(-digits)
    out = Decimal(f"{x:.9f}").quantize(q, rounding=ROUND_HALF_EVEN)
    return f"{out + 0:f}" if out != 0 else f"{abs(out):f}"


def pct(frac: float | None, digits: int = 1) -> str:
    """A fraction as a percentage by :func:`fixed` (``pct(0.6165) == "61.6"``); "–"
    for ``None``."""
    return "–" if frac is None else fixed(100 * frac, digits)
