"""ResNet-18 on CIFAR-10 with KWNG on ``W`` processes (book chapter
:ref:`distributed`)::

    torchrun --nproc-per-node=W -m kwng.experiments.cifar.ddp --epochs 100

The entry point of the one trainer (:func:`kwng.experiments.cifar.train.run`) under
torchrun: it starts the process group and trains a
:class:`~kwng.experiments.cifar.config.RunConfig` of ``world_size = W``. Every rank
builds the same *global* batch of ``W × --batch`` images from one data generator and
trains on its slice, so a ``W``-rank run sees exactly the batches of a one-process run
at batch ``W·B``; :class:`kwng.engine.distributed.DistributedKWNG` gives every rank the
direction of that global batch. The method is the claim suite's ``kwng`` (plain SGD,
``M = 5``, ``T_tilde`` damping, Gaussian kernel, ``ε`` and its bounds in the authors'
convention for the global batch, clipping at norm 1; ``--num-basis 20``:
``kwng_basis20``) on the well-conditioned network; batch norm uses each rank's shard
statistics (as under DDP) and the running statistics of rank 0 are copied to every rank
before each evaluation.

As every run: under ``<out>/<model>-W<W>-B<B>/`` the run directory
``cifar10/well/<method>/seed<k>`` holds ``metrics.json`` (one row per epoch, with the
run's identity) and ``provenance.json``, written atomically by rank 0; a checkpoint
after every epoch (``--checkpoint-dir``) lets a rerun of the same command resume
exactly; a directory or checkpoint of another configuration is refused (``--force``
moves it to a dated backup); a complete run is skipped. ``--capture`` replays the step
from a CUDA graph (the collectives inside). Ranks must share the filesystem (one host).
On a CPU (gloo) a small run checks the whole path::

    torchrun --nproc-per-node=2 -m kwng.experiments.cifar.ddp --device cpu \\
        --model tiny --source sample --epochs 1 --subset 256 --batch 16
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kwng.experiments.cifar.config import RunConfig
from kwng.experiments.cifar.data import SOURCES
from kwng.experiments.cifar.methods import PRECISIONS
from kwng.experiments.cifar.train import run
from kwng.experiments.cli_checks import int_arg, number_arg
from kwng.experiments.guard import ConfigMismatchError
from kwng.experiments.provenance import ResultFileError

__all__ = ["main"]

#: ``--num-basis`` -> the method of that basis size
_METHOD_OF_BASIS = {5: "kwng", 20: "kwng_basis20"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m kwng.experiments.cifar.ddp",
                                description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--out", default=str(Path("scratch") / "cifar_ddp"),
        help="results folder (default: the git-ignored scratch/cifar_ddp)")
    add("--checkpoint-dir", default=str(Path("checkpoints") / "cifar_ddp"))
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        choices=("cuda", "cpu"))
    add("--model", default="resnet18", choices=("resnet18", "tiny"))
    add("--epochs", type=int_arg(1), default=100)
    add("--stop-after-epoch", type=int_arg(1), default=None,
        help="stop (checkpointed) after this epoch; rerun to resume")
    add("--batch", type=int_arg(1), default=128, help="per-rank batch")
    add("--lr", type=number_arg(0), default=0.1)
    add("--num-basis", type=int, default=5, choices=tuple(_METHOD_OF_BASIS))
    add("--precision", default="fp32", choices=PRECISIONS)
    add("--capture", action="store_true", help="replay the step from a CUDA graph")
    add("--subset", type=int_arg(1), default=None, help="train on this many images")
    add("--source", default="auto", choices=SOURCES)
    add("--data-root", default=None)
    add("--eval-batch", type=int_arg(1), default=1000)
    add("--seed", type=int_arg(0), default=0)
    add("--timeout", type=number_arg(0), default=600.0,
        help="seconds a collective may wait for the other ranks")
    add("--force", action="store_true",
        help="move results of another configuration to a dated backup")
    add("--no-progress", action="store_true")
    return p


def _launch_checks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu)")
    if args.capture and args.device != "cuda":
        p.error("--capture replays CUDA graphs: it needs --device cuda")
    if "RANK" not in os.environ:
        p.error("launch with torchrun: torchrun --nproc-per-node=W -m "
                "kwng.experiments.cifar.ddp ...")


def _config(args: argparse.Namespace, world: int) -> RunConfig:
    """The run of the command line ``args`` on ``world`` processes, on this rank's
    device (its local GPU, ``LOCAL_RANK``, or the CPU)."""
    device = "cpu"
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return RunConfig(
        dataset="cifar10", conditioning="well", method=_METHOD_OF_BASIS[args.num_basis],
        seed=args.seed, epochs=args.epochs, lr=args.lr, data_root=args.data_root,
        source=args.source, device=device,
        out=str(Path(args.out) / f"{args.model}-W{world}-B{args.batch}"),
        checkpoint_dir=args.checkpoint_dir, train_subset=args.subset,
        model=args.model, batch_size=args.batch, eval_batch_size=args.eval_batch,
        stop_after_epoch=args.stop_after_epoch, schedule="claim", capture=args.capture,
        precision=args.precision, channels_last=args.device == "cuda",
        world_size=world)


def main(argv: list[str] | None = None) -> dict | None:
    """``torchrun ... -m kwng.experiments.cifar.ddp [options]`` (module docstring);
    returns the run's record."""
    p = _parser()
    args = p.parse_args(argv)
    _launch_checks(p, args)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stdout)
    try:
        return run(_config(args, world), progress=not args.no_progress,
                   force=args.force)
    except (ConfigMismatchError, ResultFileError, ValueError,
            FileNotFoundError) as exc:  # a refusal: one line per rank
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
