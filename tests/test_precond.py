"""KWNGPreconditioner: agreement of the modes with the estimator, descent, training, LM
rule, state, errors."""

import copy

import pytest
import torch
from torch import nn

import kwng
import kwng.engine.replicate
from kwng.engine.config import eps_from_authors
from kwng.engine.lm import LevenbergMarquardt, LMSchedule
from kwng.engine.precond import KWNGPreconditioner
from kwng.estimator import kernel_matrices, nystrom_solve
from kwng.nosync import kernel_matrices_nosync, nystrom_solve_nosync
from studies.cifar import nets
from studies.cifar.nets import tiny_cnn


def _batch(N=24, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, size, size, generator=g), torch.randint(
        0, 10, (N,), generator=g
    )


def _cnn(seed=0):
    torch.manual_seed(seed)
    return tiny_cnn(10, width=4)


def _direction(model, mode, z, y, seed=3, **kw):
    """One preconditioner step from a fresh copy of ``model``; returns the flat
    direction and info."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("clip_norm", None)
    kw.setdefault("eps", 1e-3)
    pc = KWNGPreconditioner(
        model, lr=0.1, mode=mode, generator=torch.Generator().manual_seed(seed), **kw
    )
    opt.zero_grad()
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    info = pc.step(loss, X)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), info, pc


@pytest.mark.parametrize("damping", list(kwng.DAMPINGS))
def test_fast_and_reference_agree_with_batchnorm(damping):
    """One replicated backward (fast) gives the same T, hence the same direction, as M
    serial VJPs.

    tiny_cnn has batch norm in train mode, which couples the samples: T must still be
    the exact Jacobian. The fast solve whitens with a Cholesky factor instead of the
    eigendecomposition; the estimator is invariant under that change (float32 round-off
    only).
    """
    z, y = _batch()
    model = _cnn()
    ref, info_ref, _ = _direction(model, "reference", z, y, damping=damping)
    d, info, pc = _direction(model, "fast", z, y, damping=damping)
    assert torch.linalg.vector_norm(d - ref) <= 1e-4 * torch.linalg.vector_norm(ref)
    assert int(info["rank"]) == info_ref["rank"] == 5
    assert not bool(info["fallback"])
    assert pc.counters()["serial_steps"] == 0  # the replicated engine ran


def test_positive_lambda_modes_agree_and_change_the_direction():
    """λ > 0 enters the stable system as λε W K Wᵀ in every mode; it changes the
    direction."""
    z, y = _batch()
    model = _cnn()
    ref, _, _ = _direction(model, "reference", z, y, lam=1e3, eps=0.1)
    fast, _, _ = _direction(model, "fast", z, y, lam=1e3, eps=0.1)
    plain, _, _ = _direction(model, "reference", z, y, lam=0.0, eps=0.1)
    assert torch.linalg.vector_norm(fast - ref) <= 1e-4 * torch.linalg.vector_norm(ref)
    assert torch.linalg.vector_norm(plain - ref) > 1e-3 * torch.linalg.vector_norm(ref)


def _serial(model, z, y, C):
    """∇L and the rows of T by plain autograd (serial VJPs), on a copy of ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    T = kwng.jacobian_from_outputs(X, params, C, retain_graph=True)
    g = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([gp.reshape(-1) for gp in g]), T


def _replicated(model, z, y, C, **kw):
    params = [p for p in model.parameters() if p.requires_grad]
    pc = KWNGPreconditioner(model, eps_schedule=None, mode="fast", **kw)
    X = model(z)
    loss = nn.functional.cross_entropy(X, y)
    return pc._gradients(loss, X, C, params), pc


def _resnet(seed=0):
    torch.manual_seed(seed)
    return nets.ResNet18(10, widths=(4, 8, 8, 8)).double()


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_replicated_backward_equals_serial_vjps_on_a_batchnorm_resnet(fmt):
    """g and T of one replicated backward equal serial autograd VJPs on a BN ResNet in
    train mode (float64: to round-off), in both memory formats, and the forward leaves X
    and the running statistics exactly as a plain forward."""
    z, y = _batch(N=12, size=8)
    z = z.double().contiguous(memory_format=fmt)
    model = _resnet().to(memory_format=fmt)
    C = torch.randn(
        5, 12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    plain = copy.deepcopy(model)
    g_ref, T_ref = _serial(plain, z, y, C)
    (g, T), pc = _replicated(model, z, y, C)
    assert pc.counters()["serial_steps"] == 0
    assert torch.allclose(T, T_ref, rtol=1e-10, atol=1e-13)
    assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)
    for (k, v), v_ref in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(v, v_ref), k


def test_replicated_backward_with_an_unused_and_a_frozen_parameter():
    """A parameter the forward never uses has zero g and T columns; a parameter frozen
    after the preconditioner was built is left out (no gradient written) and the rest is
    still exact."""
    z, y = _batch(N=12, size=8)
    z = z.double()
    model = _resnet()
    model.unused = nn.Linear(3, 3).double()  # never called in forward
    C = torch.randn(
        4, 12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    pc = KWNGPreconditioner(model, lr=0.1, num_basis=4, eps=1e-3, clip_norm=None,
                            generator=torch.Generator().manual_seed(5))
    ref_model = copy.deepcopy(model)
    pc_ref = KWNGPreconditioner(ref_model, lr=0.1,
                                num_basis=4, eps=1e-3, clip_norm=None, mode="reference",
                                generator=torch.Generator().manual_seed(5))
    for m, p in ((model, pc), (ref_model, pc_ref)):
        m.layers[0].conv1.weight.requires_grad_(False)  # frozen after construction
        X = m(z)
        p.step(nn.functional.cross_entropy(X, y), X)
    assert model.layers[0].conv1.weight.grad is None
    assert pc.counters()["serial_steps"] == 0
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        if a.requires_grad:
            assert torch.allclose(a.grad, b.grad, rtol=1e-8, atol=1e-12), n
    assert torch.count_nonzero(model.unused.weight.grad) == 0
    fresh = _resnet()
    fresh.unused = nn.Linear(3, 3).double()
    g_ref, T_ref = _serial(copy.deepcopy(fresh), z, y, C)
    (g, T), _ = _replicated(fresh, z, y, C, num_basis=4)
    assert (
        torch.allclose(T, T_ref, rtol=1e-10, atol=1e-13)
        and torch.count_nonzero(T[:, -12:]) == 0
    )


def test_loss_with_a_direct_parameter_term_keeps_the_full_gradient():
    """An L2 term in the loss reaches the parameters without passing through X: g must
    include it."""
    z, y = _batch(N=12, size=8)
    z = z.double()
    model = _resnet()
    ref = copy.deepcopy(model)
    C = torch.randn(
        3, 12, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    pc = KWNGPreconditioner(model, eps_schedule=None, num_basis=3)
    X = model(z)
    loss = nn.functional.cross_entropy(X, y) + 0.1 * model.linear.weight.square().sum()
    g, _ = pc._gradients(loss, X, C, list(model.parameters()))
    Xr = ref(z)
    loss_r = nn.functional.cross_entropy(Xr, y) + 0.1 * ref.linear.weight.square().sum()
    g_ref = torch.cat(
        [gp.reshape(-1) for gp in torch.autograd.grad(loss_r, list(ref.parameters()))]
    )
    assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13)


def test_unsupported_layers_and_foreign_outputs_use_serial_passes(caplog):
    """A parameter outside the layers the engine batches (here a GroupNorm) or outputs
    that are not the model's own output: the step is still exact, through serial
    passes, and says so in the log."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.GroupNorm(2, 6), nn.Linear(6, 3))
    z = torch.randn(16, 5)
    y = torch.randint(0, 3, (16,))
    with caplog.at_level("WARNING"):
        d_fast, _, pc = _direction(model, "fast", z, y)
    assert "GroupNorm" in caplog.text
    d_ref, _, _ = _direction(model, "reference", z, y)
    assert torch.linalg.vector_norm(d_fast - d_ref) <= 1e-4 * torch.linalg.vector_norm(
        d_ref
    )
    m2 = nets.mlp(5, 3)
    pc2 = KWNGPreconditioner(m2, lr=0.1)
    # computed from the output *and* a parameter: not pulled back
    X = m2(z) * m2[0].bias[:3]
    pc2.step(nn.functional.cross_entropy(X, y), X)
    assert pc2.counters()["serial_steps"] == 1


def test_outputs_from_the_model_output_without_parameters_stay_on_the_fast_path():
    """Samples U·h with a fixed U (the ill-conditioned CIFAR network): the cotangents
    are pulled back through U to the model's output; the direction equals the serial
    reference."""
    torch.manual_seed(0)
    model = _resnet()
    z, y = _batch(N=12, size=8)
    z = z.double()
    U = torch.logspace(-3, 1, 10, dtype=torch.float64)
    dirs = {}
    for mode in ("fast", "reference"):
        m = copy.deepcopy(model)
        pc = KWNGPreconditioner(
            m,
            lr=0.1,
            mode=mode,
            eps=1e-3,
            clip_norm=None,
            generator=torch.Generator().manual_seed(0),
        )
        X = m(z) * U
        pc.step(nn.functional.cross_entropy(X, y), X)
        dirs[mode] = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        if mode == "fast":
            assert pc.counters()["serial_steps"] == 0
    assert torch.allclose(
        dirs["fast"],
        dirs["reference"],
        rtol=1e-8,
        atol=1e-10 * float(dirs["reference"].abs().max()),
    )


def test_replicated_forward_refuses_dropout():
    model = nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5), nn.Linear(6, 3))
    KWNGPreconditioner(model, lr=0.1)
    with pytest.raises(ValueError, match="Dropout"):
        model(torch.randn(8, 5))
    model.eval()
    assert model(torch.randn(8, 5)).shape == (8, 3)


def test_plain_backward_on_a_replicated_forward_gives_the_true_gradient():
    """``loss.backward()`` instead of ``precond.step`` still leaves ∇L in ``p.grad``."""
    z, y = _batch(N=12, size=8)
    z = z.double()
    model = _resnet()
    ref = copy.deepcopy(model)
    KWNGPreconditioner(model, eps_schedule=None)
    nn.functional.cross_entropy(model(z), y).backward()
    nn.functional.cross_entropy(ref(z), y).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-13)


def test_reference_equals_kwng_gradient_from_outputs():
    """With the same basis (same generator seed) the preconditioner is the estimator of
    Prop. 6."""
    z, y = _batch()
    model = _cnn()
    d, _, _ = _direction(model, "reference", z, y, seed=7, eps=1e-2)
    m2 = copy.deepcopy(model)
    params = list(m2.parameters())
    X = m2(z)
    loss = nn.functional.cross_entropy(X, y)
    g = torch.cat(
        [gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)]
    )
    res = kwng.kwng_gradient_from_outputs(
        X,
        params,
        g,
        num_basis=5,
        eps=1e-2,
        kernel=kwng.GaussianKernel(1.0),
        generator=torch.Generator().manual_seed(7),
        bandwidth="mean_sq",
    )
    assert torch.allclose(d, res.direction, rtol=1e-6, atol=1e-9)
    dfast, _, _ = _direction(model, "fast", z, y, seed=7, eps=1e-2)
    assert torch.linalg.vector_norm(
        dfast - res.direction
    ) <= 1e-4 * torch.linalg.vector_norm(res.direction)


def test_nosync_kernel_matrices_and_solve_match_the_reference_functions():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, 3, generator=g, dtype=torch.float64)
    idx, coords = kwng.draw_basis(40, 3, 6, g)
    for kern in (
        kwng.GaussianKernel(1.0),
        kwng.RationalQuadraticKernel(1.0, alpha=2.0),
    ):
        k = copy.copy(kern)
        k.bandwidth = kwng.mean_sq_bandwidth(X, X[idx], 1.5)
        C, K, CCt = kernel_matrices(X, idx, coords, k)
        C2, K2, CCt2, sigma = kernel_matrices_nosync(
            X, idx, coords, kern, "mean_sq", 1.5
        )
        assert abs(float(sigma) - k.bandwidth) < 1e-12 * k.bandwidth
        for a, b in ((C, C2), (K, K2), (CCt, CCt2)):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)
    T = torch.randn(6, 50, generator=g, dtype=torch.float64)
    grad = torch.randn(50, generator=g, dtype=torch.float64)
    for damping in kwng.DAMPINGS:
        for eps in (1e-4, 1.0):
            ref = nystrom_solve(T, CCt, K, grad, 40, eps=eps, damping=damping).direction
            fast, info = nystrom_solve_nosync(
                T, CCt, K, grad, 40, eps=torch.tensor(eps), damping=damping
            )
            # small ε cancels large terms: round-off grows like cond/ε, still far below
            # 1e-6
            assert float((fast - ref).norm()) <= 1e-6 * float(ref.norm())
            assert int(info["rank"]) == 6 and not bool(info["ill_conditioned"])


@pytest.mark.parametrize("mode", ["fast", "reference"])
@pytest.mark.parametrize("diagonal_only", [False, True])
def test_step_is_a_descent_direction(mode, diagonal_only):
    """⟨∇L, ĝ⟩ > 0 (KWNG is (1/ε)(D⁻¹ − PSD correction) applied to g, the correction is
    bounded by D⁻¹; the fallback guarantees it in any case) and the loss decreases for a
    small step."""
    z, y = _batch()
    model = _cnn()
    d, info, _ = _direction(model, mode, z, y, diagonal_only=diagonal_only)
    m2 = copy.deepcopy(model)
    loss = nn.functional.cross_entropy(m2(z), y)
    g = torch.cat(
        [gp.reshape(-1) for gp in torch.autograd.grad(loss, list(m2.parameters()))]
    )
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
    # float64: the two computations sum in different orders (in float32 that moved the
    # result by a CPU-dependent tenth of a 1e-4 tolerance)
    z, y = _batch()
    z, model = z.double(), _cnn().double()
    d, _, _ = _direction(model, "fast", z, y, diagonal_only=True, damping="T")
    m2 = copy.deepcopy(model)
    params = list(m2.parameters())
    X = m2(z)
    loss = nn.functional.cross_entropy(X, y)
    g = torch.cat(
        [gp.reshape(-1) for gp in torch.autograd.grad(loss, params, retain_graph=True)]
    )
    idx, coords = kwng.draw_basis(
        X.shape[0], X.shape[1], 5, torch.Generator().manual_seed(3)
    )
    k = copy.copy(kwng.GaussianKernel(1.0))
    k.bandwidth = kwng.mean_sq_bandwidth(X, X[idx])
    C, _, _ = kernel_matrices(X, idx, coords, k)
    T = kwng.jacobian_from_outputs(X, params, C)
    D, _ = kwng.damping_vector("T", T)
    assert torch.allclose(d, g / D, rtol=1e-10, atol=1e-12 * float((g / D).abs().max()))


class TinyModel(nn.Module):
    """Logistic regression through an ill-conditioned head: logits U·(W z + b)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.head = nets.DiagonalConditioning(
            3, condition=1e3, top=1.0
        )

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
    pc = KWNGPreconditioner(
        model,
        lr=lambda: opt.param_groups[0]["lr"],
        num_basis=5,
        eps=1e-2,
        mode=mode,
        generator=torch.Generator().manual_seed(2),
    )
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


def _lm(ratios_high: bool, steps=10, interval=5, rule="authors"):
    """Feed a loss sequence whose reduction ratio r is known; return the schedule after
    ``steps``."""
    lm = LevenbergMarquardt(1e-3, LMSchedule(interval=interval, rule=rule))
    loss = torch.tensor(10.0, dtype=torch.float64)
    for _ in range(steps):
        lm.update(loss)
        lm.record(0.1, torch.tensor(1.0))  # predicted decrease ½·lr·⟨g,ĝ⟩ = 0.05
        # r = 2 (very good) or r = -0.2 (loss went up)
        after = loss - (0.1 if ratios_high else -0.01)
        if rule == "same_batch":
            lm.observe(after)
            # the next batch's loss is unrelated: only the same-batch pair counts
            loss = after + 5.0
        else:
            loss = after
    return lm


@pytest.mark.parametrize("rule", ["authors", "same_batch"])
def test_levenberg_marquardt_moves_eps_the_right_way(rule):
    """r > 3/4 (the quadratic model is trusted) lowers ε by ω each interval; r < 1/4
    raises it."""
    good, bad = _lm(True, rule=rule), _lm(False, rule=rule)
    assert float(good.eps) == pytest.approx(1e-3 * 0.85 ** 2)
    assert float(bad.eps) == pytest.approx(1e-3 / 0.85 ** 2)
    assert int(good.downs) == 2 and int(bad.ups) == 2
    assert float(good.ratio) == pytest.approx(2.0) and float(
        bad.ratio
    ) == pytest.approx(-0.2)
    # between the thresholds nothing changes: r = 0.25 / (½ · 1 · 1) = 0.5
    lm = LevenbergMarquardt(1e-3, LMSchedule(interval=1))
    lm.update(torch.tensor(1.0))
    lm.record(1.0, torch.tensor(1.0))
    lm.update(torch.tensor(0.75))
    assert float(lm.eps) == pytest.approx(1e-3)


def test_eps_stays_within_bounds_and_rules_are_checked():
    lm = LevenbergMarquardt(1e-10, LMSchedule(interval=1))
    lm.update(torch.tensor(1.0))
    lm.record(1.0, torch.tensor(1.0))
    lm.update(torch.tensor(0.0))  # r = 2 > 3/4 but ε is at eps_min
    assert float(lm.eps) == pytest.approx(1e-10)
    with pytest.raises(ValueError, match="same_batch"):
        lm.observe(torch.tensor(0.0))
    with pytest.raises(ValueError, match="rule"):
        LMSchedule(rule="next")


def test_lm_state_dict_round_trip():
    lm = _lm(True, steps=7)
    lm2 = LevenbergMarquardt(1e-3, LMSchedule(interval=5))
    lm2.load_state_dict(lm.state_dict())
    assert lm2.state_dict() == lm.state_dict()
    with pytest.raises(ValueError, match="missing"):
        lm2.load_state_dict({"eps": 1.0})


def test_state_dict_round_trip():
    z, y = _batch()
    model = _cnn()
    _, _, pc = _direction(model, "fast", z, y)
    pc.lm.eps = pc.lm.eps * 3
    state = pc.state_dict()
    pc2 = KWNGPreconditioner(copy.deepcopy(model), lr=0.1, generator=torch.Generator(),
                             mode="fast", eps=1e-3, clip_norm=None)
    pc2.load_state_dict(state)
    assert pc2.state_dict() == state
    assert pc2.eps == pytest.approx(3e-3)
    assert pc2.counters()["rank_sum"] == 5
    with pytest.raises(ValueError, match="missing"):
        pc2.load_state_dict({"eps": 1.0})


def test_same_batch_rule_in_a_training_loop():
    """lm_rule="same_batch": the loop hands the same batch's loss after the step to the
    schedule."""
    torch.manual_seed(0)
    model = TinyModel()
    z = torch.randn(64, 5)
    y = (z[:, 0] > 0).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pc = KWNGPreconditioner(
        model, lr=0.5, eps=1e-2, eps_schedule=LMSchedule(interval=1, rule="same_batch")
    )
    for _ in range(6):
        opt.zero_grad()
        X = model(z)
        loss = nn.functional.cross_entropy(X, y)
        info = pc.step(loss, X)
        opt.step()
        with torch.no_grad():
            pc.observe_loss_after_step(nn.functional.cross_entropy(model(z), y))
    assert (
        torch.isfinite(info["reduction_ratio"])
        and float(info["reduction_ratio"]) != 0.0
    )
    assert pc.counters()["eps_up"] + pc.counters()["eps_down"] >= 1


def test_eps_from_authors_converts_by_sqrt_batch():
    assert eps_from_authors(1e-5, 128) == pytest.approx(1e-5 * 128 ** 0.5)
    with pytest.raises(ValueError, match="batch_size"):
        eps_from_authors(1e-5, 0)


def test_repr_lists_hyperparameters():
    model = nn.Linear(3, 2)
    r = repr(KWNGPreconditioner(model, lr=0.1, num_basis=3))
    for key in (
        "num_basis=3",
        "eps=1e-05",
        "damping='T_tilde'",
        "'omega': 0.85",
        "mode='fast'",
        "q=8",
    ):
        assert key in r


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_basis": 0}, "num_basis"),
        ({"eps": -1.0}, "eps"),
        ({"eps": 1e6}, "eps"),
        ({"lam": -0.1}, "lam"),
        ({"kernel": "laplace"}, "kernel"),
        ({"bandwidth": "silverman"}, "bandwidth"),
        ({"bandwidth": -1.0}, "bandwidth"),
        ({"sigma0": 0.0}, "sigma0"),
        ({"damping": "full"}, "damping"),
        ({"eps_schedule": "lm"}, "eps_schedule"),
        (
            {"eps_schedule": LMSchedule(eps_max=1e-6)},
            r"eps must lie in \[eps_min, eps_max\]",
        ),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"mode": "ensemble"}, "mode"),
        ({"rcond": -1.0}, "rcond"),
        ({"diagonal_only": True, "damping": "identity"}, "diagonal_only"),
        ({"diagonal_only": 1}, "diagonal_only"),
        ({"generator": 3}, "generator"),
        ({"lr": None}, "lr is required"),
        ({"lr": -0.1}, "lr"),
        ({"optimizer": None}, "optimizer= is no longer taken"),
        ({"lm_omega": 0.5}, "unknown hyperparameter"),
    ],
)
def test_bad_hyperparameters_raise(kw, match):
    model = nn.Linear(3, 2)
    kw = {"lr": 0.1, **kw}
    with pytest.raises(ValueError, match=match):
        KWNGPreconditioner(model, **kw)


def test_outputs_that_are_not_a_batch_matrix_are_rejected():
    model = nn.Conv2d(3, 4, 3)
    pc = KWNGPreconditioner(model, lr=0.1)
    out = model(torch.randn(8, 3, 6, 6))  # (8, 4, 4, 4)
    loss = out.square().mean()
    with pytest.raises(ValueError, match=r"\(batch, d\)"):
        pc.step(loss, out)
    with pytest.raises(ValueError, match=r"\(batch, d\)"):
        pc.step(loss, (out,))
    flat = out.flatten(1)
    with pytest.raises(ValueError, match="autograd graph"):
        pc.step(flat.square().mean(), flat.detach())
    with pytest.raises(ValueError, match="scalar"):
        pc.step(flat.square().mean(0), flat)


def test_fallback_to_euclidean_gradient_is_counted():
    """A non-finite natural direction (ε → tiny with D floored) must fall back to g and
    be counted."""
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
    pc2 = KWNGPreconditioner(m2, lr=0.1, mode="fast")
    X = m2(z)
    info = pc2.step(0.0 * X.sum(), X)
    assert bool(info["fallback"]) and pc2.counters()["fallbacks"] == 1


def test_bf16_autocast_direction_is_as_accurate_as_a_bf16_gradient():
    """Under bf16 autocast the network runs in bf16 and the kernel algebra in float32:
    the KWNG direction's error against the float32 direction stays within twice the
    error that bf16 puts into the plain gradient itself in norm, and within four times
    in angle (1 − cosine)."""
    z, y = _batch(N=32, size=8)
    model = nets.ResNet18(10, widths=(8, 8, 8, 8)).to(
        memory_format=torch.channels_last
    )
    z = z.contiguous(memory_format=torch.channels_last)

    def run(amp, mode="fast"):
        m = copy.deepcopy(model)
        pc = KWNGPreconditioner(m, lr=0.1, mode=mode,
                                eps=1e-3, clip_norm=None, eps_schedule=None,
                                generator=torch.Generator().manual_seed(4))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            X = m(z)
            loss = nn.functional.cross_entropy(X.float(), y)
        pc.step(loss, X)
        assert pc.counters()["serial_steps"] == 0
        return torch.cat([p.grad.reshape(-1) for p in m.parameters()])

    def grad(amp):
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = nn.functional.cross_entropy(m(z).float(), y)
        return torch.cat(
            [g.reshape(-1) for g in torch.autograd.grad(loss, list(m.parameters()))]
        )

    d32, d16 = run(False), run(True)
    g32, g16 = grad(False), grad(True)
    err_dir = float((d16 - d32).norm() / d32.norm())
    err_grad = float((g16 - g32).norm() / g32.norm())
    assert err_dir <= 2 * err_grad + 1e-3
    cos_dir = float(nn.functional.cosine_similarity(d16, d32, dim=0))
    cos_grad = float(nn.functional.cosine_similarity(g16, g32, dim=0))
    # small-norm columns of D amplify bf16 noise
    assert 1 - cos_dir <= 4 * (1 - cos_grad) + 0.02


class _TempModel(nn.Module):
    """Logits from a linear layer; ``temp`` scales them inside the loss only (not in the
    outputs)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, z):
        return self.lin(z)


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_loss_only_parameter_takes_a_scaled_euclidean_step(mode, caplog):
    """A parameter that moves the loss but not the samples has a zero column of T: its
    component is g_i · ‖ĝ_rest‖/‖g_rest‖ (not g_i/(ε·floor), which would swamp the
    direction), counted and logged once."""
    torch.manual_seed(0)
    model = _TempModel()
    z, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    pc = KWNGPreconditioner(
        model,
        lr=0.1,
        mode=mode,
        clip_norm=None,
        eps=1e-3,
        generator=torch.Generator().manual_seed(0),
    )
    X = model(z)
    loss = nn.functional.cross_entropy(model.temp * X, y)
    g = torch.cat(
        [
            gr.reshape(-1)
            for gr in torch.autograd.grad(
                loss, list(model.parameters()), retain_graph=True
            )
        ]
    )
    info = pc.step(loss, X)
    d = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # own parameters come first: column 0
    assert next(iter(model.parameters())) is model.temp
    expected = g[0] * d[1:].norm() / g[1:].norm()
    assert torch.allclose(d[0], expected, rtol=1e-5)
    assert int(info["loss_only"]) == 1
    with caplog.at_level("WARNING"):
        pc.counters()
        pc.counters()
    assert caplog.text.count("move the loss but not the samples") == 1


def test_config_object_and_keywords_build_the_same_preconditioner():
    import dataclasses

    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    )
    cfg = kwng.KWNGConfig(
        num_basis=3,
        eps=1e-3,
        damping="T",
        eps_schedule=LMSchedule(interval=2),
        mode="reference",
    )
    by_cfg = KWNGPreconditioner(model, lr=0.1, config=cfg)
    by_kw = KWNGPreconditioner(model, lr=0.1, num_basis=3, eps=1e-3, damping="T",
                               eps_schedule=LMSchedule(interval=2), mode="reference")
    assert by_cfg.hyperparameters() == by_kw.hyperparameters()
    assert by_cfg.state_dict() == by_kw.state_dict()
    assert by_cfg.config.num_basis == 3 and isinstance(
        by_cfg.config.kernel, kwng.Kernel
    )
    # keywords override fields of a given config
    assert (
        KWNGPreconditioner(model, lr=0.1, config=cfg, num_basis=2).config.num_basis == 2
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eps = 1.0
    for bad, match in (
        ({"omega": 1.5}, "omega"),
        ({"low": 0.9}, "low"),
        ({"interval": 0}, "interval"),
        ({"eps_min": 1.0, "eps_max": 0.5}, "eps_min"),
        ({"rule": "next"}, "rule"),
    ):
        with pytest.raises(ValueError, match=match):
            LMSchedule(**bad)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        KWNGPreconditioner(model, lr=0.1, num_basiss=3)


def test_replicated_forward_refuses_every_dropout_kind():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout2d(0.3), nn.Flatten(),
                          nn.Linear(64, 2))
    KWNGPreconditioner(model, lr=0.1)
    with pytest.raises(ValueError, match="Dropout2d"):
        model(torch.randn(8, 3, 6, 6))


def test_load_state_dict_reads_a_state_saved_before_eps_schedule(caplog):
    """A state saved with the old flat lm_*/adapt_eps/eps_min/eps_max hyperparameters
    loads without a warning when they match; a differing value is logged."""
    pc = KWNGPreconditioner(nn.Linear(3, 2), lr=0.1, num_basis=2)
    state = pc.state_dict()
    hp = dict(state["hyperparameters"])
    s = hp.pop("eps_schedule")
    old = {
        **hp,
        "lm_interval": s["interval"],
        "lm_omega": s["omega"],
        "lm_low": s["low"],
        "lm_high": s["high"],
        "adapt_eps": True,
        "eps_min": s["eps_min"],
        "eps_max": s["eps_max"],
        "lm_rule": s["rule"],
    }
    with caplog.at_level("WARNING"):
        pc.load_state_dict({**state, "hyperparameters": old})
    assert "differ" not in caplog.text
    with caplog.at_level("WARNING"):
        pc.load_state_dict({**state, "hyperparameters": {**old, "lm_omega": 0.5}})
    assert "differ" in caplog.text
    fixed = KWNGPreconditioner(nn.Linear(3, 2), num_basis=2, eps_schedule=None, eps=1e6)
    caplog.clear()
    with caplog.at_level("WARNING"):  # a fixed ε may lie outside the rule's bounds
        fixed.load_state_dict({**fixed.state_dict(), "hyperparameters": {
            **old, "eps": 1e6, "adapt_eps": False}})
    assert "differ" not in caplog.text and fixed.eps == 1e6
