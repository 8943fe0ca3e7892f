"""The CIFAR study's reporting commands (``python -m kwng.experiments cifar
<command>``): ``select`` (the step-size selection rule), ``timing`` and
``trainer-timing`` (seconds per step and per epoch), ``schedule`` (the epochs that
fit a budget) and ``check`` (the completeness of a suite's records).
:mod:`kwng.experiments.cifar.cli` dispatches to them."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from kwng.experiments import guard
from kwng.experiments.cifar.data import DATASETS
from kwng.experiments.cifar.methods import (
    CLAIM,
    CLAIM_METHODS,
    CLAIM_SELECTION,
    CONDITIONINGS,
    METHODS,
    PRECISIONS,
    RESULTS,
    milestones_for,
)
from kwng.experiments.cifar.nets import NETWORKS
from kwng.experiments.cifar.plans import build_plan
from kwng.experiments.cifar.results import (
    check_claim,
    check_results,
    select_lrs,
)
from kwng.experiments.cifar.sweep import (
    schedule_epochs,
    timing,
)
from kwng.experiments.cli_checks import (
    device_problem,
    int_arg,
    names_arg,
    number_arg,
)

log = logging.getLogger(__name__)


def select_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    p.add_argument("--root", default=str(CLAIM_SELECTION))
    a = p.parse_args(rest)
    out = select_lrs(a.root, force=a.force)
    for k, v in sorted(out["selected"].items()):
        log.info("selected %s: lr=%g (held-out acc %.3f)", k, v["lr"], v["val_acc"])
    return 0


def timing_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    add = p.add_argument
    add("--methods", default="claim",
        type=names_arg(list(METHODS), extra=("all", "claim")))
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--steps", type=int_arg(1), default=30)
    add("--warmup", type=int_arg(0), default=5)
    add("--device", default=None)
    add("--model", default="resnet18", choices=tuple(NETWORKS))
    add("--out", default=str(CLAIM / "timing" / "timing.json"))
    a = p.parse_args(rest)
    if device_problem(a.device):
        p.error(device_problem(a.device))
    methods = {"all": list(METHODS), "claim": list(CLAIM_METHODS)}.get(
        a.methods[0], a.methods
    )
    for f in (Path(a.out), Path(a.out).parent / "provenance.json"):
        if f.exists() and not a.force:
            raise guard.ConfigMismatchError(f"{f} exists; {guard.FORCE_HINT}")
        if f.exists():
            guard.backup(f)
    timing(
        methods,
        a.dataset,
        a.conditioning,
        a.steps,
        a.warmup,
        a.device,
        Path(a.out),
        a.model,
    )
    return 0


def trainer_timing_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    from kwng.experiments.cifar.timing import trainer_timing

    add = p.add_argument
    add("--methods", default="sgd,adam,kfac,kwng", type=names_arg(list(METHODS)))
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--precisions", default="bf16", type=names_arg(PRECISIONS),
        help="comma list of fp32, bf16")
    add("--epochs", type=int_arg(1), default=2)
    add("--trace-steps", type=int_arg(1), default=256)
    add("--data-root", default=None)
    add("--source", default="auto", choices=("auto", "official", "jpeg", "sample"))
    add("--model", default="resnet18", choices=tuple(NETWORKS))
    add("--device", default=None)
    add("--train-subset", type=int_arg(1), default=None)
    add("--out", default=str(RESULTS / "authors100" / "timing" / "trainer_timing.json"))
    a = p.parse_args(rest)
    if device_problem(a.device):
        p.error(device_problem(a.device))
    res = trainer_timing(
        a.methods,
        Path(a.out),
        conditioning=a.conditioning,
        precisions=a.precisions,
        epochs=a.epochs,
        trace_steps=a.trace_steps,
        data_root=a.data_root,
        source=a.source,
        model=a.model,
        device=a.device,
        train_subset=a.train_subset,
        force=a.force,
    )
    for r in res["rows"]:
        log.info(
            "trainer timing %-12s %s %-8s epoch %.2f s (loop %.2f s, "
            "after %.2f s, "
            "%.2f ms/step)",
            r["method"],
            r["precision"],
            r["mode"],
            r["steady_epoch_s"],
            r["steady_train_s"],
            r["steady_after_s"],
            r["steady_ms_per_step"],
        )
    for t in res["loss_match"]:
        log.info(
            "loss match %s over %d steps: captured vs eager %.3g, eager vs eager %.3g",
            t["method"],
            t["steps"],
            t["max_rel_diff_captured_vs_eager"],
            t["max_rel_diff_eager_vs_eager"],
        )
    return 0


def schedule_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    add = p.add_argument
    add("--plan", default="claim", choices=("claim",))
    add("--budget-s", type=number_arg(0), required=True)
    add("--timing", default=str(RESULTS / "timing" / "timing.json"))
    add("--concurrency-gain", type=number_arg(0), default=1.0)
    add("--gpus", type=int_arg(1), default=1)
    add("--procs-per-gpu", type=int_arg(1), default=None)
    add("--min-epochs", type=int_arg(1), default=1)
    add("--max-epochs", type=int_arg(1), default=400)
    add("--out", default=None, help="write the schedule here (default: print only)")
    a = p.parse_args(rest)
    plan = build_plan(a.plan)
    e = schedule_epochs(
        Path(a.timing),
        plan,
        a.budget_s,
        a.concurrency_gain,
        a.min_epochs,
        a.max_epochs,
        gpus=a.gpus,
        procs_per_gpu=a.procs_per_gpu,
    )
    if a.out:
        guard.write_json_guarded(
            a.out,
            {
                "epochs": e,
                "budget_s": a.budget_s,
                "concurrency_gain": a.concurrency_gain,
                "gpus": a.gpus,
                "timing": a.timing,
                "plan": a.plan,
                "runs": len(plan),
                "milestones": milestones_for(e, "claim"),
            },
            a.force,
        )
    log.info(
        "schedule: %d epochs fit %.0f s for plan %s (%d runs)",
        e,
        a.budget_s,
        a.plan,
        len(plan),
    )
    print(e)
    return 0


def check_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    p.add_argument(
        "--suite", default="claim", choices=("claim", "study6", "authors100", "fig3")
    )
    p.add_argument("--tiers", default="1", help="authors100: comma list of tiers")
    p.add_argument(
        "--root",
        default=None,
        help="default: results/cifar/claim (claim), results/cifar (study6)",
    )
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--min-epochs", type=int, default=30)
    a = p.parse_args(rest)
    if a.suite == "fig3":
        return fig3_check(a.root)
    if a.suite == "authors100":
        from kwng.experiments.cifar.methods import AUTHORS100_TIERS
        from kwng.experiments.cifar.results import check_authors100

        try:
            tiers = tuple(int(t) for t in a.tiers.split(","))
        except ValueError:
            tiers = ()
        if not tiers or set(tiers) - set(AUTHORS100_TIERS):
            p.error(f"--tiers: a comma list of {AUTHORS100_TIERS}, got {a.tiers!r}")
        res = check_authors100(a.root or RESULTS / "authors100", a.dataset, tiers)
    elif a.suite == "claim":
        res = check_claim(a.root or CLAIM, a.dataset, a.min_epochs)
    else:
        res = check_results(a.root or RESULTS, a.dataset)
    extra = (("diverged:", res["diverged"]) if "diverged" in res
             else ("cut by the budget (documented):", res["cut"]))
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "not ok:", json.dumps(res["missing"] + res["incomplete"]),
          extra[0], json.dumps(extra[1]))
    return 0 if not res["missing"] and not res["incomplete"] else 1


def fig3_check(root: str | None) -> int:
    """``cifar check --suite fig3``: every record of the Fig. 3 protocol against the
    protocol (:func:`~kwng.experiments.cifar.fig3.check_fig3`), then the selection so
    far and the queue left. Exit 1 if a record is bad or unfinished."""
    from kwng.experiments.cifar.fig3 import FIG3, check_fig3, grid_state, load_protocol

    p = load_protocol()
    res = check_fig3(root or FIG3, p)
    for name, problem in res["bad"]:
        print("bad:", name, "-", problem)
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "incomplete:", json.dumps(res["incomplete"]))
    for key, st in grid_state(p, root or FIG3).items():
        runs = " ".join(f"{lr:g}:{s}" for lr, s in sorted(st["runs"].items()))
        print(f"{key:22s} selected {st['selected']} final {st['final']} "
              f"next {st['next']}  [{runs}]")
    return 1 if res["bad"] or res["incomplete"] else 0


#: the reporting commands, name -> ``(parser, argv) -> exit code``
COMMANDS = {
    "select": select_command,
    "timing": timing_command,
    "schedule": schedule_command,
    "check": check_command,
    "trainer-timing": trainer_timing_command,
}
