"""Checks of command-line options shared by the experiment commands: each error names
the option and the cause, and comes before anything is computed or written."""

from __future__ import annotations

import argparse
import math

__all__ = ["lr_arg", "path_problem", "device_problem"]


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
