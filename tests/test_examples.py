"""The code users copy runs: every script of ``examples/`` at tiny size, and every
Python block of ``README.md`` as written (each in a fresh interpreter, from the
repository root)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "cnn_sgd_kwng.py": ["--steps", "3", "--batch", "16", "--image-size", "8"],
    "bf16_autocast.py": ["--steps", "3", "--batch", "16", "--image-size", "8"],
}


def _run(args: list[str], timeout: int = 240) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def readme_python_blocks() -> list[str]:
    """The ```python blocks of README.md, in order."""
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_every_example_has_a_tiny_run():
    scripts = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert scripts == sorted([*TINY, "ddp_kwng.py"])


@pytest.mark.parametrize("script", sorted(TINY))
def test_example_runs_at_tiny_size(script):
    out = _run([sys.executable, f"examples/{script}", *TINY[script]])
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses and all(v == v and v < 10 for v in losses), out


@pytest.mark.parametrize("method", ["kwng", "sgd"])
def test_the_cnn_example_learns_in_its_default_steps(method):
    """The CNN example's task is learnable: in its default 100 steps the loss of the
    last ten batches falls well below chance (ln 10), with KWNG and with plain SGD."""
    spec = importlib.util.spec_from_file_location("cnn_sgd_kwng",
                                                  ROOT / "examples" / "cnn_sgd_kwng.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--method", method])
    assert len(losses) == 100
    assert sum(losses[-10:]) / 10 < 0.25 * math.log(10), losses[-10:]


def test_torchrun_example_keeps_two_gloo_ranks_identical():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "examples/ddp_kwng.py", "--steps", "2",
                "--batch", "8"])
    assert "2 ranks, replica spread 0.0e+00" in out, out


def test_readme_python_blocks_run_as_written():
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    for block in blocks:
        assert "..." not in block, "a README snippet must run as written"
        _run([sys.executable, "-c", block])
