"""Per-epoch measurements of a CIFAR run: evaluation, the epoch's sums and the share of
each update on the last layer (book chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from studies.cifar.images import GPUAugmentedData
from studies.cifar.methods import INFO_KEYS

log = logging.getLogger(__name__)


def full_precision(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is in a lower precision (bf16 autocast outputs), else
    ``t`` itself (float32, or float64 under the ``fp64`` precision)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"t must be a floating tensor, got {type(t).__name__}"
                         f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@torch.no_grad()
def evaluate_full(model: nn.Module, data: GPUAugmentedData, batch_size: int = 1000,
                  num_classes: int | None = None) -> dict[str, Any]:
    """Everything measured on ``data`` in one pass (eval mode, no augmentation; ``U``
    is inside the model): ``loss`` (mean cross-entropy), ``acc``, the ``confusion``
    matrix (``[true][predicted]`` counts), per class ``recall`` (the accuracy on the
    examples of that class) and ``precision`` (the share of that class among the
    examples predicted as it; ``None`` where nothing was predicted), and
    ``feature_norm``: the mean norm ``‖φ‖`` of the input of the last linear layer
    (the features the class rows ``W_k`` multiply). ``num_classes`` defaults to the
    width of the outputs."""
    from studies.cifar.nets import last_linear

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, int)
                                    or num_classes < 1):
        raise ValueError(f"num_classes must be None or an integer >= 1, "
                         f"got {num_classes!r}")
    if len(data) == 0:
        raise ValueError("data must hold at least one example")
    was = model.training
    model.eval()
    dev, k = data.device, num_classes
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
    feat_sum = torch.zeros((), device=dev, dtype=torch.float64)
    confusion = None

    def hook(_mod, inputs, _out):
        nonlocal feat_sum
        feat = full_precision(inputs[0]).flatten(1)
        feat_sum += torch.linalg.vector_norm(feat, dim=1).sum()

    handle = last_linear(model).register_forward_hook(hook)
    try:
        for z, y in data.eval_batches(batch_size):
            out = full_precision(model(z))
            if confusion is None:
                k = k or out.shape[1]
                confusion = torch.zeros(k * k, device=dev, dtype=torch.long)
            loss_sum += F.cross_entropy(out, y, reduction="sum").double()
            confusion.index_add_(0, y * k + out.argmax(1), torch.ones_like(y))
    finally:
        handle.remove()
        model.train(was)
    n = len(data)
    cm = confusion.view(k, k).double()
    diag = cm.diagonal()
    return {"loss": float(loss_sum) / n, "acc": float(diag.sum()) / n,
            "confusion": confusion.view(k, k).tolist(),
            "recall": (diag / cm.sum(1)).tolist(),      # 0/0 -> nan
            # None (JSON null) where nothing was predicted as the class
            "precision": [None if math.isnan(v) else v
                          for v in (diag / cm.sum(0)).tolist()],
            "feature_norm": float(feat_sum) / n}


def evaluate(model: nn.Module, data: GPUAugmentedData, batch_size: int = 1000,
             num_classes: int | None = None
             ) -> tuple[float, float] | tuple[float, float, list[float]]:
    """Mean cross-entropy of ``model``'s outputs and accuracy of their arg-max on
    ``data`` (:func:`evaluate_full`). With ``num_classes``, also the accuracy on the
    examples of each class (the recall; NaN for a class without examples)."""
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, int)
                                    or num_classes < 1):
        raise ValueError(f"num_classes must be None or an integer >= 1, "
                         f"got {num_classes!r}")
    res = evaluate_full(model, data, batch_size, num_classes)
    if not num_classes:
        return res["loss"], res["acc"]
    return res["loss"], res["acc"], res["recall"]


class EpochStats:
    """Sums over the steps of one epoch, kept on the device (one host sync when the
    epoch ends): training loss and accuracy, the share of each update's squared norm on
    the last layer, the movement ``Σ ‖ΔW_k‖`` of each last-layer row, and the epoch
    mean (over finite values) and last value of the KWNG diagnostics of
    :data:`~studies.cifar.methods.INFO_KEYS`.

    Every device sum is updated in place, so a training step recorded in a CUDA graph
    (:class:`studies.cifar.steps.StepRunner`) accumulates into the same
    tensors on every replay; :meth:`reset` zeroes them in place at the start of an
    epoch. The host counters (examples ``seen``, ``steps``) are advanced by
    :meth:`count`, outside any graph."""

    _STATE = ("loss_sum", "correct", "share_sum", "row_move", "seen", "steps",
              "info_sum", "info_n", "info_last", "info_keys")

    def __init__(self, device: torch.device, num_classes: int = 10) -> None:
        def z(dt=torch.float64, shape=()):
            return torch.zeros(shape, device=device, dtype=dt)

        self.device = device
        self.loss_sum, self.correct, self.share_sum = z(), z(torch.long), z()
        self.row_move = z(shape=(num_classes,))
        self.seen, self.steps = 0, 0
        self.info_sum = {k: z() for k in INFO_KEYS}
        self.info_n = {k: z(torch.long) for k in INFO_KEYS}
        self.info_last = {k: z() for k in INFO_KEYS}
        self.info_keys: list[str] = []  # the keys the method reports

    def reset(self) -> None:
        """Zero every sum in place (the start of an epoch)."""
        for t in (self.loss_sum, self.correct, self.share_sum, self.row_move,
                  *self.info_sum.values(), *self.info_n.values(),
                  *self.info_last.values()):
            t.zero_()
        self.seen, self.steps = 0, 0

    def add_step(self, loss: torch.Tensor, outputs: torch.Tensor, yb: torch.Tensor,
                 share: torch.Tensor | None, row_move: torch.Tensor | None = None
                 ) -> None:
        """One step's loss, outputs, labels, last-layer share and row movement (device
        work only, no host sync; :meth:`count` advances the host counters)."""
        self.loss_sum += loss.detach().double() * yb.shape[0]
        self.correct += (outputs.detach().argmax(1) == yb).sum()
        if share is not None:
            self.share_sum += share
        if row_move is not None:
            self.row_move += row_move

    def count(self, batch: int) -> None:
        """Advance the host counters by one step of ``batch`` examples."""
        self.seen += batch
        self.steps += 1

    def add_info(self, info: dict) -> None:
        for k in INFO_KEYS:
            v = info.get(k)
            if v is None:
                continue
            if k not in self.info_keys:
                self.info_keys.append(k)
            v = torch.as_tensor(v, device=self.device).detach().to(torch.float64)
            v = v.reshape(())
            fin = torch.isfinite(v)
            self.info_sum[k] += torch.where(fin, v, torch.zeros_like(v))
            self.info_n[k] += fin.long()
            self.info_last[k].copy_(v)

    def row(self) -> dict[str, Any]:
        out = {"train_loss": float(self.loss_sum) / max(self.seen, 1),
               "train_acc": float(self.correct) / max(self.seen, 1),
               "last_layer_update_share": float(self.share_sum) / max(self.steps, 1)}
        for k in self.info_keys:
            n = int(self.info_n[k])
            out[f"{k}_mean"] = float(self.info_sum[k]) / n if n else float("nan")
            out[f"{k}_last"] = float(self.info_last[k])
        return out

    def sum_over_ranks(self) -> None:
        """Sum the training loss, the correct predictions and the examples seen over
        the ranks of ``torch.distributed`` (each rank trained its slice of the global
        batch); the other sums are the same on every rank."""
        import torch.distributed as dist

        sums = torch.stack([self.loss_sum, self.correct.double(),
                            torch.tensor(float(self.seen), dtype=torch.float64,
                                         device=self.device)])
        dist.all_reduce(sums)
        self.loss_sum.copy_(sums[0])
        self.correct.copy_(sums[1].long())
        self.seen = int(sums[2])

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        """Copy a saved state in place (older states without ``row_move`` or
        ``info_keys`` load too)."""
        for k, v in state.items():
            cur = getattr(self, k, None)
            if isinstance(cur, torch.Tensor):
                cur.copy_(v)
            elif isinstance(cur, dict):
                for kk, vv in v.items():
                    cur[kk].copy_(torch.as_tensor(vv))
                if k == "info_sum" and "info_keys" not in state:
                    self.info_keys = [kk for kk in INFO_KEYS if kk in v]
            else:
                setattr(self, k, list(v) if k == "info_keys" else v)


class UpdateShare:
    """Per step, ``‖Δθ_last‖² / ‖Δθ‖²``: the share of the update's squared norm on the
    last layer (``Δθ`` = the parameters after the step minus before; multi-tensor ops,
    no sync), and the movement ``‖ΔW_k‖`` of each row of the last layer's weight
    (the attribute ``row_move``, set by :meth:`after`)."""

    def __init__(self, model: nn.Module) -> None:
        from studies.cifar.nets import last_linear

        weight = last_linear(model).weight
        last = {id(p) for p in last_linear(model).parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = [p.detach() for p in params]
        # once: no copy per step
        self.mask = torch.tensor([id(p) in last for p in params],
                                 device=params[0].device)
        self.snap = [p.clone() for p in self.params]
        self._w = next(i for i, p in enumerate(params) if p is weight)
        self.row_move: torch.Tensor | None = None

    def before(self) -> None:
        torch._foreach_copy_(self.snap, self.params)

    def after(self) -> torch.Tensor:
        torch._foreach_sub_(self.snap, self.params)
        self.row_move = torch.linalg.vector_norm(self.snap[self._w].double(), dim=1)
        sq = torch.stack(torch._foreach_norm(self.snap)).double() ** 2
        total = sq.sum()
        # no boolean indexing: no sync
        last = torch.where(self.mask, sq, torch.zeros_like(sq)).sum()
        return torch.where(total > 0, last / total.clamp(min=1e-300),
                           torch.zeros_like(total))


def agree_ranks(stats: EpochStats, model: nn.Module, precond, world: int,
                name: object) -> float | None:
    """With several ranks, before an epoch's evaluation: the epoch's training sums
    ``stats`` summed over the ranks, rank 0's batch-norm statistics (and the
    preconditioner's buffers) on every rank; returns how far the replicas' parameters
    differ (:func:`kwng.engine.distributed.replica_spread`, 0 when they agree, a
    warning naming the run ``name`` otherwise). ``None`` with one rank."""
    if world == 1:
        return None
    from kwng.engine.distributed import replica_spread

    stats.sum_over_ranks()
    if precond is not None:
        precond.broadcast_buffers()
    spread = replica_spread(model)
    if spread != 0.0:
        log.warning("%s: the replicas differ by %.3g (sum/sum of squares)", name,
                    spread)
    return spread
