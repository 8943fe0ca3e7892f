"""The W2² flow of the synthetic study (Fig. 2 of Arbel et al. 2020; ``python -m
studies flow``): the normal model flows towards a target normal with the exact
WNG, KWNG and the Euclidean gradient (:func:`run_flow`), on the problem of
:func:`flow_problem` with the loss and gradient of :func:`normal_w2_and_grad`. Results
and resume as the sweeps of :mod:`studies.synthetic.sweep`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from kwng.estimator import kwng_gradient
from kwng.gaussian import gaussian_w2_squared
from kwng.models import NormalModel
from studies.kit.provenance import write_provenance
from studies.kit.result_dir import prepare_result_dir
from studies.toy.grid import BandwidthSpec, keyed_seed, parse_bandwidth
from studies.toy.setup import (
    flow_problems,
    write_flow_csvs,
    write_pca_csv,
)

__all__ = ["normal_w2_and_grad", "flow_problem", "run_flow"]

log = logging.getLogger(__name__)


def normal_w2_and_grad(
    model: NormalModel, theta: torch.Tensor, mu_t: np.ndarray, Sigma_t: np.ndarray
) -> tuple[float, torch.Tensor]:
    """``L(θ) = W2²(N(μ, LLᵀ), N(μ*, Σ*))`` and its Euclidean gradient in ``θ = (μ, vech
    L)``.

    With ``S = Σ*^{1/2}`` and ``T = S (SΣS)^{-1/2} S`` (the optimal transport map from
    ``N(·, Σ)`` to ``N(·, Σ*)``), ``∇_μ L = 2(μ - μ*)`` and ``∇_Σ L = I - T``, so that
    ``∇_L L = tril(2 (I - T) L)``.
    """
    if not isinstance(model, NormalModel):
        raise ValueError("model must be a NormalModel")
    mu, L = model.split(theta)
    mu, L = mu.detach().cpu().numpy(), L.detach().cpu().numpy()
    Sigma = L @ L.T
    loss = gaussian_w2_squared(mu, Sigma, mu_t, Sigma_t)
    w, V = np.linalg.eigh(Sigma_t)
    S = (V * np.sqrt(np.clip(w, 0, None))) @ V.T
    w2, V2 = np.linalg.eigh(S @ Sigma @ S)
    inv_sqrt = (V2 / np.sqrt(np.clip(w2, 1e-300, None))) @ V2.T
    Tmap = S @ inv_sqrt @ S
    gL = 2.0 * (np.eye(model.d) - Tmap) @ L
    grad = model.join(
        torch.from_numpy(2.0 * (mu - mu_t)), torch.from_numpy(np.tril(gL))
    )
    return loss, grad.to(torch.float64)


def flow_problem(cfg: dict) -> tuple[NormalModel, torch.Tensor, np.ndarray, np.ndarray]:
    """The flow of Fig. 2: ``(model, θ₀, μ*, Σ*)`` drawn from ``cfg["seed"]`` (d =
    ``cfg["d"]``)."""
    d = cfg["d"]
    model = NormalModel(d)
    g = torch.Generator().manual_seed(cfg["seed"])
    theta0 = model.params_near_reference(g, cfg["theta_variance"])
    target = model.params_near_reference(g, cfg["theta_variance"])
    target[:d] = cfg["target_mean_std"] * torch.randn(
        d, generator=g, dtype=torch.float64
    )
    mu_t, L_t = model.split(target)
    return model, theta0, mu_t.numpy(), (L_t @ L_t.T).numpy()


def _flow_direction(
    method, model, th, grad, cfg, it, dev, spec: BandwidthSpec
) -> torch.Tensor:
    """The direction of ``method`` at ``th`` in :func:`run_flow` (EG, exact WNG or a
    KWNG variant)."""
    variants = cfg["kwng_variants"]
    if method == "eg":
        direction = grad
    elif method == "wng":
        direction = model.wng(th, grad)
    else:
        N, M = variants[method]["N"], variants[method]["M"]
        g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], method, it))
        Z = model.sample_latent(N, g).to(dev)
        res = kwng_gradient(
            lambda t, Z=Z: model.sample(t, Z),
            th.to(dev),
            grad.to(dev),
            num_basis=M,
            eps=cfg["eps"],
            lam=cfg["lam"],
            kernel=spec.kernel(),
            generator=g,
            damping=cfg["damping"],
            bandwidth=spec.rule,
            sigma0=spec.sigma0,
        )
        direction = res.direction.cpu()
    return direction


def _complete(out: Path, cfg: dict, force: bool) -> dict | None:
    """The provenance of complete flow results of ``cfg`` in ``out``, else ``None``
    (results of another configuration refused unless ``force``; incomplete or damaged
    ones recomputed)."""
    prev = prepare_result_dir(out, cfg, force)
    if prev:
        damage = flow_problems(out, prev)
        if not damage:
            log.info("flow results already complete in %s", out)
            return prev
        log.warning("flow results in %s are incomplete or damaged (%s): the flow is "
                    "recomputed", out, "; ".join(damage[:3]))
    return None


def run_flow(cfg: dict, out: str | Path, device: str = "cpu", progress: bool = True,
             force: bool = False) -> dict:
    """Fig. 2: iterate ``θ ← θ - γ · direction`` for exact WNG, KWNG and EG on the W2²
    loss.

    Writes ``out/loss.csv`` (iteration, method, loss), ``out/trajectories.csv``
    (iteration, method, θ) and ``out/pca.csv`` (the trajectories projected on the two
    leading principal directions of the WNG trajectory), plus provenance. Results of
    another configuration in ``out`` are refused unless ``force`` (moved to a dated
    backup). Returns the provenance record.
    """
    from tqdm.auto import tqdm

    out = Path(out)
    prev = _complete(out, cfg, force)
    if prev:
        return prev
    t0 = time.perf_counter()
    model, theta0, mu_t, Sigma_t = flow_problem(cfg)
    variants = cfg["kwng_variants"]
    spec = parse_bandwidth(cfg["bandwidth"])
    dev = torch.device(device)
    methods = ["wng", *variants, "eg"]
    traj = {m: [theta0.clone()] for m in methods}
    loss0 = normal_w2_and_grad(model, theta0, mu_t, Sigma_t)[0]
    losses = {m: [loss0] for m in methods}
    stopped: dict[str, int] = {}
    for it in tqdm(range(cfg["iterations"]), desc="flow", disable=not progress):
        for method in methods:
            th = traj[method][-1]
            if method in stopped:
                traj[method].append(torch.full_like(th, float("nan")))
                losses[method].append(float("nan"))
                continue
            _, grad = normal_w2_and_grad(model, th, mu_t, Sigma_t)
            try:
                direction = _flow_direction(method, model, th, grad, cfg, it, dev, spec)
                new = th - cfg["steps"][method] * direction
                loss = normal_w2_and_grad(model, new, mu_t, Sigma_t)[0]
                ok = (bool(torch.isfinite(new).all()) and np.isfinite(loss)
                      and loss < cfg["divergence_factor"] * loss0)
            except (ValueError, np.linalg.LinAlgError) as exc:
                # diverged: samples or Σ unusable
                log.warning("flow %s failed at iteration %d: %s", method, it, exc)
                ok = False
            if not ok:
                log.warning("flow %s diverged at iteration %d; recording NaN from here",
                            method, it)
                stopped[method] = it
                new, loss = torch.full_like(th, float("nan")), float("nan")
            traj[method].append(new)
            losses[method].append(loss)
    write_flow_csvs(out, losses, traj, model)
    svals = write_pca_csv(out, traj)
    wall = time.perf_counter() - t0
    explained = (svals[:2] ** 2 / (svals ** 2).sum()).tolist()
    return write_provenance(out, cfg, seeds={"base_seed": cfg["seed"]}, device=device,
                            wall_time_s=wall, wall_time_total_s=wall,
                            pca_explained_variance=explained, diverged_at=stopped,
                            target_mean=mu_t.tolist(), target_cov=Sigma_t.tolist())
