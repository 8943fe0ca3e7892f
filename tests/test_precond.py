"""KWNGPreconditioner: agreement of the modes with the estimator, descent, training, LM rule, state, errors."""

import copy

import pytest
import torch
from torch import nn

import kwng
from kwng.estimator import kernel_matrices, kernel_matrices_nosync, nystrom_solve, nystrom_solve_nosync
from kwng.nets import tiny_cnn
from kwng.precond import KWNGPreconditioner


def _batch(N=24, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, size, size, generator=g), torch.randint(0, 10, (N,), generator=g)


def _cnn(seed=0):
    torch.manual_seed(seed)
    return tiny_cnn(10, width=4)


def _direction(model, mode, z, y, seed=3, **kw):
    """One preconditioner step from a fresh copy of ``model``; returns the flat direction and info."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("clip_norm", None)
    kw.setdefault("eps", 1e-3)
    pc = KWNGPreconditioner(model, optimizer=opt, mode=mode, generator=torch.Generator().manual_seed(seed), **kw)
    opt.zero_grad()
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    info = pc.step(loss, X)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), info, pc


@pytest.mark.parametrize("damping", list(kwng.DAMPINGS))
def test_fast_loop_and_reference_agree_with_batchnorm(damping):
    """One batched backward (fast) gives the same T, hence the same direction, as M serial VJPs.

    tiny_cnn has batch norm in train mode, which couples the samples: T must still be the exact
    Jacobian. The fast solve whitens with a Cholesky factor instead of the eigendecomposition;
    the estimator is invariant under that change (float32 round-off only).
    """
    z, y = _batch()
    model = _cnn()
    ref, info_ref, _ = _direction(model, "reference", z, y, damping=damping)
    for mode in ("fast", "loop", "ensemble"):
        d, info, _ = _direction(model, mode, z, y, damping=damping)
        assert torch.linalg.vector_norm(d - ref) <= 1e-4 * torch.linalg.vector_norm(ref)
        assert int(info["rank"]) == info_ref["rank"] == 5
        assert not bool(info["fallback"])


def test_positive_lambda_modes_agree_and_change_the_direction():
    """λ > 0 enters the stable system as λε W K Wᵀ in every mode; it changes the direction."""
    z, y = _batch()
    model = _cnn()
    ref, _, _ = _direction(model, "reference", z, y, lam=1e3, eps=0.1)
    fast, _, _ = _direction(model, "fast", z, y, lam=1e3, eps=0.1)
    plain, _, _ = _direction(model, "reference", z, y, lam=0.0, eps=0.1)
    assert torch.linalg.vector_norm(fast - ref) <= 1e-4 * torch.linalg.vector_norm(ref)
    assert torch.linalg.vector_norm(plain - ref) > 1e-3 * torch.linalg.vector_norm(ref)


def test_batched_jacobian_equals_serial_vjps():
    """The M+1 rows of the batched backward are ∇L and the M rows of T (jacobian_from_outputs)."""
    z, y = _batch()
    model = _cnn()
    params = list(model.parameters())
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    idx, coords = kwng.draw_basis(X.shape[0], X.shape[1], 5, torch.Generator().manual_seed(0))
    C, _, _ = kernel_matrices(X, idx, coords, kwng.GaussianKernel(2.0))
    T_ref = kwng.jacobian_from_outputs(X, params, C, retain_graph=True)
    g_ref = torch.cat([gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)])
    pc = KWNGPreconditioner(model, adapt_eps=False, mode="fast")
    g, T = pc._gradients(loss, X, C)
    assert torch.allclose(T, T_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-7)


def test_ensemble_jacobian_equals_serial_vjps_and_keeps_running_stats():
    """mode="ensemble": one backward through M+1 stacked copies gives ∇L and T exactly, and the
    ensemble forward leaves the batch-norm running statistics as the user's forward set them."""
    z, y = _batch()
    model = _cnn()
    params = list(model.parameters())
    pc = KWNGPreconditioner(model, adapt_eps=False, mode="ensemble")
    X = model(z)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    loss = nn.functional.cross_entropy(X, y)
    idx, coords = kwng.draw_basis(X.shape[0], X.shape[1], 5, torch.Generator().manual_seed(0))
    C, _, _ = kernel_matrices(X, idx, coords, kwng.GaussianKernel(2.0))
    T_ref = kwng.jacobian_from_outputs(X, params, C, retain_graph=True)
    g_ref = torch.cat([gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)])
    g, T = pc._gradients(loss, X, C)
    assert torch.allclose(T, T_ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-7)
    for k, v in stats.items():
        assert torch.equal(model.state_dict()[k], v), k
    pc.remove_hooks()


def test_ensemble_needs_a_forward_call():
    model = _cnn()
    pc = KWNGPreconditioner(model, adapt_eps=False, mode="ensemble")
    X = nn.Linear(10, 10)(torch.randn(8, 10))  # has a graph, but the model never ran
    with pytest.raises(ValueError, match="forward"):
        pc.step((X ** 2).sum(), X)


def test_reference_equals_kwng_gradient_from_outputs():
    """With the same basis (same generator seed) the preconditioner is the estimator of Prop. 6."""
    z, y = _batch()
    model = _cnn()
    d, _, _ = _direction(model, "reference", z, y, seed=7, eps=1e-2)
    m2 = copy.deepcopy(model)
    params = list(m2.parameters())
    X = m2(z)
    loss = nn.functional.cross_entropy(X, y)
    g = torch.cat([gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)])
    res = kwng.kwng_gradient_from_outputs(X, params, g, num_basis=5, eps=1e-2, kernel=kwng.GaussianKernel(1.0),
                                          generator=torch.Generator().manual_seed(7), bandwidth="mean_sq")
    assert torch.allclose(d, res.direction, rtol=1e-6, atol=1e-9)
    dfast, _, _ = _direction(model, "fast", z, y, seed=7, eps=1e-2)
    assert torch.linalg.vector_norm(dfast - res.direction) <= 1e-4 * torch.linalg.vector_norm(res.direction)


def test_nosync_kernel_matrices_and_solve_match_the_reference_functions():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    idx, coords = kwng.draw_basis(40, 3, 6, g)
    for kern in (kwng.GaussianKernel(1.0), kwng.RationalQuadraticKernel(1.0, alpha=2.0)):
        k = copy.copy(kern)
        k.bandwidth = kwng.mean_sq_bandwidth(X, X[idx], 1.5)
        C, K, CCt = kernel_matrices(X, idx, coords, k)
        C2, K2, CCt2, sigma = kernel_matrices_nosync(X, idx, coords, kern, "mean_sq", 1.5)
        assert abs(float(sigma) - k.bandwidth) < 1e-12 * k.bandwidth
        for a, b in ((C, C2), (K, K2), (CCt, CCt2)):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)
    T = torch.randn(6, 50, generator=g, dtype=torch.float64)
    grad = torch.randn(50, generator=g, dtype=torch.float64)
    for damping in kwng.DAMPINGS:
        for eps in (1e-4, 1.0):
            ref = nystrom_solve(T, CCt, K, grad, 40, eps=eps, damping=damping).direction
            fast, info = nystrom_solve_nosync(T, CCt, K, grad, 40, eps=torch.tensor(eps), damping=damping)
            # small ε cancels large terms: round-off grows like cond/ε, still far below 1e-6
            assert float((fast - ref).norm()) <= 1e-6 * float(ref.norm())
            assert int(info["rank"]) == 6 and not bool(info["ill_conditioned"])


@pytest.mark.parametrize("mode", ["fast", "reference"])
@pytest.mark.parametrize("diagonal_only", [False, True])
def test_step_is_a_descent_direction(mode, diagonal_only):
    """⟨∇L, ĝ⟩ > 0 (KWNG is (1/ε)(D⁻¹ − PSD correction) applied to g, the correction is bounded by
    D⁻¹; the fallback guarantees it in any case) and the loss decreases for a small step."""
    z, y = _batch()
    model = _cnn()
    d, info, _ = _direction(model, mode, z, y, diagonal_only=diagonal_only)
    m2 = copy.deepcopy(model)
    loss = nn.functional.cross_entropy(m2(z), y)
    g = torch.cat([gp.reshape(-1) for gp in torch.autograd.grad(loss, list(m2.parameters()))])
    assert float(g @ d) > 0
    assert float(info["dot"]) == pytest.approx(float(g @ d), rel=1e-3)
    with torch.no_grad():
        m3 = copy.deepcopy(model)
        off = 0
        step = 1e-3 / float(d.norm())
        for p in m3.parameters():
            p -= step * d[off:off + p.numel()].view_as(p)
            off += p.numel()
        # same batch statistics in train mode
        assert float(nn.functional.cross_entropy(m3(z), y)) < float(loss)


def test_diagonal_only_is_D_inverse_g():
    z, y = _batch()
    model = _cnn()
    d, _, _ = _direction(model, "fast", z, y, diagonal_only=True, damping="T")
    m2 = copy.deepcopy(model)
    params = list(m2.parameters())
    X = m2(z)
    loss = nn.functional.cross_entropy(X, y)
    g = torch.cat([gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)])
    idx, coords = kwng.draw_basis(X.shape[0], X.shape[1], 5, torch.Generator().manual_seed(3))
    k = copy.copy(kwng.GaussianKernel(1.0))
    k.bandwidth = kwng.mean_sq_bandwidth(X, X[idx])
    C, _, _ = kernel_matrices(X, idx, coords, k)
    T = kwng.jacobian_from_outputs(X, params, C)
    D, _ = kwng.damping_vector("T", T)
    assert torch.allclose(d, g / D, rtol=1e-4, atol=1e-6 * float((g / D).abs().max()))


class TinyModel(nn.Module):
    """Logistic regression through an ill-conditioned head: logits U·(W z + b)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.head = kwng.nets.DiagonalConditioning(3, condition=1e3, top=1.0)

    def forward(self, z):
        return self.lin(z)


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_tiny_model_loss_goes_down_in_20_steps(mode):
    torch.manual_seed(0)
    model = TinyModel()
    g = torch.Generator().manual_seed(1)
    z = torch.randn(64, 5, generator=g)
    y = (z[:, 0] > 0).long() + (z[:, 1] > 0).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    pc = KWNGPreconditioner(model, optimizer=opt, num_basis=5, eps=1e-2, mode=mode,
                            generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        X = model(z)
        loss = nn.functional.cross_entropy(model.head(X), y)
        pc.step(loss, X)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert pc.counters()["steps"] == 20


def _lm(ratios_high: bool, steps=10, interval=5):
    """Feed a synthetic loss sequence whose reduction ratio r is known; return ε after ``steps``."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pc = KWNGPreconditioner(model, optimizer=opt, eps=1e-3, lm_interval=interval)
    loss = torch.tensor(10.0, dtype=torch.float64)
    pc._prev_loss, pc._prev_dot, pc._has_prev = loss.clone(), torch.tensor(1.0, dtype=torch.float64), True
    for _ in range(steps):
        # predicted first-order decrease lr·⟨g,ĝ⟩ = 0.1; r = 2·actual/0.1
        loss = loss - (0.1 if ratios_high else -0.01)  # r = 2 (very good) or r = -0.2 (loss went up)
        pc.num_steps += 1
        pc._levenberg_marquardt(loss)
        pc._prev_loss = loss.clone()
    return pc.eps, pc.counters()


def test_levenberg_marquardt_moves_eps_the_right_way():
    """r > 3/4 (the quadratic model is trusted) lowers ε by ω each lm_interval; r < 1/4 raises it."""
    eps_good, c_good = _lm(True)
    eps_bad, c_bad = _lm(False)
    assert eps_good == pytest.approx(1e-3 * 0.85 ** 2)
    assert eps_bad == pytest.approx(1e-3 / 0.85 ** 2)
    assert c_good["eps_down"] == 2 and c_bad["eps_up"] == 2
    # between the thresholds nothing changes
    model = nn.Linear(2, 2)
    pc = KWNGPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), eps=1e-3, lm_interval=1)
    pc._prev_loss, pc._prev_dot, pc._has_prev = (torch.tensor(1.0, dtype=torch.float64),
                                                 torch.tensor(1.0, dtype=torch.float64), True)
    pc.num_steps = 1
    pc._levenberg_marquardt(torch.tensor(0.75))  # r = 2 · 0.25 / 1 = 0.5
    assert pc.eps == pytest.approx(1e-3)


def test_eps_stays_within_bounds():
    model = nn.Linear(2, 2)
    pc = KWNGPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), eps=1e-10, lm_interval=1)
    pc._prev_loss, pc._prev_dot, pc._has_prev = (torch.tensor(1.0, dtype=torch.float64),
                                                 torch.tensor(1.0, dtype=torch.float64), True)
    pc.num_steps = 1
    pc._levenberg_marquardt(torch.tensor(0.0))  # r = 2 > 3/4 but ε is at eps_min
    assert pc.eps == pytest.approx(1e-10)


def test_state_dict_round_trip():
    z, y = _batch()
    model = _cnn()
    _, _, pc = _direction(model, "fast", z, y)
    pc._eps = pc._eps * 3
    state = pc.state_dict()
    pc2 = KWNGPreconditioner(copy.deepcopy(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             mode="fast", eps=1e-3, clip_norm=None)
    pc2.load_state_dict(state)
    assert pc2.state_dict() == state
    assert pc2.eps == pytest.approx(3e-3)
    assert pc2.counters()["rank_sum"] == 5
    with pytest.raises(ValueError, match="missing"):
        pc2.load_state_dict({"eps": 1.0})


def test_repr_lists_hyperparameters():
    model = nn.Linear(3, 2)
    r = repr(KWNGPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), num_basis=3))
    for key in ("num_basis=3", "eps=1e-05", "damping='T_tilde'", "lm_omega=0.85", "mode='fast'", "q=8"):
        assert key in r


@pytest.mark.parametrize("kw, match", [
    ({"num_basis": 0}, "num_basis"), ({"eps": -1.0}, "eps"), ({"eps": 1e6}, "eps"), ({"lam": -0.1}, "lam"),
    ({"kernel": "laplace"}, "kernel"), ({"bandwidth": "silverman"}, "bandwidth"), ({"bandwidth": -1.0}, "bandwidth"),
    ({"sigma0": 0.0}, "sigma0"), ({"damping": "full"}, "damping"), ({"lm_interval": 0}, "lm_interval"),
    ({"lm_omega": 1.5}, "lm_omega"), ({"lm_low": 0.9}, "lm_low"), ({"clip_norm": 0.0}, "clip_norm"),
    ({"mode": "turbo"}, "mode"), ({"diagonal_only": True, "damping": "identity"}, "diagonal_only"),
    ({"generator": 3}, "generator"), ({"optimizer": None}, "optimizer"),
])
def test_bad_hyperparameters_raise(kw, match):
    model = nn.Linear(3, 2)
    kw = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **kw}
    with pytest.raises(ValueError, match=match):
        KWNGPreconditioner(model, **kw)


def test_outputs_that_are_not_a_batch_matrix_are_rejected():
    model = nn.Conv2d(3, 4, 3)
    pc = KWNGPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out = model(torch.randn(8, 3, 6, 6))  # (8, 4, 4, 4)
    loss = out.square().mean()
    with pytest.raises(ValueError, match=r"\(batch, d\)"):
        pc.step(loss, out)
    with pytest.raises(ValueError, match=r"\(batch, d\)"):
        pc.step(loss, (out,))
    flat = out.flatten(1)
    with pytest.raises(ValueError, match="autograd graph"):
        pc.step(flat.square().mean(), flat.detach())
    with pytest.raises(ValueError, match="num_basis"):
        pc.step(flat[:3].square().mean(), flat[:3])
    with pytest.raises(ValueError, match="scalar"):
        pc.step(flat.square().mean(0), flat)


def test_fallback_to_euclidean_gradient_is_counted():
    """A non-finite natural direction (ε → tiny with D floored) must fall back to g and be counted."""
    z, y = _batch()
    model = _cnn()
    d, info, pc = _direction(model, "fast", z, y)
    bad = torch.full_like(d, float("nan"))
    g = torch.ones_like(d)
    direction = torch.where(~torch.isfinite(bad).all(), g, bad)
    assert torch.equal(direction, g)  # the selection used in step()
    assert pc.counters()["fallbacks"] == 0
    # loss whose gradient is zero: ⟨g, ĝ⟩ = 0 ≤ 0 → fallback
    m2 = copy.deepcopy(model)
    pc2 = KWNGPreconditioner(m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), mode="fast")
    X = m2(z)
    info = pc2.step(0.0 * X.sum(), X)
    assert bool(info["fallback"]) and pc2.counters()["fallbacks"] == 1
