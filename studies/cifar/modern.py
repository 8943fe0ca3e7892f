"""Today's preconditioned optimizers for the CIFAR study, from maintained libraries
(book chapter :ref:`cifar-fig3`): Muon (``torch.optim.Muon``, wrapped by
:class:`MuonAdamW`), SOAP and Shampoo (``pytorch-optimizer``, the version pinned in
``requirements.txt``; the comparison that chose it:
``studies/fig3/modern_optimizers.md``).

Every optimizer here takes one step size ``lr`` (the Fig. 3 grid's) and otherwise its
library's documented defaults; the builders take ``(model, lr, spec)`` like the other
entries of :data:`studies.cifar.methods.OPTIMIZERS`. The training step is the plain
``torch.optim`` one (:class:`studies.cifar.steps.MethodStep`: the gradient clipped to
norm 1, then ``optimizer.step()``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from studies.cifar.nets import last_linear

__all__ = ["MuonAdamW", "muon_groups", "as_matrix", "muon_adamw", "soap", "shampoo"]


def muon_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, rest)``: the hidden weights Muon updates (every conv kernel and
    every ``nn.Linear`` weight but the output layer's,
    :func:`~studies.cifar.nets.last_linear`) and every other parameter (biases,
    BatchNorm, the output layer), for AdamW."""
    head = last_linear(model).weight
    matrices, rest = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (matrices if p.dim() >= 2 and p is not head else rest).append(p)
    return matrices, rest


def as_matrix(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` as an (out, in·k·k) matrix, a view of ``t`` where its memory allows.

    The columns come in the memory order of ``like`` (default ``t``): (in, k, k) for a
    contiguous kernel, (k, k, in) for a channels-last one, so that the matrix of a
    parameter is a view of it. Muon's update does not depend on the order of the
    columns: Newton–Schulz multiplies ``X`` on the left by polynomials in ``X Xᵀ``,
    which a permutation of the columns leaves unchanged."""
    like = t if like is None else like
    if t.dim() == 2:
        return t
    if t.dim() == 4 and not like.is_contiguous() and like.is_contiguous(
            memory_format=torch.channels_last):
        t = t.permute(0, 2, 3, 1)
    return t.reshape(t.shape[0], -1)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden weight matrices, AdamW on the rest: the recipe of Muon's
    authors (Jordan et al. 2024, "Muon: an optimizer for hidden layers"), from
    ``torch.optim.Muon`` and ``torch.optim.AdamW``.

    * **Muon** updates every conv kernel, as the (out, in·k·k) matrix
      :func:`as_matrix` views it (``torch.optim.Muon`` takes 2-D parameters only: it
      updates the view, and so the kernel in place), and every hidden ``nn.Linear``
      weight: momentum 0.95 with Nesterov, the update orthogonalised by 5
      Newton–Schulz steps, decoupled weight decay 0.1 (``torch.optim.Muon``'s
      defaults), its step scaled by ``adjust_lr_fn="match_rms_adamw"`` (``0.2 ·
      √max(A, B)``, Moonshot's rule, which gives the update AdamW's RMS so that one
      ``lr`` serves both groups: the grid has one step size per method).
    * **AdamW** (``torch.optim.AdamW``'s defaults: betas (0.9, 0.999), eps 1e-8,
      weight decay 0.01; ``capturable`` on CUDA, as the study's Adam) updates the
      biases, the BatchNorm scales and shifts, and the output layer (the network's
      last ``nn.Linear``). Muon's authors keep classifier heads out of Muon; here the
      head is the layer whose outputs the ill-conditioned ``U`` scales (it has no
      parameters), so its weight gradient has its rows scaled by ``U``'s entries and
      AdamW's per-coordinate normalisation sees that as Adam does; every hidden
      layer's gradient passes through ``U`` too, and Muon discards its singular
      values.

    ``param_groups`` are the two optimizers' groups (Muon's first), so a scheduler's
    change of ``lr`` reaches both; ``state_dict`` holds both optimizers' states.
    """

    def __init__(self, model: nn.Module, lr: float) -> None:
        matrices, rest = muon_groups(model)
        if not matrices:
            raise ValueError("model has no hidden weight matrix for Muon")
        self._pairs = [(p, as_matrix(p.detach())) for p in matrices]
        cuda = next(model.parameters()).device.type == "cuda"
        self.muon = torch.optim.Muon([v for _, v in self._pairs], lr=lr,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, capturable=cuda)
        super().__init__([{"params": matrices}, {"params": rest}], {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    def __repr__(self) -> str:
        return (f"MuonAdamW(lr={self.param_groups[0]['lr']}, "
                f"muon={len(self._pairs)} matrices, "
                f"adamw={len(self.adamw.param_groups[0]['params'])} tensors)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, v in self._pairs:
            v.grad = None
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.adamw.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for p, v in self._pairs:
            if v.data_ptr() != p.data_ptr():
                raise RuntimeError("a parameter moved after MuonAdamW was built (e.g. "
                                   "model.to(...)): build the optimizer last")
            v.grad = None if p.grad is None else as_matrix(p.grad, like=p)
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("state must be a MuonAdamW state_dict ('muon', 'adamw'), "
                             f"got keys {sorted(state_dict)}")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def muon_adamw(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    """:class:`MuonAdamW` at step ``lr`` (the method ``muon``)."""
    return MuonAdamW(model, lr)


def _pytorch_optimizer():
    try:
        import pytorch_optimizer
    except ImportError as exc:
        raise ImportError("SOAP and Shampoo need pytorch-optimizer (requirements.txt; "
                          "on a GPU machine without network, the wheel carried in .whl/"
                          ": studies/fig3/README.md)") from exc
    return pytorch_optimizer


def soap(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    """SOAP (Vyas et al. 2024: Adam in the eigenbasis of Shampoo's preconditioners)
    from ``pytorch-optimizer`` at its defaults: betas (0.95, 0.95), the statistics'
    decay β₂, eigenbasis refreshed every 10 steps, eps 1e-8, decoupled weight decay
    0.01, dimensions up to 10,000 preconditioned, 1-D parameters in Adam's basis. A conv
    kernel has one preconditioner per dimension (``merge_dims`` off, the default)."""
    return _pytorch_optimizer().SOAP(model.parameters(), lr=lr)


def shampoo(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    """Shampoo (Gupta, Koren and Singer 2018) from ``pytorch-optimizer`` at its
    defaults: per dimension of a tensor of order k the statistics
    ``Σ_t G_(i) G_(i)ᵀ`` from ``ε I`` (``matrix_eps`` 1e-6) and their inverse
    ``2k``-th root (4th for a matrix, 8th for a conv kernel) recomputed every step, no
    momentum, no weight decay."""
    return _pytorch_optimizer().Shampoo(model.parameters(), lr=lr)
