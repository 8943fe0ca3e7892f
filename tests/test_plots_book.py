"""The book's figure style, its colour table and the findings helpers of ten_minutes."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest

from studies.bench import findings as bench_findings
from studies.kit.live import plot_error_vs_n
from studies.kit.style import (
    BOOK_STYLE,
    FIG_WIDTH_IN,
    METHOD_COLORS,
    grid_ticks,
    method_color,
)
from studies.synthetic import findings

matplotlib.use("Agg")


def test_every_method_has_its_own_colour_and_an_unknown_one_raises():
    colours = [matplotlib.colors.to_hex(c) for c in METHOD_COLORS.values()]
    assert len(set(colours)) == len(colours)
    assert method_color("kwng") == METHOD_COLORS["kwng"]
    with pytest.raises(ValueError, match="no colour for method 'nope'.*kwng"):
        method_color("nope")


def test_the_smallest_text_stays_readable_on_a_phone():
    # a figure FIG_WIDTH_IN wide shown 342 px wide: 342 / (72 FIG_WIDTH_IN) px per pt
    smallest = min(v for k, v in BOOK_STYLE.items() if "size" in k)
    assert smallest * 342 / (72 * FIG_WIDTH_IN) >= 7.0


def test_grid_ticks_keeps_the_ends_and_at_most_four_labels():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    grid_ticks(ax, [100, 200, 500, 1000, 2000, 5000, 10000])
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "100" and labels[-1] == "10000" and len(labels) <= 4
    plt.close(fig)


def test_error_figure_checks_its_input():
    with pytest.raises(ValueError, match="errors must be"):
        plot_error_vs_n([10, 20], np.ones((3, 2)))
    fig = plot_error_vs_n([10, 20, 40], np.ones((3, 2)))
    assert fig.get_figwidth() <= FIG_WIDTH_IN


def _rows(panel, x, values):
    return [
        {"panel": panel, "d": d, x: v, "N": v if x == "N" else 100, "M": 10,
         "bandwidth_spec": v, "run": r, "error": err(d, v)}
        for d, err in ((1, lambda d, v: v**-0.5), (2, lambda d, v: 2 * v**-0.5))
        for v in values
        for r in range(3)
    ]


def test_relerr_headline_fits_the_slope_at_the_largest_dimension():
    h = findings.relerr_headline(_rows("N", "N", [100, 400, 1600]))
    assert h["d"] == 2 and h["N"] == 1600
    assert h["slope"] == pytest.approx(-0.5)
    assert h["median"] == pytest.approx(2 / 40)


def test_bandwidth_range_and_divergence_step():
    rows = _rows("sigma", "bandwidth_spec", [0.1, 1.0, 10.0])
    # errors 2/sqrt(σ): within a factor 2 of the best (σ = 10) only from σ = 10/4 on
    assert findings.bandwidth_range(rows) == (10.0, 10.0)
    assert findings.divergence_step([1.0, 0.5, math.inf, math.nan]) == 2
    assert findings.divergence_step([1.0, 0.5]) is None


def test_step_cost_ratio_reads_graph_rows():
    def row(mode, ms, M=None):
        return {"precision": "bf16_autocast", "memory_format": "channels_last",
                "mode": mode, "num_basis": M, "median_ms": ms}

    record = {"rows": [row("sgd_graph", 2.0), row("kwng_fast_graph", 7.0, 5)]}
    assert bench_findings.step_cost_ratio(record) == pytest.approx(3.5)


def test_every_cifar_method_has_its_own_colour():
    """A CIFAR method's colour is in its record; no two methods of the book share one
    (the CIFAR KWNG has the colour of the flows' "kwng")."""
    from studies.cifar.methods import METHODS

    cifar = {m: r.color for m, r in METHODS.items()}
    assert cifar["kwng"] == METHOD_COLORS["kwng"]
    every = {**METHOD_COLORS, **cifar}
    colours = [matplotlib.colors.to_hex(c) for c in every.values()]
    assert len(set(colours)) == len(colours)
