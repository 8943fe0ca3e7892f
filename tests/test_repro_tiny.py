"""The CIFAR trainer trains as when the fixture was written (:mod:`tests.repro_tiny`):
every per-epoch number of 7 tiny float64 runs (SGD, SGD + momentum + weight decay,
Adam, KWNG in both conditionings, the diagonal variant, KFAC) to
:data:`~tests.repro_tiny.RTOL` relative, integers and accuracies exactly; and a small
change to the training (step size, damping, one step, augmentation, optimizer state)
fails that comparison."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.repro_tiny import (
    CASES,
    FIXTURE,
    MUTATIONS,
    RTOL,
    differences,
    key,
    mutated_rows,
    tiny_rows,
)

EXPECTED = json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("case", CASES, ids=key)
def test_trainer_reproduces_the_fixture(case, tmp_path):
    if case[0] == "kfac":
        pytest.importorskip("nngeometry")
    rows = tiny_rows(*case, str(tmp_path))
    diff = differences(rows, EXPECTED[key(case)])
    assert not diff, f"{key(case)}: {diff[:10]} differ (relative tolerance {RTOL:g})"


def test_the_comparison_reads_every_kind_of_value():
    want = EXPECTED[key(CASES[3])]
    assert differences(want, want) == []
    row = json.loads(json.dumps(want[-1]))
    row["train_loss"] *= 1 + 10 * RTOL
    row["steps"] += 1
    row["test_acc"] += 1e-15  # a ratio of counts: exact
    row["row_movement"][3] *= 1 + 0.1 * RTOL  # within the tolerance
    got = dict(differences(want[:-1] + [row], want))
    assert set(got) == {"2:train_loss", "2:steps", "2:test_acc"}
    assert got["2:train_loss"] == pytest.approx(10 * RTOL, rel=1e-3)
    assert math.isinf(got["2:steps"])
    assert differences(want[:1], want) == [("epochs", math.inf)]
    with pytest.raises(ValueError, match="lists"):
        differences(want[0], want)


#: one case per mutation (the whole table: ``python tests/repro_tiny.py --mutations``)
MUTATED = {"step size x 1.01": CASES[4], "another damping": CASES[3],
           "one step more": CASES[6], "another augmentation seed": CASES[0],
           "momentum buffer not reset": CASES[1]}


def test_every_mutation_has_a_case():
    assert MUTATED.keys() == MUTATIONS.keys()
    for name, case in MUTATED.items():
        methods = MUTATIONS[name][1]
        assert methods is None or case[0] in methods, (name, case)


@pytest.mark.parametrize("name", list(MUTATED))
def test_a_mutation_fails_the_comparison(name, tmp_path):
    case = MUTATED[name]
    if case[0] == "kfac":
        pytest.importorskip("nngeometry")
    diff = differences(mutated_rows(name, case, str(tmp_path)), EXPECTED[key(case)])
    trained = {p for p, _ in diff
               if p.split(":", 1)[1].split("[")[0] in ("train_loss", "test_loss",
                                                        "feature_norm",
                                                        "last_layer_row_norms")}
    assert trained, f"{name} on {key(case)} moves no trained number: {diff[:10]}"
    with pytest.raises(ValueError, match="unknown mutation"):
        mutated_rows("no such change", case, str(tmp_path))


def test_the_cpu_code_path_asked_for_is_the_one_in_effect():
    """``make test-portable`` sets ``ATEN_CPU_CAPABILITY``; PyTorch falls back to its
    widest path for a name it does not know or a CPU that lacks it, and the second run
    would repeat the first."""
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    if asked is None:
        pytest.skip("ATEN_CPU_CAPABILITY is not set (make test-portable sets it)")
    assert torch.backends.cpu.get_cpu_capability().lower() == asked.lower()
