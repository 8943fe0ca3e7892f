"""Augmentation of CIFAR image batches (:mod:`kwng.experiments.cifar.data`, which re-exports every name):
normalisation, and the random crop with padding and horizontal flip used by
:class:`kwng.experiments.cifar.data.GPUAugmentedData`. Moved out of :mod:`kwng.experiments.cifar.data` to keep each module
short.
"""

from __future__ import annotations

import torch


# ------------------------------------------------------------------------------------- augmentation
def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``uint8 (B, 3, H, W)`` → float, ``(x / 255 - mean) / std`` per channel."""
    return (x.float().div_(255.0) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def draw_augmentation(b: int, generator: torch.Generator, pad: int = 4
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draws of :func:`augment_batch` for ``b`` images, from the CPU ``generator``:
    crop offsets ``ox``, ``oy`` in ``[0, 2 pad]`` and horizontal ``flip`` flags."""
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    return ox, oy, flip


def apply_augmentation(x: torch.Tensor, ox: torch.Tensor, oy: torch.Tensor,
                       flip: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Crop the ``pad``-zero-padded images ``x`` ``(B, C, H, W)`` at offsets ``ox``,
    ``oy`` and flip those with ``flip`` (the draws, on ``x.device``)."""
    b, c, h, w = x.shape
    dev = x.device
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    ar_h = torch.arange(h, device=dev)
    ar_w = torch.arange(w, device=dev)
    cols = ox[:, None] + torch.where(flip[:, None], w - 1 - ar_w[None, :], ar_w[None, :])  # flip folded in
    rows = oy[:, None] + ar_h[None, :]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def augment_batch(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop of the ``pad``-zero-padded images and random horizontal flip, all on ``x.device``.

    ``x`` is ``(B, C, H, W)`` (any dtype). The draws (crop offsets in ``[0, 2 pad]``, flips) come from
    the CPU ``generator`` (:func:`draw_augmentation`), so they do not depend on the device and are
    reproducible after a resume.
    """
    ox, oy, flip = draw_augmentation(x.shape[0], generator, pad)
    dev = x.device
    return apply_augmentation(x, ox.to(dev, non_blocking=True), oy.to(dev, non_blocking=True),
                              flip.to(dev, non_blocking=True), pad)
