"""KFAC and EKFAC preconditioners for the CIFAR study, as thin wrappers around
nngeometry 0.4.

The paper compares KWNG with KFAC (Martens & Grosse 2015; Grosse & Martens 2016) and
EKFAC (George et al. 2018) with "a damping coefficient of 1e-3 and a frequency of
reparametrization of 100 updates" (App. D.2). nngeometry (by EKFAC's first author)
represents the Monte-Carlo Fisher of a classifier in both forms (``PMatKFAC``,
``PMatEKFAC``) but has no optimizer; :class:`KFACPreconditioner` supplies the loop:

* the Fisher is that of the model's predictive distribution ``softmax(U h_θ(z))``:
  nngeometry's ``FIM_MonteCarlo`` with ``variant="classif_logits"`` and one sampled
  label per input, evaluated on the current mini-batch, with the output transform ``U``
  (``output_fn``) included;
* only ``Conv2d`` and ``Linear`` layers are preconditioned; every other parameter
  (BatchNorm's; on the ViT the layer norms, the class token and the position
  embedding) keeps the plain gradient, clipped jointly with the directions: plain SGD
  on them, as ``kfac`` / ``ekfac`` train without momentum;
* a ``Linear`` layer applied to token sequences (the ViT's ``qkv``, ``proj`` and MLP
  layers; its patch embedding is a ``Conv2d`` and its head reads the class token)
  counts every token as a row of its factors, KFAC-expand (Eschenhagen et al. 2023),
  with ``G`` divided by the tokens per image to KFAC-expand's normalisation (nngeometry
  divides by the images only): :mod:`studies.cifar.kfac_tokens`; EKFAC's scalings use
  the per-image gradients, summed over the tokens;
* the Kronecker factors (KFAC) or the Kronecker-factored eigenbasis (EKFAC) are
  recomputed every ``update_freq`` (100) updates by nngeometry's pass; EKFAC's diagonal
  scalings are re-estimated every ``diag_freq`` steps (1: every step; between
  re-estimates the last ones are kept) with the estimator of nngeometry's
  ``PMatEKFAC.update_diag``, from the training step's own forward (labels
  sampled from its outputs, one extra backward; in a bf16 step its activations and
  gradients are bf16, promoted to fp32);
* the refresh's extra forward/backward passes run in training mode (batch statistics,
  as in the step itself) and the BatchNorm running statistics are restored afterwards,
  so evaluation sees only the training passes.

**Damping convention (``damping`` = 1e-3).** KFAC: nngeometry's
``PMatKFAC.inverse(regul=damping)``, i.e. the factored Tikhonov damping of Martens &
Grosse (2015, §6.3): ``A + π √damping I`` and ``G + √damping / π I`` with ``π² = (tr A /
dim A) / (tr G / dim G)``. EKFAC: ``(s + damping)^{-1}`` on the re-estimated eigenvalues
``s`` (``PMatEKFAC.solvePVec(regul=damping)``), as in George et al. (2018). The two are
not the same damping; the step size is selected per method anyway.

**Capture.** A step between refreshes never syncs with the host and reads the factors
from persistent buffers that each refresh updates in place; the refresh step (the
nngeometry pass) runs eagerly. KFAC applies the cached damped inverse factors with plain
torch ops (:class:`studies.cifar.kfac_factors.InverseFactors`: the same
products as nngeometry's ``PMatKFAC.mv``). EKFAC re-estimates its scalings from the
training step's own forward, with one extra backward of the log-likelihood of labels
sampled on the device, and solves in the eigenbasis with plain torch ops
(:mod:`studies.cifar.ekfac_factors`: nngeometry's ``get_kfe_diag`` and
``solvePVec``), so it needs no second forward. :attr:`KFACPreconditioner.cache` (a
:class:`~studies.cifar.kfac_factors.FactorSchedule`) tells
:class:`~studies.cifar.steps.StepRunner` which steps refresh, so the other
steps replay a CUDA graph.

Usage, in the same loop shape as :class:`kwng.engine.precond.KWNGPreconditioner`::

    precond = KFACPreconditioner(model, kind="ekfac", output_fn=U, clip_norm=1.0)
    optimizer.zero_grad(); outputs = model(z); loss = loss_fn(U(outputs), y)
    info = precond.step(loss, outputs, inputs=z)  # backward, precondition,
    optimizer.step()                              # clip, into p.grad
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from kwng._checks import check_choice, check_int, check_positive
from studies.cifar.ekfac_factors import (
    EigenFactors,
    LayerRecorder,
    fisher_output_grads,
)
from studies.cifar.kfac_factors import FactorSchedule, InverseFactors
from studies.cifar.kfac_tokens import expand_scale, token_rows

__all__ = ["KFACPreconditioner", "clip_grad_norm", "bn_state", "restore_bn_state"]

log = logging.getLogger(__name__)


def clip_grad_norm(params, clip_norm: float | None) -> torch.Tensor:
    """Scale the ``.grad`` of ``params`` so that their joint norm is at most
    ``clip_norm``; return the norm before clipping as a 0-dim tensor (no host sync).
    ``clip_norm=None``: no clipping. The same rule for every method of the study (KWNG
    clips its own direction in the same way)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    return torch.nn.utils.clip_grad_norm_(
        params, float("inf") if clip_norm is None else clip_norm, foreach=True
    )


def bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every BatchNorm buffer (running mean/var, batch counter)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for bname, buf in mod.named_buffers(recurse=False):
                if buf is not None:
                    out[f"{name}.{bname}"] = buf.detach().clone()
    return out


def restore_bn_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    buffers = dict(model.named_buffers())
    for k, v in state.items():
        buffers[k].copy_(v)


def _nngeometry():
    try:
        import nngeometry  # noqa: F401
        from nngeometry.layercollection import LayerCollection
        from nngeometry.metrics import FIM_MonteCarlo
        from nngeometry.object import PMatEKFAC, PMatKFAC
        from nngeometry.object.vector import PVector
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "KFAC/EKFAC need nngeometry 0.4: pip install --no-deps nngeometry==0.4"
        ) from exc
    return LayerCollection, FIM_MonteCarlo, PMatKFAC, PMatEKFAC, PVector


class KFACPreconditioner:
    """KFAC (``kind="kfac"``) or EKFAC (``kind="ekfac"``) natural-gradient
    preconditioning of ``p.grad``.

    Parameters: ``model``; ``kind``; ``damping`` (> 0, see the module docstring for its
    convention); ``update_freq`` (≥ 1, steps between factor / eigenbasis refreshes);
    ``diag_freq`` (≥ 1, EKFAC: steps between re-estimates of the scalings);
    ``output_fn`` (maps the network's logits to the logits of the predictive
    distribution, e.g. the fixed ``U``; identity when ``None``); ``clip_norm`` (the
    joint norm bound applied to the final update, ``None`` for none); ``device``.
    EKFAC hooks the model's Conv2d/Linear layers (their input and output of the
    training forward: :class:`~studies.cifar.ekfac_factors.LayerRecorder`).
    """

    def __init__(self, model: nn.Module, kind: str = "kfac", damping: float = 1e-3,
                 update_freq: int = 100, diag_freq: int = 1,
                 output_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 clip_norm: float | None = 1.0, device: str | torch.device | None = None
                 ) -> None:
        self.kind = check_choice(kind, "kind", ("kfac", "ekfac"))
        self.damping = check_positive(damping, "damping")
        self.update_freq = check_int(update_freq, "update_freq", 1)
        self.diag_freq = check_int(diag_freq, "diag_freq", 1)
        self.clip_norm = (
            None if clip_norm is None else check_positive(clip_norm, "clip_norm")
        )
        self.model = model
        self.output_fn = output_fn
        self.device = (
            torch.device(device)
            if device is not None
            else next(model.parameters()).device
        )
        LayerCollection, _, _, _, _ = _nngeometry()
        lc = LayerCollection()
        self.modules: dict[str, nn.Module] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                lc.add_layer(name, LayerCollection._module_to_layer(mod))
                self.modules[name] = mod
        if not self.modules:
            raise ValueError("model has no Conv2d or Linear layer to precondition")
        self.layer_collection = lc
        self.schedule = FactorSchedule(
            update_freq, sub_every=self.diag_freq if kind == "ekfac" else 1)
        self.fim = None        # PMatKFAC / PMatEKFAC (the last refresh's)
        self.factors = InverseFactors()  # KFAC: damped inverse factors, in place
        self.eigen = EigenFactors()  # EKFAC: eigenbasis and scalings, in place
        self.recorder = LayerRecorder(self.modules) if kind == "ekfac" else None

    def __repr__(self) -> str:
        return (
            f"KFACPreconditioner(kind={self.kind!r}, damping={self.damping}, "
            f"update_freq={self.update_freq}, "
            f"diag_freq={self.diag_freq}, clip_norm={self.clip_norm}, "
            f"layers={len(self.modules)})"
        )

    def close(self) -> None:
        """Remove EKFAC's forward hooks from the model (and the activations they keep),
        so that the model can train on without this preconditioner; a no-op for KFAC.
        A closed EKFAC preconditioner cannot step again."""
        if self.recorder is not None:
            self.recorder.remove()

    @property
    def steps(self) -> int:
        """Steps taken (the host-side counter of its ``schedule``)."""
        return self.schedule.steps

    @property
    def cache(self) -> FactorSchedule | None:
        """The refresh schedule that a graph-capturing runner follows (its steps between
        refreshes are replayed, its refresh steps run eagerly) when
        ``update_freq > 1``; ``None`` otherwise (every step runs eagerly). EKFAC with
        ``diag_freq > 1`` has two programs between refreshes (``schedule.kinds``)."""
        return self.schedule if self.update_freq > 1 else None

    # ----------------------------------------------------------------------------------
    # internals
    def _function(self, z: torch.Tensor) -> torch.Tensor:
        out = self.model(z)
        return self.output_fn(out) if self.output_fn is not None else out

    def _examples(self, inputs: torch.Tensor):
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(inputs.detach()), batch_size=inputs.shape[0]
        )

    def _refresh(self, inputs: torch.Tensor) -> None:
        _, FIM_MonteCarlo, PMatKFAC, PMatEKFAC, _ = _nngeometry()
        rep = PMatKFAC if self.kind == "kfac" else PMatEKFAC
        with token_rows(self.modules) as rows:  # Linear layers on token sequences
            self.fim = FIM_MonteCarlo(
                model=self.model,
                loader=self._examples(inputs),
                representation=rep,
                variant="classif_logits",
                device=self.device,
                function=lambda *d: self._function(d[0]),
                layer_collection=self.layer_collection,
            )
        if self.kind == "kfac":
            expand_scale(self.fim.data, rows)  # KFAC-expand's G (kfac_tokens)
            self.factors.store(self.fim.inverse(regul=self.damping).data)
        else:  # the eigenbasis, and its initial scalings (the factors' eigenvalues)
            self.eigen.store(self.fim.data)
        self.schedule.ready = True

    def _fisher_passes(self, inputs: torch.Tensor) -> None:
        """The eager nngeometry pass of a refresh step (KFAC's factors, EKFAC's
        eigenbasis); BatchNorm statistics and gradients are left as they were."""
        saved = bn_state(self.model)
        grads = {id(p): p.grad.detach().clone()
                 for p in self.model.parameters() if p.grad is not None}
        paused = (self.recorder.paused() if self.recorder is not None
                  else contextlib.nullcontext())
        with torch.enable_grad(), paused:
            self._refresh(inputs)
        restore_bn_state(self.model, saved)
        # nngeometry's passes use autograd.grad w.r.t. inputs only, but keep
        # the gradient safe regardless
        for p in self.model.parameters():
            if id(p) in grads:
                p.grad.copy_(grads[id(p)])

    def _check_grads(self) -> None:
        for name, mod in self.modules.items():
            if mod.weight.grad is None or (mod.bias is not None
                                           and mod.bias.grad is None):
                raise ValueError(
                    f"layer {name} has no gradient; call step() after a loss that "
                    "depends on it"
                )

    def _grad_pvector(self):
        PVector = _nngeometry()[4]
        d = {name: (mod.weight.grad,) if mod.bias is None
             else (mod.weight.grad, mod.bias.grad)
             for name, mod in self.modules.items()}
        return PVector(self.layer_collection, dict_repr=d)

    # ----------------------------------------------------------------------------------
    # step
    def step(self, loss: torch.Tensor, outputs: torch.Tensor | None = None,
             inputs: torch.Tensor | None = None) -> dict:
        """Backward ``loss``, replace the Conv/Linear gradients by the (E)KFAC
        direction, clip all gradients.

        ``inputs`` (the mini-batch ``z``) is needed for the refresh pass; ``outputs``
        (the network's outputs of the forward that gave ``loss``) for EKFAC's scalings.
        Returns a dict with ``grad_norm`` (before clipping), ``refreshed`` and
        ``fallback`` (1 when the direction was non-finite and the plain gradient was
        used instead, a 0-dim device tensor: a step between refreshes never waits for
        the device; :class:`~studies.cifar.steps.KFACStep` sums and logs it).
        """
        if inputs is None:
            raise ValueError("inputs must be the mini-batch tensor z for KFAC/EKFAC")
        refresh = self.schedule.refresh_now()
        records = None
        if self.kind == "ekfac":
            records = self._scaling_records(
                outputs, refresh or self.schedule.sub_due)
        loss.backward()
        self._check_grads()
        if refresh:
            self._fisher_passes(inputs)
        info = {"refreshed": int(refresh)}
        if self.kind == "kfac":
            info["fallback"] = self.factors.apply(self.modules)
        else:
            if records is not None:  # in the eigenbasis of this step (a new one, if
                self.eigen.update(self.modules, records)  # it refreshed)
            info["fallback"] = self.eigen.apply(self.modules, self.damping)
        info["grad_norm"] = clip_grad_norm(list(self.model.parameters()),
                                           self.clip_norm)
        self.schedule.advance()
        return info

    def _scaling_records(self, outputs: torch.Tensor | None, due: bool):
        """EKFAC: each layer's input and the gradient, with respect to its output, of
        the log-likelihood of labels sampled from the predictive distribution of
        ``outputs`` (the training forward's, its graph retained); ``None`` when the
        scalings are not ``due`` at this step. Forgets the recorded forward."""
        names = list(self.modules)
        if not due:
            self.recorder.saved = {}
            return None
        if not isinstance(outputs, torch.Tensor):
            raise ValueError("outputs must be the network's outputs of the training "
                             f"forward for EKFAC, got {type(outputs).__name__}")
        layers = self.recorder.take(names)
        logits = outputs.float() if outputs.dtype in (torch.float16,
                                                      torch.bfloat16) else outputs
        if self.output_fn is not None:
            logits = self.output_fn(logits)
        gys = fisher_output_grads(logits, {k: layers[k][1] for k in names})
        return {k: (layers[k][0], gys[k]) for k in names}

    # ----------------------------------------------------------------------------------
    # state
    def state_dict(self) -> dict:
        """Step counter and current factors (enough for an exact resume)."""
        state: dict = {"steps": self.steps, "kind": self.kind}
        if self.kind == "ekfac" and self.eigen.buffers:
            # PMatEKFAC.data's form, with the current scalings
            state["fim_data"] = self.eigen.state()
        elif self.kind == "kfac" and self.fim is not None:
            state["fim_data"] = self.fim.data
            state["inverse_data"] = self.factors.state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (KFAC's inverse factors, EKFAC's eigenbasis and
        scalings into the same buffers)."""
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            got = state.get("kind") if isinstance(state, dict) else state
            raise ValueError(
                f"state must be a state_dict of kind={self.kind!r}, got {got!r:.100}"
            )
        self.schedule.steps = int(state["steps"])
        if "fim_data" in state:
            _, _, PMatKFAC, PMatEKFAC, _ = _nngeometry()
            from nngeometry.backend import TorchHooksJacobianBackend

            rep = PMatKFAC if self.kind == "kfac" else PMatEKFAC
            gen = TorchHooksJacobianBackend(
                model=self.model,
                function=lambda *d: self._mc_logprob(d[0]),
                layer_collection=self.layer_collection,
            )
            self.fim = rep(generator=gen, data=state["fim_data"])
            if self.kind == "kfac":
                self.factors.store(state.get("inverse_data"), self.device)
            else:
                self.eigen.store(state["fim_data"], self.device)
        self.schedule.ready = self.fim is not None

    def _mc_logprob(self, z: torch.Tensor) -> torch.Tensor:
        """The Monte-Carlo function of nngeometry's ``classif_logits`` variant (one
        sampled label)."""
        log_softmax = torch.log_softmax(self._function(z), dim=1)
        sampled = torch.multinomial(torch.exp(log_softmax), 1, replacement=True)
        return torch.gather(log_softmax, 1, sampled)
