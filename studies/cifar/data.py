"""CIFAR-10 / CIFAR-100 data for the classification study (paper §4.2, App. D.2).

Three sources, all returning ``uint8`` images of shape ``(N, 32, 32, 3)`` and ``int64``
labels:

* the **official python-format archives** (``cifar-10-batches-py/data_batch_{1..5},
  test_batch``, ``cifar-100-python/{train,test,meta}``), read with
  :func:`read_official_cifar` and, where the user has internet and torchvision,
  downloaded by :func:`download_official`;
* the **offline JPEG copy** of CIFAR-10 (``cifar10_jpeg.npz``: the original JPEG bytes
  of every image, quality 75), decoded once with Pillow by
  :func:`~studies.cifar.images.load_jpeg_npz` and cached as ``.npy`` arrays
  in the user's cache folder (``$KWNG_CACHE``, default ``~/.cache/kwng``) keyed by the
  npz's content hash
  (:func:`~studies.cifar.images.file_fingerprint`), so a replaced npz is
  decoded again;
* the **committed sample** (``studies/cifar/data_sample/cifar10_sample.npz``:
  500 train + 200 test images taken from the offline copy), read by :func:`load_sample`,
  for tests and the book's live run.

:func:`load_cifar` picks a source.
:class:`~studies.cifar.images.GPUAugmentedData` keeps a whole training set on
the compute device as ``uint8`` and does the paper's augmentation there (random crop of
the 4-pixel zero-padded image, horizontal flip, per-channel normalisation), so that
producing a batch costs a few kernel launches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kwng._checks import check_choice
from kwng.scale_switch import REPO_ROOT
from studies.cifar.images import (
    _check_labels,
    _decode_jpegs,
    _npz_split,
    file_fingerprint,
    load_jpeg_npz,
)

__all__ = ["DATASETS", "SOURCES", "NUM_CLASSES", "SAMPLE_PATH", "read_official_cifar",
           "write_official_cifar", "load_sample", "download_official", "find_source",
           "source_fingerprint", "load_cifar"]

log = logging.getLogger(__name__)

DATASETS = ("cifar10", "cifar100")
#: where the images come from (:func:`load_cifar`)
SOURCES = ("auto", "official", "jpeg", "sample")
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
SAMPLE_PATH = Path(__file__).resolve().parent / "data_sample" / "cifar10_sample.npz"


_OFFICIAL_DIR = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
_JPEG_NAME = {"cifar10": "cifar10_jpeg.npz", "cifar100": "cifar100_jpeg.npz"}


# -----------------------------------------------------------------------------------
# official format
def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{path}: not a readable CIFAR archive file ({type(exc).__name__}: {exc})"
        ) from exc


def _get(d: dict, key: str):
    """Pickles written by Python 2 have ``bytes`` keys, newer ones ``str`` keys."""
    if key in d:
        return d[key]
    return d[key.encode()]


def read_official_cifar(
    directory: str | os.PathLike, dataset: str, split: str
) -> tuple[np.ndarray, np.ndarray]:
    """Read one split of an official python-format archive.

    ``directory`` is the extracted folder (``cifar-10-batches-py`` or
    ``cifar-100-python``) or its parent. CIFAR-100 uses the fine labels. Returns ``(x,
    y)``: ``uint8 (N, 32, 32, 3)`` and ``int64 (N,)``. ``dataset`` is one of
    :data:`DATASETS` (:func:`load_cifar` checks it).
    """
    check_choice(split, "split", ("train", "test"))
    directory = Path(directory)
    if (directory / _OFFICIAL_DIR[dataset]).is_dir():
        directory = directory / _OFFICIAL_DIR[dataset]
    if dataset == "cifar10":
        names = (
            [f"data_batch_{i}" for i in range(1, 6)]
            if split == "train"
            else ["test_batch"]
        )
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
        ys.append(
            _check_labels(
                np.asarray(_get(d, label_key), dtype=np.int64),
                NUM_CLASSES[dataset],
                str(path),
            )
        )
        if len(ys[-1]) != len(xs[-1]):
            raise ValueError(f"{path}: {len(xs[-1])} images but {len(ys[-1])} labels")
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def write_official_cifar(directory: str | os.PathLike, dataset: str,
                         x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                         y_test: np.ndarray) -> Path:
    """Write arrays in the official python pickle layout (used by the tests to build
    tiny archives).

    Mirrors the official files: ``bytes`` keys, ``data`` as ``uint8 (N, 3072)`` in
    channel-major order, CIFAR-10 training data split over five ``data_batch_k`` files,
    CIFAR-100 with ``fine_labels``, ``coarse_labels`` and a ``meta`` file. Returns the
    archive folder.
    """
    check_choice(dataset, "dataset", DATASETS)
    out = Path(directory) / _OFFICIAL_DIR[dataset]
    out.mkdir(parents=True, exist_ok=True)

    def flat(x):
        return np.ascontiguousarray(
            np.asarray(x, dtype=np.uint8).transpose(0, 3, 1, 2).reshape(len(x), -1)
        )

    def dump(name, obj):
        with open(out / name, "wb") as fh:
            pickle.dump(obj, fh, protocol=2)

    if dataset == "cifar10":
        for k, idx in enumerate(np.array_split(np.arange(len(x_train)), 5), start=1):
            dump(f"data_batch_{k}", {
                b"batch_label": f"training batch {k} of 5".encode(),
                b"labels": [int(v) for v in y_train[idx]],
                b"data": flat(x_train[idx])})
        dump("test_batch", {b"batch_label": b"testing batch 1 of 1",
                            b"labels": [int(v) for v in y_test], b"data": flat(x_test)})
        dump("batches.meta",
             {b"label_names": [f"class{i}".encode() for i in range(10)]})
    else:
        for name, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            dump(name, {b"filenames": [f"{i}.png".encode() for i in range(len(x))],
                        b"fine_labels": [int(v) for v in y],
                        b"coarse_labels": [int(v) // 5 for v in y],
                        b"data": flat(x)})
        dump("meta", {
            b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)]})
    return out


def download_official(root: str | os.PathLike, dataset: str) -> Path:
    """Download (and extract) the official archive through torchvision into ``root``.

    Needs torchvision and internet access; raises ``RuntimeError`` otherwise (never
    silently skipped).
    """
    try:
        import torchvision.datasets as tvd
    except ImportError as exc:
        raise RuntimeError(
            "torchvision is needed to download the official CIFAR archives"
        ) from exc
    cls = tvd.CIFAR10 if dataset == "cifar10" else tvd.CIFAR100
    root = Path(root)
    log.info("downloading official %s archive into %s", dataset, root)
    cls(str(root), train=True, download=True)
    return root / _OFFICIAL_DIR[dataset]


# --------------------------------------------------------------------------------------
# identity
def source_fingerprint(
    dataset: str, data_root: str | os.PathLike | None = None, source: str = "auto"
) -> str:
    """``"<kind>:<hash>"`` identifying the data :func:`load_cifar` would read with these
    arguments: the content hash of the npz or of the official files (not their paths).
    Raises as :func:`find_source` when there is no data."""
    check_choice(dataset, "dataset", DATASETS)
    check_choice(source, "source", SOURCES)
    if source == "sample":
        return f"sample:{file_fingerprint(SAMPLE_PATH)}"
    kind, where = find_source(dataset, data_root)
    if kind == "jpeg":
        return f"jpeg:{file_fingerprint(where)}"
    folder = (
        where / _OFFICIAL_DIR[dataset]
        if (where / _OFFICIAL_DIR[dataset]).is_dir()
        else where
    )
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(
        p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
    ):
        h.update(f"{f.name}:{file_fingerprint(f)}".encode())
    return f"official:{h.hexdigest()}"


# --------------------------------------------------------------------------------------
# the sample
def load_sample(
    split: str, path: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The committed CIFAR-10 sample (500 train + 200 test images, see
    ``studies/cifar/data_sample/README.md``)."""
    check_choice(split, "split", ("train", "test"))
    path = SAMPLE_PATH if path is None else Path(path)
    z, y, off = _npz_split(path, split)
    return _decode_jpegs(z[f"{split}_jpeg"], off, path), y


# --------------------------------------------------------------------------------------
# dispatch
def _default_roots() -> list[Path]:
    repo = REPO_ROOT
    roots = [
        repo / ".data",
        repo.parent / "shared" / "data",
        Path.home() / ".cache" / "kwng",
    ]
    if os.environ.get("KWNG_DATA"):
        roots.insert(0, Path(os.environ["KWNG_DATA"]))
    return roots


def find_source(
    dataset: str, data_root: str | os.PathLike | None = None
) -> tuple[str, Path]:
    """Locate data for ``dataset``: ``("official", folder)`` or ``("jpeg", npz path)``.

    An explicit ``data_root`` (a folder or an npz file) is the only place searched: if
    it does not exist or holds no data for ``dataset`` that is an error, never a silent
    fall-back to other folders. Without it: ``$KWNG_DATA``, ``<repo>/.data``,
    ``<repo>/../shared/data`` and ``~/.cache/kwng``. Official archives are preferred to
    the JPEG copy. Raises ``FileNotFoundError`` listing the places searched. ``dataset``
    is one of :data:`DATASETS` (:func:`load_cifar` and :func:`source_fingerprint` check
    it).
    """
    if data_root is not None and not Path(data_root).exists():
        raise FileNotFoundError(
            f"data_root {str(data_root)!r} does not exist (check --data-root)"
        )
    roots = [Path(data_root)] if data_root is not None else _default_roots()
    for r in roots:
        if r.is_file() and r.suffix == ".npz":
            return "jpeg", r
    for r in roots:
        if (r / _OFFICIAL_DIR[dataset]).is_dir() or (
            r.name == _OFFICIAL_DIR[dataset] and r.is_dir()
        ):
            return "official", r
    for r in roots:
        if (r / _JPEG_NAME[dataset]).is_file():
            return "jpeg", r / _JPEG_NAME[dataset]
    raise FileNotFoundError(
        f"no {dataset} data found in {[str(r) for r in roots]}; pass --data-root "
        "(a folder or an npz file), or --download to fetch the official archive with "
        "torchvision"
    )


def load_cifar(dataset: str, split: str, data_root: str | os.PathLike | None = None,
               source: str = "auto", download: bool = False,
               rows: Callable[[int], np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Load ``(x, y)`` for ``dataset`` in {cifar10, cifar100} and ``split`` in {train,
    test}.

    ``source``: ``"auto"`` (:func:`find_source`, downloading through torchvision into
    ``data_root`` if nothing is found and ``download``), ``"official"``, ``"jpeg"`` or
    ``"sample"`` (CIFAR-10 only). ``rows``: a function of the split's size that returns
    the indices of the images to keep (a subset); a JPEG npz then decodes only those
    (:func:`~studies.cifar.images.load_jpeg_npz`).
    """
    check_choice(dataset, "dataset", DATASETS)
    check_choice(split, "split", ("train", "test"))
    check_choice(source, "source", SOURCES)
    if source == "sample":
        if dataset != "cifar10":
            raise ValueError(
                "source='sample' exists for dataset='cifar10' only, got "
                f"dataset={dataset!r}"
            )
        return _keep(*load_sample(split), rows)
    try:
        kind, where = find_source(dataset, data_root)
    except FileNotFoundError:
        if not download:
            raise
        if data_root is not None:
            Path(data_root).mkdir(parents=True, exist_ok=True)
        kind, where = (
            "official",
            download_official(data_root or _default_roots()[-1], dataset),
        )
    if source != "auto" and kind != source:
        raise FileNotFoundError(
            f"asked for source={source!r} but found {kind} data at {where}"
        )
    if kind == "official":
        return _keep(*read_official_cifar(where, dataset, split), rows)
    return load_jpeg_npz(where, split, rows=rows)


def _keep(x: np.ndarray, y: np.ndarray, rows: Callable[[int], np.ndarray] | None
          ) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` at the indices ``rows(len(y))`` (all of them without ``rows``)."""
    if rows is None:
        return x, y
    keep = np.asarray(rows(len(y)), dtype=np.int64)
    return x[keep], y[keep]
