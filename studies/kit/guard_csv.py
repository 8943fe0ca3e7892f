"""Result CSV files of the studies: written whole and atomically
(:func:`write_csv_rows`), read back checked (:func:`read_csv_checked`: every row is
parsed, checked and keyed, and each bad row is reported with its file and line), so that
a resume recomputes what is damaged instead of trusting it.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from studies.kit.provenance import ResultFileError, atomic_write_text

__all__ = ["write_csv_rows", "read_csv_checked"]


def write_csv_rows(
    path: str | os.PathLike, columns: Sequence[str], rows: list[dict]
) -> None:
    """Write ``rows`` (dicts holding ``columns``) to the CSV ``path`` atomically, floats
    with 10 significant digits (``.10g``), every row ending in a newline."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(
            {k: (f"{r[k]:.10g}" if isinstance(r[k], float) else r[k]) for k in columns}
        )
    atomic_write_text(path, buf.getvalue())


def _parse_row(
    where: str,
    fields: list[str],
    columns: Sequence[str],
    converters: dict[str, Callable],
    finite: Sequence[str],
) -> tuple[dict[str, Any] | None, str | None]:
    """One CSV row of :func:`read_csv_checked`: ``(row, None)``, or ``(row, problem)``
    (parsed, not finite) or ``(None, problem)`` (does not parse), the problem naming
    ``where`` and what is wrong."""
    if len(fields) != len(columns):
        return None, (
            f"{where}: {len(fields)} fields, expected {len(columns)} "
            "(truncated row?)"
        )
    row: dict[str, Any] = dict(zip(columns, fields))
    try:
        for k, conv in converters.items():
            row[k] = conv(row[k])
    except ValueError as exc:
        return None, f"{where}: field {k!r} = {row[k]!r} does not parse ({exc})"
    bad = [k for k in finite if not math.isfinite(row[k])]
    if bad:
        return row, f"{where}: non-finite {', '.join(f'{k}={row[k]}' for k in bad)}"
    return row, None


def _split_csv(path: Path) -> tuple[list[str] | None, list[list[str]], bool]:
    """``(header, rows of fields, cut_tail)`` of the CSV ``path``; ``cut_tail``: the
    last row has no line end. An undecodable file raises :class:`ResultFileError`."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
        reader = csv.reader(text.splitlines())
        header = next(reader, None)
        lines = list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ResultFileError(f"{path}: not a readable CSV file ({exc})") from exc
    # files are written whole, each row ending in a newline: a last row without one was
    # cut short (possibly in the middle of a number that still parses)
    return header, lines, bool(lines) and not text.endswith("\n")


def read_csv_checked(
    path: str | os.PathLike,
    columns: Sequence[str],
    converters: dict[str, Callable],
    key: Callable[[dict], Any],
    finite: Sequence[str] = (),
    check: Callable[[dict], str | None] | None = None,
    rejected: list[dict] | None = None,
) -> tuple[list[dict], list[str]]:
    """Rows of the CSV ``path`` that are whole, parseable, finite in ``finite``, pass
    ``check`` (a row to ``None`` or what is wrong with it) and are unique by ``key``.

    Returns ``(good_rows, problems)``; each problem names the file, the line and what is
    wrong (a field that does not parse, a missing field, a last row without its line
    end, a non-finite value, a failed ``check``, a repeated key). Of rows with a
    repeated key only the first is kept. The rows that parsed but were rejected
    (non-finite, failed check, repeated key) are appended to ``rejected`` when given,
    so that a resume can recompute what they belonged to. A header other than
    ``columns`` raises :class:`ResultFileError`. A missing file gives ``([], [])``."""
    path = Path(path)
    if not path.exists():
        return [], []
    header, lines, cut_tail = _split_csv(path)
    if header is None:
        return [], [f"{path}: empty file (no header)"]
    if list(header) != list(columns):
        raise ResultFileError(
            f"{path}: header {header} differs from the expected columns {list(columns)}"
        )
    good, problems, seen = [], [], set()
    for lineno, fields in enumerate(lines, start=2):
        where = f"{path}:{lineno}"
        if cut_tail and lineno == len(lines) + 1:
            problems.append(f"{where}: last row has no line end (file truncated)")
            continue
        row, problem = _parse_row(where, fields, columns, converters, finite)
        if problem is None and check is not None:
            problem = check(row)
            problem = None if problem is None else f"{where}: {problem}"
        if problem is not None:
            problems.append(problem)
            if rejected is not None and row is not None:
                rejected.append(row)
            continue
        kk = key(row)
        if kk in seen:
            problems.append(f"{where}: duplicate of an earlier row with key {kk!r}")
            if rejected is not None:
                rejected.append(row)
            continue
        seen.add(kk)
        good.append(row)
    return good, problems
