"""Where the studies keep what they write: the one results root of the checkout, under
which every study has its folder (``results/cifar``, ``results/relerr``, ...) with
committed records that no command overwrites by default, and the checkpoints root."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RESULTS", "CHECKPOINTS"]

#: the results root, relative to the checkout
RESULTS = Path("results")
#: the root of the runs' checkpoints (ignored by git)
CHECKPOINTS = Path("checkpoints")
