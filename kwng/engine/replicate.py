"""One backward pass for ``M + 1`` cotangents: the replicated-batch engine of the
preconditioner.

A KWNG step needs the Euclidean gradient ``g = ∇_θ L`` and the ``M`` rows
``T_m = Σ_n (C_{m,n}/N)ᵀ ∂X_n/∂θ`` of Prop. 5: ``R = M + 1`` vector–Jacobian products of
the same network at the same batch. Serial backward passes (``mode="reference"``) launch
``R`` small backward passes; a ``vmap`` over the backward relays out every activation.
This module does it as **one** backward pass of an ``R·N`` batch:

* the model's forward (train mode, grad enabled) runs on the input repeated ``R`` times,
  so every activation has ``R`` identical copies stacked along the batch dimension;
* each ``Conv2d``/``Linear`` (its class swapped for a subclass that knows the engine)
  computes its output on the first copy only and repeats it (the copies are identical,
  so the forward costs one batch of matrix work, not ``R``);
* each ``BatchNorm`` normalises with the statistics of one copy (exactly the statistics
  the un-replicated model sees, so ``X`` and the running averages are the model's own)
  and, in the backward pass, reduces over each copy separately — batch norm couples the
  samples of a copy, never two copies;
* the backward pass receives the stacked cotangent ``(∂L/∂X, C_1/N, …, C_M/N)`` and
  every layer propagates all ``R·N`` signals at once; the weight gradient of copy ``r``
  is formed from the layer's input (one copy) and copy ``r``'s output gradient. On the
  GPU a convolution does this in one call, with the copies' output gradients stacked
  along the output channels; elsewhere in ``R`` calls on slices of the output gradient.

On the GPU the passes that eager PyTorch operations would spread over many kernels run
compiled (``torch.compile``): the ``R``-fold repeat of an activation and the relayout
for the stacked weight gradients; the per-copy batch-norm backward (two passes over the
``R``-fold gradient instead of seven) is a Triton kernel (:mod:`kwng.engine.gpu_paths`).
A batch norm that follows a convolution writes its input gradient in both layouts, so
that convolution needs no relayout (handed over through ``_State.handoff``, checked by
memory, shape, strides and version: a gradient that autograd summed from several
consumers is relaid instead).

Memory format: the replicated pass keeps the model's. On the GPU make a convolutional
model and its inputs channels_last (``model.to(memory_format=torch.channels_last)``):
cuDNN runs fp32 convolutions of NCHW tensors with channels_last kernels and converts the
tensors around each call (the NCHW and channels_last rows of the record
``results/benchmarks/step_cost.json``).
A step on the paper's ResNet-18 costs about one forward and backward pass at batch
``R·N`` (``python -m studies.bench.step_cost``; the deep-learning chapter gives
the table).

Copy ``0`` gives ``g`` (also returned to autograd, so a plain ``loss.backward()`` on a
replicated forward still leaves the true gradient in ``p.grad``), copies ``1..M`` give
``T``. Everything is exact: the test-suite compares it with serial
``torch.autograd.grad`` calls.

Supported: every trainable parameter must be the ``weight``/``bias`` of a ``Conv2d``
(``groups = 1``, zero padding), ``Linear``, ``BatchNorm1d/2d`` or ``LayerNorm``
(:mod:`kwng.engine.replicate_norms`: normalised on one copy, γ and β per copy), or the
``weight`` of a :class:`kwng.engine.expanded.ExpandedParameter` (a tensor shared by
every sample, such as a transformer's class token or position embedding); the exact
types, not subclasses. Other modules (ReLU, GELU, pooling, residual additions,
``F.scaled_dot_product_attention``, any parameter-free function of each sample) run
unchanged at batch ``R·N``: a transformer whose attention projects with ``nn.Linear``
layers is batched whole (``nn.MultiheadAttention``, whose input projection is a bare
parameter, is not). Dropout in training mode would draw different masks per copy and is
refused. :func:`unsupported_reason` names the modules that keep a model off the engine;
the preconditioner then warns (``UserWarning``) and falls back to serial passes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kwng.engine.expanded import ExpandedParameter, _Expand
from kwng.engine.replicate_bn import _BatchNorm
from kwng.engine.replicate_layers import _Conv, _Linear, _State
from kwng.engine.replicate_norms import _LayerNorm

__all__ = ["ReplicatedEngine", "disabled_engine", "unsupported_reason"]


def unsupported_reason(model: nn.Module, params: list[torch.Tensor]) -> str | None:
    """``None`` if every parameter of ``params`` lives in a layer the engine batches,
    else why not (every module that holds such a parameter is named)."""
    taken = [name or "model" for name, mod in model.named_modules()
             if isinstance(mod, _Swapped)]
    if taken:
        return (
            f"the model already carries a KWNG preconditioner's engine (layer "
            f"{taken[0]} is patched): one fast-mode preconditioner per model; call "
            "remove_hooks() on the old one first"
        )
    wanted = {id(p) for p in params}
    owned: set[int] = set()
    foreign, bad_conv = [], []
    for name, mod in model.named_modules():
        own = [p for p in mod.parameters(recurse=False) if id(p) in wanted]
        if type(mod) not in _SWAP:
            if own:
                foreign.append(f"{name or 'model'} ({type(mod).__name__})")
            continue
        if isinstance(mod, nn.Conv2d) and (
            mod.groups != 1
            or mod.padding_mode != "zeros"
            or isinstance(mod.padding, str)
        ):
            bad_conv.append(
                f"{name} (Conv2d with groups={mod.groups}, "
                f"padding_mode={mod.padding_mode!r}, padding={mod.padding!r})"
            )
        owned.update(id(p) for p in own)
    if foreign:
        return (
            "parameters of " + ", ".join(foreign) + " (the engine batches the exact "
            f"types {SUPPORTED}; a tensor used directly in forward goes into a "
            "kwng.engine.expanded.ExpandedParameter)"
        )
    if bad_conv:
        return ", ".join(bad_conv) + " (the engine takes groups=1 and numeric zero "\
            "padding)"
    if wanted - owned:
        return f"a trainable parameter that none of {SUPPORTED} owns"
    return None


class ReplicatedEngine:
    """Patch ``model`` so that a training forward runs on ``R`` copies of the batch.

    Use: ``engine = ReplicatedEngine(model, copies)`` (``gpu_solve``: that of
    :class:`kwng.KWNGConfig`); while ``engine.enabled``, a
    forward call of ``model`` in train mode with grad enabled runs replicated and
    returns the first copy's output ``X`` (a view of the ``(R·N, d)`` output
    ``outputs``). :meth:`backward` then takes the ``(R·N, d)`` stacked cotangent and
    returns ``{id(p): (R, *p.shape)}``. :meth:`remove` restores the model's own forward
    methods. The ``R``-fold activations keep the model's memory format (see the module
    docstring).
    """

    def __init__(self, model: nn.Module, copies: int,
                 output_fn: Callable[[Any], torch.Tensor] | None = None,
                 gpu_solve: str = "auto") -> None:
        self.model = model
        self.output_fn = output_fn
        self.state = _State(copies=copies, gpu_solve=gpu_solve)
        self.outputs: torch.Tensor | None = None
        self.first: torch.Tensor | None = None
        self.enabled = True
        self._patched: list[nn.Module] = []
        for mod in model.modules():
            if type(mod) in _SWAP:
                mod.__class__ = _SWAP[type(mod)]
                mod._kwng_state = self.state
                self._patched.append(mod)
        # found once, not in every forward (every dropout kind: Dropout, Dropout2d, ...)
        self._dropouts = [
            m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
        ]
        self._pre = model.register_forward_pre_hook(self._pre_hook)
        self._post = model.register_forward_hook(self._post_hook)

    def _pre_hook(self, module: nn.Module, args: tuple):
        st = self.state
        st.active = bool(
            self.enabled
            and module.training
            and torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
        )
        if not st.active:
            return None
        for m in self._dropouts:
            if m.training and m.p > 0:
                raise ValueError(
                    f"{type(m).__name__}(p={m.p}) in training mode: the replicated "
                    "KWNG forward would draw a different mask per copy; "
                    "use mode='reference' or p=0"
                )
        st.batch = args[0].shape[0]
        R = st.copies
        new = tuple(
            a.repeat((R,) + (1,) * (a.dim() - 1))
            if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == st.batch
            else a
            for a in args
        )
        if (
            args[0].dim() == 4
            and args[0].is_contiguous(memory_format=torch.channels_last)
            and not args[0].is_contiguous()
        ):
            new = (new[0].contiguous(memory_format=torch.channels_last),) + new[1:]
        return new

    def _post_hook(self, module: nn.Module, args: tuple, output: Any):
        st = self.state
        if not st.active:
            return None
        st.active = False
        rows = st.copies * st.batch
        if not isinstance(output, torch.Tensor) and self.output_fn is None:
            raise ValueError(
                f"the model returned a {type(output).__name__}, not one (batch, d) "
                "tensor: pass output_fn= to the preconditioner, the function that "
                "picks the samples from the model's output (e.g. lambda out: out[0] "
                "for (logits, aux), lambda out: out['logits'] for a dict)")
        full = output if self.output_fn is None else self.output_fn(output)
        if not isinstance(full, torch.Tensor) or full.dim() < 1 \
                or full.shape[0] != rows:
            raise ValueError(
                "output_fn must return the model's (batch, d) samples as a tensor, "
                f"got {type(full).__name__}")
        first = _first_copy(output, rows, st.batch)
        self.outputs = full
        self.first = first if self.output_fn is None else self.output_fn(first)
        return first

    def __deepcopy__(self, memo: dict) -> ReplicatedEngine:
        """A deep copy of the model (hooks included) gets a disabled engine: its hooks
        do nothing."""
        new = memo[id(self)] = disabled_engine()
        return new

    def __reduce__(self) -> tuple:
        """A pickled model (``torch.save(model)``) carries a disabled engine: the
        loaded model runs its own forward, on one copy of the batch."""
        return (disabled_engine, ())

    def backward(
        self, cotangent: torch.Tensor, params: list[torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """One backward pass of the stacked ``(R·N, d)`` cotangent; per-copy parameter
        gradients."""
        st = self.state
        st.grads, st.handoff = {}, {}
        Xs = self.outputs
        if Xs is None:
            raise ValueError(
                "no replicated forward to differentiate: "
                "call the model (train mode) first"
            )
        self.outputs = self.first = None
        try:
            torch.autograd.grad(Xs, params, cotangent.to(Xs.dtype), allow_unused=True)
        finally:
            st.handoff = {}  # layouts no convolution took (a gradient summed first)
        return st.grads

    def owned(self) -> set[int]:
        """``id`` of every parameter of a patched layer (the ones :meth:`backward`
        returns gradients for)."""
        return {id(p) for mod in self._patched for p in mod.parameters(recurse=False)}

    def remove(self) -> None:
        """Give the layers their own classes back and remove the hooks."""
        for mod in self._patched:
            mod.__class__ = _ORIGINAL[type(mod)]
            del mod._kwng_state
        self._patched = []
        self._pre.remove()
        self._post.remove()


def _first_copy(output: Any, rows: int, batch: int) -> Any:
    """``output`` with every tensor of ``rows`` rows cut to its first ``batch`` (the
    first copy), through tuples, lists and dicts (a dict keeps its class, e.g. a
    Hugging Face ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output[:batch] if output.dim() > 0 and output.shape[0] == rows \
            else output
    if isinstance(output, dict):
        out = copy.copy(output)
        for k in output:
            out[k] = _first_copy(output[k], rows, batch)
        return out
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(_first_copy(v, rows, batch) for v in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_first_copy(v, rows, batch) for v in output)
    return output


def disabled_engine() -> ReplicatedEngine:
    """An engine whose hooks do nothing (what a copied or pickled model carries)."""
    new = object.__new__(ReplicatedEngine)
    new.model, new.state, new.outputs, new.first = None, _State(), None, None
    new.enabled, new._patched, new._pre, new._post = False, [], None, None
    new.output_fn = None
    new._dropouts = []
    return new


class _Swapped:
    """Mixin of the swapped layer classes: the replicated computation while the engine's
    forward is active, the layer's own otherwise; a deep copy or a pickled copy is a
    plain layer of the original class."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        state = {k: v for k, v in self.__dict__.items() if k != "_kwng_state"}
        return (_new_layer, (_ORIGINAL[type(self)],), state)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        cls = _ORIGINAL[type(self)]
        new = cls.__new__(cls)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_kwng_state":
                new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = _active(self, x)
        return super().forward(x) if st is None else self._replicated(x, st)


def _new_layer(cls: type) -> nn.Module:
    """An empty layer of class ``cls`` (its state follows in the pickle)."""
    return cls.__new__(cls)


def _active(mod: nn.Module, x: torch.Tensor) -> _State | None:
    st = mod._kwng_state
    return st if st.active and x.shape[0] == st.copies * st.batch else None


class _RConv2d(_Swapped, nn.Conv2d):
    """``Conv2d`` that runs replicated while its engine's forward is active (same state,
    same class otherwise: ``isinstance`` checks, ``state_dict`` and ``deepcopy`` see a
    ``Conv2d``)."""

    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _Conv.apply(x, self.weight, self.bias, self, st)


class _RLinear(_Swapped, nn.Linear):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias, st)


class _RBatchNorm1d(_Swapped, nn.BatchNorm1d):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _BatchNorm.apply(x, self.weight, self.bias, self, st)


class _RBatchNorm2d(_Swapped, nn.BatchNorm2d):
    _replicated = _RBatchNorm1d._replicated


class _RLayerNorm(_Swapped, nn.LayerNorm):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _LayerNorm.apply(x, self.weight, self.bias, self, st)


class _RExpandedParameter(_Swapped, ExpandedParameter):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _Expand.apply(self.weight, st)


_SWAP = {
    nn.Conv2d: _RConv2d,
    nn.Linear: _RLinear,
    nn.BatchNorm1d: _RBatchNorm1d,
    nn.BatchNorm2d: _RBatchNorm2d,
    nn.LayerNorm: _RLayerNorm,
    ExpandedParameter: _RExpandedParameter,
}
_ORIGINAL = {v: k for k, v in _SWAP.items()}
#: the layer types whose parameters the engine batches (exact types, not subclasses)
SUPPORTED = ", ".join(k.__name__ for k in _SWAP)
