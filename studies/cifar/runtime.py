"""What one CIFAR run needs around its training loop: where its record and checkpoint
live, its step size and identity, its data split, the RNG states of an exact resume, the
device's fast settings, and the processes that train it together
(:func:`process_group`, :func:`rank0_decides`)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from studies.cifar.config import RunConfig
from studies.cifar.data import load_cifar
from studies.cifar.methods import AUTHORS100, METHODS, SELECTION
from studies.kit import guard
from studies.kit.provenance import ResultFileError, read_json

log = logging.getLogger(__name__)


def run_dir_for(cfg: RunConfig | dict) -> Path:
    """``<out>/<dataset>/<conditioning>/<method>/seed<k>``: where a run writes."""
    cfg = RunConfig.of(cfg)
    return (
        Path(cfg.out)
        / cfg.dataset
        / cfg.conditioning
        / cfg.method
        / f"seed{cfg.seed}"
    )


def checkpoint_path_for(cfg: RunConfig | dict) -> Path:
    """The run's checkpoint, under ``checkpoint_dir`` (an absolute run directory is
    hashed)."""
    cfg = RunConfig.of(cfg)
    rd = run_dir_for(cfg)
    if rd.is_absolute():
        rd = Path("abs") / hashlib.sha1(str(rd).encode()).hexdigest()[:16]
    return Path(cfg.checkpoint_dir) / rd / "checkpoint.pt"


def resolve_lr(cfg: RunConfig) -> float:
    """The step size: a number, or the one chosen by ``select`` for the method (or its
    ``lr_from``)."""
    if cfg.lr != "selected":
        return float(cfg.lr)
    path = Path(cfg.selection_file or SELECTION / "selected.json")
    if not path.is_file():
        raise FileNotFoundError(
            f"lr='selected' needs {path} (run `cifar select` first) or pass --lr"
        )
    table = read_json(path)["selected"]
    base = cfg.spec.get("lr_from", cfg.method)
    key = f"{cfg.dataset}/{cfg.conditioning}/{base}"
    if key not in table:
        prefix = f"{cfg.dataset}/{cfg.conditioning}/"
        chosen = ", ".join(k[len(prefix):] for k in sorted(table)
                           if k.startswith(prefix)) or "none"
        raise ValueError(f"lr='selected': {path} holds no step size for {key} "
                         f"(for {prefix} it has {chosen}); pass --lr, or run `cifar "
                         f"select` on a selection that includes {base!r}")
    return float(table[key]["lr"])


def split_data(cfg: RunConfig):
    """Training / evaluation arrays. With ``val_size`` > 0 (step-size selection) the
    evaluation set is held out of the training set (the test set is not looked at);
    ``train_subset`` keeps that many (only those images are decoded from a JPEG npz)."""
    held = {}

    def rows(n: int) -> np.ndarray:
        """The training rows to load: the subset, then the held-out split."""
        if cfg.val_size and cfg.val_size >= n:
            raise ValueError(
                f"val_size must be smaller than the training set ({n} "
                f"images), got {cfg.val_size}: nothing left to train on"
            )
        perm = np.random.default_rng(12345).permutation(n)
        if cfg.val_size:
            val, rest = perm[: cfg.val_size], perm[cfg.val_size :]
            rest = rest[: cfg.train_subset] if cfg.train_subset else rest
            held["train"] = len(rest)
            return np.concatenate([rest, val])
        return np.sort(perm[: cfg.train_subset])

    x, y = load_cifar(
        cfg.dataset, "train", cfg.data_root, cfg.source, cfg.download,
        rows=rows if cfg.val_size or cfg.train_subset else None,
    )
    if cfg.val_size:
        k = held["train"]
        return x[:k], y[:k], x[k:], y[k:]
    xt, yt = load_cifar(
        cfg.dataset, "test", cfg.data_root, cfg.source, cfg.download
    )
    return x, y, xt, yt


def test_arrays(cfg: RunConfig):
    """The test set's images and labels (evaluated beside the validation split when
    ``eval_test``)."""
    return load_cifar(cfg.dataset, "test", cfg.data_root, cfg.source,
                      cfg.download)


def rng_state(device: torch.device) -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fast_cuda(device: torch.device) -> None:
    """cuDNN autotuning and TF32 matrix products on a CUDA device."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def save_checkpoint(path: Path, ck: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ck, tmp)
    os.replace(tmp, path)


#: The seconds that pass between two end-of-epoch checkpoints of a run. A checkpoint
#: of an amortized KWNG run holds the cached M × q system (about 220 MB for the
#: ResNet-18), and writing it after every epoch cost about 0.5 s an epoch, a third of
#: an epoch of training. A run killed outright loses at most this much; a deadline, a
#: stop after an epoch and the first epoch of a process still checkpoint at once.
CHECKPOINT_EVERY_S = 60.0


class CheckpointClock:
    """When a run checkpoints at the end of epoch ``done`` (counted from 1): the first
    time it is asked in this process (so that a record on disk always has a checkpoint
    beside it), when the run stops after this epoch (``done`` reaches ``stop_after``),
    and otherwise once :data:`CHECKPOINT_EVERY_S` seconds have passed since the last
    checkpoint.

    >>> clock = CheckpointClock(every_s=3600)
    >>> clock.due(1, None), clock.due(2, None), clock.due(3, 3)
    (True, False, True)
    """

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = CHECKPOINT_EVERY_S if every_s is None else every_s
        self.last: float | None = None

    def due(self, done: int, stop_after: int | None) -> bool:
        now, stopping = time.monotonic(), stop_after is not None and done >= stop_after
        if stopping or self.last is None or now - self.last >= self.every_s:
            self.last = now
            return True
        return False


def past(deadline: float | None) -> bool:
    """Whether the Unix time ``deadline`` has passed (checked once per batch by
    :func:`studies.cifar.train.run`)."""
    return deadline is not None and time.time() > deadline


def run_identity_of(cfg: RunConfig, lr: float) -> dict:
    """The identity of the run ``cfg`` at step size ``lr``
    (:func:`studies.kit.guard.run_identity` with the fingerprint of its data)."""
    from studies.cifar.data import source_fingerprint

    try:
        data = source_fingerprint(cfg.dataset, cfg.data_root, cfg.source)
    except FileNotFoundError:
        if not cfg.download:
            raise
        data = None  # fetched by this run; not compared
    return guard.run_identity(cfg.to_dict(), lr, cfg.batch, cfg.spec, data)


def process_group() -> tuple[int, int]:
    """This process's rank and the number of processes that train the run together:
    from ``torch.distributed`` when its process group is initialised (torchrun), else
    ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank0_decides(decide, world: int):
    """``decide()`` on rank 0 (the one process that reads and writes the run's files),
    its result on every rank; a refusal there raises the same error on every rank."""
    if world == 1:
        return decide()
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (decide(), None)
        except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError,
                ValueError) as exc:
            box[0] = (None, exc)
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


# ------------------------------------------------- how long a run takes, for the queues
#: seconds a worker needs beside training and evaluation (start, data, capture)
START_S = 60.0
#: factor on the fastest finished run of a method, for a run on a GPU of its own
RUN_MARGIN = 1.15


def wall_times(root: Path) -> dict[str, float]:
    """Per method, the wall time (training and evaluation) of its fastest finished,
    not stopped, 100-epoch run under ``root``."""
    times: dict[str, float] = {}
    for mp in root.glob("**/seed*/metrics.json"):
        rec = read_json(mp)
        rows = rec.get("epochs") if isinstance(rec, dict) else None
        if rows and rec.get("complete") and not rec.get("early_stop") \
                and len(rows) == 100 and "time_train" in rows[-1]:
            t = rows[-1]["time_train"] + sum(r.get("time_eval", 0.0) for r in rows)
            m = rec["config"]["method"]
            times[m] = min(times.get(m, math.inf), t)
    return times


def run_seconds(root: str | os.PathLike,
                fallback: str | os.PathLike | None = AUTHORS100) -> dict[str, float]:
    """Per method, the wall time (training and evaluation) of its fastest finished
    100-epoch run under ``root`` or ``fallback`` (the authors100 study), times
    :data:`RUN_MARGIN`, plus :data:`START_S`: the estimate that keeps a queue from
    starting a run it cannot finish. The queue runs one run per GPU, and the fastest
    record is the one that shared its GPU least. A method without any finished run gets
    the estimate of :func:`estimate_seconds`."""
    times = wall_times(Path(root))
    for m, t in (wall_times(Path(fallback)) if fallback is not None else {}).items():
        times[m] = min(t, times.get(m, math.inf))
    return {m: t * RUN_MARGIN + START_S for m, t in times.items()}


def estimate_seconds(times: dict[str, float], method: str) -> float | None:
    """A method's own estimate or that of the same method without the refresh guard
    (the smaller); a KWNG variant (the same Jacobian block, another damping, kernel or
    momentum) at most KWNG's; an (E)KFAC method without a run
    KFAC's, scaled by their planning weights (``rel_cost``); a first-order or modern
    optimizer without a run SGD's times its ``rel_cost`` (at least 1); else the longest
    method's, twice that for KFAC/EKFAC."""
    precond = METHODS[method].spec.get("precond")
    own = [times[k] for k in (method,) if k in times]
    # the same method without the refresh guard (a guard adds refreshes, not steps) and
    # with the default fallback (a skipped step costs what a fallback does)
    bare = {k: v for k, v in METHODS[method].spec.items()
            if k not in ("refresh_guard", "fallback")}
    twin = [t for k, t in times.items() if k in METHODS and METHODS[k].spec == bare]
    if precond == "kwng" and "kwng" in times:
        own.append(times["kwng"])
    if own or twin:
        return min(own + twin)
    if not times:
        return None
    if precond in ("kfac", "ekfac") and "kfac" in times:
        return times["kfac"] * METHODS[method].rel_cost / METHODS["kfac"].rel_cost
    if precond is None and "sgd" in times:
        # a whole SGD run scaled by the step's planning weight: an upper estimate, as
        # the data, evaluation and checkpoints of a run do not scale with its step
        return times["sgd"] * max(METHODS[method].rel_cost, 1.0)
    return max(times.values()) * (2.0 if precond in ("kfac", "ekfac") else 1.0)
