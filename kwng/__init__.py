"""kwng: the Kernelized Wasserstein Natural Gradient (Arbel, Gretton, Li & Montúfar, ICLR 2020).

The package behind the kwng book. Public API:

* kernels: :class:`GaussianKernel`, :class:`RationalQuadraticKernel`, :func:`make_kernel`,
  bandwidth heuristics :func:`mean_sq_bandwidth`, :func:`median_bandwidth`;
* the estimator (Props. 5 and 6): :func:`kwng_gradient`, :func:`kwng_gradient_from_outputs`,
  :func:`nystrom_solve` and its building blocks (the linear algebra itself, batched, in
  :mod:`kwng.solve`);
* models with closed-form WNG: :class:`NormalModel`, :class:`LogNormalModel`,
  :class:`HyperSphereModel`;
* deep networks: :class:`KWNGPreconditioner` with its :class:`KWNGConfig` (drop-in between ``loss.backward`` and
  ``optimizer.step``; see :mod:`kwng.precond`), the networks of the CIFAR study in
  :mod:`kwng.nets`, data in :mod:`kwng.data`, KFAC/EKFAC baselines in :mod:`kwng.baselines`;
* the scale switch :func:`scale` (``$KWNG_SCALE`` = ``small`` | ``full``).
"""

from .config import is_full, pick, scale
from .cuda_graphs import capture_step
from .estimator import (
    KWNGResult,
    damping_vector,
    draw_basis,
    jacobian_from_outputs,
    jacobian_from_sampler,
    kernel_matrices,
    kwng_gradient,
    kwng_gradient_from_outputs,
    nystrom_solve,
    nystrom_solve_nosync,  # kept at the top level: the deep-learning chapter names it
)
from .kernels import (
    GaussianKernel,
    Kernel,
    RationalQuadraticKernel,
    make_kernel,
    mean_sq_bandwidth,
    median_bandwidth,
)
from .lm import LevenbergMarquardt, LMSchedule
from .models import (
    HyperSphereModel,
    ImplicitModel,
    LogNormalModel,
    NormalModel,
    gaussian_w2_squared,
    lyapunov,
    make_model,
    normal_wng_sigma_coords,
)
from .precond import KWNGPreconditioner
from .precond_config import KWNGConfig, eps_from_authors
from .solve import DAMPINGS, METHODS

__version__ = "0.1.0"

# What a reader uses. Internals (the sync-free kernel matrices, the bandwidth tensor, the
# batched sweeps, the building blocks of kwng.solve) stay importable from their modules.
__all__ = [
    "scale", "is_full", "pick",
    "Kernel", "GaussianKernel", "RationalQuadraticKernel", "make_kernel",
    "mean_sq_bandwidth", "median_bandwidth",
    "KWNGResult", "DAMPINGS", "METHODS", "draw_basis", "kernel_matrices",
    "jacobian_from_sampler", "jacobian_from_outputs", "damping_vector", "nystrom_solve",
    "nystrom_solve_nosync", "kwng_gradient", "kwng_gradient_from_outputs",
    "ImplicitModel", "NormalModel", "LogNormalModel", "HyperSphereModel", "make_model",
    "gaussian_w2_squared", "lyapunov", "normal_wng_sigma_coords",
    "KWNGPreconditioner", "KWNGConfig", "LevenbergMarquardt", "LMSchedule", "eps_from_authors",
    "capture_step", "relative_error",
]


def relative_error(estimate, exact) -> float:
    """``‖estimate - exact‖ / ‖exact‖`` (the error measure of the paper's Figs. 1, 5, 6)."""
    import torch

    e = torch.as_tensor(estimate, dtype=torch.float64).cpu()
    x = torch.as_tensor(exact, dtype=torch.float64).cpu()
    if e.shape != x.shape:
        raise ValueError(f"estimate and exact must have the same shape, got {tuple(e.shape)} and {tuple(x.shape)}")
    nx = float(torch.linalg.vector_norm(x))
    if nx == 0:
        raise ValueError("exact must be non-zero for a relative error")
    return float(torch.linalg.vector_norm(e - x)) / nx

# Beyond the paper: the same kernel estimator on the Fisher–Rao dual (kwng.fisher).
from .fisher import (  # noqa: E402
    fisher_matrix,
    fisher_matrix_mc,
    fisher_natural_gradient,
    kernel_fisher_metric,
    kfng_gradient,
)

__all__ += ["kfng_gradient", "kernel_fisher_metric", "fisher_matrix",
            "fisher_natural_gradient", "fisher_matrix_mc"]
