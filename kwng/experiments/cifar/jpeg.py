"""Reading a CIFAR JPEG npz (:mod:`kwng.experiments.cifar.data`): the checks of its
arrays and the decode of its images. Each error names the file and the cause: a missing
or damaged file, labels outside the classes, offsets that do not match the labels, an
image that is not a JPEG."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np


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
