"""Training time in the Fig. 3 study (book chapter :ref:`cifar-fig3`): which clock the
accuracy-against-time figure and the time-to-accuracy table read, and the seconds each
method needs to reach a test accuracy.

Two clocks, one per source of timings:

* **one trainer timing** (preferred): ``cifar trainer-timing`` measures every method's
  training step alone on one GPU in one call (``results/cifar/fig3/timing/
  trainer_timing.json``, :data:`TIMING`); every run at a selected step, every seed, is
  then put on that clock, epoch ``e`` ending at ``steps(e) × ms per step``
  (:func:`timed_runs`). Methods are compared on one machine in one run;
* **the queue's own runs** (until that record exists): the training seconds each run
  recorded, from the runs that had a GPU to themselves
  (:func:`studies.fig3.verdicts.alone_runs`), on H100s of several rounds.

:func:`time_runs` picks the clock, :func:`seconds_to_accuracy` reads it.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from studies.cifar.methods import METHODS
from studies.cifar.records import epoch_seconds
from studies.fig3.protocol import FIG3, grid_state
from studies.fig3.verdicts import alone_runs, selected_runs
from studies.kit.provenance import read_json
from studies.kit.wording import name_list

__all__ = ["TIMING", "step_ms", "timed_runs", "retime", "time_runs", "first_at",
           "seconds_to_accuracy", "time_to_thresholds", "threshold_winners",
           "thresholds_phrase"]

TIMING = FIG3 / "timing" / "trainer_timing.json"
"""Where the Fig. 3 study's trainer timing is written (``cifar trainer-timing --out``),
the file ``trainer_timing.json`` in the folder ``results/cifar/fig3/timing/``.

:meta hide-value:
"""


def step_ms(timing: dict, precision: str = "bf16") -> dict[str, float]:
    """Milliseconds per training step of each method in a trainer-timing record
    (``steady_ms_per_step``, the last timed epoch), from its captured row where the
    step was replayed from a CUDA graph, else from its eager row
    (:func:`studies.cifar.records.epoch_seconds` reads the same rows)."""
    return epoch_seconds(timing, precision, field="steady_ms_per_step")


def timed_runs(p: dict, root: str | os.PathLike, timing: dict) -> dict[tuple, dict]:
    """Every finished run at a selected step
    (:func:`~studies.fig3.verdicts.selected_runs`) of a method the timing
    measured, as a copy whose epochs' ``time_train`` is the cumulative step count times
    that method's step time (:func:`step_ms` in the protocol's precision); other
    methods are left out."""
    return retime(selected_runs(p, root),
                  step_ms(timing, p["settings"].get("precision") or "bf16"))


def retime(runs: dict[tuple, dict], ms: dict[str, float]) -> dict[tuple, dict]:
    """``runs`` (keyed ``(conditioning, method, seed)``) as copies on the clock
    ``ms`` (milliseconds per step by method, :func:`step_ms`): epoch ``e``'s
    ``time_train`` becomes its cumulative step count times the method's step time;
    runs of a method ``ms`` lacks are left out."""
    return {k: {**r, "epochs": [{**e, "time_train": e["steps"] * ms[k[1]] / 1e3}
                                for e in r["epochs"]]}
            for k, r in runs.items() if k[1] in ms}


def time_runs(p: dict, root: str | os.PathLike = FIG3,
              timing_path: str | os.PathLike | None = None) -> tuple[dict, dict]:
    """The runs the time figure and table read, and their clock: ``(runs, source)``
    with ``source["kind"]`` ``"trainer-timing"`` (and ``device``, ``path``, ``methods``)
    when the trainer-timing record exists (``timing_path``, default ``root /
    "timing" / "trainer_timing.json"``), else ``"alone"`` (the runs' own seconds)."""
    root = Path(root)
    path = Path(timing_path) if timing_path is not None else (
        root / "timing" / "trainer_timing.json")
    if not path.exists():
        return alone_runs(p, root), {"kind": "alone"}
    timing = read_json(path)
    return timed_runs(p, root, timing), {
        "kind": "trainer-timing", "device": timing.get("device", "unknown"),
        "path": str(path), "methods": sorted(timing["config"]["methods"])}


def first_at(rows: list[dict], target: float) -> dict | None:
    """The first epoch row of ``rows`` whose test accuracy is at least ``target``;
    ``None`` when the run never got there."""
    return next((r for r in rows if r["test_acc"] >= target), None)


def _seconds_to(rows: list[dict], target: float) -> float | None:
    hit = first_at(rows, target)
    return None if hit is None else hit["time_train"]


def seconds_to_accuracy(p: dict, root: str | os.PathLike = FIG3,
                        targets: tuple[float, ...] = (0.80, 0.85),
                        runs: dict | None = None) -> dict[str, dict]:
    """Per ``"<conditioning>/<method>"`` at its selected step, from ``runs`` (default
    the clock of :func:`time_runs`): ``lr``, ``final`` (whether that selection is
    final), ``runs``, ``s_per_epoch`` (median training seconds an epoch, the first
    excluded), ``to`` (``{target: mean training seconds to the first epoch at or above
    that test accuracy, or None when a run never reached it}``) and ``epoch_to`` (the
    same in epochs). Training time only: the per-epoch evaluations are not counted."""
    bad = [t for t in targets if not 0 < t < 1]
    if bad:
        raise ValueError(f"targets must be accuracies in (0, 1), got {bad}")
    runs = time_runs(p, root)[0] if runs is None else runs
    state, out = grid_state(p, root), {}
    for (cond, m, _), rec in sorted(runs.items()):
        rows = rec["epochs"]
        st = state[f"{cond}/{m}"]
        e = out.setdefault(f"{cond}/{m}", {
            "lr": st["selected"], "final": st["final"], "runs": 0, "epochs": [],
            "to": {t: [] for t in targets}, "epoch_to": {t: [] for t in targets}})
        e["runs"] += 1
        e["epochs"] += [b["time_train"] - a["time_train"]
                        for a, b in zip(rows, rows[1:])]
        for t in targets:
            e["to"][t].append(_seconds_to(rows, t))
            hit = first_at(rows, t)
            e["epoch_to"][t].append(None if hit is None else hit["epoch"])
    for e in out.values():
        e["s_per_epoch"] = statistics.median(e.pop("epochs"))
        for k in ("to", "epoch_to"):
            e[k] = {t: None if None in v else statistics.fmean(v)
                    for t, v in e[k].items()}
    return out


def time_to_thresholds(p: dict, root: str | os.PathLike = FIG3,
                       runs: dict | None = None, cond: str = "ill",
                       lowest: int = 70) -> dict:
    """Seconds to every test-accuracy threshold from ``lowest`` % to the best final
    accuracy of ``cond``, one point apart, on one clock (``runs``, default
    :func:`time_runs`): ``thresholds`` (in %), ``best`` (the highest mean final test
    accuracy over the methods, in %) and ``seconds`` (per method, the mean seconds of
    its runs to each threshold, ``None`` where a run never reached it;
    :func:`seconds_to_accuracy`)."""
    runs = time_runs(p, root)[0] if runs is None else runs
    runs = {k: r for k, r in runs.items() if k[0] == cond}
    final: dict[str, list[float]] = {}
    for (_, m, _), r in runs.items():
        final.setdefault(m, []).append(100 * r["epochs"][-1]["test_acc"])
    best = max(statistics.fmean(v) for v in final.values())
    thr = list(range(lowest, math.floor(best) + 1))
    tta = seconds_to_accuracy(p, root, targets=tuple(t / 100 for t in thr), runs=runs)
    return {"thresholds": thr, "best": best,
            "seconds": {k.split("/")[1]: [v["to"][t / 100] for t in thr]
                        for k, v in tta.items()}}


def threshold_winners(curve: dict, method: str, baseline: str) -> list[tuple]:
    """Which of ``method`` and ``baseline`` reaches each threshold of ``curve``
    (:func:`time_to_thresholds`) in fewer seconds: runs of thresholds with the same
    answer as ``(winner, alone, lowest, highest)``, ``alone`` true where the other one
    never gets there, ``winner`` ``None`` where neither does."""
    a, b = curve["seconds"][method], curve["seconds"][baseline]
    out: list[list] = []
    for t, x, y in zip(curve["thresholds"], a, b):
        w = (None if x is None and y is None else method if y is None
             else baseline if x is None else method if x < y else baseline)
        key = (w, w is not None and (x is None or y is None))
        if out and tuple(out[-1][:2]) == key:
            out[-1][3] = t
        else:
            out.append([*key, t, t])
    return [tuple(o) for o in out]


def thresholds_phrase(curve: dict, method: str = "kwng") -> str:
    """Which thresholds of the time-to-accuracy curve
    (:func:`studies.fig3.clocks.time_to_thresholds`) favour ``method``
    and which each baseline, in one phrase: "Adam is faster at 70–87 %, only KWNG
    reaches 88 %; ...; SGD and EKFAC never reach 70 %"."""
    def rng(lo: int, hi: int) -> str:
        return f"{lo} %" if lo == hi else f"{lo}–{hi} %"

    lab, parts, never = METHODS[method].label, [], []
    for b in curve["seconds"]:
        if b == method:
            continue
        if all(v is None for v in curve["seconds"][b]):
            never.append(METHODS[b].label)
            continue
        bits = []
        for w, alone, lo, hi in threshold_winners(curve, method, b):
            who = METHODS[w].label if w else None
            bits.append(f"neither reaches {rng(lo, hi)}" if w is None
                        else f"only {who} reaches {rng(lo, hi)}" if alone
                        else f"{who} is faster at {rng(lo, hi)}")
        parts.append(f"against {METHODS[b].label}, " + ", ".join(bits))
    if never:
        parts.append(f"{name_list(never)} never reach{'es' * (len(never) == 1)} "
                     f"{curve['thresholds'][0]} % (so {lab} is faster at every "
                     "threshold)")
    return "; ".join(parts)
