"""Synthetic experiments of Arbel et al. (2020): estimator accuracy and the Gaussian W2 flow.

Three commands (``python -m kwng.experiments <name> --scale small|full ...``):

* ``relerr``    – relative error of KWNG against the exact WNG (Fig. 1 for the hyper-sphere,
  Fig. 5 for the normal and log-normal models): panel ``N`` (error vs ``N`` with
  ``M = ⌊d√N⌋``; its ``N = 5000`` column is the box-plot of panel (a)) and panel ``M`` (error vs
  ``M`` at fixed ``N``);
* ``bandwidth`` – relative error against a fixed Gaussian bandwidth ``σ`` (Fig. 6);
* ``flow``      – W2² flow of the normal model towards a target normal with exact WNG, KWNG and
  the Euclidean gradient (Fig. 2).

Results go to ``results/<name>/`` as CSV/JSON with a ``provenance.json``. Sweeps write one CSV
per model, rewritten atomically after every finished grid point; a rerun with the same
configuration skips the points already there (resume) after checking every row (a truncated,
non-finite or repeated row is recomputed). A rerun with another configuration refuses, naming the
differing keys, unless ``--force``, which moves the old results to a dated backup
(:mod:`kwng.experiments.guard`); so the committed full-scale results under ``results/`` are never
replaced by a small run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from kwng import config as _config
from kwng.batched import batched_kwng
from kwng.estimator import kwng_gradient
from kwng.experiments.cli_checks import device_problem, number_arg, path_problem
from kwng.experiments.grid import BandwidthSpec, keyed_seed, parse_bandwidth
from kwng.experiments.guard import ConfigMismatchError
from kwng.experiments.guard_csv import write_csv_rows
from kwng.experiments.provenance import ResultFileError, read_json, write_provenance
from kwng.experiments.result_dir import prepare_result_dir
from kwng.experiments.synthetic_setup import (
    FIGURE_MODELS,
    SWEEP_COLUMNS,
    bandwidth_config,
    checked_rows,
    flow_config,
    flow_problems,
    point_key,
    relerr_config,
    sweep_points,
    write_flow_csvs,
    write_pca_csv,
)
from kwng.gaussian import gaussian_w2_squared
from kwng.models import NormalModel, make_model

__all__ = ["REQUIRED_PROVENANCE", "run_sweep", "flow_problem", "run_flow", "check_results_complete",
           "normal_w2_and_grad", "main"]

log = logging.getLogger(__name__)

#: the keys every provenance record of the synthetic studies holds
REQUIRED_PROVENANCE = ("command", "config", "git_commit", "device", "date", "seeds", "wall_time_s")


# --------------------------------------------------------------------------------------------
# Sweeps (relerr, bandwidth)
# --------------------------------------------------------------------------------------------
def _compute_point(model_name: str, p: dict, cfg: dict, device: str, exact_cache: dict,
                   mem_bytes: float) -> list[dict]:
    d, N, M, R = p["d"], p["N"], p["M"], cfg["runs"]
    model = make_model(model_name, d)
    if (model_name, d) not in exact_cache:
        thetas, grads, exact = [], [], []
        for r in range(R):
            g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, r))
            th = model.params_near_reference(g, cfg["theta_variance"])
            gr = cfg["grad_variance"] ** 0.5 * torch.randn(model.num_params, generator=g, dtype=torch.float64)
            thetas.append(th)
            grads.append(gr)
            exact.append(model.wng(th, gr))
        exact_cache[(model_name, d)] = (torch.stack(thetas), torch.stack(grads), torch.stack(exact))
    Theta, Grads, Exact = exact_cache[(model_name, d)]
    Z = torch.empty(R, N, d, dtype=torch.float64)
    idx = torch.empty(R, M, dtype=torch.long)
    crd = torch.empty(R, M, dtype=torch.long)
    for r in range(R):
        g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, N, r))
        Z[r] = torch.randn(N, d, generator=g, dtype=torch.float64)
        gb = torch.Generator().manual_seed(keyed_seed(cfg["seed"], point_key(model_name, p), r))
        idx[r] = torch.randperm(N, generator=gb)[:M]
        crd[r] = torch.randint(0, d, (M,), generator=gb)
    spec = parse_bandwidth(p["bandwidth_spec"])
    dev = torch.device(device)
    D, sig, rank = batched_kwng(model, Theta.to(dev), Grads.to(dev), Z.to(dev), idx.to(dev), crd.to(dev),
                                eps=cfg["eps"], lam=cfg["lam"], bandwidth=spec.bandwidth, sigma0=spec.sigma0,
                                damping=cfg["damping"], mem_bytes=mem_bytes)
    D, sig, rank = D.cpu(), sig.cpu(), rank.cpu()
    err = torch.linalg.vector_norm(D - Exact, dim=1) / torch.linalg.vector_norm(Exact, dim=1)
    return [{"model": model_name, "panel": p["panel"], "d": d, "N": N, "M": M,
             "bandwidth_spec": str(p["bandwidth_spec"]), "run": r, "bandwidth": float(sig[r]),
             "rank": int(rank[r]), "error": float(err[r])} for r in range(R)]


def _resume_rows(path: Path, cfg: dict, model_name: str) -> tuple[list[dict], list[dict]]:
    """The rows of ``path`` a resume keeps and the grid points still to compute: every row is
    checked (:func:`~kwng.experiments.synthetic_setup.checked_rows`); the points with bad rows
    (truncated, non-finite, repeated) or fewer than ``cfg["runs"]`` runs are recomputed whole,
    and the bad rows leave the file even when no point is."""
    rejected: list[dict] = []
    rows, problems = checked_rows(path, rejected)
    if problems:
        log.warning("%d bad row(s) in %s are removed and their points recomputed: %s", len(problems),
                    path, "; ".join(problems[:5]))
    damaged = {point_key(model_name, r) for r in rejected}  # a repeated run: which copy is right?
    done: dict[str, int] = {}
    for r in rows:
        k = point_key(model_name, r)
        done[k] = done.get(k, 0) + 1
    points = sweep_points(cfg, model_name)
    todo = [p for p in points
            if done.get(point_key(model_name, p), 0) < cfg["runs"] or point_key(model_name, p) in damaged]
    keys_todo = {point_key(model_name, p) for p in todo}
    rows = [r for r in rows if point_key(model_name, r) not in keys_todo]  # drop partial points
    if problems and not todo:
        write_csv_rows(path, SWEEP_COLUMNS, rows)
    log.info("%s/%s: %d of %d points to do", cfg["experiment"], model_name, len(todo), len(points))
    return rows, todo


def run_sweep(cfg: dict, out: str | Path, device: str = "cpu", models: Iterable[str] | None = None,
              mem_gb: float = 4.0, progress: bool = True, force: bool = False) -> dict:
    """Run (or resume) the ``relerr`` or ``bandwidth`` sweep described by ``cfg`` into ``out``.

    ``models`` restricts the sweep to some of ``cfg["models"]``; ``mem_gb`` bounds the memory of
    one batch of runs. If ``out`` holds results of another configuration the sweep refuses unless
    ``force`` (old results moved to a dated backup). On resume every CSV row is checked; bad rows
    (truncated, non-finite, repeated) are logged and their grid points recomputed. Returns the
    provenance record written to ``out/provenance.json``.
    """
    from tqdm.auto import tqdm

    if cfg.get("experiment") not in ("relerr", "bandwidth"):
        raise ValueError("cfg['experiment'] must be 'relerr' or 'bandwidth'")
    models = list(cfg["models"] if models is None else models)
    for m in models:
        if m not in cfg["models"]:
            raise ValueError(f"models must be a subset of {cfg['models']}, got {m!r}")
    if mem_gb <= 0:
        raise ValueError(f"mem_gb must be in (0, inf), got {mem_gb}")
    out = Path(out)
    prev = prepare_result_dir(out, cfg, force)
    t0 = time.perf_counter()
    timings: dict[str, float] = dict(prev.get("timings_s", {}))
    exact_cache: dict = {}
    computed = 0
    for model_name in models:
        path = out / f"{model_name}.csv"
        rows, todo = _resume_rows(path, cfg, model_name)
        tm = time.perf_counter()
        for p in tqdm(todo, desc=f"{cfg['experiment']}:{model_name}", disable=not progress):
            rows.extend(_compute_point(model_name, p, cfg, device, exact_cache, mem_gb * 1e9))
            write_csv_rows(path, SWEEP_COLUMNS, rows)
            computed += 1
            # the time so far, recorded with the rows: an interrupted call still counts
            wall = time.perf_counter() - t0
            write_provenance(out, cfg, seeds={"base_seed": cfg["seed"], "rule": "crc32 of the grid point key"},
                             device=device, wall_time_s=wall, in_progress=True,
                             wall_time_total_s=prev.get("wall_time_total_s", 0.0) + wall,
                             timings_s={**timings, model_name: timings.get(model_name, 0.0)
                                        + time.perf_counter() - tm},
                             models_done=prev.get("models_done", []))
        timings[model_name] = timings.get(model_name, 0.0) + time.perf_counter() - tm
    wall = time.perf_counter() - t0
    if computed == 0 and prev and set(models) <= set(prev.get("models_done", [])):
        log.info("%s: complete in %s, nothing recomputed; provenance kept", cfg["experiment"], out)
        return prev  # a rerun of a finished sweep changes no file
    return write_provenance(out, cfg, seeds={"base_seed": cfg["seed"], "rule": "crc32 of the grid point key"},
                            device=device, wall_time_s=wall,
                            wall_time_total_s=prev.get("wall_time_total_s", 0.0) + wall, timings_s=timings,
                            models_done=sorted(set(prev.get("models_done", [])) | set(models)))


# --------------------------------------------------------------------------------------------
# The W2 flow (Fig. 2)
# --------------------------------------------------------------------------------------------
def normal_w2_and_grad(model: NormalModel, theta: torch.Tensor, mu_t: np.ndarray, Sigma_t: np.ndarray
                       ) -> tuple[float, torch.Tensor]:
    """``L(θ) = W2²(N(μ, LLᵀ), N(μ*, Σ*))`` and its Euclidean gradient in ``θ = (μ, vech L)``.

    With ``S = Σ*^{1/2}`` and ``T = S (SΣS)^{-1/2} S`` (the optimal transport map from ``N(·, Σ)`` to
    ``N(·, Σ*)``), ``∇_μ L = 2(μ - μ*)`` and ``∇_Σ L = I - T``, so that ``∇_L L = tril(2 (I - T) L)``.
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
    grad = model.join(torch.from_numpy(2.0 * (mu - mu_t)), torch.from_numpy(np.tril(gL)))
    return loss, grad.to(torch.float64)


def flow_problem(cfg: dict) -> tuple[NormalModel, torch.Tensor, np.ndarray, np.ndarray]:
    """The flow of Fig. 2: ``(model, θ₀, μ*, Σ*)`` drawn from ``cfg["seed"]`` (d = ``cfg["d"]``)."""
    d = cfg["d"]
    model = NormalModel(d)
    g = torch.Generator().manual_seed(cfg["seed"])
    theta0 = model.params_near_reference(g, cfg["theta_variance"])
    target = model.params_near_reference(g, cfg["theta_variance"])
    target[:d] = cfg["target_mean_std"] * torch.randn(d, generator=g, dtype=torch.float64)
    mu_t, L_t = model.split(target)
    return model, theta0, mu_t.numpy(), (L_t @ L_t.T).numpy()


def _flow_direction(method, model, th, grad, cfg, it, dev, spec: BandwidthSpec) -> torch.Tensor:
    """The direction of ``method`` at ``th`` in :func:`run_flow` (EG, exact WNG or a KWNG variant)."""
    variants = cfg["kwng_variants"]
    if method == "eg":
        direction = grad
    elif method == "wng":
        direction = model.wng(th, grad)
    else:
        N, M = variants[method]["N"], variants[method]["M"]
        g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], method, it))
        Z = model.sample_latent(N, g).to(dev)
        res = kwng_gradient(lambda t, Z=Z: model.sample(t, Z), th.to(dev), grad.to(dev), num_basis=M,
                            eps=cfg["eps"], lam=cfg["lam"], kernel=spec.kernel(), generator=g,
                            damping=cfg["damping"], bandwidth=spec.rule, sigma0=spec.sigma0)
        direction = res.direction.cpu()
    return direction


def run_flow(cfg: dict, out: str | Path, device: str = "cpu", progress: bool = True, force: bool = False) -> dict:
    """Fig. 2: iterate ``θ ← θ - γ · direction`` for exact WNG, KWNG and EG on the W2² loss.

    Writes ``out/loss.csv`` (iteration, method, loss), ``out/trajectories.csv`` (iteration,
    method, θ) and ``out/pca.csv`` (the trajectories projected on the two leading principal
    directions of the WNG trajectory), plus provenance. Results of another configuration in ``out``
    are refused unless ``force`` (moved to a dated backup). Returns the provenance record.
    """
    from tqdm.auto import tqdm

    out = Path(out)
    prev = prepare_result_dir(out, cfg, force)
    if prev:
        damage = flow_problems(out, prev)
        if not damage:
            log.info("flow results already complete in %s", out)
            return prev
        log.warning("flow results in %s are incomplete or damaged (%s): the flow is recomputed", out,
                    "; ".join(damage[:3]))
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
                ok = bool(torch.isfinite(new).all()) and np.isfinite(loss) and loss < cfg["divergence_factor"] * loss0
            except (ValueError, np.linalg.LinAlgError) as exc:  # diverged: samples or Σ unusable
                log.warning("flow %s failed at iteration %d: %s", method, it, exc)
                ok = False
            if not ok:
                log.warning("flow %s diverged at iteration %d; recording NaN from here", method, it)
                stopped[method] = it
                new, loss = torch.full_like(th, float("nan")), float("nan")
            traj[method].append(new)
            losses[method].append(loss)
    write_flow_csvs(out, losses, traj, model)
    svals = write_pca_csv(out, traj)
    wall = time.perf_counter() - t0
    explained = (svals[:2] ** 2 / (svals ** 2).sum()).tolist()
    return write_provenance(out, cfg, seeds={"base_seed": cfg["seed"]}, device=device, wall_time_s=wall,
                            wall_time_total_s=wall, pca_explained_variance=explained, diverged_at=stopped,
                            target_mean=mu_t.tolist(), target_cov=Sigma_t.tolist())


# --------------------------------------------------------------------------------------------
# Completeness check of committed results
# --------------------------------------------------------------------------------------------
def check_results_complete(name: str, results_dir: str | Path = "results", runs: int = 100) -> list[str]:
    """Problems with ``results_dir/name`` (empty list when complete).

    A sweep is complete when every grid point of its configuration holds ``runs`` runs with a
    finite error and ``provenance.json`` has the keys of :data:`REQUIRED_PROVENANCE`; the flow
    needs its three CSVs and all iterations of the three methods.
    """
    if name not in ("relerr", "bandwidth", "flow"):
        raise ValueError(f"name must be one of ['relerr', 'bandwidth', 'flow'], got {name!r}")
    d = Path(results_dir) / name
    problems: list[str] = []
    if not (d / "provenance.json").exists():
        return [f"{d}/provenance.json missing"]
    prov = read_json(d / "provenance.json")
    problems += [f"provenance lacks {k!r}" for k in REQUIRED_PROVENANCE if k not in prov]
    cfg = prov.get("config", {})
    if name == "flow":
        return problems + flow_problems(d, prov)
    if cfg.get("runs") != runs:
        problems.append(f"config has {cfg.get('runs')} runs per point, expected {runs}")
    for model_name in cfg.get("models", []):
        rows, bad = checked_rows(d / f"{model_name}.csv")
        problems += bad
        count: dict[str, int] = {}
        for r in rows:
            if np.isfinite(r["error"]):
                k = point_key(model_name, r)
                count[k] = count.get(k, 0) + 1
        for p in sweep_points(cfg, model_name):
            c = count.get(point_key(model_name, p), 0)
            if c != cfg.get("runs"):
                problems.append(f"{model_name} {p}: {c} runs")
    return problems


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m kwng.experiments relerr|bandwidth|flow [--scale] [--model ...] [--device] [--out]``."""
    ap = argparse.ArgumentParser(prog="python -m kwng.experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=["relerr", "bandwidth", "flow"])
    ap.add_argument("--scale", choices=list(_config.SCALES), default=None,
                    help="grid size (default: $KWNG_SCALE, else small)")
    ap.add_argument("--model", nargs="+", choices=list(FIGURE_MODELS), default=None, help="models to run (sweeps)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    ap.add_argument("--out", default=None, help="output directory (default results/<name>)")
    ap.add_argument("--mem-gb", type=number_arg(0), default=None,
                    help="memory bound of one batch of runs (sweeps; default 4)")
    ap.add_argument("--force", action="store_true",
                    help="if --out holds results of another configuration, move them to a dated backup "
                         "(<out>.backup-<date>) and start afresh; without it such a run refuses")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    problem = path_problem(args, ("out",)) or device_problem(args.device)
    if args.name == "flow" and (args.mem_gb is not None or args.model is not None):
        problem = ("--mem-gb and --model are options of the relerr and bandwidth "
                   "sweeps; flow does not use them")
    if problem:
        ap.error(problem)
    out = Path(args.out or Path("results") / args.name)
    try:
        if args.name == "flow":
            prov = run_flow(flow_config(args.scale), out, args.device, progress=not args.no_progress,
                            force=args.force)
        else:
            cfg = relerr_config(args.scale) if args.name == "relerr" else bandwidth_config(args.scale)
            mem_gb = 4.0 if args.mem_gb is None else args.mem_gb
            prov = run_sweep(cfg, out, args.device, args.model, mem_gb,
                             progress=not args.no_progress,
                             force=args.force)
    except (ConfigMismatchError, ResultFileError) as exc:
        print(f"{args.name}: refused: {exc}", file=sys.stderr)
        return 2
    log.info("%s done in %.1f s -> %s", args.name, prov["wall_time_s"], out)
    print(f"{args.name}: wall time {prov['wall_time_s']:.1f} s on {prov['device']} -> {out}")
    return 0
