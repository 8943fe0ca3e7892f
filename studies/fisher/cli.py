"""Fisher–Rao next to Wasserstein: the same kernel estimator on both duals (beyond the
paper).

One command, ``python -m studies fisher [--part sweep|flow|all] [--scale
small|full] [--out DIR]``, with two parts:

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
rerun with the same configuration resumes, every row checked (a damaged one is removed
and its grid point recomputed); a directory holding results of *another* configuration
is never touched (the command stops with an error) unless ``--force``, which moves that
part's files to dated backups. The flow (:mod:`studies.fisher.flow`) is redone
whole when its ``flow.csv`` is incomplete. The committed results were made with
``--scale full --out results/fisher``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from kwng import scale_switch as _config
from studies.fisher.flow import run_flow
from studies.fisher.sweep import FISHER_MODELS, run_sweep
from studies.kit.cli_checks import int_arg, path_problem
from studies.kit.guard import ConfigMismatchError
from studies.kit.provenance import ResultFileError, index_provenance
from studies.toy.setup import RELERR_BANDWIDTH

__all__ = [
    "FLOW_METHODS",
    "LOSSES",
    "PARTS",
    "sweep_config",
    "flow_config",
    "write_directory_provenance",
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
        "models": list(FISHER_MODELS),
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
        # as in the relerr study: fixed σ = 1 on the sphere (paper, Fig. 1), the
        # heuristic σ = 0.5 · mean ‖X_n - Y_m‖² elsewhere
        "bandwidth": dict(RELERR_BANDWIDTH),
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
        "bandwidth": RELERR_BANDWIDTH["normal"],
        "theta_variance": 0.1,
        "target_mean_std": 1.0,
        "divergence_factor": 1e6,
        "seed": 15,
    }


PARTS = ("fisher-sweep", "fisher-flow")


def write_directory_provenance(out: str | Path) -> dict:
    """``provenance.json`` of the results directory, gathered from the part records
    (``<part>.provenance.json``) by
    :func:`studies.kit.provenance.index_provenance`."""
    return index_provenance(out)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m studies fisher",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("name", choices=["fisher"])
    ap.add_argument("--part", choices=["sweep", "flow", "all", "provenance"],
                    default="all", help="provenance: only (re)write the directory's "
                    "provenance.json from the part files")
    ap.add_argument("--scale", choices=list(_config.SCALES), default=None,
                    help="grid size (default: $KWNG_SCALE, else small)")
    ap.add_argument("--out", default=None,
                    help="output directory (default _build/results/fisher-<scale>)")
    ap.add_argument("--threads", type=int_arg(1), default=1,
                    help="torch CPU threads (default 1: the estimates are small; more "
                    "threads only contend on a shared 2-core machine)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--force", action="store_true", help="move a part's results of "
                    "another configuration (or an unreadable sweep.csv) to dated "
                    "backups instead of refusing")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``python -m studies fisher [--part sweep|flow|all] [--scale]
    [--out]``."""
    ap = _parser()
    args = ap.parse_args(argv)
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
