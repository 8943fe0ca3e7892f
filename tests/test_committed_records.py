"""Audits of the committed benchmark records that the book reads.

The chapters glue these numbers into their prose; the checks that the committed files
are complete, say where they came from and still hold the values the text was written
against live here, not in the chapters (a chapter re-run on another card must not fail).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "results" / "benchmarks"
CONFIGS = [
    ("bf16_autocast", "channels_last"),
    ("fp32", "channels_last"),
    ("fp32", "nchw"),
]


@pytest.fixture(scope="module")
def step_cost():
    bench = json.loads((BENCH / "step_cost.json").read_text())
    rows = {
        (r["precision"], r["memory_format"], r["mode"], r["num_basis"]): r
        for r in bench["rows"]
    }
    return bench, rows


def _ms(rows, prec, fmt, mode, M=5):
    return rows[(prec, fmt, mode, None if mode.startswith("sgd") else M)]["median_ms"]


def test_step_cost_is_complete_and_has_provenance(step_cost):
    bench, rows = step_cost
    for key in ("device", "torch", "batch_size", "provenance"):
        assert bench[key], key
    assert len(bench["provenance"]["git_commit"]) >= 7
    for prec, fmt in CONFIGS:
        for mode in ("sgd", "sgd_graph"):
            assert (prec, fmt, mode, None) in rows
        for mode in ("kwng_fast", "kwng_fast_graph", "fwd_bwd_RN"):
            assert (prec, fmt, mode, 5) in rows, (prec, fmt, mode)
    for r in bench["rows"]:
        assert r["min_ms"] <= r["q25_ms"] <= r["median_ms"] <= r["q75_ms"]


@pytest.mark.parametrize(
    "prec, fmt, t, lim, eager, graph",
    [
        ("bf16_autocast", "channels_last", 11.4, 0.83, 1.34, 3.64),
        ("fp32", "channels_last", 21.9, 0.94, 3.22, 4.50),
        ("fp32", "nchw", 21.8, 0.57, 2.53, 2.95),
    ],
)
def test_step_cost_values_the_appendix_was_written_against(
    step_cost, prec, fmt, t, lim, eager, graph
):
    _, rows = step_cost
    g = _ms(rows, prec, fmt, "kwng_fast_graph")
    assert round(g, 1) == t
    assert round(g / _ms(rows, prec, fmt, "fwd_bwd_RN"), 2) == lim
    assert round(g / _ms(rows, prec, fmt, "sgd"), 2) == eager
    assert round(g / _ms(rows, prec, fmt, "sgd_graph"), 2) == graph


def test_step_cost_limit_and_large_basis(step_cost):
    _, rows = step_cost
    cl = ("fp32", "channels_last")
    assert round(_ms(rows, *cl, "fwd_bwd_RN") / _ms(rows, *cl, "sgd"), 2) == 3.43
    assert round(_ms(rows, "fp32", "nchw", "fwd_bwd_RN"), 1) == 38.3
    bf = ("bf16_autocast", "channels_last")
    assert round(_ms(rows, *bf, "kwng_fast_graph", 20), 1) == 44.2
    assert round(_ms(rows, *bf, "kwng_reference", 20), 1) == 123.3


def test_precond_exactness_record():
    exact = json.loads((BENCH / "precond_exactness.json").read_text())
    res = exact["results"]
    assert exact["provenance"]["device"]
    assert res["float64"]["rel_err_T_fast_vs_serial_fp64"] < 1e-13
    assert round(res["float64"]["rel_err_T_serial_fp32_vs_fp64"], 4) == 0.0029
    assert max(res[c]["rel_err_T"] for c in ("fp32_nchw", "fp32_channels_last")) < 4e-3
    bf = res["bf16_channels_last"]
    assert round(bf["rel_err_g"], 2) == 0.31
    assert round(bf["rel_err_g_plain_autograd_same_config"], 2) == 0.31
