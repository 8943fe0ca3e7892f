"""The READMEs' commands on a fresh checkout write nothing that git would see: each runs
(in its small form: the tiny network on the bundled CIFAR sample, one epoch, the CPU)
in a temporary copy of the repository's files, committed to a new git repository, and
``git status --porcelain`` must stay empty afterwards (results go to the git-ignored
``scratch/``, checkpoints to ``checkpoints/``). The root ``README.md`` carries the two
snippets; each study's commands live in its ``studies/<study>/README.md``, and every
command below names the README that must show it.

The synthetic sweeps (relerr, bandwidth, flow, fisher, the estimator timing) take
minutes on a shared CPU and run only with ``KWNG_README_ALL=1``; their write paths are
the same ``--out scratch/...`` folders.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from studies.bench.distributed_check import free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: the READMEs that document commands, by path relative to the repository root
READMES = {p.relative_to(ROOT).as_posix(): p.read_text()
           for p in [ROOT / "README.md",
                     *sorted((ROOT / "studies").rglob("README.md"))]}
PY = sys.executable
XP = [PY, "-m", "studies"]
TINY = ["--source", "sample", "--model", "tiny", "--device", "cpu"]
SLOW = os.environ.get("KWNG_README_ALL") != "1"


def _snippet() -> str:
    """The README's estimator example (the Python block that calls kwng_gradient)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    return next(b for b in blocks if "kwng.kwng_gradient(" in b)


SYN = "studies/synthetic/README.md"
CLAIM = "studies/claim_suite/README.md"
A100 = "studies/authors100/README.md"
CIFAR = "studies/cifar/README.md"

#: (the README that shows it, the command it stands for, the small form run here, slow)
COMMANDS = [
    ("README.md", "kwng.kwng_gradient(lambda t: model.sample(t, Z)",
     [PY, "-c", _snippet()], False),
    (CIFAR, "python -m studies cifar --conditioning ill --method kwng --seed 0",
     [*XP, "cifar", "--conditioning", "ill", "--method", "kwng", "--seed", "0",
      "--epochs", "1", "--schedule", "claim", "--lr", "1", "--out", "scratch/cifar",
      *TINY, "--train-subset", "200", "--no-progress"], False),
    (CLAIM, "python -m studies cifar select", [*XP, "cifar", "select"], False),
    (CLAIM, "python -m studies cifar timing --methods claim --out "
     "scratch/cifar/timing.json",
     [*XP, "cifar", "timing", "--methods", "sgd", "--model", "tiny", "--device", "cpu",
      "--steps", "1", "--warmup", "0", "--out", "scratch/cifar/timing.json"], False),
    (CLAIM, "python -m studies cifar schedule --plan claim --budget-s 900",
     [*XP, "cifar", "schedule", "--plan", "claim", "--budget-s", "900", "--gpus", "4",
      "--procs-per-gpu", "5", "--timing", "results/cifar/claim/timing/timing.json"],
     False),
    (CLAIM, "python -m studies cifar check ", [*XP, "cifar", "check"], False),
    (A100, "python -m studies cifar check --suite authors100 --tiers 1,2,3",
     [*XP, "cifar", "check", "--suite", "authors100", "--tiers", "1,2,3"], False),
    (A100, "python -m studies cifar trainer-timing --methods",
     [*XP, "cifar", "trainer-timing", "--methods", "sgd", "--precisions", "fp32",
      "--epochs", "1", "--trace-steps", "2", *TINY, "--train-subset", "200",
      "--out", "scratch/cifar/trainer_timing.json"], False),
    (CIFAR, "torchrun --nproc-per-node=2 -m studies cifar ddp --device cpu --model "
     "tiny", [PY, "-m", "torch.distributed.run", "--nproc-per-node=2",
              "--master-port", "PORT", "-m", "studies", "cifar", "ddp",
              "--device", "cpu", "--model", "tiny", "--source", "sample", "--epochs",
              "1", "--subset", "256", "--batch", "16", "--no-progress"], False),
    (SYN, "python -m studies relerr --scale small",
     [*XP, "relerr", "--scale", "small", "--model", "sphere", "--out",
      "scratch/relerr", "--no-progress"], True),
    (SYN, "python -m studies bandwidth --scale small",
     [*XP, "bandwidth", "--scale", "small", "--model", "sphere", "--out",
      "scratch/bandwidth", "--no-progress"], True),
    (SYN, "python -m studies flow --scale small",
     [*XP, "flow", "--scale", "small", "--out", "scratch/flow", "--no-progress"], True),
    ("studies/fisher/README.md", "python -m studies fisher --scale small",
     [*XP, "fisher", "--scale", "small", "--out", "scratch/fisher", "--no-progress"],
     True),
    ("studies/bench/README.md", "python -m studies.bench.estimator_time [--json "
     "scratch/estimator_time.json]",
     [PY, "-m", "studies.bench.estimator_time", "--json",
      "scratch/estimator_time.json"], True),
]


def _git(copy: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=copy, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore) in a
    new git repository, committed: a fresh clone of the working tree."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository's .git")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    copy = tmp_path_factory.mktemp("checkout")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, copy / f)
    _git(copy, "init", "-q")
    _git(copy, "add", "-A")
    _git(copy, "commit", "-q", "-m", "checkout")
    return copy


def _name(argv: list[str]) -> str:
    words = [a for a in argv[1:] if not a.startswith("-") and "\n" not in a]
    return " ".join(words[:3]) or "estimator example"


@pytest.mark.parametrize("path, readme, argv, slow", COMMANDS,
                         ids=[_name(c[2]) for c in COMMANDS])
def test_readme_command_writes_nothing_git_sees(checkout, path, readme, argv, slow):
    assert readme in READMES[path], f"{path} no longer shows {readme!r}"
    if slow and SLOW:
        pytest.skip("minutes on a shared CPU: KWNG_README_ALL=1 runs it")
    argv = [str(free_port()) if a == "PORT" else a for a in argv]
    env = {**os.environ, "PYTHONPATH": str(checkout), "KWNG_SCALE": "small",
           "OMP_NUM_THREADS": "1"}
    try:
        res = subprocess.run(argv, cwd=checkout, env=env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""
    finally:  # the next command starts from the committed files again
        _git(checkout, "reset", "-q", "--hard")
        _git(checkout, "clean", "-q", "-f", "-d")


def test_the_baseline_folder_of_the_step_cost_recheck_is_ignored(checkout):
    assert "mkdir -p .baseline && git archive" in READMES["studies/bench/README.md"]
    _git(checkout, "check-ignore", "-q", ".baseline/kwng/__init__.py")
