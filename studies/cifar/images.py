"""CIFAR images below the data sets of :mod:`studies.cifar.data`: reading a
JPEG npz and augmenting a batch.

* Reading: the checks of a JPEG npz's arrays, the decode of its images and the decode
  cache keyed by the npz's content hash (:func:`load_jpeg_npz`,
  :func:`file_fingerprint`). Each error names the file and the cause: a missing or
  damaged file, labels outside the classes, offsets that do not match the labels, an
  image that is not a JPEG.
* Augmenting: normalisation, the random crop with padding and horizontal flip, and
  :class:`GPUAugmentedData`, which keeps a whole set on the compute device as ``uint8``
  and augments its batches there; its batch order and augmentation draws come from a
  seeded CPU :class:`torch.Generator` whose state is checkpointed for exact resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from kwng import scale_switch as config
from kwng._checks import check_choice, check_int

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "file_fingerprint", "load_jpeg_npz", "normalize",
           "draw_augmentation", "apply_augmentation", "augment_batch",
           "GPUAugmentedData"]

log = logging.getLogger(__name__)

# Per-channel statistics of the official training sets on the [0, 1] scale (the usual
# constants).
CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}


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


def _decode_jpegs(buf: np.ndarray, offsets: np.ndarray, path: Path | str = "npz",
                  rows: np.ndarray | None = None) -> np.ndarray:
    """The ``uint8 (N, 32, 32, 3)`` images of the JPEG bytes ``buf`` cut at
    ``offsets`` (``rows``: only these images, in this order)."""
    from PIL import Image, UnidentifiedImageError

    if int(offsets[-1]) != buf.size:
        raise ValueError(f"{path}: the offsets end at byte {int(offsets[-1])}, the "
                         f"JPEG buffer holds {buf.size}")
    order = range(len(offsets) - 1) if rows is None else rows
    out = np.empty((len(order), 32, 32, 3), dtype=np.uint8)
    for j, i in enumerate(order):
        raw = buf[offsets[i]:offsets[i + 1]].tobytes()
        try:
            out[j] = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
        except (OSError, ValueError, UnidentifiedImageError) as exc:
            raise ValueError(f"{path}: image {i} is not a 32x32 JPEG "
                             f"({type(exc).__name__}: {exc})") from exc
    return out


def file_fingerprint(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """BLAKE2b-128 of the content of ``path`` (and its size): equal for equal files
    wherever they lie. Remembered per process for an unchanged file (same path, inode,
    size and change times): a sweep checks the data of every run it would skip."""
    path = Path(path)
    st = path.stat()
    memo = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if memo not in _FINGERPRINTS:
        h = hashlib.blake2b(digest_size=16)
        h.update(str(st.st_size).encode())
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
        _FINGERPRINTS[memo] = h.hexdigest()
    return _FINGERPRINTS[memo]


_FINGERPRINTS: dict[tuple, str] = {}


def _write_decode_cache(
    x: np.ndarray, key: dict, path: Path, split: str, candidates: list[Path]
) -> None:
    """Store the decoded images and their key in the first writable folder of
    ``candidates`` (see :func:`load_jpeg_npz`)."""
    for c in candidates:
        f = c / f"{path.stem}_{split}_x.npy"
        try:
            c.mkdir(parents=True, exist_ok=True)
            tmp = c / f".{f.name}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                np.save(fh, x)
            ktmp = c / f".{f.name}.key.{os.getpid()}.tmp"
            ktmp.write_text(json.dumps(key), encoding="utf-8")
            # images first, then the key: a crash in between leaves a stale key
            os.replace(tmp, f)
            os.replace(ktmp, c / f"{path.stem}_{split}_x.key.json")
            break
        except OSError as exc:
            log.info("cannot cache decoded images in %s (%s)", c, exc)


def _read_decode_cache(path: Path, split: str, key: dict, n: int,
                       candidates: list[Path]) -> np.ndarray | None:
    """The decoded images of ``path``'s ``split`` (``n`` of them) from the first folder
    of ``candidates`` whose cache matches ``key``; ``None`` if none does."""
    x = None
    for c in candidates:
        f = c / f"{path.stem}_{split}_x.npy"
        kf = c / f"{path.stem}_{split}_x.key.json"
        if f.is_file():
            try:
                stored = (
                    json.loads(kf.read_text(encoding="utf-8")) if kf.is_file() else None
                )
            except (json.JSONDecodeError, UnicodeDecodeError):
                stored = None
            if stored != key:
                log.warning(
                    "decode cache %s does not match %s (source changed or key "
                    "missing): rebuilding",
                    f,
                    path,
                )
                continue
            try:
                x = np.load(f)
            except (OSError, ValueError, EOFError) as exc:
                log.warning("decode cache %s unreadable (%s): rebuilding", f, exc)
                continue
            if x.shape != (n, 32, 32, 3):
                log.warning("ignoring cache %s with shape %s", f, x.shape)
                x = None
            else:
                break
    return x


def load_jpeg_npz(path: str | os.PathLike, split: str,
                  cache_dir: str | os.PathLike | None = None,
                  official_order: bool = True,
                  rows: Callable[[int], np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Decode one split of a JPEG npz (``{split}_jpeg``, ``{split}_offsets``,
    ``y_{split}``).

    The decoded ``uint8`` array is cached as ``<stem>_<split>_x.npy`` in ``cache_dir``
    (default: :func:`kwng.scale_switch.cache_dir`, ``$KWNG_CACHE`` or ``~/.cache/kwng``;
    never beside the npz) so that the decode (a few seconds) happens once. The cache is
    used only if its key file ``<stem>_<split>_x.key.json`` holds the npz's current
    :func:`file_fingerprint`; otherwise (npz replaced, key missing, shape wrong) it is
    rebuilt. With ``official_order`` and a ``train_official_perm`` key, training rows
    are put in the order of the official ``data_batch`` files.

    ``rows`` — a function of the split's size ``n`` that returns the indices (into the
    returned order) to keep: only those images are returned, and without a complete
    cache only those are decoded (and nothing is cached).
    """
    check_choice(split, "split", ("train", "test"))
    path = Path(path)
    z, y, off = _npz_split(path, split)
    key = {"source_fingerprint": file_fingerprint(path), "split": split}
    candidates = [Path(cache_dir) if cache_dir is not None else config.cache_dir()]
    perm = (np.asarray(z["train_official_perm"])
            if split == "train" and official_order and "train_official_perm" in z.files
            else None)
    x = _read_decode_cache(path, split, key, len(y), candidates)
    keep = None if rows is None else np.asarray(rows(len(y)), dtype=np.int64)
    if x is None and keep is not None:  # decode the kept images only
        stored = keep if perm is None else perm[keep]
        log.info("decoding %d of %d %s JPEGs from %s", len(stored), len(y), split,
                 path)
        return _decode_jpegs(z[f"{split}_jpeg"], off, path, stored), y[stored]
    if x is None:
        log.info("decoding %d %s JPEGs from %s", len(y), split, path)
        x = _decode_jpegs(z[f"{split}_jpeg"], off, path)
        _write_decode_cache(x, key, path, split, candidates)
    if perm is not None:
        x, y = x[perm], y[perm]
    return (x, y) if keep is None else (x[keep], y[keep])


# ---------------------------------------------------------------------- augmentation
def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``uint8 (B, 3, H, W)`` → ``(x / 255 - mean) / std`` per channel, in the dtype of
    ``mean``."""
    mean, std = mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)
    return (x.to(mean.dtype).div_(255.0) - mean) / std


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


class GPUAugmentedData:
    """A labelled image set held on ``device`` as ``uint8 (N, 3, 32, 32)``, with
    on-device augmentation.

    ``x`` is ``uint8 (N, 32, 32, 3)`` (numpy or tensor), ``y`` integer labels.
    :meth:`batches` yields normalised batches of floating ``dtype`` (augmented when
    ``augment``) in an order drawn from the CPU ``generator``; :meth:`eval_batches`
    yields the data in order without augmentation.
    """

    def __init__(
        self, x, y, dataset: str = "cifar10", device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check_choice(dataset, "dataset", tuple(CIFAR_MEAN))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
        x = torch.as_tensor(np.asarray(x))
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[-1] != 3:
            raise ValueError(
                f"x must be uint8 of shape (N, H, W, 3), got {x.dtype} {tuple(x.shape)}"
            )
        y = torch.as_tensor(np.asarray(y), dtype=torch.long)
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},), got {tuple(y.shape)}")
        self.device = torch.device(device)
        self.x = x.permute(0, 3, 1, 2).contiguous().to(self.device)
        self.y = y.to(self.device)
        self.mean = torch.tensor(CIFAR_MEAN[dataset], device=self.device, dtype=dtype)
        self.std = torch.tensor(CIFAR_STD[dataset], device=self.device, dtype=dtype)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        n = len(self)
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, batch_size: int, generator: torch.Generator, augment: bool = True,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of ``(z, y)`` batches: a fresh permutation, then per-batch
        crop/flip/normalise.

        Every draw of the epoch (the permutation, then each batch's crop offsets and
        flips, in that order) is made on the CPU ``generator`` before the first batch
        and copied to the device once: the batches then cost no host-to-device copy
        (which would wait for the device)."""
        check_int(batch_size, "batch_size", 1)
        n = len(self)
        nb = self.num_batches(batch_size, drop_last)
        perm = torch.randperm(n, generator=generator)
        draws = [draw_augmentation(min(batch_size, n - k * batch_size), generator)
                 for k in range(nb)] if augment else []
        perm = perm.to(self.device)
        if augment:
            ox, oy, flip = (torch.cat(t).to(self.device) for t in zip(*draws))
        for k in range(nb):
            sl = slice(k * batch_size, (k + 1) * batch_size)
            idx = perm[sl]
            xb = self.x[idx]
            if augment:
                xb = apply_augmentation(xb, ox[sl], oy[sl], flip[sl])
            yield normalize(xb, self.mean, self.std), self.y[idx]

    def eval_batches(
        self, batch_size: int = 1000
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        check_int(batch_size, "batch_size", 1)
        for k in range(0, len(self), batch_size):
            yield (
                normalize(self.x[k : k + batch_size], self.mean, self.std),
                self.y[k : k + batch_size],
            )
