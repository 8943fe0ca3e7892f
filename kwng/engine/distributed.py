"""KWNG data-parallel over ``torch.distributed``: every rank writes the direction that
one process would compute on the whole batch (book chapter :ref:`distributed`).

Why it is exact. The estimator of Prop. 6 sees the ``N`` samples only through

* the samples ``X`` themselves (``N × d``): the basis ``Y_m = X_{b_m}``, the bandwidth
  ``σ = σ0 · mean ‖X_n − Y_m‖²``, the matrices ``C`` (``M × N × d``), ``K`` and ``CCᵀ``;
* two means over samples: ``g = ∇_θ L = Σ_n ∇_θ ℓ_n / N`` and the rows
  ``T_m = Σ_n (C_{m,n} / N)ᵀ ∂X_n/∂θ`` (``m = 1..M``).

With the global batch split into shards of ``N_r`` samples (``N = Σ_r N_r``), rank ``r``
holds ``X^{(r)}`` and the graph from it to ``θ``. One step of
:class:`DistributedKWNG`::

    all_gather [X^{(r)}, N_r L_r, (b, i) of rank 0]  → X (N × d), the basis of rank 0,
                                                       L = Σ_r N_r L_r / N
    C, K, CCᵀ, σ from the global X                     (the same on every rank)
    g^{(r)} ← ∇_θ (N_r/N · L_r)                        (local)
    T^{(r)}_m ← (C_{m, rows of r} / N)ᵀ ∂X^{(r)}/∂θ    (local, m = 1..M)
    all_reduce [g^{(r)}; T^{(r)}]: one flat bucket of (M + 1)·q values  → g, T
    ε ← Levenberg–Marquardt on the global L;  ĝ ← Prop. 6 (T, CCᵀ, K, g, N, ε)

``L_r`` is the mean loss of rank ``r``'s shard, so ``Σ_r (N_r/N) L_r`` is the mean over
the global batch (not the mean of the ranks' means when the shards differ in size), and
the sums over ranks of ``g^{(r)}`` and ``T^{(r)}`` are the single-process ``g`` and
``T``. Every rank then solves the same ``M × M`` system from the same (bitwise)
reduced numbers and writes the same direction, so the replicas never drift apart. The
cost over one GPU: an all-gather of ``N·d + W(1 + 2M)`` numbers (tiny) and one
all-reduce of ``(M + 1)·q`` numbers after the backward pass — ``M + 1`` times the
gradient that ``DistributedDataParallel`` reduces for SGD, and not overlapped with the
backward pass.

Design choices:

* **It replaces DistributedDataParallel.** DDP reduces ``∇L`` from hooks on the
  gradient accumulation of ``loss.backward()``; the preconditioner forms ``g`` and ``T``
  with ``torch.autograd.grad`` (one replicated backward pass on the fast path) and
  reduces them together, so DDP would either reduce ``∇L`` a second time or wait for a
  reduction that never comes. Pass the bare module; like DDP, the constructor broadcasts
  the parameters and buffers of group rank 0 (``broadcast=True``).
* **Batch norm is the user's choice.** Plain ``BatchNorm`` normalises with each rank's
  shard statistics, as under DDP: the direction is then the single-process one on a
  network that normalises shard by shard (what ``tests/test_distributed.py`` checks).
  ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` normalises with the global batch's
  statistics; its backward is exact too, but the replicated engine batches the exact
  ``BatchNorm`` types only, so such a model takes the serial backward passes (logged
  once) — and ``SyncBatchNorm`` runs on GPUs only. Running statistics stay per rank
  (:meth:`DistributedKWNG.broadcast_buffers` copies rank 0's, as DDP does every
  forward).
* **The basis is rank 0's draw**, carried by the same all-gather as the samples: the
  other ranks never touch their random streams, and nothing has to keep generators in
  step.
* **Between refreshes** (``refresh_every = k > 1``,
  :class:`kwng.engine.precond.SystemCache`): every rank holds the same cached system
  (it came from the same reduced ``T``); a step that reuses it needs no all-gather and
  one all-reduce of ``q + 1`` values (``g`` and ``N_r L_r``), as DDP's gradient
  reduction; the ``(M + 1)·q`` one runs on refresh steps only.
* **Shard sizes.** ``batch_sizes`` (one integer per rank, or one for all) declares them:
  no size exchange, nothing waits for the host, so the step can be captured in a CUDA
  graph. ``None`` exchanges the sizes every step (one small all-gather read on the host)
  for loops whose last batches differ.

All collectives are issued in the same order on every rank. A rank that raises (for
example a batch that does not match ``batch_sizes``) leaves the others waiting in the
next collective until the process group's timeout; ``torchrun`` then stops the job.
At construction the ranks compare their settings and their models
(:func:`fingerprint`: the hyperparameters, the step size, the shard sizes, every
parameter's name, shape and dtype, every module's type) in one exchange, and every
rank raises naming the first difference: ranks that disagree would otherwise write
different directions, or stop in a collective whose sizes do not match.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kwng.engine.config import KWNGConfig
from kwng.engine.precond import KWNGPreconditioner
from kwng.estimator import draw_basis

__all__ = ["DistributedKWNG", "broadcast_module", "bucket_size", "check_agreement",
           "fingerprint", "replica_spread"]

log = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (same arguments); the GPU machine has 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: the largest global batch whose sample indices float32 carries exactly (2**24)
_EXACT_F32 = 1 << 24


def _group_info(group: Any) -> tuple[int, int, int]:
    """``(rank, world size, global rank of the group's rank 0)``; raises when
    ``torch.distributed`` is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("DistributedKWNG needs an initialised process group: call "
                         "torch.distributed.init_process_group(backend) first (under "
                         "torchrun: 'nccl' on GPUs, 'gloo' on CPUs)")
    src = 0 if group is None else dist.get_global_rank(group, 0)
    return dist.get_rank(group), dist.get_world_size(group), src


def broadcast_module(model: nn.Module, group: Any = None) -> None:
    """Copy the parameters and buffers of ``group``'s rank 0 into ``model`` on every
    rank (what DistributedDataParallel does at construction)."""
    _, _, src = _group_info(group)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src, group=group)


def replica_spread(model: nn.Module, group: Any = None) -> float:
    """The largest difference across ranks of ``model``'s parameters, summarised per
    tensor by the float64 sum and sum of squares (0 when the replicas agree bitwise up
    to these summaries). Two all-reduces and a host sync: for epoch ends, not steps."""
    _group_info(group)
    flat = [p.detach().double() for p in model.parameters()]
    stats = torch.stack([s for p in flat for s in (p.sum(), p.square().sum())])
    hi, lo = stats.clone(), stats.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max()) if stats.numel() else 0.0


def bucket_size(num_basis: int, q: int) -> int:
    """The number of values of the step's one all-reduce: ``(M + 1) · q`` (``M`` =
    ``num_basis``, ``q`` the trainable parameters)."""
    return (int(num_basis) + 1) * int(q)


def _check_batch_sizes(batch_sizes: int | Sequence[int] | None, world: int
                       ) -> list[int] | None:
    if batch_sizes is None:
        return None
    msg = (f"batch_sizes must be None, an integer >= 1 or {world} integers >= 1 (one "
           f"per rank), got {batch_sizes!r}")
    if isinstance(batch_sizes, bool):
        raise ValueError(msg)
    sizes = [batch_sizes] * world if isinstance(batch_sizes, int) else list(batch_sizes)
    if len(sizes) != world or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                  for n in sizes):
        raise ValueError(msg)
    return sizes


def fingerprint(precond: KWNGPreconditioner, extra: dict[str, Any] | None = None
                ) -> list[tuple[str, str]]:
    """What every rank of one job must share, as ``(key, value)`` pairs in a fixed
    order: ``precond``'s hyperparameters, its current step size and the entries of
    ``extra``; the number of trainable parameter tensors and values; each trainable
    parameter's name, shape, dtype and device type; each module's type and settings
    (``extra_repr``: the activation, the layer sizes, batch norm's ``eps``)."""
    hp = {**precond.hyperparameters(), "lr": precond._current_lr(), **(extra or {})}
    named = [(n, p) for n, p in precond.model.named_parameters() if p.requires_grad]
    out = [(k, repr(v)) for k, v in hp.items()]
    out.append(("trainable parameters", f"{len(named)} tensors, "
                f"{sum(p.numel() for _, p in named)} values"))
    out += [(f"parameter {n}", f"shape {tuple(p.shape)}, {p.dtype}, on {p.device.type}")
            for n, p in named]
    out += [(f"module {n or '(root)'}", f"{type(m).__name__}({m.extra_repr()})")
            for n, m in precond.model.named_modules()]
    return out


def _first_difference(mine: list[tuple[str, str]], other: list[tuple[str, str]]
                      ) -> tuple[str, str, str] | None:
    """``(key, value here, value there)`` of the first entry that differs, else
    ``None`` (a missing entry reads ``absent``)."""
    a, b = dict(mine), dict(other)
    keys = list(a) + [k for k in b if k not in a]
    for k in keys:
        if a.get(k, "absent") != b.get(k, "absent"):
            return k, a.get(k, "absent"), b.get(k, "absent")
    return None


def check_agreement(entries: list[tuple[str, str]], group: Any = None,
                    device: torch.device | str = "cpu") -> None:
    """All-gather ``entries`` (:func:`fingerprint`) over ``group`` and raise
    ``ValueError`` on every rank, naming the first entry in which a rank differs from
    group rank 0. Two all-gathers (the lengths, then the padded bytes) on ``device``,
    at construction only."""
    rank, world, _ = _group_info(group)
    data = torch.tensor(list(json.dumps(entries).encode()), dtype=torch.uint8,
                        device=device)
    sizes = torch.empty(world, dtype=torch.long, device=device)
    _all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    top = int(sizes.max())
    send = torch.zeros(top, dtype=torch.uint8, device=device)
    send[:data.numel()] = data
    recv = torch.empty(world * top, dtype=torch.uint8, device=device)
    _all_gather(recv, send, group=group)
    rows = recv.view(world, top).cpu()
    every = [[tuple(e) for e in json.loads(bytes(rows[r, :int(sizes[r])].tolist()))]
             for r in range(world)]
    for r in range(1, world):
        diff = _first_difference(every[0], every[r])
        if diff is not None:
            key, ref, got = diff
            raise ValueError(f"DistributedKWNG: the ranks disagree on {key}: {ref} on "
                             f"rank 0 but {got} on rank {r} (this is rank {rank}); "
                             "every rank must build the same model and preconditioner")


def _adjacent(g: torch.Tensor, T: torch.Tensor) -> torch.Tensor | None:
    """The flat ``(M + 1)·q`` view of ``[g; T]`` when ``T`` follows ``g`` in one buffer
    (as the fast path returns them), else ``None``."""
    q = g.numel()
    if (g.dtype == T.dtype and g.is_contiguous() and T.is_contiguous()
            and g.untyped_storage().data_ptr() == T.untyped_storage().data_ptr()
            and T.storage_offset() == g.storage_offset() + q):
        return g.as_strided((q * (T.shape[0] + 1),), (1,))
    return None


class DistributedKWNG(KWNGPreconditioner):
    """:class:`kwng.KWNGPreconditioner` data-parallel over ``torch.distributed``: the
    direction of the global batch on every rank (the algorithm and the design choices
    are in :mod:`kwng.engine.distributed`).

    Used like the single-process preconditioner, on each rank's shard (``loss`` the
    mean loss of the shard, ``X`` its outputs)::

        dist.init_process_group("nccl")            # under torchrun
        precond = DistributedKWNG(model, lr=0.1, num_basis=5, batch_sizes=128)
        for z, y in shard_loader:                  # this rank's samples
            opt.zero_grad()
            X = model(z)
            precond.step(F.cross_entropy(X, y), X)  # the global direction in p.grad
            opt.step()                             # the same update on every rank

    Arguments as :class:`kwng.KWNGPreconditioner`, plus ``group`` — the process group
    (``None``: the default one); ``batch_sizes`` — ``None`` (exchanged every step, a
    host sync), an integer (every rank's) or one integer per rank; ``broadcast`` — copy
    group rank 0's parameters and buffers at construction. Every rank must pass the
    same settings and an identical model (:func:`check_agreement` raises otherwise).
    ``generator`` draws the basis on rank 0 only. ``model`` must be the bare module,
    not a ``DistributedDataParallel`` wrapper (this class replaces it).
    """

    adds_prefilled_grads = False  # a rank's own p.grad would make the replicas drift

    def __init__(self, model: nn.Module, config: KWNGConfig | None = None, *,
                 group: Any = None, batch_sizes: int | Sequence[int] | None = None,
                 broadcast: bool = True, lr: float | Callable[[], float] | None = None,
                 generator: torch.Generator | None = None,
                 **hyperparameters: Any) -> None:
        self.rank, self.world_size, self._src = _group_info(group)
        self.group = group
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("model must be the bare module, not a "
                             "DistributedDataParallel wrapper: DistributedKWNG reduces "
                             "∇L itself (with T, in one all-reduce); pass model.module")
        if not isinstance(broadcast, bool):
            raise ValueError("broadcast must be a bool, got "
                             f"{type(broadcast).__name__}")
        self.batch_sizes = _check_batch_sizes(batch_sizes, self.world_size)
        if hyperparameters.get("accumulation_steps", 1) != 1:
            raise ValueError("accumulation_steps must be 1 for DistributedKWNG: split "
                             "the batch over more processes instead")
        super().__init__(model, config, lr=lr, generator=generator, **hyperparameters)
        check_agreement(fingerprint(self, {"batch_sizes": self.batch_sizes,
                                           "broadcast": broadcast}),
                        group, self.params[0].device)
        if broadcast:
            broadcast_module(model, group)
        self._rows = (0, 0, 1)  # (offset, N_r, N) of the last step

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "world_size": self.world_size}

    def __repr__(self) -> str:
        return (super().__repr__()[:-1].replace("KWNGPreconditioner", "DistributedKWNG")
                + f", rank={self.rank}, batch_sizes={self.batch_sizes})")

    def broadcast_buffers(self) -> None:
        """Copy group rank 0's buffers (batch-norm running statistics) to every rank."""
        with torch.no_grad():
            for t in self.model.buffers():
                dist.broadcast(t, self._src, group=self.group)

    # --- the hooks of the step (KWNGPreconditioner, kwng.engine.precond) -------------
    def _degenerate(self, loss: torch.Tensor, X: torch.Tensor, refresh: bool,
                    check_finite: bool) -> str | None:
        """No local check: every rank must take the same kind of step, so a
        non-finite batch is refused through the reduced ``g`` (the same on every rank,
        checked after the all-reduce), and whether a kernel system can be built is a
        property of the global batch (:meth:`_share` checks its size)."""
        return None

    def _shard_sizes(self, n: int, device: torch.device) -> list[int]:
        if self.batch_sizes is not None:
            r, want = self.rank, self.batch_sizes[self.rank]
            if n != want:
                raise ValueError(f"rank {r}'s batch has {n} samples but "
                                 f"batch_sizes[{r}] = {want}; pass batch_sizes=None "
                                 "for shards whose sizes change")
            return self.batch_sizes
        mine = torch.tensor([n], dtype=torch.long, device=device)
        out = torch.empty(self.world_size, dtype=torch.long, device=device)
        _all_gather(out, mine, group=self.group)
        return [int(v) for v in out.tolist()]  # a host sync (batch_sizes avoids it)

    def _share(self, Xk: torch.Tensor, loss: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather every rank's samples and ``N_r L_r`` with rank 0's basis, in one
        all-gather of ``W`` rows ``[X^{(r)} (padded), N_r L_r, b, i]``."""
        n, d = Xk.shape
        sizes = self._shard_sizes(n, Xk.device)
        N, top, M = sum(sizes), max(sizes) * d, self.config.num_basis
        if N < M:
            raise ValueError(f"the global batch has {N} samples but num_basis = {M}; "
                             "num_basis must be <= the global batch size")
        if Xk.dtype == torch.float32 and N > _EXACT_F32:
            raise ValueError(f"the global batch has {N} samples; at most {_EXACT_F32} "
                             "(float32 carries the basis indices exactly below that)")
        send = Xk.new_zeros(top + 1 + 2 * M)
        send[:n * d].copy_(Xk.reshape(-1))
        send[top] = loss.detach().to(Xk.dtype) * n
        if self.rank == 0:
            idx, coords = draw_basis(N, d, M, self.generator, Xk.device)
            send[top + 1:].copy_(torch.cat([idx, coords]).to(send))
        recv = Xk.new_empty(self.world_size * send.numel())  # flat: gloo wants it so
        _all_gather(recv, send, group=self.group)
        recv = recv.view(self.world_size, send.numel())
        if len(set(sizes)) == 1:
            X = recv[:, :top].reshape(N, d)
        else:
            X = torch.cat([recv[r, :s * d].view(s, d) for r, s in enumerate(sizes)])
        basis = recv[0, top + 1:].round().long()
        self._rows = (sum(sizes[:self.rank]), n, N)
        return X, basis[:M], basis[M:], recv[:, top].sum() / N

    def _gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shares ``∇(N_r/N · L_r)`` and ``(C_{rows of r} / N)ᵀ
        ∂X^{(r)}/∂θ`` (the base class divides by the local ``N_r``)."""
        off, n, N = self._rows
        w = n / N
        return super()._gradients(loss * w, X, C[:, off:off + n] * w, params)

    def _reduce(self, g: torch.Tensor, T: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``[g; T]`` over the ranks in one all-reduce of ``(M + 1)·q`` values (in
        place when the fast path returned them in one buffer, else after one copy)."""
        flat = _adjacent(g, T)
        if flat is None:
            flat = torch.cat([g[None], T]).reshape(-1)
            g, T = flat[:g.numel()], flat[g.numel():].view(T.shape)
        dist.all_reduce(flat, group=self.group)
        return g, T

    def _plain_gradient(self, loss: torch.Tensor, X: torch.Tensor,
                        params: list[torch.Tensor]) -> torch.Tensor:
        """A step between refreshes (``refresh_every > 1``): this rank's share
        ``∇(N_r/N · L_r)`` of ``g``."""
        n = X.shape[0]
        sizes = self._shard_sizes(n, X.device)
        N = sum(sizes)
        self._rows = (sum(sizes[:self.rank]), n, N)
        return super()._plain_gradient(loss * (n / N), X, params)

    def _reduce_gradient(self, g: torch.Tensor, loss: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``[g; N_r L_r]`` over the ranks in one all-reduce of ``q + 1`` values:
        the global ``g`` and the global batch's mean loss (for the ε rule)."""
        _, n, N = self._rows
        flat = torch.cat([g, (loss.detach() * n).reshape(1).to(g.dtype)])
        dist.all_reduce(flat, group=self.group)
        return flat[:-1], flat[-1] / N

    def observe_loss_after_step(self, loss_after: torch.Tensor) -> None:
        """``LMSchedule(rule="same_batch")``: this rank's shard loss after the step;
        the rule sees the global mean (one small all-reduce)."""
        if not isinstance(loss_after, torch.Tensor) or loss_after.dim() != 0:
            raise ValueError("loss_after must be a scalar tensor (the same batch's "
                             "loss after the step)")
        _, n, N = self._rows
        t = (loss_after.detach().double() * n).reshape(1)
        dist.all_reduce(t, group=self.group)
        super().observe_loss_after_step(t[0] / N)
