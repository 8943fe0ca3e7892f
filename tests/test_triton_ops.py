"""The Triton kernels of the fast KWNG step (:mod:`kwng.engine.triton_support`).

The kernels run on the GPU; here Triton's interpreter runs them on CPU tensors
(``TRITON_INTERPRET=1``, set before Triton is imported, hence the subprocess) and
``tests/triton_interpret_checks.py`` compares them with the PyTorch operations they
replace. Skipped where Triton is not installed (it is in ``requirements.txt`` for Linux
x86-64). The stacked weight gradient, which needs no Triton, is checked in this process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kwng.engine import replicate_layers

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton not installed"
)
def test_kernels_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "triton_interpret_checks.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("stride,k", [(1, 3), (2, 3), (2, 1)])
def test_stacked_weight_gradient_equals_one_call_per_copy(fmt, stride, k):
    g = torch.Generator().manual_seed(0)
    R, N = 3, 4
    x0 = torch.randn(N, 3, 8, 8, generator=g, dtype=torch.float64).contiguous(
        memory_format=fmt
    )
    w = torch.randn(5, 3, k, k, generator=g, dtype=torch.float64).contiguous(
        memory_format=fmt
    )
    out = 8 // stride
    dy = torch.randn(R * N, 5, out, out, generator=g, dtype=torch.float64)
    dy = dy.contiguous(memory_format=fmt)
    args = ([stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], 1)
    loop = replicate_layers._wgrad_loop(dy, x0, w, R, args)
    stacked = replicate_layers._wgrad_stacked(dy, x0, w, R, args)
    assert stacked.shape == (R,) + tuple(w.shape)
    assert torch.allclose(stacked, loop, rtol=1e-12, atol=1e-12)
