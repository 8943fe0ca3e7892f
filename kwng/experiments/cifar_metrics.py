"""Per-epoch measurements of a CIFAR run: evaluation, the epoch's sums and the share of
each update on the last layer (book chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import GPUAugmentedData
from .cifar_methods import INFO_KEYS


@torch.no_grad()
def evaluate(model: nn.Module, data: GPUAugmentedData, batch_size: int = 1000,
             num_classes: int | None = None
             ) -> tuple[float, float] | tuple[float, float, list[float]]:
    """Mean cross-entropy of ``model``'s outputs and accuracy of their arg-max on
    ``data`` (eval mode, no augmentation; ``U`` is inside the model). With
    ``num_classes``, also the accuracy on the examples of each class (NaN for a class
    without examples)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    was = model.training
    model.eval()
    loss_sum = torch.zeros((), device=data.device, dtype=torch.float64)
    k = num_classes or 1
    hits = torch.zeros(k, device=data.device, dtype=torch.long)
    count = torch.zeros(k, device=data.device, dtype=torch.long)
    for z, y in data.eval_batches(batch_size):
        out = model(z)
        loss_sum += F.cross_entropy(out, y, reduction="sum").double()
        ok = (out.argmax(1) == y).long()
        cls = y if num_classes else torch.zeros_like(y)
        hits.index_add_(0, cls, ok)
        count.index_add_(0, cls, torch.ones_like(ok))
    model.train(was)
    loss, acc = float(loss_sum) / len(data), float(hits.sum()) / len(data)
    if not num_classes:
        return loss, acc
    per = (hits.double() / count.double()).tolist()  # 0/0 -> nan
    return loss, acc, per


class EpochStats:
    """Sums over the steps of one epoch, kept on the device (one host sync when the
    epoch ends): training loss and accuracy, the share of each update's squared norm on
    the last layer, and the epoch mean (over finite values) and last value of the KWNG
    diagnostics of :data:`~kwng.experiments.cifar_methods.INFO_KEYS`."""

    _STATE = ("loss_sum", "correct", "share_sum", "seen", "steps", "info_sum", "info_n",
              "info_last")

    def __init__(self, device: torch.device) -> None:
        def z(dt=torch.float64):
            return torch.zeros((), device=device, dtype=dt)

        self.device = device
        self.loss_sum, self.correct, self.share_sum = z(), z(torch.long), z()
        self.seen, self.steps = 0, 0
        self.info_sum: dict[str, torch.Tensor] = {}
        self.info_n: dict[str, torch.Tensor] = {}
        self.info_last: dict[str, torch.Tensor] = {}

    def add_step(self, loss: torch.Tensor, outputs: torch.Tensor, yb: torch.Tensor,
                 share: torch.Tensor) -> None:
        """One step's loss, outputs, labels and last-layer share (no host sync)."""
        self.loss_sum += loss.detach().double() * len(yb)
        self.correct += (outputs.detach().argmax(1) == yb).sum()
        self.share_sum += share
        self.seen += len(yb)
        self.steps += 1

    def add_info(self, info: dict) -> None:
        for k in INFO_KEYS:
            v = info.get(k)
            if v is None:
                continue
            v = torch.as_tensor(v, device=self.device).detach().to(torch.float64)
            v = v.reshape(())
            fin = torch.isfinite(v)
            self.info_sum[k] = (self.info_sum.get(k, 0)
                                + torch.where(fin, v, torch.zeros_like(v)))
            self.info_n[k] = self.info_n.get(k, 0) + fin.long()
            self.info_last[k] = v

    def row(self) -> dict[str, Any]:
        out = {"train_loss": float(self.loss_sum) / max(self.seen, 1),
               "train_acc": float(self.correct) / max(self.seen, 1),
               "last_layer_update_share": float(self.share_sum) / max(self.steps, 1)}
        for k in self.info_sum:
            n = int(self.info_n[k])
            out[f"{k}_mean"] = float(self.info_sum[k]) / n if n else float("nan")
            out[f"{k}_last"] = float(self.info_last[k])
        return out

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        def dev(v):
            return v.to(self.device) if isinstance(v, torch.Tensor) else v

        for k, v in state.items():
            setattr(self, k, {kk: dev(vv) for kk, vv in v.items()}
                    if isinstance(v, dict) else dev(v))


class UpdateShare:
    """Per step, ``‖Δθ_last‖² / ‖Δθ‖²``: the share of the update's squared norm on the
    last layer (``Δθ`` = the parameters after the step minus before; multi-tensor ops,
    no sync)."""

    def __init__(self, model: nn.Module) -> None:
        from ..nets import last_linear

        last = {id(p) for p in last_linear(model).parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = [p.detach() for p in params]
        # once: no copy per step
        self.mask = torch.tensor([id(p) in last for p in params],
                                 device=params[0].device)
        self.snap = [p.clone() for p in self.params]

    def before(self) -> None:
        torch._foreach_copy_(self.snap, self.params)

    def after(self) -> torch.Tensor:
        torch._foreach_sub_(self.snap, self.params)
        sq = torch.stack(torch._foreach_norm(self.snap)).double() ** 2
        total = sq.sum()
        # no boolean indexing: no sync
        last = torch.where(self.mask, sq, torch.zeros_like(sq)).sum()
        return torch.where(total > 0, last / total.clamp(min=1e-300),
                           torch.zeros_like(total))
