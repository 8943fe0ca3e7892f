"""A group of runs in a plan beside the Fig. 3 protocol (the amortized step's seed
study, the audit): the checks its ``conditioning``, ``methods`` and ``seeds`` share."""

from __future__ import annotations

from studies.cifar.methods import METHODS

__all__ = ["check_group"]


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
