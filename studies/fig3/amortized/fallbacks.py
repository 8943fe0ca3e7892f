"""What the safeguard's fallbacks say about the CIFAR-10 runs of the KWNG family.

A KWNG direction that fails the descent test is replaced by the Euclidean gradient (or
by no step, ``fallback="skip"``), and each run's records count these fallbacks epoch by
epoch. Read across the committed records (the Fig. 3 protocol, its audit, and both
amortized studies), the count separates the runs that stalled from the healthy ones;
:func:`quiet_stall_values` describes a stall that the count misses.
"""

from __future__ import annotations

import os
from pathlib import Path

from studies.cifar.methods import METHODS
from studies.fig3.amortized.seed_study import STALL_BELOW
from studies.kit.provenance import read_json
from studies.kit.wording import name_list, pct

__all__ = ["fallback_records", "fallback_values", "method_fallbacks",
           "quiet_stall_values", "WHERE"]


def fallback_records(roots: list[str | os.PathLike], step: float = 10.0,
                     cond: str = "ill") -> list[tuple[str, dict]]:
    """Every complete run of the KWNG family (methods ``kwng*`` and ``diag*``: exact,
    amortized, diagonal, the ablations) under ``roots`` at ``step`` in conditioning
    ``cond``, as ``(label, record)`` with label ``"root/method seed
    s"``; runs cut short (early-stopped or diverged) are left out."""
    out = []
    for root in map(Path, roots):
        for f in sorted(root.rglob(f"lr{step:g}/cifar10/{cond}/*/seed*/metrics.json")):
            rec = read_json(f)
            eps = rec.get("epochs") or []
            kwng = f.parent.parent.name.startswith(("kwng", "diag"))
            if (kwng and rec.get("complete") and eps and "fallbacks" in eps[-1]
                    and len(eps) == rec.get("config", {}).get("epochs", len(eps))):
                out.append((f"{root.name}/{f.parent.parent.name} {f.parent.name}", rec))
    return out


#: the record folders of :func:`fallback_records`, in words
WHERE = {"fig3": "protocol", "fig3_audit": "audit", "amortized": "amortized study",
         "amortized_seeds": "seed study"}


def _label_parts(label: str) -> tuple[str, str, str]:
    """A :func:`fallback_records` label ``"folder/method seedN"`` as ``(folder in
    words, method, seed)``."""
    folder, rest = label.split("/", 1)
    m, seed = rest.rsplit(" ", 1)
    return WHERE.get(folder, folder), m, seed[4:]


def _run_words(label: str) -> str:
    """A label as ``"<method label>, seed N (<folder in words>)"``."""
    where, m, seed = _label_parts(label)
    return f"{METHODS[m].label if m in METHODS else m}, seed {seed} ({where})"


def method_fallbacks(recs: list[tuple[str, dict]], method: str) -> str:
    """Each run of ``method`` among :func:`fallback_records`' ``recs`` with its final
    test accuracy and fallback count: ``"seed 0 (protocol): 64.2 %, 1,690 fallbacks;
    ..."``; ``"none"`` without a run."""
    out = []
    for label, rec in recs:
        where, m, seed = _label_parts(label)
        last = rec["epochs"][-1]
        if m == method:
            out.append(f"seed {seed} ({where}): {pct(last['test_acc'])} %, "
                       f"{last['fallbacks']:,} fallbacks")
    return "; ".join(out) or "none"


def fallback_values(recs: list[tuple[str, dict]],
                    stall_below: float = STALL_BELOW) -> dict[str, str]:
    """How the safeguard's fallbacks split the runs of :func:`fallback_records`:
    ``fb_runs`` (how many), ``fb_stalls`` (how many ended below ``stall_below``),
    ``fb_healthy`` (how many did not) and ``fb_healthy_max`` (the most fallbacks of one
    of them); ``fb_fell`` (how many stalled runs fell back more often than any healthy
    run), ``fb_stalled`` (each of them with its fallback count) and ``fb_stalled_min``
    (the fewest of theirs); ``fb_quiet`` (the stalled runs that did not, with theirs,
    or ``none``)."""
    stalled = sorted(((rec["epochs"][-1]["fallbacks"], label) for label, rec in recs
                      if rec["epochs"][-1]["test_acc"] < stall_below), reverse=True)
    healthy = [rec["epochs"][-1]["fallbacks"] for _, rec in recs
               if rec["epochs"][-1]["test_acc"] >= stall_below]
    top = max(healthy, default=0)
    fell = [(n, lab) for n, lab in stalled if n > top]
    quiet = [(n, lab) for n, lab in stalled if n <= top]

    def words(runs: list[tuple[int, str]]) -> str:
        return "; ".join(f"{_run_words(lab)}: {n:,}" for n, lab in runs) or "none"
    return {"fb_runs": str(len(recs)), "fb_stalls": str(len(stalled)),
            "fb_fell": str(len(fell)), "fb_stalled": words(fell),
            "fb_stalled_min": f"{min(n for n, _ in fell):,}" if fell else "–",
            "fb_quiet": words(quiet), "fb_healthy": str(len(healthy)),
            "fb_healthy_max": f"{top:,}" if healthy else "–"}


def quiet_stall_values(runs: dict[tuple, dict], method: str,
                       stall_below: float = STALL_BELOW, dead: float = 0.1
                       ) -> dict[str, str]:
    """What the records show of ``method``'s first ill-conditioned run that stalled
    (``runs``: ``{(conditioning, method, seed): record}``) beside its first healthy
    one: ``dq_seed``; ``dq_dead``, the classes it ended with a test recall below
    ``dead``, their output scales (the conditioning's ``U``, ``dq_scales``; whether
    they are the smallest, ``dq_smallest``: "the 2 smallest of the 10") and recalls
    (``dq_recall``);
    ``dq_rows`` and ``dq_rows_ok``, the final norms of those classes' output weight
    rows in the stalled and the healthy run; ``dq_loss`` and ``dq_loss_ok``, their
    final training losses. ``–`` where a run is missing."""
    mine = [(s, r) for (c, m, s), r in sorted(runs.items())
            if (c, m) == ("ill", method)]
    low = [(s, r) for s, r in mine if r["epochs"][-1]["test_acc"] < stall_below]
    ok = [r for _, r in mine if r["epochs"][-1]["test_acc"] >= stall_below]
    if not low:
        return dict.fromkeys(("dq_seed", "dq_dead", "dq_scales", "dq_smallest",
                              "dq_recall", "dq_rows", "dq_rows_ok", "dq_loss",
                              "dq_loss_ok"), "–")
    (seed, rec), last = low[0], low[0][1]["epochs"][-1]
    cls = [k for k, a in enumerate(last["test_acc_per_class"]) if a < dead]

    def norms(r: dict) -> str:
        return name_list([f"{r['epochs'][-1]['last_layer_row_norms'][k]:,.0f}"
                          for k in cls])
    return {"dq_seed": str(seed),
            "dq_dead": name_list([str(k) for k in cls]) or "none",
            "dq_scales": name_list([f"{rec['U'][k]:.0e}" for k in cls]),
            "dq_smallest": ("" if sorted(cls) == sorted(sorted(
                range(len(rec["U"])), key=rec["U"].__getitem__)[:len(cls)]) else "not ")
            + f"the {len(cls)} smallest of the {len(rec['U'])}",
            "dq_recall": name_list([f"{pct(last['test_acc_per_class'][k], 0)} %"
                                    for k in cls]),
            "dq_rows": norms(rec), "dq_rows_ok": norms(ok[0]) if ok else "–",
            "dq_loss": f"{last['train_loss']:.2f}",
            "dq_loss_ok": f"{ok[0]['epochs'][-1]['train_loss']:.3f}" if ok else "–"}
