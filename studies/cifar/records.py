"""A CIFAR run's records read back (book chapter :ref:`experiments-cifar`): one record
checked before a count takes it, and what a set of them say, as plain data.

* One record (:func:`read_record`, :func:`provenance_problem`, :func:`rows_problem`):
  a provenance file that belongs to it, and finite numbers in every epoch it recorded.
  The completeness checks (:mod:`studies.cifar.results`,
  :mod:`studies.fig3.protocol`) read every run through these functions, so a
  truncated, empty or foreign ``provenance.json`` and a non-finite loss or accuracy are
  named, never passed.
* Their tables. For the records of :func:`studies.cifar.results.load_results`
  (``{(conditioning, method, seed): record}``): :func:`at_epoch`, :func:`curves`,
  :func:`final_accuracy_table` and :func:`format_table`, :func:`class_scalings`,
  :func:`final_per_class`, :func:`diag_series`; the step-size selection:
  :func:`selection_table`; for the authors'-horizon records
  (:func:`studies.authors100.records.load_authors100`): :func:`run_label`,
  :func:`epoch_seconds` and :func:`time_to_accuracy`. The decision rules
  (:mod:`studies.fig3.verdicts`) read them, and the figures of
  :mod:`studies.cifar.figures` and :mod:`studies.authors100.figures` draw from them,
  never the
  reverse.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from studies.kit.guard import IDENTITY_DEFAULTS, RUN_IDENTITY_KEYS, record_identity
from studies.kit.provenance import ResultFileError, read_json

__all__ = ["read_record", "provenance_problem", "rows_problem", "EXECUTION_KEYS",
           "execution_differences", "execution_problem", "at_epoch", "curves",
           "final_accuracy_table", "format_table", "class_scalings", "final_per_class",
           "diag_series", "selection_table", "run_label", "epoch_seconds",
           "time_to_accuracy"]

# --------------------------------------------------------------------------- one record
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
    (:data:`~studies.kit.guard.RUN_IDENTITY_KEYS`,
    :data:`~studies.kit.guard.IDENTITY_DEFAULTS`) are the record's, a git commit
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


#: the settings of a run's identity that name how its step executed, recorded beside
#: the identity as they ran (the trainer can run a step eagerly that was asked to be
#: captured)
EXECUTION_KEYS = ("capture", "channels_last")


def execution_differences(rec: dict) -> dict[str, dict]:
    """Where the record's identity (what skip, resume and ``cifar check`` compare)
    differs from how the run executed (the record's top-level ``capture`` and
    ``channels_last``): ``{key: {"asked": identity's, "ran": record's}}``."""
    ident = record_identity(rec)
    return {k: {"asked": ident.get(k), "ran": rec[k]} for k in EXECUTION_KEYS
            if k in rec and ident.get(k) != rec[k]}


def execution_problem(rec: dict) -> tuple[str | None, str | None]:
    """``(problem, note)`` on how the run executed: ``problem`` when its identity and
    its execution differ and the record does not name the difference under
    ``ran_differs``, ``note`` (a sentence ``cifar check`` prints) when it names it;
    ``(None, None)`` when they agree."""
    diff = execution_differences(rec)
    if not diff:
        return None, None
    text = ", ".join(f"{k} asked {v['asked']} ran {v['ran']}" for k, v in diff.items())
    if rec.get("ran_differs") != diff:
        return f"identity and execution differ, unnamed: {text}", None
    fixed = [c["date"] for c in rec.get("corrections", [])
             if "ran_differs" in c.get("fields", ())]
    return None, text + (f" (named by a correction of {fixed[0]})" if fixed else "")


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


# ------------------------------------------------------------------------- their tables
def at_epoch(results: dict, epoch: int) -> dict:
    """The records cut after ``epoch`` epochs (runs with fewer are left out): a
    comparison of runs that stopped at different epochs, all at the same point of their
    schedule."""
    if not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"epoch must be an integer >= 1, got {epoch!r}")
    return {
        k: {**r, "epochs": r["epochs"][:epoch]}
        for k, r in results.items()
        if len(r["epochs"]) >= epoch
    }


def curves(
    results: dict, conditioning: str, method: str, key: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(epochs, values)`` with values of shape ``(seeds, epochs)``, truncated to the
    shortest run."""
    runs = [
        r
        for (c, m, _), r in sorted(results.items())
        if c == conditioning and m == method and r["epochs"]
    ]
    if not runs:
        return np.zeros(0), np.zeros((0, 0))
    n = min(len(r["epochs"]) for r in runs)
    vals = np.array([[row[key] for row in r["epochs"][:n]] for r in runs], dtype=float)
    return np.arange(1, n + 1), vals


def final_accuracy_table(
    results: dict,
    methods: Sequence[str],
    conditionings: Sequence[str] = ("ill", "well"),
) -> dict:
    """``{method: {cond: {"mean", "min", "max", "std", "n", "epochs", "diverged"}}}`` of
    the last-epoch test accuracy (absent entries: no run)."""
    out: dict = {}
    for m in methods:
        for c in conditionings:
            runs = [
                r
                for (cc, mm, _), r in results.items()
                if cc == c and mm == m and r["epochs"]
            ]
            if not runs:
                continue
            acc = np.array([r["epochs"][-1]["test_acc"] for r in runs], dtype=float)
            out.setdefault(m, {})[c] = {
                "mean": float(np.nanmean(acc))
                if np.isfinite(acc).any()
                else float("nan"),
                "min": float(np.nanmin(acc))
                if np.isfinite(acc).any()
                else float("nan"),
                "max": float(np.nanmax(acc))
                if np.isfinite(acc).any()
                else float("nan"),
                "std": float(np.nanstd(acc, ddof=1))
                if np.isfinite(acc).sum() > 1
                else 0.0,
                "n": len(runs),
                "epochs": [len(r["epochs"]) for r in runs],
                "planned": max(int(r["config"]["epochs"]) for r in runs),
                "complete": all(r.get("complete") for r in runs),
                "diverged": sum(bool(r.get("diverged")) for r in runs),
            }
    return out


def format_table(table: dict, conditionings: Sequence[str] = ("ill", "well")) -> str:
    """A Markdown table: mean ± std (min–max, n seeds) of the final test accuracy in %;
    runs stopped before their planned number of epochs are marked with the epochs they
    reached."""
    head = "| method | " + " | ".join(f"{c}-conditioned" for c in conditionings) + " |"
    lines = [head, "|---" * (len(conditionings) + 1) + "|"]
    for m, row in table.items():
        cells = []
        for c in conditionings:
            e = row.get(c)
            if e is None:
                cells.append("–")
                continue
            s = f"{100 * e['mean']:.1f}"
            if e["n"] > 1:
                lo, hi = 100 * e["min"], 100 * e["max"]
                s += f" ± {100 * e['std']:.1f} ({lo:.1f}–{hi:.1f}, n={e['n']})"
            if not e["complete"]:
                s += f" (incomplete: {min(e['epochs'])}/{e['planned']} epochs)"
            if e["diverged"]:
                s += f" ({e['diverged']} diverged)"
            cells.append(s)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def class_scalings(results: dict) -> np.ndarray:
    """``U_k`` of each class in the ill-conditioned runs, from the records (the
    loader, :func:`studies.cifar.results.load_results`, fills it in for old
    records)."""
    for (c, _, _), r in sorted(results.items()):
        if c == "ill" and r.get("U"):
            return np.asarray(r["U"], dtype=float)
    raise ValueError(
        "results must hold an ill-conditioned record with its class scalings 'U' "
        "(load them with studies.cifar.results.load_results)"
    )


def final_per_class(results: dict, cond: str, method: str) -> np.ndarray | None:
    """Per-class test accuracy after the last epoch, mean over seeds (None without such
    records)."""
    runs = [
        r
        for (c, m, _), r in results.items()
        if c == cond
        and m == method
        and r["epochs"]
        and "test_acc_per_class" in r["epochs"][-1]
    ]
    if not runs:
        return None
    return np.mean([r["epochs"][-1]["test_acc_per_class"] for r in runs], axis=0)


def diag_series(rec: dict, key: str) -> np.ndarray:
    """One KWNG diagnostic of a run record per epoch: ``"eps"`` (epoch mean, in the
    authors' units ``ε_ours / √N`` for runs of the authors' convention), ``"clipped"``
    (fraction of the epoch's steps) or another ``info`` key's epoch mean
    (``"reduction_ratio"``, ...); an empty array when the record lacks it."""
    rows = rec["epochs"]
    if key == "clipped":
        if all("clipped_mean" in r for r in rows):
            return np.array([r["clipped_mean"] for r in rows], dtype=float)
        if all(
            "clipped" in r for r in rows
        ):  # cumulative counter -> fraction of the epoch's steps
            cum = np.array([0] + [r["clipped"] for r in rows], dtype=float)
            st = np.array([0] + [r["steps"] for r in rows], dtype=float)
            return np.diff(cum) / np.maximum(np.diff(st), 1)
        return np.zeros(0)
    if key == "eps":
        vals = [r.get("eps_mean", r.get("eps")) for r in rows]
        if any(v is None for v in vals):
            return np.zeros(0)
        from kwng.engine.config import authors_eps_factor

        conv = rec.get("method_spec", {}).get("eps_convention", "ours")
        return np.array(vals, dtype=float) / (
            authors_eps_factor(rec["batch_size"]) if conv == "authors" else 1.0
        )
    vals = [r.get(f"{key}_mean") for r in rows]
    return np.zeros(0) if any(v is None for v in vals) else np.array(vals, dtype=float)


def selection_table(selected: dict) -> str:
    """The step-size selection (the ``selected.json`` of ``cifar select``) as a Markdown
    table: held-out accuracy per step size of the grid, ``div`` for diverged runs, the
    chosen one in bold."""
    grid = selected["grid"]
    lines = [
        "| run | " + " | ".join(f"{g:g}" for g in grid) + " | chosen |",
        "|---" * (len(grid) + 2) + "|",
    ]
    for key, v in sorted(selected["selected"].items()):
        acc = {
            c["lr"]: ("div" if not c["ok"] else f"{100 * c['val_acc']:.1f}")
            for c in v["candidates"]
        }
        cells = [f"**{acc[g]}**" if g == v["lr"] else acc.get(g, "–") for g in grid]
        lines.append(
            f"| {key.split('/', 1)[1]} | " + " | ".join(cells) + f" | {v['lr']:g} |"
        )
    return "\n".join(lines)


def run_label(key: tuple) -> str:
    """``method step`` (with ``fp32`` and the seed where they matter)."""
    tag, _cond, method, seed = key
    step = tag.split("lr")[-1]
    extra = " fp32" if tag.startswith("fp32") else ""
    return f"{method} {step}{extra}" + (f" s{seed}" if seed else "")


def epoch_seconds(timing: dict, precision: str = "bf16",
                  field: str = "steady_epoch_s") -> dict[str, float]:
    """Seconds per epoch (training and evaluation) of each method alone on one GPU, from
    the trainer timing (``cifar trainer-timing``): the captured row where the method
    captures, else the eager one. ``field`` reads another of the rows' steady-state
    numbers (``steady_ms_per_step``: milliseconds per training step)."""
    rows = [r for r in timing.get("rows", []) if r.get("precision") == precision]
    if not rows:
        have = sorted({r.get("precision") for r in timing.get("rows", [])})
        raise ValueError(f"precision must be one the timing measured {have}, "
                         f"got {precision!r}")
    out: dict[str, float] = {}
    for r in rows:
        if r["mode"] == "captured" or r["method"] not in out:
            out[r["method"]] = float(r[field])
    return out


def _curve(r: dict) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([e["epoch"] for e in r["epochs"]]),
        np.array([e["test_acc"] for e in r["epochs"]]),
    )


def time_to_accuracy(
    records: dict, seconds: dict[str, float], levels: Sequence[float] = (0.6, 0.8)
) -> list[dict]:
    """For every run (not the fp32 control): the first epoch whose test accuracy reaches
    each level and that epoch times the method's seconds per epoch (``None``: never)."""
    out = []
    for key, r in sorted(records.items()):
        if key[0].startswith("fp32"):
            continue
        ep, acc = _curve(r)
        row = {"key": key, "label": run_label(key), "conditioning": key[1]}
        for lv in levels:
            hit = np.flatnonzero(acc >= lv)
            e = int(ep[hit[0]]) if len(hit) else None
            row[f"epoch_{lv:g}"] = e
            row[f"seconds_{lv:g}"] = None if e is None else e * seconds[key[2]]
        out.append(row)
    return out
