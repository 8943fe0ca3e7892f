"""The amortized step's seed study (plan ``amortized_seeds`` of
:func:`kwng.experiments.cifar.plans.build_plan`, records under
``results/cifar/amortized_seeds``): each setting of the amortized KWNG step, and tuned
Adam beside it, at several seeds, with the Fig. 3 protocol's settings. Its plan is the
committed file ``plan.json`` of that folder; this module reads and checks it."""

from __future__ import annotations

from kwng.experiments.cifar.methods import METHODS, RESULTS

__all__ = ["AMORTIZED_SEEDS", "seed_study_groups"]

#: the amortized step's seed study, ``results/cifar/amortized_seeds`` of the checkout:
#: its committed plan (``plan.json``) and its records
#:
#: :meta hide-value:
AMORTIZED_SEEDS = RESULTS / "amortized_seeds"


def seed_study_groups(spec: dict) -> list[dict]:
    """The groups of the seed study's plan ``spec`` (``plan.json``), its amendments
    after them, each checked: ``conditioning`` ill or well, ``methods`` known names,
    ``seeds`` distinct integers >= 0, ``lr_of`` the Fig. 3 method whose selected step
    the group runs at."""
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list):
        raise ValueError("the seed study's plan must be a dict with a list 'groups', "
                         f"got {spec!r:.200}")
    groups = [*spec["groups"], *spec.get("amendments", [])]
    for g in groups:
        if not isinstance(g, dict) or g.get("conditioning") not in ("ill", "well"):
            raise ValueError("each group needs conditioning 'ill' or 'well', got "
                             f"{g!r}")
        unknown = sorted(set(g.get("methods", [])) - set(METHODS))
        if unknown or not g.get("methods"):
            raise ValueError(f"a group's methods must be names from {sorted(METHODS)}, "
                             f"got {g.get('methods')!r}")
        seeds = g.get("seeds")
        if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                       for s in seeds)):
            raise ValueError(f"a group's seeds must be distinct integers >= 0, got "
                             f"{seeds!r}")
        if g.get("lr_of") not in METHODS:
            raise ValueError(f"a group's lr_of must be a method name, got "
                             f"{g.get('lr_of')!r}")
    return groups
