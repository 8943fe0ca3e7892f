"""The Levenberg–Marquardt rule for ``ε`` (paper App. D.2), as a small object with
its own state.

The rule compares the decrease of the loss that the step achieved with the decrease that
the linear model predicted, ``r = (L_before − L_after) / (½ · lr · ⟨g, ĝ⟩)``, and adapts
the damping ``ε`` every ``interval`` steps from the largest ``r`` seen since the last
update::

    ε ← ε / ω  if r < low   (the step was too optimistic: more damping)
    ε ← ε · ω  if r > high  (the linear model was good: less damping)
    ε ∈ [eps_min, eps_max]

Two ways of getting ``L_after`` (``rule``):

* ``"authors"`` — as the authors' code: ``L_after`` is the loss of the *next*
  mini-batch, read at the start of the next step
  (:meth:`~kwng.engine.lm.LevenbergMarquardt.update`). The two losses are of different
  batches, so ``r`` mixes the progress of the step with the difference between the
  batches.
* ``"same_batch"`` — ``L_after`` is the loss of the *same* mini-batch after the step,
  which the training loop computes (one extra forward pass without gradients) and hands
  to :meth:`LevenbergMarquardt.observe`. This is the comparison the rule intends.

The hyperparameters form one frozen, validated object, :class:`LMSchedule` (the
``eps_schedule`` of :class:`kwng.KWNGConfig`); :class:`LevenbergMarquardt` holds ``ε``
and the rule's state. All quantities are 0-dim tensors on the device: no host
synchronisation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kwng._checks import check_choice, check_int, check_positive

__all__ = ["LevenbergMarquardt", "LMSchedule", "LM_RULES"]

#: the ε rules (``"authors"`` compares with the next batch's loss, ``"same_batch"``
#: with the same batch's loss after the step)
LM_RULES = ("authors", "same_batch")


@dataclass(frozen=True)
class LMSchedule:
    """The hyperparameters of the ε rule of App. D.2, validated on construction:
    ``interval`` ≥ 1 steps between updates, ``omega`` [``ω``] in (0, 1), thresholds
    ``0 ≤ low < high`` of ``r``, bounds ``0 < eps_min ≤ eps_max``, ``rule`` one of
    :data:`LM_RULES`. The defaults are the paper's."""

    interval: int = 5
    omega: float = 0.85
    low: float = 0.25
    high: float = 0.75
    eps_min: float = 1e-10
    eps_max: float = 1e5
    rule: str = "authors"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("interval", check_int(self.interval, "interval", 1))
        omega = check_positive(self.omega, "omega")
        if not omega < 1:
            raise ValueError(f"omega must lie in (0, 1), got {self.omega!r}")
        put("omega", omega)
        low = check_positive(self.low, "low", allow_zero=True)
        high = check_positive(self.high, "high", allow_zero=True)
        if not low < high:
            raise ValueError(f"low must be < high (both in [0, inf)), got low={low}, "
                             f"high={high}")
        put("low", low)
        put("high", high)
        lo = check_positive(self.eps_min, "eps_min")
        hi = check_positive(self.eps_max, "eps_max")
        if not lo <= hi:
            raise ValueError(f"eps_min must be <= eps_max, got eps_min={lo}, "
                             f"eps_max={hi}")
        put("eps_min", lo)
        put("eps_max", hi)
        check_choice(self.rule, "rule", LM_RULES)

    def check_eps(self, eps: float) -> float:
        """``eps`` if it lies in ``[eps_min, eps_max]``, else a ``ValueError``."""
        eps = check_positive(eps, "eps")
        if not self.eps_min <= eps <= self.eps_max:
            raise ValueError(f"eps must lie in [eps_min, eps_max] = [{self.eps_min}, "
                             f"{self.eps_max}] of the schedule, got {eps}")
        return eps

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class LevenbergMarquardt:
    """``ε`` and the state of its rule (App. D.2): ``schedule`` (an
    :class:`LMSchedule`, default the paper's) gives ``interval``, ``omega`` = ω,
    ``low``/``high`` (the thresholds of ``r``), the bounds and the rule; ``eps`` is the
    initial ``ε``, within the bounds."""

    def __init__(
        self,
        eps: float,
        schedule: LMSchedule | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        schedule = LMSchedule() if schedule is None else schedule
        if not isinstance(schedule, LMSchedule):
            raise ValueError("schedule must be a kwng.engine.lm.LMSchedule or None, "
                             "got "
                             f"{type(schedule).__name__}")
        self.schedule = schedule
        self.eps_init = schedule.check_eps(eps)
        self.to(torch.device(device), reset=True)

    @property
    def rule(self) -> str:
        return self.schedule.rule

    # --- state ------------------------------------------------------------------------
    def to(self, device: torch.device, reset: bool = False) -> LevenbergMarquardt:
        """Move the state to ``device`` (``reset``: start afresh)."""
        f64 = torch.float64
        if reset:
            self.eps = torch.tensor(self.eps_init, dtype=f64, device=device)
            self.ratio = torch.zeros((), dtype=f64, device=device)  # latest r
            self._r_max = torch.full((), -torch.inf, dtype=f64, device=device)
            self._loss = torch.zeros(
                (), dtype=f64, device=device
            )  # L_before of the last step
            self._pred = torch.zeros(
                (), dtype=f64, device=device
            )  # ½·lr·⟨g, ĝ⟩ of the last step
            self.has_prev = False
            self.ups = torch.zeros((), dtype=torch.long, device=device)
            self.downs = torch.zeros((), dtype=torch.long, device=device)
            self._count = torch.zeros((), dtype=torch.long, device=device)
        else:
            for k in (
                "eps",
                "ratio",
                "_r_max",
                "_loss",
                "_pred",
                "ups",
                "downs",
                "_count",
            ):
                setattr(self, k, getattr(self, k).to(device))
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "eps": float(self.eps),
            "ratio": float(self.ratio),
            "r_max": float(self._r_max),
            "loss": float(self._loss),
            "pred": float(self._pred),
            "has_prev": self.has_prev,
            "steps": self.steps,
            "ups": int(self.ups),
            "downs": int(self.downs),
            "rule": self.rule,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError("state must be a dict (LevenbergMarquardt.state_dict()), "
                             f"got {type(state).__name__}")
        missing = {
            "eps",
            "ratio",
            "r_max",
            "loss",
            "pred",
            "has_prev",
            "steps",
            "ups",
            "downs",
        } - set(state)
        if missing:
            raise ValueError(
                f"LevenbergMarquardt state_dict is missing {sorted(missing)}"
            )
        if state.get("rule", self.rule) != self.rule:
            raise ValueError(
                f"state_dict was saved with rule={state['rule']!r}, "
                f"this schedule has {self.rule!r}"
            )
        dev, f64 = self.eps.device, torch.float64
        self.eps = torch.tensor(
            check_positive(state["eps"], "eps"), dtype=f64, device=dev
        )
        if not isinstance(state["has_prev"], bool):
            raise ValueError("state['has_prev'] must be True or False, got "
                             f"{state['has_prev']!r}")
        values = {}
        for key in ("ratio", "r_max", "loss", "pred"):  # NaN stands for "none yet"
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"state[{key!r}] must be a real number, got "
                                 f"{type(v).__name__}")
            values[key] = float(v)
        counts = {k: check_int(state[k], f"state[{k!r}]", 0)
                  for k in ("steps", "ups", "downs")}
        for k, key in (("ratio", "ratio"), ("_r_max", "r_max"), ("_loss", "loss"),
                       ("_pred", "pred")):
            setattr(self, k, torch.tensor(values[key], dtype=f64, device=dev))
        self.has_prev = state["has_prev"]
        self._count = torch.tensor(counts["steps"], device=dev)
        self.ups = torch.tensor(counts["ups"], device=dev)
        self.downs = torch.tensor(counts["downs"], device=dev)

    @property
    def steps(self) -> int:
        """Steps recorded so far, counted on the device (CUDA-graph replays count)."""
        return int(self._count)

    # --- the rule ---------------------------------------------------------------------
    # Every state tensor is updated in place (``copy_``, ``+=``): a step recorded in a
    # CUDA graph then reads and writes the same memory on every replay.
    def _ratio(self, loss_after: torch.Tensor) -> None:
        after = loss_after.detach().to(self.eps.device, torch.float64)
        pred = self._pred
        self.ratio.copy_(torch.where(
            pred > 0,
            (self._loss - after) / pred.clamp(min=1e-300),
            torch.zeros_like(pred),
        ))
        self._r_max.copy_(torch.maximum(self._r_max, self.ratio))

    def _adapt(self) -> None:
        """Every ``interval`` steps (counted on the device, so a CUDA-graph replay
        counts too)."""
        due = (self._count + 1) % self.schedule.interval == 0
        r = self._r_max
        seen = due & torch.isfinite(r)
        up = seen & (r < self.schedule.low) & (self.eps < self.schedule.eps_max)
        down = seen & (r > self.schedule.high) & (self.eps > self.schedule.eps_min)
        new = torch.where(
            up,
            self.eps / self.schedule.omega,
            torch.where(down, self.eps * self.schedule.omega, self.eps),
        )
        self.eps.copy_(new.clamp(self.schedule.eps_min, self.schedule.eps_max))
        self.ups += up.long()
        self.downs += down.long()
        self._r_max.copy_(torch.where(due, torch.full_like(r, -torch.inf), r))

    def update(self, loss: torch.Tensor) -> torch.Tensor:
        """Start of a step with mini-batch loss ``loss``; returns the ``ε`` to use in
        this step.

        Rule ``"authors"``: ``loss`` is the ``L_after`` of the previous step.
        """
        if self.rule == "authors" and self.has_prev:
            self._ratio(loss)
        if self.has_prev:
            self._adapt()
        self._loss.copy_(loss.detach())
        return self.eps.clone()  # this step's value (the state changes in place later)

    def record(self, lr: float, dot: torch.Tensor) -> None:
        """End of a step: the step size and ``⟨g, ĝ⟩`` of the update just written."""
        dot = dot.detach().to(self.eps.device, torch.float64)
        self._pred.copy_(0.5 * float(lr) * dot)
        self.has_prev = True
        self._count += 1

    def observe(self, loss_after: torch.Tensor) -> None:
        """Rule ``"same_batch"``: the loss of the same mini-batch after the optimizer's
        step."""
        if self.rule != "same_batch":
            raise ValueError(
                "observe() is for rule='same_batch'; "
                f"this schedule has rule={self.rule!r}"
            )
        if not self.has_prev:
            raise ValueError(
                "observe() before any step: call it after optimizer.step()"
            )
        self._ratio(loss_after)

    def __repr__(self) -> str:
        return f"LevenbergMarquardt(eps={self.eps_init}, schedule={self.schedule!r})"
