"""The amortized step's seed study (plan ``amortized_seeds`` of
:func:`studies.cifar.plans.build_plan`, records under
``results/cifar/amortized_seeds``): each setting of the amortized KWNG step, and tuned
Adam beside it, at several seeds, with the Fig. 3 protocol's settings. Its plan is the
committed file ``plan.json`` of that folder; this module reads and checks it."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from studies.cifar.hooks import register_check
from studies.cifar.methods import METHODS, RESULTS
from studies.fig3.clocks import first_at, retime, step_ms, time_runs
from studies.fig3.groups import check_group, record_verdict
from studies.fig3.protocol import FIG3, load_protocol, record_problem
from studies.fig3.verdicts import ablation_runs, selected_runs
from studies.kit.provenance import ResultFileError, read_json
from studies.kit.wording import name_list

__all__ = ["AMORTIZED_METHODS", "AMORTIZED", "AMORTIZED_SEEDS", "BAR", "STALL_BELOW",
           "SEED_RUN_HEADER",
           "SEED_SUMMARY_HEADER", "amortized_runs", "bar_phrase", "check_seed_study",
           "seed_bar", "seed_check", "seed_run_table", "seed_study_groups",
           "own_step_ms", "seed_study_runs", "seed_summary_rows", "seed_summary_table",
           "failure_rows", "seconds_text", "summary_values", "failure_values",
           "rounds_phrase"]

#: the test accuracies a run reports the time to
TARGETS = (0.80, 0.85)

#: the methods of the amortized-step study, in the order of its figure
AMORTIZED_METHODS = ("kwng_k5", "kwng_k20", "kwng_k100", "diag_k20")
#: the amortized-step study's records, ``results/cifar/amortized`` of the checkout
#:
#: :meta hide-value:
AMORTIZED = RESULTS / "amortized"
#: the amortized step's seed study, ``results/cifar/amortized_seeds`` of the checkout:
#: its committed plan (``plan.json``) and its records
#:
#: :meta hide-value:
AMORTIZED_SEEDS = RESULTS / "amortized_seeds"
#: The final test accuracy below which a run stalls, the plan's ``stall_below``; every
#: reading that counts stalls takes it as its default, and a test holds the two equal.
STALL_BELOW = 0.8


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
        check_group(g)
        if g.get("lr_of") not in METHODS:
            raise ValueError(f"a group's lr_of must be a method name, got "
                             f"{g.get('lr_of')!r}")
    return groups


def check_seed_study(root: str | os.PathLike = AMORTIZED_SEEDS,
                     p: dict | None = None) -> dict[str, list]:
    """Every record of the seed study under ``root`` against the Fig. 3 protocol's
    settings (:func:`studies.fig3.protocol.record_problem`) and its plan (a
    method, conditioning and seed that ``plan.json`` lists): ``{"ok"``, ``"incomplete"``
    (epochs still to run), ``"bad": [(run, problem)]}``, runs named
    ``lr<lr>/<conditioning>/<method>/seed<k>``."""
    p = load_protocol() if p is None else p
    root, epochs = Path(root), int(p["settings"]["epochs"])
    planned = {(g["conditioning"], m, s) for g in seed_study_groups(
        read_json(root / "plan.json")) for m in g["methods"] for s in g["seeds"]}
    res: dict[str, list] = {"ok": [], "incomplete": [], "bad": []}
    for mp in sorted(root.glob(f"lr*/{p['dataset']}/*/*/seed*/metrics.json")):
        cond, m, seed = mp.parts[-4], mp.parts[-3], int(mp.parts[-2][4:])
        name = "/".join((mp.parts[-6], *mp.parts[-4:-1]))
        problem, status = record_verdict(p, mp, "", (cond, m, seed), planned, epochs)
        if problem:
            res["bad"].append((name, problem))
            continue
        res["ok" if status == "finished" else "incomplete"].append(name)
    return res


def seed_check(root: str | None) -> int:
    """``cifar check --suite amortized_seeds``: :func:`check_seed_study`, printed; exit
    1 if a record is bad or unfinished (runs the plan has not reached are not
    counted)."""
    res = check_seed_study(root or AMORTIZED_SEEDS)
    for name, problem in res["bad"]:
        print("bad:", name, "-", problem)
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "incomplete:", json.dumps(res["incomplete"]))
    return 1 if res["bad"] or res["incomplete"] else 0


def amortized_runs(p: dict, root: str | os.PathLike = AMORTIZED) -> dict[tuple, dict]:
    """``{(conditioning, method, seed): record}`` of every record under ``root``,
    finished or cut, each checked against the protocol ``p`` as the Fig. 3 records are
    (:func:`studies.fig3.protocol.record_problem`). A record that breaks it raises
    :class:`~studies.kit.provenance.ResultFileError` naming the file."""
    out = {}
    for mp in sorted(Path(root).glob(f"lr*/{p['dataset']}/*/*/seed*/metrics.json")):
        problem = record_problem(p, mp, "")
        if problem:
            raise ResultFileError(f"{mp}: {problem}")
        out[(mp.parts[-4], mp.parts[-3], int(mp.parts[-2][4:]))] = read_json(mp)
    return out


# ----------------------------------------------------------- the seed study read
def own_step_ms(rec: dict) -> float:
    """A run's own steady step time in milliseconds: the median over its epochs after
    the first of training seconds per step (the first epoch also compiles kernels and
    records graphs, which a run that starts a machine hold pays in full), the run's
    own counterpart of the trainer timing's ``steady_ms_per_step``."""
    e = rec["epochs"]
    per = [(b["time_train"] - a["time_train"]) / (b["steps"] - a["steps"])
           for a, b in zip(e, e[1:]) if b["steps"] > a["steps"]]
    if not per:
        raise ValueError("own_step_ms needs a record with at least 2 epochs")
    return 1e3 * statistics.median(per)


def seed_study_runs(p: dict, fig3_root: str | os.PathLike = FIG3,
                    root: str | os.PathLike = AMORTIZED_SEEDS,
                    timing_path: str | os.PathLike | None = None) -> list[dict]:
    """Every run of the seed study under ``root`` (finished or not), with the Fig. 3
    study's finished runs of Adam and exact KWNG at their selected steps and of its
    ablation variants beside them (``source`` ``"fig3"``), one dict a run: ``cond``,
    ``method``, ``seed``, ``source``, ``epochs`` run, ``final`` (test accuracy at the
    last epoch run), ``complete``, ``stalled`` (a finished run below the plan's
    ``stall_below``), ``epochs_to_80``/``_85`` and ``s_to_80``/``_85`` (``None``: never
    reached) on the Fig. 3 trainer timing's clock (``clock`` ``"trainer-timing"``) where
    it timed the method, else on the run's own steady step time (``"own-steady"``,
    :func:`own_step_ms`; the GPU it ran on is ``device``)."""
    epochs, root = int(p["settings"]["epochs"]), Path(root)
    stall = float(read_json(root / "plan.json")["stall_below"])
    runs = {**{(c, m, s): (r, "study") for (c, m, s), r in
               amortized_runs(p, root).items()},
            **{k: (r, "fig3") for k, r in selected_runs(p, fig3_root).items()
               if k[1] in ("adam", "kwng")},
            **{k: (r, "fig3") for k, r in ablation_runs(p, fig3_root, False).items()
               if k[1] != "kwng"}}
    base, source = time_runs(p, fig3_root, timing_path)
    ms = (step_ms(read_json(source["path"]), p["settings"].get("precision") or "bf16")
          if source["kind"] == "trainer-timing" else {})
    out = []
    for (cond, m, seed), (rec, src) in sorted(
            runs.items(), key=lambda kv: (kv[0][0] != "ill", METHODS[kv[0][1]].order,
                                          kv[0][2])):
        rows = rec["epochs"]
        own = {} if m in ms else {m: own_step_ms(rec)}
        clocked = retime({(cond, m, seed): rec}, {**ms, **own}).get((cond, m, seed))
        row = {"cond": cond, "method": m, "seed": seed, "source": src,
               "epochs": len(rows), "final": float(rows[-1]["test_acc"]),
               "complete": bool(rec.get("complete")) and len(rows) == epochs,
               "clock": "trainer-timing" if m in ms else "own-steady",
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
#:
#: :meta hide-value:
SEED_RUN_HEADER = ("cond.", "method", "seed", "from", "final test %", "stall",
                   "epochs to 85 %", "s to 85 %", "clock")


def seed_run_table(runs: list[dict]) -> list[tuple]:
    """:func:`seed_study_runs` as text, every run, stalls marked."""
    return [(r["cond"], METHODS[r["method"]].label, r["seed"], r["source"],
             f"{100 * r['final']:.1f}" + ("" if r["complete"] else
                                           f" (epoch {r['epochs']})"),
             "STALL" if r["stalled"] else "", _num(r["epochs_to_85"], "{:d}"),
             seconds_text(r["s_to_85"]), r["clock"]) for r in runs]


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
#:
#: :meta hide-value:
SEED_SUMMARY_HEADER = ("cond.", "method", "runs", "stalls", "final test % (mean)",
                       "range", "s to 80 % (median / worst)",
                       "s to 85 % (median / worst)")


def seed_summary_table(rows: list[dict]) -> list[tuple]:
    """:func:`seed_summary_rows` as text."""
    return [(r["cond"], METHODS[r["method"]].label, r["runs"], r["stalls"],
             f"{100 * r['mean']:.1f}", f"{100 * r['min']:.1f}–{100 * r['max']:.1f}",
             " / ".join(map(seconds_text, (r["median_s_to_80"], r["worst_s_to_80"]))),
             " / ".join(map(seconds_text, (r["median_s_to_85"], r["worst_s_to_85"]))))
            for r in rows]


#: the bar a recommended setting must meet (runs per conditioning, the final accuracy
#: every ill-conditioned run must reach, the target it must reach before Adam's median)
#:
#: :meta hide-value:
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


def rounds_phrase(rounds: list[dict]) -> str:
    """The GPU rounds of ``rounds.json`` in a phrase: each round's machine, device
    seconds and whether its runs had a GPU each or shared one."""
    return "; ".join(f"{r['machine']}, {r['device_s']} device seconds, "
                     + ("one run per GPU" if r["runs_per_gpu"] == 1
                        else f"up to {r['runs_per_gpu']} runs sharing a GPU")
                     for r in rounds)


def seconds_text(v: float | None) -> str:
    """Seconds as text, to the second; ``"never"`` for ``None``."""
    return "never" if v is None else f"{v:.0f}"


def failure_rows(runs: dict[tuple, dict], method: str, cond: str = "ill",
                 stall_below: float = STALL_BELOW) -> list[dict]:
    """Per run of ``method`` in ``cond`` (``runs``: :func:`amortized_runs`), what the
    safeguard and the solve saw: ``final`` test accuracy, ``stalled``, the steps that
    fell back to ``g`` and that met a rank-deficient ``C Cᵀ`` (totals, and after the
    first 7 epochs), the first epoch with a fallback (``None``: none), and ``ε`` at the
    end of epochs 7 and 40 (its median over the run's epochs ``eps_median``)."""
    out = []
    for (c, m, seed), rec in sorted(runs.items()):
        if (c, m) != (cond, method):
            continue
        rows = rec["epochs"]
        first = next((r["epoch"] for r in rows if r["fallbacks"]), None)
        at = {r["epoch"]: r for r in rows}
        out.append({"seed": seed, "final": rows[-1]["test_acc"],
                    "stalled": rows[-1]["test_acc"] < stall_below,
                    "fallbacks": rows[-1]["fallbacks"],
                    "ill_conditioned": rows[-1]["ill_conditioned"],
                    "fallbacks_7": at[7]["fallbacks"] if 7 in at else None,
                    "ill_7": at[7]["ill_conditioned"] if 7 in at else None,
                    "first_fallback": first,
                    "eps_median": statistics.median(r["eps"] for r in rows),
                    "steps": rows[-1]["steps"]})
    return out


def summary_values(rows: list[dict], runs: list[dict]) -> dict[str, str]:
    """The numbers a page quotes from :func:`seed_summary_rows` ``rows``, as text named
    ``<cond>_<method>_<field>`` (``runs``, ``stalls``, ``range`` of the final test
    accuracy in %, one number for one run, ``s85`` median / worst seconds to 85 %,
    one number for one run), and ``k100_ok_s85``, the
    seconds to 85 % of each ill-conditioned ``kwng_k100`` run of :func:`seed_study_runs`
    ``runs`` that did not stall."""
    out = {}
    for r in rows:
        key = f"{r['cond']}_{r['method']}"
        out[f"{key}_runs"], out[f"{key}_stalls"] = str(r["runs"]), str(r["stalls"])
        one = r["runs"] == 1
        out[f"{key}_range"] = (f"{100 * r['min']:.1f}" if one else
                               f"{100 * r['min']:.1f}–{100 * r['max']:.1f}")
        s85 = (r["median_s_to_85"],) if one else (r["median_s_to_85"],
                                                  r["worst_s_to_85"])
        out[f"{key}_s85"] = " / ".join(map(seconds_text, s85))
    out["k100_ok_s85"] = name_list([
        seconds_text(r["s_to_85"]) for r in runs if r["method"] == "kwng_k100"
        and r["cond"] == "ill" and r["complete"] and not r["stalled"]])
    return out


def failure_values(fail: dict[str, list[dict]], every: int = 100) -> dict[str, str]:
    """The numbers a page quotes from :func:`failure_rows` of ``kwng_k100`` (a system
    reused ``every`` steps) and ``kwng_k20`` (``fail``: method -> rows): for the stalled
    runs the epoch of the first fallback, the fallbacks by epoch 7, the rank-deficient
    steps and systems and the steps run; for the healthy ones the sum of both counts;
    for k = 20 its rank-deficient steps per seed and its fallbacks."""
    bad = [r for r in fail["kwng_k100"] if r["stalled"]]
    good = [r for r in fail["kwng_k100"] if not r["stalled"]]
    return {
        "first": " and ".join(str(r["first_fallback"]) for r in bad),
        "fall7": " and ".join(str(r["fallbacks_7"]) for r in bad),
        "ill": " and ".join(f"{r['ill_conditioned']:,}" for r in bad),
        "systems": " and ".join(str(r["ill_conditioned"] // every) for r in bad),
        "steps": f"{bad[0]['steps']:,}" if bad else "–",
        "good": str(sum(r["fallbacks"] + r["ill_conditioned"] for r in good)),
        "k20_ill": ", ".join(str(r["ill_conditioned"]) for r in fail["kwng_k20"]),
        "k20_fall": str(sum(r["fallbacks"] for r in fail["kwng_k20"]))}


register_check("amortized_seeds", lambda a: seed_check(a.root))
