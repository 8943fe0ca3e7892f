"""One CIFAR run: the training loop, evaluation, checkpoints and the per-epoch record
(book chapter :ref:`experiments-cifar`).

:func:`run` trains a :class:`~studies.cifar.config.RunConfig` to completion (or to
``stop_after_epoch`` / ``max_steps`` / ``deadline``), resuming exactly from its last
checkpoint (:class:`~studies.cifar.runtime.CheckpointClock`); each method steps through
:class:`~studies.cifar.steps.MethodStep` (:func:`~studies.cifar.steps.train_step`).

The same loop serves one process and ``world_size`` processes under torchrun
(:func:`studies.cifar.cli.ddp_main`): every rank draws the same global batch of
``world_size × batch`` images and trains on its slice (KWNG: ``DistributedKWNG``); the
training sums are summed over the ranks, rank 0's batch-norm statistics are copied to
every rank before the evaluation; rank 0 alone decides and writes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time

import numpy as np
import torch

from studies.cifar import hooks
from studies.cifar.config import RunConfig
from studies.cifar.data import NUM_CLASSES
from studies.cifar.images import GPUAugmentedData
from studies.cifar.methods import (
    CLIP_NORM,
    METHODS,
    PARAM_DTYPES,
    device_for,
    milestones_for,
)
from studies.cifar.metrics import EpochStats, UpdateShare, agree_ranks, evaluate_full
from studies.cifar.runtime import (
    CheckpointClock,
    checkpoint_path_for,
    fast_cuda,
    past,
    process_group,
    rank0_decides,
    resolve_lr,
    rng_state,
    run_dir_for,
    run_identity_of,
    save_checkpoint,
    set_rng_state,
    split_data,
    sync,
    test_arrays,
)
from studies.cifar.steps import (
    StepRunner,
    build_model,
    build_optimizer,
    make_step,
    train_step,
)
from studies.kit import guard
from studies.kit.provenance import atomic_write_json, write_provenance

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- run
class Run:
    """The state of one run between its setup and its last epoch."""

    def __init__(self, cfg: RunConfig, lr: float, identity: dict) -> None:
        self.cfg, self.rdir, self.ckpt = cfg, run_dir_for(cfg), checkpoint_path_for(cfg)
        self.rank, self.world = process_group()
        self.device = device = device_for(cfg.device)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        fast_cuda(device)
        x, y, xt, yt = split_data(cfg)
        dtype = PARAM_DTYPES[cfg.precision]
        self.train = GPUAugmentedData(x, y, cfg.dataset, device, dtype)
        self.test = GPUAugmentedData(xt, yt, cfg.dataset, device, dtype)
        # with eval_test, ``test`` above is the validation split and ``test_set`` the
        # test set, both evaluated after every epoch
        self.test_set = (GPUAugmentedData(*test_arrays(cfg), cfg.dataset, device, dtype)
                         if cfg.eval_test else None)
        self.model = build_model(cfg).to(device, dtype)
        # KFAC and EKFAC reshape the gradients themselves (kfac_factors, ekfac_factors):
        # any memory format
        self.channels_last = cfg.channels_last
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer = build_optimizer(cfg, self.model, lr)
        milestones = milestones_for(cfg.epochs, cfg.schedule)
        self.scheduler = torch.optim.lr_scheduler.MultiStepLR(
            self.optimizer, milestones=milestones, gamma=0.1)
        self.method = make_step(cfg, self.model, self.optimizer, device)
        self.data_gen = torch.Generator().manual_seed(10_000 + cfg.seed)
        self.share = UpdateShare(self.model)
        self.stats = EpochStats(device, NUM_CLASSES[cfg.dataset])
        capture = cfg.capture and self.method.capturable
        if cfg.capture and not capture and device.type == "cuda":
            why = METHODS[cfg.method].not_capturable or "not capturable"
            log.warning("%s: method %s runs eagerly: %s", self.rdir, cfg.method, why)
        self.runner = StepRunner(self._step, device, capture,
                                 lambda: self.optimizer.param_groups[0]["lr"],
                                 cache=getattr(self.method.precond, "cache", None))
        self.trace: torch.Tensor | None = None  # per-step losses (trainer_timing)
        self.record = self._new_record(lr, identity, milestones)
        self.start_epoch, self.steps, self.time_train, self.partial = 0, 0, 0.0, None
        self.ckpt_clock = CheckpointClock()  # end-of-epoch checkpoints, by time
        #: the step that raised a numerical error (train_epoch), or None
        self.failure: dict | None = None

    def _step(self, z: torch.Tensor, yb: torch.Tensor) -> None:
        """The whole training step, sums included (what a CUDA graph records)."""
        loss, outputs, info, frac = train_step(self.method, self.model, z, yb,
                                               self.share, self.cfg.precision)
        self.method.track(info, self.stats)
        self.stats.add_step(loss, outputs, yb, frac, self.share.row_move)
        if self.trace is not None:
            self.trace_pos += 1
            pos = (self.trace_pos.clamp(max=len(self.trace)) - 1).view(1)
            self.trace.index_copy_(0, pos,
                                   loss.detach().double().view(1))

    def _new_record(self, lr: float, identity: dict, milestones: list[int]) -> dict:
        cfg, model, pc = self.cfg, self.model, self.method.precond
        scaled = cfg.spec.get("estimator_input", "scaled") == "scaled"
        record = {
            "config": cfg.to_dict(), "identity": identity, "lr": lr,
            "milestones": milestones,
            "batch_size": cfg.batch, "method_spec": cfg.spec, "clip_norm": CLIP_NORM,
            "epochs": [], "complete": False, "diverged": False,
            "train_size": len(self.train), "eval_size": len(self.test),
            "test_size": len(self.test_set) if self.test_set is not None else None,
            "eval_split": ("validation (held out of train)" if cfg.val_size
                           else "test"),
            "eval_fields": ("val_* the validation split, test_* the test set"
                            if cfg.eval_test else "test_* the evaluation split"),
            "samples": "U h (U inside the network)" if scaled else "h (before U)",
            "U": (model.conditioning.diag.tolist() if model.conditioning is not None
                  else None),
            "precision": cfg.precision, "channels_last": self.channels_last,
            "capture": self.runner.capture,
            "ran_differs": {k: {"asked": getattr(cfg, k), "ran": v} for k, v in (
                ("capture", self.runner.capture), ("channels_last", self.channels_last))
                if getattr(cfg, k) != v},
            "lr_field": "the step size used during the epoch",
            "confusion": None}
        if self.world > 1:
            record.update(world_size=self.world, global_batch=self.world * cfg.batch)
        if pc is not None and hasattr(pc, "hyperparameters"):
            record["precond"] = {k: v for k, v in pc.hyperparameters().items()
                                 if isinstance(v, (int, float, str, dict))}
        return record

    def resume(self, ck: dict) -> None:
        self.model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        if self.method.precond is not None:
            self.method.precond.load_state_dict(ck["precond"])
        self.data_gen.set_state(ck["data_gen"].cpu())
        set_rng_state(ck["rng"], self.device)
        self.record = ck["record"]
        self.start_epoch, self.steps = ck["epoch"], ck["steps"]
        self.time_train, self.partial = ck["time_train"], ck.get("partial")
        log.info("%s: resumed after epoch %d%s", self.rdir, self.start_epoch,
                 f" and {self.partial['batches']} batches" if self.partial else "")

    def checkpoint(self, epoch: int, partial: dict | None = None) -> None:
        """Rank 0 saves the run's state (every rank's is the same)."""
        if self.rank != 0:
            return
        pc = self.method.precond
        ck = {"model": self.model.state_dict(),
              "optimizer": self.optimizer.state_dict(),
              "scheduler": self.scheduler.state_dict(),
              "precond": pc.state_dict() if pc is not None else None,
              "data_gen": self.data_gen.get_state(), "rng": rng_state(self.device),
              "record": self.record, "epoch": epoch, "steps": self.steps,
              "time_train": self.time_train}
        if partial is not None:
            ck["partial"] = partial
        save_checkpoint(self.ckpt, ck)

    def train_epoch(self, epoch: int, total_steps: int, bar) -> bool:
        """One epoch of steps; ``False`` if the deadline stopped it (checkpointed)."""
        sync(self.device)
        t0 = time.perf_counter()
        stats, skip, t_before = self.stats, 0, 0.0
        stats.reset()
        if self.partial is not None:  # resume mid-epoch: replay the epoch's draws
            self.data_gen.set_state(self.partial["data_gen_epoch_start"].cpu())
            stats.load_state_dict(self.partial["stats"])
            skip, t_before = self.partial["batches"], self.partial["time_in_epoch"]
            self.partial = None
        gen_start = self.data_gen.get_state()
        cl, B, r, W = self.channels_last, self.cfg.batch, self.rank, self.world
        for b, (z, yb) in enumerate(self.train.batches(B * W, self.data_gen,
                                                       drop_last=W > 1)):
            if b < skip:
                continue
            if W > 1:  # this rank's slice of the global batch
                z, yb = z[r * B:(r + 1) * B], yb[r * B:(r + 1) * B]
            if past(self.cfg.deadline):
                sync(self.device)
                self.checkpoint(epoch, {
                    "batches": b, "stats": stats.state_dict(),
                    "data_gen_epoch_start": gen_start,
                    "time_in_epoch": t_before + time.perf_counter() - t0})
                log.warning("%s: deadline reached in epoch %d after %d batches: "
                            "checkpointed", self.rdir, epoch + 1, b)
                self.record["stopped"] = "deadline"
                return False
            if cl:
                z = z.contiguous(memory_format=torch.channels_last)
            try:
                self.runner(z, yb)
            except torch.linalg.LinAlgError as exc:
                # a preconditioner whose factor cannot be inverted (KFAC at a step
                # so large that the activations collapsed): the run has diverged,
                # recorded as such by end_epoch instead of failing without a record
                # (one process only: a rank leaving the loop alone would hang the rest)
                if W > 1:
                    raise
                self.failure = {"epoch": epoch + 1, "step": self.steps + 1,
                                "error": f"{type(exc).__name__}: {exc}"}
                log.warning("%s: step %d of epoch %d failed (%s): recorded as "
                            "diverged", self.rdir, self.steps + 1, epoch + 1, exc)
                break
            stats.count(len(yb))
            self.steps += 1
            if bar is not None:
                bar.update(1)
            if W == 1 and self.steps % 50 == 0 \
                    and not bool(torch.isfinite(stats.loss_sum)):
                break  # diverged: stop early (recorded by end_epoch)
            if self.steps >= total_steps:
                break
        sync(self.device)
        self.time_train += t_before + time.perf_counter() - t0
        return True

    def end_epoch(self, epoch: int, total_steps: int) -> bool:
        """Evaluate, record and checkpoint the epoch; ``True`` when the run ends."""
        from studies.cifar.nets import last_linear

        cfg, record = self.cfg, self.record
        lr_epoch = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        spread = agree_ranks(self.stats, self.model, self.method.precond, self.world,
                             self.rdir)
        te = time.perf_counter()
        k = NUM_CLASSES[cfg.dataset]
        val = (evaluate_full(self.model, self.test, cfg.eval_batch_size, k)
               if self.test_set is not None else None)
        ev = evaluate_full(self.model, self.test_set or self.test,
                           cfg.eval_batch_size, k)
        w = last_linear(self.model).weight.detach()
        norms = torch.linalg.vector_norm(w.double(), dim=1).tolist()
        u = record["U"] or [1.0] * len(norms)
        move = self.stats.row_move.tolist()
        prev = record["epochs"][-1].get("cumulative_row_movement") if record["epochs"] \
            else None
        row = {"epoch": epoch + 1, "steps": self.steps, "lr": lr_epoch,
               **self.stats.row(),
               "test_loss": ev["loss"], "test_acc": ev["acc"],
               "test_acc_per_class": ev["recall"], "test_precision_per_class":
               ev["precision"], "feature_norm": ev["feature_norm"],
               "last_layer_row_norms": norms,
               "logit_scale": [a * b for a, b in zip(u, norms)],
               "row_movement": move,
               "cumulative_row_movement": [a + b for a, b in
                                           zip(prev or [0.0] * len(move), move)],
               "time_train": self.time_train, "time_eval": time.perf_counter() - te,
               "time_unix": time.time()}
        if val is not None:
            row.update(val_loss=val["loss"], val_acc=val["acc"])
        if spread is not None:
            row["replica_spread"] = spread
        record["confusion"] = ev["confusion"]
        test_loss, test_acc = ev["loss"], ev["acc"]
        row.update(self.method.epoch_fields(record["epochs"]))
        record["epochs"].append(row)
        finished = epoch + 1 == cfg.epochs or self.steps >= total_steps
        if not math.isfinite(row["train_loss"]) or self.failure is not None:
            record["diverged"] = finished = True
            record.update({"failure": self.failure} if self.failure else {})
        if cfg.early_stop and (not finished or record["diverged"]):
            finished = self._early_stop(row, k) or finished
        record["complete"] = finished
        record.pop("stopped", None)
        log.info("%s epoch %d: train %.4f/%.3f test %.4f/%.3f (%.1fs)", self.rdir,
                 epoch + 1, row["train_loss"], row["train_acc"], test_loss, test_acc,
                 self.time_train)
        if not finished and self.ckpt_clock.due(epoch + 1, cfg.stop_after_epoch):
            self.checkpoint(epoch + 1)
        if self.rank == 0:
            atomic_write_json(self.rdir / "metrics.json", record)
        if finished and self.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                self.ckpt.unlink()
        return finished

    def _early_stop(self, row: dict, num_classes: int) -> bool:
        """Apply the run's early-stop rule (registered by its study:
        :func:`studies.cifar.hooks.early_stop_rule`) to its latest epoch ``row``, on the
        validation accuracy; ``True`` records the reason and ends the run."""
        acc = row.get("val_acc", row["test_acc"])  # without eval_test: validation
        rows = [{**r, "val_acc": r.get("val_acc", r["test_acc"])}
                for r in self.record["epochs"]]
        rule = hooks.early_stop_rule(self.cfg.early_stop)
        stop = rule({**row, "val_acc": acc}, rows, self.rdir, num_classes)
        if stop is None:
            return False
        self.record["early_stop"] = {"rule": self.cfg.early_stop, **stop}
        log.info("%s: early stop after epoch %d (%s)", self.rdir, row["epoch"],
                 stop["reason"])
        return True

    def train_all(self, progress: bool) -> dict:
        cfg, E, W = self.cfg, self.cfg.epochs, self.world
        nb = self.train.num_batches(cfg.batch * W, drop_last=W > 1)
        total_steps = E * nb if cfg.max_steps is None else min(E * nb,
                                                                   cfg.max_steps)
        bar = None
        if progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=total_steps, initial=min(self.steps, total_steps),
                       desc=str(self.rdir), leave=False, mininterval=5.0,
                       file=sys.stderr)
        self.model.train()
        for epoch in range(self.start_epoch, E):
            if self.steps >= total_steps or not self.train_epoch(epoch, total_steps,
                                                                 bar):
                break
            if self.end_epoch(epoch, total_steps):
                break
            stop = cfg.stop_after_epoch
            if stop is not None and epoch + 1 >= stop:
                break
        if bar is not None:
            bar.close()
        return self.record


def run(cfg: RunConfig | dict, progress: bool = True, force: bool = False) -> dict:
    """Train one configuration to completion (or to ``stop_after_epoch`` / ``max_steps``
    / ``deadline``), resuming from its checkpoint if one exists. Returns the metrics
    record (also written to disk).

    A run directory written with another identity
    (:func:`studies.kit.guard.run_identity`: step size, epochs, model, data, batch,
    method spec, ...) is refused, never resumed, skipped or overwritten; so is an
    unfinished record whose checkpoint is gone. ``force`` moves such results to a dated
    backup and starts afresh.

    At the ``deadline`` (a Unix time) the run checkpoints in the middle of its epoch,
    with the epoch's partial sums and the data generator's state at the epoch start: the
    resumed run replays the epoch's batch draws up to that point and continues exactly
    where it stopped."""
    cfg = RunConfig.of(cfg)
    rank, world = process_group()
    if world != cfg.world_size:
        raise ValueError(f"world_size must be the number of processes ({world}), "
                         f"got {cfg.world_size}")
    rdir, ckpt_path = run_dir_for(cfg), checkpoint_path_for(cfg)
    lr = resolve_lr(cfg)
    identity = run_identity_of(cfg, lr)
    prev = rank0_decides(
        lambda: guard.check_existing_run(rdir, ckpt_path, identity, force), world)
    if prev is not None:
        log.info("%s is complete: skipped", rdir)
        return prev
    state = Run(cfg, lr, identity)
    ck = None

    def found() -> bool:
        nonlocal ck
        ck = guard.resume_checkpoint(ckpt_path, identity, state.device, force, rdir)
        return ck is not None

    if rank0_decides(found, world) and ck is None:  # the checkpoint rank 0 read
        ck = guard.load_checkpoint(ckpt_path, state.device)
    if ck is not None:
        state.resume(ck)
    if rank == 0:
        write_provenance(rdir, cfg.to_dict(),
                         seeds={"seed": cfg.seed, "data": 10_000 + cfg.seed},
                         device=str(state.device), lr=lr, method_spec=cfg.spec,
                         resumed_from_epoch=state.start_epoch,
                         **({"world_size": world} if world > 1 else {}))
    return state.train_all(progress)
