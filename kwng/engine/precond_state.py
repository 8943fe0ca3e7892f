"""The saved state of :class:`kwng.KWNGPreconditioner`: its counters and the loading of
a ``state_dict``, including one saved before the ε rule became one object
(``eps_schedule``, :class:`kwng.engine.lm.LMSchedule`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kwng._checks import check_int
from kwng.engine.lm import LevenbergMarquardt

__all__ = ["COUNTERS", "count_step", "counters_report", "generator_state",
           "load_generator_state", "load_preconditioner_state",
           "upgrade_hyperparameters"]

log = logging.getLogger(__name__)

#: The counters of a preconditioner (device tensors, summed over its steps).
COUNTERS = ("fallbacks", "ill_conditioned", "rank_sum", "damping_floored", "clipped",
            "serial_steps", "loss_only", "euclidean_steps")

# the hyperparameters of a state saved before eps_schedule: old key -> LMSchedule field
_OLD_LM_KEYS = {"lm_interval": "interval", "lm_omega": "omega", "lm_low": "low",
                "lm_high": "high", "eps_min": "eps_min", "eps_max": "eps_max",
                "lm_rule": "rule"}


def count_step(counters: dict[str, torch.Tensor], f: dict[str, torch.Tensor],
               extra: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Add a step's direction info ``f`` (:data:`kwng.engine.step_direction.INFO_KEYS`)
    to ``counters``; the step's info: ``f``'s entries with ``extra`` (``eps``,
    ``reduction_ratio``, ``bandwidth``), as 0-dim tensors on ``device``."""
    for key, name in (("fallbacks", "fallback"), ("ill_conditioned", "ill_conditioned"),
                      ("rank_sum", "rank"), ("damping_floored", "damping_floored"),
                      ("clipped", "clipped"), ("loss_only", "loss_only")):
        counters[key] += f[name].long()
    info = {"eps": extra["eps"], "reduction_ratio": extra["reduction_ratio"],
            "fallback": f["fallback"], "clipped": f["clipped"], "rank": f["rank"],
            "floored_columns": f["damping_floored"].long(),
            "floored_share": f["floored_share"], "loss_only": f["loss_only"],
            "dot": f["dot"], "grad_norm": f["grad_norm"],
            "direction_norm": f["direction_norm"], "bandwidth": extra["bandwidth"]}
    return {k: torch.as_tensor(v, device=device) for k, v in info.items()}


def counters_report(counters: dict[str, torch.Tensor], lm: LevenbergMarquardt,
                    steps: int, warn_once: Callable[..., None]) -> dict[str, int]:
    """:meth:`kwng.KWNGPreconditioner.counters`: ``counters`` with the ε rule's moves
    and ``steps`` as Python ints (a host sync); logs fallbacks and rank deficiencies if
    any."""
    out = {k: int(v) for k, v in counters.items()}
    out["eps_up"], out["eps_down"] = int(lm.ups), int(lm.downs)
    out["steps"] = steps
    if out["fallbacks"]:
        log.info("KWNG fell back to the Euclidean gradient in %d of %d steps",
                 out["fallbacks"], steps)
    if out["ill_conditioned"]:
        log.info("C Cᵀ was rank deficient in %d of %d steps", out["ill_conditioned"],
                 steps)
    if out["loss_only"]:
        warn_once("loss_only", "KWNG: parameters that move the loss but not the "
                  "samples (zero column of T) took the Euclidean gradient scaled like "
                  "the rest (%d components over %d steps)", out["loss_only"], steps)
    return out


def upgrade_hyperparameters(hp: dict[str, Any]) -> dict[str, Any]:
    """``hp`` in the current form: the ``lm_*``, ``eps_min``, ``eps_max`` and
    ``adapt_eps`` entries of an older state become ``eps_schedule`` (a dict, or ``None``
    for ``adapt_eps=False``), and a state saved before ``refresh_every`` gets its
    default ``1``; a current ``hp`` is returned unchanged."""
    if "refresh_every" not in hp:
        hp = {**hp, "refresh_every": 1}
    if "eps_schedule" in hp or not any(k in hp for k in (*_OLD_LM_KEYS, "adapt_eps")):
        return hp
    new = {k: v for k, v in hp.items() if k not in _OLD_LM_KEYS and k != "adapt_eps"}
    sched = {field: hp[k] for k, field in _OLD_LM_KEYS.items() if k in hp}
    new["eps_schedule"] = sched if hp.get("adapt_eps", True) else None
    return new


def load_preconditioner_state(
    state: dict[str, Any], lm: LevenbergMarquardt, hyperparameters: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Load ``state`` into ``lm``; returns the step count and the counters as device
    tensors. Warns if the saved hyperparameters differ from ``hyperparameters``."""
    if not isinstance(state, dict):
        raise ValueError("state must be a dict (KWNGPreconditioner.state_dict()), got "
                         f"{type(state).__name__}")
    missing = {"lm", "num_steps", "counters"} - set(state)
    if missing:
        raise ValueError(f"state_dict is missing {sorted(missing)}")
    lm.load_state_dict(state["lm"])
    dev = lm.eps.device
    steps = torch.tensor(check_int(state["num_steps"], "num_steps", 0),
                         dtype=torch.long, device=dev)
    saved = state["counters"]
    counters = {k: torch.tensor(check_int(saved.get(k, 0), f"counters[{k!r}]", 0),
                                dtype=torch.long, device=dev) for k in COUNTERS}
    hp = state.get("hyperparameters")
    if hp is not None:
        hp = upgrade_hyperparameters(hp)
        diffs = [f"{k}: saved {hp.get(k, '(absent)')!r}, "
                 f"now {hyperparameters.get(k, '(absent)')!r}"
                 for k in sorted({*hp, *hyperparameters})
                 if hp.get(k) != hyperparameters.get(k)]
        if diffs:
            log.warning("load_state_dict: hyperparameters differ from the saved ones "
                        "(the loaded state is used with this preconditioner's): %s",
                        "; ".join(diffs))
    return steps, counters


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """The state of the basis generator as bytes (a plain value: ``state_dict``s stay
    comparable with ``==`` and load with ``torch.load(weights_only=True)``)."""
    return None if generator is None else bytes(generator.get_state().numpy())


def load_generator_state(state: dict[str, Any], generator: torch.Generator | None
                         ) -> None:
    """Restore the basis generator's state saved in ``state`` (nothing for a state
    saved without one)."""
    saved = state.get("generator")
    if saved is None:
        return
    if not isinstance(saved, bytes):
        raise ValueError("state['generator'] must be bytes (a generator's state), got "
                         f"{type(saved).__name__}")
    if generator is None:
        log.warning("load_state_dict: the state holds a basis generator's state but "
                    "this preconditioner has none (its bases come from torch's global "
                    "stream); pass generator=torch.Generator() to resume the same "
                    "draws")
        return
    generator.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
