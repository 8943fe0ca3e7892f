"""CIFAR images below the data sets of :mod:`kwng.experiments.cifar.data`: reading a
JPEG npz and augmenting a batch.

* Reading: the checks of a JPEG npz's arrays and the decode of its images. Each error
  names the file and the cause: a missing or damaged file, labels outside the classes,
  offsets that do not match the labels, an image that is not a JPEG.
* Augmenting: normalisation, and the random crop with padding and horizontal flip used
  by :class:`kwng.experiments.cifar.data.GPUAugmentedData`.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["normalize", "draw_augmentation", "apply_augmentation", "augment_batch"]


# ------------------------------------------------------------------------ a JPEG npz
def _check_labels(y: np.ndarray, num_classes: int, where: str) -> np.ndarray:
    """``y`` if every label lies in ``[0, num_classes - 1]``, else ``ValueError``
    naming ``where``."""
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        raise ValueError(f"{where}: {int(bad.sum())} label(s) outside "
                         f"[0, {num_classes - 1}] (first: {int(y[bad][0])} at row "
                         f"{int(np.argmax(bad))})")
    return y


def _npz_split(path: Path, split: str) -> tuple[object, np.ndarray, np.ndarray]:
    """``(npz, y, offsets)`` of one split of a JPEG npz, checked: readable, labels in
    range, one JPEG per label with increasing offsets."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"CIFAR JPEG npz {path} does not exist")
    try:
        z = np.load(path)
        y = np.asarray(z[f"y_{split}"], dtype=np.int64)
        off = np.asarray(z[f"{split}_offsets"], dtype=np.int64)
        classes = len(z["classes"]) if "classes" in z.files else 10
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable CIFAR JPEG npz, truncated or "
                         f"damaged? ({type(exc).__name__}: {exc})") from exc
    _check_labels(y, classes, f"{path} (y_{split})")
    if (off.ndim != 1 or len(off) != len(y) + 1 or off[0] != 0
            or (np.diff(off) <= 0).any()):
        raise ValueError(f"{path}: {split}_offsets must be {len(y) + 1} increasing "
                         f"byte offsets from 0 (one JPEG per label of y_{split}), got "
                         f"{len(off)} values")
    return z, y, off


def _decode_jpegs(buf: np.ndarray, offsets: np.ndarray, path: Path | str = "npz"
                  ) -> np.ndarray:
    """The ``uint8 (N, 32, 32, 3)`` images of the JPEG bytes ``buf`` cut at
    ``offsets``."""
    from PIL import Image, UnidentifiedImageError

    if int(offsets[-1]) != buf.size:
        raise ValueError(f"{path}: the offsets end at byte {int(offsets[-1])}, the "
                         f"JPEG buffer holds {buf.size}")
    out = np.empty((len(offsets) - 1, 32, 32, 3), dtype=np.uint8)
    for i in range(len(offsets) - 1):
        raw = buf[offsets[i]:offsets[i + 1]].tobytes()
        try:
            out[i] = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
        except (OSError, ValueError, UnidentifiedImageError) as exc:
            raise ValueError(f"{path}: image {i} is not a 32x32 JPEG "
                             f"({type(exc).__name__}: {exc})") from exc
    return out


# ---------------------------------------------------------------------- augmentation
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
    # the flip folded into the column index
    cols = ox[:, None] + torch.where(flip[:, None], w - 1 - ar_w[None, :],
                                     ar_w[None, :])
    rows = oy[:, None] + ar_h[None, :]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


def augment_batch(x: torch.Tensor, generator: torch.Generator,
                  pad: int = 4) -> torch.Tensor:
    """Random crop of the ``pad``-zero-padded images and random horizontal flip, all on
    ``x.device``.

    ``x`` is ``(B, C, H, W)`` (any dtype). The draws (crop offsets in ``[0, 2 pad]``,
    flips) come from the CPU ``generator`` (:func:`draw_augmentation`), so they do not
    depend on the device and are reproducible after a resume.
    """
    ox, oy, flip = draw_augmentation(x.shape[0], generator, pad)
    dev = x.device
    return apply_augmentation(x, ox.to(dev, non_blocking=True),
                              oy.to(dev, non_blocking=True),
                              flip.to(dev, non_blocking=True), pad)
