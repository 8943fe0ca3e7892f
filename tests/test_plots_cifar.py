"""The CIFAR figures read right: a legend counts the seeds each curve averages, the
ablation figure shows every curve, the time figure is in seconds with the accuracy the
text times, and the amortized steps' colours are told apart."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from studies.cifar import figures as pc
from studies.cifar.methods import METHODS
from studies.fig3.amortized.seed_study import AMORTIZED_METHODS

matplotlib.use("Agg")


def _run(acc: float, epochs: int = 4) -> dict:
    rows = [{"test_acc": acc * (e + 1) / epochs, "train_acc": acc,
             "time_train": 10.0 * e} for e in range(epochs)]
    return {"epochs": rows, "complete": True, "config": {"epochs": epochs}}


def _results(seeds: dict[tuple[str, str], int]) -> dict:
    return {(c, m, s): _run(0.5 + 0.01 * s) for (c, m), n in seeds.items()
            for s in range(n)}


def _legend(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_seed_label_counts_each_conditioning():
    assert pc.seed_label("kwng", {"ill": 3, "well": 3}) == "kwng (n=3)"
    assert pc.seed_label("kwng", {"ill": 3, "well": 2}) == "kwng (n=3 IC, 2 WC)"
    assert pc.seed_label("kwng_k5", {"ill": 1, "well": 1}) == "kwng_k5"


def test_legend_counts_the_seeds_each_panel_averages():
    res = _results({("ill", "sgd"): 3, ("well", "sgd"): 2, ("ill", "kwng"): 3,
                    ("well", "kwng"): 3, ("well", "kwng_mom"): 2})
    fig = pc.fig_accuracy_per_epoch(res, ["sgd", "kwng", "kwng_mom"])
    assert _legend(fig) == ["sgd (n=3 IC, 2 WC)", "kwng (n=3)", "kwng_mom (n=2)"]


def test_ablation_shows_every_variant_beside_kwng():
    variants = ["kwng_D_identity", "diag_Ttilde", "kwng_kernel_rq"]
    res = _results({("ill", "kwng"): 3, **{("ill", m): 1 for m in variants}})
    fig = pc.fig_ablation(res, ["kwng", *variants])
    axes = [ax for ax in fig.axes if ax.lines]
    assert len(axes) == 2 * len(variants)
    for i, m in enumerate(variants):
        for ax in axes[2 * i: 2 * i + 2]:
            labels = [ln.get_label() for ln in ax.lines]
            assert labels == [m, "kwng"]
            # KWNG is drawn above the variant, in another line style
            var, ref = ax.lines
            assert ref.get_zorder() > var.get_zorder()
            assert ref.get_linestyle() != var.get_linestyle()
    assert "kwng (n=3)" in _legend(fig)


def test_time_figure_is_in_seconds_with_the_target_line():
    res = _results({("ill", "kwng"): 2, ("ill", "adam"): 2})
    fig = pc.fig_accuracy_vs_time(res, ["kwng", "adam"], target=0.85, xmax=25)
    test_ax = [ax for ax in fig.axes if ax.get_ylabel().startswith("test")][0]
    assert test_ax.get_xlabel() == "training time (s)"
    assert test_ax.get_xlim() == (0, 25)
    flat = [ln for ln in test_ax.lines if np.allclose(ln.get_ydata(), 85.0)]
    assert flat, "no line at 85 % test accuracy"
    kwng = next(ln for ln in test_ax.lines if ln.get_label() == "kwng")
    assert np.allclose(kwng.get_xdata(), [0, 10, 20, 30])  # seconds, not minutes
    assert "85 % test accuracy" in _legend(fig)


def _lab(hex_colour: str) -> np.ndarray:
    """CIE L*a*b* (D65) of an sRGB colour."""
    rgb = np.array(matplotlib.colors.to_rgb(hex_colour))
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ lin / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


@pytest.mark.parametrize("a", ["kwng", *AMORTIZED_METHODS])
def test_amortized_steps_are_told_apart(a):
    """Every pair of exact KWNG and its amortized steps differs by a colour difference a
    reader sees (CIE76 ΔE ≥ 25) and by line style."""
    for b in ("kwng", *AMORTIZED_METHODS):
        if a == b:
            continue
        dist = np.linalg.norm(_lab(METHODS[a].color) - _lab(METHODS[b].color))
        assert dist >= 25, (a, b, dist)
        if "kwng" not in (a, b):
            assert METHODS[a].style != METHODS[b].style, (a, b)
