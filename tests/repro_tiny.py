"""The CIFAR trainer's per-epoch numbers on a fixed tiny problem, kept as a fixture
(``tests/data/repro_tiny.json``) so that a change to the trainer's structure can show it
trains as before: 2 epochs of the tiny CNN on 200 images of the committed sample, a
50-image validation split, the authors' schedule and ε, CPU, one thread.

The runs are in float64 (the trainer's ``precision="fp64"``): float32 training
amplifies the last-bit differences between CPUs (vector width, summation order) to
1e-3 relative within 8 steps, float64 keeps them at round-off, so a tight tolerance
(:data:`RTOL`) still means "trains as before". Integers (steps, counters) and the
fields computed from counts (accuracies) must match exactly.

Commands (from the repository root)::

    PYTHONPATH=. python tests/repro_tiny.py             # compare with the fixture
    PYTHONPATH=. python tests/repro_tiny.py --spread    # measure the cross-CPU spread
    PYTHONPATH=. python tests/repro_tiny.py --mutations # every mutation must fail
    PYTHONPATH=. python tests/repro_tiny.py --write     # regenerate the fixture

Regenerate only when a change of the numbers is intended, and say why in the commit.
``--spread`` reruns every case under ``ATEN_CPU_CAPABILITY`` ∈ :data:`CAPABILITIES` ×
1 and 2 threads (``--precision fp32`` shows the float32 spread for comparison), prints
the largest relative difference to the fixture per field and fails unless :data:`RTOL`
is at least :data:`MARGIN` times the float64 spread. ``--mutations`` applies each
change of :data:`MUTATIONS` to every case it concerns and fails if one of them still
passes the comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "data" / "repro_tiny.json"
#: (method, conditioning, step) of every fixture run
CASES = (("sgd", "ill", 0.1), ("sgd_momentum_wd", "well", 0.05), ("adam", "ill", 1e-3),
         ("kwng", "ill", 1.0), ("kwng", "well", 0.5), ("diag_Ttilde", "ill", 1.0),
         ("kfac", "ill", 0.1))
#: per-epoch fields that depend on timing, not on what was trained
TIMING = ("time_train", "time_eval", "time_unix")
#: the relative tolerance of every float field in float64 (``--spread`` checks it)
RTOL = 1e-8
#: zero stays zero up to this
ATOL = 1e-12
#: RTOL must be at least this many times the measured float64 spread
MARGIN = 100.0
#: float fields that are ratios of counts: exact
COUNTED = ("train_acc", "test_acc", "val_acc", "test_acc_per_class",
           "test_precision_per_class")
#: the CPU code paths the spread is measured over
CAPABILITIES = ("default", "avx2", "avx512")


def tiny_rows(method: str, conditioning: str, lr: float, root: str, threads: int = 1,
              precision: str = "fp64") -> list[dict]:
    """Train one fixture case under ``root`` on ``threads`` CPU threads in
    ``precision`` and return its per-epoch rows without the timing fields."""
    from studies.cifar import train

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cfg = {"source": "sample", "model": "tiny", "batch_size": 50, "epochs": 2,
           "lr": lr, "device": "cpu", "method": method, "conditioning": conditioning,
           "train_subset": 200, "val_size": 50, "eval_test": True,
           "schedule": "authors", "precision": precision,
           "out": str(Path(root) / "res"), "checkpoint_dir": str(Path(root) / "ck")}
    try:
        rec = train.run(cfg, progress=False)
    finally:
        torch.set_num_threads(before)
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rec["epochs"]]


def key(case: tuple) -> str:
    return "/".join(str(c) for c in case)


def rel_diff(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 for equal values, NaN equal to NaN)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _leaves(value, path: str) -> Iterator[tuple[str, object]]:
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    else:
        yield path, value


def differences(rows: list[dict], want: list[dict]) -> list[tuple[str, float]]:
    """``(epoch:field[index], relative difference)`` of every value of ``rows`` that
    differs from ``want`` beyond the tolerance (:data:`RTOL`; exact for integers,
    ``None`` and :data:`COUNTED` fields; ``inf`` for a missing or extra value)."""
    if not isinstance(rows, list) or not isinstance(want, list):
        raise ValueError("rows and want must be lists of per-epoch dicts")
    out: list[tuple[str, float]] = []
    if len(rows) != len(want):
        return [("epochs", math.inf)]
    for got, exp in zip(rows, want):
        tag = f"{exp['epoch']}:"
        for k in sorted(set(got) ^ set(exp)):
            out.append((tag + k, math.inf))
        for k in sorted(set(got) & set(exp)):
            a, b = dict(_leaves(got[k], k)), dict(_leaves(exp[k], k))
            if a.keys() != b.keys():
                out.append((tag + k, math.inf))
                continue
            for p in a:
                x, y = a[p], b[p]
                floats = isinstance(x, float) or isinstance(y, float)
                if floats and k not in COUNTED and x is not None and y is not None:
                    if not math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL) and not (
                            math.isnan(x) and math.isnan(y)):
                        out.append((tag + p, rel_diff(x, y)))
                elif x != y and not (floats and x is not None and y is not None
                                     and math.isnan(x) and math.isnan(y)):
                    out.append((tag + p, math.inf))
    return out


# ------------------------------------------------------------------------ the spread
def field_spread(rows: list[dict], want: list[dict]) -> dict[str, float]:
    """The largest relative difference of each field (over epochs and list entries)
    between ``rows`` and ``want``; integers enter as 0 or ``inf``."""
    out: dict[str, float] = {}
    for got, exp in zip(rows, want):
        for k in exp:
            a, b = dict(_leaves(got.get(k), k)), dict(_leaves(exp[k], k))
            worst = 0.0 if a.keys() == b.keys() else math.inf
            for p in a.keys() & b.keys():
                x, y = a[p], b[p]
                if isinstance(x, float) and isinstance(y, float):
                    worst = max(worst, rel_diff(x, y))
                elif x != y:
                    worst = math.inf
            out[k] = max(out.get(k, 0.0), worst)
    return out


def _rows_in_subprocess(capability: str, threads: int, precision: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    cmd = [sys.executable, __file__, "--rows", "--threads", str(threads),
           "--precision", precision]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def spread(precision: str) -> int:
    """Print the per-field spread of every case over the capabilities × threads (to
    the fixture in fp64; in fp32 to the run with the widest vectors on 1 thread);
    return 1 when float64's exceeds ``RTOL / MARGIN``."""
    runs = {(cap, threads): _rows_in_subprocess(cap, threads, precision)
            for cap in CAPABILITIES for threads in (1, 2)}
    want = (json.loads(FIXTURE.read_text()) if precision == "fp64"
            else runs[(CAPABILITIES[-1], 1)]["rows"])
    per_field: dict[str, float] = {}
    for (cap, threads), got in runs.items():
        worst = 0.0
        for case in CASES:
            for k, v in field_spread(got["rows"][key(case)], want[key(case)]).items():
                per_field[k] = max(per_field.get(k, 0.0), v)
                worst = max(worst, v)
        print(f"ATEN_CPU_CAPABILITY={cap:8s} (in effect: {got['capability']}) "
              f"threads={threads} precision={precision}: largest relative "
              f"difference {worst:.3g}")
    print("per field, the largest relative difference:")
    for k in sorted(per_field, key=lambda k: -per_field[k]):
        print(f"  {k:32s} {per_field[k]:.3g}")
    top = max(per_field.values())
    if precision == "fp64":
        ok = top * MARGIN <= RTOL
        print(f"float64: largest spread {top:.3g}, RTOL {RTOL:g} = "
              f"{RTOL / top if top else math.inf:.3g} × it (needs >= {MARGIN:g}): "
              f"{'ok' if ok else 'TOO CLOSE'}")
        return 0 if ok else 1
    return 0


# ---------------------------------------------------------------------- mutations
@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _optimizers(wrap: Callable) -> Iterator[None]:
    """Every optimizer of the method table built through ``wrap(build, model, lr,
    spec)`` (``build`` the original entry)."""
    from studies.cifar.methods import OPTIMIZERS

    orig = dict(OPTIMIZERS)
    OPTIMIZERS.update({k: functools.partial(wrap, f) for k, f in orig.items()})
    try:
        yield
    finally:
        OPTIMIZERS.update(orig)


@contextlib.contextmanager
def step_size_x101() -> Iterator[None]:
    """The optimizer's step size 1 % larger."""
    with _optimizers(lambda build, model, lr, spec: build(model, lr * 1.01, spec)):
        yield


@contextlib.contextmanager
def another_damping() -> Iterator[None]:
    """KWNG's damping ``D = ‖T‖`` instead of ``T̃``; KFAC's damping doubled."""
    from kwng.engine import precond
    from studies.cifar import baselines

    kwng_cls, kfac_cls = precond.KWNGPreconditioner, baselines.KFACPreconditioner

    def kwng(net, **kw):
        return kwng_cls(net, **{**kw, "damping": "T"})

    def kfac(model, **kw):
        return kfac_cls(model, **{**kw, "damping": 2 * kw["damping"]})

    with _patched(precond, "KWNGPreconditioner", kwng), \
            _patched(baselines, "KFACPreconditioner", kfac):
        yield


@contextlib.contextmanager
def one_step_more() -> Iterator[None]:
    """The first batch of the run trained twice (the step counter sees one step)."""
    from studies.cifar import train

    orig, seen = train.Run._step, set()

    def step(self, z, yb):
        if id(self) not in seen:
            seen.add(id(self))
            orig(self, z, yb)
        orig(self, z, yb)

    with _patched(train.Run, "_step", step):
        yield


@contextlib.contextmanager
def another_augmentation_seed() -> Iterator[None]:
    """The crops and flips from another generator (the batch order unchanged)."""
    from studies.cifar import images

    orig, other = images.draw_augmentation, torch.Generator().manual_seed(1)

    def draw(b, generator, pad=4):
        orig(b, generator, pad)  # keeps the run's generator where it was
        return orig(b, other, pad)

    with _patched(images, "draw_augmentation", draw):
        yield


@contextlib.contextmanager
def momentum_not_reset() -> Iterator[None]:
    """The optimizer starts from the state (momentum buffers, Adam's moments) that a
    first run of the same case left: the case is trained twice."""
    made = []

    def carried(build, model, lr, spec):
        opt = build(model, lr, spec)
        if made:
            opt.load_state_dict(made[-1].state_dict())
        made.append(opt)
        return opt

    with _optimizers(carried):
        yield


#: name -> (mutation, the methods it concerns: ``None`` for all)
MUTATIONS: dict[str, tuple[Callable, tuple[str, ...] | None]] = {
    "step size x 1.01": (step_size_x101, None),
    "another damping": (another_damping, ("kwng", "diag_Ttilde", "kfac")),
    "one step more": (one_step_more, None),
    "another augmentation seed": (another_augmentation_seed, None),
    "momentum buffer not reset": (momentum_not_reset, ("sgd_momentum_wd", "adam")),
}


def mutated_rows(name: str, case: tuple, root: str) -> list[dict]:
    """The rows of ``case`` trained under the mutation ``name``."""
    if name not in MUTATIONS:
        raise ValueError(f"unknown mutation {name!r}; accepted: {sorted(MUTATIONS)}")
    mutation, _ = MUTATIONS[name]
    with mutation():
        if name == "momentum buffer not reset":
            tiny_rows(*case, str(Path(root) / "first"))
        return tiny_rows(*case, str(Path(root) / "mutated"))


def mutations() -> int:
    """Apply every mutation to every case it concerns; print the fields it moves
    beyond the tolerance; return 1 if one passes the comparison."""
    want, passed = json.loads(FIXTURE.read_text()), []
    for name, (_, methods) in MUTATIONS.items():
        for case in CASES:
            if methods is not None and case[0] not in methods:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                diff = differences(mutated_rows(name, case, tmp), want[key(case)])
            fields = sorted({p.split(":", 1)[1].split("[")[0].split(".")[0]
                             for p, _ in diff})
            finite = [d for _, d in diff if math.isfinite(d)]
            print(f"{name:26s} {key(case):26s} "
                  f"{'FAILS' if diff else 'PASSES (bad)'}: {len(diff)} values, "
                  f"{len(fields)} fields beyond tolerance, largest finite relative "
                  f"difference {max(finite, default=0.0):.2g}")
            if not diff:
                passed.append((name, key(case)))
    print(f"{len(passed)} mutated runs passed the comparison" if passed
          else "every mutated run fails the comparison")
    return 1 if passed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--spread", action="store_true",
                       help="measure the spread across CPU capabilities and threads")
    group.add_argument("--mutations", action="store_true",
                       help="check that every mutation fails the comparison")
    group.add_argument("--rows", action="store_true",
                       help="print every case's rows as one JSON line (--spread's)")
    group.add_argument("--write", action="store_true",
                       help="regenerate the fixture (a committed file)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="fp64", choices=("fp64", "fp32"))
    args = ap.parse_args(argv)
    if args.spread:
        return spread(args.precision)
    if args.mutations:
        return mutations()
    out = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out[key(case)] = tiny_rows(*case, tmp, args.threads, args.precision)
    if args.rows:
        print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                          "rows": out}))
        return 0
    if not args.write:
        want, bad = json.loads(FIXTURE.read_text()), 0
        for case in CASES:
            diff = differences(out[key(case)], want[key(case)])
            bad += bool(diff)
            print(key(case), f"{len(diff)} values differ: {diff[:5]}" if diff
                  else "as the fixture")
        return 1 if bad else 0
    if args.precision != "fp64" or args.threads != 1:
        raise SystemExit("the fixture is written in fp64 on 1 thread")
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print("wrote", FIXTURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
