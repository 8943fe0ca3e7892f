"""The ``flow`` part of the Fisher–Rao experiment (see :mod:`studies.fisher.cli`
for the protocol): natural-gradient descent of the normal model toward a target normal
for the ``W2²`` and ``KL`` losses, with the exact and the kernel-estimated Wasserstein
and Fisher natural gradients and the Euclidean one, and the reading and checking of
``flow.csv``. The problem (start, target) is drawn as in the W2 flow of Fig. 2
(:func:`studies.toy.flow.flow_problem`).
"""

from __future__ import annotations

import csv
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from kwng.estimator import kwng_gradient
from kwng.fisher import kfng_gradient
from kwng.fisher_exact import fisher_natural_gradient
from kwng.models import NormalModel
from studies.kit.guard_csv import read_csv_checked, write_csv_rows
from studies.kit.provenance import atomic_write_json, make_provenance
from studies.kit.result_dir import prepare_result_dir
from studies.toy.flow import flow_problem, normal_w2_and_grad
from studies.toy.grid import keyed_seed, parse_bandwidth

__all__ = ["FLOW_COLUMNS", "normal_kl_and_grad", "run_flow", "load_flow"]

# the logger of the experiment's command (the records name the command)
log = logging.getLogger("studies.fisher.cli")

FLOW_COLUMNS = ("loss", "method", "iteration", "value")


def normal_kl_and_grad(
    model: NormalModel, theta: torch.Tensor, mu_t: np.ndarray, Sigma_t: np.ndarray
) -> tuple[float, torch.Tensor]:
    """``L(θ) = KL(N(μ, LLᵀ) ‖ N(μ*, Σ*))`` and its gradient in ``θ = (μ, vech L)``
    (autograd of ``½[tr(Σ*⁻¹Σ) + (μ* - μ)ᵀΣ*⁻¹(μ* - μ) - d + log det Σ* - log det
    Σ]``)."""
    if not isinstance(model, NormalModel):
        raise ValueError("model must be a NormalModel")
    th = theta.detach().to(torch.float64).clone().requires_grad_(True)
    mu, L = model.split(th)
    St = torch.as_tensor(Sigma_t, dtype=torch.float64)
    Sinv = torch.linalg.inv(St)
    dm = torch.as_tensor(mu_t, dtype=torch.float64) - mu
    Sigma = L @ L.T
    kl = 0.5 * (
        torch.trace(Sinv @ Sigma)
        + dm @ Sinv @ dm
        - model.d
        + torch.logdet(St)
        - 2.0 * torch.log(torch.abs(torch.diagonal(L))).sum()
    )
    (g,) = torch.autograd.grad(kl, th)
    return float(kl.detach()), g.detach()


def _direction(
    method: str,
    model: NormalModel,
    theta: torch.Tensor,
    grad: torch.Tensor,
    cfg: dict,
    it: int,
    loss: str,
) -> torch.Tensor:
    if method == "eg":
        return grad
    if method == "wng":
        return model.wng(theta, grad)
    if method == "fng":
        return fisher_natural_gradient(model, theta, grad)
    gen = torch.Generator().manual_seed(keyed_seed(cfg["seed"], loss, method, it))
    Z = model.sample_latent(cfg["N"], gen)
    spec = parse_bandwidth(cfg["bandwidth"])
    lam = cfg["lam"] if method == "kwng" else cfg["lam_fisher"]
    kw = dict(
        num_basis=cfg["M"],
        eps=cfg["eps"],
        lam=lam,
        kernel=spec.kernel(),
        damping=cfg["damping"],
        generator=gen,
        bandwidth=spec.rule,
        sigma0=spec.sigma0,
    )
    est = kwng_gradient if method == "kwng" else kfng_gradient
    return est(lambda t: model.sample(t, Z), theta, grad, **kw).direction


def _flow_step(
    fn, model, theta, value, mu_t, Sigma_t, step, method, cfg, it, loss, loss0, stopped
):
    """One iteration of :func:`run_flow` for ``(loss, method)``: the new ``(θ, value)``;
    a failure or a divergence is logged and recorded in ``stopped``."""
    try:
        _, grad = fn(model, theta, mu_t, Sigma_t)
        theta = theta - step * _direction(method, model, theta, grad, cfg, it, loss)
        value = fn(model, theta, mu_t, Sigma_t)[0]
        ok = (
            bool(torch.isfinite(theta).all())
            and math.isfinite(value)
            and value < cfg["divergence_factor"] * loss0
        )
    except (ValueError, np.linalg.LinAlgError, torch.linalg.LinAlgError) as exc:
        log.warning("flow %s/%s failed at iteration %d: %s", loss, method, it, exc)
        ok = False
    if not ok:
        log.warning(
            "flow %s/%s diverged at iteration %d: NaN from here", loss, method, it
        )
        stopped[(loss, method)] = it
    return theta, value


def _flow_csv_problems(path: Path, cfg: dict) -> list[str]:
    """What is missing or damaged in ``flow.csv`` (each problem names the file, and
    the line where there is one); empty when every loss and method has all its
    iterations."""
    if not path.exists():
        return [f"{path} missing"]
    rows, problems = read_csv_checked(
        path, FLOW_COLUMNS,
        {"iteration": int, "value": float},
        lambda r: (r["loss"], r["method"], r["iteration"]))
    for loss in cfg["losses"]:
        for m in cfg["methods"]:
            n = sum(r["loss"] == loss and r["method"] == m for r in rows)
            if n != cfg["iterations"] + 1:
                problems.append(f"{path}: {loss}/{m} has {n} of "
                                f"{cfg['iterations'] + 1} iterations")
    return problems


def _flow_rows(cfg: dict, progress: bool) -> tuple[list[dict], dict, np.ndarray,
                                                    np.ndarray]:
    """The rows of ``flow.csv`` (every loss, method and iteration), the stopped runs
    (``(loss, method) -> iteration``) and the target ``(μ*, Σ*)``."""
    from tqdm.auto import tqdm

    model, theta0, mu_t, Sigma_t = flow_problem(cfg)
    loss_fns = {"w2": normal_w2_and_grad, "kl": normal_kl_and_grad}
    rows, stopped = [], {}
    for loss in cfg["losses"]:
        fn = loss_fns[loss]
        loss0 = fn(model, theta0, mu_t, Sigma_t)[0]
        for method in cfg["methods"]:
            theta, value = theta0.clone(), loss0
            step = cfg["eg_step"] if method == "eg" else cfg["step"]
            rows.append({"loss": loss, "method": method, "iteration": 0,
                         "value": value})
            for it in tqdm(range(cfg["iterations"]), desc=f"flow {loss}/{method}",
                           disable=not progress):
                if (loss, method) not in stopped:
                    theta, value = _flow_step(fn, model, theta, value, mu_t, Sigma_t,
                                              step, method, cfg, it, loss, loss0,
                                              stopped)
                if (loss, method) in stopped:
                    value = math.nan
                rows.append({"loss": loss, "method": method, "iteration": it + 1,
                             "value": value})
    return rows, stopped, mu_t, Sigma_t


def run_flow(cfg: dict, out: str | Path, progress: bool = True,
             force: bool = False) -> dict:
    """Natural-gradient descent ``θ ← θ - γ · direction`` toward the target for every
    loss and method of ``cfg`` (:func:`~studies.fisher.cli.flow_config`); writes
    ``out/flow.csv`` (loss, method, iteration, value) and the provenance. A method whose
    loss becomes non-finite or exceeds ``divergence_factor`` times the initial loss is
    stopped and recorded as NaN from then on. A complete flow in ``out`` is left as it
    is; an interrupted or damaged one (``flow.csv`` missing or without every iteration,
    about 20 s of work at full scale) is redone whole."""
    if cfg.get("experiment") != "fisher-flow":
        raise ValueError("cfg must come from flow_config()")
    out = Path(out)
    prev = prepare_result_dir(out, cfg, force, part=cfg["experiment"],
                              files=(out / "flow.csv",))
    damage = _flow_csv_problems(out / "flow.csv", cfg) if prev else []
    if prev and not damage:
        log.info("flow results already complete in %s", out)
        return prev
    if damage:
        log.warning("flow results in %s are incomplete or damaged (%s): the flow is "
                    "recomputed", out, "; ".join(damage[:3]))
    t0 = time.perf_counter()
    rows, stopped, mu_t, Sigma_t = _flow_rows(cfg, progress)
    write_csv_rows(out / "flow.csv", FLOW_COLUMNS, rows)
    wall = time.perf_counter() - t0
    record = make_provenance(
        cfg, seeds={"base_seed": cfg["seed"]}, device="cpu", wall_time_s=wall,
        wall_time_total_s=wall, threads=torch.get_num_threads(),
        diverged_at={f"{k[0]}/{k[1]}": v for k, v in stopped.items()},
        target_mean=mu_t.tolist(), target_cov=Sigma_t.tolist(),
    )
    atomic_write_json(out / "fisher-flow.provenance.json", record)
    return record


def load_flow(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """``{loss: {method: values over iterations}}`` from ``flow.csv``."""
    out: dict[str, dict[str, list]] = {}
    with open(path, encoding="utf-8", newline="") as fh:
        for r in csv.DictReader(fh):
            out.setdefault(r["loss"], {}).setdefault(r["method"], []).append(
                float(r["value"])
            )
    return {k: {m: np.array(v) for m, v in d.items()} for k, d in out.items()}
