"""The one place where the run scale of the book and the experiments is decided, and
where the checkout lives.

Set the environment variable ``KWNG_SCALE`` to ``small`` (the default: CPU, seconds per
chapter) or ``full`` (GPU, the paper's sizes). Every chapter and experiment reads it
through
:func:`scale` so that a single switch changes the whole project.
"""

from __future__ import annotations

import os
from pathlib import Path

SCALES = ("small", "full")
ENV_VAR = "KWNG_SCALE"
#: the repository checkout that holds this package (``results/``, ``.data/`` beside it)
#:
#: :meta hide-value:
REPO_ROOT = Path(__file__).resolve().parents[1]


#: the environment variable of the folder for caches (decoded images), default
#: ``~/.cache/kwng``
CACHE_VAR = "KWNG_CACHE"


def cache_dir() -> Path:
    """The folder for caches that can be rebuilt (e.g. decoded CIFAR images):
    ``$KWNG_CACHE``, else ``~/.cache/kwng``; never beside a user's data."""
    value = os.environ.get(CACHE_VAR, "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kwng"


def scale() -> str:
    """Return the active scale, ``"small"`` or ``"full"``, from ``$KWNG_SCALE``."""
    value = os.environ.get(ENV_VAR, "small").strip().lower()
    if value not in SCALES:
        raise ValueError(f"{ENV_VAR} must be one of {SCALES}, got {value!r}")
    return value


def resolve(value: str | None = None) -> str:
    """``value`` checked against ``SCALES``, or the active :func:`scale` when ``None``
    (the ``scale=`` argument of every experiment's configuration function)."""
    if value is None:
        return scale()
    if value not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {value!r}")
    return value


def is_full() -> bool:
    """True when ``$KWNG_SCALE`` asks for the paper's (GPU) scale."""
    return scale() == "full"


def pick(small, full):
    """Return ``small`` or ``full`` according to :func:`scale`."""
    return full if is_full() else small
