"""Where a data-parallel CIFAR run (:mod:`kwng.experiments.cifar.ddp`) keeps its record
and checkpoint: its identity and folder, and rank 0's decision to start, resume or skip,
shared with every rank."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kwng.experiments.guard import (
    ConfigMismatchError,
    backup,
    check_run_record,
    load_checkpoint,
)
from kwng.experiments.provenance import atomic_write_json, read_json

log = logging.getLogger(__name__)


def identity_of(args: argparse.Namespace, world: int, data: str) -> dict:
    """What must be equal for a run directory to be resumed or skipped."""
    return {"model": args.model, "epochs": args.epochs, "per_rank_batch": args.batch,
            "world_size": world, "lr": float(args.lr), "num_basis": args.num_basis,
            "seed": args.seed, "subset": args.subset, "precision": args.precision,
            "channels_last": args.device == "cuda", "schedule": "claim", "data": data}


def run_dir(args: argparse.Namespace, world: int) -> Path:
    return Path(args.out) / f"{args.model}-W{world}-B{args.batch}" / f"seed{args.seed}"


def decide(rdir: Path, ckpt: Path, ident: dict, force: bool) -> str:
    """Rank 0's decision: ``"skip"``, ``"resume"`` or ``"start"``. A record or
    checkpoint of another configuration (or without an identity), and the epochs of an
    unfinished run whose checkpoint is gone, raise :class:`ConfigMismatchError`; with
    ``force`` they are moved to a dated backup and the run starts afresh."""
    def refuse(msg: str) -> str:
        if not force:
            raise ConfigMismatchError(f"{msg}; use another --out, or --force to move "
                                      "the old results to a dated backup")
        for path in (rdir, ckpt):
            if path.exists():
                backup(path)
        return "start"

    mp = rdir / "metrics.json"
    if mp.is_file():
        rec = read_json(mp)
        if not isinstance(rec, dict) or not isinstance(rec.get("identity"), dict):
            return refuse(f"{mp} records no identity")
        keys = check_run_record(rdir, rec["identity"], ident, force=True)
        if keys:
            return refuse(f"{rdir} was produced with another configuration "
                          f"(differing keys: {', '.join(keys)})")
        if rec.get("complete"):
            return "skip"
        if rec.get("epochs") and not ckpt.is_file():
            return refuse(f"{mp} records epochs of an unfinished run whose checkpoint "
                          f"{ckpt} is missing")
    if ckpt.is_file():
        old = load_checkpoint(ckpt, "cpu").get("identity")
        keys = ["identity"] if not isinstance(old, dict) else \
            check_run_record(ckpt, old, ident, force=True)
        if keys:
            return refuse(f"{ckpt} was written with another configuration "
                          f"(differing keys: {', '.join(keys)})")
        return "resume"
    return "start"


def agree(rank: int, rdir: Path, ckpt: Path, ident: dict, force: bool) -> str:
    """Rank 0's decision (start, resume, skip), the same on every rank; a refusal
    ends every rank with its message."""
    decision = [None]
    if rank == 0:
        try:
            decision[0] = decide(rdir, ckpt, ident, force)
        except (ConfigMismatchError, ValueError) as exc:
            decision[0] = f"error: {exc}"
    dist.broadcast_object_list(decision, src=0)
    if decision[0].startswith("error: "):
        raise SystemExit(decision[0][7:])
    return decision[0]


def save_epoch(tr: Any, ident: dict, record: dict, rdir: Path, ckpt: Path) -> None:
    """After an epoch (rank 0): the checkpoint (atomically; removed once the run is
    complete) and the record."""
    if not record["complete"]:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(f".{os.getpid()}.tmp")
        torch.save(tr.state(ident), tmp)
        os.replace(tmp, ckpt)
    atomic_write_json(rdir / "metrics.json", record)
    if record["complete"] and ckpt.is_file():
        ckpt.unlink()
