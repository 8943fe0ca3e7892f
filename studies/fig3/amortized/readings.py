"""The amortized-step study read as time to accuracy.

KWNG with its kernel system rebuilt every ``k`` steps (``refresh_every``,
:class:`kwng.engine.precond.SystemCache`) ran at KWNG's selected steps of the Fig. 3
protocol (:func:`studies.fig3.amortized.plan.amortized_plan`, records under
``results/cifar/amortized``). Its runs are set here beside the protocol's runs at
their selected steps (exact KWNG is ``k = 1``), as seconds and epochs to a test
accuracy, on one clock: the Fig. 3 study's trainer timing where it exists
(:func:`studies.fig3.clocks.time_runs`), else each run's own training
seconds, from the runs that had a GPU to themselves. The study's goal is then
checked: some ``k`` reaches 85 % test accuracy in the ill-conditioned case in fewer
training seconds than the best-tuned Adam while its final test accuracy stays within
exact KWNG's seed spread.
"""

from __future__ import annotations

import os
import statistics

from studies.cifar.methods import METHODS
from studies.fig3.amortized.seed_study import (
    AMORTIZED,
    AMORTIZED_METHODS,
    STALL_BELOW,
    amortized_runs,
)
from studies.fig3.clocks import first_at, retime, step_ms, time_runs
from studies.fig3.protocol import FIG3, grid_state
from studies.fig3.verdicts import alone_runs, seed_summary
from studies.kit.provenance import read_json
from studies.kit.wording import name_list

__all__ = ["TARGETS", "TIME_HEADER", "TIME_ANSWER", "clock_runs", "time_rows",
           "time_table", "time_values", "amortized_goal", "GOAL_HEADER", "goal_table",
           "goal_values", "guard_values"]

#: the test accuracies a row reports the time to
TARGETS = (0.80, 0.85)


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
    :func:`studies.fig3.clocks.time_runs`), else as ``"own"`` (``kind``
    ``"alone"``): each run's own training seconds, from the protocol's runs that had a
    GPU to themselves (:func:`studies.fig3.verdicts.alone_runs`)."""
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
    :data:`~studies.fig3.amortized.seed_study.AMORTIZED_METHODS`, on the clock of
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


#: the columns of :func:`time_table`, the answers (:data:`TIME_ANSWER`) first after
#: the row's name, so that a phone shows them without scrolling the table
TIME_HEADER = ("cond.", "method", "s to 85 %", "epochs to 85 %", "final test %",
               "s to 80 %", "s / epoch", "step", "runs")
#: the columns of :data:`TIME_HEADER` that answer the study's question
TIME_ANSWER = ("s to 85 %", "epochs to 85 %", "final test %")


def time_table(rows: list[dict]) -> list[tuple]:
    """:func:`time_rows` as text, one tuple per row under :data:`TIME_HEADER`: "never"
    for a target a run did not reach; a cut run's final accuracy as its last one, in
    brackets, with its epoch."""
    return [(r["cond"], r["label"], _sec(r["s_to_85"]),
             "never" if r["epochs_to_85"] is None else f"{r['epochs_to_85']:.1f}",
             _acc(r), _sec(r["s_to_80"]), f"{r['s_per_epoch']:.2f}", f"{r['lr']:g}",
             r["runs"])
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
            "goal_met": ", ".join(goal["met"]) or "none",
            "k_spread": f"{100 * (max(finals) - min(finals)):.1f}" if finals else "–"}


def _seed_list(seeds: list[int]) -> str:
    if not seeds:
        return "none"
    word = "seed " if len(seeds) == 1 else "seeds "
    return word + name_list([str(s) for s in seeds])


def _skip_pairs(runs: dict[tuple, dict], seeds: list[int], cond: str) -> dict[str, str]:
    """``skip_fall``: each skip run's failed directions; ``skip_same``: the seeds at
    which the skip run and the unguarded ``k = 100`` run have the same loss in every
    epoch (the same steps), and those whose first epochs differ already."""
    fall = [str(runs[(cond, "kwng_k100_skip", s)]["epochs"][-1]["fallbacks"])
            for s in seeds]
    same, other = [], []
    for s in seeds:
        a, b = (runs.get((cond, m, s), {}).get("epochs", [])
                for m in ("kwng_k100_skip", "kwng_k100"))
        if a and b:
            key = [(e["train_loss"], e["test_loss"]) for e in a]
            (same if key == [(e["train_loss"], e["test_loss"]) for e in b]
             else other).append(s)
    n = len(runs[(cond, "kwng_k100_skip", same[0])]["epochs"]) if same else 0
    text = (f"at {_seed_list(same)} the skip run and the unguarded run have the same "
            f"losses in all {n} epochs, to the last digit" if same
            else "no pair of runs took the same steps")
    if other:
        text += (f"; at {_seed_list(other)} the pair's losses differ from the first "
                 "epoch on: those pairs did not take the same steps, fallback or not")
    return {"skip_fall": f"{name_list(fall)} ({_seed_list(seeds)})" if seeds else "–",
            "skip_same": text}


def guard_values(runs: dict[tuple, dict], stall_below: float = STALL_BELOW,
                 cond: str = "ill", by_epoch: int = 6) -> dict[str, str]:
    """The guarded ``k = 100`` runs beside the unguarded ones of the same seeds
    (``runs``: :func:`~studies.fig3.amortized.seed_study.amortized_runs`), as text:
    ``guard_seeds`` (which seeds stalled with and without the guard), ``guard_fall`` and
    ``unguarded_fall`` (the fallback counter of the records at the end of epoch
    ``by_epoch``, for each seed whose guarded run stalled; "–" when none did) and
    ``skip_runs`` (the runs of ``kwng_k100_skip``, the guard with
    ``fallback="skip"``: how many, how many stalled, their final accuracies), with
    ``skip_fall`` and ``skip_same`` (:func:`_skip_pairs`)."""
    def stalled(m: str) -> tuple[list[int], list[int]]:
        seeds = sorted(s for (c, mm, s) in runs if (c, mm) == (cond, m))
        return seeds, [s for s in seeds if runs[(cond, m, s)]["epochs"][-1]["test_acc"]
                       < stall_below]

    def fall(m: str, s: int) -> str:
        at = {e["epoch"]: e for e in runs.get((cond, m, s), {"epochs": []})["epochs"]}
        return str(at[by_epoch]["fallbacks"]) if by_epoch in at else "no run"

    plain, plain_bad = stalled("kwng_k100")
    guard, guard_bad = stalled("kwng_k100_guard")
    seeds = (f"Without the guard {_seed_list(plain_bad)} stalled (of "
             f"{_seed_list(plain)}); with it {_seed_list(guard_bad)} (of "
             f"{_seed_list(guard)}).")
    skip, skip_bad = stalled("kwng_k100_skip")
    finals = [runs[(cond, "kwng_k100_skip", s)]["epochs"][-1]["test_acc"] for s in skip]
    skip_runs = ("none of its runs is among the records yet" if not skip else
                 f"{len(skip)} run{'s' * (len(skip) > 1)}, {len(skip_bad)} stalled "
                 f"(final accuracies {', '.join(f'{100 * v:.1f}' for v in finals)} %)")
    return {"guard_seeds": seeds, "skip_runs": skip_runs,
            **_skip_pairs(runs, skip, cond),
            "guard_fall": ", ".join(f"{fall('kwng_k100_guard', s)} (seed {s})"
                                    for s in guard_bad) or "–",
            "unguarded_fall": ", ".join(f"{fall('kwng_k100', s)} (seed {s})"
                                        for s in guard_bad) or "–"}
