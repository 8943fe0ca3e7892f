"""The CIFAR trainer trains exactly as when the fixture was written
(:mod:`tests.repro_tiny`): every per-epoch number of 7 tiny runs (SGD, SGD + momentum +
weight decay, Adam, KWNG in both conditionings, the diagonal variant, KFAC), to 1e-6
relative, integers exactly."""

from __future__ import annotations

import json
import math

import pytest

from tests.repro_tiny import CASES, FIXTURE, key, tiny_rows

EXPECTED = json.loads(FIXTURE.read_text())


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("case", CASES, ids=key)
def test_trainer_reproduces_the_fixture(case, tmp_path):
    if case[0] == "kfac":
        pytest.importorskip("nngeometry")
    rows = tiny_rows(*case, str(tmp_path))
    want = EXPECTED[key(case)]
    assert len(rows) == len(want) == 2
    for got, exp in zip(rows, want):
        diff = [k for k in exp if k not in got or not _same(got[k], exp[k])]
        assert not diff and got.keys() == exp.keys(), (
            f"{key(case)} epoch {exp['epoch']}: {diff or set(got) ^ set(exp)} differ")
