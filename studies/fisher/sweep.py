"""The ``sweep`` part of the Fisher–Rao experiment (:mod:`studies.fisher.cli`).

For every grid point and run: KWNG against the exact WNG and the kernel Fisher estimate
against the exact Fisher natural gradient (:func:`compare_once`), and the resumable
sweep writing ``sweep.csv`` (:func:`run_sweep`); see :mod:`studies.fisher.cli` for
the protocol. The grid (keyed seeds, bandwidth specs, panels) is that of the synthetic
sweeps (:mod:`studies.toy.grid`).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from kwng.estimator import draw_basis, kwng_gradient, with_bandwidth
from kwng.estimator_checks import relative_error
from kwng.fisher import fisher_kernel_matrices, kernel_fisher_metric, kfng_gradient
from kwng.fisher_exact import fisher_matrix, fisher_natural_gradient, scores
from kwng.jacobians import jacobian_from_sampler
from kwng.models import make_model, model_names
from studies.kit.guard import FORCE_HINT, backup
from studies.kit.guard_csv import read_csv_checked, write_csv_rows
from studies.kit.provenance import (
    ResultFileError,
    atomic_write_json,
    make_provenance,
)
from studies.kit.result_dir import prepare_result_dir
from studies.toy.grid import keyed_seed, panel_points, parse_bandwidth

__all__ = ["FISHER_MODELS", "SWEEP_COLUMNS", "compare_once", "metric_vs_lambda",
           "checked_sweep_rows", "load_sweep", "run_sweep"]

# the logger of the experiment's command (the records name the command)
log = logging.getLogger("studies.fisher.cli")

#: The models of the sweep (names of :data:`kwng.models.MODELS`), in the order of its
#: figures and of the committed configuration: the two with a density, then the sphere.
FISHER_MODELS = model_names(("normal", "lognormal", "sphere"))
SWEEP_COLUMNS = (
    "model",
    "panel",
    "d",
    "N",
    "M",
    "run",
    "bandwidth",
    "err_wng",
    "err_fng",
    "err_fng_lam",
    "err_fng_score",
    "fng_norm",
    "gf_max",
    "gf_exact_max",
    "range_residual",
    "time_wng_s",
    "time_fng_s",
)


# --------------------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------------------
def _points(cfg: dict) -> list[dict]:
    return panel_points(cfg["dims"], cfg["N_values"], cfg["N_fixed"], cfg["M_values"])


def _key(model: str, p: dict) -> str:
    return f"{model}|{p['panel']}|{p['d']}|{p['N']}|{p['M']}"


def _kernel_fisher_max(sampler, theta, idx, kernel, rule, sigma0, N, cfg) -> float:
    """Largest eigenvalue of the kernel Fisher metric ``Ĝ_F = Tᵀ(CCᵀ/N)†T`` with the
    basis and bandwidth of :func:`compare_once`."""
    X = sampler(theta).detach()
    C, K, CCt, Gx = fisher_kernel_matrices(
        X, idx, with_bandwidth(kernel, X, idx, rule, sigma0)
    )
    G = kernel_fisher_metric(
        jacobian_from_sampler(sampler, theta, Gx), CCt, K, N, lam=cfg["lam"]
    )
    return float(torch.linalg.eigvalsh(G).max())


def _fisher_errors(row, model, sampler, theta, grad, idx, f, common, cfg) -> None:
    """The Fisher columns of a :func:`compare_once` row (models with a density): the
    errors of the kernel Fisher estimates against the exact Fisher natural gradient."""
    exact = fisher_natural_gradient(model, theta, grad)
    fs = kfng_gradient(
        sampler,
        theta,
        grad,
        basis_idx=idx,
        jacobian="score",
        score_fn=lambda t, Xs: scores(model, t, Xs),
        **common,
    )
    common["lam"] = cfg["lam_fisher"]
    fl = kfng_gradient(sampler, theta, grad, basis_idx=idx, **common)
    row.update(
        err_fng=relative_error(f.direction, exact),
        err_fng_score=relative_error(fs.direction, exact),
        err_fng_lam=relative_error(fl.direction, exact),
        gf_exact_max=float(torch.linalg.eigvalsh(fisher_matrix(model, theta)).max()),
    )


def compare_once(model_name: str, p: dict, r: int, cfg: dict) -> dict:
    """One run of the sweep at the grid point ``p`` (``{"panel", "d", "N", "M"}``), run
    index ``r``: KWNG and the kernel Fisher estimates on the same samples and basis
    points, against the exact natural gradients. Returns a row with the columns of
    ``SWEEP_COLUMNS``; the draws are keyed by ``(cfg["seed"], model, point, r)`` so
    any run can be redone alone."""
    if model_name not in FISHER_MODELS:
        raise ValueError(
            f"model_name must be one of {list(FISHER_MODELS)}, got {model_name!r}"
        )
    d, N, M = p["d"], p["N"], p["M"]
    model = make_model(model_name, d)
    g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, r))
    theta = model.params_near_reference(g, cfg["theta_variance"])
    grad = cfg["grad_variance"] ** 0.5 * torch.randn(
        model.num_params, generator=g, dtype=torch.float64
    )
    gz = torch.Generator().manual_seed(keyed_seed(cfg["seed"], _key(model_name, p), r))
    Z = model.sample_latent(N, gz)
    idx, coords = draw_basis(N, d, M, gz)
    sampler = lambda t: model.sample(t, Z)  # noqa: E731
    spec = parse_bandwidth(cfg["bandwidth"][model_name])
    kernel, rule, sigma0 = spec.kernel(), spec.rule, spec.sigma0
    common = dict(
        num_basis=M, eps=cfg["eps"], lam=cfg["lam"], kernel=kernel,
        damping=cfg["damping"], bandwidth=rule, sigma0=sigma0,
    )
    t0 = time.perf_counter()
    w = kwng_gradient(
        sampler, theta, grad, basis_idx=idx, basis_coords=coords, **common
    )
    t1 = time.perf_counter()
    f = kfng_gradient(sampler, theta, grad, basis_idx=idx, **common)
    t2 = time.perf_counter()
    row = {
        "model": model_name,
        "panel": p["panel"],
        "d": d,
        "N": N,
        "M": M,
        "run": r,
        "bandwidth": float(f.diagnostics["bandwidth"]),
        "err_wng": relative_error(w.direction, model.wng(theta, grad)),
        "fng_norm": float(f.direction.norm() / grad.norm()),
        "range_residual": float(f.diagnostics["range_residual"]),
        "time_wng_s": t1 - t0,
        "time_fng_s": t2 - t1,
    }
    # the kernel Fisher metric Ĝ_F = Tᵀ(CCᵀ/N)†T with the same basis and bandwidth
    row["gf_max"] = _kernel_fisher_max(
        sampler, theta, idx, kernel, rule, sigma0, N, cfg
    )
    if model_name == "sphere":  # no density: no Fisher natural gradient to compare with
        row.update(
            err_fng=math.nan, err_fng_lam=math.nan, err_fng_score=math.nan,
            gf_exact_max=math.nan,
        )
        return row
    _fisher_errors(row, model, sampler, theta, grad, idx, f, common, cfg)
    return row


def metric_vs_lambda(
    model_name: str, d: int, N: int, M: int, lams: list[float], cfg: dict, run: int = 0
) -> tuple[list[float], float]:
    """Largest eigenvalue of the kernel Fisher metric ``Ĝ_F(λ) = Tᵀ(CCᵀ/N + λK)†T`` for
    each ``λ`` in ``lams``, on the samples and basis of run ``run`` of the sweep point
    ``(d, N, M)`` (``T`` reparametrised), and the largest eigenvalue of the exact
    ``G_F`` (NaN on the sphere). Where the Fisher metric exists ``Ĝ_F`` converges as
    ``λ → 0``; on the sphere it grows like ``1/λ`` until the float64 truncation of the
    pseudo-inverse stops it."""
    if model_name not in FISHER_MODELS:
        raise ValueError(
            f"model_name must be one of {list(FISHER_MODELS)}, got {model_name!r}"
        )
    if not lams or any(float(v) < 0 for v in lams):
        raise ValueError(
            f"lams must be a non-empty list of numbers in [0, inf), got {lams!r}"
        )
    p = {"panel": "N", "d": d, "N": N, "M": M}
    model = make_model(model_name, d)
    g = torch.Generator().manual_seed(keyed_seed(cfg["seed"], model_name, d, run))
    theta = model.params_near_reference(g, cfg["theta_variance"])
    key = _key(model_name, p)
    gz = torch.Generator().manual_seed(keyed_seed(cfg["seed"], key, run))
    Z = model.sample_latent(N, gz)
    idx, _ = draw_basis(N, d, M, gz)
    sampler = lambda t: model.sample(t, Z)  # noqa: E731
    spec = parse_bandwidth(cfg["bandwidth"][model_name])
    X = sampler(theta).detach()
    kernel = with_bandwidth(spec.kernel(), X, idx, spec.rule, spec.sigma0)
    C, K, CCt, Gx = fisher_kernel_matrices(X, idx, kernel)
    T = jacobian_from_sampler(sampler, theta, Gx)
    values = [
        float(
            torch.linalg.eigvalsh(
                kernel_fisher_metric(T, CCt, K, N, lam=float(v))
            ).max()
        )
        for v in lams
    ]
    exact = (
        math.nan
        if model_name == "sphere"
        else float(torch.linalg.eigvalsh(fisher_matrix(model, theta)).max())
    )
    return values, exact


_SWEEP_CONVERTERS = {k: (int if k in ("d", "N", "M", "run") else float)
                     for k in SWEEP_COLUMNS if k not in ("model", "panel")}
_ALWAYS_FINITE = ("bandwidth", "err_wng", "fng_norm", "gf_max", "range_residual",
                  "time_wng_s", "time_fng_s")  # the Fisher columns: NaN on the sphere
_FISHER_COLUMNS = ("err_fng", "err_fng_lam", "err_fng_score", "gf_exact_max")


def _row_problem(r: dict) -> str | None:
    """What is wrong with a parsed ``sweep.csv`` row beyond parsing (or ``None``)."""
    if r["model"] not in FISHER_MODELS or r["panel"] not in ("N", "M"):
        return f"model {r['model']!r} / panel {r['panel']!r} is not of this sweep"
    if r["model"] != "sphere":
        bad = [k for k in _FISHER_COLUMNS if not math.isfinite(r[k])]
        if bad:
            return f"non-finite {', '.join(f'{k}={r[k]}' for k in bad)}"
    return None


def checked_sweep_rows(path: str | Path) -> tuple[list[dict], list[str], set[str]]:
    """The rows of ``sweep.csv`` a resume may trust, the problems of the others (file
    and line each) and the grid points (:func:`_key`) of the rejected rows that
    parsed. Another header raises
    :class:`~studies.kit.provenance.ResultFileError`."""
    rejected: list[dict] = []
    rows, problems = read_csv_checked(
        path, SWEEP_COLUMNS, _SWEEP_CONVERTERS,
        lambda r: (_key(r["model"], r), r["run"]), finite=_ALWAYS_FINITE,
        check=_row_problem, rejected=rejected)
    return rows, problems, {_key(r["model"], r) for r in rejected}


def load_sweep(path: str | Path) -> list[dict]:
    """Rows of ``sweep.csv`` with numbers converted (empty list if absent); a damaged
    row raises :class:`~studies.kit.provenance.ResultFileError` naming the file
    and line."""
    rows, problems, _ = checked_sweep_rows(path)
    if problems:
        raise ResultFileError(
            f"{len(problems)} bad row(s) in {path}: " + "; ".join(problems[:5]))
    return rows


def run_sweep(cfg: dict, out: str | Path, progress: bool = True,
              force: bool = False) -> dict:
    """Run or resume the sweep of ``cfg`` (:func:`sweep_config`) into
    ``out/sweep.csv``.

    On resume every row is checked (:func:`checked_sweep_rows`): a damaged row
    (truncated, unparsable, non-finite, repeated) is removed from the file and its grid
    point recomputed. Another configuration in ``out``, or a ``sweep.csv`` that cannot
    be read as this sweep's, is refused naming the file, unless ``force`` (the old files
    go to dated backups)."""
    from tqdm.auto import tqdm

    if cfg.get("experiment") != "fisher-sweep":
        raise ValueError("cfg must come from sweep_config()")
    out = Path(out)
    path = out / "sweep.csv"
    prev = prepare_result_dir(out, cfg, force, part=cfg["experiment"], files=(path,))
    try:
        rows, problems, damaged = checked_sweep_rows(path)
    except ResultFileError as exc:  # not this sweep's file: refused, or moved away
        if not force:
            raise ResultFileError(f"{exc}; {FORCE_HINT}") from exc
        log.warning("%s; --force: moved to %s", exc, backup(path))
        rows, problems, damaged = [], [], set()
    if problems:
        log.warning("%d damaged row(s) in %s are removed and their grid points "
                    "recomputed: %s", len(problems), path, "; ".join(problems[:5]))
    done: dict[str, int] = {}
    for r in rows:
        done[_key(r["model"], r)] = done.get(_key(r["model"], r), 0) + 1
    todo = [
        (m, p)
        for m in cfg["models"]
        for p in _points(cfg)
        if done.get(_key(m, p), 0) < cfg["runs"] or _key(m, p) in damaged
    ]
    partial = {_key(m, p) for m, p in todo}
    rows = [r for r in rows if _key(r["model"], r) not in partial]
    if not todo and prev and not problems and not prev.get("in_progress"):
        log.info("sweep already complete in %s", out)
        return prev
    if problems:  # the damaged rows leave the file even when nothing is recomputed
        write_csv_rows(path, SWEEP_COLUMNS, rows)
    t0 = time.perf_counter()
    def provenance(**extra) -> dict:  # with the rows: an interrupted call still counts
        wall = time.perf_counter() - t0
        record = make_provenance(
            cfg, seeds={"base_seed": cfg["seed"], "rule": "crc32 of model, point, run"},
            device="cpu", wall_time_s=wall,
            wall_time_total_s=prev.get("wall_time_total_s", 0.0) + wall,
            threads=torch.get_num_threads(), **extra)
        atomic_write_json(out / "fisher-sweep.provenance.json", record)
        return record

    for m, p in tqdm(todo, desc="fisher sweep", disable=not progress):
        rows.extend(compare_once(m, p, r, cfg) for r in range(cfg["runs"]))
        write_csv_rows(path, SWEEP_COLUMNS, rows)
        provenance(in_progress=True)
    return provenance()
