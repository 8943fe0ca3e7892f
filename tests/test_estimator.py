"""The Nyström KWNG estimator: algebra, limits, consistency and input validation."""

import statistics

import pytest
import torch

import kwng


def _normal_problem(d=2, N=200, seed=0):
    model = kwng.NormalModel(d)
    g = torch.Generator().manual_seed(seed)
    theta = model.random_params(g)
    mu, L = model.split(theta)
    theta = model.join(mu, L + torch.eye(d, dtype=L.dtype))
    grad = 0.1 ** 0.5 * torch.randn(model.num_params, generator=g, dtype=torch.float64)
    Z = model.sample_latent(N, g)
    return model, theta, grad, Z, (lambda t: model.sample(t, Z))


def _estimate(sampler, theta, grad, seed=1, **kw):
    kw.setdefault("kernel", kwng.GaussianKernel(1.0))
    return kwng.kwng_gradient(
        sampler, theta, grad, generator=torch.Generator().manual_seed(seed), **kw
    )


@pytest.mark.parametrize("name", ["normal", "lognormal"])
@pytest.mark.parametrize("damping", list(kwng.DAMPINGS))
def test_plain_and_stable_agree_in_float64(name, damping):
    """Props. 5 and 6 are the same estimator when λ = 0 and CCᵀ has full rank.

    The setting (N = 100, M = 5, ε = 0.1, σ = 1) keeps cond(CCᵀ) below 1e3, so float64
    round-off stays far below the 1e-8 tolerance (the book shows where the plain form
    breaks down).
    """
    model = kwng.make_model(name, 2)
    g = torch.Generator().manual_seed(0)
    theta = model.random_params(g)
    grad = torch.randn(model.num_params, generator=g, dtype=torch.float64)
    Z = model.sample_latent(100, torch.Generator().manual_seed(1))
    kw = dict(num_basis=5, eps=0.1, damping=damping)
    stable = _estimate(lambda t: model.sample(t, Z), theta, grad, method="stable", **kw)
    plain = _estimate(lambda t: model.sample(t, Z), theta, grad, method="plain", **kw)
    assert stable.diagnostics["rank"] == 5
    assert kwng.relative_error(plain.direction, stable.direction) < 1e-8


def test_stable_equals_plain_with_lambda():
    model, theta, grad, Z, sampler = _normal_problem(N=100)
    kw = dict(num_basis=5, eps=0.1, lam=0.3)
    a = _estimate(sampler, theta, grad, method="stable", **kw).direction
    b = _estimate(sampler, theta, grad, method="plain", **kw).direction
    assert kwng.relative_error(a, b) < 1e-8


def test_matches_direct_minimisation_over_nystrom_subspace():
    """The closed form equals the minimiser of Ĵ(α) (eq. sample_solution), solved
    independently."""
    model, theta, grad, Z, sampler = _normal_problem(N=60)
    eps, lam, M = 0.05, 0.2, 6
    res = _estimate(
        sampler, theta, grad, num_basis=M, eps=eps, lam=lam, damping="identity"
    )
    idx, coords = res.diagnostics["basis_idx"], res.diagnostics["basis_coords"]
    kernel = kwng.GaussianKernel(1.0)
    theta_v = theta.clone().requires_grad_(True)
    X = model.sample(theta_v, Z)
    Y = X.detach()[idx]
    N = X.shape[0]
    C = kernel.mixed_coord(Y, coords, X.detach())  # ∇f(X_n) = Σ_m α_m C[m, n, :]
    KY = kernel.mixed_coord(Y, coords, Y)  # [m, m', j]; K[m, m'] takes j = i_{m'}
    K = KY[:, torch.arange(M), coords]
    tau = kernel.grad_coord(Y, coords, X).mean(1)
    T = torch.stack(
        [torch.autograd.grad(tau[m], theta_v, retain_graph=True)[0] for m in range(M)]
    )

    def J(alpha):
        grad_f = torch.einsum("m,mnj->nj", alpha, C)
        U = grad + T.T @ alpha
        return (grad_f ** 2).sum() / N + U @ U / eps + lam * alpha @ K @ alpha

    H = torch.autograd.functional.hessian(J, torch.zeros(M, dtype=torch.float64))
    b = torch.autograd.functional.jacobian(J, torch.zeros(M, dtype=torch.float64))
    alpha = torch.linalg.solve(H, -b)
    direct = (grad + T.T @ alpha) / eps
    assert kwng.relative_error(res.direction, direct) < 1e-8


def test_three_ways_to_compute_T_agree():
    """T from the sampler Jacobian, from M vector-Jacobian products, and autograd of τ
    directly."""
    model, theta, grad, Z, sampler = _normal_problem(N=50)
    kernel = kwng.GaussianKernel(0.8)
    idx, coords = kwng.draw_basis(50, 2, 7, torch.Generator().manual_seed(3))
    X = sampler(theta)
    C, _, _ = kwng.kernel_matrices(X, idx, coords, kernel)
    T1 = kwng.jacobian_from_sampler(sampler, theta, C)
    theta_v = theta.clone().requires_grad_(True)
    Xv = model.sample(theta_v, Z)
    T2 = kwng.jacobian_from_outputs(Xv, [theta_v], C)

    def tau_fn(t):
        return kernel.grad_coord(X[idx], coords, model.sample(t, Z)).mean(1)

    T3 = torch.autograd.functional.jacobian(tau_fn, theta)
    torch.testing.assert_close(T1, T3, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(T2, T3, rtol=1e-10, atol=1e-12)
    # and the outputs-based entry point returns the same direction
    r1 = kwng.kwng_gradient(sampler, theta, grad, num_basis=7, eps=1e-3, kernel=kernel,
                            basis_idx=idx, basis_coords=coords)
    r2 = kwng.kwng_gradient_from_outputs(
        Xv,
        [theta_v],
        grad,
        num_basis=7,
        eps=1e-3,
        kernel=kernel,
        basis_idx=idx,
        basis_coords=coords,
    )
    assert kwng.relative_error(r2.direction, r1.direction) < 1e-10


def test_explicit_basis_reproduces_generator_draw():
    model, theta, grad, Z, sampler = _normal_problem()
    a = _estimate(sampler, theta, grad, seed=7, num_basis=20, eps=1e-4)
    b = kwng.kwng_gradient(
        sampler,
        theta,
        grad,
        num_basis=20,
        eps=1e-4,
        kernel=kwng.GaussianKernel(1.0),
        basis_idx=a.diagnostics["basis_idx"],
        basis_coords=a.diagnostics["basis_coords"],
    )
    assert torch.equal(a.direction, b.direction)


@pytest.mark.parametrize("damping", list(kwng.DAMPINGS))
def test_large_eps_limit_is_damped_gradient(damping):
    """ε ĝ → D⁻¹ ∇L as ε → ∞ (the kernel term is O(1/ε²))."""
    model, theta, grad, Z, sampler = _normal_problem(N=100)
    errs = []
    for eps in (1e2, 1e4, 1e6):
        res = _estimate(sampler, theta, grad, num_basis=10, eps=eps, damping=damping)
        idx, coords = res.diagnostics["basis_idx"], res.diagnostics["basis_coords"]
        C, _, CCt = kwng.kernel_matrices(
            sampler(theta), idx, coords, kwng.GaussianKernel(1.0)
        )
        T = kwng.jacobian_from_sampler(sampler, theta, C)
        S, U = torch.linalg.eigh(CCt)
        keep = S > 10 * torch.finfo(S.dtype).eps * S.max()
        Tt = (U[:, keep] / S[keep].sqrt()).T @ T
        D, _ = kwng.damping_vector(damping, T, Tt)
        errs.append(kwng.relative_error(eps * res.direction, grad / D))
    assert errs[-1] < 1e-5 and errs[0] > errs[1] > errs[2]


def test_consistency_on_normal_model():
    """Relative error falls as N and M = ⌊d√N⌋ grow (d = 2, λ = 0, ε = 1e-5, σ = 1).

    Theorem 7 with c = 0 predicts ‖error‖ = O(N^{-1/4}), i.e. a factor 2 from N = 250 to
    4000; we require at least that factor on the median of 8 runs, and a median below
    10% at N = 4000 (measured: ~4%; the 10% bar is the accuracy at which the flow
    experiment of Fig. 2 tracks the exact WNG).
    """
    medians = {}
    for N in (250, 4000):
        errs = []
        for seed in range(8):
            model, theta, grad, Z, sampler = _normal_problem(N=N, seed=seed)
            res = _estimate(
                sampler,
                theta,
                grad,
                seed=100 + seed,
                num_basis=int(2 * N**0.5),
                eps=1e-5,
            )
            errs.append(kwng.relative_error(res.direction, model.wng(theta, grad)))
        medians[N] = statistics.median(errs)
    assert medians[4000] < 0.1
    assert medians[250] / medians[4000] > 2.0


def test_float32_runs_and_is_close_to_float64():
    model, theta, grad, Z, sampler = _normal_problem(N=300)
    r64 = _estimate(sampler, theta, grad, num_basis=10, eps=1e-2)
    r32 = _estimate(
        lambda t: model.sample(t, Z.float()),
        theta.float(),
        grad.float(),
        num_basis=10,
        eps=1e-2,
    )
    assert r32.direction.dtype == torch.float32
    assert kwng.relative_error(r32.direction, r64.direction) < 1e-2


# ----------------------------------------------------------------------------
# validation
@pytest.fixture
def problem():
    return _normal_problem(N=30)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eps=0.0), "eps"),
        (dict(eps=-1.0), "eps"),
        (dict(eps=float("nan")), "eps"),
        (dict(lam=-0.1), "lam"),
        (dict(num_basis=31), "num_basis"),
        (dict(num_basis=0), "num_basis"),
        (dict(damping="diag"), "damping"),
        (dict(method="fast"), "method"),
    ],
)
def test_bad_hyperparameters_raise(problem, kw, match):
    model, theta, grad, Z, sampler = problem
    args = dict(num_basis=5, eps=1e-3, kernel=kwng.GaussianKernel(1.0))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        kwng.kwng_gradient(sampler, theta, grad, **args)


def test_bad_gradient_and_shapes_raise(problem):
    model, theta, grad, Z, sampler = problem
    args = dict(num_basis=5, eps=1e-3, kernel=kwng.GaussianKernel(1.0))
    bad = grad.clone()
    bad[0] = float("nan")
    with pytest.raises(ValueError, match="grad"):
        kwng.kwng_gradient(sampler, theta, bad, **args)
    with pytest.raises(ValueError, match="grad"):
        kwng.kwng_gradient(sampler, theta, grad[:-1], **args)
    with pytest.raises(ValueError, match="X"):
        kwng.kwng_gradient(lambda t: model.sample(t, Z).flatten(), theta, grad, **args)
    with pytest.raises(ValueError, match="basis_idx"):
        kwng.kwng_gradient(
            sampler, theta, grad, basis_idx=torch.arange(5), basis_coords=None, **args
        )
    with pytest.raises(ValueError, match="basis_coords"):
        kwng.kwng_gradient(sampler, theta, grad, basis_idx=torch.arange(5),
                           basis_coords=torch.full((5,), 9), **args)
    with pytest.raises(ValueError, match="kernel"):
        kwng.kwng_gradient(
            sampler, theta, grad, num_basis=5, eps=1e-3, kernel="gaussian"
        )


def test_bandwidth_rules():
    model, theta, grad, Z, sampler = _normal_problem(N=100)
    res = _estimate(
        sampler, theta, grad, num_basis=5, eps=1e-3, bandwidth="mean_sq", sigma0=0.5
    )
    idx = res.diagnostics["basis_idx"]
    X = sampler(theta)
    assert res.diagnostics["bandwidth"] == pytest.approx(
        kwng.mean_sq_bandwidth(X, X[idx], 0.5)
    )
    res = _estimate(sampler, theta, grad, num_basis=5, eps=1e-3, bandwidth="median")
    assert res.diagnostics["bandwidth"] == pytest.approx(
        kwng.median_bandwidth(X, X[idx])
    )
    with pytest.raises(ValueError, match="bandwidth"):
        _estimate(sampler, theta, grad, num_basis=5, eps=1e-3, bandwidth="silverman")
    with pytest.raises(ValueError, match="bandwidth"):
        _estimate(sampler, theta, grad, num_basis=5, eps=1e-3, bandwidth=-1.0)
