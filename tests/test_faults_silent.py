"""Inputs that must not pass silently: samples that all sit at one point under a fixed
bandwidth (the step, in either mode, takes the Euclidean gradient, logs why and counts
it; the reference matrices warn), a bandwidth <= 0 given to the sync-free kernel
matrices, and a directory's provenance must keep the time of interrupted calls."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import kwng
from kwng import nosync
from studies.kit.provenance import index_provenance, make_provenance


def _one_point_step(mode: str) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    pc = kwng.KWNGPreconditioner(model, lr=0.1, num_basis=3, eps=1e-5, bandwidth=1.0,
                                 mode=mode, clip_norm=None)
    X = model(torch.randn(1, 4, dtype=torch.float64).expand(8, 4))  # 8 equal samples
    info = pc.step(X.square().mean(), X)
    pc.remove_hooks()
    return {k: float(v) for k, v in info.items()}, pc.counters()


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_one_point_samples_take_the_euclidean_gradient_and_are_counted(mode, caplog):
    with caplog.at_level("WARNING"):
        info, counters = _one_point_step(mode)
    assert info["fallback"] == 1.0 and counters["fallbacks"] == 1
    assert counters["euclidean_steps"] == 1
    assert info["direction_norm"] == pytest.approx(info["grad_norm"])  # ∇L itself
    assert math.isnan(info["bandwidth"])  # no kernel was built
    assert "coincide" in caplog.text


def test_one_point_samples_warn_in_the_reference_matrices():
    X = torch.ones(8, 2, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="all 8 samples X sit at one point"):
        kwng.kernel_matrices(X, torch.arange(3), torch.tensor([0, 1, 0]),
                             kwng.GaussianKernel(1.0))


def _matrices(X, **kw):
    idx, coords = torch.arange(3), torch.tensor([0, 1, 0])
    return nosync.kernel_matrices_nosync(X, idx, coords, kwng.GaussianKernel(1.0), **kw)


@pytest.mark.parametrize("bandwidth", [2.0, None, "mean_sq", "median"])
def test_sync_free_matrices_of_one_point_samples_are_not_finite(bandwidth):
    C, _, CCt, sigma = _matrices(torch.ones(5, 2, dtype=torch.float64),
                                 bandwidth=bandwidth)
    assert not torch.isfinite(C).any() and not torch.isfinite(CCt).any()
    assert not torch.isfinite(sigma) or isinstance(bandwidth, str)  # a rule: σ = 0
    C, _, CCt, sigma = _matrices(torch.randn(5, 2, dtype=torch.float64),
                                 bandwidth=bandwidth)
    assert torch.isfinite(CCt).all() and torch.isfinite(sigma)


@pytest.mark.parametrize("bandwidth", [0, -1, float("nan"), float("inf")])
def test_sync_free_matrices_refuse_a_bandwidth_that_is_not_positive(bandwidth):
    with pytest.raises(ValueError, match=r"bandwidth must be a finite number in "
                       r"\(0, inf\)"):
        _matrices(torch.randn(5, 2, dtype=torch.float64), bandwidth=bandwidth)
    assert not hasattr(nosync, "bandwidth_tensor")  # no caller: no second home


def test_directory_provenance_keeps_the_time_of_interrupted_calls(tmp_path):
    sweep = make_provenance({"part": "sweep"}, wall_time_s=2.0, wall_time_total_s=5.0)
    flow = make_provenance({"part": "flow"}, wall_time_s=3.0)
    (tmp_path / "sweep.provenance.json").write_text(json.dumps(sweep))
    (tmp_path / "flow.provenance.json").write_text(json.dumps(flow))
    rec = index_provenance(tmp_path)
    assert rec["wall_time_s"] == 5.0 and rec["wall_time_total_s"] == 8.0
    assert json.loads((tmp_path / "provenance.json").read_text())[
        "wall_time_total_s"] == 8.0
