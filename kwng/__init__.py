"""kwng: the Kernelized Wasserstein Natural Gradient (Arbel, Gretton, Li & Montúfar,
ICLR 2020).

The library, in floors that import only downwards:

* ``kwng`` (this folder): the estimator core. Kernels (:mod:`kwng.kernels`), the linear
  algebra of Props. 5 and 6 (:mod:`kwng.solve`), the estimator (:mod:`kwng.estimator`,
  sync-free variant :mod:`kwng.nosync`), the models with closed-form WNG
  (:mod:`kwng.models`, on the normal closed forms of :mod:`kwng.gaussian`), the kernel
  Fisher–Rao estimator (:mod:`kwng.fisher`) and the book's scale switch
  (:mod:`kwng.scale_switch`).
* :mod:`kwng.engine`: the deep-learning engine, :class:`KWNGPreconditioner` (class,
  state and step in :mod:`kwng.engine.precond`) with its :class:`KWNGConfig`, drop-in
  before ``optimizer.step`` (its ``step(loss, X)`` runs the backward passes), and
  :class:`DistributedKWNG` over ``torch.distributed``.
* :mod:`kwng.theory`: the theory chapters' reference computations.

The book's studies (experiments, figures, tables, benchmarks) live beside the library in
the checkout's ``studies/`` folder and are not part of it. ``import kwng`` loads the
core and the engine's preconditioner only; the theory and the GPU kernels load when
imported. The names below are the curated public API; each is defined in the module
named in its docstring.
"""

from importlib.metadata import PackageNotFoundError, version

from kwng.engine.capture import capture_step
from kwng.engine.config import KWNGConfig, eps_from_authors
from kwng.engine.distributed import DistributedKWNG
from kwng.engine.expanded import ExpandedParameter
from kwng.engine.lm import LevenbergMarquardt, LMSchedule
from kwng.engine.precond import KWNGPreconditioner, RefreshSchedule
from kwng.estimator import (
    KWNGResult,
    damping_vector,
    draw_basis,
    kernel_matrices,
    kwng_gradient,
    kwng_gradient_from_outputs,
    nystrom_solve,
)
from kwng.estimator_checks import relative_error
from kwng.fisher import kernel_fisher_metric, kfng_gradient
from kwng.fisher_exact import fisher_matrix, fisher_matrix_mc, fisher_natural_gradient
from kwng.gaussian import gaussian_w2_squared, lyapunov, normal_wng_sigma_coords
from kwng.jacobians import jacobian_from_outputs, jacobian_from_sampler
from kwng.kernels import (
    GaussianKernel,
    Kernel,
    RationalQuadraticKernel,
    make_kernel,
    mean_sq_bandwidth,
    median_bandwidth,
)
from kwng.models import (
    HyperSphereModel,
    ImplicitModel,
    LogNormalModel,
    NormalModel,
    make_model,
)
from kwng.nosync import nystrom_solve_nosync
from kwng.scale_switch import is_full, pick, scale
from kwng.solve import DAMPINGS, SOLVE_METHODS

# the installed distribution's version (pyproject.toml); a bare source tree has none
try:
    __version__ = version("kwng")
except PackageNotFoundError:
    __version__ = "0+unknown"

__all__ = [
    # the preconditioner and its configuration
    "KWNGPreconditioner",
    "KWNGConfig",
    "DistributedKWNG",
    "LMSchedule",
    "LevenbergMarquardt",
    "RefreshSchedule",
    "eps_from_authors",
    "capture_step",
    "ExpandedParameter",
    # the estimator (Props. 5 and 6)
    "KWNGResult",
    "DAMPINGS",
    "SOLVE_METHODS",
    "draw_basis",
    "kernel_matrices",
    "jacobian_from_sampler",
    "jacobian_from_outputs",
    "damping_vector",
    "nystrom_solve",
    "nystrom_solve_nosync",
    "kwng_gradient",
    "kwng_gradient_from_outputs",
    "relative_error",
    # kernels and their bandwidths
    "Kernel",
    "GaussianKernel",
    "RationalQuadraticKernel",
    "make_kernel",
    "mean_sq_bandwidth",
    "median_bandwidth",
    # models with a closed-form Wasserstein natural gradient
    "ImplicitModel",
    "NormalModel",
    "LogNormalModel",
    "HyperSphereModel",
    "make_model",
    # closed forms of the normal family
    "gaussian_w2_squared",
    "lyapunov",
    "normal_wng_sigma_coords",
    # the Fisher-Rao side: kernel estimator and exact references
    "kfng_gradient",
    "kernel_fisher_metric",
    "fisher_matrix",
    "fisher_natural_gradient",
    "fisher_matrix_mc",
    # the scale switch of the experiments (KWNG_SCALE)
    "scale",
    "is_full",
    "pick",
]
