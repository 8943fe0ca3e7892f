"""Why KWNG at the paper's Fig. 2 settings cannot follow the W2 flow of a 10-d normal
model.

At ``N = 128``, ``M = 100``, ``ε = 1e-10`` the flow of :mod:`studies.synthetic.sweep`
diverges within a few iterations on our 65-parameter model ``θ = (μ, vech L)``. This
module tests the candidate explanations at exactly those settings, one change at a time:

* ``diagonal``: a diagonal covariance, ``X = μ + l ⊙ Z``, ``q = 20`` (the target is
  diagonal too). For this family ``W2²`` is the Euclidean distance of ``(μ, l)``, so
  ``G_W = I`` and the exact WNG is the Euclidean gradient;
* ``sigma_coords``: the paper's coordinates ``θ = (μ, s)`` with ``s`` the lower triangle
  of ``Σ`` (App. D.1), sampled as ``X = μ + chol(Σ) Z``; exact WNG from
  :func:`kwng.gaussian.normal_wng_sigma_coords`;
* ``bandwidth``: fixed ``σ ∈ {1, 10}``, the median heuristic, and ``σ0 ∈ {0.5, 2}`` in
  ``σ = σ0 · mean‖X_n - Y_m‖²``;
* ``damping``: ``D = I``, ``diag(TᵀT)``, ``diag(T̃ᵀT̃)``, and ``ε = 1e-5`` instead of
  ``1e-10``.

For each variant it records the relative error of the KWNG direction at ``θ₀`` (median
over draws) and runs the flow with step ``0.1`` next to the exact WNG flow of the same
parametrisation, stopping a run whose loss exceeds ``1e6`` times the initial one.

Run ``python -m studies.synthetic.flow_study --scale small|full --out DIR``; results go
to ``DIR/flow_study.json`` with provenance (``DIR`` must not hold another
configuration's results).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kwng import scale_switch as _config
from kwng.estimator import kwng_gradient
from kwng.gaussian import normal_wng_sigma_coords
from studies.kit.provenance import (
    atomic_write_json,
    index_provenance,
    make_provenance,
    read_json,
)
from studies.toy.flow import flow_problem, normal_w2_and_grad
from studies.toy.grid import parse_bandwidth
from studies.toy.setup import flow_config

log = logging.getLogger(__name__)

__all__ = [
    "VARIANTS",
    "study_config",
    "Problem",
    "make_problem",
    "direction_error",
    "run_variant_flow",
    "run_study",
    "main",
]

#: The variants of the study, name -> (parametrisation, overrides of the settings).
VARIANTS: dict[str, tuple[str, dict]] = {
    "baseline (μ, vech L)": ("cholesky", {}),
    "diagonal Σ, q = 20": ("diagonal", {}),
    "paper's coordinates (μ, tril Σ)": ("sigma_coords", {}),
    "bandwidth σ = 1": ("cholesky", {"bandwidth": 1.0}),
    "bandwidth σ = 10": ("cholesky", {"bandwidth": 10.0}),
    "bandwidth median": ("cholesky", {"bandwidth": "median"}),
    "bandwidth σ0 = 2": ("cholesky", {"sigma0": 2.0}),
    "damping D = I": ("cholesky", {"damping": "identity"}),
    "damping D = diag(TᵀT)": ("cholesky", {"damping": "T"}),
    "ε = 1e-5": ("cholesky", {"eps": 1e-5}),
}


def study_config(scale: str | None = None) -> dict:
    """The paper's Fig. 2 KWNG settings; ``small`` runs fewer iterations and draws."""
    scale = _config.scale() if scale is None else scale
    if scale not in _config.SCALES:
        raise ValueError(f"scale must be one of {_config.SCALES}, got {scale!r}")
    full = scale == "full"
    base = flow_config("full")
    return {
        "experiment": "flow_study",
        "scale": "full" if full else "small",
        "d": base["d"],
        "seed": base["seed"],
        "theta_variance": base["theta_variance"],
        "target_mean_std": base["target_mean_std"],
        "N": 128,
        "M": 100,
        "eps": 1e-10,
        "lam": 0.0,
        "damping": "T_tilde",
        "bandwidth": "mean_sq",
        "sigma0": 0.5,
        "step": 0.1,
        "iterations": 50 if full else 10,
        "draws": 6 if full else 2,
        "divergence_factor": 1e6,
    }


@dataclass
class Problem:
    """A parametrisation of the flow: sampler, loss with its gradient, exact WNG."""

    name: str
    theta0: torch.Tensor
    sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_grad: Callable[[torch.Tensor], tuple[float, torch.Tensor]]
    wng: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    d: int


def _sym_from_tril(s: torch.Tensor, d: int) -> torch.Tensor:
    rows, cols = torch.tril_indices(d, d)
    A = torch.zeros(d, d, dtype=s.dtype).index_put((rows, cols), s)
    return A + A.T - torch.diag(torch.diag(A))


def _sigma_coords_problem(parametrisation: str, model, theta0, mu_t, Sigma_t):
    """The ``sigma_coords`` case of :func:`make_problem`: ``θ = (μ, vech Σ)``."""
    d = model.d
    rows, cols = torch.tril_indices(d, d)
    mu0, L0 = model.split(theta0)
    s0 = torch.cat([mu0, (L0 @ L0.T)[rows, cols]])

    def to_cholesky(th):
        L = torch.linalg.cholesky(_sym_from_tril(th[d:], d))
        return model.join(th[:d], L), L

    def sample(th, Z):
        L = torch.linalg.cholesky(_sym_from_tril(th[d:], d))
        return th[:d] + Z.to(th.dtype) @ L.T

    def loss_grad(th):
        th_l, L = to_cholesky(th)
        loss, g_l = normal_w2_and_grad(model, th_l, mu_t, Sigma_t)
        J = model.jacobian_s_l(L.numpy())
        g_s = np.linalg.solve(J.T, g_l[d:].numpy())
        return loss, torch.cat([g_l[:d], torch.from_numpy(g_s)])

    def wng(th, grad):
        Sigma = _sym_from_tril(th[d:], d).numpy()
        nat_mu, nat_s = normal_wng_sigma_coords(
            Sigma, grad[:d].numpy(), grad[d:].numpy()
        )
        return torch.from_numpy(np.concatenate([nat_mu, nat_s]))

    return Problem(parametrisation, s0, sample, loss_grad, wng, d)


def make_problem(parametrisation: str, cfg: dict) -> Problem:
    """The flow problem of Fig. 2 in one of the parametrisations ``cholesky`` (ours),
    ``sigma_coords`` (the paper's) or ``diagonal``."""
    model, theta0, mu_t, Sigma_t = flow_problem(cfg)
    d = model.d
    if parametrisation == "cholesky":
        return Problem(
            parametrisation,
            theta0,
            model.sample,
            lambda th: normal_w2_and_grad(model, th, mu_t, Sigma_t),
            model.wng,
            d,
        )
    if parametrisation == "sigma_coords":
        return _sigma_coords_problem(parametrisation, model, theta0, mu_t, Sigma_t)
    if parametrisation == "diagonal":
        mu0, L0 = model.split(theta0)
        th0 = torch.cat([mu0, torch.diag(L0)])
        mu_t_ = torch.from_numpy(mu_t)
        l_t = torch.from_numpy(np.sqrt(np.diag(Sigma_t)))  # the diagonal target

        def loss_grad(th):
            dm, dl = th[:d] - mu_t_, th[d:].abs() - l_t
            loss = float(dm @ dm + dl @ dl)
            return loss, torch.cat([2 * dm, 2 * dl * torch.sign(th[d:])])

        return Problem(
            parametrisation,
            th0,
            lambda th, Z: th[:d] + th[d:] * Z.to(th.dtype),
            loss_grad,
            lambda th, g: g.clone(),
            d,
        )
    raise ValueError(
        "parametrisation must be 'cholesky', 'sigma_coords' or 'diagonal', "
        f"got {parametrisation!r}"
    )


def _kwng(problem: Problem, theta, grad, settings: dict, generator: torch.Generator):
    Z = torch.randn(settings["N"], problem.d, generator=generator, dtype=torch.float64)
    spec = parse_bandwidth(settings["bandwidth"])  # σ0: the study's own setting
    return kwng_gradient(
        lambda t: problem.sample(t, Z),
        theta,
        grad,
        num_basis=settings["M"],
        eps=settings["eps"],
        lam=settings["lam"],
        kernel=spec.kernel(),
        bandwidth=spec.rule,
        sigma0=settings["sigma0"],
        damping=settings["damping"],
        generator=generator,
    ).direction


def direction_error(
    problem: Problem, settings: dict, draws: int, seed: int = 0
) -> list[float]:
    """Relative error of the KWNG direction at ``θ₀`` for ``draws`` independent
    draws."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    _, grad = problem.loss_grad(problem.theta0)
    exact = problem.wng(problem.theta0, grad)
    errs = []
    for k in range(draws):
        g = torch.Generator().manual_seed(seed + k)
        est = _kwng(problem, problem.theta0, grad, settings, g)
        errs.append(float((est - exact).norm() / exact.norm()))
    return errs


def run_variant_flow(
    problem: Problem,
    settings: dict,
    iterations: int,
    step: float,
    divergence_factor: float = 1e6,
    seed: int = 0,
) -> dict:
    """Exact WNG and KWNG flows side by side; losses per iteration (NaN once
    stopped)."""
    if iterations < 1 or not step > 0:
        raise ValueError(
            f"iterations must be >= 1 and step > 0, got {iterations}, {step}"
        )
    loss0 = problem.loss_grad(problem.theta0)[0]
    out = {}
    for method in ("wng", "kwng"):
        th, losses, stopped = problem.theta0.clone(), [loss0], None
        for it in range(iterations):
            if stopped is not None:
                losses.append(float("nan"))
                continue
            _, grad = problem.loss_grad(th)
            try:
                if method == "wng":
                    direction = problem.wng(th, grad)
                else:
                    g = torch.Generator().manual_seed(seed + 1000 + it)
                    direction = _kwng(problem, th, grad, settings, g)
                th = th - step * direction
                loss = problem.loss_grad(th)[0]
                ok = np.isfinite(loss) and loss < divergence_factor * loss0
            except (ValueError, RuntimeError, np.linalg.LinAlgError) as exc:
                # a diverged iterate: Σ no longer positive definite, or samples unusable
                log.warning(
                    "flow_study: %s stopped at iteration %d: %s", method, it, exc
                )
                ok = False
            if not ok:
                stopped, loss = it + 1, float("nan")
            losses.append(float(loss))
        out[method] = {"loss": losses, "stopped_at": stopped}
    return out


def run_study(cfg: dict, variants: dict | None = None, progress: bool = True) -> dict:
    """Every variant of :data:`VARIANTS`: direction error at ``θ₀`` and the flow."""
    from tqdm import tqdm

    variants = VARIANTS if variants is None else variants
    rows = {}
    base = {
        k: cfg[k] for k in ("N", "M", "eps", "lam", "damping", "bandwidth", "sigma0")
    }
    for name, (param, overrides) in tqdm(
        variants.items(), disable=not progress, desc="flow_study"
    ):
        settings = {**base, **overrides}
        problem = make_problem(param, cfg)
        errs = direction_error(problem, settings, cfg["draws"])
        flows = run_variant_flow(
            problem, settings, cfg["iterations"], cfg["step"], cfg["divergence_factor"]
        )
        rows[name] = {
            "parametrisation": param,
            "q": int(problem.theta0.numel()),
            "settings": settings,
            "direction_errors": errs,
            "median_error": float(np.median(errs)),
            **flows,
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["small", "full"], default=None)
    parser.add_argument("--out", type=Path, default=Path("results/flow_study"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = study_config(args.scale)
    path = args.out / "flow_study.json"
    if path.exists():
        prev = read_json(path)
        if prev.get("provenance", {}).get("config") == cfg:
            print(f"{path} already holds this configuration; nothing to do")
            return 0
        print(
            f"{path} holds another configuration; choose another --out", file=sys.stderr
        )
        return 1
    t0 = time.perf_counter()
    rows = run_study(cfg, progress=not args.no_progress)
    prov = make_provenance(
        cfg,
        seeds={"flow": cfg["seed"], "draws": list(range(cfg["draws"]))},
        wall_time_s=time.perf_counter() - t0,
    )
    atomic_write_json(path, {"rows": rows, "provenance": prov})
    index_provenance(path.parent)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
