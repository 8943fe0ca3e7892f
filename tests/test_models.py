"""Exact Wasserstein natural gradients against independent computations."""

import numpy as np
import pytest
import torch

import kwng

D_VALUES = [1, 2, 4]


def _setup(name, d, seed=0):
    model = kwng.make_model(name, d)
    g = torch.Generator().manual_seed(seed)
    theta = model.params_near_reference(g)  # normal: Σ well away from singular
    grad = torch.randn(model.num_params, generator=g, dtype=torch.float64)
    return model, theta, grad


@pytest.mark.parametrize("name", ["normal", "lognormal", "sphere"])
@pytest.mark.parametrize("d", D_VALUES)
def test_closed_form_solves_assembled_metric(name, d):
    """WNG = G⁻¹∇L with G assembled independently (normal: one Lyapunov solve per
    direction)."""
    model, theta, grad = _setup(name, d)
    G = model.metric(theta)
    assert torch.allclose(G, G.T)
    assert float(torch.linalg.eigvalsh(G).min()) > 0
    torch.testing.assert_close(
        model.wng(theta, grad), torch.linalg.solve(G, grad), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("name", ["normal", "lognormal", "sphere"])
@pytest.mark.parametrize("d", [1, 3])
def test_w2_finite_difference_matches_metric(name, d):
    """W2²(ρ_θ, ρ_{θ+tu}) / t² → uᵀ G_W u as t → 0 (closed-form or quantile W2)."""
    model, theta, _ = _setup(name, d, seed=1)
    u = torch.randn(
        model.num_params,
        generator=torch.Generator().manual_seed(5),
        dtype=torch.float64,
    )
    quad = float(u @ model.metric(theta) @ u)
    ratios = [model.w2_squared(theta, theta + t * u) / t ** 2 for t in (1e-2, 1e-3)]
    # the error of the quotient is O(t): it must shrink tenfold and be small at t = 1e-3
    assert abs(ratios[1] - quad) / quad < 5e-3
    assert (
        abs(ratios[1] - quad) < abs(ratios[0] - quad)
        or abs(ratios[0] - quad) / quad < 1e-6
    )


def test_normal_one_dimensional_quantile_form():
    """d = 1: W2² between normals equals ∫₀¹ (F_a⁻¹ - F_b⁻¹)² = (μa-μb)² + (σa-σb)²."""
    from scipy.integrate import quad
    from scipy.stats import norm

    model = kwng.NormalModel(1)
    a, b = (
        torch.tensor([0.3, 1.2], dtype=torch.float64),
        torch.tensor([-0.1, 0.7], dtype=torch.float64),
    )
    integral = quad(
        lambda u: ((0.3 + 1.2 * norm.ppf(u)) - (-0.1 + 0.7 * norm.ppf(u))) ** 2, 0, 1
    )[0]
    assert model.w2_squared(a, b) == pytest.approx(integral, rel=1e-8)
    # and the metric in 1-d is diag(1, 4σ²)·… : for L = σ, dΣ = 2σ dσ, A = dσ/σ, tr(AΣA)
    # = dσ²
    np.testing.assert_allclose(model.metric(a).numpy(), np.eye(2), atol=1e-12)


@pytest.mark.parametrize("name", ["lognormal", "sphere"])
def test_metric_equals_monte_carlo_of_sampler_jacobian(name):
    """For these models every velocity field is a gradient, so G = E[∂_θhᵀ ∂_θh]
    (autograd, MC)."""
    model, theta, _ = _setup(name, 2, seed=2)
    Z = model.sample_latent(200_000, torch.Generator().manual_seed(3))
    B = torch.autograd.functional.jacobian(
        lambda t: model.sample(t, Z), theta, vectorize=True, strategy="forward-mode"
    )
    G_mc = torch.einsum("njq,njr->qr", B, B) / Z.shape[0]
    G = model.metric(theta)
    assert float((G_mc - G).abs().max() / G.abs().max()) < 2e-2


def test_normal_sigma_coordinates_formula():
    """Paper's eq. (true_nat_grad) against the Lyapunov metric in (μ, s = tril Σ)
    coordinates."""
    d = 3
    rng = np.random.default_rng(0)
    A = rng.normal(size=(d, d))
    Sigma = A @ A.T + d * np.eye(d)
    il = np.tril_indices(d)
    g_mu, g_s = rng.normal(size=d), rng.normal(size=len(il[0]))
    As = []
    for i, j in zip(*il):
        S = np.zeros((d, d))
        S[i, j] = S[j, i] = 1.0
        As.append(kwng.lyapunov(Sigma, S))
    G = np.array([[np.trace(a @ Sigma @ b) for b in As] for a in As])
    nat_mu, nat_s = kwng.normal_wng_sigma_coords(Sigma, g_mu, g_s)
    np.testing.assert_allclose(nat_mu, g_mu)
    np.testing.assert_allclose(nat_s, np.linalg.solve(G, g_s), rtol=1e-9, atol=1e-12)


def test_samplers_have_the_right_law():
    g = torch.Generator().manual_seed(0)
    normal = kwng.NormalModel(2)
    theta = normal.join(
        torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    )
    X = normal.sample(theta.double(), normal.sample_latent(100_000, g))
    np.testing.assert_allclose(np.cov(X.T.numpy()), normal.covariance(theta), atol=0.05)
    sphere = kwng.HyperSphereModel(3)
    th = torch.tensor([0.0, 1.0, 2.0, np.log(2.0)], dtype=torch.float64)
    Xs = sphere.sample(th, sphere.sample_latent(1000, g))
    np.testing.assert_allclose(
        torch.linalg.vector_norm(Xs - th[:3], dim=1).numpy(), 2.0, rtol=1e-12
    )


def test_bad_theta_rejected():
    with pytest.raises(ValueError, match="theta"):
        kwng.NormalModel(2).wng(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="model"):
        kwng.make_model("cauchy", 2)
    with pytest.raises(ValueError, match="d must be"):
        kwng.NormalModel(0)
