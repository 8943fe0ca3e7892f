"""CIFAR-10 / CIFAR-100 data for the classification study (paper §4.2, App. D.2).

Three sources, all returning ``uint8`` images of shape ``(N, 32, 32, 3)`` and ``int64`` labels:

* the **official python-format archives** (``cifar-10-batches-py/data_batch_{1..5}, test_batch``,
  ``cifar-100-python/{train,test,meta}``), read with :func:`read_official_cifar` and, where the user
  has internet and torchvision, downloaded by :func:`download_official`;
* the **offline JPEG copy** of CIFAR-10 (``cifar10_jpeg.npz``: the original JPEG bytes of every image,
  quality 75), decoded once with Pillow by :func:`load_jpeg_npz` and cached as ``.npy`` arrays keyed
  by the npz's content hash (:func:`file_fingerprint`), so a replaced npz is decoded again;
* the **committed sample** (``kwng/experiments/cifar/data_sample/cifar10_sample.npz``: 500 train + 200 test images taken
  from the offline copy), read by :func:`load_sample`, for tests and the book's live run.

:func:`load_cifar` picks a source. :class:`GPUAugmentedData` keeps a whole training set on the compute
device as ``uint8`` and does the paper's augmentation there (random crop of the 4-pixel zero-padded
image, horizontal flip, per-channel normalisation), so that producing a batch costs a few kernel
launches; its batch order and augmentation draws come from a seeded CPU :class:`torch.Generator`
whose state is checkpointed for exact resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kwng._checks import check_choice, check_int
from kwng.config import REPO_ROOT
from kwng.experiments.cifar.images import (
    _check_labels,
    _decode_jpegs,
    _npz_split,
    apply_augmentation,
    draw_augmentation,
    normalize,
)

__all__ = ["DATASETS", "SOURCES", "NUM_CLASSES", "CIFAR_MEAN", "CIFAR_STD", "SAMPLE_PATH",
           "read_official_cifar", "write_official_cifar", "load_jpeg_npz",
           "load_sample", "download_official", "find_source", "file_fingerprint",
           "source_fingerprint", "load_cifar", "GPUAugmentedData"]

log = logging.getLogger(__name__)

DATASETS = ("cifar10", "cifar100")
#: where the images come from (:func:`load_cifar`)
SOURCES = ("auto", "official", "jpeg", "sample")
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
# Per-channel statistics of the official training sets on the [0, 1] scale (the usual constants).
CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}
SAMPLE_PATH = Path(__file__).resolve().parent / "data_sample" / "cifar10_sample.npz"


_OFFICIAL_DIR = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_JPEG_NAME = {"cifar10": "cifar10_jpeg.npz", "cifar100": "cifar100_jpeg.npz"}


# ----------------------------------------------------------------------------------- official format
def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a readable CIFAR archive file ({type(exc).__name__}: {exc})") from exc


def _get(d: dict, key: str):
    """Pickles written by Python 2 have ``bytes`` keys, newer ones ``str`` keys."""
    if key in d:
        return d[key]
    return d[key.encode()]


def read_official_cifar(directory: str | os.PathLike, dataset: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one split of an official python-format archive.

    ``directory`` is the extracted folder (``cifar-10-batches-py`` or ``cifar-100-python``) or its parent.
    CIFAR-100 uses the fine labels. Returns ``(x, y)``: ``uint8 (N, 32, 32, 3)`` and ``int64 (N,)``.
    ``dataset`` is one of :data:`DATASETS` (:func:`load_cifar` checks it).
    """
    check_choice(split, "split", ("train", "test"))
    directory = Path(directory)
    if (directory / _OFFICIAL_DIR[dataset]).is_dir():
        directory = directory / _OFFICIAL_DIR[dataset]
    if dataset == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        label_key = "labels"
    else:
        names = [split]
        label_key = "fine_labels"
    xs, ys = [], []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"official {dataset} file missing: {path}")
        d = _unpickle(path)
        data = np.asarray(_get(d, "data"), dtype=np.uint8)
        xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(_check_labels(np.asarray(_get(d, label_key), dtype=np.int64), NUM_CLASSES[dataset], str(path)))
        if len(ys[-1]) != len(xs[-1]):
            raise ValueError(f"{path}: {len(xs[-1])} images but {len(ys[-1])} labels")
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def write_official_cifar(directory: str | os.PathLike, dataset: str, x_train: np.ndarray, y_train: np.ndarray,
                         x_test: np.ndarray, y_test: np.ndarray) -> Path:
    """Write arrays in the official python pickle layout (used by the tests to build tiny archives).

    Mirrors the official files: ``bytes`` keys, ``data`` as ``uint8 (N, 3072)`` in channel-major order,
    CIFAR-10 training data split over five ``data_batch_k`` files, CIFAR-100 with ``fine_labels``,
    ``coarse_labels`` and a ``meta`` file. Returns the archive folder.
    """
    check_choice(dataset, "dataset", DATASETS)
    out = Path(directory) / _OFFICIAL_DIR[dataset]
    out.mkdir(parents=True, exist_ok=True)

    def flat(x):
        return np.ascontiguousarray(np.asarray(x, dtype=np.uint8).transpose(0, 3, 1, 2).reshape(len(x), -1))

    def dump(name, obj):
        with open(out / name, "wb") as fh:
            pickle.dump(obj, fh, protocol=2)

    if dataset == "cifar10":
        for k, idx in enumerate(np.array_split(np.arange(len(x_train)), 5), start=1):
            dump(f"data_batch_{k}", {b"batch_label": f"training batch {k} of 5".encode(),
                                     b"labels": [int(v) for v in y_train[idx]], b"data": flat(x_train[idx])})
        dump("test_batch", {b"batch_label": b"testing batch 1 of 1", b"labels": [int(v) for v in y_test],
                            b"data": flat(x_test)})
        dump("batches.meta", {b"label_names": [f"class{i}".encode() for i in range(10)]})
    else:
        for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            dump(name, {b"filenames": [f"{i}.png".encode() for i in range(len(x))],
                        b"fine_labels": [int(v) for v in y], b"coarse_labels": [int(v) // 5 for v in y],
                        b"data": flat(x)})
        dump("meta", {b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
                      b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]})
    return out


def download_official(root: str | os.PathLike, dataset: str) -> Path:
    """Download (and extract) the official archive through torchvision into ``root``.

    Needs torchvision and internet access; raises ``RuntimeError`` otherwise (never silently skipped).
    """
    try:
        import torchvision.datasets as tvd
    except ImportError as exc:
        raise RuntimeError("torchvision is needed to download the official CIFAR archives") from exc
    cls = tvd.CIFAR10 if dataset == "cifar10" else tvd.CIFAR100
    root = Path(root)
    log.info("downloading official %s archive into %s", dataset, root)
    cls(str(root), train=True, download=True)
    return root / _OFFICIAL_DIR[dataset]


# ------------------------------------------------------------------------------------------ identity
def file_fingerprint(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """BLAKE2b-128 of the content of ``path`` (and its size): equal for equal files wherever they lie.
    Remembered per process for an unchanged file (same path, inode, size and change times): a
    sweep checks the data of every run it would skip."""
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


def source_fingerprint(dataset: str, data_root: str | os.PathLike | None = None, source: str = "auto") -> str:
    """``"<kind>:<hash>"`` identifying the data :func:`load_cifar` would read with these arguments:
    the content hash of the npz or of the official files (not their paths). Raises as
    :func:`find_source` when there is no data."""
    check_choice(dataset, "dataset", DATASETS)
    check_choice(source, "source", SOURCES)
    if source == "sample":
        return f"sample:{file_fingerprint(SAMPLE_PATH)}"
    kind, where = find_source(dataset, data_root)
    if kind == "jpeg":
        return f"jpeg:{file_fingerprint(where)}"
    folder = where / _OFFICIAL_DIR[dataset] if (where / _OFFICIAL_DIR[dataset]).is_dir() else where
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(f"{f.name}:{file_fingerprint(f)}".encode())
    return f"official:{h.hexdigest()}"


# ------------------------------------------------------------------------------------------ JPEG npz
def _write_decode_cache(x: np.ndarray, key: dict, path: Path, split: str, candidates: list[Path]) -> None:
    """Store the decoded images and their key in the first writable folder of ``candidates``
    (see :func:`load_jpeg_npz`)."""
    for c in candidates:
        f = c / f"{path.stem}_{split}_x.npy"
        try:
            c.mkdir(parents=True, exist_ok=True)
            tmp = c / f".{f.name}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                np.save(fh, x)
            ktmp = c / f".{f.name}.key.{os.getpid()}.tmp"
            ktmp.write_text(json.dumps(key), encoding="utf-8")
            os.replace(tmp, f)  # images first, then the key: a crash in between leaves a stale key
            os.replace(ktmp, c / f"{path.stem}_{split}_x.key.json")
            break
        except OSError as exc:
            log.info("cannot cache decoded images in %s (%s)", c, exc)


def load_jpeg_npz(path: str | os.PathLike, split: str, cache_dir: str | os.PathLike | None = None,
                  official_order: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Decode one split of a JPEG npz (``{split}_jpeg``, ``{split}_offsets``, ``y_{split}``).

    The decoded ``uint8`` array is cached as ``<stem>_<split>_x.npy`` in ``cache_dir`` (default: next to
    the npz, or ``~/.cache/kwng`` if that folder is read-only) so that the decode (a few seconds) happens
    once. The cache is used only if its key file ``<stem>_<split>_x.key.json`` holds the npz's current
    :func:`file_fingerprint`; otherwise (npz replaced, key missing, shape wrong) it is rebuilt.
    With ``official_order`` and a ``train_official_perm`` key, training rows are put in the order of the
    official ``data_batch`` files.
    """
    check_choice(split, "split", ("train", "test"))
    path = Path(path)
    z, y, off = _npz_split(path, split)
    key = {"source_fingerprint": file_fingerprint(path), "split": split}
    candidates = [Path(cache_dir)] if cache_dir is not None else [path.parent, Path.home() / ".cache" / "kwng"]
    x = None
    for c in candidates:
        f = c / f"{path.stem}_{split}_x.npy"
        kf = c / f"{path.stem}_{split}_x.key.json"
        if f.is_file():
            try:
                stored = json.loads(kf.read_text(encoding="utf-8")) if kf.is_file() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                stored = None
            if stored != key:
                log.warning("decode cache %s does not match %s (source changed or key missing): rebuilding", f, path)
                continue
            try:
                x = np.load(f)
            except (OSError, ValueError, EOFError) as exc:
                log.warning("decode cache %s unreadable (%s): rebuilding", f, exc)
                continue
            if x.shape != (len(y), 32, 32, 3):
                log.warning("ignoring cache %s with shape %s", f, x.shape)
                x = None
            else:
                break
    if x is None:
        log.info("decoding %d %s JPEGs from %s", len(y), split, path)
        x = _decode_jpegs(z[f"{split}_jpeg"], off, path)
        _write_decode_cache(x, key, path, split, candidates)
    if split == "train" and official_order and "train_official_perm" in z.files:
        perm = np.asarray(z["train_official_perm"])
        x, y = x[perm], y[perm]
    return x, y


def load_sample(split: str, path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The committed CIFAR-10 sample (500 train + 200 test images, see ``kwng/experiments/cifar/data_sample/README.md``)."""
    check_choice(split, "split", ("train", "test"))
    path = SAMPLE_PATH if path is None else Path(path)
    z, y, off = _npz_split(path, split)
    return _decode_jpegs(z[f"{split}_jpeg"], off, path), y


# ------------------------------------------------------------------------------------------ dispatch
def _default_roots() -> list[Path]:
    repo = REPO_ROOT
    roots = [repo / ".data", repo.parent / "shared" / "data", Path.home() / ".cache" / "kwng"]
    if os.environ.get("KWNG_DATA"):
        roots.insert(0, Path(os.environ["KWNG_DATA"]))
    return roots


def find_source(dataset: str, data_root: str | os.PathLike | None = None) -> tuple[str, Path]:
    """Locate data for ``dataset``: ``("official", folder)`` or ``("jpeg", npz path)``.

    An explicit ``data_root`` (a folder or an npz file) is the only place searched: if it does not
    exist or holds no data for ``dataset`` that is an error, never a silent fall-back to other
    folders. Without it: ``$KWNG_DATA``, ``<repo>/.data``, ``<repo>/../shared/data`` and
    ``~/.cache/kwng``. Official archives are preferred to the JPEG copy.
    Raises ``FileNotFoundError`` listing the places searched. ``dataset`` is one of
    :data:`DATASETS` (:func:`load_cifar` and :func:`source_fingerprint` check it).
    """
    if data_root is not None and not Path(data_root).exists():
        raise FileNotFoundError(f"data_root {str(data_root)!r} does not exist (check --data-root)")
    roots = [Path(data_root)] if data_root is not None else _default_roots()
    for r in roots:
        if r.is_file() and r.suffix == ".npz":
            return "jpeg", r
    for r in roots:
        if (r / _OFFICIAL_DIR[dataset]).is_dir() or (r.name == _OFFICIAL_DIR[dataset] and r.is_dir()):
            return "official", r
    for r in roots:
        if (r / _JPEG_NAME[dataset]).is_file():
            return "jpeg", r / _JPEG_NAME[dataset]
    raise FileNotFoundError(f"no {dataset} data found in {[str(r) for r in roots]}; pass --data-root "
                            "(a folder or an npz file), or --download to fetch the official archive with torchvision")


def load_cifar(dataset: str, split: str, data_root: str | os.PathLike | None = None, source: str = "auto",
               download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Load ``(x, y)`` for ``dataset`` in {cifar10, cifar100} and ``split`` in {train, test}.

    ``source``: ``"auto"`` (:func:`find_source`, downloading through torchvision into ``data_root`` if
    nothing is found and ``download``), ``"official"``, ``"jpeg"`` or ``"sample"`` (CIFAR-10 only).
    """
    check_choice(dataset, "dataset", DATASETS)
    check_choice(split, "split", ("train", "test"))
    check_choice(source, "source", SOURCES)
    if source == "sample":
        if dataset != "cifar10":
            raise ValueError(f"source='sample' exists for dataset='cifar10' only, got dataset={dataset!r}")
        return load_sample(split)
    try:
        kind, where = find_source(dataset, data_root)
    except FileNotFoundError:
        if not download:
            raise
        if data_root is not None:
            Path(data_root).mkdir(parents=True, exist_ok=True)
        kind, where = "official", download_official(data_root or _default_roots()[-1], dataset)
    if source != "auto" and kind != source:
        raise FileNotFoundError(f"asked for source={source!r} but found {kind} data at {where}")
    if kind == "official":
        return read_official_cifar(where, dataset, split)
    return load_jpeg_npz(where, split)


class GPUAugmentedData:
    """A labelled image set held on ``device`` as ``uint8 (N, 3, 32, 32)``, with on-device augmentation.

    ``x`` is ``uint8 (N, 32, 32, 3)`` (numpy or tensor), ``y`` integer labels. :meth:`batches` yields
    normalised float batches (augmented when ``augment``) in an order drawn from the CPU ``generator``;
    :meth:`eval_batches` yields the data in order without augmentation.
    """

    def __init__(self, x, y, dataset: str = "cifar10", device: str | torch.device = "cpu") -> None:
        check_choice(dataset, "dataset", DATASETS)
        x = torch.as_tensor(np.asarray(x))
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[-1] != 3:
            raise ValueError(f"x must be uint8 of shape (N, H, W, 3), got {x.dtype} {tuple(x.shape)}")
        y = torch.as_tensor(np.asarray(y), dtype=torch.long)
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},), got {tuple(y.shape)}")
        self.device = torch.device(device)
        self.x = x.permute(0, 3, 1, 2).contiguous().to(self.device)
        self.y = y.to(self.device)
        self.mean = torch.tensor(CIFAR_MEAN[dataset], device=self.device)
        self.std = torch.tensor(CIFAR_STD[dataset], device=self.device)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def num_batches(self, batch_size: int, drop_last: bool = False) -> int:
        n = len(self)
        return n // batch_size if drop_last else -(-n // batch_size)

    def batches(self, batch_size: int, generator: torch.Generator, augment: bool = True,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of ``(z, y)`` batches: a fresh permutation, then per-batch crop/flip/normalise.

        Every draw of the epoch (the permutation, then each batch's crop offsets and flips, in that
        order) is made on the CPU ``generator`` before the first batch and copied to the device once:
        the batches then cost no host-to-device copy (which would wait for the device)."""
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

    def eval_batches(self, batch_size: int = 1000) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        check_int(batch_size, "batch_size", 1)
        for k in range(0, len(self), batch_size):
            yield normalize(self.x[k:k + batch_size], self.mean, self.std), self.y[k:k + batch_size]
