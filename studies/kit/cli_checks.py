"""Checks of command-line options shared by the experiment commands: each error names
the option and the cause, and comes before anything is computed or written."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

__all__ = ["lr_arg", "int_arg", "int_list_arg", "number_arg", "names_arg",
           "path_problem", "device_problem"]


def lr_arg(text: str) -> str | float:
    """``--lr``: ``'selected'`` or a finite number > 0 (argparse names the option)."""
    if text == "selected":
        return text
    try:
        lr = float(text)
    except ValueError:
        lr = math.nan
    if not (math.isfinite(lr) and lr > 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0 or 'selected', got {text!r}")
    return lr


def int_arg(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= lo`` (argparse names the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {lo}, got {text!r}")
        return value
    return parse


def int_list_arg(lo: int) -> Callable[[str], list[int]]:
    """An argparse ``type``: a comma list of integers ``>= lo``.

    >>> int_list_arg(0)("2,3")
    [2, 3]
    """
    def parse(text: str) -> list[int]:
        try:
            return [int_arg(lo)(t) for t in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be a comma list of integers >= {lo}, got {text!r}") from None
    return parse


def number_arg(lo: float = 0.0) -> Callable[[str], float]:
    """An argparse ``type``: a finite number ``> lo``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > lo):
            raise argparse.ArgumentTypeError(
                f"must be a finite number > {lo:g}, got {text!r}")
        return value
    return parse


def names_arg(choices: Sequence[str], extra: Sequence[str] = ()
              ) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma list of names from ``choices`` (or one word of
    ``extra``, returned as a one-element list)."""
    def parse(text: str) -> list[str]:
        if text in extra:
            return [text]
        names = [t.strip() for t in text.split(",")]
        bad = [n for n in names if n not in choices]
        if bad or not text.strip():
            words = ", ".join(map(repr, extra))
            raise argparse.ArgumentTypeError(
                f"must be a comma list of {', '.join(choices)}"
                + (f" (or {words})" if extra else "") + f"; got {text!r}")
        return names
    return parse


def path_problem(args: argparse.Namespace, names: tuple[str, ...]) -> str | None:
    """The first of the path options ``names`` given as an empty string (``""`` is not
    a path: it would silently mean the current folder or the default)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and not str(value).strip():
            return f"--{name.replace('_', '-')} is an empty path"
    return None


def device_problem(device: str | None) -> str | None:
    """What is wrong with a ``--device`` value (``None``: the default), or ``None``."""
    import torch

    if device is None:
        return None
    try:
        dev = torch.device(device)
    except RuntimeError:
        return f"--device must be a torch device such as cpu or cuda:0, got {device!r}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available here (use --device cpu)"
    return None
