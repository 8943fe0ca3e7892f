"""What a study adds to the CIFAR kit without the kit importing it.

The kit (trainer, sweep, ``cifar check``) knows no study. A study registers, when it is
imported, what the kit calls by name:

* an **early-stop rule** (run setting ``early_stop="<name>"``): ``rule(row, rows, rdir,
  num_classes)`` returns why the run stops after its latest epoch ``row`` (a dict with
  at least ``"reason"`` and ``"epoch"``) or ``None`` to go on; ``rows`` are the run's
  epochs so far, ``rdir`` its record folder (for the sibling runs of a grid);
* a **plan** (``cifar sweep --plan <name>``): ``plan(common, epochs, select)`` returns
  the list of runs, each a dict of :class:`~studies.cifar.config.RunConfig` settings;
* a **completeness check** (``cifar check --suite <name>``): ``check(root)`` prints
  what is missing and returns the exit status.

``python -m studies`` imports every study first (:func:`studies.load_all`), so every
name
is registered before a command runs; a name that nobody registered is refused with the
names that were.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["EarlyStopRule", "register_early_stop", "early_stop_rule",
           "early_stop_names",
           "register_plan", "plan_builder", "plan_names", "register_check", "check_of",
           "check_names"]

#: ``rule(row, rows, rdir, num_classes) -> dict | None``
EarlyStopRule = Callable[[dict, list, Path, int], "dict | None"]

_EARLY_STOP: dict[str, EarlyStopRule] = {}
_PLANS: dict[str, Callable[..., list[dict]]] = {}
_CHECKS: dict[str, Callable[[Any], int]] = {}


def _register(table: dict, kind: str, name: str, fn: Callable) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{kind} name must be an identifier, got {name!r}")
    if not callable(fn):
        raise TypeError(f"{kind} {name!r} must be callable, got {type(fn).__name__}")
    old = table.get(name)
    if old is not None and old is not fn and (old.__module__, old.__qualname__) != (
            fn.__module__, fn.__qualname__):
        raise ValueError(f"{kind} {name!r} is already registered by {old.__module__}")
    table[name] = fn


def _lookup(table: dict, kind: str, name: str) -> Callable:
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise ValueError(f"unknown {kind} {name!r} (registered: {known}); a study "
                         "registers its own when imported (python -m studies imports "
                         "them all: studies.load_all())")
    return table[name]


def register_early_stop(name: str, rule: EarlyStopRule) -> None:
    """Register ``rule`` as the early-stop rule ``name``."""
    _register(_EARLY_STOP, "early-stop rule", name, rule)


def early_stop_rule(name: str) -> EarlyStopRule:
    """The early-stop rule registered as ``name``."""
    return _lookup(_EARLY_STOP, "early-stop rule", name)


def early_stop_names() -> tuple[str, ...]:
    """The names of the registered early-stop rules, sorted."""
    return tuple(sorted(_EARLY_STOP))


def register_plan(name: str, builder: Callable[..., list[dict]]) -> None:
    """Register ``builder(common, epochs, select)`` as the plan ``name``."""
    _register(_PLANS, "plan", name, builder)


def plan_builder(name: str) -> Callable[..., list[dict]]:
    """The builder of the plan registered as ``name``."""
    return _lookup(_PLANS, "plan", name)


def plan_names() -> tuple[str, ...]:
    """The names of the registered plans, sorted."""
    return tuple(sorted(_PLANS))


def register_check(name: str, check: Callable[[Any], int]) -> None:
    """Register ``check(root)`` as the completeness check ``cifar check --suite
    name``."""
    _register(_CHECKS, "check suite", name, check)


def check_of(name: str) -> Callable[[Any], int]:
    """The completeness check registered as ``name``."""
    return _lookup(_CHECKS, "check suite", name)


def check_names() -> tuple[str, ...]:
    """The names of the registered completeness checks, sorted."""
    return tuple(sorted(_CHECKS))
