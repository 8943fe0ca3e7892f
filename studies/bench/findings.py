"""The benchmarks' headline finding every page quotes: a KWNG step's cost in SGD steps,
read from the committed step-cost record."""

from __future__ import annotations

from pathlib import Path

from studies.bench.figures import step_rows

__all__ = ["step_cost_ratio", "STEP_COST_RECORD"]


#: the step-cost record every page quotes a KWNG step's cost in SGD steps from (under
#: ``results/``): the table of the GPU appendix, measured with the book's code
#:
#: :meta hide-value:
STEP_COST_RECORD = Path("benchmarks") / "recheck" / "step_cost_after.json"


def step_cost_ratio(record: dict, precision: str = "bf16_autocast",
                    layout: str = "channels_last", num_basis: int = 5) -> float:
    """The KWNG step (fast path, replayed from a CUDA graph) in SGD steps replayed the
    same way, from the step-cost record (:mod:`studies.bench.step_cost`;
    the pages read :data:`STEP_COST_RECORD`)."""
    rows = step_rows(record)
    kwng = rows[(precision, layout, "kwng_fast_graph", num_basis)]["median_ms"]
    sgd = rows[(precision, layout, "sgd_graph", None)]["median_ms"]
    return kwng / sgd
