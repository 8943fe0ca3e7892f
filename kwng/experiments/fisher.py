"""Fisher–Rao next to Wasserstein: the same kernel estimator on both duals (beyond the
paper).

One command,
``python -m kwng.experiments fisher [--part sweep|flow|all] [--scale small|full]
[--out DIR]``, with two parts:

* ``sweep`` – for the normal, log-normal and hyper-sphere models, at every grid point
  ``(d, N, M)`` and for ``runs`` random ``(θ, ∇L)`` (the protocol of ``relerr``): the
  relative error of KWNG against the exact WNG, of the kernel Fisher estimator against
  the exact Fisher natural gradient (``reparam`` Jacobian with ``λ = 0`` and with
  ``λ = lam_fisher``, ``score`` Jacobian with ``λ = 0``), the largest eigenvalue of the
  kernel Fisher metric ``Ĝ_F``, the part of ``T`` outside the range of ``C`` and the
  time of each estimate. On the sphere the Fisher natural gradient does not exist: its
  errors are NaN and the other columns show what the estimator does there;
* ``flow`` – natural-gradient descent of the normal model toward a target normal, for
  two losses (``W2²`` and ``KL(ρ_θ ‖ ρ*)``), with the exact WNG, the exact Fisher NG,
  KWNG (``λ = 0``, the paper's setting), the kernel Fisher estimate (``λ = lam_fisher``)
  and the Euclidean gradient.

Results go to ``DIR`` (default ``_build/results/fisher-<scale>``, outside the committed
results) with one provenance file per part (``fisher-sweep.provenance.json``,
``fisher-flow.provenance.json``: command, configuration, git commit, device, date,
seeds, wall time). The sweep CSV is rewritten atomically after each grid point and a
rerun with the same configuration resumes; a directory holding results of *another*
configuration is never touched (the command stops with an error). The committed results
were made with ``--scale full --out results/fisher``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from .. import config as _config
from ..estimator import kwng_gradient
from ..fisher import (
    fisher_natural_gradient,
    kfng_gradient,
)
from ..kernels import GaussianKernel
from ..models import NormalModel
from ..provenance import (
    ResultFileError,
    atomic_write_json,
    index_provenance,
    make_provenance,
)
from .cli_checks import path_problem
from .fisher_sweep import (  # noqa: F401  (moved; re-exported under the old path)
    BANDWIDTH,
    MODELS,
    SWEEP_COLUMNS,
    _key,
    _parse_bandwidth,
    _points,
    _prepare_dir,
    _relerr,
    _seed,
    _write_csv,
    checked_sweep_rows,
    compare_once,
    load_sweep,
    metric_vs_lambda,
    run_sweep,
)
from .guard import ConfigMismatchError
from .guard_csv import read_csv_checked
from .synthetic import draw_theta, normal_w2_and_grad

__all__ = [
    "MODELS",
    "SWEEP_COLUMNS",
    "compare_once",
    "metric_vs_lambda",
    "FLOW_METHODS",
    "LOSSES",
    "sweep_config",
    "flow_config",
    "run_sweep",
    "run_flow",
    "load_sweep",
    "checked_sweep_rows",
    "load_flow",
    "normal_kl_and_grad",
    "main",
]

log = logging.getLogger(__name__)

FLOW_METHODS = ("wng", "fng", "kwng", "kfng", "eg")
LOSSES = ("w2", "kl")


def sweep_config(scale: str | None = None) -> dict:
    """Grid of the sweep. ``full`` is sized for a 2-core CPU (a few minutes):
    ``d ∈ {2, 4}``, ``N`` up to 4000 with ``M = ⌊d√N⌋`` (the paper's rule), an ``M``
    panel at ``N = 2000``, 20 runs per point (enough for a median and quartiles; the
    paper's 100 runs change the spread of the boxes, not their centres)."""
    full = _config.resolve(scale) == "full"
    return {
        "experiment": "fisher-sweep",
        "scale": "full" if full else "small",
        "models": list(MODELS),
        "dims": [2, 4] if full else [2],
        "N_values": [250, 500, 1000, 2000, 4000] if full else [250, 500, 1000],
        "N_fixed": 2000 if full else 1000,
        "M_values": [10, 30, 100, 300] if full else [10, 30, 100],
        "runs": 20 if full else 3,
        "eps": 1e-5,
        "lam": 0.0,
        "lam_fisher": 1e-4,
        "damping": "T_tilde",
        "theta_variance": 0.1,
        "grad_variance": 0.1,
        "bandwidth": dict(BANDWIDTH),
        "seed": 14,
    }


def flow_config(scale: str | None = None) -> dict:
    """The flows: normal model, ``d = 4`` (``q = 14``; ``d = 2`` at small scale), step
    0.1 for the natural gradients and ``eg_step`` for the Euclidean one, estimators with
    ``N`` samples and ``M = ⌊d√N⌋`` basis points redrawn at every step."""
    full = _config.resolve(scale) == "full"
    d = 4 if full else 2
    N = 1000 if full else 250
    return {
        "experiment": "fisher-flow",
        "scale": "full" if full else "small",
        "d": d,
        "iterations": 150 if full else 25,
        "losses": list(LOSSES),
        "methods": list(FLOW_METHODS),
        "N": N,
        "M": int(d * N**0.5),
        "step": 0.1,
        "eg_step": 0.02,
        "eps": 1e-5,
        "lam": 0.0,
        "lam_fisher": 1e-4,
        "damping": "T_tilde",
        "bandwidth": BANDWIDTH["normal"],
        "theta_variance": 0.1,
        "target_mean_std": 1.0,
        "divergence_factor": 1e6,
        "seed": 15,
    }


# --------------------------------------------------------------------------------------
# Flow
# --------------------------------------------------------------------------------------
def normal_kl_and_grad(
    model: NormalModel, theta: torch.Tensor, mu_t: np.ndarray, Sigma_t: np.ndarray
) -> tuple[float, torch.Tensor]:
    """``L(θ) = KL(N(μ, LLᵀ) ‖ N(μ*, Σ*))`` and its gradient in ``θ = (μ, vech L)``
    (autograd of
    ``½[tr(Σ*⁻¹Σ) + (μ* - μ)ᵀΣ*⁻¹(μ* - μ) - d + log det Σ* - log det Σ]``)."""
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


def _flow_problem(
    cfg: dict,
) -> tuple[NormalModel, torch.Tensor, np.ndarray, np.ndarray]:
    d = cfg["d"]
    model = NormalModel(d)
    g = torch.Generator().manual_seed(cfg["seed"])
    theta0 = draw_theta("normal", d, g, cfg["theta_variance"])
    target = draw_theta("normal", d, g, cfg["theta_variance"])
    target[:d] = cfg["target_mean_std"] * torch.randn(
        d, generator=g, dtype=torch.float64
    )
    mu_t, L_t = model.split(target)
    return model, theta0, mu_t.numpy(), (L_t @ L_t.T).numpy()


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
    gen = torch.Generator().manual_seed(_seed(cfg["seed"], loss, method, it))
    Z = model.sample_latent(cfg["N"], gen)
    _, rule, sigma0 = _parse_bandwidth(cfg["bandwidth"])
    lam = cfg["lam"] if method == "kwng" else cfg["lam_fisher"]
    kw = dict(
        num_basis=cfg["M"],
        eps=cfg["eps"],
        lam=lam,
        kernel=GaussianKernel(1.0),
        damping=cfg["damping"],
        generator=gen,
        bandwidth=rule,
        sigma0=sigma0,
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
        path, ("loss", "method", "iteration", "value"),
        {"iteration": int, "value": float},
        lambda r: (r["loss"], r["method"], r["iteration"]))
    for loss in cfg["losses"]:
        for m in cfg["methods"]:
            n = sum(r["loss"] == loss and r["method"] == m for r in rows)
            if n != cfg["iterations"] + 1:
                problems.append(f"{path}: {loss}/{m} has {n} of "
                                f"{cfg['iterations'] + 1} iterations")
    return problems


def run_flow(cfg: dict, out: str | Path, progress: bool = True,
             force: bool = False) -> dict:
    """Natural-gradient descent ``θ ← θ - γ · direction`` toward the target for every
    loss and method of ``cfg`` (:func:`flow_config`); writes ``out/flow.csv`` (loss,
    method, iteration, value) and the provenance. A method whose loss becomes non-finite
    or exceeds ``divergence_factor`` times the initial loss is stopped and recorded as
    NaN from then on. A complete flow in ``out`` is left as it is; an interrupted one
    (no ``flow.csv`` yet, about 20 s of work at full scale) is redone whole."""
    from tqdm.auto import tqdm

    if cfg.get("experiment") != "fisher-flow":
        raise ValueError("cfg must come from flow_config()")
    out = Path(out)
    prev = _prepare_dir(out, cfg, force, (out / "flow.csv",))
    damage = _flow_csv_problems(out / "flow.csv", cfg) if prev else []
    if prev and not damage:
        log.info("flow results already complete in %s", out)
        return prev
    if damage:
        log.warning("flow results in %s are incomplete or damaged (%s): the flow is "
                    "recomputed", out, "; ".join(damage[:3]))
    t0 = time.perf_counter()
    model, theta0, mu_t, Sigma_t = _flow_problem(cfg)
    loss_fns = {"w2": normal_w2_and_grad, "kl": normal_kl_and_grad}
    rows, stopped = [], {}
    for loss in cfg["losses"]:
        fn = loss_fns[loss]
        loss0 = fn(model, theta0, mu_t, Sigma_t)[0]
        for method in cfg["methods"]:
            theta, value = theta0.clone(), loss0
            step = cfg["eg_step"] if method == "eg" else cfg["step"]
            rows.append(
                {"loss": loss, "method": method, "iteration": 0, "value": value}
            )
            for it in tqdm(
                range(cfg["iterations"]),
                desc=f"flow {loss}/{method}",
                disable=not progress,
            ):
                if (loss, method) not in stopped:
                    theta, value = _flow_step(
                        fn,
                        model,
                        theta,
                        value,
                        mu_t,
                        Sigma_t,
                        step,
                        method,
                        cfg,
                        it,
                        loss,
                        loss0,
                        stopped,
                    )
                if (loss, method) in stopped:
                    value = math.nan
                rows.append(
                    {
                        "loss": loss,
                        "method": method,
                        "iteration": it + 1,
                        "value": value,
                    }
                )
    _write_csv(out / "flow.csv", ("loss", "method", "iteration", "value"), rows)
    wall = time.perf_counter() - t0
    record = make_provenance(
        cfg,
        seeds={"base_seed": cfg["seed"]},
        device="cpu",
        wall_time_s=wall,
        wall_time_total_s=wall,
        threads=torch.get_num_threads(),
        diverged_at={f"{k[0]}/{k[1]}": v for k, v in stopped.items()},
        target_mean=mu_t.tolist(),
        target_cov=Sigma_t.tolist(),
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


PARTS = ("fisher-sweep", "fisher-flow")


def write_directory_provenance(out: str | Path) -> dict:
    """``provenance.json`` of the results directory, gathered from the part records
    (``<part>.provenance.json``) by :func:`kwng.provenance.index_provenance`."""
    return index_provenance(out)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m kwng.experiments fisher [--part sweep|flow|all] [--scale]
    [--out]``."""
    ap = argparse.ArgumentParser(
        prog="python -m kwng.experiments fisher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("name", choices=["fisher"])
    ap.add_argument(
        "--part",
        choices=["sweep", "flow", "all", "provenance"],
        default="all",
        help="provenance: only (re)write the directory's provenance.json from the "
        "part files",
    )
    ap.add_argument(
        "--scale",
        choices=list(_config.SCALES),
        default=None,
        help="grid size (default: $KWNG_SCALE, else small)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="output directory (default _build/results/fisher-<scale>)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the estimates are small; more threads only "
        "contend on a shared 2-core machine)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--force", action="store_true", help="move a part's results of "
                    "another configuration (or an unreadable sweep.csv) to dated "
                    "backups instead of refusing")
    args = ap.parse_args(argv)
    if args.threads < 1:
        raise SystemExit(
            f"--threads must be an integer in [1, inf), got {args.threads}"
        )
    torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    scale = _config.resolve(args.scale)
    if path_problem(args, ("out",)):
        ap.error(path_problem(args, ("out",)))
    out = Path(args.out or Path("_build") / "results" / f"fisher-{scale}")
    try:
        for part in ("sweep", "flow"):
            if args.part not in (part, "all"):
                continue
            cfg = (sweep_config if part == "sweep" else flow_config)(scale)
            print(f"fisher {part} configuration:", json.dumps(cfg))
            prov = (run_sweep if part == "sweep" else run_flow)(
                cfg, out, progress=not args.no_progress, force=args.force)
            print(f"fisher {part}: {prov['wall_time_s']:.1f} s on {prov['device']} "
                  f"-> {out}")
    except (ConfigMismatchError, ResultFileError) as exc:
        log.error("refused: %s", exc)
        return 2
    write_directory_provenance(out)
    return 0
