"""The book's answer to the paper's CIFAR-10 claim, in words (chapters :ref:`claims`,
:ref:`cifar-fig3`, the introduction and the README): the verdict sentence with the size
of each baseline's drop (:func:`fig3_sentence`) and, beside it, the results that go
against KWNG (:func:`fig3_negatives`), both computed from the Fig. 3 records."""

from __future__ import annotations

import os
from pathlib import Path

from studies.cifar.methods import LR_GRID, METHODS
from studies.claims.ledger import RESULTS, ablation_verdict, cifar_fig3_verdict
from studies.fig3 import audit, verdicts
from studies.fig3.protocol import grid_state, load_protocol
from studies.kit.wording import fixed, name_list, pct

__all__ = ["DRASTIC", "DROP_HEADER", "ablation_sides", "drop_table", "fig3_drops",
           "fig3_negatives", "fig3_sentence"]


#: a baseline's drop from well- to ill-conditioned that the verdict sentence calls
#: drastic (rule set after the runs: the gap between the SGD-type and KFAC-type
#: methods' 20-40 points and Adam's 1.5)
DRASTIC = 0.10


def fig3_sentence(root: str | os.PathLike = RESULTS, q: dict | None = None) -> str:
    """The book's answer to the paper's CIFAR-10 headline claim from the Fig. 3 records
    (``q``, default :func:`cifar_fig3_verdict` of ``root``): the verdict per baseline,
    then, once settled, the size of each baseline's drop from well- to ill-conditioned
    (drastic at :data:`DRASTIC` or more, else small) beside KWNG's. The paper's word
    "Euclidean" covers the gradient methods only (SGD-type and Adam), not KFAC and
    EKFAC. Pages glue it, the README quotes it (tested)."""
    q = cifar_fig3_verdict(root) if q is None else q
    claim = ("its CIFAR-10 claim (with an ill-conditioned output layer the methods "
             "based on the Euclidean gradient drop drastically, KWNG keeps its "
             f"accuracy) {q['by_baseline']}")
    if not q["settled"]:
        left = sum(q["queue"].values())
        return (f"By the paper's own protocol (the Fig. 3 study), {claim}; the overall "
                f"verdict needs {left} more run{'s' * (left != 1)}.")
    per = q["per_baseline"]

    def drops(ms: list[str]) -> str:
        return name_list([f"{METHODS[m].label} {pct(per[m]['drop'])}" for m in ms])

    big = [m for m in per if per[m]["drop"] >= DRASTIC]
    small = [m for m in per if per[m]["drop"] < DRASTIC]
    kw = 100 * next(iter(per.values()))["drop_kwng"]
    parts = [f"drastic for {drops(big)} points" if big else "",
             f"small for {drops(small)} points" if small else ""]
    sizes = "; ".join(p for p in parts if p)
    return (f"By the paper's own protocol (the Fig. 3 study), {claim}. The drop from "
            f"well- to ill-conditioned is {sizes}; KWNG's is "
            f"{fixed(kw)}{' (a gain)' if kw < 0 else ''}.")


def _edge_negatives(p: dict, root: Path, fig3: Path) -> list[str]:
    """The grid-edge part of :func:`fig3_negatives`."""
    out: list[str] = []
    top = max(LR_GRID)
    edge = [m for k, st in grid_state(p, fig3).items() if k.startswith("ill/")
            and st["selected"] == top for m in [k.split("/")[1]]]
    # the audit's runs above the grid (studies.fig3.audit) settle a method whose edge
    # steps all did worse than its selection; one that did better stays a negative
    tried = {m: beat for (cond, m), (_, beat) in audit.edge_groups(
        audit.edge_runs(p, root / "cifar" / "fig3_audit", fig3)).items()
        if cond == "ill"}
    beyond = [m for m in edge if tried.get(m)]
    edge = [m for m in edge if m not in tried]
    if beyond:
        out.append(f"{name_list([METHODS[m].label for m in beyond])} did better above "
                   f"the paper's grid (step {top:g}) in the ill-conditioned case than "
                   "at their selected step")
    if edge:
        out.append(f"{name_list([METHODS[m].label for m in edge])} "
                   f"{'were' if len(edge) > 1 else 'was'} selected at step {top:g} in "
                   "the ill-conditioned case, the top of the paper's grid, so "
                   f"{'their' if len(edge) > 1 else 'its'} best step may lie beyond it")
    return out


def fig3_negatives(root: str | os.PathLike = RESULTS, q: dict | None = None) -> str:
    """The Fig. 3 results that go against KWNG, in one sentence (``q``: the verdict of
    :func:`cifar_fig3_verdict`): the baselines that reach 85 % test accuracy in the
    ill-conditioned case sooner than exact KWNG on the time figure's clock, the ablation
    variants that end above full KWNG, KWNG's rank among the methods settled in the
    well-conditioned case (a final selection with all its seeds), and the methods
    selected at the top of the paper's grid in the ill-conditioned case (their best step
    may lie beyond it) unless the audit's runs above the grid
    (:func:`studies.fig3.audit.edge_runs`) all did worse; a method whose run there did
    better is named as such."""
    q = cifar_fig3_verdict(root) if q is None else q
    fig3 = Path(root) / "cifar" / "fig3"
    p = load_protocol(fig3 / "protocol.json")
    out = []
    s85 = q["time_s85"]
    faster = [m for m in q["per_baseline"] if m in s85 and s85[m] < s85["kwng"]]
    if faster:
        out.append(f"{name_list([METHODS[m].label for m in faster])} reach"
                   f"{'es' * (len(faster) == 1)} 85 % test accuracy in the "
                   "ill-conditioned case sooner than exact KWNG ("
                   + ", ".join(f"{s85[m]:.0f} s" for m in faster)
                   + f" against {s85['kwng']:.0f} s)")
    ab = {r["method"]: r for r in q["ablation_rows"]}
    above = [m for m, r in ab.items() if m != "kwng" and r["test"] is not None
             and r["test"] > ab["kwng"]["test"]]
    if above:
        out.append(name_list([f"{METHODS[m].label} ({100 * ab[m]['test']:.1f} %, "
                              f"{ab[m]['runs']} run{'s' * (ab[m]['runs'] != 1)})"
                              for m in above])
                   + f" end{'s' * (len(above) == 1)} above full KWNG "
                   f"({pct(ab['kwng']['test'])} %) in the Fig. 7 ablation")
    seeds = verdicts.seed_summary(p, fig3)
    # a method ranks once its selection is final with all its seeds (an added method
    # whose grid is still running has no rank yet)
    well = sorted((v["mean"], k.split("/")[1]) for k, v in seeds.items()
                  if k.startswith("well/") and verdicts.settled(v))
    rank = [m for _, m in well].index("kwng")
    if rank == 0:
        out.append(f"in the well-conditioned case KWNG ends lowest of the {len(well)} "
                   f"methods ({pct(well[0][0])} %)")
    out += _edge_negatives(p, Path(root), fig3)
    if not out:
        return "No Fig. 3 result goes against KWNG."
    return "Against KWNG: " + "; ".join(out) + "."


def fig3_drops(q: dict) -> str:
    """Each baseline's drop from well- to ill-conditioned in points, ± its spread (the
    verdict rule's), then KWNG's: the numbers that decide the Fig. 3 verdict (``q``:
    :func:`cifar_fig3_verdict`)."""
    per = q["per_baseline"]
    if not per:
        return "no baseline has its runs"
    kw = next(iter(per.values()))
    return ", ".join(f"{METHODS[m].label} {pct(v['drop'])} ± {pct(v['spread'])}"
                     for m, v in per.items()) + (
        f"; KWNG {pct(kw['drop_kwng'])} ± {pct(kw['spread_kwng'])}")


#: the columns of :func:`drop_table`
#:
#: :meta hide-value:
DROP_HEADER = ("baseline", "drop WC → IC (points)", "KWNG's drop", "verdict")


def drop_table(q: dict) -> list[tuple]:
    """One row per baseline of :func:`cifar_fig3_verdict` ``q``: its drop from well- to
    ill-conditioned ± spread, KWNG's beside it, and the verdict of the rule ("–" for
    the drops of a baseline whose verdict waits for runs)."""
    return [(METHODS[m].label, f"{pct(v['drop'])} ± {pct(v['spread'])}",
             f"{pct(v['drop_kwng'])} ± {pct(v['spread_kwng'])}", v["verdict"])
            if "drop" in v else (METHODS[m].label, "–", "–", v["verdict"])
            for m, v in q["per_baseline"].items()]


def ablation_sides(rows: list[dict]) -> str:
    """Where each ablation variant ends against KWNG by the ledger's rule
    (:func:`studies.claims.ledger.ablation_verdict` of ``rows``, from
    :func:`studies.fig3.verdicts.ablation_rows`): the variants below, level (inside
    the larger seed range), above and unstable (some runs stalled, others not), each
    with its mean and runs (each run's final accuracy where it has several), then
    KWNG's."""
    by, side = {r["method"]: r for r in rows}, ablation_verdict(rows)["side"]
    if not side:
        return "no variant has run yet"

    def one(m: str) -> str:
        r = by[m]
        each = (": " + ", ".join(pct(v) for v in r["finals"]) + " %"
                if r["runs"] > 1 else "")
        return (f"{METHODS[m].label} at {pct(r['test'])} % ({r['runs']} "
                f"run{'s' * (r['runs'] != 1)}{each})")

    said = [f"{where}: " + name_list([one(m) for m, w in side.items() if w == key])
            for key, where in (("below", "below KWNG"), ("level", "level with KWNG"),
                               ("above", "above KWNG"),
                               ("unstable", "unstable (stalled in some runs, not in "
                                "others)")) if key in side.values()]
    kw = by["kwng"]
    return "; ".join(said) + (f"; KWNG at {pct(kw['test'])} % ({kw['runs']} runs, "
                              f"range {pct(kw['range'])})")
