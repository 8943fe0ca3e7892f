"""KWNG for many independent runs at once (the synthetic studies of Figs. 1, 5, 6 and
2).

:func:`kwng.kwng_gradient` handles one draw of samples and one basis. The accuracy
studies of Arbel et al. (2020, §4.1 and App. D.1) repeat the estimate 100 times per grid
point; this module evaluates the *same* estimator (Prop. 6, the stable form, with the
Gaussian kernel) for ``R`` runs stacked along a leading batch dimension, so that a GPU
works on all of them together.

Two simplifications keep it short and fast, both specific to the synthetic models:

* the sampler Jacobian ``B = ∂X/∂θ`` (``N × d × q``) is written in closed form for the
  three models of :mod:`kwng.models` (:func:`sample_and_jacobian`) instead of
  forward-mode autograd;
* eigenvalues of ``CCᵀ`` below the relative threshold ``rcond`` are not removed from the
  system but have their row of ``W = S^{-1/2}Uᵀ`` set to zero
  (:func:`kwng.solve.eig_whitening`), so every run in the batch keeps the shape ``M``.

``C``, ``K`` and the bandwidth come from :func:`kwng.kernels.coord_matrices` and the
solve from :func:`kwng.solve.kwng_direction`: the formulas of the single-run estimator,
with a batch dimension.

The tests check the result against :func:`kwng.kwng_gradient` on identical samples and
basis.
"""

from __future__ import annotations

import torch

from kwng._checks import check_choice, check_int, check_positive
from kwng.kernels import BANDWIDTH_RULES, GaussianKernel, Kernel, coord_matrices
from kwng.models import HyperSphereModel, ImplicitModel, LogNormalModel, NormalModel
from kwng.solve import DAMPING_FLOOR, DAMPINGS, default_rcond, kwng_direction

__all__ = [
    "sample_and_jacobian",
    "batched_nystrom_solve",
    "batched_kwng",
    "runs_per_chunk",
]

_GAUSSIAN = GaussianKernel(1.0)  # the bandwidth is passed per run


def _check_batch(
    Theta: torch.Tensor, Z: torch.Tensor, model: ImplicitModel
) -> tuple[int, int]:
    if (
        not isinstance(Theta, torch.Tensor)
        or Theta.dim() != 2
        or Theta.shape[1] != model.num_params
    ):
        raise ValueError(
            f"Theta must be a tensor of shape (R, {model.num_params}) for {model!r}"
        )
    if (
        not isinstance(Z, torch.Tensor)
        or Z.dim() != 3
        or Z.shape[0] != Theta.shape[0]
        or Z.shape[2] != model.d
    ):
        raise ValueError(
            f"Z must be a tensor of shape (R, N, {model.d}) with R = {Theta.shape[0]}"
        )
    return Z.shape[0], Z.shape[1]


def sample_and_jacobian(model: ImplicitModel, Theta: torch.Tensor, Z: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``X = h_θ(Z)`` (``R × N × d``) and their Jacobian ``B = ∂X/∂θ`` (``R × N
    × d × q``).

    ``Theta`` is ``R × q`` (one parameter vector per run) and ``Z`` the latent draws ``R
    × N × d``. Closed forms (same parametrisations as :mod:`kwng.models`):

    * normal ``X = μ + LZ``: ``∂X_j/∂μ_k = δ_jk``, ``∂X_j/∂L_ab = δ_ja Z_b`` (``a ≥
      b``);
    * log-normal ``X = exp(μ + s⊙Z)``: ``∂X_j/∂μ_k = δ_jk X_j``, ``∂X_j/∂s_k = δ_jk X_j
      Z_j``;
    * sphere ``X = μ + e^ρ Z/‖Z‖``: ``∂X_j/∂μ_k = δ_jk``, ``∂X/∂ρ = e^ρ Z/‖Z‖``.
    """
    R, N = _check_batch(Theta, Z, model)
    d, q = model.d, model.num_params
    Z = Z.to(Theta.dtype)
    B = torch.zeros(R, N, d, q, dtype=Theta.dtype, device=Theta.device)
    eye = torch.arange(d, device=Theta.device)
    if isinstance(model, NormalModel):
        rows, cols = torch.tril_indices(d, d, device=Theta.device)
        L = torch.zeros(R, d, d, dtype=Theta.dtype, device=Theta.device)
        L[:, rows, cols] = Theta[:, d:]
        X = Theta[:, None, :d] + Z @ L.transpose(1, 2)
        B[:, :, eye, eye] = 1.0
        B[:, :, rows, d + torch.arange(len(rows), device=Theta.device)] = Z[:, :, cols]
    elif isinstance(model, LogNormalModel):
        X = torch.exp(Theta[:, None, :d] + Theta[:, None, d:] * Z)
        B[:, :, eye, eye] = X
        B[:, :, eye, d + eye] = X * Z
    elif isinstance(model, HyperSphereModel):
        U = Z / torch.linalg.vector_norm(Z, dim=2, keepdim=True)
        radial = torch.exp(Theta[:, d])[:, None, None] * U
        X = Theta[:, None, :d] + radial
        B[:, :, eye, eye] = 1.0
        B[:, :, :, d] = radial
    else:
        raise ValueError(
            "model must be a NormalModel, LogNormalModel or HyperSphereModel, got "
            f"{model!r}"
        )
    return X, B


def batched_nystrom_solve(T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor | None,
                          grad: torch.Tensor, N: int, *, eps: float, lam: float = 0.0,
                          damping: str = "T_tilde", rcond: float | None = None,
                          damping_floor: float = DAMPING_FLOOR
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable form (Prop. 6) for a batch: ``T`` is ``R × M × q``, ``CCt`` and ``K`` are
    ``R × M × M``, ``grad`` is ``R × q``. Returns the directions (``R × q``) and the
    rank of each ``CCᵀ`` (``R``). This is :func:`kwng.solve.kwng_direction` in float64
    with the eigen whitening whose dropped eigenvalues are zero rows (so every run keeps
    the shape ``M``), the relative damping floor and the degenerate-column rule of
    :func:`kwng.nystrom_solve`."""
    eps = check_positive(eps, "eps")
    lam = check_positive(lam, "lam", allow_zero=True)
    check_choice(damping, "damping", DAMPINGS)
    if lam > 0 and K is None:
        raise ValueError("K is required when lam > 0")
    M = T.shape[1]
    rcond = check_positive(
        default_rcond(M, CCt.dtype) if rcond is None else rcond, "rcond"
    )
    out = kwng_direction(
        T.to(torch.float64),
        CCt,
        K,
        grad.to(torch.float64),
        N,
        eps=eps,
        lam=lam,
        damping=damping,
        whitening="eig",
        rcond=rcond,
        damping_floor=check_positive(damping_floor, "damping_floor"),
    )
    if not bool((out.rank > 0).all()):
        raise ValueError(
            "C Cᵀ is numerically zero in some run: bandwidth far too small or too large"
        )
    return out.direction, out.rank


def runs_per_chunk(
    M: int, N: int, d: int, q: int, mem_bytes: float = 4e9, itemsize: int = 8
) -> int:
    """How many runs fit in ``mem_bytes`` (``C``, its temporaries and ``B``
    dominate)."""
    check_int(M, "M", 1)
    check_int(N, "N", 1)
    per_run = itemsize * N * d * (3 * M + q) + itemsize * 4 * M * M
    return max(1, int(mem_bytes // per_run))


def _check_inputs(model: ImplicitModel, Theta: torch.Tensor, grads: torch.Tensor,
                  Z: torch.Tensor, basis_idx: torch.Tensor, basis_coords: torch.Tensor,
                  bandwidth: float | str) -> tuple[int, int, int]:
    """``(R, N, M)`` of the inputs of :func:`batched_kwng`, checked."""
    R, N = _check_batch(Theta, Z, model)
    if grads.shape != Theta.shape:
        raise ValueError(
            f"grads must have the shape of Theta {tuple(Theta.shape)}, got "
            f"{tuple(grads.shape)}"
        )
    if (
        basis_idx.dim() != 2
        or basis_idx.shape[0] != R
        or basis_coords.shape != basis_idx.shape
    ):
        raise ValueError(f"basis_idx and basis_coords must both have shape ({R}, M)")
    M = basis_idx.shape[1]
    check_int(M, "num_basis", 1, N)
    if int(basis_idx.min()) < 0 or int(basis_idx.max()) >= N:
        raise ValueError(f"basis_idx must lie in [0, {N - 1}]")
    if int(basis_coords.min()) < 0 or int(basis_coords.max()) >= model.d:
        raise ValueError(f"basis_coords must lie in [0, {model.d - 1}]")
    if isinstance(bandwidth, str):
        check_choice(bandwidth, "bandwidth", BANDWIDTH_RULES)
    else:
        check_positive(bandwidth, "bandwidth")
    return R, N, M


def batched_kwng(model: ImplicitModel, Theta: torch.Tensor, grads: torch.Tensor,
                 Z: torch.Tensor, basis_idx: torch.Tensor, basis_coords: torch.Tensor,
                 *, eps: float, lam: float = 0.0, bandwidth: float | str = 1.0,
                 sigma0: float = 1.0, damping: str = "T_tilde",
                 rcond: float | None = None, mem_bytes: float = 4e9,
                 kernel: Kernel | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KWNG (Prop. 6, Gaussian kernel) for ``R`` runs of a synthetic model at once.

    ``Theta`` (``R × q``), ``grads`` (``R × q``), ``Z`` (``R × N × d``), ``basis_idx``
    and ``basis_coords`` (``R × M``) must share a device; the computation runs there in
    float64 and in chunks of runs bounded by ``mem_bytes``. ``bandwidth`` is a fixed ``σ
    > 0``, ``"mean_sq"`` or ``"median"`` (``σ = sigma0 · mean ‖X_n - Y_m‖²`` per run).
    Returns ``(directions R × q, bandwidths R, ranks R)``. ``kernel`` (default Gaussian)
    supplies the formula; its own bandwidth is not used. Matches
    :func:`kwng.kwng_gradient` with that kernel, ``method="stable"`` and the same
    samples and basis.
    """
    R, N, M = _check_inputs(model, Theta, grads, Z, basis_idx, basis_coords,
                            bandwidth)
    d, q = model.d, model.num_params
    chunk = runs_per_chunk(M, N, d, q, mem_bytes)
    dirs, sigmas, ranks = [], [], []
    for start in range(0, R, chunk):
        sl = slice(start, start + chunk)
        Th = Theta[sl].to(torch.float64)
        X, B = sample_and_jacobian(model, Th, Z[sl].to(torch.float64))
        idx, crd = basis_idx[sl].long(), basis_coords[sl].long()
        bw = (
            bandwidth
            if isinstance(bandwidth, str)
            else torch.full(
                (X.shape[0],), float(bandwidth), dtype=torch.float64, device=X.device
            )
        )
        C, K, sig = coord_matrices(
            kernel or _GAUSSIAN, X, idx, crd, bw, sigma0, need_K=lam > 0
        )
        Cf = C.reshape(C.shape[0], M, N * d)
        CCt = Cf @ Cf.transpose(1, 2)
        T = (Cf @ B.reshape(B.shape[0], N * d, q)) / N
        del C, Cf, B
        direction, rank = batched_nystrom_solve(
            T, CCt, K, grads[sl].to(torch.float64), N, eps=eps, lam=lam,
            damping=damping, rcond=rcond)
        dirs.append(direction)
        sigmas.append(sig)
        ranks.append(rank)
    return torch.cat(dirs), torch.cat(sigmas), torch.cat(ranks)

