"""The numbers behind the claims ledger (book chapter :ref:`claims`): for each claim of
the paper, the figures that decide it, read from the committed result files under
``results/``, and the rule that turns them into a verdict. Each function takes the
results folder (``results/`` of the repository by default) and returns plain numbers
and words, so the ledger updates itself when a record changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from studies.authors100.records import load_authors100
from studies.authors100.verdict import authors100_verdict
from studies.cifar.methods import CLAIM_ALL, METHODS
from studies.cifar.records import (
    at_epoch,
    epoch_seconds,
    final_accuracy_table,
    time_to_accuracy,
)
from studies.cifar.results import load_results
from studies.claim_suite.verdict import claim_verdict
from studies.fig3 import clocks as fig3_time
from studies.fig3 import protocol as fig3
from studies.fig3.amortized.readings import time_rows
from studies.fig3.amortized.seed_study import STALL_BELOW
from studies.fig3.plan import queue_left, queue_phrase
from studies.fig3.verdicts import ablation_rows, fig3_verdicts, seed_summary, settled
from studies.kit import paths
from studies.kit.wording import fixed, name_list
from studies.study6.records import study6_table
from studies.toy.setup import load_flow, load_rows, summarise

__all__ = ["RESULTS", "relerr_numbers", "bandwidth_numbers", "flow_numbers",
           "cifar_context", "cifar_fig3_verdict", "synthetic_verdicts",
           "mixed_verdict", "ablation_verdict", "ABLATION_WORSE", "momentum_verdict",
           "time_verdict", "flat"]

RESULTS = paths.RESULTS
"""The committed results folder, relative to the repository root."""


def mixed_verdict(oks: dict[str, bool]) -> str:
    """``"holds"`` if every case passes, ``"fails"`` if none does, else ``"partly"``."""
    n = sum(bool(v) for v in oks.values())
    return "holds" if n == len(oks) else "fails" if n == 0 else "partly"


#: the ablations that the paper's Fig. 7 says do worse than KWNG, the other dampings
#: (§4.2, "a drop in performance when a different choice of damping is used") and the
#: diagonal preconditioners ("doesn't match the performance of KWNG")
ABLATION_WORSE = ("kwng_D_identity", "kwng_D_T", "kwng_diag_T", "diag_Ttilde")


def ablation_verdict(rows: list[dict], stall_below: float = STALL_BELOW) -> dict:
    """The Fig. 7 claim from the ablation rows of the Fig. 3 protocol
    (:func:`studies.fig3.verdicts.ablation_rows`). A variant some of whose runs
    stalled (final test accuracy below ``stall_below``) and others not is
    ``"unstable"``; else it lies ``"below"`` or ``"above"`` KWNG when its mean final
    test accuracy differs from KWNG's by more than the larger seed range (0 for one
    run), else ``"level"``. The claim is :func:`mixed_verdict` of "every variant of
    :data:`ABLATION_WORSE` lies below", ``"pending"`` until all of them have run."""
    by = {r["method"]: r for r in rows}
    if not by.get("kwng", {}).get("runs") or any(
            not by.get(m, {}).get("runs") for m in ABLATION_WORSE):
        return {"verdict": "pending", "side": {}}
    kw, side = by["kwng"], {}
    for m, r in by.items():
        if m != "kwng" and r["runs"]:
            d, tol = r["test"] - kw["test"], max(r["range"], kw["range"])
            low = [v < stall_below for v in r["finals"]]
            side[m] = ("unstable" if any(low) and not all(low) else "level"
                       if abs(d) <= tol else "above" if d > 0 else "below")
    return {"verdict": mixed_verdict({m: side[m] == "below" for m in ABLATION_WORSE}),
            "side": side}


def momentum_verdict(summ: dict) -> dict:
    """The §4.2 claim "using Momentum leads to an improved performance in the (WC)
    case", from :func:`studies.fig3.verdicts.seed_summary`: ``well/kwng_mom``
    against ``well/kwng``, each at its selected step. ``gap`` is momentum's mean final
    test accuracy minus KWNG's (points), ``tol`` the larger of their seed ranges; the
    verdict is ``"holds"`` if ``gap > tol``, ``"fails"`` if ``gap < -tol``, else
    ``"within spread"``, and ``"pending"`` until both selections are final with all
    their seeds. ``gap_shown`` is the gap of the two means as pages print them (to 0.1
    point), the number a page quotes beside them."""
    a, b = summ.get("well/kwng_mom"), summ.get("well/kwng")
    if not a or not b or not (settled(a) and settled(b)):
        return {"verdict": "pending"}
    gap, tol = 100 * (a["mean"] - b["mean"]), 100 * max(a["range"], b["range"])
    word = "holds" if gap > tol else "fails" if gap < -tol else "within spread"
    shown = float(f"{100 * a['mean']:.1f}") - float(f"{100 * b['mean']:.1f}")
    return {"verdict": word, "gap": gap, "tol": tol, "gap_shown": shown}


def time_verdict(tta: dict, fig3_ver: dict, target: float = 0.85) -> dict:
    """The §4.2 claim "the time cost is also in favor of KWNG" (the paper's
    accuracy-against-time figure), read where the paper makes its case, the
    ill-conditioned network: per baseline, ``"holds"`` if KWNG reaches ``target``
    test accuracy in fewer training seconds than the baseline (one that never
    reaches it is slower), ``"fails"`` if the baseline gets there first, and
    ``"pending"`` while the baseline's Fig. 3 verdict (``fig3_ver``, from
    :func:`studies.fig3.verdicts.fig3_verdicts`) is. ``tta`` comes from
    :func:`studies.fig3.clocks.seconds_to_accuracy` (the time
    figure's clock). ``verdict``: :func:`mixed_verdict` once no baseline is pending;
    ``seconds``: each method's mean seconds to ``target`` in IC (None: never)."""
    if not 0 < target < 1:
        raise ValueError(f"target must lie in (0, 1), got {target}")
    sec = {k.split("/")[1]: v["to"].get(target) for k, v in tta.items()
           if k.startswith("ill/")}
    kw, per = sec.get("kwng"), {}
    for m, v in fig3_ver.items():
        if v["verdict"] == "pending" or m not in sec or kw is None:
            per[m] = "pending"
        else:
            per[m] = "holds" if sec[m] is None or sec[m] > kw else "fails"
    word = "pending" if "pending" in per.values() else mixed_verdict(
        {m: w == "holds" for m, w in per.items()})
    return {"per_baseline": per, "verdict": word, "seconds": sec,
            "by_baseline": _phrase(per)}


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def relerr_numbers(root: str | os.PathLike = RESULTS) -> dict:
    """Figs. 1 and 4 (error against ``N`` and ``M``): per model, at the largest ``d``
    and ``N``, the median and mean error, the slope of the mean error in ``N`` (the
    rule ``M = ⌊d√N⌋``), the largest slope over all ``d``, the median over ``d``, and
    the smallest ``M`` within a factor 1.5 of the best mean error at the smallest and
    largest ``d`` (``thr_lo``, ``thr_hi``; ``M_max`` the largest ``M`` of the grid).
    Verdicts: ``falls`` (the mean error falls with ``N`` at every ``d``) and
    ``plateau`` (a threshold inside the grid at every ``d``)."""
    root = Path(root) / "relerr"
    cfg = json.loads((root / "config.json").read_text())
    out: dict = {"models": {}}
    for m in cfg["models"]:
        rows = load_rows(root / f"{m}.csv")
        byN, byM = summarise(rows, "N", "N"), summarise(rows, "M", "M")
        dmax, dmin = max(byN), min(byN)
        slopes = {d: _slope(s["x"], s["mean"]) for d, s in byN.items()}
        thr = {d: float(s["x"][np.argmax(s["mean"] <= 1.5 * s["mean"].min())])
               for d, s in byM.items()}
        med_d = [float(byN[d]["median"][-1]) for d in byN]
        M_max = float(max(byM[dmax]["x"]))
        out["models"][m] = {
            "median": float(byN[dmax]["median"][-1]),
            "mean": float(byN[dmax]["mean"][-1]),
            "slope": slopes[dmax], "slope_worst": max(slopes.values()),
            "median_dmin": min(med_d), "median_dmax": max(med_d),
            "thr_lo": thr[min(byM)], "thr_hi": thr[max(byM)], "M_max": M_max,
            "falls": all(s < 0 for s in slopes.values()),
            "plateau": all(t < M_max for t in thr.values()),
        }
        out.update(d_max=dmax, d_min=dmin, N_max=float(max(byN[dmax]["x"])))
    return out


def bandwidth_numbers(root: str | os.PathLike = RESULTS,
                      factor: float = 2.0, decades: float = 1.0) -> dict:
    """Fig. 5 (error against a fixed bandwidth ``σ``): per model, at the largest ``d``,
    the best mean error, its ``σ``, the range of ``σ`` whose mean error is within
    ``factor`` of it, and ``robust``: that range spans at least ``decades`` decades.
    ``verdict`` by :func:`mixed_verdict` over the models."""
    root = Path(root) / "bandwidth"
    cfg = json.loads((root / "config.json").read_text())
    out: dict = {"models": {}}
    for m in cfg["models"]:
        s = summarise(load_rows(root / f"{m}.csv"), "sigma", "bandwidth_spec")
        dm = max(s)
        mean, x = s[dm]["mean"], s[dm]["x"]
        good = x[mean <= factor * mean.min()]
        out["models"][m] = {
            "best": float(mean.min()), "best_sigma": float(x[np.argmin(mean)]),
            "lo": float(good.min()), "hi": float(good.max()),
            "robust": bool(np.log10(good.max() / good.min()) >= decades)}
        out["d"] = dm
    out["verdict"] = mixed_verdict({m: v["robust"] for m, v in out["models"].items()})
    return out


def flow_numbers(root: str | os.PathLike = RESULTS) -> dict:
    """Fig. 2 (the W2² flow): per method the last finite iteration and loss, whether it
    diverged, WNG's mean loss ratio per step over its first ten steps, EG's loss after
    as many iterations over its first loss; the settings of the KWNG variants; and
    from the flow study the variants whose KWNG flow never diverged."""
    root = Path(root)
    flow = load_flow(root / "flow")
    cfg = flow["provenance"]["config"]
    out: dict = {"methods": {}, "variants": cfg["kwng_variants"]}
    for m, loss in flow["loss"].items():
        fin = np.flatnonzero(np.isfinite(loss))
        out["methods"][m] = {"last": int(fin[-1]), "loss": float(loss[fin[-1]]),
                             "first": float(loss[0]),
                             "diverged": not bool(np.isfinite(loss).all())}
    wng, eg = flow["loss"]["wng"], flow["loss"]["eg"]
    out["wng_rate"] = float(np.exp(np.mean(np.log(wng[1:11] / wng[:10]))))
    out["eg_ratio"] = float(eg[-1] / eg[0])
    out["iterations"] = len(wng) - 1
    study = json.loads((root / "flow_study" / "flow_study.json").read_text())
    out["study_total"] = len(study["rows"])
    out["study_tracks"] = sorted(n for n, r in study["rows"].items()
                                 if not r["kwng"]["stopped_at"])
    return out


def _claim_suite(root: Path) -> dict:
    """The 30-epoch claim suite: its verdict, the WC → IC drop per method and the
    ``diag_Ttilde`` and ``kwng`` IC accuracies."""
    claim = load_results(root / "cifar" / "claim", "cifar10")
    at_E = at_epoch(claim, min(len(r["epochs"]) for r in claim.values()))
    v = claim_verdict(at_E)
    t = final_accuracy_table(at_E, methods=CLAIM_ALL)
    return {"holds": v["holds"],
            "drops": {m: 100 * d for m, d in v["drops"].items() if d is not None},
            "kwng_ill": 100 * v["kwng_ill"], "kwng_well": 100 * v["kwng_well"],
            "diag_ill": 100 * t["diag_Ttilde"]["ill"]["mean"]}


def _authors_horizon(root: Path) -> dict:
    """The 100-epoch study: its verdict, the final accuracies the ledger quotes and
    the seconds to 80 % test accuracy of ``kwng`` (IC, step 10) and SGD (WC)."""
    a100 = root / "cifar" / "authors100"
    rec = load_authors100(a100)
    v = authors100_verdict(rec)
    fin = {k: 100 * r["epochs"][-1]["test_acc"] for k, r in rec.items()}
    tt = json.loads((a100 / "timing" / "trainer_timing.json").read_text())
    sec = epoch_seconds(tt)
    tta = {(r["key"][1], r["key"][2], r["key"][0]): r["seconds_0.8"]
           for r in time_to_accuracy(rec, sec)
           if r["key"][3] == 0}
    eu = [k for k in fin if k[1] == "ill" and k[2] in ("sgd", "adam", "kfac")]
    return {"holds": v["holds"], "kwng_ill": 100 * v["kwng_ill"],
            "kwng_well": 100 * v["kwng_well"], "sgd_ill": 100 * v["sgd_ill"],
            "best_euclid_ill": max(fin[k] for k in eu),
            "diag_ill": fin[("lr10", "ill", "diag_Ttilde", 0)],
            "kfac_ill": max(fin[k] for k in eu if k[2] == "kfac"),
            "tta_kwng_ill": tta[("ill", "kwng", "lr10")],
            "tta_sgd_well": tta[("well", "sgd", "lr0.1")],
            "epoch_ratio": sec["kwng"] / sec["sgd"]}


def _six_epoch(root: Path) -> dict:
    """The earlier 6-epoch study: ``M = 20`` against ``M = 5`` after epoch 3 (IC, the
    seeds' range of ``M = 5``), KWNG with momentum against KWNG in WC, and the
    smallest gap between a diagonal or other-damping ablation and KWNG in IC."""
    res = load_results(root / "cifar", "cifar10")

    def acc(c: str, m: str, e: int | None = None) -> list[float]:
        return [100 * r["epochs"][-1 if e is None else e - 1]["test_acc"]
                for (cc, mm, _), r in sorted(res.items()) if (cc, mm) == (c, m)]

    k5 = acc("ill", "kwng", 3)
    return {"m20_ill_3": acc("ill", "kwng_m20", 3)[0],
            "m5_ill_3_lo": min(k5), "m5_ill_3_hi": max(k5),
            "mom_well": acc("well", "kwng_momentum")[0],
            "kwng_well": float(np.mean(acc("well", "kwng"))),
            "methods": len({m for (_, m, _) in res
                            if m in study6_table()["main_methods"]})}


def cifar_context(root: str | os.PathLike = RESULTS) -> dict:
    """The superseded CIFAR studies the ledger cites next to the pending verdict:
    ``claim`` (30 epochs), ``a100`` (100 epochs) and ``six`` (6 epochs)."""
    root = Path(root)
    return {"claim": _claim_suite(root), "a100": _authors_horizon(root),
            "six": _six_epoch(root)}


def cifar_fig3_verdict(root: str | os.PathLike = RESULTS) -> dict:
    """The Fig. 3 protocol's verdicts so far
    (:func:`studies.fig3.verdicts.fig3_verdicts`): ``per_baseline``, the
    counts by verdict, the queue left, ``verdict``: ``"pending"`` while any
    baseline is pending, else ``by_baseline``, and
    ``by_baseline``: every baseline's verdict so far in one phrase ("holds against
    SGD and Adam; pending against EKFAC"), ``queue_phrase`` (the queue in words,
    :func:`studies.fig3.plan.queue_phrase`), ``so_far``: the mean final test
    accuracy (%) at each selected step so far (``"<cond>_<method>"``) and of each
    ablation that has run (``"ab_<method>"``), ``kfac_drop``: whether KFAC drops from
    WC to IC by more than its seed spread (§4.2), ``ablation_verdict``
    (:func:`ablation_verdict` of ``ablation_rows``, the rows it reads), ``momentum``
    (:func:`momentum_verdict`), ``time`` and ``time_by_baseline`` (:func:`time_verdict`
    at 85 %), ``time_thresholds`` (who is faster at each threshold from 70 % to the
    best final accuracy in IC, :func:`~studies.fig3.clocks.thresholds_phrase`),
    ``time_clock`` (where its seconds come from, :func:`~studies.fig3.clocks.time_runs`)
    ``time_s85``: the mean training seconds to 85 % test accuracy in IC of each
    method that gets there, the amortized study's (``k > 1``, one seed each,
    :func:`~studies.fig3.amortized.readings.time_rows`, same clock) included. The
    verdict and the queue are the paper's baselines'; the baselines an amendment added
    beyond the paper's (``p["added"]``) have their own ``beyond`` (verdict per method),
    ``beyond_phrase`` and ``beyond_queue``."""
    base = Path(root) / "cifar" / "fig3"
    p = fig3.load_protocol(base / "protocol.json")
    every, added = fig3_verdicts(p, base), set(p.get("added", []))
    ver = {m: v for m, v in every.items() if m not in added}  # the paper's baselines
    counts: dict[str, int] = {}
    for v in ver.values():
        counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
    by_baseline = _phrase({m: v["verdict"] for m, v in ver.items()})
    word = "pending" if "pending" in counts else by_baseline
    paper = [m for m in p["order"] if m not in added]
    timed, clock = fig3_time.time_runs(p, base)
    tv = time_verdict(fig3_time.seconds_to_accuracy(p, base, runs=timed), ver)
    curve = fig3_time.time_to_thresholds(p, base, runs=timed)
    queue = queue_left(p, base, methods=paper)
    summ = seed_summary(p, base)
    so_far = {k.replace("/", "_"): 100 * v["mean"] for k, v in summ.items()}
    ab = ablation_rows(p, base)
    so_far.update({f"ab_{r['method']}": 100 * r["test"] for r in ab if r["runs"]})
    kf = ver.get("kfac", {"verdict": "pending"})
    kfac_drop = "pending" if kf["verdict"] == "pending" else (
        "holds" if kf["drop"] > kf["spread"] else "fails")
    return {"per_baseline": ver, "counts": counts, "verdict": word, "queue": queue,
            "queue_phrase": queue_phrase(queue),
            "so_far": so_far, "kfac_drop": kfac_drop,
            "ablation_verdict": ablation_verdict(ab)["verdict"], "ablation_rows": ab,
            "by_baseline": by_baseline,
            "momentum": momentum_verdict(summ), "time": tv["verdict"],
            "time_by_baseline": tv["by_baseline"],
            "time_thresholds": fig3_time.thresholds_phrase(curve),
            "time_clock": f"one trainer-timing call on {clock['device']}"
            if clock["kind"] == "trainer-timing"
            else "the runs that had a GPU alone, H100s of several rounds",
            "time_s85": {m: s for m, s in tv["seconds"].items() if s is not None} | {
                r["method"]: r["s_to_85"] for r in time_rows(
                    p, base, base.parent / "amortized") if r["cond"] == "ill"
                and r["k"] > 1 and r["s_to_85"] is not None},
            "settled": word != "pending" and not any(queue.values()),
            **_beyond(p, base, every)}


def _beyond(p: dict, base: Path, every: dict) -> dict:
    """The baselines an amendment added beyond the paper's: verdict per method, in one
    phrase, and their runs left in the queue."""
    added = list(p.get("added", []))
    beyond = {m: v for m, v in every.items() if m in added}
    return {"beyond": beyond,
            "beyond_phrase": _phrase({m: v["verdict"] for m, v in beyond.items()}),
            "beyond_queue": queue_left(p, base, methods=added)}


def _phrase(per: dict[str, str]) -> str:
    """Per-method verdicts in one phrase: "holds against SGD and Adam; pending
    against EKFAC" (methods by their labels, verdicts in alphabetical order)."""
    by: dict[str, list[str]] = {}
    for m, w in per.items():
        by.setdefault(w, []).append(METHODS[m].label)
    return "; ".join(f"{w} against {name_list(by[w])}" for w in sorted(by))


def flat(d: dict, prefix: str, digits: int | None = None) -> dict[str, object]:
    """``d`` flattened into ``prefix_key_subkey`` names (the ledger's glue names), lists
    left out; ``digits``: floats as :func:`~studies.kit.wording.fixed` text."""
    out: dict[str, object] = {}
    for k, v in d.items():
        name = f"{prefix}_{k}".replace(" ", "_")
        if isinstance(v, dict):
            out.update(flat(v, name, digits))
        elif isinstance(v, float) and digits is not None:
            out[name] = fixed(v, digits)
        elif not isinstance(v, list):
            out[name] = v
    return out


def synthetic_verdicts(relerr: dict, bandwidth: dict, flow: dict) -> dict[str, str]:
    """The ledger's verdicts on the synthetic claims, from the numbers of
    :func:`relerr_numbers`, :func:`bandwidth_numbers` and :func:`flow_numbers`:

    * ``fig1_N``: the sphere's mean error falls with ``N`` at every ``d``;
    * ``fig1_d``: under ``M = ⌊d√N⌋`` the sphere's median error at the largest ``N``
      varies by at most a factor 2 over ``d``;
    * ``fig1_M``: a threshold in ``M`` inside the grid, at the smallest and the
      largest ``d`` (:func:`mixed_verdict` over the two);
    * ``fig4``: per normal and log-normal model, the error falls with ``N`` and its
      mean at the largest ``d`` and ``N`` is below 1 (mixed over the two);
    * ``fig5``: :func:`bandwidth_numbers`' verdict;
    * ``fig2_wng``: WNG ends below EG after the same iterations;
    * ``fig2_kwng``: the KWNG variants that never diverged (mixed over them)."""
    sph = relerr["models"]["sphere"]
    fm = flow["methods"]
    return {
        "fig1_N": "holds" if sph["falls"] else "fails",
        "fig1_d": "holds" if sph["median_dmax"] <= 2 * sph["median_dmin"]
        else "fails",
        "fig1_M": mixed_verdict({"lo": sph["thr_lo"] < sph["M_max"],
                                 "hi": sph["thr_hi"] < sph["M_max"]}),
        "fig4": mixed_verdict({m: relerr["models"][m]["falls"]
                               and relerr["models"][m]["mean"] < 1
                               for m in ("normal", "lognormal")}),
        "fig5": bandwidth["verdict"],
        "fig2_wng": "holds" if fm["wng"]["loss"] < fm["eg"]["loss"] else "fails",
        "fig2_kwng": mixed_verdict({v: not fm[v]["diverged"]
                                    for v in flow["variants"]}),
    }
