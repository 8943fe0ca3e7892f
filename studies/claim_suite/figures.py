"""Tables and quoted numbers of the CIFAR claim suite (plan ``claim``; book chapter
:ref:`experiments-cifar`), read from its committed records.

Each table function returns a Markdown table
(:func:`studies.kit.tables.markdown_table`);
each ``*_values`` function returns a dictionary ``{name: number}`` of the numbers the
chapter's prose quotes, under the names it glues them by. The records are those of
:func:`studies.cifar.results.load_results` (``{(conditioning, method, seed):
record}``):

* :func:`selection_rule` and :func:`selected_steps` — the stored step-size selection;
* :func:`recall_table` and :func:`recall_values` — per-class recall in IC, classes by
  ascending ``U_k``;
* :func:`eps_table` and :func:`eps_values` — the Levenberg–Marquardt ε and reduction
  ratio of the ``kwng`` runs at a few epochs;
* :func:`pilot_table` and :func:`pilot_values` — the same-batch ε rule's pilot next to
  the two ``kwng`` seeds;
* :func:`verdict_word`, :func:`verdict_table`, :func:`drop_table` and
  :func:`drop_values` — the decision rule applied and the drop of every method.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from studies.cifar.records import class_scalings, diag_series, final_per_class
from studies.kit.tables import kwng_criteria_rows, markdown_table

__all__ = ["selection_rule", "selected_steps", "recall_table", "recall_values",
           "eps_table", "eps_values", "pilot_table", "pilot_values", "verdict_word",
           "verdict_table", "drop_table", "drop_values"]

#: the epochs at which :func:`eps_table` shows ε and the reduction ratio
EPS_EPOCHS = (1, 3, 9, 16, 20, 26, 28, 30)

#: the runs :func:`pilot_table` compares, per conditioning (name, method, seed)
PILOT_RUNS = (("kwng s0", "kwng", 0), ("kwng s1", "kwng", 1),
              ("same batch", "kwng_lm_same_batch", 0))


def selection_rule(selected: dict) -> str:
    """The selection rule stored with a selection (``selected.json``), as Markdown: its
    first paragraph dropped, whitespace joined, Sphinx roles reduced to code."""
    if "rule" not in selected:
        raise ValueError("selected must hold the selection's 'rule'")
    rule = " ".join(selected["rule"].split("\n\n", 1)[-1].strip().split())
    return re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", rule)


def selected_steps(selected: dict) -> dict[str, float]:
    """The selected step size per conditioning and method, named
    ``lr_<cond>_<method>``."""
    return {"lr_" + k.split("/", 1)[1].replace("/", "_"): v["lr"]
            for k, v in selected["selected"].items()}


def _recall(at_E: dict, methods: Sequence[str]):
    U_k = class_scalings(at_E)
    order = np.argsort(U_k)
    recall = {m: final_per_class(at_E, "ill", m)[order] for m in methods}
    return U_k[order], recall, final_per_class(at_E, "well", "kwng")[order]


def recall_table(at_E: dict, methods: Sequence[str]) -> str:
    """Per-class test recall in IC of each of ``methods`` and of ``kwng`` in WC, classes
    by ascending ``U_k`` (one column each)."""
    U, recall, recall_wc = _recall(at_E, methods)
    head = ["method"] + [f"{u:.0e}" for u in U]
    rows = [[f"`{m}`"] + [f"{x:.2f}" for x in r] for m, r in recall.items()]
    rows.append(["`kwng` in WC"] + [f"{x:.2f}" for x in recall_wc])
    return markdown_table(head, rows)


def recall_values(at_E: dict, methods: Sequence[str]) -> dict[str, float]:
    """``rec_<method>_<j>``: the IC recall of the ``j``-th smallest ``U_k`` (``j`` < 4);
    ``rec_kwng_wc_<j>`` (``j`` < 2) in WC; ``rec_diag_gap``: the largest per-class gap
    between ``diag_Ttilde`` and ``kwng``; ``u_<j>``: the four smallest ``U_k``."""
    U, recall, recall_wc = _recall(at_E, methods)
    out = {f"rec_{m}_{j}": float(r[j]) for m, r in recall.items() for j in range(4)}
    out |= {f"rec_kwng_wc_{j}": float(recall_wc[j]) for j in (0, 1)}
    gap = np.abs(recall["diag_Ttilde"] - recall["kwng"]).max()
    out["rec_diag_gap"] = float(gap)
    return out | {f"u_{j}": float(u) for j, u in enumerate(U[:4])}


def _kwng_runs(claim: dict):
    return [(cond, seed, r) for (cond, m, seed), r in sorted(claim.items())
            if m == "kwng"]


def eps_table(claim: dict, epochs: Sequence[int] = EPS_EPOCHS) -> str:
    """The epoch means of ε (authors' units) and of the reduction ratio ``r`` of every
    ``kwng`` run at ``epochs`` (1-based), two rows per run."""
    rows = []
    for cond, seed, r in _kwng_runs(claim):
        eps = diag_series(r, "eps")
        rat = diag_series(r, "reduction_ratio")
        rows.append([f"{cond} s{seed}", "ε"] + [f"{eps[e - 1]:.0e}" for e in epochs])
        rows.append(["", "r"] + [f"{rat[e - 1]:.3f}" for e in epochs])
    head = ["`kwng`", "epoch"] + [str(e) for e in epochs]
    return markdown_table(head, rows, align="ll" + "r" * len(epochs))


def eps_values(claim: dict) -> dict[str, float]:
    """``eps_<cond>_<seed>_<epoch>`` for epochs 9, 26 and 30 of every ``kwng`` run, and
    ``r_lo`` and ``r_hi``: the range of the reduction ratio after the first epoch."""
    out, ratios = {}, []
    for cond, seed, r in _kwng_runs(claim):
        eps = diag_series(r, "eps")
        ratios.append(diag_series(r, "reduction_ratio")[1:])
        out |= {f"eps_{cond}_{seed}_{e}": float(eps[e - 1]) for e in (9, 26, 30)}
    return out | {"r_lo": float(np.min(ratios)), "r_hi": float(np.max(ratios))}


def _pilot_series(claim: dict, pilot: dict, epochs: int = 5):
    for cond in ("ill", "well"):
        for name, method, seed in PILOT_RUNS:
            r = (pilot if method != "kwng" else claim)[(cond, method, seed)]
            v = diag_series(r, "reduction_ratio")[:epochs]
            acc = [x["test_acc"] for x in r["epochs"][:epochs]]
            yield cond, name, method, v, acc


def pilot_table(claim: dict, pilot: dict) -> str:
    """The reduction ratio and test accuracy of the first five epochs of the two
    ``kwng`` seeds and of the same-batch pilot (``pilot``), per conditioning."""
    rows = []
    for cond, name, _, v, acc in _pilot_series(claim, pilot):
        rows += [[cond, name, "r"] + [f"{x:.3f}" for x in v],
                 ["", "", "test acc."] + [f"{x:.3f}" for x in acc]]
    head = ["cond.", "run", ""] + [f"epoch {e}" for e in range(1, 6)]
    return markdown_table(head, rows, align="lll" + "r" * 5)


def pilot_values(claim: dict, pilot: dict) -> dict[str, float]:
    """``pilot_<cond>_<run>_acc5``: the test accuracy after epoch 5 of each run of
    :func:`pilot_table`; ``pilot_r_lo`` and ``pilot_r_hi``: the range of the pilot's
    reduction ratio."""
    out, same = {}, []
    for cond, name, method, v, acc in _pilot_series(claim, pilot):
        out[f"pilot_{cond}_{name.replace(' ', '_')}_acc5"] = acc[-1]
        same += list(v) if method != "kwng" else []
    return out | {"pilot_r_lo": float(min(same)), "pilot_r_hi": float(max(same))}


def verdict_word(holds: bool | None) -> str:
    """``"holds"``, ``"does not hold"`` or, where ``holds`` is ``None``,
    ``"is undecided"``."""
    return {True: "holds", False: "does not hold"}.get(holds, "is undecided")


def verdict_table(v: dict) -> str:
    """The three criteria of
    :func:`~studies.claim_suite.verdict.claim_verdict` (its result ``v``), with
    the numbers behind each and whether it holds."""
    U_small = ", ".join(f"{u:.0e}" for u in v["U_small"])
    per_class = ", ".join(f"{a:.2f} (WC {b:.2f})"
                          for a, b in zip(v["per_class_ill"], v["per_class_well"]))
    rows = kwng_criteria_rows(v, "a_within", "b_above_sgd") + [
        (f"3. half the WC accuracy on the classes with U_k = {U_small}", per_class,
         v["c_small_classes"]),
    ]
    return markdown_table(["criterion", "`kwng`", "holds"], rows, "llc")


def drop_table(table: dict, methods: Sequence[str]) -> str:
    """The mean final accuracy in WC and IC of each of ``methods`` (from
    :func:`~studies.cifar.records.final_accuracy_table`) and its drop."""
    rows = []
    for m in methods:
        w, i = table[m]["well"]["mean"], table[m]["ill"]["mean"]
        rows.append((f"`{m}`", f"{100 * w:.1f}", f"{100 * i:.1f}",
                     f"{100 * (w - i):.1f}"))
    return markdown_table(["method", "WC (%)", "IC (%)", "drop"], rows)


def drop_values(table: dict, v: dict, methods: Sequence[str]) -> dict[str, float]:
    """``acc_<method>_well``, ``acc_<method>_ill`` and ``drop_<method>`` (percent) of
    each of ``methods``; the range of ``kwng`` over its seeds in IC
    (``kwng_ill_min``, ``kwng_ill_max``) and its margin over SGD in the verdict ``v``
    (``kwng_margin_sgd``)."""
    out = {}
    for m in methods:
        w, i = table[m]["well"]["mean"], table[m]["ill"]["mean"]
        out |= {f"acc_{m}_well": 100 * w, f"acc_{m}_ill": 100 * i,
                f"drop_{m}": 100 * (w - i)}
    k = table["kwng"]["ill"]
    return out | {"kwng_ill_min": 100 * k["min"], "kwng_ill_max": 100 * k["max"],
                  "kwng_margin_sgd": 100 * (v["kwng_ill"] - v["sgd_ill"])}
