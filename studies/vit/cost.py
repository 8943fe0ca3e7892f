"""The ViT's step cost on one GPU, read from its committed record
(``results/vit/step_cost_vit.json``, written by ``python -m studies.bench.step_cost
--model vit ...``; the command is in ``studies/vit/README.md``): each captured step's
median time over the captured SGD step's, measured side by side in one run. The study's
target for the fast path is a captured exact KWNG step at most :data:`TARGET` captured
SGD steps, as on the ResNet-18."""

from __future__ import annotations

import os
from pathlib import Path

from studies.kit.paths import RESULTS
from studies.kit.provenance import read_json

__all__ = ["STEP_COST", "TARGET", "captured_ratios"]

#: the committed step-cost record of the ViT
#:
#: :meta hide-value:
STEP_COST = RESULTS / "vit" / "step_cost_vit.json"
#: a captured exact KWNG step over a captured SGD step, at most
TARGET = 4.0


def captured_ratios(path: str | os.PathLike = STEP_COST) -> dict[str, float]:
    """``{"adam", "kwng_k<k>", ...}``: the median time of each captured step of the
    record over the captured SGD step's (``kwng_k1`` the exact step, ``kwng_k20`` the
    kernel system rebuilt every 20 steps). Raises ``ValueError`` when the record has
    no captured SGD row."""
    rec = read_json(Path(path))
    rows = rec["rows"]
    sgd = [r["median_ms"] for r in rows if r["mode"] == "sgd_graph"]
    if not sgd:
        raise ValueError(f"{path} has no captured SGD row (mode 'sgd_graph'): rows "
                         f"{sorted({r['mode'] for r in rows})}")
    out = {}
    for r in rows:
        if r["mode"] == "adam_graph":
            out["adam"] = r["median_ms"] / sgd[0]
        elif r["mode"] == "kwng_fast_graph":
            out[f"kwng_k{int(r.get('refresh_every') or 1)}"] = r["median_ms"] / sgd[0]
    return out
