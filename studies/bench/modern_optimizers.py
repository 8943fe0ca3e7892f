"""SOAP and Shampoo from two optimizer libraries against the algorithms' definitions.

python -m studies.bench.modern_optimizers [--steps 3] [--json PATH]

Each candidate library's optimizer takes ``--steps`` steps on one 4 × 3 matrix
parameter ``W`` with fixed gradients ``G_1, G_2, ...`` (seeded; weight decay 0, so
that the preconditioned step alone is compared) and its parameters after every step
are compared with a few lines of reference math, in the same dtype:

* **Shampoo** (Gupta, Koren and Singer 2018, Algorithm 1): ``L_0 = ε I``,
  ``R_0 = ε I``; ``L_t = L_{t-1} + G_t G_tᵀ``, ``R_t = R_{t-1} + G_tᵀ G_t``;
  ``W_t = W_{t-1} - η L_t^{-1/4} G_t R_t^{-1/4}`` (``ε`` = the library's
  ``matrix_eps``);
* **SOAP** (Vyas et al. 2024, Algorithm 3, with the authors' code's first step, which
  only sets the preconditioner): ``Q_L``, ``Q_R`` the eigenvectors of
  ``(1-β_s) G_1 G_1ᵀ`` and ``(1-β_s) G_1ᵀ G_1``; from step 2 on, with ``k = t - 1``,
  ``M = β_1 M + (1-β_1) G_t``, ``V = β_2 V + (1-β_2) (Q_Lᵀ G_t Q_R)²`` and
  ``W_t = W_{t-1} - η √(1-β_2^k) / (1-β_1^k) · Q_L [(Q_Lᵀ M Q_R) / (√V + ε)] Q_Rᵀ``.
  The eigenbasis is refreshed only every ``precondition_frequency`` steps, so the
  first steps (before any refresh) follow the formula exactly; the update is the same
  for any order and signs of the eigenvectors.

Prints, per library and algorithm, the largest ``|W_lib - W_ref|`` over the steps
relative to the largest ``|W_ref - W_0|``, with the library's version and the defaults
it ran with; ``--json`` writes them to a new file. The comparison and the choice:
``studies/fig3/modern_optimizers.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _power(a: torch.Tensor, p: float) -> torch.Tensor:
    """``a^p`` of a symmetric positive semi-definite matrix (eigenvalues floored
    at 0)."""
    e, q = torch.linalg.eigh(a)
    return q @ torch.diag(e.clamp_min(0) ** p) @ q.T


def shampoo_reference(w0: torch.Tensor, grads: list[torch.Tensor], lr: float,
                      eps: float) -> list[torch.Tensor]:
    """The parameters after each Shampoo step (Algorithm 1, ``L_0 = R_0 = ε I``)."""
    w, out = w0.clone(), []
    left = eps * torch.eye(w.shape[0], dtype=w.dtype)
    right = eps * torch.eye(w.shape[1], dtype=w.dtype)
    for g in grads:
        left, right = left + g @ g.T, right + g.T @ g
        w = w - lr * _power(left, -0.25) @ g @ _power(right, -0.25)
        out.append(w)
    return out


def soap_reference(w0: torch.Tensor, grads: list[torch.Tensor], lr: float,
                   betas: tuple[float, float], shampoo_beta: float,
                   eps: float) -> list[torch.Tensor]:
    """The parameters after each SOAP step, before the first refresh of the basis."""
    b1, b2 = betas
    g1 = grads[0]
    ql = torch.linalg.eigh((1 - shampoo_beta) * g1 @ g1.T)[1]
    qr = torch.linalg.eigh((1 - shampoo_beta) * g1.T @ g1)[1]
    w, m, v, out = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0), [w0.clone()]
    for k, g in enumerate(grads[1:], start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * (ql.T @ g @ qr) ** 2
        n = ql @ ((ql.T @ m @ qr) / (v.sqrt() + eps)) @ qr.T
        w = w - lr * (1 - b2 ** k) ** 0.5 / (1 - b1 ** k) * n
        out.append(w)
    return out


def _run(make: Callable, w0: torch.Tensor, grads: list[torch.Tensor]
         ) -> list[torch.Tensor]:
    w = torch.nn.Parameter(w0.clone())
    opt, out = make([w]), []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(w.detach().clone())
    return out


def _error(got: list[torch.Tensor], ref: list[torch.Tensor], w0: torch.Tensor) -> float:
    moved = max(float((r - w0).abs().max()) for r in ref)
    return max(float((a - b).abs().max()) for a, b in zip(got, ref)) / moved


def candidates() -> list[dict]:
    """Per library and algorithm: how to build it, the dtype it runs in, its settings
    and its reference (libraries not installed are skipped with a warning)."""
    rows = []
    try:
        import pytorch_optimizer as po
    except ImportError:
        log.warning("pytorch-optimizer is not installed: skipped")
    else:
        rows += [
            {"library": "pytorch-optimizer", "algorithm": "Shampoo",
             "dtype": torch.float64, "make": lambda ps: po.Shampoo(ps, lr=0.1),
             "ref": lambda w, gs: shampoo_reference(w, gs, 0.1, 1e-6),
             "settings": "lr 0.1, matrix_eps 1e-6 (default), momentum 0 (default)"},
            {"library": "pytorch-optimizer", "algorithm": "SOAP",
             "dtype": torch.float64,
             "make": lambda ps: po.SOAP(ps, lr=0.1, weight_decay=0.0),
             "ref": lambda w, gs: soap_reference(w, gs, 0.1, (0.95, 0.95), 0.95, 1e-8),
             "settings": "lr 0.1, betas (0.95, 0.95), shampoo_beta = beta2, eps 1e-8, "
                         "precondition_frequency 10 (defaults), weight_decay 0"}]
    try:
        import heavyball
        import heavyball.utils
    except ImportError:
        log.warning("heavyball is not installed: skipped")
    else:
        heavyball.utils.compile_mode = None  # eager: its compiled einsum needs inductor
        rows.append(
            {"library": "heavyball", "algorithm": "SOAP", "dtype": torch.float32,
             "make": lambda ps: heavyball.SOAP(ps, lr=0.1, weight_decay=0.0,
                                               precondition_frequency=100,
                                               compile_step=False),
             "ref": lambda w, gs: soap_reference(w, gs, 0.1, (0.9, 0.95), 0.95, 1e-8),
             "settings": "lr 0.1, betas (0.9, 0.95), shampoo_beta 0.95, eps 1e-8 "
                         "(defaults), weight_decay 0, precondition_frequency 100 (its "
                         "default 2 refreshes the basis at step 2, which the reference "
                         "does not model), eager (compile off), float32 (float64 fails "
                         "in its einsum)"})
    return rows


def check(steps: int = 3, seed: int = 0) -> list[dict]:
    """Every candidate against its reference: ``relative_error`` per row."""
    out = []
    for c in candidates():
        gen = torch.Generator().manual_seed(seed)
        w0 = torch.randn(4, 3, generator=gen, dtype=torch.float64).to(c["dtype"])
        grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64).to(c["dtype"])
                 for _ in range(steps)]
        err = _error(_run(c["make"], w0, grads), c["ref"](w0, grads), w0)
        lib = c["library"]
        name = {"pytorch-optimizer": "pytorch_optimizer"}.get(lib, lib)
        out.append({"library": lib, "version": importlib.metadata.version(name),
                    "algorithm": c["algorithm"], "dtype": str(c["dtype"]),
                    "steps": steps, "relative_error": err, "settings": c["settings"]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="steps compared (>= 2)")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the rows to this new file")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be >= 2 (SOAP's first step only sets its basis)")
    rows = check(a.steps)
    for r in rows:
        print(f"{r['library']:18s} {r['version']:8s} {r['algorithm']:8s} "
              f"{r['dtype']:14s} relative error {r['relative_error']:.2e}")
    if a.json is not None:
        if a.json.exists():
            raise SystemExit(f"{a.json} exists: choose a new path")
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
