"""The parametrisations of the Fig. 2 study (studies.synthetic.flow_study): gradients
against finite differences, exact WNGs against the metric, the normal-model helper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kwng
from kwng.theory import wng as theory
from studies.synthetic import flow_study as fs


def _cfg(d=3):
    cfg = fs.study_config("small")
    cfg.update(d=d)
    return cfg


def _fd_grad(loss, th, h=1e-6):
    g = torch.zeros_like(th)
    for i in range(th.numel()):
        e = torch.zeros_like(th)
        e[i] = h
        g[i] = (loss(th + e) - loss(th - e)) / (2 * h)
    return g


@pytest.mark.parametrize("param", ["cholesky", "sigma_coords", "diagonal"])
def test_gradient_matches_finite_differences(param):
    p = fs.make_problem(param, _cfg())
    th = p.theta0 + 0.01 * torch.randn(p.theta0.numel(), dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(0))
    _, g = p.loss_grad(th)
    fd = _fd_grad(lambda t: p.loss_grad(t)[0], th)
    torch.testing.assert_close(g, fd, rtol=1e-5, atol=1e-6)


def test_wng_in_sigma_coords_is_the_pushforward_of_the_cholesky_one():
    cfg = _cfg()
    chol, sig = fs.make_problem("cholesky", cfg), fs.make_problem("sigma_coords", cfg)
    d = chol.d
    _, g_l = chol.loss_grad(chol.theta0)
    _, g_s = sig.loss_grad(sig.theta0)
    nat_l, nat_s = chol.wng(chol.theta0, g_l), sig.wng(sig.theta0, g_s)
    model = kwng.NormalModel(d)
    _, L = model.split(chol.theta0)
    J = torch.from_numpy(model.jacobian_s_l(L.numpy()))
    # a tangent vector in vech L maps to J · (it) in tril Σ
    torch.testing.assert_close(nat_s[d:], J @ nat_l[d:], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(nat_s[:d], nat_l[:d])


def test_diagonal_family_has_identity_metric():
    p = fs.make_problem("diagonal", _cfg(d=2))
    Z, w = theory.gauss_hermite_latent(2, 8)
    G = theory.pullback_metric(lambda t: p.sample(t, Z), p.theta0, w)
    torch.testing.assert_close(G, torch.eye(4, dtype=G.dtype), rtol=0, atol=1e-12)
    _, g = p.loss_grad(p.theta0)
    torch.testing.assert_close(p.wng(p.theta0, g), g)


def test_exact_flow_converges_and_kwng_runs():
    cfg = _cfg(d=2)
    p = fs.make_problem("diagonal", cfg)
    settings = {k: cfg[k] for k in ("N", "M", "eps", "lam", "damping", "bandwidth",
                                     "sigma0")}
    settings.update(N=64, M=8)
    out = fs.run_variant_flow(p, settings, iterations=5, step=0.1)
    wng = np.array(out["wng"]["loss"])
    np.testing.assert_allclose(wng[1:] / wng[:-1], 0.64, rtol=1e-10)  # (1 - 2·0.1)²
    assert len(out["kwng"]["loss"]) == 6
    errs = fs.direction_error(p, settings, draws=2)
    assert len(errs) == 2 and all(np.isfinite(errs))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="parametrisation"):
        fs.make_problem("polar", _cfg())
    with pytest.raises(ValueError, match="scale"):
        fs.study_config("huge")
    p = fs.make_problem("diagonal", _cfg(d=2))
    with pytest.raises(ValueError, match="draws"):
        fs.direction_error(p, {}, draws=0)
    with pytest.raises(ValueError, match="iterations"):
        fs.run_variant_flow(p, {}, iterations=0, step=0.1)


def test_params_near_reference_is_the_recipe():
    """θ₀ + ξ: the normal model's draw is the paper's with I added to L (bit for bit,
    the draw of the committed sweeps); the other models' draw is the paper's."""
    model = kwng.NormalModel(3)
    theta = model.random_params(torch.Generator().manual_seed(5))
    mu, L = model.split(theta)
    recipe = model.join(mu, L + torch.eye(3, dtype=L.dtype))
    near = model.params_near_reference(torch.Generator().manual_seed(5))
    torch.testing.assert_close(near, recipe, rtol=0, atol=0)
    _, L_near = model.split(near)
    assert float(torch.linalg.cond(L_near @ L_near.T)) < 10  # well conditioned
    for name in ("lognormal", "sphere"):
        other = kwng.make_model(name, 3)
        torch.testing.assert_close(
            other.params_near_reference(torch.Generator().manual_seed(5), 0.3),
            other.random_params(torch.Generator().manual_seed(5), 0.3), rtol=0, atol=0)
