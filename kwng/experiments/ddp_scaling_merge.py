"""The merge of :mod:`kwng.experiments.ddp_scaling`: one record from the per-``W``
files, with the weak-scaling efficiency of every row and the summary that issue 24's
target reads (book chapter :ref:`distributed`)."""

from __future__ import annotations

import os

from ..provenance import make_provenance, read_json
from .ddp_scaling import CAPTURES, PLAIN, PRECISIONS

__all__ = ["merge", "TARGET_POINTS"]

#: The target of issue 24, in points: KWNG's efficiency at most this far below SGD's
TARGET_POINTS = 10.0


def _family(method: str) -> str:
    return "kwng" if method.startswith("kwng") else "sgd"


def merge(parts: list[str | os.PathLike]) -> dict:
    """One record from the per-``W`` files: every row with ``world_size``,
    ``efficiency`` (``t_plain(W=1) / t``, same method family, precision and capture;
    ``None`` for the plain rows themselves) and ``allreduce_share`` (the step's
    all-reduce timed alone ÷ the step), the collectives per ``W``, and a ``summary`` at
    the largest ``W``: both efficiencies, their gap in points and whether KWNG is within
    10 points of SGD (the target of issue 24)."""
    recs = sorted((read_json(p) for p in parts), key=lambda r: r["world_size"])
    sizes = [r["world_size"] for r in recs]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"the parts must have distinct world sizes, got {sizes}")
    for key in ("model", "per_rank_batch", "num_basis", "q"):
        if len({r[key] for r in recs}) != 1:
            raise ValueError(f"the parts disagree on {key}: {[r[key] for r in recs]}")
    base = {(_family(r["method"]), r["precision"], r["capture"]): r["median_ms"]
            for rec in recs if rec["world_size"] == 1 for r in rec["rows"]
            if r["method"] in PLAIN.values()}
    rows = []
    for rec in recs:
        coll = rec.get("collectives", {})
        for r in rec["rows"]:
            fam = _family(r["method"])
            t1 = base.get((fam, r["precision"], r["capture"]))
            ar = coll.get(f"allreduce_{fam}", {}).get("median_ms")
            plain = r["method"] in PLAIN.values()
            eff = None if plain or t1 is None else t1 / r["median_ms"]
            rows.append({**r, "world_size": rec["world_size"],
                         "global_batch": rec["global_batch"], "efficiency": eff,
                         "allreduce_ms": None if plain else ar,
                         "allreduce_share": None if plain or ar is None
                         else ar / r["median_ms"]})
    top = max(sizes)
    summary = []
    for precision in PRECISIONS:
        for capture in CAPTURES:
            eff = {r["method"]: r["efficiency"] for r in rows if r["world_size"] == top
                   and r["precision"] == precision and r["capture"] == capture}
            if eff.get("sgd_ddp") is None or eff.get("kwng") is None:
                continue
            gap = 100 * (eff["sgd_ddp"] - eff["kwng"])
            summary.append({"world_size": top, "precision": precision,
                            "capture": capture, "efficiency_sgd": eff["sgd_ddp"],
                            "efficiency_kwng": eff["kwng"],
                            "gap_points": gap,
                            "within_target": gap <= TARGET_POINTS})
    first = recs[0]
    prov = make_provenance(
        {"parts": [str(p) for p in parts],
         "part_configs": {r["world_size"]: r["provenance"]["config"] for r in recs}},
        seeds={r["world_size"]: r["provenance"]["seeds"] for r in recs},
        device=None, devices={r["world_size"]: r["devices"] for r in recs},
        driver=os.environ.get("KWNG_DDP_DRIVER"),
        part_commands={r["world_size"]: r["provenance"]["command"] for r in recs},
        part_dates={r["world_size"]: r["provenance"]["date"] for r in recs},
        wall_time_s=sum(r["provenance"].get("wall_time_s") or 0.0 for r in recs))
    prov["device"] = f"{top} × {recs[-1]['devices'][0]}"
    return {"benchmark": "ddp_scaling", "model": first["model"], "q": first["q"],
            "per_rank_batch": first["per_rank_batch"], "num_basis": first["num_basis"],
            "world_sizes": sizes, "rows": rows,
            "collectives": {r["world_size"]: r.get("collectives") for r in recs},
            "capture_fallbacks": {r["world_size"]: r["capture_fallbacks"]
                                  for r in recs},
            "summary": summary, "provenance": prov}
