"""What a CIFAR run's files must hold before a check counts the run: a provenance file
that belongs to it, and finite numbers in every epoch it recorded.

The completeness checks (:mod:`kwng.experiments.cifar.results`,
:mod:`kwng.experiments.cifar.fig3`) read every run through these functions, so a
truncated, empty or foreign ``provenance.json`` and a non-finite loss or accuracy are
named, never passed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kwng.experiments.guard import IDENTITY_DEFAULTS, RUN_IDENTITY_KEYS
from kwng.experiments.provenance import ResultFileError, read_json

__all__ = ["read_record", "provenance_problem", "rows_problem"]

_KEYS = (*RUN_IDENTITY_KEYS, *IDENTITY_DEFAULTS)


def read_record(path: str | os.PathLike) -> dict:
    """A metrics record: a JSON object with a ``config`` object and an ``epochs`` list;
    anything else raises :class:`ResultFileError` naming ``path``."""
    rec = read_json(path)
    if not isinstance(rec, dict):
        raise ResultFileError(f"{path}: the record is a {type(rec).__name__}, "
                              "expected a JSON object")
    for key, kind in (("config", dict), ("epochs", list)):
        if not isinstance(rec.get(key), kind):
            raise ResultFileError(f"{path}: '{key}' is missing or not a "
                                  f"{kind.__name__}")
    return rec


def provenance_problem(rec: dict, prov_path: str | os.PathLike) -> str | None:
    """Why ``prov_path`` is not the provenance of the run recorded in ``rec``, or
    ``None``: it must parse, hold a configuration whose identity settings
    (:data:`~kwng.experiments.guard.RUN_IDENTITY_KEYS`,
    :data:`~kwng.experiments.guard.IDENTITY_DEFAULTS`) are the record's, a git commit
    and a date."""
    prov_path = Path(prov_path)
    if not prov_path.is_file():
        return f"{prov_path}: missing"
    try:
        prov = read_json(prov_path)
    except ResultFileError as exc:
        return str(exc)
    if not isinstance(prov, dict) or not isinstance(prov.get("config"), dict):
        return f"{prov_path}: holds no configuration"
    pc, rc, dflt = prov["config"], rec["config"], IDENTITY_DEFAULTS
    differ = [k for k in _KEYS if pc.get(k, dflt.get(k)) != rc.get(k, dflt.get(k))]
    if differ:
        return f"{prov_path}: another run's provenance (differing: {differ})"
    if not prov.get("git_commit") or not prov.get("date"):
        return f"{prov_path}: lacks the git commit or the date"
    return None


def rows_problem(rec: dict, fields: tuple[str, ...] = ("train_loss", "test_acc")
                 ) -> str | None:
    """Why the record's epochs are not in order or hold a non-finite value of
    ``fields``, or ``None``. The last row of a run that diverged (or stopped for a
    non-finite loss) may hold one: that is how the run ended."""
    rows = rec["epochs"]
    if [r.get("epoch") if isinstance(r, dict) else None for r in rows] \
            != list(range(1, len(rows) + 1)):
        return "epochs missing or out of order"
    stop = rec.get("early_stop") or {}
    ended = bool(rec.get("diverged")) or stop.get("reason") == "non-finite loss"
    for i, r in enumerate(rows):
        vals = [r.get(f, math.nan) for f in fields]
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals)
        if not ok and not (ended and i == len(rows) - 1):
            return f"non-finite or missing {'/'.join(fields)} in epoch {i + 1}"
    return None
