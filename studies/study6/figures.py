"""Tables and findings of the earlier 6-epoch CIFAR study (chapter
:ref:`cifar-6epoch`), from its records
(:func:`studies.cifar.results.load_results`, ``{(conditioning, method, seed):
record}``) and the accuracy table of
:func:`studies.cifar.records.final_accuracy_table`.

Each table function returns ``(header, rows)`` for
:func:`studies.kit.tables.markdown_table`:

* :func:`step_time_table` and :func:`step_time_values` — each method's step time alone
  and under the sharing of the GPUs;
* :func:`ablation_table` — the final IC accuracy of each ablation against ``kwng``;
* :func:`conditioning_table` and :func:`claim_lines` — the drop of each method from WC
  to IC and the paper's claims checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["step_time_table", "step_time_values", "ablation_table",
           "conditioning_table", "claim_lines"]

#: the Euclidean methods of the study
EUCLIDEAN = ("sgd", "sgd_momentum", "sgd_momentum_wd", "adam")

#: the method that stopped early (after 3 of 6 epochs)
CUT = "kwng_m20"


def step_time_table(results: dict, timing: dict) -> tuple[list[str], list[tuple]]:
    """Per method of the timing record (``cifar timing``): ms per step alone, that over
    SGD's, ms per step under the sharing (the records' last epoch) and the slow-down."""
    if "sgd" not in timing.get("methods", {}):
        raise ValueError("timing must be a timing record with a 'methods' entry 'sgd'")
    sgd_alone = timing["methods"]["sgd"]["sec_per_step"]
    rows = []
    for m, t in timing["methods"].items():
        shared = np.mean([r["epochs"][-1]["time_train"] / r["epochs"][-1]["steps"]
                          for (_, mm, _), r in results.items() if mm == m])
        alone = t["sec_per_step"]
        rows.append((m, f"{1e3 * alone:.1f}", f"{alone / sgd_alone:.1f}",
                     f"{1e3 * shared:.1f}", f"{shared / alone:.1f}"))
    return ["method", "alone (ms/step)", "× SGD", "shared (ms/step)", "slow-down"], rows


def step_time_values(timing: dict) -> dict[str, float]:
    """``six_kwng_per_sgd``: a KWNG step alone in SGD steps; ``six_m20_per_kwng``: a
    step with ``M`` = 20 in ``M`` = 5 steps."""
    sec = {m: t["sec_per_step"] for m, t in timing["methods"].items()}
    return {"six_kwng_per_sgd": sec["kwng"] / sec["sgd"],
            "six_m20_per_kwng": sec["kwng_m20"] / sec["kwng"]}


def ablation_table(table: dict, ablations: Sequence[str]) -> tuple[list[str], list]:
    """``kwng`` (mean and range over its seeds) and each of ``ablations``: the final
    IC test accuracy and its difference to ``kwng``."""
    k = table["kwng"]["ill"]
    rows = [(f"`{m}`", f"{100 * table[m]['ill']['mean']:.1f}",
             f"{100 * (table[m]['ill']['mean'] - k['mean']):+.1f}") for m in ablations]
    rows.insert(0, ("`kwng` (3 seeds)", f"{100 * k['mean']:.1f}",
                    f"range {100 * k['min']:.1f}–{100 * k['max']:.1f}"))
    return ["variant", "IC test acc. (%)", "vs kwng"], rows


def _drops(table: dict, methods: Sequence[str]) -> dict[str, tuple[float, float]]:
    return {m: (table[m]["well"]["mean"], table[m]["ill"]["mean"]) for m in methods}


def conditioning_table(table: dict, methods: Sequence[str]) -> tuple[list[str], list]:
    """Per method: the final accuracy in WC and IC, the drop and IC over WC
    (``kwng_m20`` marked as cut after 3 of 6 epochs)."""
    rows = [(f"`{m}`" + (" (after 3 of 6 epochs)" if m == CUT else ""),
             f"{100 * w:.1f}", f"{100 * i:.1f}", f"{100 * (w - i):.1f}", f"{i / w:.2f}")
            for m, (w, i) in _drops(table, methods).items()]
    return ["method", "WC (%)", "IC (%)", "drop (points)", "IC / WC"], rows


def claim_lines(table: dict, methods: Sequence[str]) -> list[str]:
    """The paper's claims (i), (ii), (iii) and (v) as comparisons of the final
    accuracies of ``methods`` that ran all six epochs, one line each."""
    acc = _drops(table, [m for m in methods if m != CUT])
    well = {m: w for m, (w, _) in acc.items()}
    ill = {m: i for m, (_, i) in acc.items()}
    drop = {m: w - i for m, (w, i) in acc.items()}
    best_both = max(well, key=well.get) == max(ill, key=ill.get) == "kfac"
    k, s = table["kwng"]["ill"], table["sgd"]["ill"]
    return [
        f"(i)   well-conditioned accuracies span {100 * min(well.values()):.1f}-"
        f"{100 * max(well.values()):.1f}% (KWNG {100 * well['kwng']:.1f}%, "
        f"best {max(well, key=well.get)})",
        f"(ii)  Euclidean methods lose {100 * min(drop[m] for m in EUCLIDEAN):.1f}-"
        f"{100 * max(drop[m] for m in EUCLIDEAN):.1f} points",
        f"(iii) KWNG loses {100 * drop['kwng']:.1f} points and keeps "
        f"{ill['kwng'] / well['kwng']:.0%} of its well-conditioned accuracy;\n"
        f"      ill-conditioned KWNG seeds {100 * k['min']:.1f}-"
        f"{100 * k['max']:.1f}% vs SGD seeds {100 * s['min']:.1f}-"
        f"{100 * s['max']:.1f}%",
        f"(v)   KFAC loses {100 * drop['kfac']:.1f} points and is the best method "
        f"in both conditionings: {best_both}",
    ]
