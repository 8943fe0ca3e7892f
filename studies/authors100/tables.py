"""Tables and quoted numbers of the CIFAR study at the authors' horizon (plan
``authors100``; book chapter :ref:`experiments-cifar`).

Each table function returns a Markdown table
(:func:`studies.kit.tables.markdown_table`);
each ``*_values`` function returns a dictionary ``{name: number}`` of the numbers the
chapter's prose quotes, under the names it glues them by. The records are those of
:func:`studies.authors100.records.load_authors100` (keys ``(tag, conditioning,
method, seed)``); the trainer timing is ``trainer_timing.json`` of ``cifar
trainer-timing``:

* :func:`budget_table` and :func:`budget_values` — the movement budget of a schedule
  (:func:`studies.cifar.methods.movement_budget`);
* :func:`trainer_timing_table`, :func:`loss_match_table` and
  :func:`trainer_timing_values` — the captured trainer's epoch times and its losses
  against the eager ones;
* :func:`final_table`, :func:`verdict_table` and :func:`final_values` — the final
  accuracy of every run and the decision rule at 100 epochs;
* :func:`time_to_accuracy_table` and :func:`time_to_accuracy_values` — the seconds of
  one GPU to reach 60 % and 80 %.
"""

from __future__ import annotations

from studies.authors100.figures import final_rows
from studies.cifar.methods import movement_budget
from studies.kit.tables import kwng_criteria_rows, markdown_table

__all__ = ["budget_table", "budget_values", "trainer_timing_table",
           "loss_match_table", "trainer_timing_values", "final_table", "verdict_table",
           "final_values", "time_to_accuracy_table", "time_to_accuracy_values"]

#: the runs whose final accuracy the chapter quotes, by glue suffix (``a100_<name>``)
QUOTED_RUNS = {
    "k10_ill": ("lr10", "ill", "kwng", 0), "k10_well": ("lr10", "well", "kwng", 0),
    "k1_ill": ("lr1", "ill", "kwng", 0), "diag_ill": ("lr10", "ill", "diag_Ttilde", 0),
    "sgd_ill": ("lr0.1", "ill", "sgd", 0), "sgd10_ill": ("lr1", "ill", "sgd", 0),
    "sgd_well": ("lr0.1", "well", "sgd", 0),
    "adam_ill": ("lr0.0001", "ill", "adam", 0),
    "adam10_ill": ("lr0.001", "ill", "adam", 0), "kfac_ill": ("lr1", "ill", "kfac", 0),
    "kfac10_ill": ("lr10", "ill", "kfac", 0), "k10s1_ill": ("lr10", "ill", "kwng", 1),
}


def _budgets() -> dict[str, float]:
    authors = movement_budget(10.0, 350, "authors")
    return {
        "authors, 350 epochs": sum(authors),
        "authors, first 100 epochs": sum(authors[:100]),
        "claim suite, 30 epochs at step 1": sum(movement_budget(1.0, 30, "claim")),
        "authors' schedule at step 1, 100 epochs": sum(
            movement_budget(1.0, 100, "authors")),
    }


def budget_table() -> str:
    """The largest distance the parameters can move under the authors' schedule (350
    epochs and its first 100), the claim suite's and the authors' at step 1."""
    rows = [(k, f"{v:,.0f}") for k, v in _budgets().items()]
    return markdown_table(["schedule", "largest distance"], rows, "lr")


def budget_values() -> dict[str, float]:
    """``budget_350``, ``budget_100`` and ``budget_claim`` (the budgets of
    :func:`budget_table`) and ``budget_share_100``: the first 100 epochs' share of the
    authors' 350 (percent)."""
    b = _budgets()
    full, first = b["authors, 350 epochs"], b["authors, first 100 epochs"]
    return {"budget_350": full, "budget_100": first,
            "budget_share_100": 100 * (first / full),
            "budget_claim": b["claim suite, 30 epochs at step 1"]}


def trainer_timing_table(tt: dict) -> str:
    """Epoch time, step time and the time after the loop of every method, precision
    and mode of the trainer timing ``tt`` (``(†)``: asked to capture, ran eagerly)."""
    rows = []
    for r in tt["rows"]:
        mode = r["mode"] + (
            "" if r["mode"] == "captured" or not r["asked_capture"] else " (†)")
        rows.append((f"`{r['method']}`", r["precision"], mode,
                     f"{r['steady_epoch_s']:.2f}", f"{r['steady_ms_per_step']:.1f}",
                     f"{r['steady_after_s']:.2f}"))
    head = ["method", "precision", "mode", "epoch (s)", "ms/step",
            "after the loop (s)"]
    return markdown_table(head, rows)


def loss_match_table(tt: dict) -> str:
    """The largest relative difference of the per-step losses, captured against eager
    and eager against eager, per method of the trainer timing ``tt``."""
    rows = [(f"`{t['method']}`", t["steps"],
             f"{t['max_rel_diff_captured_vs_eager']:.1e}",
             f"{t['max_rel_diff_eager_vs_eager']:.1e}") for t in tt["loss_match"]]
    head = ["method", "steps", "captured vs eager", "eager vs eager"]
    return markdown_table(head, rows)


def trainer_timing_values(tt: dict) -> dict:
    """``tt_kwng_<precision>_<mode>``: KWNG's epoch time (s) in bf16 and fp32, eager and
    captured; ``tt_after_max``: the longest time after the loop; ``tt_device``."""
    rows = {(r["method"], r["precision"], r["mode"]): r for r in tt["rows"]}
    out = {f"tt_kwng_{prec}_{mode}": rows[("kwng", prec, mode)]["steady_epoch_s"]
           for prec in ("bf16", "fp32") for mode in ("eager", "captured")}
    out["tt_after_max"] = max(r["steady_after_s"] for r in tt["rows"])
    return out | {"tt_device": tt["device"]}


def _fmt(xs) -> str:
    return ", ".join("–" if x is None else f"{x:.2f}" for x in xs)


def final_table(records: dict) -> str:
    """The final test accuracy of every run
    (:func:`~studies.authors100.figures.final_rows`)
    and, in IC, the recall and precision of its two classes with the smallest
    ``U_k``."""
    rows = []
    for r in final_rows(records):
        small = ((_fmt(r["recall_small"]), _fmt(r["precision_small"]))
                 if r["conditioning"] == "ill" else ("", ""))
        rows.append((r["conditioning"].upper()[0] + "C", f"`{r['method']}`",
                     f"{r['step']:g}", f"{r['seed']}", r["precision"], r["epochs"],
                     f"{100 * r['final']:.1f}", *small))
    head = ["", "method", "step", "seed", "arith.", "epochs", "test acc. (%)",
            "recall, 2 smallest $U_k$", "precision"]
    return markdown_table(head, rows)


def verdict_table(v: dict) -> str:
    """The four criteria of
    :func:`~studies.authors100.verdict.authors100_verdict` (its result ``v``),
    with the numbers behind each and whether it holds."""
    rows = kwng_criteria_rows(v, "c1_within", "c2_above_sgd") + [
        ("3. half the WC recall where U_k ≤ 1e-3",
         f"{_fmt(v['recall_ill'])} (WC {_fmt(v['recall_well'])})",
         v["c3_small_classes"]),
        ("4. two smallest U_k: recall and precision ≥ 0.5",
         f"{_fmt(v['recall_ill'][:2])}; {_fmt(v['precision_ill'][:2])}",
         v["c4_two_smallest_learned"]),
    ]
    return markdown_table(["criterion", "`kwng`, step 10", "holds"], rows, "llc")


def final_values(records: dict, v: dict) -> dict[str, float]:
    """``a100_<name>``: the final test accuracy (percent) of each run of
    :data:`QUOTED_RUNS`; ``a100_kwng_ill_mean`` and ``a100_gap`` (IC minus WC) of the
    verdict ``v``."""
    out = {f"a100_{name}": 100 * records[key]["epochs"][-1]["test_acc"]
           for name, key in QUOTED_RUNS.items()}
    return out | {"a100_kwng_ill_mean": 100 * v["kwng_ill"],
                  "a100_gap": 100 * (v["kwng_ill"] - v["kwng_well"])}


def _tta_cell(epoch, seconds) -> str:
    return "never" if epoch is None else f"{seconds:.0f} s (epoch {epoch})"


def time_to_accuracy_table(tta: list[dict]) -> str:
    """The seconds (and epoch) at which every run of
    :func:`~studies.cifar.records.time_to_accuracy` reaches 60 % and 80 %,
    IC first."""
    rows = [(r["conditioning"].upper()[0] + "C", r["label"],
             _tta_cell(r["epoch_0.6"], r["seconds_0.6"]),
             _tta_cell(r["epoch_0.8"], r["seconds_0.8"]))
            for r in sorted(tta, key=lambda r: (r["conditioning"] != "ill",
                                                r["label"]))]
    return markdown_table(["", "run", "60 %", "80 %"], rows)


def time_to_accuracy_values(tta: list[dict]) -> dict[str, float]:
    """``tta_k10_80``: the seconds of ``kwng`` at step 10 in IC to 80 %;
    ``tta_sgd_wc_80``: those of SGD at step 0.1 in WC."""
    t = {r["label"] + r["conditioning"]: r for r in tta}
    return {"tta_k10_80": t["kwng 10ill"]["seconds_0.8"],
            "tta_sgd_wc_80": t["sgd 0.1well"]["seconds_0.8"]}
