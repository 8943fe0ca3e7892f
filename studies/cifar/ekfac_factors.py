"""EKFAC's step in plain torch ops, from the training step's own forward, so that a
CUDA graph can replay it.

EKFAC (George et al. 2018) preconditions each ``Conv2d`` / ``Linear`` layer in the
Kronecker-factored eigenbasis (KFE) of its Monte-Carlo Fisher: the eigenvectors ``U_A``
(inputs, a bias as the last coordinate) and ``U_G`` (output gradients) of the KFAC
factors, and per-coordinate scalings ``s`` re-estimated from per-example gradients.
:class:`~studies.cifar.baselines.KFACPreconditioner` refreshes the eigenbasis
every ``update_freq`` steps through nngeometry's pass (``PMatEKFAC``, eager); the
scalings of every step and the direction are computed here:

* :class:`LayerRecorder` keeps, through forward hooks, each layer's input and output of
  the last forward that builds a graph: the training forward.
* :func:`fisher_output_grads` draws one label ``ỹᵢ`` per input from the predictive
  distribution ``softmax(logits)`` on the device and returns the gradients of
  ``Σᵢ log p(ỹᵢ | xᵢ)`` with respect to the layer outputs (``torch.autograd.grad``, the
  graph retained: the training backward that follows is unchanged). The draw is
  ``torch.multinomial``'s own for one sample, ``argmax p / E`` with ``E ~ Exp(1)`` from
  the default generator (so the same labels from the same generator state), without
  its host-side validity check, which a CUDA graph cannot record.
* :class:`EigenFactors` keeps ``(U_A, U_G, s)`` per layer in persistent buffers that a
  refresh or a load rewrites in place (nngeometry's ``PMatEKFAC.data``).
  :meth:`EigenFactors.update` writes the new scalings into them: nngeometry's
  ``get_kfe_diag``, i.e. ``s = (1/n) Σᵢ (U_Gᵀ gᵢ xᵢᵀ U_A)²`` over the ``n`` examples,
  with ``xᵢ`` the layer input (a convolution's unfolded patches, summed over the
  locations with the output gradients ``gᵢ``; a ``Linear`` layer's input on token
  sequences, summed over the tokens in the same way: the gradient of example ``i``,
  where nngeometry's ``get_kfe_diag`` would square each token's share on its own).
  :meth:`EigenFactors.apply` replaces each
  gradient ``∇W`` by ``U_G ((U_Gᵀ ∇W U_A) / (s + damping)) U_Aᵀ``: nngeometry's
  ``solvePVec(regul=damping)``, the same products in the same order. A non-finite
  direction leaves every gradient plain (a device-side choice, no host sync).

The per-example gradient ``gᵢ xᵢᵀ`` of a convolution is projected in the cheaper order:
the patches first (``U_Aᵀ xᵢ``, nngeometry's order) when a layer has no more output
locations than channels, else after the sum over the locations (the same product,
reassociated). Activations and output gradients of a bf16 forward are promoted to the
buffers' dtype first. With BatchNorm in training mode the examples of a batch interact;
``gᵢ`` is then, as in nngeometry, the ``i``-th row of the gradient of the sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from studies.cifar.kfac_factors import _store, _weight_matrix, _write_back

__all__ = ["EigenFactors", "LayerRecorder", "check_layers", "fisher_output_grads"]


def check_layers(modules: Mapping[str, nn.Module]) -> None:
    """Raise unless every module is a ``Linear`` or a ``Conv2d`` with one group and
    numeric zero padding (the layers whose patches ``F.unfold`` reproduces)."""
    for name, mod in modules.items():
        if isinstance(mod, nn.Conv2d):
            if (mod.groups != 1 or isinstance(mod.padding, str)
                    or mod.padding_mode != "zeros"):
                raise ValueError(
                    f"layer {name}: EKFAC needs Conv2d layers with groups=1 and "
                    f"numeric zero padding, got groups={mod.groups}, padding="
                    f"{mod.padding!r}, padding_mode={mod.padding_mode!r}")
        elif not isinstance(mod, nn.Linear):
            raise ValueError(f"layer {name} must be a Conv2d or a Linear, got "
                             f"{type(mod).__name__}")


class LayerRecorder:
    """Forward hooks on ``modules`` (layer name -> module) that keep each one's input
    and output of the last forward that builds a graph; :meth:`take` hands them over
    and forgets them. Forwards without a graph (evaluation) and forwards inside
    :meth:`paused` are ignored."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        check_layers(modules)
        self.saved: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._paused = False
        self.handles = [mod.register_forward_hook(self._hook(name))
                        for name, mod in modules.items()]

    def __repr__(self) -> str:
        return f"LayerRecorder(layers={len(self.handles)}, saved={len(self.saved)})"

    def _hook(self, name: str):
        def hook(mod, inputs, output):
            if not self._paused and output.requires_grad:
                self.saved[name] = (inputs[0].detach(), output, output._version)
        return hook

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside the block are not recorded (nngeometry's own passes)."""
        old, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = old

    def take(self, names) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(input, output)`` of every layer of ``names``, recorded since the last
        call; raises when one is missing or its output was modified in place since."""
        saved, self.saved = self.saved, {}
        missing = [k for k in names if k not in saved]
        if missing:
            raise ValueError(f"layers {missing} ran no forward with a graph since the "
                             "last step: EKFAC needs the training forward's")
        changed = [k for k in names if saved[k][1]._version != saved[k][2]]
        if changed:
            raise ValueError(f"the outputs of layers {changed} were modified in place "
                             "after their forward (an in-place op follows them): "
                             "EKFAC needs their gradients")
        return {k: saved[k][:2] for k in names}

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()
        self.handles, self.saved = [], {}


def fisher_output_grads(logits: torch.Tensor,
                        outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of ``Σᵢ log p(ỹᵢ | xᵢ)``, ``p = softmax(logits)`` and ``ỹᵢ`` drawn
    from ``p(· | xᵢ)`` on the device (one label per input), with respect to each tensor
    of ``outputs`` (layer name -> layer output); the graph is retained."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a (batch, classes) tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if not logits.requires_grad:
        raise ValueError("logits must be the outputs of the training forward (they "
                         "require no gradient)")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    log_p = torch.log_softmax(logits, dim=1)
    p = torch.exp(log_p.detach())
    labels = (p / torch.empty_like(p).exponential_()).argmax(dim=1, keepdim=True)
    names = list(outputs)
    grads = torch.autograd.grad(log_p.gather(1, labels).sum(),
                                [outputs[k] for k in names], retain_graph=True,
                                allow_unused=True)
    unused = [k for k, g in zip(names, grads) if g is None]
    if unused:
        raise ValueError(f"the logits do not depend on the outputs of layers {unused}: "
                         "step() needs the outputs of the forward just recorded")
    return dict(zip(names, grads))


def _square_grads(mod: nn.Module, x: torch.Tensor, gy: torch.Tensor,
                  evecs_a: torch.Tensor, evecs_g: torch.Tensor) -> torch.Tensor:
    """``Σᵢ (U_Gᵀ gᵢ xᵢᵀ U_A)²`` of one layer, an ``(out, in·k·k [+ 1])`` matrix. A
    ``Linear`` layer on token sequences (``(batch, tokens..., features)``) is treated
    as a convolution's locations: ``gᵢ xᵢᵀ`` sums over the tokens of example ``i``."""
    bias = mod.bias is not None
    x, gy = x.to(evecs_a.dtype), gy.to(evecs_a.dtype)
    if isinstance(mod, nn.Linear):
        if x.dim() < 2 or x.shape[:-1] != gy.shape[:-1]:
            raise ValueError(f"a Linear layer's input must be (batch, [tokens...,] "
                             f"features) for EKFAC, matching its output gradient "
                             f"{tuple(gy.shape)}, got shape {tuple(x.shape)}")
        if x.dim() == 2:
            if bias:
                x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
            return torch.mm(torch.mm(gy, evecs_g).t() ** 2,
                            torch.mm(x, evecs_a) ** 2)
        cols = x.reshape(x.shape[0], -1, x.shape[-1])  # (batch, tokens, in)
        gy = gy.reshape(gy.shape[0], -1, gy.shape[-1])  # (batch, tokens, out)
    else:
        cols = F.unfold(x, kernel_size=mod.kernel_size, dilation=mod.dilation,
                        padding=mod.padding, stride=mod.stride).transpose(1, 2)
        gy = gy.flatten(2).transpose(1, 2)  # (batch, locations, out)
    if bias:  # (batch, locations, in·k·k + 1)
        cols = torch.cat([cols, torch.ones_like(cols[:, :, :1])], dim=2)
    g_kfe = torch.matmul(gy, evecs_g).transpose(1, 2)
    if cols.shape[1] <= g_kfe.shape[1]:  # locations <= channels: patches first
        per_example = torch.bmm(g_kfe, torch.matmul(cols, evecs_a))
    else:
        per_example = torch.matmul(torch.bmm(g_kfe, cols), evecs_a)
    return (per_example ** 2).sum(dim=0)


class EigenFactors:
    """Persistent buffers of the Kronecker-factored eigenbasis and its scalings, one
    triple ``(U_A, U_G, s)`` per layer name (``s`` of shape ``(out, in·k·k [+ 1])``),
    the scalings' estimate and the direction."""

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"EigenFactors(layers={len(self.buffers)})"

    def store(self, data, device: torch.device | None = None) -> None:
        """Keep ``data`` = ``(evecs, diags)``, nngeometry's ``PMatEKFAC.data``
        (``evecs``: layer name -> ``(U_A, U_G)``, ``diags``: layer name -> the flat
        scalings), moved to ``device`` if given: copied into the existing buffers in
        place where shapes, dtypes and devices match, so that a recorded graph reads
        the new ones."""
        ok = (isinstance(data, (tuple, list)) and len(data) == 2
              and all(isinstance(d, Mapping) for d in data)
              and set(data[0]) == set(data[1]))
        if not ok or not all(
                isinstance(p, (tuple, list)) and len(p) == 2
                and all(isinstance(t, torch.Tensor) for t in (*p, data[1][k]))
                and data[1][k].numel() == p[0].shape[0] * p[1].shape[0]
                for k, p in data[0].items()):
            raise ValueError("data must be (evecs, diags): evecs mapping each layer "
                             "name to (U_A, U_G), diags to the scalings of the same "
                             f"layers (U_G rows x U_A rows), got {data!r:.200}")
        evecs, diags = data
        for name, (evecs_a, evecs_g) in evecs.items():
            _store(self.buffers, name, (evecs_a, evecs_g, diags[name].reshape(
                evecs_g.shape[0], evecs_a.shape[0])), device)

    def state(self) -> tuple[dict, dict]:
        """Copies of the buffers in the form of ``PMatEKFAC.data``."""
        return ({k: (a.clone(), g.clone()) for k, (a, g, _) in self.buffers.items()},
                {k: s.flatten().clone() for k, (_, _, s) in self.buffers.items()})

    def _check(self, names) -> None:
        missing = [k for k in names if k not in self.buffers]
        if missing:
            raise ValueError(f"modules must be layers with a stored eigenbasis; none "
                             f"for {missing} (run a refresh step first)")

    def update(self, modules: Mapping[str, nn.Module],
               records: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Re-estimate the scalings in place from ``records`` (layer name ->
        ``(input, output gradient)`` of every module of ``modules``): the mean over the
        batch of the squared per-example gradients in the eigenbasis."""
        self._check(modules)
        for name, mod in modules.items():
            evecs_a, evecs_g, s = self.buffers[name]
            x, gy = records[name]
            s.copy_(_square_grads(mod, x, gy, evecs_a, evecs_g) / x.shape[0])

    def apply(self, modules: Mapping[str, nn.Module],
              damping: float) -> torch.Tensor:
        """Replace the weight (and bias) gradient of every module of ``modules`` by
        ``U_G ((U_Gᵀ ∇W U_A) / (s + damping)) U_Aᵀ``, or leave every gradient plain
        when any entry of the direction is non-finite. Returns 1 in that case, else 0,
        as a 0-dim int64 device tensor (no host sync)."""
        self._check(modules)
        dirs = []
        for name, mod in modules.items():
            evecs_a, evecs_g, s = self.buffers[name]
            v_kfe = torch.mm(torch.mm(evecs_g.t(), _weight_matrix(mod)), evecs_a)
            dirs.append(torch.mm(torch.mm(evecs_g, v_kfe / (s + damping)),
                                 evecs_a.t()))
        return _write_back(modules, dirs)
