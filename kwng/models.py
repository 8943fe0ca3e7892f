"""Parametric models with a closed-form Wasserstein natural gradient (WNG).

Each model is an *implicit model* ``X = h_θ(Z)`` (a differentiable torch sampler usable
by the estimator) and knows its Wasserstein information matrix ``G_W(θ)`` and WNG
``G_W(θ)⁻¹ ∇L(θ)`` in closed form (Arbel et al. 2020, App. D.1; Malagò et al. 2018; Chen
& Li 2018):

* :class:`NormalModel`     ``X = μ + L Z``, ``Σ = L Lᵀ``, ``L`` lower triangular;
* :class:`LogNormalModel`  ``X = exp(μ + s ⊙ Z)``: **diagonal** covariance ``diag(s²)``
  of the underlying normal. This assumption is what makes the WNG closed-form: the
  family is a product of one-dimensional families, for which every velocity field is a
  gradient;
* :class:`HyperSphereModel` ``X = μ + e^ρ Z/‖Z‖``: uniform on the sphere of centre ``μ``
  and radius ``r = e^ρ``; it has no density, so the Fisher natural gradient does not
  exist.

Closed forms are computed in float64 with NumPy/SciPy and returned as torch float64
tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import numpy as np
import torch

from kwng._checks import check_int, check_positive
from kwng.gaussian import _np, gaussian_w2_squared, lyapunov, normal_wng_sigma_coords

__all__ = [
    "ImplicitModel",
    "NormalModel",
    "LogNormalModel",
    "HyperSphereModel",
    "MODELS",
    "make_model",
    "model_names",
]


class ImplicitModel:
    """Base class: a sampler ``h_θ(Z)`` with latent ``Z ~ N(0, I_d)`` and closed-form
    metric."""

    name = "model"

    def __init__(self, d: int) -> None:
        self.d = check_int(d, "d", 1)

    @property
    def num_params(self) -> int:  # q
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(d={self.d}, q={self.num_params})"

    def check_theta(self, theta: torch.Tensor) -> torch.Tensor:
        if not isinstance(theta, torch.Tensor) or theta.shape != (self.num_params,):
            shape = (
                tuple(theta.shape)
                if isinstance(theta, torch.Tensor)
                else type(theta).__name__
            )
            raise ValueError(
                f"theta must be a tensor of shape ({self.num_params},) for {self!r}, "
                f"got {shape}"
            )
        return theta

    def sample_latent(self, N: int, generator: torch.Generator | None = None,
                      dtype: torch.dtype = torch.float64,
                      device: str | torch.device = "cpu") -> torch.Tensor:
        """``N`` latent draws ``Z ~ N(0, I_d)`` (drawn on the CPU for reproducibility,
        then moved)."""
        N = check_int(N, "N", 1)
        return torch.randn(N, self.d, generator=generator, dtype=dtype).to(device)

    def random_params(self, generator: torch.Generator | None = None,
                      variance: float = 0.1, dtype: torch.dtype = torch.float64
                      ) -> torch.Tensor:
        """``θ ~ N(0, variance · I_q)``, the protocol of the paper's synthetic
        experiments."""
        std = check_positive(variance, "variance") ** 0.5
        return std * torch.randn(self.num_params, generator=generator, dtype=dtype)

    def reference_params(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The model's reference point ``θ₀``: ``0`` here; :class:`NormalModel`
        overrides it."""
        return torch.zeros(self.num_params, dtype=dtype)

    def params_near_reference(self, generator: torch.Generator | None = None,
                              variance: float = 0.1,
                              dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A random parameter near the reference point: ``θ = θ₀ + ξ``, ``ξ`` drawn by
        :meth:`random_params` (``N(0, variance · I_q)``, the paper's protocol).

        ``θ₀ = 0`` for the sphere and the log-normal model (the paper's draw as stated)
        and ``θ₀ = (μ = 0, L = I)`` for the normal model
        (:meth:`NormalModel.reference_params`). The draw of the synthetic sweeps, the
        Fisher study, the flows and the chapters.
        """
        return self.random_params(generator, variance, dtype) + self.reference_params(
            dtype
        )

    def sample(self, theta: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
        """``X = h_θ(Z)``, differentiable in ``theta``; shape ``(N, d)``."""
        raise NotImplementedError

    def metric(self, theta: torch.Tensor) -> torch.Tensor:
        """The Wasserstein information matrix ``G_W(θ)`` (``q × q``)."""
        raise NotImplementedError

    def wng(self, theta: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The exact Wasserstein natural gradient ``G_W(θ)⁻¹ ∇L(θ)``."""
        raise NotImplementedError

    def w2_squared(self, theta_a: torch.Tensor, theta_b: torch.Tensor) -> float:
        """Closed-form ``W2²(ρ_{θ_a}, ρ_{θ_b})`` (used by the finite-difference
        checks)."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------
# Multivariate normal
# --------------------------------------------------------------------------------------
class NormalModel(ImplicitModel):
    """``N(μ, LLᵀ)`` with ``θ = (μ, vech L)``, ``L`` lower triangular (entries in
    ``torch.tril_indices`` order), sampled as ``X = μ + L Z``.

    The metric is the Bures-Wasserstein one (paper App. D.1): a tangent vector ``(m,
    dΣ)`` has squared length ``‖m‖² + tr(A Σ A)`` where ``AΣ + ΣA = dΣ`` and ``dΣ = dL
    Lᵀ + L dLᵀ``. The WNG is computed in the paper's ``(μ, s = tril Σ)`` coordinates
    with :func:`normal_wng_sigma_coords` and carried to ``(μ, L)`` by the chain rule
    (the map ``L ↦ tril(LLᵀ)`` is a local diffeomorphism when ``L`` has a non-zero
    diagonal).
    """

    name = "normal"

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self._il = np.tril_indices(d)

    @property
    def num_params(self) -> int:
        return self.d + self.d * (self.d + 1) // 2

    def split(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(μ, L)`` from ``θ``."""
        theta = self.check_theta(theta)
        d = self.d
        rows, cols = torch.tril_indices(d, d)
        L = torch.zeros(d, d, dtype=theta.dtype, device=theta.device)
        L = L.index_put((rows.to(theta.device), cols.to(theta.device)), theta[d:])
        return theta[:d], L

    def join(self, mu, L) -> torch.Tensor:
        mu, L = torch.as_tensor(mu), torch.as_tensor(L)
        rows, cols = torch.tril_indices(self.d, self.d)
        return torch.cat([mu.reshape(-1), L[rows, cols]])

    def reference_params(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``θ₀ = (μ = 0, vech L = vech I)``: the standard normal.

        The paper's draw ``θ ~ N(0, variance · I_q)`` around ``0`` puts ``L`` near zero,
        where ``Σ = LLᵀ`` is close to singular and finite differences or Lyapunov solves
        lose accuracy; drawing around ``L = I`` (:meth:`params_near_reference`) keeps
        ``Σ`` well conditioned.
        """
        return self.join(
            torch.zeros(self.d, dtype=dtype), torch.eye(self.d, dtype=dtype)
        )

    def covariance(self, theta: torch.Tensor) -> np.ndarray:
        _, L = self.split(theta)
        L = _np(L)
        return L @ L.T

    def sample(self, theta, Z):
        mu, L = self.split(theta)
        return mu + Z.to(theta.dtype) @ L.T

    def jacobian_s_l(self, L: np.ndarray) -> np.ndarray:
        """``J = ∂ tril(LLᵀ) / ∂ vech(L)``, square of size ``d(d+1)/2``: carries
        gradients between our coordinates ``(μ, vech L)`` and the paper's ``(μ, tril
        Σ)``."""
        il = self._il
        n = len(il[0])
        J = np.zeros((n, n))
        for k, (i, j) in enumerate(zip(*il)):
            E = np.zeros_like(L)
            E[i, j] = 1.0
            dS = E @ L.T + L @ E.T
            J[:, k] = dS[il]
        return J

    def metric(self, theta):
        """``G_W`` assembled entry by entry from the definition (Lyapunov solve per
        direction)."""
        mu, L = self.split(theta)
        L = _np(L)
        Sigma = L @ L.T
        d = self.d
        As = []
        for i, j in zip(*self._il):
            E = np.zeros((d, d))
            E[i, j] = 1.0
            As.append(lyapunov(Sigma, E @ L.T + L @ E.T))
        n = len(As)
        G = np.zeros((d + n, d + n))
        G[:d, :d] = np.eye(d)
        for a in range(n):
            for b in range(a, n):
                G[d + a, d + b] = G[d + b, d + a] = np.trace(As[a] @ Sigma @ As[b])
        return torch.from_numpy(G)

    def wng(self, theta, grad):
        mu, L = self.split(theta)
        L = _np(L)
        g = _np(grad)
        d = self.d
        J = self.jacobian_s_l(L)
        g_s = np.linalg.solve(J.T, g[d:])  # ∇_s L from ∇_L L by the chain rule
        nat_mu, nat_s = normal_wng_sigma_coords(L @ L.T, g[:d], g_s)
        nat_l = np.linalg.solve(J, nat_s)
        return torch.from_numpy(np.concatenate([nat_mu, nat_l]))

    def w2_squared(self, theta_a, theta_b):
        mu_a, _ = self.split(theta_a)
        mu_b, _ = self.split(theta_b)
        return gaussian_w2_squared(
            mu_a, self.covariance(theta_a), mu_b, self.covariance(theta_b)
        )


# --------------------------------------------------------------------------------------
# Log-normal with diagonal covariance
# --------------------------------------------------------------------------------------
class LogNormalModel(ImplicitModel):
    """Multivariate log-normal ``X = exp(μ + s ⊙ Z)`` with ``θ = (μ, s) ∈ R^{2d}``.

    **Assumption:** the underlying normal has diagonal covariance ``diag(s²)``. The
    coordinates are then independent, the Wasserstein metric splits into ``d`` blocks
    and in each one-dimensional block the velocity fields ``x ↦ (x, x z(x))`` are
    gradients, so ``G_k = E[(∂h/∂(μ_k, s_k))(∂h/∂(μ_k, s_k))ᵀ] = e^{2μ_k + 2s_k²} [[1,
    2s_k], [2s_k, 1 + 4s_k²]]``. (A full covariance couples coordinates through a
    non-gradient velocity field and has no closed form that we know of.)
    """

    name = "lognormal"

    @property
    def num_params(self) -> int:
        return 2 * self.d

    def sample(self, theta, Z):
        theta = self.check_theta(theta)
        d = self.d
        return torch.exp(theta[:d] + theta[d:] * Z.to(theta.dtype))

    def _blocks(self, theta):
        t = _np(self.check_theta(theta))
        mu, s = t[: self.d], t[self.d:]
        scale = np.exp(2 * mu + 2 * s ** 2)
        return mu, s, scale

    def metric(self, theta):
        _, s, scale = self._blocks(theta)
        d = self.d
        G = np.zeros((2 * d, 2 * d))
        k = np.arange(d)
        G[k, k] = scale
        G[k, d + k] = G[d + k, k] = scale * 2 * s
        G[d + k, d + k] = scale * (1 + 4 * s ** 2)
        return torch.from_numpy(G)

    def wng(self, theta, grad):
        _, s, scale = self._blocks(theta)
        g = _np(grad)
        gm, gs = g[: self.d], g[self.d:]
        # Each 2 × 2 block has determinant scale², its inverse is [[1+4s², -2s], [-2s,
        # 1]] / scale.
        nat_m = ((1 + 4 * s ** 2) * gm - 2 * s * gs) / scale
        nat_s = (-2 * s * gm + gs) / scale
        return torch.from_numpy(np.concatenate([nat_m, nat_s]))

    def quantile(self, theta, u: np.ndarray) -> np.ndarray:
        """Quantile function of the marginals, shape ``(len(u), d)`` (used for 1-d W2
        checks)."""
        from scipy.stats import norm

        t = _np(self.check_theta(theta))
        return np.exp(
            t[: self.d] + np.abs(t[self.d :]) * norm.ppf(np.asarray(u))[:, None]
        )

    def w2_squared(self, theta_a, theta_b):
        """Sum over coordinates of the 1-d ``W2² = ∫₀¹ (F_a⁻¹(u) - F_b⁻¹(u))² du``
        (adaptive quadrature)."""
        from scipy.integrate import quad

        total = 0.0
        for k in range(self.d):
            def integrand(u, k=k):
                qa = self.quantile(theta_a, np.array([u]))[0, k]
                qb = self.quantile(theta_b, np.array([u]))[0, k]
                return (qa - qb) ** 2
            total += quad(integrand, 0.0, 1.0, limit=200, epsabs=1e-14, epsrel=1e-12)[0]
        return total


# --------------------------------------------------------------------------------------
# Uniform distribution on a hyper-sphere
# --------------------------------------------------------------------------------------
class HyperSphereModel(ImplicitModel):
    """Uniform distribution on the sphere ``{x : ‖x - μ‖ = r}`` in ``R^d``, ``θ = (μ,
    ρ)``, ``r = e^ρ``, sampled as ``X = μ + r Z/‖Z‖`` (for ``d = 1``: the two points ``μ
    ± r``).

    The velocity fields of ``μ`` and ``ρ`` are ``x ↦ e_i`` and ``x ↦ x - μ``, both
    gradients (of ``x_i`` and ``‖x - μ‖²/2``), so ``G_W = E[∂hᵀ∂h] = diag(I_d, r²)``.
    The measure has no density: the Fisher information is not defined.
    """

    name = "sphere"

    @property
    def num_params(self) -> int:
        return self.d + 1

    def sample(self, theta, Z):
        theta = self.check_theta(theta)
        Z = Z.to(theta.dtype)
        U = Z / torch.linalg.vector_norm(Z, dim=1, keepdim=True)
        return theta[: self.d] + torch.exp(theta[self.d]) * U

    def metric(self, theta):
        t = _np(self.check_theta(theta))
        diag = np.ones(self.d + 1)
        diag[-1] = np.exp(2 * t[-1])
        return torch.from_numpy(np.diag(diag))

    def wng(self, theta, grad):
        t = _np(self.check_theta(theta))
        g = _np(grad).copy()
        g[-1] = g[-1] * np.exp(-2 * t[-1])
        return torch.from_numpy(g)

    def w2_squared(self, theta_a, theta_b):
        """``‖μa - μb‖² + (ra - rb)²``: the radial map ``x ↦ μb + (rb/ra)(x - μa)`` is
        optimal."""
        a, b = _np(theta_a), _np(theta_b)
        d = self.d
        return float(np.sum((a[:d] - b[:d]) ** 2) + (np.exp(a[d]) - np.exp(b[d])) ** 2)


#: The registry of the models by name (the one table; the studies take their names from
#: it).
MODELS: Mapping[str, type[ImplicitModel]] = MappingProxyType(
    {"normal": NormalModel, "lognormal": LogNormalModel, "sphere": HyperSphereModel})


def model_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, in their order, each checked against :data:`MODELS`: an
    unknown name raises ``ValueError`` with the accepted names (a study's figure order
    is one)."""
    names = tuple(names)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {unknown[0]!r}")
    return names


def make_model(name: str, d: int) -> ImplicitModel:
    """Build a model by name: ``"normal"``, ``"lognormal"`` or ``"sphere"``
    (:data:`MODELS`)."""
    (name,) = model_names((name,))
    return MODELS[name](d)
