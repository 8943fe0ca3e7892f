"""The kernel Fisher–Rao estimator (kwng.fisher) and its experiment
(studies.fisher.cli)."""

import json

import numpy as np
import pytest
import torch

import kwng
from kwng import fisher as F
from kwng import fisher_exact
from kwng.theory.nystrom import loglog_slope
from studies.fisher import cli as E
from studies.fisher import flow as fisher_flow
from studies.fisher import sweep as fisher_sweep

#: the keys every provenance record of the Fisher experiments carries
PROVENANCE_KEYS = ("command", "config", "git_commit", "device", "date", "seeds",
                   "wall_time_s")


def _problem(name, d=2, N=40, M=8, seed=0):
    model = kwng.make_model(name, d)
    theta = model.params_near_reference(torch.Generator().manual_seed(seed), 0.1)
    grad = torch.randn(
        model.num_params,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    Z = model.sample_latent(N, torch.Generator().manual_seed(seed + 2))
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(seed + 3))[:M]
    return model, theta, grad, (lambda t: model.sample(t, Z)), idx


# --------------------------------------------------------------------------------------
# The closed form against an independent brute-force solve of the restricted dual
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["normal", "lognormal"])
@pytest.mark.parametrize("lam", [0.0, 1e-3])
@pytest.mark.parametrize("eps", [1.0, 1e-2])
def test_closed_form_matches_brute_force(name, lam, eps):
    # N = 40 samples, M = 8 basis points, σ = 0.3: the brute-force normal equations have
    # a condition number near 1e7, so both routes agree to about 1e-9 in float64
    # (measured ≤ 1e-9).
    model, theta, grad, sampler, idx = _problem(name)
    kernel = kwng.GaussianKernel(0.3)
    dual, metric = F.fisher_brute_force(
        sampler, theta, grad, idx, eps=eps, lam=lam, kernel=kernel
    )
    for method in ("stable", "plain"):
        est = F.kfng_gradient(
            sampler,
            theta,
            grad,
            num_basis=8,
            eps=eps,
            lam=lam,
            kernel=kernel,
            damping="identity",
            basis_idx=idx,
            method=method,
        ).direction
        tol = (
            5e-9 if method == "stable" else 1e-6
        )  # the plain form goes through a pseudo-inverse
        assert kwng.relative_error(est, dual) < tol
        assert kwng.relative_error(est, metric) < tol


def test_score_jacobian_puts_T_in_the_range_of_C_and_plain_equals_stable():
    # M = N: the centred C has rank ≤ N - 1, so CCᵀ is singular. With T = C S / N the
    # range of T lies in that of C and the stable form equals the plain one (the
    # chapter's proposition). A small bandwidth keeps the Gram well conditioned apart
    # from the one exact null direction of the centring (CCᵀv = 0 for v = K⁻¹1); the
    # plain form's pseudo-inverse must still find that direction in a system of
    # condition ~1e17, so larger bandwidths or smaller ε leave the two forms apart by
    # round-off amplified by that condition number.
    model, theta, grad, sampler, _ = _problem("normal", N=30)
    kernel = kwng.GaussianKernel(0.03)
    kw = dict(
        num_basis=30,
        eps=1.0,
        kernel=kernel,
        damping="identity",
        basis_idx=torch.arange(30),
        jacobian="score",
        score_fn=lambda t, X: fisher_exact.scores(model, t, X),
    )
    stable = F.kfng_gradient(sampler, theta, grad, method="stable", **kw)
    plain = F.kfng_gradient(sampler, theta, grad, method="plain", **kw)
    assert stable.diagnostics["rank"] == 29
    assert stable.diagnostics["range_residual"] < 1e-6
    assert kwng.relative_error(stable.direction, plain.direction) < 1e-6


def test_centring_removes_constants():
    X = torch.randn(50, 2, dtype=torch.float64)
    C, K, CCt, Gx = F.fisher_kernel_matrices(
        X, torch.arange(7), kwng.GaussianKernel(0.8)
    )
    assert C.shape == (7, 50) and K.shape == (7, 7) and Gx.shape == (7, 50, 2)
    assert torch.allclose(C.sum(1), torch.zeros(7, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(CCt, C @ C.T)
    # Gx is the x-derivative of k(Y_m, x): compare with autograd
    Xr = X.clone().requires_grad_(True)
    k = kwng.GaussianKernel(0.8)(X[:7], Xr)
    (g,) = torch.autograd.grad(k[3].sum(), Xr)
    assert torch.allclose(Gx[3], g, atol=1e-12)


# --------------------------------------------------------------------------------------
# Exact Fisher information
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["normal", "lognormal"])
def test_fisher_matrix_entry_by_entry_against_monte_carlo(name):
    # G_mc = (1/N) Σ s sᵀ from autograd scores of the log-density (independent of the
    # formulas); each entry must lie within 5 standard errors of the exact one (a 5σ
    # band: a false alarm has probability below 1e-5 per entry).
    model = kwng.make_model(name, 2)
    theta = model.params_near_reference(torch.Generator().manual_seed(4), 0.1)
    G = fisher_exact.fisher_matrix(model, theta)
    Gmc, se = fisher_exact.fisher_matrix_mc(
        model, theta, 100_000, torch.Generator().manual_seed(5)
    )
    assert G.shape == Gmc.shape == (model.num_params,) * 2
    assert bool(((Gmc - G).abs() <= 5 * se + 1e-12).all()), ((Gmc - G).abs() / se).max()


def test_fisher_closed_forms():
    model = kwng.NormalModel(3)
    theta = model.params_near_reference(torch.Generator().manual_seed(6), 0.1)
    _, L = model.split(theta)
    g = torch.zeros(model.num_params, dtype=torch.float64)
    g[:3] = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    # mean block: G_F⁻¹ = Σ, and the mean and covariance blocks decouple
    nat = fisher_exact.fisher_natural_gradient(model, theta, g)
    assert torch.allclose(nat[:3], L @ L.T @ g[:3], atol=1e-10)
    assert torch.allclose(nat[3:], torch.zeros(6, dtype=torch.float64), atol=1e-10)
    # log-normal = normal with diagonal L (the Fisher metric is invariant under
    # x ↦ exp x)
    s = torch.tensor([0.7, -1.3], dtype=torch.float64)
    mu = torch.tensor([0.1, 0.2], dtype=torch.float64)
    Gl = fisher_exact.fisher_matrix(kwng.LogNormalModel(2), torch.cat([mu, s]))
    Gn = fisher_exact.fisher_matrix(
        kwng.NormalModel(2), kwng.NormalModel(2).join(mu, torch.diag(s))
    )
    keep = [0, 1, 2, 4]  # μ1, μ2, L11, L22 (drop L21)
    assert torch.allclose(Gl, Gn[keep][:, keep], atol=1e-12)


def test_errors_name_the_argument():
    model, theta, grad, sampler, idx = _problem("normal")
    k = kwng.GaussianKernel(1.0)
    with pytest.raises(ValueError, match="eps"):
        F.kfng_gradient(sampler, theta, grad, num_basis=8, eps=0.0, kernel=k)
    with pytest.raises(ValueError, match="jacobian"):
        F.kfng_gradient(
            sampler, theta, grad, num_basis=8, eps=1.0, kernel=k, jacobian="finite"
        )
    with pytest.raises(ValueError, match="score_fn"):
        F.kfng_gradient(
            sampler, theta, grad, num_basis=8, eps=1.0, kernel=k, jacobian="score"
        )
    with pytest.raises(ValueError, match="num_basis"):
        F.kfng_gradient(sampler, theta, grad, num_basis=41, eps=1.0, kernel=k)
    with pytest.raises(ValueError, match="no density"):
        fisher_exact.fisher_matrix(
            kwng.HyperSphereModel(2), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad"):
        fisher_exact.fisher_natural_gradient(model, theta, grad[:2])


# --------------------------------------------------------------------------------------
# Consistency, and the sphere
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["normal", "lognormal"])
def test_error_decays_with_N(name):
    # d = 2, M = ⌊d√N⌋, λ = 1e-4 (the experiment's lam_fisher), median of 6 runs. The
    # estimator averages N samples, so it cannot beat the Monte Carlo rate N^{-1/2};
    # measured slopes are -0.6 to -0.7 (kernel bias shrinking too). Threshold: slope
    # below -0.3 (room for the scatter of a 6-run median) and a median error below 0.1
    # at N = 4000 (measured 0.05).
    d = 2
    model = kwng.make_model(name, d)
    Ns, med = [250, 1000, 4000], []
    for N in Ns:
        errs = []
        for r in range(6):
            g0 = torch.Generator().manual_seed(r)
            theta = model.params_near_reference(g0, 0.1)
            grad = 0.3 * torch.randn(
                model.num_params, generator=g0, dtype=torch.float64
            )
            exact = fisher_exact.fisher_natural_gradient(model, theta, grad)
            gen = torch.Generator().manual_seed(1000 + r)
            Z = model.sample_latent(N, gen)
            est = F.kfng_gradient(
                lambda t, Z=Z: model.sample(t, Z),
                theta,
                grad,
                num_basis=int(d * N**0.5),
                eps=1e-5,
                lam=1e-4,
                kernel=kwng.GaussianKernel(1.0),
                generator=gen,
                bandwidth="mean_sq",
                sigma0=0.5,
            )
            errs.append(kwng.relative_error(est.direction, exact))
        med.append(float(np.median(errs)))
    slope = loglog_slope(Ns, med)
    assert slope < -0.3, (slope, med)
    assert med[-1] < 0.1, med


def test_sphere_kernel_fisher_metric_blows_up():
    # No density: functions that vanish on the sphere but not their normal derivative
    # have zero variance and a non-zero distributional gradient, so the kernel Fisher
    # metric grows without bound as the basis grows. On the normal model it stays near
    # the exact G_F.
    cfg = E.sweep_config("small")
    rows = {
        (m, N): fisher_sweep.compare_once(
            m, {"panel": "N", "d": 2, "N": N, "M": int(2 * N**0.5)}, 0, cfg
        )
        for m in ("sphere", "normal")
        for N in (250, 1000)
    }
    assert rows[("sphere", 1000)]["gf_max"] > 1e6 * rows[("normal", 1000)]["gf_max"]
    assert rows[("sphere", 1000)]["range_residual"] > 1e-2
    assert np.isnan(rows[("sphere", 1000)]["err_fng"])
    for N in (250, 1000):
        r = rows[("normal", N)]
        assert r["gf_exact_max"] / 3 < r["gf_max"] < 3 * r["gf_exact_max"]
        assert r["range_residual"] < 1e-4


# --------------------------------------------------------------------------------------
# The experiment command
# --------------------------------------------------------------------------------------
def test_sweep_resumes_and_never_overwrites(tmp_path):
    cfg = E.sweep_config("small")
    cfg.update(
        models=["normal", "sphere"], N_values=[200], M_values=[10], N_fixed=200, runs=2
    )
    fisher_sweep.run_sweep(cfg, tmp_path, progress=False)
    rows = fisher_sweep.load_sweep(tmp_path / "sweep.csv")
    assert len(rows) == 2 * 2 * 2  # models × points × runs
    assert all(np.isfinite(r["err_wng"]) for r in rows)
    assert all(np.isfinite(r["err_fng"]) == (r["model"] != "sphere") for r in rows)
    prov = json.loads((tmp_path / "fisher-sweep.provenance.json").read_text())
    for key in PROVENANCE_KEYS:
        assert key in prov
    before = (tmp_path / "sweep.csv").read_text()
    prov_before = (tmp_path / "fisher-sweep.provenance.json").read_text()
    # resume: nothing to do, nothing changed
    fisher_sweep.run_sweep(cfg, tmp_path, progress=False)
    assert (tmp_path / "sweep.csv").read_text() == before
    assert (tmp_path / "fisher-sweep.provenance.json").read_text() == prov_before
    other = dict(cfg, runs=3)
    with pytest.raises(ValueError, match="another configuration"):
        fisher_sweep.run_sweep(other, tmp_path, progress=False)
    assert (tmp_path / "sweep.csv").read_text() == before
    # the figures and the table read these rows
    import matplotlib.pyplot as plt

    from studies.fisher import figures as P

    for fig in (
        P.plot_fisher_relerr(rows, models=("normal",)),
        P.plot_fisher_sphere(rows),
    ):
        assert len(fig.axes) >= 2
        plt.close(fig)
    table = {r["model"]: r for r in P.comparison_table(rows, 200)}
    assert np.isnan(table["sphere"]["err_fng"]) and np.isfinite(
        table["normal"]["err_fng"]
    )
    assert table["sphere"]["gf_max"] > table["normal"]["gf_max"]
    with pytest.raises(ValueError, match="column"):
        P.median_by(rows, "no_such_column", ("N",))


def test_flow_all_methods_decrease_the_loss(tmp_path):
    cfg = E.flow_config("small")
    cfg.update(iterations=8, N=200, M=28)
    fisher_flow.run_flow(cfg, tmp_path, progress=False)
    flow = fisher_flow.load_flow(tmp_path / "flow.csv")
    for loss in ("w2", "kl"):
        for method in E.FLOW_METHODS:
            v = flow[loss][method]
            assert len(v) == 9 and np.isfinite(v).all()
            assert v[-1] < 0.7 * v[0], (loss, method, v)


def test_directory_provenance_gathers_the_parts(tmp_path):
    """``provenance.json`` of a results directory holds both parts' records and the keys
    every results directory has; it is derived from the part files, never recomputed."""
    with pytest.raises(ValueError, match="no result file with a provenance"):
        E.write_directory_provenance(tmp_path)
    cfg = E.flow_config("small")
    cfg.update(iterations=2, N=100, M=20)
    flow = fisher_flow.run_flow(cfg, tmp_path, progress=False)
    rec = E.write_directory_provenance(tmp_path)
    assert set(rec["files"]) == {"fisher-flow.provenance.json"}
    on_disk = json.loads((tmp_path / "provenance.json").read_text())
    for key in PROVENANCE_KEYS:
        assert key in on_disk
    assert on_disk["wall_time_s"] == pytest.approx(flow["wall_time_s"])
    assert E.main(["fisher", "--part", "provenance", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "provenance.json").read_text()) == on_disk


def test_committed_results_have_a_directory_provenance():
    root = (
        __import__("pathlib").Path(__file__).resolve().parents[1] / "results" / "fisher"
    )
    rec = json.loads((root / "provenance.json").read_text())
    names = {f"{p}.provenance.json" for p in E.PARTS}
    assert set(rec["files"]) == names
    for name in names:
        assert rec["files"][name] == json.loads((root / name).read_text())
