"""A group of runs in a plan beside the Fig. 3 protocol (the amortized step's seed
study, the audit): the checks its ``conditioning``, ``methods`` and ``seeds`` share."""

from __future__ import annotations

from pathlib import Path

from studies.cifar.methods import METHODS
from studies.fig3.protocol import record_problem, run_status
from studies.kit.provenance import ResultFileError, read_json

__all__ = ["check_group", "record_verdict"]


def check_group(g: object) -> dict:
    """``g`` itself when it is a dict whose ``conditioning`` is ill or well, whose
    ``methods`` are known names (at least one) and whose ``seeds`` are distinct
    integers >= 0; else a ``ValueError`` naming the field and what it accepts."""
    if not isinstance(g, dict) or g.get("conditioning") not in ("ill", "well"):
        raise ValueError("each group needs conditioning 'ill' or 'well', "
                         f"got {g!r:.200}")
    unknown = sorted(set(g.get("methods") or []) - set(METHODS))
    if unknown or not g.get("methods"):
        raise ValueError(f"a group's methods must be names from {sorted(METHODS)}, "
                         f"got {g.get('methods')!r}")
    seeds = g.get("seeds")
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                   for s in seeds)):
        raise ValueError(f"a group's seeds must be distinct integers >= 0, got "
                         f"{seeds!r}")
    return g


def record_verdict(p: dict, mp: Path, part: str, key: tuple, planned: set,
                   epochs: int) -> tuple[str | None, str | None]:
    """``(problem, status)`` of the record ``mp`` of a group plan: the problem against
    the protocol ``p`` (its part ``part``), or that ``key`` (conditioning, method, seed)
    is not a run of the plan; else ``None`` and its run status
    (:func:`~studies.fig3.protocol.run_status`)."""
    try:
        problem = record_problem(p, mp, part)
    except (ResultFileError, KeyError, TypeError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None and key not in planned:
        problem = "not a run of the plan (plan.json)"
    return (problem, None) if problem else (None, run_status(read_json(mp), epochs))
