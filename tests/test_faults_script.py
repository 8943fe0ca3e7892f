"""Fault case: ``scripts/run_cifar_gpu.sh`` checks every
prerequisite before it touches anything and never moves tracked files.

The script runs on the CPU (``GPUS=0``) in a temporary copy of the parts of the tree it
uses (``kwng/``, ``studies/``, ``scripts/``, ``results/cifar/``); the committed results
are only
copied."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = "studies/cifar/data_sample/cifar10_sample.npz"


def _tree(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for part in ("kwng", "studies", "scripts"):
        shutil.copytree(ROOT / part, repo / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "results" / "cifar", repo / "results" / "cifar")
    return repo


def _snapshot(folder: Path) -> dict[str, object]:
    """Every path under ``folder``: file bytes, link targets, folders."""
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        if p.is_symlink():
            out[key] = ("link", os.readlink(p))
        elif p.is_file():
            out[key] = p.read_bytes()
        else:
            out[key] = "dir"
    return out


def _script(repo: Path, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("SET", "DATA", "EPOCHS")}
    full.update(PY=sys.executable, GPUS="0", OUT=str(tmp_path / "out"), TIMING="0",
                PYTHONPATH=str(repo))
    full.update(env)
    return subprocess.run(["bash", "scripts/run_cifar_gpu.sh"], cwd=repo, env=full,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("env, says", [
    ({}, ".data/cifar10_jpeg.npz not found"),
    ({"DATA": SAMPLE, "GPUS": "two"},
     "GPUS must be a non-negative integer"),
    ({"DATA": SAMPLE, "EPOCHS": "auto"},
     "EPOCHS=auto needs CLAIM_BUDGET_S"),
    ({"DATA": SAMPLE, "PY": "no-such-python"},
     "python 'no-such-python' not found"),
])
def test_missing_prerequisite_changes_nothing(tmp_path, env, says):
    repo = _tree(tmp_path)
    before = _snapshot(repo)
    res = _script(repo, tmp_path, **env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert says in res.stderr and "nothing was changed" in res.stderr
    assert _snapshot(repo) == before  # no move, no link, no checkpoints/ folder
    assert not (tmp_path / "out").exists()


def test_a_call_keeps_tracked_files_in_place(tmp_path):
    # all prerequisites met (the committed sample as data, tiny model), no time for
    # runs: the call refuses to credit the committed selection to these settings,
    # and neither its setup nor its end moves a tracked file
    repo = _tree(tmp_path)
    claim = repo / "results" / "cifar" / "claim"
    before = _snapshot(claim)
    res = _script(repo, tmp_path, DATA=SAMPLE, LIMIT="0",
                  SET="model=tiny device=cpu")
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "refused" in res.stdout and "differing keys" in res.stderr
    assert not claim.is_symlink() and _snapshot(claim) == before
    work = repo / "checkpoints" / "keep" / "work" / "results" / "cifar" / "claim"
    assert _snapshot(work) == before  # the machine's state: a copy
    import tarfile

    with tarfile.open(tmp_path / "out" / "cifar_claim.tar.gz") as tar:
        names = set(tar.getnames())
    assert "results/cifar/claim/selection/selected.json" in names
