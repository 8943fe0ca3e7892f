"""The amortized-step study read as time to accuracy.

KWNG with its kernel system rebuilt every ``k`` steps (``refresh_every``,
:mod:`kwng.engine.amortized`) ran at KWNG's selected steps of the Fig. 3 protocol
(:func:`kwng.experiments.cifar.plans.amortized_plan`, records under
``results/cifar/amortized``). Its runs are set here beside the protocol's runs at
their selected steps (exact KWNG is ``k = 1``), as seconds and epochs to a test
accuracy, on one clock: the Fig. 3 study's trainer timing where it exists
(:func:`kwng.experiments.cifar.fig3_time.time_runs`), else each run's own training
seconds, from the runs that had a GPU to themselves. The study's goal is then
checked: some ``k`` reaches 85 % test accuracy in the ill-conditioned case in fewer
training seconds than the best-tuned Adam while its final test accuracy stays within
exact KWNG's seed spread.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from kwng.experiments.cifar.fig3 import FIG3, grid_state, record_problem
from kwng.experiments.cifar.fig3_time import first_at, retime, step_ms, time_runs
from kwng.experiments.cifar.methods import AMORTIZED_METHODS, METHODS
from kwng.experiments.cifar.plans import AMORTIZED
from kwng.experiments.cifar.seed_study import AMORTIZED_SEEDS
from kwng.experiments.cifar.verdicts import alone_runs, seed_summary, selected_runs
from kwng.experiments.provenance import ResultFileError, read_json

__all__ = ["TARGETS", "TIME_HEADER", "amortized_runs", "clock_runs", "time_rows",
           "time_table", "time_values", "amortized_goal", "GOAL_HEADER", "goal_table",
           "goal_values", "seed_study_runs", "SEED_RUN_HEADER", "seed_run_table",
           "SEED_SUMMARY_HEADER", "seed_summary_rows", "seed_summary_table",
           "seed_bar", "bar_phrase"]

#: the test accuracies a row reports the time to
TARGETS = (0.80, 0.85)


def amortized_runs(p: dict, root: str | os.PathLike = AMORTIZED) -> dict[tuple, dict]:
    """``{(conditioning, method, seed): record}`` of every record under ``root``,
    finished or cut, each checked against the protocol ``p`` as the Fig. 3 records are
    (:func:`kwng.experiments.cifar.fig3.record_problem`). A record that breaks it raises
    :class:`~kwng.experiments.provenance.ResultFileError` naming the file."""
    out = {}
    for mp in sorted(Path(root).glob(f"lr*/{p['dataset']}/*/*/seed*/metrics.json")):
        problem = record_problem(p, mp, "")
        if problem:
            raise ResultFileError(f"{mp}: {problem}")
        out[(mp.parts[-4], mp.parts[-3], int(mp.parts[-2][4:]))] = read_json(mp)
    return out


def _mean(values: list) -> float | None:
    return None if not values or None in values else statistics.fmean(values)


def _row(cond: str, method: str, recs: list[dict], epochs: int) -> dict:
    """One method in one conditioning over its runs ``recs``: seconds and epochs to
    each of :data:`TARGETS` (mean over runs, ``None`` when a run never got there),
    the median training seconds of an epoch (the first excluded), the first epoch's
    seconds (compilation and graph capture fall there; ``steady_s_to_*`` counts that
    epoch at the median instead), the final test accuracy when
    every run finished, else ``None``, and the epochs the shortest run reached."""
    row = {"cond": cond, "method": method, "label": METHODS[method].label,
           "k": int(METHODS[method].settings.get("refresh_every", 1)),
           "lr": float(recs[0]["lr"]), "runs": len(recs),
           "epochs": min(len(r["epochs"]) for r in recs),
           "complete": all(len(r["epochs"]) == epochs for r in recs)}
    steps = [b["time_train"] - a["time_train"]
             for r in recs for a, b in zip(r["epochs"], r["epochs"][1:])]
    row["s_per_epoch"] = statistics.median(steps)
    row["first_epoch_s"] = statistics.fmean(r["epochs"][0]["time_train"] for r in recs)
    for t in TARGETS:
        hits = [first_at(r["epochs"], t) or {} for r in recs]
        s_to = _mean([h.get("time_train") for h in hits])
        row[f"s_to_{round(100 * t)}"] = s_to
        row[f"steady_s_to_{round(100 * t)}"] = (
            None if s_to is None else s_to - row["first_epoch_s"] + row["s_per_epoch"])
        row[f"epochs_to_{round(100 * t)}"] = _mean([h.get("epoch") for h in hits])
    finals = [r["epochs"][-1]["test_acc"] for r in recs]
    row["final"] = statistics.fmean(finals) if row["complete"] else None
    row["last"] = statistics.fmean(finals)
    return row


def clock_runs(p: dict, fig3_root: str | os.PathLike = FIG3,
               root: str | os.PathLike = AMORTIZED,
               clock: str = "auto") -> tuple[dict, dict, str]:
    """``(protocol_runs, amortized_runs, kind)`` on one clock, both keyed
    ``(conditioning, method, seed)``. ``clock`` ``"auto"``: the Fig. 3 study's
    trainer timing when its record exists (``kind`` ``"trainer-timing"``: every seed of
    a selected step, and each amortized run, put on its step times,
    :func:`kwng.experiments.cifar.fig3_time.time_runs`), else as ``"own"`` (``kind``
    ``"alone"``): each run's own training seconds, from the protocol's runs that had a
    GPU to themselves (:func:`kwng.experiments.cifar.verdicts.alone_runs`)."""
    if clock not in ("auto", "own"):
        raise ValueError(f"clock must be 'auto' or 'own', got {clock!r}")
    am = amortized_runs(p, root)
    base, source = (time_runs(p, fig3_root) if clock == "auto"
                    else (alone_runs(p, fig3_root), {"kind": "alone"}))
    if source["kind"] == "trainer-timing":
        am = retime(am, step_ms(read_json(source["path"]),
                                p["settings"].get("precision") or "bf16"))
    return base, am, source["kind"]


def time_rows(p: dict, fig3_root: str | os.PathLike = FIG3,
              root: str | os.PathLike = AMORTIZED, clock: str = "auto") -> list[dict]:
    """Per conditioning, the protocol's methods at their selected steps (once the
    selection is final) and then the amortized methods, in the order of
    :data:`~kwng.experiments.cifar.methods.AMORTIZED_METHODS`, on the clock of
    :func:`clock_runs`; one row each (:func:`_row`, with ``clock``, that clock's
    kind)."""
    epochs = int(p["settings"]["epochs"])
    alone, am, kind = clock_runs(p, fig3_root, root, clock)
    state, rows = grid_state(p, fig3_root), []
    for cond in ("ill", "well"):
        base = [m for m in p["order"] if state.get(f"{cond}/{m}", {}).get("final")
                and any(k[:2] == (cond, m) for k in alone)]
        for m in base:
            recs = [r for k, r in sorted(alone.items()) if k[:2] == (cond, m)]
            rows.append(_row(cond, m, recs, epochs))
        for m in AMORTIZED_METHODS:
            recs = [r for k, r in sorted(am.items()) if k[:2] == (cond, m)]
            if recs:
                rows.append(_row(cond, m, recs, epochs))
    return [{**r, "clock": kind} for r in rows]


def amortized_goal(p: dict, rows: list[dict], fig3_root: str | os.PathLike = FIG3,
                   cond: str = "ill") -> dict:
    """The study's goal in ``cond``: Adam's seconds to 85 %; exact KWNG's final test
    accuracy over its seeds (``mean``, ``range`` = max − min) and the floor ``mean −
    range`` (the ± of the protocol's verdict rule); per amortized method of ``rows``,
    ``faster`` (85 % in fewer seconds than Adam), ``within`` (final test accuracy at or
    above the floor; ``None`` while its run is unfinished) and ``met`` (both). ``met``
    at the top lists the methods that meet it."""
    if cond not in ("ill", "well"):
        raise ValueError(f"cond must be 'ill' or 'well', got {cond!r}")
    by = {r["method"]: r for r in rows if r["cond"] == cond}
    if "adam" not in by:
        raise ValueError(f"rows hold no Adam run alone on a GPU in {cond!r}")
    exact = seed_summary(p, fig3_root)[f"{cond}/kwng"]
    adam_s, floor = by["adam"]["s_to_85"], exact["mean"] - exact["range"]
    out = {"adam_s": adam_s, "kwng_mean": exact["mean"], "kwng_range": exact["range"],
           "kwng_seeds": exact["seeds"], "floor": floor, "methods": {}}
    for m in AMORTIZED_METHODS:
        if m not in by:
            continue
        r = by[m]
        faster = (r["s_to_85"] is not None
                  and (adam_s is None or r["s_to_85"] < adam_s))
        within = None if r["final"] is None else r["final"] >= floor
        out["methods"][m] = {"faster": faster, "within": within,
                             "met": bool(faster and within)}
    out["met"] = [m for m, v in out["methods"].items() if v["met"]]
    return out


def _sec(v: float | None) -> str:
    return "never" if v is None else f"{v:.0f}"


def _acc(r: dict) -> str:
    if r["final"] is not None:
        return f"{100 * r['final']:.1f}"
    return f"({100 * r['last']:.1f} at epoch {r['epochs']})"


#: the columns of :func:`time_table`
TIME_HEADER = ("cond.", "method", "step", "runs", "s / epoch", "s to 80 %", "s to 85 %",
               "epochs to 85 %", "final test %")


def time_table(rows: list[dict]) -> list[tuple]:
    """:func:`time_rows` as text, one tuple per row under :data:`TIME_HEADER`: "never"
    for a target a run did not reach; a cut run's final accuracy as its last one, in
    brackets, with its epoch."""
    return [(r["cond"], r["label"], f"{r['lr']:g}", r["runs"],
             f"{r['s_per_epoch']:.2f}", _sec(r["s_to_80"]), _sec(r["s_to_85"]),
             "never" if r["epochs_to_85"] is None else f"{r['epochs_to_85']:.1f}",
             _acc(r))
            for r in rows]


def time_values(rows: list[dict]) -> dict[str, str]:
    """The numbers a page quotes from :func:`time_rows`, as text, named
    ``<cond>_<method>_<field>`` (fields ``s_to_85``, ``steady_s_to_85``,
    ``epochs_to_85``, ``spe`` the seconds per epoch, ``final``), plus ``first_max``,
    ``spe_min`` and ``spe_max`` over every row."""
    out = {"first_max": f"{max(r['first_epoch_s'] for r in rows):.0f}",
           "spe_min": f"{min(r['s_per_epoch'] for r in rows):.1f}",
           "spe_max": f"{max(r['s_per_epoch'] for r in rows):.1f}"}
    for r in rows:
        key = f"{r['cond']}_{r['method']}"
        out[f"{key}_s_to_85"] = _sec(r["s_to_85"])
        out[f"{key}_steady_s_to_85"] = _sec(r["steady_s_to_85"])
        out[f"{key}_epochs_to_85"] = ("never" if r["epochs_to_85"] is None
                                      else f"{r['epochs_to_85']:.1f}")
        out[f"{key}_spe"] = f"{r['s_per_epoch']:.2f}"
        out[f"{key}_final"] = _acc(r)
    return out


#: the columns of :func:`goal_table`
GOAL_HEADER = ("method", "85 % before Adam", "final within KWNG's spread", "goal met")


def _yes(v: bool | None) -> str:
    return "unknown (cut)" if v is None else "yes" if v else "no"


def goal_table(goal: dict) -> list[tuple]:
    """:func:`amortized_goal`'s methods as rows under :data:`GOAL_HEADER`."""
    return [(m, _yes(v["faster"]), _yes(v["within"]), _yes(v["met"]))
            for m, v in goal["methods"].items()]


def goal_values(goal: dict, rows: list[dict]) -> dict[str, str]:
    """The numbers the chapter quotes from :func:`amortized_goal` (``goal_adam``,
    ``goal_mean``, ``goal_range``, ``goal_seeds``, ``goal_floor``, ``goal_met``) and
    from :func:`time_rows` ``rows``: ``k_spread``, the span in points of the final
    test accuracies of the ill-conditioned KWNG runs with ``k > 1``."""
    finals = [r["final"] for r in rows if r["cond"] == "ill" and r["k"] > 1
              and r["method"].startswith("kwng") and r["final"] is not None]
    return {"goal_adam": f"{goal['adam_s']:.0f}",
            "goal_mean": f"{100 * goal['kwng_mean']:.1f}",
            "goal_range": f"{100 * goal['kwng_range']:.2f}",
            "goal_seeds": str(goal["kwng_seeds"]),
            "goal_floor": f"{100 * goal['floor']:.2f}",
            "goal_met": ", ".join(f"`{m}`" for m in goal["met"]) or "none",
            "k_spread": f"{100 * (max(finals) - min(finals)):.1f}" if finals else "–"}


# ------------------------------------------------------------------ the seed study
def seed_study_runs(p: dict, fig3_root: str | os.PathLike = FIG3,
                    root: str | os.PathLike = AMORTIZED_SEEDS,
                    timing_path: str | os.PathLike | None = None) -> list[dict]:
    """Every run of the seed study under ``root`` (finished or not), with the Fig. 3
    study's finished runs of Adam and exact KWNG at their selected steps beside them
    (``source`` ``"fig3"``), one dict a run: ``cond``, ``method``, ``seed``,
    ``source``, ``epochs`` run, ``final`` (test accuracy at the last epoch run),
    ``complete``, ``stalled`` (a finished run below the plan's ``stall_below``),
    ``epochs_to_80``/``_85`` and ``s_to_80``/``_85`` (``None``: never reached) on the
    Fig. 3 trainer timing's clock (``clock`` ``"trainer-timing"``) where it timed the
    method, else the run's own training seconds (``"own"``, the GPU it ran on,
    ``device``)."""
    epochs, root = int(p["settings"]["epochs"]), Path(root)
    stall = float(read_json(root / "plan.json")["stall_below"])
    runs = {**{(c, m, s): (r, "study") for (c, m, s), r in
               amortized_runs(p, root).items()},
            **{k: (r, "fig3") for k, r in selected_runs(p, fig3_root).items()
               if k[1] in ("adam", "kwng")}}
    base, source = time_runs(p, fig3_root, timing_path)
    ms = (step_ms(read_json(source["path"]), p["settings"].get("precision") or "bf16")
          if source["kind"] == "trainer-timing" else {})
    out = []
    for (cond, m, seed), (rec, src) in sorted(
            runs.items(), key=lambda kv: (kv[0][0] != "ill", METHODS[kv[0][1]].order,
                                          kv[0][2])):
        rows = rec["epochs"]
        clocked = retime({(cond, m, seed): rec}, ms).get((cond, m, seed))
        row = {"cond": cond, "method": m, "seed": seed, "source": src,
               "epochs": len(rows), "final": float(rows[-1]["test_acc"]),
               "complete": bool(rec.get("complete")) and len(rows) == epochs,
               "clock": "trainer-timing" if clocked else "own",
               "device": _device(root if src == "study" else None, p, rec, cond, m,
                                 seed)}
        row["stalled"] = row["complete"] and row["final"] < stall
        for t in TARGETS:
            hit = first_at(rows, t) or {}
            hit_c = first_at((clocked or rec)["epochs"], t) or {}
            row[f"epochs_to_{round(100 * t)}"] = hit.get("epoch")
            row[f"s_to_{round(100 * t)}"] = hit_c.get("time_train")
        out.append(row)
    return out


def _device(root: Path | None, p: dict, rec: dict, cond: str, m: str,
            seed: int) -> str:
    """The GPU a run of the study under ``root`` trained on (its provenance);
    ``"fig3"`` for a Fig. 3 run (``root`` ``None``)."""
    if root is None:
        return "fig3"
    prov = (root / f"lr{float(rec['lr']):g}" / p["dataset"] / cond / m / f"seed{seed}"
            / "provenance.json")
    return str(read_json(prov).get("device", "unknown")) if prov.exists() else "unknown"


#: the columns of :func:`seed_run_table`
SEED_RUN_HEADER = ("cond.", "method", "seed", "from", "final test %", "stall",
                   "epochs to 85 %", "s to 85 %", "clock")


def seed_run_table(runs: list[dict]) -> list[tuple]:
    """:func:`seed_study_runs` as text, every run, stalls marked."""
    return [(r["cond"], METHODS[r["method"]].label, r["seed"], r["source"],
             f"{100 * r['final']:.1f}" + ("" if r["complete"] else
                                           f" (epoch {r['epochs']})"),
             "STALL" if r["stalled"] else "", _num(r["epochs_to_85"], "{:d}"),
             _sec(r["s_to_85"]), r["clock"]) for r in runs]


def _num(v, fmt: str) -> str:
    return "never" if v is None else fmt.format(v)


def seed_summary_rows(runs: list[dict]) -> list[dict]:
    """Per conditioning and method, over its finished runs: ``runs``, ``stalls``, the
    final test accuracy's ``mean``, ``min`` and ``max``, and for 80 % and 85 % the
    ``median`` and ``worst`` seconds (``None`` for the worst when a run never got
    there), in the order the runs come."""
    keys = list(dict.fromkeys((r["cond"], r["method"]) for r in runs))
    out = []
    for cond, m in keys:
        rs = [r for r in runs
              if (r["cond"], r["method"]) == (cond, m) and r["complete"]]
        if not rs:
            continue
        finals = [r["final"] for r in rs]
        row = {"cond": cond, "method": m, "runs": len(rs),
               "stalls": sum(r["stalled"] for r in rs),
               "mean": statistics.fmean(finals), "min": min(finals), "max": max(finals),
               "clock": ", ".join(sorted({r["clock"] for r in rs}))}
        for t in (80, 85):
            got = [r[f"s_to_{t}"] for r in rs]
            hit = [v for v in got if v is not None]
            row[f"median_s_to_{t}"] = statistics.median(hit) if hit else None
            row[f"worst_s_to_{t}"] = None if None in got else max(got)
        out.append(row)
    return out


#: the columns of :func:`seed_summary_table`
SEED_SUMMARY_HEADER = ("cond.", "method", "runs", "stalls", "final test % (mean)",
                       "range", "s to 80 % (median / worst)",
                       "s to 85 % (median / worst)")


def seed_summary_table(rows: list[dict]) -> list[tuple]:
    """:func:`seed_summary_rows` as text."""
    return [(r["cond"], METHODS[r["method"]].label, r["runs"], r["stalls"],
             f"{100 * r['mean']:.1f}", f"{100 * r['min']:.1f}–{100 * r['max']:.1f}",
             f"{_sec(r['median_s_to_80'])} / {_sec(r['worst_s_to_80'])}",
             f"{_sec(r['median_s_to_85'])} / {_sec(r['worst_s_to_85'])}")
            for r in rows]


#: the recommendation's bar: runs per conditioning, the final accuracy every
#: ill-conditioned run must reach, and the target reached before Adam's median
BAR = {"ill": 5, "well": 3, "final_ill": 0.875, "target": 85}


def seed_bar(runs: list[dict]) -> dict[str, dict]:
    """Per method of the study with ``k > 1`` (and the guarded ones): whether it meets
    the recommendation's bar (:data:`BAR`): at least 5 ill- and 3 well-conditioned
    finished runs, no stall among them, every ill-conditioned run at or above 87.5 %
    final, and every ill-conditioned run at 85 % before the median of Adam's
    ill-conditioned runs on the same clock. ``met`` is ``None`` while runs are missing
    (``missing`` says how many), else ``True`` or ``False`` with the ``failed``
    conditions named."""
    done = [r for r in runs if r["complete"]]
    adam = [r["s_to_85"] for r in done if r["method"] == "adam" and r["cond"] == "ill"
            and r["clock"] == "trainer-timing" and r["s_to_85"] is not None]
    adam_median = statistics.median(adam) if adam else None
    out = {}
    for m in dict.fromkeys(r["method"] for r in done):
        if METHODS[m].settings.get("refresh_every", 1) == 1:
            continue
        ill = [r for r in done if r["method"] == m and r["cond"] == "ill"]
        well = [r for r in done if r["method"] == m and r["cond"] == "well"]
        failed = []
        if any(r["stalled"] for r in ill + well):
            failed.append("a run stalled")
        if any(r["final"] < BAR["final_ill"] for r in ill):
            failed.append(f"an ill-conditioned run ended below {BAR['final_ill']:.1%}")
        if adam_median is None or any(
                r["clock"] != "trainer-timing" or r["s_to_85"] is None
                or r["s_to_85"] >= adam_median for r in ill):
            failed.append("an ill-conditioned run reached 85 % after Adam's median "
                          "(or never, or on another clock)")
        missing = max(0, BAR["ill"] - len(ill)) + max(0, BAR["well"] - len(well))
        out[m] = {"ill_runs": len(ill), "well_runs": len(well), "missing": missing,
                  "adam_median_s": adam_median, "failed": failed,
                  "met": False if failed else (None if missing else True)}
    return out


def bar_phrase(bar: dict[str, dict]) -> str:
    """:func:`seed_bar` in one sentence: the settings that meet the bar (with their run
    counts), else why none does yet, per setting."""
    met = [m for m, v in bar.items() if v["met"] is True]
    if met:
        return ("Settings that meet the bar: " + ", ".join(
            f"{METHODS[m].label} ({bar[m]['ill_runs']} ill- and {bar[m]['well_runs']} "
            "well-conditioned runs, none stalled)" for m in met) + ".")
    parts = []
    for m, v in bar.items():
        runs = f"{v['ill_runs']} ill- and {v['well_runs']} well-conditioned runs"
        why = ("; ".join(v["failed"]) if v["met"] is False
               else f"{v['missing']} more runs needed")
        parts.append(f"{METHODS[m].label}: {runs}, {why}")
    return "No setting meets the bar: " + "; ".join(parts) + "."
