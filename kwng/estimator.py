"""The Nyström estimator of the kernelized Wasserstein natural gradient (KWNG).

Arbel, Gretton, Li & Montúfar (ICLR 2020), §3.2–3.3. Symbols of the book and the paper
map to argument names as follows:

=====================  ===========================================================
paper                  here
=====================  ===========================================================
``N``                  number of samples, ``X.shape[0]``
``M``                  ``num_basis`` (basis points ``Y_m = X_{basis_idx[m]}``)
``i_m``                ``basis_coords[m]`` (one random coordinate per basis point)
``ε``                  ``eps``  (> 0)
``λ``                  ``lam``  (>= 0)
``D(θ)``               ``damping`` in {"identity", "T", "T_tilde"}
``\\widehat{∇L(θ)}``   ``grad``
``C, K, T``            :func:`kernel_matrices`,
                       :func:`kwng.jacobians.jacobian_from_sampler`,
                       :func:`kwng.jacobians.jacobian_from_outputs`
=====================  ===========================================================

Plain form (Prop. 5)::

    ĝ = (1/ε) [D⁻¹ - D⁻¹Tᵀ (T D⁻¹ Tᵀ + λεK + (ε/N) CCᵀ)† T D⁻¹] ∇L

Stable form (Prop. 6). With the eigendecomposition ``CCᵀ = U S Uᵀ`` restricted to the
``r`` eigenvalues kept, put ``W = S^{-1/2} Uᵀ`` and ``T̃ = W T``::

    ĝ = (1/ε) [D⁻¹ - D⁻¹T̃ᵀ (T̃ D⁻¹ T̃ᵀ + λε W K Wᵀ + (ε/N) I_r)⁻¹ T̃ D⁻¹] ∇L

The paper prints ``T̃ = S†UᵀT``; the equality with Prop. 5 needs the square root
``S^{-1/2}`` (then ``W CCᵀ Wᵀ = P``), which is also what the authors' code does. The
book's chapter on the estimator derives this. For ``λ > 0`` the transformed ``K`` term
keeps the two forms equal.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kwng import solve
from kwng._checks import (
    check_choice,
    check_int,
    check_points,
    check_positive,
)
from kwng.estimator_checks import (
    check_basis,
    check_grad,
    check_samples,
    check_solve_inputs,
    report_degenerate,
)
from kwng.jacobians import jacobian_from_outputs, jacobian_from_sampler
from kwng.kernels import (
    BANDWIDTH_RULES,
    Kernel,
    coord_matrices,
    mean_sq_bandwidth,
    median_bandwidth,
)
from kwng.samples import check_sample_resolution
from kwng.solve import DAMPING_FLOOR, DAMPINGS, SOLVE_METHODS

__all__ = ["KWNGResult", "draw_basis", "kernel_matrices", "damping_vector",
           "nystrom_solve", "kwng_gradient", "kwng_gradient_from_outputs"]

log = logging.getLogger(__name__)



@dataclass
class KWNGResult:
    """Output of the estimator: the direction and what it took to compute it.

    ``diagnostics`` holds ``N, M, d, q``, ``rank`` (eigenvalues of ``CCᵀ`` kept by the
    stable solve), ``cond_CCt``, ``cond_system`` (condition number of the ``M × M`` or
    ``r × r`` system), ``bandwidth``, ``damping``, ``method``, ``damping_floored``
    (entries of ``D`` raised to the floor), ``solver`` (cholesky, lstsq or pinv),
    ``fallbacks`` (1 when the Cholesky solve failed and least squares was used) and the
    basis actually used (``basis_idx``, ``basis_coords``).
    """

    direction: torch.Tensor
    diagnostics: dict = field(default_factory=dict)


def draw_basis(N: int, d: int, num_basis: int, generator: torch.Generator | None = None,
               device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``M = num_basis`` distinct sample indices and one coordinate in ``[0, d)``
    for each.

    This is the random Nyström subspace ``H_M = span{∂_{i_m} k(Y_m, ·)}`` of §3.2. With
    a ``generator`` both tensors live on its device (pass the same seed to reproduce a
    draw); without one they are drawn on ``device`` (default CPU) from the global
    stream, so a training step on a GPU draws there without a host-to-device copy or a
    sync.
    """
    N = check_int(N, "N", 1)
    d = check_int(d, "d", 1)
    check_int(num_basis, "num_basis", 1, N)
    if generator is not None:
        device = generator.device
    idx = torch.randperm(N, generator=generator, device=device)[:num_basis]
    coords = torch.randint(0, d, (num_basis,), generator=generator, device=device)
    return idx, coords


def kernel_matrices(
    X: torch.Tensor, basis_idx: torch.Tensor, basis_coords: torch.Tensor, kernel: Kernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The matrices ``C`` and ``K`` of Prop. 5 (eq. matrices) and the Gram ``CCᵀ``.

    Returns ``C`` with shape ``(M, N, d)`` (``C[m, n, j] = ∂_{i_m}∂_{j+d} k(Y_m,
    X_n)``), ``K`` with shape ``(M, M)`` (``K[m, m'] = ∂_{i_m}∂_{i_{m'}+d} k(Y_m,
    Y_{m'})``) and ``CCᵀ`` (``M × M``, summed over ``n`` and ``j`` *without* the
    ``1/N``). ``X`` is detached and promoted to float64 (at least): the three matrices
    come back in float64, so the kernel terms add no rounding of their own to that of
    the samples, and float16/bfloat16 samples cannot overflow them. Samples that all sit
    at one point give a ``RuntimeWarning``: they carry no metric to estimate (the
    estimators refuse them; :func:`kwng.nosync.kernel_matrices_nosync` returns NaN).
    """
    X = check_points(X, "X").detach()
    X = X.to(torch.promote_types(X.dtype, torch.float64))
    if X.shape[0] > 1 and bool((X == X[:1]).all()):
        warnings.warn(f"kernel_matrices: all {X.shape[0]} samples X sit at one point: "
                      "they carry no metric, and a direction built on these matrices "
                      "is meaningless", RuntimeWarning, stacklevel=2)
    C, K, _ = coord_matrices(
        kernel, X, basis_idx.to(X.device), basis_coords.to(X.device)
    )
    Cf = C.reshape(C.shape[0], -1)
    return C, K, Cf @ Cf.T


def damping_vector(kind: str, T: torch.Tensor, T_tilde: torch.Tensor | None = None,
                   floor: float = DAMPING_FLOOR) -> tuple[torch.Tensor, int]:
    """Diagonal ``D(θ)`` of §3.3: ``1``, ``‖T_{·,i}‖`` or ``‖T̃_{·,i}‖``, each at least
    ``floor`` times the largest entry (a relative floor, ``kwng.solve.DAMPING_FLOOR``).

    Validated form of :func:`kwng.solve.damping_diagonal`. Returns the vector and how
    many entries were raised to the floor (parameters the samples do not depend on have
    a zero column).
    """
    check_choice(kind, "damping", DAMPINGS)
    floor = check_positive(floor, "floor")
    if kind == "T_tilde" and T_tilde is None:
        raise ValueError("damping 'T_tilde' needs T_tilde (the whitened T)")
    D, low, _ = solve.damping_diagonal(kind, T, T_tilde, floor)
    n_low = int(low.sum())
    if n_low:
        log.debug("damping %s: %d of %d entries raised to %.1e of the largest",
                  kind, n_low, D.numel(), floor)
    return D.to(T.dtype), n_low


def _cond(A: torch.Tensor) -> float:
    ev = torch.linalg.eigvalsh(A)
    lo, hi = float(ev.abs().min()), float(ev.abs().max())
    return float("inf") if lo == 0 else hi / lo


def nystrom_solve(T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor,
                  grad: torch.Tensor, N: int, *, eps: float, lam: float = 0.0,
                  damping: str = "T_tilde", method: str = "stable",
                  rcond: float | None = None, damping_floor: float = DAMPING_FLOOR,
                  diagnostics: bool = True) -> KWNGResult:
    """The linear algebra of Props. 5 and 6 given ``T`` (``M × q``), ``CCᵀ`` and ``K``.

    ``eps`` is ``ε > 0``, ``lam`` is ``λ >= 0``, ``grad`` the estimated Euclidean
    gradient (``q``). Validates its inputs, runs :func:`kwng.solve.kwng_direction` in
    float64 (the eigen whitening of Prop. 6 with the dropped eigenvalues removed) and
    reports host-side diagnostics. The algebra *and the final combination* ``(D⁻¹∇L -
    D⁻¹ T̃ᵀ w) / ε`` run in float64 whatever the inputs' dtype: the two terms nearly
    cancel, so a subtraction in float32 or lower would return rounding noise. ``rcond``
    is the relative threshold below which eigenvalues of ``CCᵀ`` are dropped (default
    ``M · float-eps`` of ``CCᵀ``'s dtype). Returns the direction in ``grad``'s dtype.

    The precision of the samples themselves is checked by :func:`kwng_gradient` and
    :func:`kwng_gradient_from_outputs` (:func:`check_sample_resolution`).
    """
    eps = check_positive(eps, "eps")
    lam = check_positive(lam, "lam", allow_zero=True)
    check_choice(damping, "damping", DAMPINGS)
    check_choice(method, "method", SOLVE_METHODS)
    M, q = check_solve_inputs(T, CCt, K, grad)
    rcond = check_positive(solve.default_rcond(M, CCt.dtype) if rcond is None
                           else rcond, "rcond")
    damping_floor = check_positive(damping_floor, "damping_floor")
    out = solve.kwng_direction(
        T.to(torch.float64), CCt, K, grad.to(torch.float64), N, eps=eps, lam=lam,
        damping=damping, method=method, rcond=rcond, whitening="eig_truncate",
        damping_floor=damping_floor)
    rank = int(out.rank)
    if rank == 0:
        raise ValueError("C Cᵀ is numerically zero: the kernel derivatives vanish at "
                         "every sample (bandwidth far too small or too large for the "
                         "data)")
    n_loss_only = int(out.loss_only)
    if n_loss_only:
        log.info("%d parameter(s) move the loss but not the samples (zero column of "
                 "T): their components are the Euclidean gradient scaled like the rest",
                 n_loss_only)
    direction = out.direction.to(grad.dtype)
    if (not bool(torch.isfinite(direction).all())
            and bool(torch.isfinite(out.direction).all())):
        warnings.warn(f"KWNG direction overflows {grad.dtype}: pass grad in a wider "
                      "dtype", RuntimeWarning, stacklevel=2)
    diag = {}
    if diagnostics:
        Spos = out.eigenvalues[out.eigenvalues > 0]
        solver = ("pinv" if method == "plain"
                  else ("lstsq" if bool(out.failed) else "cholesky"))
        diag = {
            "M": M, "q": q, "N": N, "rank": rank, "method": method, "damping": damping,
            "eps": eps, "lam": lam, "damping_floored": int(out.floored),
            "floored_share": float(out.floored_share), "loss_only": n_loss_only,
            "solver": solver, "fallbacks": int(solver == "lstsq"),
            "cond_CCt": float("inf") if rank < M else float(Spos.max() / Spos.min()),
            "cond_system": _cond(out.system),
        }
    return KWNGResult(direction, diag)


def with_bandwidth(
    kernel: Kernel, X: torch.Tensor, basis_idx: torch.Tensor, bandwidth, sigma0: float
) -> Kernel:
    """A copy of ``kernel`` whose bandwidth follows ``bandwidth``: ``None`` keeps it, a
    number sets it, ``"mean_sq"`` uses ``σ0 · mean ‖X_n - Y_m‖²`` and ``"median"`` the
    median heuristic."""
    if bandwidth is None:
        return kernel
    if not bool(torch.isfinite(X.detach()).all()):
        raise ValueError(
            f"X must contain only finite values to set the bandwidth: found "
            f"{int(torch.isnan(X).sum())} NaN and {int(torch.isinf(X).sum())} inf "
            "entries"
        )
    kernel = copy.copy(kernel)
    X = X.detach().to(torch.promote_types(X.dtype, torch.float64))  # as kernel_matrices
    Y = X[basis_idx.to(X.device)]
    if isinstance(bandwidth, str):
        check_choice(bandwidth, "bandwidth", BANDWIDTH_RULES)
        kernel.bandwidth = (mean_sq_bandwidth(X, Y, sigma0) if bandwidth == "mean_sq"
                            else sigma0 * median_bandwidth(X, Y))
    else:
        kernel.bandwidth = bandwidth
    return kernel


def _prepare(X, grad, num_basis, eps, lam, kernel, generator, basis_idx, basis_coords):
    """The checks shared with :func:`kwng.kfng_gradient`
    (:mod:`kwng.estimator_checks`)."""
    X, _ = check_samples(X)
    N, d = X.shape
    check_int(num_basis, "num_basis", 1, N)
    check_positive(eps, "eps")
    check_positive(lam, "lam", allow_zero=True)
    if not isinstance(kernel, Kernel):
        raise ValueError(f"kernel must be a kwng.Kernel, got {type(kernel).__name__}")
    check_grad(grad)
    basis_idx, basis_coords = check_basis(
        basis_idx, basis_coords, N, d, num_basis,
        lambda: draw_basis(N, d, num_basis, generator))
    return X, N, d, basis_idx, basis_coords


def _estimate(X, basis_idx, basis_coords, kernel, bandwidth, sigma0, grad, jacobian,
              **solve_kw) -> KWNGResult:
    """The common tail of the two estimators: bandwidth, ``C, K, CCᵀ``, ``T`` (from
    ``jacobian(C)``), the solve and the diagnostics."""
    resolution = check_sample_resolution(X)
    kernel = with_bandwidth(kernel, X, basis_idx, bandwidth, sigma0)
    C, K, CCt = kernel_matrices(X, basis_idx, basis_coords, kernel)  # float64
    res = nystrom_solve(jacobian(C), CCt, K, grad, X.shape[0], **solve_kw)
    res.diagnostics["sample_resolution"] = resolution
    res.diagnostics.update(
        d=X.shape[1],
        bandwidth=kernel.bandwidth,
        kernel=repr(kernel),
        basis_idx=basis_idx,
        basis_coords=basis_coords,
    )
    report_degenerate(res.diagnostics, res.direction, grad, "kwng_gradient", 4)
    return res


def kwng_gradient(sampler: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor,
                  grad: torch.Tensor, *, num_basis: int, eps: float, lam: float = 0.0,
                  kernel: Kernel, damping: str = "T_tilde", method: str = "stable",
                  generator: torch.Generator | None = None,
                  basis_idx: torch.Tensor | None = None,
                  basis_coords: torch.Tensor | None = None, rcond: float | None = None,
                  bandwidth: float | str | None = None, sigma0: float = 1.0
                  ) -> KWNGResult:
    """KWNG estimate for an implicit model given as a sampler ``θ ↦ X = h_θ(Z)`` (Props.
    5/6).

    ``sampler`` maps a flat parameter vector ``theta`` (shape ``(q,)``) to samples ``X``
    (``N × d``) with the latent noise ``Z`` fixed inside it; ``grad`` is the estimated
    Euclidean gradient ``\\widehat{∇L(θ)}`` (shape ``(q,)``). ``num_basis`` is ``M``,
    ``eps`` is ``ε``, ``lam`` is ``λ``; ``damping`` picks ``D(θ)`` and ``method`` the
    plain (Prop. 5) or stable (Prop. 6) form. The basis is drawn with ``generator``
    unless ``basis_idx`` and ``basis_coords`` are passed. ``bandwidth`` overrides the
    kernel's bandwidth for this call: a number, ``"mean_sq"`` (``σ = σ0 · mean ‖X_n -
    Y_m‖²``, the paper's heuristic) or ``"median"`` (``σ0 ·`` median of ``‖X_n -
    Y_m‖²``), with ``sigma0`` the multiplier.

    Example::

        >>> import torch, kwng
        >>> model = kwng.NormalModel(d=2)
        >>> theta = model.random_params(torch.Generator().manual_seed(0))
        >>> Z = model.sample_latent(500, torch.Generator().manual_seed(1))
        >>> g = torch.randn(model.num_params, dtype=torch.float64)
        >>> res = kwng.kwng_gradient(lambda t: model.sample(t, Z), theta, g,
        ...                          num_basis=40, eps=1e-5,
        ...                          kernel=kwng.GaussianKernel(1.0))
        >>> res.direction.shape
        torch.Size([5])
    """
    if not isinstance(theta, torch.Tensor) or theta.dim() != 1:
        raise ValueError("theta must be a 1-d torch.Tensor (the flat parameter vector)")
    check_grad(grad, theta.numel())
    with torch.no_grad():
        X = sampler(theta)
    X, N, d, basis_idx, basis_coords = _prepare(
        X, grad, num_basis, eps, lam, kernel, generator, basis_idx, basis_coords
    )
    return _estimate(X, basis_idx, basis_coords, kernel, bandwidth, sigma0, grad,
                     lambda C: jacobian_from_sampler(sampler, theta.detach(), C),
                     eps=eps, lam=lam, damping=damping, method=method, rcond=rcond)


def kwng_gradient_from_outputs(X: torch.Tensor, params: Sequence[torch.Tensor],
                               grad: torch.Tensor, *, num_basis: int, eps: float,
                               lam: float = 0.0, kernel: Kernel,
                               damping: str = "T_tilde", method: str = "stable",
                               generator: torch.Generator | None = None,
                               basis_idx: torch.Tensor | None = None,
                               basis_coords: torch.Tensor | None = None,
                               rcond: float | None = None, retain_graph: bool = True,
                               bandwidth: float | str | None = None, sigma0: float = 1.0
                               ) -> KWNGResult:
    """KWNG estimate from outputs ``X = h_θ(Z)`` that carry an autograd graph to
    ``params``.

    Same estimator as :func:`kwng_gradient`; ``T`` is built from ``M`` vector-Jacobian
    products through the graph of ``X`` (:func:`jacobian_from_outputs`). ``grad`` is the
    flattened Euclidean gradient in the order of ``params``.
    """
    params = list(params)
    X, N, d, basis_idx, basis_coords = _prepare(
        X, grad, num_basis, eps, lam, kernel, generator, basis_idx, basis_coords
    )
    q = sum(p.numel() for p in params)
    if grad.shape != (q,):
        raise ValueError(
            f"grad must have shape ({q},) = total size of params, got "
            f"{tuple(grad.shape)}"
        )
    return _estimate(
        X,
        basis_idx,
        basis_coords,
        kernel,
        bandwidth,
        sigma0,
        grad,
        lambda C: jacobian_from_outputs(X, params, C, retain_graph=retain_graph),
        eps=eps,
        lam=lam,
        damping=damping,
        method=method,
        rcond=rcond,
    )

