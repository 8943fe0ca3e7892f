"""The configuration of one CIFAR run (book chapter :ref:`experiments-cifar`).

:class:`RunConfig` is a frozen dataclass, validated once when it is built; a variant is
``dataclasses.replace(cfg, ...)``. The single-run command line is generated from its
fields (:func:`add_run_options`: an option per field whose metadata holds a ``help``),
and the settings a command line leaves unset come from the scale's preset
(:meth:`RunConfig.small`, :meth:`RunConfig.full`). :meth:`RunConfig.from_dict` builds
one from a plan's job or a record's ``config``; :meth:`RunConfig.to_dict` is what
records store.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from studies.cifar import hooks
from studies.cifar.data import DATASETS, SOURCES
from studies.cifar.methods import (
    BATCH_SIZE,
    CHECKPOINTS,
    CONDITIONINGS,
    METHODS,
    PRECISIONS,
    RESULTS,
    SCHEDULES,
    check_method_spec,
)
from studies.cifar.nets import NETWORKS
from studies.kit.cli_checks import int_arg, lr_arg

__all__ = ["RunConfig", "SETTINGS", "SMALL_RUN", "FULL_RUN", "add_run_options"]


def _opt(help: str, **argparse_kwargs: Any) -> dict:
    """A field's metadata: its command-line option's help and argparse arguments."""
    return {"help": help, "argparse": argparse_kwargs}


def _flag(help: str) -> dict:
    return _opt(help, action="store_true")


_SCALED = "default: {} (full scale), {} (small)"


@dataclass(frozen=True)
class RunConfig:
    """The configuration of one run. The fields without option help (the evaluation
    batch, a sweep's deadline, the Fig. 3 protocol, the number of processes) are set
    by the code that runs it, never on the single-run command line."""

    dataset: str = field(default="cifar10", metadata=_opt(
        "the data set", choices=DATASETS))
    conditioning: str = field(default="ill", metadata=_opt(
        "the network's output scaling U", choices=CONDITIONINGS))
    method: str = field(default="kwng", metadata=_opt(
        "the training method", choices=tuple(METHODS)))
    seed: int = field(default=0, metadata=_opt("the seed", type=int_arg(0)))
    epochs: int = field(default=6, metadata=_opt(
        _SCALED.format(30, 2), type=int_arg(1)))
    lr: float | str = field(default="selected", metadata=_opt(
        "a step size or 'selected' (`cifar select`)", type=lr_arg))
    data_root: str | None = field(default=None, metadata=_opt(
        "the folder of the data set"))
    source: str = field(default="auto", metadata=_opt(
        "default: auto (full scale, or with --data-root), sample (small)",
        choices=SOURCES))
    device: str | None = field(default=None, metadata=_opt(
        "a torch device (default: CUDA when available)"))
    out: str = field(default=str(RESULTS), metadata=_opt(
        _SCALED.format(RESULTS, Path("scratch") / "cifar")))
    checkpoint_dir: str = field(default=str(CHECKPOINTS), metadata=_opt(
        f"the checkpoints' root (default: {CHECKPOINTS})"))
    train_subset: int | None = field(default=None, metadata=_opt(
        "train on this many images", type=int_arg(1)))
    val_size: int = field(default=0, metadata=_opt(
        "hold this many training images out as the evaluation split", type=int_arg(0)))
    max_steps: int | None = field(default=None, metadata=_opt(
        "stop after this many steps", type=int_arg(1)))
    model: str = field(default="resnet18", metadata=_opt(
        "default: resnet18 (full scale), tiny (small)", choices=tuple(NETWORKS)))
    batch_size: int | None = field(default=None, metadata=_opt(
        f"the batch per process (default: the method's, else {BATCH_SIZE})",
        type=int_arg(1)))
    eval_batch_size: int = 1000
    stop_after_epoch: int | None = field(default=None, metadata=_opt(
        "stop (checkpointed) after this epoch", type=int_arg(1)))
    #: a Unix time after which the run checkpoints and stops (set by a sweep's worker)
    deadline: float | None = None
    selection_file: str | None = field(default=None, metadata=_opt(
        "the selected step sizes (default: the study's selected.json)"))
    download: bool = field(default=False, metadata=_flag(
        "download the official archive via torchvision"))
    schedule: str = field(default="claim", metadata=_opt(
        "the step-size schedule", choices=SCHEDULES))
    capture: bool = field(default=False, metadata=_flag(
        "replay the training step from a CUDA graph (CUDA only; KFAC/EKFAC run "
        "eagerly)"))
    precision: str = field(default="fp32", metadata=_opt(
        "the network's forward/backward: fp32 (TF32 on CUDA), bf16 autocast or fp64 "
        "(a reference that agrees across CPUs to round-off)",
        choices=PRECISIONS))
    channels_last: bool = field(default=False, metadata=_flag(
        "the network in channels_last"))
    eval_test: bool = field(default=False, metadata=_flag(
        "with --val-size: evaluate the test set too after every epoch (val_* and "
        "test_* fields)"))
    early_stop: str | None = field(default=None, metadata=_opt(
        "the early-stop rule, by the name its study registered (fig3: "
        "studies.fig3.protocol; needs --val-size)"))
    #: the Fig. 3 protocol a run belongs to (:mod:`studies.fig3.protocol`)
    protocol: str | None = None
    #: the number of processes that train the run together (torchrun; each trains
    #: ``batch`` images of a global batch of ``world_size × batch``)
    world_size: int = 1

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_numbers()
        if self.early_stop is not None and not self.val_size:
            raise ValueError("early_stop needs val_size > 0: the rule reads the "
                             "validation accuracy, never the test set's")
        if self.source == "sample" and self.data_root is not None:
            raise ValueError("source='sample' trains on the committed 500-image "
                             "sample and would not read "
                             f"data_root={self.data_root!r}: drop --data-root, or "
                             "pass --source auto (or jpeg, official) to train on it")
        if self.eval_test is True and not self.val_size:
            raise ValueError("eval_test=True needs val_size > 0 (without a validation "
                             "split the evaluation set is already the test set)")
        for k in ("capture", "channels_last", "eval_test", "download"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"{k} must be True or False, got {getattr(self, k)!r}")
        if self.lr != "selected":
            try:
                lr = float(self.lr)
            except (TypeError, ValueError):
                lr = math.nan
            if not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"lr must be a positive number or 'selected', "
                                 f"got {self.lr!r}")
            object.__setattr__(self, "lr", lr)
        check_method_spec(self.method, self.spec)

    def _check_choices(self) -> None:
        for k, choices in (("dataset", DATASETS), ("conditioning", CONDITIONINGS),
                           ("method", tuple(METHODS)), ("schedule", SCHEDULES),
                           ("model", tuple(NETWORKS)), ("precision", PRECISIONS),
                           ("source", SOURCES),
                           ("early_stop", (None, *hooks.early_stop_names()))):
            if getattr(self, k) not in choices:
                raise ValueError(f"{k} must be one of {choices}, "
                                 f"got {getattr(self, k)!r}")

    def _check_numbers(self) -> None:
        for k, lo in (("seed", 0), ("epochs", 1), ("eval_batch_size", 1),
                      ("val_size", 0), ("world_size", 1)):
            v = getattr(self, k)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{k} must be an integer >= {lo}, got {v!r}")
        for k in ("train_subset", "max_steps", "batch_size", "stop_after_epoch"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{k} must be None or an integer >= 1, got {v!r}")

    # ------------------------------------------------------------- derived settings
    @property
    def spec(self) -> dict[str, Any]:
        """The method's settings (:data:`~studies.cifar.methods.METHODS`)."""
        return METHODS[self.method].spec

    @property
    def batch(self) -> int:
        """The per-process batch size, which is ``batch_size``, else the method's,
        else :data:`~studies.cifar.methods.BATCH_SIZE`."""
        return int(self.batch_size or self.spec.get("batch_size", BATCH_SIZE))

    # ---------------------------------------------------------------- dicts, presets
    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> RunConfig:
        """The configuration of ``settings`` (a plan's job, a record's ``config``); an
        unknown key raises ``ValueError`` naming it."""
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            raise ValueError(f"unknown run settings {sorted(unknown)}; "
                             f"accepted: {sorted(SETTINGS)}")
        return cls(**settings)

    @classmethod
    def of(cls, settings: RunConfig | dict[str, Any]) -> RunConfig:
        """``settings`` itself if a :class:`RunConfig`, else :meth:`from_dict`."""
        return settings if isinstance(settings, cls) else cls.from_dict(settings)

    def to_dict(self) -> dict[str, Any]:
        """The settings as records store them (``world_size`` only when above 1: the
        one-process records predate it)."""
        out = {k: getattr(self, k) for k in SETTINGS}
        if self.world_size == 1:
            del out["world_size"]
        return out

    @classmethod
    def small(cls, **given: Any) -> RunConfig:
        """The ``KWNG_SCALE=small`` run: :data:`SMALL_RUN` where ``given`` is silent
        (the committed sample only when no ``data_root`` is given)."""
        preset = dict(SMALL_RUN)
        if given.get("data_root") is not None:
            preset["source"] = "auto"
        return cls.from_dict({**preset, **given})

    @classmethod
    def full(cls, **given: Any) -> RunConfig:
        """The ``KWNG_SCALE=full`` run: :data:`FULL_RUN` where ``given`` is silent."""
        return cls.from_dict({**FULL_RUN, **given})


#: the names of :class:`RunConfig`'s settings
SETTINGS = tuple(f.name for f in dataclasses.fields(RunConfig))
#: the settings of a run at ``KWNG_SCALE=small`` that the caller does not give (the
#: tiny network on the committed sample, 2 epochs, results under ``scratch/``)
SMALL_RUN = {"model": "tiny", "source": "sample", "epochs": 2,
             "out": str(Path("scratch") / "cifar")}
#: the same at ``KWNG_SCALE=full``: the study's network, data, epochs and folder
FULL_RUN = {"model": "resnet18", "source": "auto", "epochs": 30, "out": str(RESULTS)}


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """An option ``--name`` per :class:`RunConfig` field with option help; an option
    not given parses as ``None`` (``False`` for a flag): the field's default or the
    scale's preset applies."""
    for f in dataclasses.fields(RunConfig):
        if "help" in f.metadata:
            kwargs = f.metadata["argparse"]
            default = False if kwargs.get("action") == "store_true" else None
            parser.add_argument("--" + f.name.replace("_", "-"), default=default,
                                help=f.metadata["help"], **kwargs)
