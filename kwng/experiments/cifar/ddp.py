"""ResNet-18 on CIFAR-10 with KWNG on ``W`` processes (book chapter
:ref:`distributed`)::

    torchrun --nproc-per-node=W -m kwng.experiments.cifar.ddp --epochs 100

Every rank builds the same *global* batch of ``W × --batch`` images from one data
generator (the same permutation and augmentation draws everywhere) and trains on its
slice ``[r·B, (r+1)·B)``, so a ``W``-rank run sees exactly the batches of a one-process
run at batch ``W·B``; :class:`kwng.engine.distributed.DistributedKWNG` gives every rank
the direction of that global batch. The method is the claim suite's ``kwng`` (plain SGD,
``M = 5``, ``T_tilde`` damping, Gaussian kernel, ``ε`` and its bounds in the authors'
convention for the global batch, clipping at norm 1) on the well-conditioned network;
batch norm uses each rank's shard statistics (as under DDP) and the running statistics
of rank 0 are copied to every rank before each evaluation (sharded over the ranks).

Like the one-process runner (:mod:`kwng.experiments.cifar.train`): a run directory
``<out>/<model>-W<W>-B<B>/seed<k>`` holds ``metrics.json`` (one row per epoch, with the
run's identity) and ``provenance.json``, written atomically by rank 0; a checkpoint
after every epoch (``--checkpoint-dir``) lets a rerun of the same command resume
exactly; a directory or checkpoint of another configuration is refused
(``--force`` moves it to a dated backup); a complete run is skipped. ``--capture``
replays the step from a CUDA graph (the collectives inside). Ranks must share the
filesystem (one host). On a CPU (gloo) a small run checks the whole path::

    torchrun --nproc-per-node=2 -m kwng.experiments.cifar.ddp --device cpu \\
        --model tiny --source sample --epochs 1 --subset 256 --batch 16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kwng.experiments.cifar.ddp_store import (
    agree,
    identity_of,
    run_dir,
    save_epoch,
)
from kwng.experiments.cli_checks import int_arg, number_arg
from kwng.experiments.guard import (
    load_checkpoint,
)
from kwng.experiments.provenance import read_json, write_provenance

__all__ = ["main"]

log = logging.getLogger(__name__)



class _Trainer:
    """The state of one run on this rank."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from kwng.engine.config import eps_from_authors
        from kwng.engine.distributed import DistributedKWNG
        from kwng.engine.lm import LMSchedule
        from kwng.experiments.cifar.capture import StepRunner
        from kwng.experiments.cifar.data import (
            NUM_CLASSES,
            GPUAugmentedData,
            load_cifar,
            source_fingerprint,
        )
        from kwng.experiments.cifar.methods import (
            CLIP_NORM,
            EPS_AUTHORS,
            EPS_BOUNDS_AUTHORS,
            milestones_for,
        )
        from kwng.experiments.cifar.nets import resnet18, tiny_cnn

        self.args, self.device = args, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)
        x, y = load_cifar("cifar10", "train", args.data_root, args.source)
        if args.subset:
            keep = np.random.default_rng(12345).permutation(len(x))[:args.subset]
            x, y = x[np.sort(keep)], y[np.sort(keep)]
        xt, yt = load_cifar("cifar10", "test", args.data_root, args.source)
        self.train = GPUAugmentedData(x, y, "cifar10", device)
        self.test = GPUAugmentedData(xt, yt, "cifar10", device)
        self.data = source_fingerprint("cifar10", args.data_root, args.source)
        k = NUM_CLASSES["cifar10"]
        model = resnet18(k) if args.model == "resnet18" else tiny_cnn(k)
        self.cl = device.type == "cuda"
        fmt = torch.channels_last if self.cl else torch.contiguous_format
        self.model = model.to(device).to(memory_format=fmt)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        self.sched = torch.optim.lr_scheduler.MultiStepLR(
            self.opt, milestones_for(args.epochs, "claim"), gamma=0.1)
        N = self.world * args.batch  # ε converts with the estimator's (global) batch
        lo, hi = EPS_BOUNDS_AUTHORS
        self.precond = DistributedKWNG(
            self.model, lr=lambda: self.opt.param_groups[0]["lr"],
            num_basis=args.num_basis, batch_sizes=args.batch, damping="T_tilde",
            kernel="gaussian", eps=eps_from_authors(EPS_AUTHORS, N),
            eps_schedule=LMSchedule(eps_min=eps_from_authors(lo, N),
                                    eps_max=eps_from_authors(hi, N)),
            clip_norm=CLIP_NORM)
        self.data_gen = torch.Generator().manual_seed(10_000 + args.seed)
        # the epoch's sums on the device: loss, correct, examples
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.runner = StepRunner(self._step, device, args.capture,
                                 lambda: self.opt.param_groups[0]["lr"])
        self.epoch, self.steps, self.rows, self.time_train = 0, 0, [], 0.0

    def _step(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """One step on this rank's slice, sums included (what a CUDA graph records)."""
        self.opt.zero_grad(set_to_none=True)
        amp = (torch.autocast(z.device.type, dtype=torch.bfloat16, cache_enabled=False)
               if self.args.precision == "bf16" else contextlib.nullcontext())
        with amp:
            X = self.model(z)
            loss = F.cross_entropy(X.float(), y)
        self.precond.step(loss, X)
        self.opt.step()
        self.sums[0] += loss.detach().double() * y.shape[0]
        self.sums[1] += (X.detach().argmax(1) == y).sum()
        self.sums[2] += y.shape[0]

    # --- state ---------------------------------------------------------------------
    def state(self, ident: dict) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"identity": ident, "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "precond": self.precond.state_dict(),
                "data_gen": self.data_gen.get_state(), "rng": rng,
                "epoch": self.epoch, "steps": self.steps, "rows": self.rows,
                "time_train": self.time_train}

    def load(self, ck: dict) -> None:
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        self.precond.load_state_dict(ck["precond"])
        self.data_gen.set_state(ck["data_gen"].cpu())
        torch.set_rng_state(ck["rng"]["torch"].cpu())
        if "cuda" in ck["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(ck["rng"]["cuda"].cpu(), self.device)
        self.epoch, self.steps, self.rows = ck["epoch"], ck["steps"], ck["rows"]
        self.time_train = ck["time_train"]

    # --- epochs --------------------------------------------------------------------
    def train_epoch(self, bar) -> None:
        B, r = self.args.batch, self.rank
        self.sums.zero_()
        t0 = time.perf_counter()
        for z, y in self.train.batches(B * self.world, self.data_gen, drop_last=True):
            z = z[r * B:(r + 1) * B]
            if self.cl:
                z = z.contiguous(memory_format=torch.channels_last)
            self.runner(z, y[r * B:(r + 1) * B])
            self.steps += 1
            if bar is not None:
                bar.update(1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.time_train += time.perf_counter() - t0

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy, the test set split over the ranks (rank 0's running
        statistics everywhere)."""
        from kwng.engine.distributed import replica_spread

        self.precond.broadcast_buffers()
        self.spread = replica_spread(self.model)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for k, (z, y) in enumerate(self.test.eval_batches(self.args.eval_batch)):
                if k % self.world != self.rank:
                    continue
                X = self.model(z.contiguous(memory_format=torch.channels_last)
                               if self.cl else z).float()
                sums += torch.stack([F.cross_entropy(X, y, reduction="sum").double(),
                                     (X.argmax(1) == y).sum().double(),
                                     torch.tensor(float(len(y)), device=self.device,
                                                  dtype=torch.float64)])
        self.model.train()
        dist.all_reduce(sums)
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    def end_epoch(self) -> dict:
        lr = self.opt.param_groups[0]["lr"]
        sums = self.sums.clone()
        dist.all_reduce(sums)
        self.sched.step()
        test_loss, test_acc = self.evaluate()
        self.epoch += 1
        row = {"epoch": self.epoch, "steps": self.steps, "lr": lr,
               "train_loss": float(sums[0] / sums[2]),
               "train_acc": float(sums[1] / sums[2]),
               "test_loss": test_loss, "test_acc": test_acc, "eps": self.precond.eps,
               "replica_spread": self.spread, "time_train": self.time_train}
        if self.spread != 0.0:
            log.warning("epoch %d: the replicas differ by %.3g (sum/sum of squares)",
                        self.epoch, self.spread)
        self.rows.append(row)
        return row


def _launch_checks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu)")
    if args.capture and args.device != "cuda":
        p.error("--capture replays CUDA graphs: it needs --device cuda")
    if "RANK" not in os.environ:
        p.error("launch with torchrun: torchrun --nproc-per-node=W -m "
                "kwng.experiments.cifar.ddp ...")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog="torchrun ... -m kwng.experiments.cifar.ddp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path("scratch") / "cifar_ddp"),
                   help="results folder (default: the git-ignored scratch/cifar_ddp)")
    p.add_argument("--checkpoint-dir", default=str(Path("checkpoints") / "cifar_ddp"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--model", default="resnet18", choices=("resnet18", "tiny"))
    p.add_argument("--epochs", type=int_arg(1), default=100)
    p.add_argument("--stop-after-epoch", type=int_arg(1), default=None,
                   help="stop (checkpointed) after this epoch; rerun to resume")
    p.add_argument("--batch", type=int_arg(1), default=128, help="per-rank batch")
    p.add_argument("--lr", type=number_arg(0), default=0.1)
    p.add_argument("--num-basis", type=int_arg(1), default=5)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--capture", action="store_true",
                   help="replay the step from a CUDA graph")
    p.add_argument("--subset", type=int_arg(1), default=None,
                   help="train on this many images")
    p.add_argument("--source", default="auto", choices=("auto", "official", "jpeg",
                                                        "sample"))
    p.add_argument("--data-root", default=None)
    p.add_argument("--eval-batch", type=int_arg(1), default=1000)
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument("--timeout", type=number_arg(0), default=600.0,
                   help="seconds a collective may wait for the other ranks")
    p.add_argument("--force", action="store_true",
                   help="move results of another configuration to a dated backup")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _launch_checks(p, args)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:  # a refusal: one line per rank
        print(f"rank {dist.get_rank()}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()


def _device(args: argparse.Namespace) -> torch.device:
    """This rank's device: its local GPU (``LOCAL_RANK``) or the CPU."""
    if args.device != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.backends.cudnn.benchmark = True
    return torch.device("cuda", local)


def _run(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stdout)
    device = _device(args)
    tr = _Trainer(args, device)
    ident = identity_of(args, world, tr.data)
    rdir = run_dir(args, world)
    ckpt = Path(args.checkpoint_dir) / rdir.relative_to(args.out) / "checkpoint.pt"
    decision = [agree(rank, rdir, ckpt, ident, args.force)]
    if decision[0] == "skip":
        log.info("%s is complete: skipped", rdir)
        return read_json(rdir / "metrics.json")
    if decision[0] == "resume":
        tr.load(load_checkpoint(ckpt, device))
        log.info("%s: resumed after epoch %d", rdir, tr.epoch)
    config = {k: v for k, v in vars(args).items() if k not in ("force", "no_progress")}
    if rank == 0:
        write_provenance(rdir, config, seeds={"model": args.seed,
                                              "data": 10_000 + args.seed},
                         device=str(device), world_size=world,
                         resumed_from_epoch=tr.epoch)
    log.info("cifar_ddp: W=%d, global batch %d, %s", world, world * args.batch, config)
    record = {"identity": ident, "config": config, "world_size": world,
              "global_batch": world * args.batch, "epochs": tr.rows, "complete": False,
              "precond": {k: v for k, v in tr.precond.hyperparameters().items()
                          if isinstance(v, (int, float, str))}}
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm.auto import tqdm

        nb = len(tr.train) // (world * args.batch)
        bar = tqdm(total=nb * args.epochs, initial=tr.steps, desc=str(rdir),
                   mininterval=5.0, file=sys.stderr)
    while tr.epoch < args.epochs:
        tr.train_epoch(bar)
        row = tr.end_epoch()
        log.info("epoch %d: train %.4f/%.3f test %.4f/%.3f (%.1f s)", row["epoch"],
                 row["train_loss"], row["train_acc"], row["test_loss"], row["test_acc"],
                 row["time_train"])
        record["complete"] = tr.epoch == args.epochs
        if rank == 0:
            save_epoch(tr, ident, record, rdir, ckpt)
        dist.barrier()
        if args.stop_after_epoch is not None and tr.epoch >= args.stop_after_epoch:
            break
    if bar is not None:
        bar.close()
    return record


if __name__ == "__main__":
    main()
