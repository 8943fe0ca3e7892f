"""The early-stop rule of the Fig. 3 protocol (book chapter :ref:`cifar-fig3`).

A step-size grid spends most of its GPU time on steps that cannot win. The protocol,
fixed before its first run (``results/cifar/fig3/protocol.json``), stops a grid run only
when it cannot be selected, for one of three reasons, checked after every epoch ``e`` on
the validation accuracy (the split held out of the training set; the test set plays no
part):

* ``"non-finite loss"``: the training loss is not finite;
* ``"at chance"``: ``e ≥ 10`` and the validation accuracy is below chance plus
  :data:`CHANCE_MARGIN` (12 % on CIFAR-10);
* ``"behind"``: ``e ≥ 30`` and a run of the same method, conditioning and seed at
  another step of the grid reached at least :data:`GAP` (25 points) more validation
  accuracy at the same epoch ``e``.

The third reason compares with the records that exist when the epoch ends: a run ahead
of its siblings is compared at a later epoch, once they have reached it. A stopped run
keeps its record with ``"early_stop": {"reason", "epoch", ...}`` and counts as finished.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from kwng.experiments.provenance import ResultFileError, read_json

log = logging.getLogger(__name__)

#: "at chance" means below ``1 / classes + CHANCE_MARGIN`` validation accuracy
CHANCE_MARGIN = 0.02
#: the first epoch at which "at chance" stops a run
CHANCE_EPOCH = 10
#: "behind" means at least this much validation accuracy (a fraction) below a sibling
GAP = 0.25
#: the first epoch at which "behind" stops a run
GAP_EPOCH = 30
#: the rule's constants as the protocol file states them (tested against it)
RULE = {"chance_margin": CHANCE_MARGIN, "chance_epoch": CHANCE_EPOCH, "gap": GAP,
        "gap_epoch": GAP_EPOCH}

__all__ = ["CHANCE_MARGIN", "CHANCE_EPOCH", "GAP", "GAP_EPOCH", "RULE",
           "sibling_rows", "stop_reason"]


def sibling_rows(rdir: str | Path) -> dict[str, list[dict]]:
    """The per-epoch rows of the runs of the same dataset, conditioning, method and seed
    at the other step sizes of the grid: ``rdir`` is
    ``<root>/lr<lr>/<dataset>/<conditioning>/<method>/seed<k>`` and the siblings are
    ``<root>/lr*/...`` with the same tail. Returns ``{"lr<lr>": rows}``; a sibling whose
    record cannot be read now (being written by another process) is skipped with a
    warning."""
    rdir = Path(rdir)
    lr_dir = rdir.parents[3]
    tail = rdir.relative_to(lr_dir)
    out = {}
    for d in sorted(lr_dir.parent.glob("lr*")):
        mp = d / tail / "metrics.json"
        if d == lr_dir or not mp.is_file():
            continue
        try:
            rec = read_json(mp)
        except ResultFileError as exc:
            log.warning("early stop: sibling %s not read (%s)", mp, exc)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("epochs"), list):
            out[d.name] = rec["epochs"]
    return out


def stop_reason(row: dict, siblings: dict[str, list[dict]],
                num_classes: int) -> dict | None:
    """Why the run whose latest epoch is ``row`` (with ``epoch``, ``train_loss`` and
    ``val_acc``) stops under the Fig. 3 rule, or ``None`` to go on. ``siblings`` maps
    each other step's name to its rows (:func:`sibling_rows`)."""
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    e, acc = int(row["epoch"]), float(row["val_acc"])
    if not math.isfinite(row["train_loss"]) or not math.isfinite(acc):
        return {"reason": "non-finite loss", "epoch": e}
    chance = 1.0 / num_classes + CHANCE_MARGIN
    if e >= CHANCE_EPOCH and acc < chance:
        return {"reason": "at chance", "epoch": e, "val_acc": acc,
                "threshold": chance}
    if e < GAP_EPOCH:
        return None
    for name, rows in sorted(siblings.items()):
        same = [r for r in rows if r.get("epoch") == e]
        other = float(same[0].get("val_acc", math.nan)) if same else math.nan
        if math.isfinite(other) and other - acc >= GAP:
            return {"reason": "behind", "epoch": e, "val_acc": acc, "sibling": name,
                    "sibling_val_acc": other}
    return None
