"""Augmentation of CIFAR image batches (:mod:`kwng.data`, which re-exports every name):
normalisation, and the random crop with padding and horizontal flip used by
:class:`kwng.data.GPUAugmentedData`. Moved out of :mod:`kwng.data` to keep each module
short.
"""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------- augmentation
def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``uint8 (B, 3, H, W)`` → float, ``(x / 255 - mean) / std`` per channel."""
    return (x.float().div_(255.0) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def augment_batch(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop of the ``pad``-zero-padded images and random horizontal flip, all on ``x.device``.

    ``x`` is ``(B, C, H, W)`` (any dtype). The draws (crop offsets in ``[0, 2 pad]``, flips) come from
    the CPU ``generator``, so they do not depend on the device and are reproducible after a resume.
    """
    b, c, h, w = x.shape
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    dev = x.device
    ox, oy, flip = ox.to(dev, non_blocking=True), oy.to(dev, non_blocking=True), flip.to(dev, non_blocking=True)
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    ar_h = torch.arange(h, device=dev)
    ar_w = torch.arange(w, device=dev)
    cols = ox[:, None] + torch.where(flip[:, None], w - 1 - ar_w[None, :], ar_w[None, :])  # flip folded in
    rows = oy[:, None] + ar_h[None, :]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]
