"""KFAC's factor pass on ``nn.Linear`` layers that act on token sequences (the ViT of
:mod:`studies.cifar.vit`): every token row counts as a row of the layer's input.

nngeometry 0.4 computes a ``Linear`` layer's Kronecker factors from the input ``x`` and
output gradient ``g`` its hooks see, assuming both are ``(examples, features)``
matrices: ``A += xᵀx`` (with a column of ones for the bias), ``G += gᵀg``. A ViT's
projections and MLPs see ``(N, T, D)`` tensors (``T`` tokens per image), which those
hooks refuse. :func:`token_rows` lets them run: while it is active each ``Linear`` of
``modules`` is called on ``x.reshape(-1, D)`` and its output is reshaped back, so the
hooks (which fire inside the call) see ``N·T`` rows and the rest of the network sees
the usual shapes. The function computed is the same (``F.linear`` flattens the leading
dimensions itself); only the hooks' view of it changes. The model is left exactly as
it was on exit: the swap is of each layer's class (a subclass of its own class, named
like it, since nngeometry dispatches on the class name), for the pass only, so the
KWNG engine, parameter names and checkpoints never see it.

**What the factors are.** Summing ``x xᵀ`` and ``g gᵀ`` over all ``N·T`` rows treats
every token as an example of its own and drops the products between different tokens of
one image. That is the *KFAC-expand* approximation of Eschenhagen et al. (NeurIPS 2023,
"Kronecker-Factored Approximate Curvature for Modern Neural Network Architectures"),
which they derive for layers whose weights are shared over a sequence dimension
when the loss has a term per position (it is exact for deep linear networks there). A
classifier that reads one token, as here, is their other ("reduce") setting, where
expand is one of two approximations; in their ViT experiments the two trained about
equally well. Their normalisation, as in the reference code of their co-authors
(curvlinops): ``A = (1/(N·T)) Σ_{n,t} a aᵀ`` and ``G = (1/N) Σ_{n,t} g gᵀ``, with
``g`` the gradient of one example's log-likelihood with respect to the token's output.

nngeometry divides both factors by the number of examples ``N`` of its loader and by
nothing else (with one sampled label its ``n_output`` factors are 1), so on token rows
it returns ``A = (1/N) Σ a aᵀ = T · A_expand`` and ``G = (1/N) Σ g gᵀ = G_expand``: its
Kronecker product is ``T`` times KFAC-expand's. For a convolution it divides ``G`` by
the number of locations instead (``kfac_gg``), so its product there is the KFC /
KFAC-expand one. A constant factor matters under KFAC's π-corrected Tikhonov damping
(``A + π√λ I``, ``G + √λ/π I``, ``π² = (tr A/dim A)/(tr G/dim G)``): moving a factor
``c`` from ``G`` to ``A`` changes nothing (``π`` becomes ``cπ``, the damped factors
``c·`` and ``1/c·`` the old ones), but scaling the product by ``c`` gives ``1/c`` times
the direction of the unscaled product at damping ``λ/c``. Left as nngeometry returns
them, the ViT's token layers would get a ``T`` (65) times weaker damping and a ``T``
times shorter step than the head and the patch embedding. :func:`expand_scale` divides
each such layer's ``G`` by its ``T``, as nngeometry does for convolutions: the product
is then KFAC-expand's, with the damping of the module :mod:`studies.cifar.baselines`.
EKFAC takes only the eigenvectors from this pass (a scale does not change them): its
scalings are re-estimated from the per-image gradients, summed over the tokens, on
every refresh step (:mod:`studies.cifar.ekfac_factors`), so its pass is not rescaled.

**Which parameters of the ViT are preconditioned.** The layer collection of
:class:`~studies.cifar.baselines.KFACPreconditioner` holds the ``Conv2d`` and
``Linear`` layers: the patch embedding, each block's ``attn.qkv``, ``attn.proj``,
``mlp.0`` and ``mlp.2``, and the head (on the class token: one row per image, left as
it is). The layer norms, the class token and the position embedding are neither, so
they keep their plain gradient, clipped jointly with the KFAC directions: plain SGD
(the ``kfac`` and ``ekfac`` methods train without momentum).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["expand_scale", "token_rows"]

_ROW_CLASSES: dict[type, type] = {}


class _TokenRows:
    """Mixin of the swapped ``Linear`` classes: a call on ``(N, ..., D)`` runs the
    layer (and its hooks) on the ``(N·..., D)`` rows and reshapes the output back,
    recording the rows per example in the active pass's log."""

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() <= 2:
            out = super().__call__(x, *args, **kwargs)
            rows = 1
        else:
            lead = x.shape[:-1]
            out = super().__call__(x.reshape(-1, x.shape[-1]), *args, **kwargs)
            out = out.reshape(*lead, out.shape[-1])
            rows = math.prod(x.shape[1:-1])
        log, name = self.__dict__["_token_rows_log"]
        log[name] = rows
        return out


def _row_class(cls: type) -> type:
    """The swapped class of ``cls`` (cached): named like it, since nngeometry's hooks
    dispatch on ``mod.__class__.__name__``."""
    if cls not in _ROW_CLASSES:
        _ROW_CLASSES[cls] = type(cls.__name__, (_TokenRows, cls),
                                 {"__module__": __name__})
    return _ROW_CLASSES[cls]


@contextlib.contextmanager
def token_rows(modules: Mapping[str, nn.Module]) -> Iterator[dict[str, int]]:
    """Inside the block each ``nn.Linear`` of ``modules`` (layer name -> module) runs
    on its input's rows (``x.reshape(-1, D)``), the output reshaped back; other modules
    are left alone. Yields a dict that each call fills with layer name -> rows per
    example (``T`` for a ``(N, T, D)`` input, 1 for a matrix). Every layer gets its own
    class back on exit, also after an error."""
    if not isinstance(modules, Mapping) or not all(
            isinstance(m, nn.Module) for m in modules.values()):
        raise ValueError("modules must map layer names to nn.Module layers, got "
                         f"{modules!r:.200}")
    log: dict[str, int] = {}
    swapped = []
    try:
        for name, mod in modules.items():
            if isinstance(mod, nn.Linear) and not isinstance(mod, _TokenRows):
                old = type(mod)
                mod.__class__ = _row_class(old)
                mod.__dict__["_token_rows_log"] = (log, name)
                swapped.append((mod, old))
        yield log
    finally:
        for mod, old in swapped:
            mod.__class__ = old
            del mod.__dict__["_token_rows_log"]


def expand_scale(data: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 rows: Mapping[str, int]) -> None:
    """Divide in place the ``G`` of every layer of ``data`` (nngeometry's
    ``PMatKFAC.data``: layer name -> ``(A, G)``) by its rows per example in ``rows``
    (from :func:`token_rows`; a layer missing there, or with 1 row, is left as it is):
    KFAC-expand's normalisation of the factors' product (module docstring)."""
    if not isinstance(data, Mapping) or not all(
            isinstance(v, (tuple, list)) and len(v) == 2 for v in data.values()):
        raise ValueError("data must map each layer name to a pair (A, G), got "
                         f"{data!r:.200}")
    if not isinstance(rows, Mapping) or not all(
            isinstance(r, int) and r >= 1 for r in rows.values()):
        raise ValueError("rows must map layer names to positive ints, got "
                         f"{rows!r:.200}")
    for name, (_, g) in data.items():
        if rows.get(name, 1) > 1:
            g.div_(rows[name])
