"""The grids of the accuracy studies: keyed seeds, bandwidth specs, ``N``/``M`` panels.

Shared by the synthetic sweeps (:mod:`studies.synthetic.sweep`) and the Fisher–Rao
sweep (:mod:`studies.fisher.sweep`), so that both draw, read and lay out their
grids the same way:

* :func:`keyed_seed` turns the key of a grid point into a seed, so that any point (or
  any run of a flow) can be redone alone;
* :func:`parse_bandwidth` reads a bandwidth spec of a configuration: a number (a fixed
  ``σ``) or ``"<rule>:<σ0>"`` with a rule of :data:`BANDWIDTH_RULES`
  (``σ = σ0 · mean ‖X_n - Y_m‖²`` for ``mean_sq``, ``σ0`` times the median heuristic
  for ``median``; paper §3.3);
* :func:`panel_points` lays out the two panels of Figs. 1 and 5: error against ``N``
  with ``M = min(N, ⌊d√N⌋)`` and error against ``M`` at a fixed ``N``.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

from kwng.kernels import GaussianKernel

__all__ = [
    "BANDWIDTH_RULES", "BandwidthSpec", "keyed_seed", "parse_bandwidth", "panel_points",
]

#: the data-driven bandwidth rules a spec may name
BANDWIDTH_RULES = ("mean_sq", "median")


def keyed_seed(*parts: Any) -> int:
    """A 31-bit seed from the key ``parts`` (CRC-32 of their ``|``-joined text)."""
    return zlib.crc32("|".join(map(str, parts)).encode()) & 0x7FFFFFFF


class BandwidthSpec(NamedTuple):
    """A parsed bandwidth spec: a ``fixed`` σ (``rule`` is ``None``) or a ``rule`` of
    :data:`BANDWIDTH_RULES` with its multiplier ``sigma0`` (``fixed`` is ``None``)."""

    fixed: float | None
    rule: str | None
    sigma0: float

    @property
    def bandwidth(self) -> float | str:
        """The ``bandwidth`` of :func:`studies.toy.batched.batched_kwng`: σ or the
        rule."""
        return self.rule if self.fixed is None else self.fixed

    def kernel(self) -> GaussianKernel:
        """The Gaussian kernel the estimators start from: bandwidth ``σ``, or ``1`` when
        a rule sets it from the samples (``bandwidth=rule, sigma0=sigma0``)."""
        return GaussianKernel(1.0 if self.fixed is None else self.fixed)


def parse_bandwidth(spec: float | str) -> BandwidthSpec:
    """``1.0`` -> fixed σ = 1; ``"mean_sq:0.5"`` -> the ``mean_sq`` rule with σ0 = 0.5;
    ``"median"`` -> the median rule with σ0 = 1. Another rule raises ``ValueError``."""
    if isinstance(spec, str):
        rule, _, s0 = spec.partition(":")
        if rule not in BANDWIDTH_RULES:
            raise ValueError("bandwidth spec must be a number or "
                             f"'<{'|'.join(BANDWIDTH_RULES)}>:<sigma0>', got {spec!r}")
        return BandwidthSpec(None, rule, float(s0 or 1.0))
    return BandwidthSpec(float(spec), None, 1.0)


def panel_points(dims, N_values, N_fixed: int, M_values) -> list[dict]:
    """The grid points ``{"panel", "d", "N", "M"}`` of the two panels, for each ``d``:
    panel ``N`` (each ``N`` of ``N_values``, ``M = min(N, ⌊d√N⌋)``), then panel ``M``
    (each ``M ≤ N_fixed`` of ``M_values`` at ``N = N_fixed``)."""
    pts = []
    for d in dims:
        for N in N_values:
            pts.append({"panel": "N", "d": d, "N": N, "M": min(N, int(d * N ** 0.5))})
        for M in M_values:
            if M <= N_fixed:
                pts.append({"panel": "M", "d": d, "N": N_fixed, "M": M})
    return pts
