"""The scaling record of KWNG data-parallel as the book chapter :ref:`distributed`
shows it: :func:`scaling_table` and :func:`scaling_facts` turn the record
(:func:`studies.bench.ddp_record.load_scaling`) into the chapter's table and
the numbers its prose glues. A missing record (``None``) gives dashes, never an error.
"""

from __future__ import annotations

__all__ = ["scaling_table", "scaling_facts"]



def _row(record: dict, W: int, method: str, precision: str, capture: str) -> dict:
    return next(r for r in record["rows"] if r["world_size"] == W
                and r["method"] == method and r["precision"] == precision
                and r["capture"] == capture)


def scaling_table(record: dict, capture: str = "graph"
                  ) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows (for :func:`studies.kit.tables.markdown_table`): per
    world size and precision, the step times of SGD (DDP) and KWNG, their ratio, both
    weak-scaling efficiencies and the share of KWNG's step that its all-reduce takes
    alone; ``capture`` picks the captured (``"graph"``) or eager rows. A row timed
    eagerly although asked captured is marked ``*``."""
    head = ["GPUs", "global batch", "precision", "SGD+DDP ms", "KWNG ms", "KWNG/SGD",
            "eff. SGD", "eff. KWNG", "all-reduce share"]
    rows = []
    for W in record["world_sizes"]:
        for p in sorted({r["precision"] for r in record["rows"]}, reverse=True):
            s, k = (_row(record, W, m, p, capture) for m in record["methods"])

            def ms(r):
                star = "*" if capture == "graph" and not r["captured"] else ""
                return f"{r['median_ms']:.2f}{star}"

            share = k.get("allreduce_share")
            rows.append([str(W), str(k["global_batch"]), p, ms(s), ms(k),
                         f"{k['median_ms'] / s['median_ms']:.2f}",
                         f"{100 * s['efficiency']:.0f} %",
                         f"{100 * k['efficiency']:.0f} %",
                         "" if share is None else f"{100 * share:.0f} %"])
    return head, rows


def scaling_facts(record: dict | None, precision: str = "bf16", capture: str = "graph"
                  ) -> dict[str, str]:
    """The numbers the chapter's prose quotes, as display strings (``"—"`` without a
    record): at the largest world size, for ``precision`` and ``capture``, the
    efficiencies of SGD and KWNG, their gap in points and its side (KWNG below or above
    SGD), KWNG's all-reduce share, the world size, the devices and the largest eager
    efficiency of any row; on one GPU, the step of plain SGD and of SGD under DDP and
    the efficiency that ratio gives (what DDP's own machinery costs)."""
    keys = ("world_size", "devices", "eff_sgd", "eff_kwng", "gap", "gap_side",
            "allreduce_share", "kwng_over_sgd", "eager_max", "one_plain_ms",
            "one_ddp_ms", "one_eff_sgd")
    if record is None:
        return dict.fromkeys(keys, "—")
    W = max(record["world_sizes"])
    s, k = (_row(record, W, m, precision, capture) for m in record["methods"])
    gap = 100 * (s["efficiency"] - k["efficiency"])
    share = k.get("allreduce_share")
    devices = record["provenance"]["devices"][str(W)]
    return {"world_size": str(W), "devices": f"{W} × {devices[0]}",
            "eff_sgd": f"{100 * s['efficiency']:.0f} %",
            "eff_kwng": f"{100 * k['efficiency']:.0f} %", "gap": f"{abs(gap):.0f}",
            "gap_side": "below" if gap > 0 else "above",
            "allreduce_share": "—" if share is None else f"{100 * share:.0f} %",
            "kwng_over_sgd": f"{k['median_ms'] / s['median_ms']:.1f}",
            "eager_max": f"{100 * _eager_max(record):.0f} %",
            **_one_gpu(record, precision, capture)}


def _one_gpu(record: dict, precision: str, capture: str) -> dict[str, str]:
    plain = _row(record, 1, "sgd_plain", precision, capture)
    ddp = _row(record, 1, record["methods"][0], precision, capture)
    return {"one_plain_ms": f"{plain['median_ms']:.2f}",
            "one_ddp_ms": f"{ddp['median_ms']:.2f}",
            "one_eff_sgd": f"{100 * ddp['efficiency']:.0f} %"}


def _eager_max(record: dict) -> float:
    """The largest efficiency of an eager row (above 1 when the host-bound one-GPU
    step happened to run slower than the W-GPU one)."""
    return max(r["efficiency"] or 0.0 for r in record["rows"]
               if r["capture"] == "eager")
