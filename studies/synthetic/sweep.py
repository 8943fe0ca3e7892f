"""Synthetic experiments of Arbel et al. (2020): estimator accuracy and the Gaussian W2
flow.

Three commands (``python -m studies <name> --scale small|full ...``):

* ``relerr``    – relative error of KWNG against the exact WNG (Fig. 1 for the
  hyper-sphere, Fig. 4 for the normal and log-normal models): panel ``N`` (error vs
  ``N`` with ``M = ⌊d√N⌋``; its ``N = 5000`` column is the box-plot of panel (a)) and
  panel ``M`` (error vs ``M`` at fixed ``N``);
* ``bandwidth`` – relative error against a fixed Gaussian bandwidth ``σ`` (Fig. 5);
* ``flow``      – W2² flow of the normal model towards a target normal with exact WNG,
  KWNG and the Euclidean gradient (Fig. 2).

Results go to ``results/<name>/`` as CSV/JSON with a ``provenance.json``. Sweeps write
one CSV per model, rewritten atomically after every finished grid point; a rerun with
the same configuration skips the points already there (resume) after checking every row
(a truncated, non-finite or repeated row is recomputed). A rerun with another
configuration refuses, naming the differing keys, unless ``--force``, which moves the
old results to a dated backup (:mod:`studies.kit.guard`); so the committed
full-scale results under ``results/`` are never replaced by a small run.
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

from kwng import scale_switch as _config
from kwng.models import make_model
from studies.kit import paths
from studies.kit.cli_checks import device_problem, number_arg, path_problem
from studies.kit.guard import ConfigMismatchError
from studies.kit.guard_csv import write_csv_rows
from studies.kit.provenance import ResultFileError, read_json, write_provenance
from studies.kit.result_dir import prepare_result_dir
from studies.toy.batched import batched_kwng
from studies.toy.flow import run_flow
from studies.toy.grid import keyed_seed, parse_bandwidth
from studies.toy.setup import (
    FIGURE_MODELS,
    SWEEP_COLUMNS,
    bandwidth_config,
    checked_rows,
    flow_config,
    flow_problems,
    point_key,
    relerr_config,
    sweep_points,
)

__all__ = ["REQUIRED_PROVENANCE", "run_sweep", "check_results_complete", "main"]

log = logging.getLogger(__name__)

#: how a sweep's seeds are drawn (its provenance adds ``base_seed``)
_SEED_RULE = {"rule": "crc32 of the grid point key"}

#: the keys every provenance record of the synthetic studies holds
REQUIRED_PROVENANCE = (
    "command",
    "config",
    "git_commit",
    "device",
    "date",
    "seeds",
    "wall_time_s",
)


# --------------------------------------------------------------------------------------
# Sweeps (relerr, bandwidth)
# --------------------------------------------------------------------------------------
def _compute_point(model_name: str, p: dict, cfg: dict, device: str, exact_cache: dict,
                   mem_bytes: float) -> list[dict]:
    d, N, M, R = p["d"], p["N"], p["M"], cfg["runs"]
    model = make_model(model_name, d)
    if (model_name, d) not in exact_cache:
        thetas, grads, exact = [], [], []
        for r in range(R):
            g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, r))
            th = model.params_near_reference(g, cfg["theta_variance"])
            gr = cfg["grad_variance"] ** 0.5 * torch.randn(
                model.num_params, generator=g, dtype=torch.float64)
            thetas.append(th)
            grads.append(gr)
            exact.append(model.wng(th, gr))
        exact_cache[(model_name, d)] = (torch.stack(thetas), torch.stack(grads),
                                        torch.stack(exact))
    Theta, Grads, Exact = exact_cache[(model_name, d)]
    Z = torch.empty(R, N, d, dtype=torch.float64)
    idx = torch.empty(R, M, dtype=torch.long)
    crd = torch.empty(R, M, dtype=torch.long)
    for r in range(R):
        g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, N, r))
        Z[r] = torch.randn(N, d, generator=g, dtype=torch.float64)
        gb = torch.Generator().manual_seed(keyed_seed(cfg["seed"],
                                                      point_key(model_name, p), r))
        idx[r] = torch.randperm(N, generator=gb)[:M]
        crd[r] = torch.randint(0, d, (M,), generator=gb)
    spec = parse_bandwidth(p["bandwidth_spec"])
    dev = torch.device(device)
    D, sig, rank = batched_kwng(
        model, Theta.to(dev), Grads.to(dev), Z.to(dev), idx.to(dev), crd.to(dev),
        eps=cfg["eps"], lam=cfg["lam"], bandwidth=spec.bandwidth, sigma0=spec.sigma0,
        damping=cfg["damping"], mem_bytes=mem_bytes)
    D, sig, rank = D.cpu(), sig.cpu(), rank.cpu()
    err = (torch.linalg.vector_norm(D - Exact, dim=1)
           / torch.linalg.vector_norm(Exact, dim=1))
    return [{"model": model_name, "panel": p["panel"], "d": d, "N": N, "M": M,
             "bandwidth_spec": str(p["bandwidth_spec"]), "run": r,
             "bandwidth": float(sig[r]), "rank": int(rank[r]), "error": float(err[r])}
            for r in range(R)]


def _resume_rows(
    path: Path, cfg: dict, model_name: str
) -> tuple[list[dict], list[dict]]:
    """The rows of ``path`` a resume keeps and the grid points still to compute: every
    row is checked (:func:`~studies.toy.setup.checked_rows`); the points
    with bad rows (truncated, non-finite, repeated) or fewer than ``cfg["runs"]`` runs
    are recomputed whole, and the bad rows leave the file even when no point is."""
    rejected: list[dict] = []
    rows, problems = checked_rows(path, rejected)
    if problems:
        log.warning(
            "%d bad row(s) in %s are removed and their points recomputed: %s",
            len(problems),
            path,
            "; ".join(problems[:5]),
        )
    # a repeated run: which copy is right?
    damaged = {point_key(model_name, r) for r in rejected}
    done: dict[str, int] = {}
    for r in rows:
        k = point_key(model_name, r)
        done[k] = done.get(k, 0) + 1
    points = sweep_points(cfg, model_name)
    todo = [
        p
        for p in points
        if done.get(point_key(model_name, p), 0) < cfg["runs"]
        or point_key(model_name, p) in damaged
    ]
    keys_todo = {point_key(model_name, p) for p in todo}
    # drop partial points
    rows = [r for r in rows if point_key(model_name, r) not in keys_todo]
    if problems and not todo:
        write_csv_rows(path, SWEEP_COLUMNS, rows)
    log.info(
        "%s/%s: %d of %d points to do",
        cfg["experiment"],
        model_name,
        len(todo),
        len(points),
    )
    return rows, todo


def run_sweep(cfg: dict, out: str | Path, device: str = "cpu",
              models: Iterable[str] | None = None, mem_gb: float = 4.0,
              progress: bool = True, force: bool = False) -> dict:
    """Run (or resume) the ``relerr`` or ``bandwidth`` sweep described by ``cfg`` into
    ``out``.

    ``models`` restricts the sweep to some of ``cfg["models"]``; ``mem_gb`` bounds the
    memory of one batch of runs. If ``out`` holds results of another configuration the
    sweep refuses unless ``force`` (old results moved to a dated backup). On resume
    every CSV row is checked; bad rows (truncated, non-finite, repeated) are logged and
    their grid points recomputed. Returns the provenance record written to
    ``out/provenance.json``.
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
        for p in tqdm(todo, desc=f"{cfg['experiment']}:{model_name}",
                      disable=not progress):
            rows.extend(_compute_point(model_name, p, cfg, device, exact_cache,
                                       mem_gb * 1e9))
            write_csv_rows(path, SWEEP_COLUMNS, rows)
            computed += 1
            # the time so far, recorded with the rows: an interrupted call still counts
            wall = time.perf_counter() - t0
            write_provenance(
                out, cfg, seeds={"base_seed": cfg["seed"], **_SEED_RULE}, device=device,
                wall_time_s=wall, in_progress=True,
                wall_time_total_s=prev.get("wall_time_total_s", 0.0) + wall,
                timings_s={**timings, model_name: timings.get(model_name, 0.0)
                           + time.perf_counter() - tm},
                models_done=prev.get("models_done", []))
        timings[model_name] = timings.get(model_name, 0.0) + time.perf_counter() - tm
    wall = time.perf_counter() - t0
    if computed == 0 and prev and set(models) <= set(prev.get("models_done", [])):
        log.info("%s: complete in %s, nothing recomputed; provenance kept",
                 cfg["experiment"], out)
        return prev  # a rerun of a finished sweep changes no file
    return write_provenance(
        out, cfg, seeds={"base_seed": cfg["seed"], **_SEED_RULE}, device=device,
        wall_time_s=wall, wall_time_total_s=prev.get("wall_time_total_s", 0.0) + wall,
        timings_s=timings,
        models_done=sorted(set(prev.get("models_done", [])) | set(models)))


# --------------------------------------------------------------------------------------
# Completeness check of committed results
# --------------------------------------------------------------------------------------
def check_results_complete(
    name: str, results_dir: str | Path = "results", runs: int = 100
) -> list[str]:
    """Problems with ``results_dir/name`` (empty list when complete).

    A sweep is complete when every grid point of its configuration holds ``runs`` runs
    with a finite error and ``provenance.json`` has the keys of
    :data:`REQUIRED_PROVENANCE`; the flow needs its three CSVs and all iterations of the
    three methods.
    """
    if name not in ("relerr", "bandwidth", "flow"):
        raise ValueError(
            f"name must be one of ['relerr', 'bandwidth', 'flow'], got {name!r}"
        )
    d = Path(results_dir) / name
    problems: list[str] = []
    if not (d / "provenance.json").exists():
        return [f"{d}/provenance.json missing"]
    prov = read_json(d / "provenance.json")
    problems += [
        f"provenance lacks {k!r}" for k in REQUIRED_PROVENANCE if k not in prov
    ]
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


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m studies relerr|bandwidth|flow [--scale] [--model ...]
    [--device] [--out]``."""
    ap = argparse.ArgumentParser(prog="python -m studies", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=["relerr", "bandwidth", "flow"])
    ap.add_argument("--scale", choices=list(_config.SCALES), default=None,
                    help="grid size (default: $KWNG_SCALE, else small)")
    ap.add_argument("--model", nargs="+", choices=list(FIGURE_MODELS), default=None,
                    help="models to run (sweeps)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    ap.add_argument("--out", default=None,
                    help="output directory (default results/<name>)")
    ap.add_argument("--mem-gb", type=number_arg(0), default=None,
                    help="memory bound of one batch of runs (sweeps; default 4)")
    ap.add_argument("--force", action="store_true",
                    help="if --out holds results of another configuration, move them "
                    "to a dated backup (<out>.backup-<date>) and start afresh; without "
                    "it such a run refuses")
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
    out = Path(args.out or paths.RESULTS / args.name)
    try:
        if args.name == "flow":
            prov = run_flow(flow_config(args.scale), out, args.device,
                            progress=not args.no_progress, force=args.force)
        else:
            cfg = (relerr_config(args.scale) if args.name == "relerr"
                   else bandwidth_config(args.scale))
            mem_gb = 4.0 if args.mem_gb is None else args.mem_gb
            prov = run_sweep(cfg, out, args.device, args.model, mem_gb,
                             progress=not args.no_progress,
                             force=args.force)
    except (ConfigMismatchError, ResultFileError) as exc:
        print(f"{args.name}: refused: {exc}", file=sys.stderr)
        return 2
    log.info("%s done in %.1f s -> %s", args.name, prov["wall_time_s"], out)
    print(f"{args.name}: wall time {prov['wall_time_s']:.1f} s on {prov['device']} "
          f"-> {out}")
    return 0
