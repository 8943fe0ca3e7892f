"""kwng.theory.wng: each function against an independent computation (book's theory
chapters)."""

import math

import numpy as np
import pytest
import torch

import kwng
from kwng import fisher_exact
from kwng.theory import nystrom as nys
from kwng.theory import wng as th


def _normal(d=2, seed=0):
    model = kwng.NormalModel(d)
    g = torch.Generator().manual_seed(seed)
    theta = model.random_params(g)
    mu, L = model.split(theta)
    theta = model.join(mu, L + torch.eye(d, dtype=L.dtype))
    grad = torch.randn(model.num_params, generator=g, dtype=torch.float64)
    return model, theta, grad, g


def test_gauss_hermite_latent_moments():
    Z, w = th.gauss_hermite_latent(2, 6)
    assert Z.shape == (36, 2) and abs(float(w.sum()) - 1) < 1e-14
    torch.testing.assert_close(w @ Z ** 2, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(w @ Z[:, 0] ** 4, torch.tensor(3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_nodes"):
        th.gauss_hermite_latent(2, 0)


def test_circle_latent_is_uniform():
    Z, w = th.circle_latent(16)
    torch.testing.assert_close(
        w @ Z, torch.zeros(2, dtype=torch.float64), atol=1e-14, rtol=0
    )
    torch.testing.assert_close(w @ Z[:, 0] ** 2, torch.tensor(0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_nodes"):
        th.circle_latent(2)


@pytest.mark.parametrize(
    "name,d", [("sphere", 2), ("sphere", 3), ("normal", 1), ("lognormal", 2)]
)
def test_pullback_metric_is_wasserstein_for_gradient_fields(name, d):
    """For models whose velocity fields are gradients, E[∂hᵀ∂h] is the closed-form
    G_W."""
    model = kwng.make_model(name, d)
    theta = model.random_params(torch.Generator().manual_seed(1))
    if name == "sphere" and d == 2:
        Z, w = th.circle_latent(32)
    elif name == "sphere":
        Z, w = model.sample_latent(40000, torch.Generator().manual_seed(2)), None
    else:
        Z, w = th.gauss_hermite_latent(d, 12)
    G = th.pullback_metric(lambda t: model.sample(t, Z), theta, w)
    tol = 3e-2 if w is None else 1e-8
    torch.testing.assert_close(G, model.metric(theta), rtol=tol, atol=tol)


def test_pullback_metric_upper_bounds_normal_metric():
    """In d = 2 the normal's fields are not all gradients: E[∂hᵀ∂h] - G_W is PSD and
    non-zero."""
    model, theta, _, _ = _normal(2)
    Z, w = th.gauss_hermite_latent(2, 6)
    diff = th.pullback_metric(lambda t: model.sample(t, Z), theta, w) - model.metric(
        theta
    )
    ev = torch.linalg.eigvalsh(diff)
    assert float(ev.min()) > -1e-10 and float(ev.max()) > 1e-3


def test_pullback_wng_matches_model_wng():
    model = kwng.HyperSphereModel(2)
    theta = model.random_params(torch.Generator().manual_seed(0))
    Z, w = th.circle_latent(32)
    target = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    loss = lambda t: ((t - target) ** 2).sum()  # noqa: E731
    torch.testing.assert_close(
        th.pullback_wng(lambda t: model.sample(t, Z), loss, theta, w),
        model.wng(theta, 2 * (theta - target)),
    )


def test_integrate_flow_orders():
    """ẋ = -x: Euler error O(step), RK4 error O(step⁴)."""
    x0 = torch.tensor([1.0], dtype=torch.float64)
    errs = {}
    for method in ("euler", "rk4"):
        errs[method] = [
            abs(
                float(
                    th.integrate_flow(
                        lambda x: -x, x0, step=h, t_end=1.0, method=method
                    )[-1, 0]
                )
                - math.exp(-1)
            )
            for h in (0.1, 0.05)
        ]
    assert 1.8 < errs["euler"][0] / errs["euler"][1] < 2.2
    assert 14 < errs["rk4"][0] / errs["rk4"][1] < 18
    with pytest.raises(ValueError, match="t_end / step"):
        th.integrate_flow(lambda x: -x, x0, step=0.3, t_end=1.0)


def _sphere_flows(step):
    """WNG and Euclidean flows of W2² to a target sphere, in θ and in ψ = Ψ(θ)."""
    model = kwng.HyperSphereModel(2)
    Z, w = th.circle_latent(16)
    target = torch.tensor([1.0, -0.5], dtype=torch.float64), 2.0

    def loss(t):
        return ((t[:2] - target[0]) ** 2).sum() + (t[2].exp() - target[1]) ** 2

    def Psi(t):
        return torch.stack([t[0] + t[1] ** 2, torch.sinh(t[1]), t[2] + 0.5 * t[0]])

    def Psi_inv(p):
        m2 = torch.asinh(p[1])
        m1 = p[0] - m2 ** 2
        return torch.stack([m1, m2, p[2] - 0.5 * m1])

    loss_psi = lambda p: loss(Psi_inv(p))  # noqa: E731
    s_theta = lambda t: model.sample(t, Z)  # noqa: E731
    s_psi = lambda p: model.sample(Psi_inv(p), Z)  # noqa: E731
    theta0 = torch.tensor([0.2, 0.1, -0.3], dtype=torch.float64)
    out = {}
    th_w = th.integrate_flow(
        lambda t: -th.pullback_wng(s_theta, loss, t, w), theta0, step=step, t_end=0.5
    )
    ps_w = th.integrate_flow(
        lambda p: -th.pullback_wng(s_psi, loss_psi, p, w),
        Psi(theta0),
        step=step,
        t_end=0.5,
    )
    out["wng"] = float((Psi(th_w[-1]) - ps_w[-1]).norm())

    def egrad(fn, x):
        x = x.clone().requires_grad_(True)
        return torch.autograd.grad(fn(x), x)[0]

    th_e = th.integrate_flow(lambda t: -egrad(loss, t), theta0, step=step, t_end=0.5)
    ps_e = th.integrate_flow(
        lambda p: -egrad(loss_psi, p), Psi(theta0), step=step, t_end=0.5
    )
    out["euclid"] = float((Psi(th_e[-1]) - ps_e[-1]).norm())
    return out


def test_invariance_gap_shrinks_with_step():
    """Prop. 1: the WNG flows in θ and ψ agree up to O(step); Euclidean flows do not."""
    a, b = _sphere_flows(0.05), _sphere_flows(0.0125)
    assert b["wng"] < a["wng"] / 3
    assert b["euclid"] > 0.1 and b["euclid"] > 50 * b["wng"]


def test_normal_fisher_matches_kl_second_order():
    """KL(ρ_θ ‖ ρ_{θ+tu}) / t² → ½ uᵀ G_F u."""
    model, theta, _, g = _normal(2)
    u = torch.randn(model.num_params, generator=g, dtype=torch.float64)

    def kl(ta, tb):
        Sa, Sb = (
            torch.from_numpy(model.covariance(ta)),
            torch.from_numpy(model.covariance(tb)),
        )
        dm = model.split(tb)[0] - model.split(ta)[0]
        Sbi = torch.linalg.inv(Sb)
        return 0.5 * (
            torch.trace(Sbi @ Sa)
            + dm @ Sbi @ dm
            - 2
            + torch.logdet(Sb)
            - torch.logdet(Sa)
        )

    t = 1e-4
    quad = float(u @ fisher_exact.normal_fisher_matrix(model, theta) @ u)
    assert abs(float(kl(theta, theta + t * u)) / t ** 2 - 0.5 * quad) < 1e-3 * quad
    with pytest.raises(ValueError, match="model"):
        fisher_exact.normal_fisher_matrix(kwng.HyperSphereModel(2), theta)


@pytest.mark.parametrize("metric", ["wasserstein", "fisher"])
def test_dual_optimum_equals_half_quadratic_form(metric):
    """Props. 2 and 3: sup over quadratics = ½ uᵀ G u on the normal model (exact
    quadrature)."""
    model, theta, _, g = _normal(2)
    u = torch.randn(model.num_params, generator=g, dtype=torch.float64)
    Z, w = th.gauss_hermite_latent(2, 8)
    opt = th.dual_optimum(
        lambda t: model.sample(t, Z),
        theta,
        u,
        th.polynomial_features(2, 2),
        metric=metric,
        weights=w,
    )
    G = (
        model.metric(theta)
        if metric == "wasserstein"
        else fisher_exact.normal_fisher_matrix(model, theta)
    )
    assert abs(opt.value - 0.5 * float(u @ G @ u)) < 1e-9 * opt.value
    # the objective at the optimal function equals the optimum, and is lower elsewhere
    f = lambda X: th.polynomial_features(2, 2)(X) @ opt.beta[:, None]  # noqa: E731
    val = th.dual_objective(
        lambda t: model.sample(t, Z), theta, u, f, metric=metric, weights=w
    )
    assert abs(val - opt.value) < 1e-9 * opt.value

    def f2(X):
        return th.polynomial_features(2, 2)(X) @ (0.5 * opt.beta[:, None])

    assert (
        th.dual_objective(
            lambda t: model.sample(t, Z), theta, u, f2, metric=metric, weights=w
        )
        < val
    )


def test_distributional_gradient_matches_finite_difference():
    model, theta, _, g = _normal(2)
    u = torch.randn(model.num_params, generator=g, dtype=torch.float64)
    Z, w = th.gauss_hermite_latent(2, 8)
    feats = th.rbf_features(
        torch.tensor([[0.3, -0.2], [1.0, 0.5]], dtype=torch.float64), 0.7
    )
    b = th.distributional_gradient(lambda t: model.sample(t, Z), theta, u, feats, w)
    h = 1e-6
    fd = (
        w @ feats(model.sample(theta + h * u, Z))
        - w @ feats(model.sample(theta - h * u, Z))
    ) / (2 * h)
    torch.testing.assert_close(b, fd, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="u must"):
        th.distributional_gradient(lambda t: model.sample(t, Z), theta, u[:2], feats, w)


def test_fisher_dual_unbounded_on_sphere_wasserstein_bounded():
    """No density: f_a(x) = a(‖x−μ‖ − r) vanishes on the sphere but has slope a across
    it."""
    model = kwng.HyperSphereModel(2)
    theta = torch.tensor([0.0, 0.0, math.log(1.5)], dtype=torch.float64)
    Z, w = th.circle_latent(16)
    u = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    vals_f, vals_w = [], []
    for a in (1.0, 10.0, 100.0):
        f = lambda X, a=a: a * (X.norm(dim=1, keepdim=True) - 1.5)  # noqa: E731
        s = lambda t: model.sample(t, Z)  # noqa: E731
        vals_f.append(th.dual_objective(s, theta, u, f, metric="fisher", weights=w))
        vals_w.append(
            th.dual_objective(s, theta, u, f, metric="wasserstein", weights=w)
        )
    assert vals_f == pytest.approx([1.5, 15.0, 150.0])
    assert max(vals_w) <= 0.5 * 1.5 ** 2 + 1e-12


def test_negative_sobolev_dirac_unbounded():
    """App. B.3: for δ_θ vs δ_{θ+εu} the Sobolev dual grows like a with f = -a‖x−θ‖²."""
    theta = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    u = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    eps = 1e-2
    vals = [
        th.negative_sobolev_objective(
            lambda X, a=a: -a * ((X - theta) ** 2).sum(1, keepdim=True),
            theta,
            theta + eps * u,
        )
        / eps
        for a in (1.0, 1e3)
    ]
    assert vals[1] == pytest.approx(1e3 * vals[0]) and vals[0] == pytest.approx(
        eps * 5.0
    )


def test_rbf_dual_optimum_approaches_metric_from_below():
    model, theta, _, g = _normal(1)
    u = torch.tensor([0.3, 1.0], dtype=torch.float64)
    Z, w = th.gauss_hermite_latent(1, 40)
    exact = 0.5 * float(u @ model.metric(theta) @ u)
    centres = torch.linspace(-4, 4, 25, dtype=torch.float64)[:, None]
    opt = th.dual_optimum(
        lambda t: model.sample(t, Z), theta, u, th.rbf_features(centres, 0.5), weights=w
    )
    assert opt.value <= exact * (1 + 1e-9) and opt.value > 0.99 * exact


def _problem(N=40, d=2, seed=0):
    model, theta, grad, g = _normal(d, seed)
    Z = model.sample_latent(N, g)
    return model, theta, grad, (lambda t: model.sample(t, Z))


@pytest.mark.parametrize("lam", [1e-1, 1e-3])
def test_brute_force_three_routes_agree(lam):
    """Prop. 4 (dual), Prop. 5/6 (closed form) and the minimax-exchanged metric
    route."""
    model, theta, grad, s = _problem()
    r = nys.rkhs_brute_force(
        s, theta, grad, eps=1e-2, lam=lam, kernel=kwng.GaussianKernel(1.0)
    )
    assert kwng.relative_error(r.direction_dual, r.direction_closed) < 1e-5
    assert kwng.relative_error(r.direction_metric, r.direction_closed) < 1e-5
    assert r.alpha.shape == (40, 2)
    with pytest.raises(ValueError, match="eps"):
        nys.rkhs_brute_force(
            s, theta, grad, eps=0.0, lam=lam, kernel=kwng.GaussianKernel(1.0)
        )


def test_brute_force_limits():
    """λ → ∞: Ĝ → 0 so ĝ → ∇L/ε; λ = 0 on the sphere: Ĝ → empirical E[∂hᵀ∂h]."""
    model, theta, grad, s = _problem()
    r = nys.rkhs_brute_force(
        s, theta, grad, eps=0.5, lam=1e8, kernel=kwng.GaussianKernel(1.0)
    )
    assert kwng.relative_error(r.direction_closed, grad / 0.5) < 1e-6
    sph = kwng.HyperSphereModel(2)
    Z = sph.sample_latent(30, torch.Generator().manual_seed(0))
    ts = sph.random_params(torch.Generator().manual_seed(1))
    r = nys.rkhs_brute_force(
        lambda t: sph.sample(t, Z),
        ts,
        torch.ones(3, dtype=torch.float64),
        eps=1e-3,
        lam=1e-10,
        kernel=kwng.GaussianKernel(1.0),
    )
    Gp = th.pullback_metric(lambda t: sph.sample(t, Z), ts)
    assert kwng.relative_error(r.metric, Gp) < 1e-3


def test_full_derivative_basis_layout():
    idx, coords = nys.full_derivative_basis(torch.tensor([4, 7]), 3)
    assert idx.tolist() == [4, 4, 4, 7, 7, 7] and coords.tolist() == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="basis_idx"):
        nys.full_derivative_basis(torch.tensor([0.5]), 2)


def test_sutherland_with_all_points_is_brute_force():
    model, theta, grad, s = _problem()
    kw = dict(eps=1e-2, lam=1e-2, kernel=kwng.GaussianKernel(1.0))
    r = nys.rkhs_brute_force(s, theta, grad, **kw)
    su = nys.sutherland_kwng_gradient(
        s, theta, grad, num_points=40, damping="identity", **kw
    )
    assert su.diagnostics["num_functions"] == 80
    assert kwng.relative_error(su.direction, r.direction_closed) < 1e-6
    with pytest.raises(ValueError, match="num_points"):
        nys.sutherland_kwng_gradient(s, theta, grad, num_points=41, **kw)


def test_stable_as_printed_differs_and_sqrt_form_agrees():
    """Prop. 6 as printed (T̃ = S†UᵀT) is not Prop. 5; with S^{-1/2} (the library) it
    is."""
    model, theta, grad, s = _problem(N=100)
    kernel = kwng.GaussianKernel(1.0)
    idx, coords = kwng.draw_basis(100, 2, 6, torch.Generator().manual_seed(0))
    C, K, CCt = kwng.kernel_matrices(s(theta), idx, coords, kernel)
    T = kwng.jacobian_from_sampler(s, theta, C)
    kw = dict(eps=0.1, lam=0.0, damping="identity")
    plain = kwng.nystrom_solve(T, CCt, K, grad, 100, method="plain", **kw).direction
    stable = kwng.nystrom_solve(T, CCt, K, grad, 100, method="stable", **kw).direction
    printed = nys.stable_as_printed(T, CCt, grad, 100, eps=0.1)
    assert kwng.relative_error(stable, plain) < 1e-8
    assert kwng.relative_error(printed, plain) > 1e-2


def test_rates_and_schedule():
    assert nys.predicted_rate(nys.well_specified_b(0.0)) == pytest.approx(0.25)
    assert nys.predicted_rate(nys.well_specified_b(5.0)) == pytest.approx(1 / 3)
    for c in (0.0, 1.0, 3.0):
        assert nys.predicted_rate(nys.misspecified_b(c)) == pytest.approx(1 / (4 + c))
    sch = nys.theory_schedule(1000, 2, 0.5)
    assert sch["num_basis"] == math.ceil(2 * 1000 ** 0.5 * math.log(1000))
    assert sch["lam"] == pytest.approx(1000**-0.5) and sch["eps"] == pytest.approx(
        1000**-0.25
    )
    assert nys.theory_schedule(100, 5, 0.5)["num_basis"] == 100
    with pytest.raises(ValueError, match="b must"):
        nys.predicted_rate(2.0)


def test_cost_and_slope():
    assert nys.predicted_cost(10, 2, 3, 4) == 3 * 10 * 4 + 4 * 4 + 8
    x = np.array([1.0, 2.0, 4.0])
    assert nys.loglog_slope(x, 3 * x ** 2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        nys.loglog_slope(x, -x)
