"""The data-parallel CIFAR runner (``cifar ddp``,
:func:`studies.cifar.cli.ddp_main`) on two CPU ranks (gloo), tiny CNN on the
committed sample: a run interrupted after its first epoch and resumed records the same
epochs as the uninterrupted run, a complete run is skipped, and a rerun with another
configuration is refused (every rank stops, nothing hangs)."""

from __future__ import annotations

import pytest

from studies.bench.distributed_check import launch
from studies.kit.provenance import read_json

ARGS = ["-m", "studies", "cifar", "ddp", "--device", "cpu", "--model", "tiny",
        "--source", "sample", "--epochs", "2", "--subset", "64", "--batch", "8",
        "--eval-batch", "50", "--no-progress"]


def _run(tmp_path, name, *extra):
    out, ck = tmp_path / name, tmp_path / f"{name}_ck"
    logs = launch([*ARGS, "--out", str(out), "--checkpoint-dir", str(ck), *extra], 2,
                  timeout=90, logdir=tmp_path)
    return out / "tiny-W2-B8" / "cifar10" / "well" / "kwng" / "seed0", ck, logs[0]


def _rows(rdir):
    rec = read_json(rdir / "metrics.json")
    rows = [{k: v for k, v in r.items() if not k.startswith("time_")}
            for r in rec["epochs"]]
    return rec, rows


def test_interrupted_run_resumes_exactly_and_reruns_are_guarded(tmp_path):
    full, _, _ = _run(tmp_path, "full")
    rec, rows = _rows(full)
    assert rec["complete"] and rec["world_size"] == 2 and rec["global_batch"] == 16
    assert [r["epoch"] for r in rows] == [1, 2] and all(r["steps"] for r in rows)
    assert all(r["replica_spread"] == 0.0 for r in rows)  # the ranks never drift apart
    assert (full / "provenance.json").is_file()

    part, ck, _ = _run(tmp_path, "part", "--stop-after-epoch", "1")
    assert not read_json(part / "metrics.json")["complete"]
    assert len(list(ck.rglob("checkpoint.pt"))) == 1
    _, _, log = _run(tmp_path, "part")
    assert "resumed after epoch 1" in log
    rec2, rows2 = _rows(part)
    assert rec2["complete"] and rows2 == rows  # the same losses, accuracies and ε
    assert not list(ck.rglob("checkpoint.pt"))

    _, _, log = _run(tmp_path, "full")
    assert "is complete: skipped" in log
    with pytest.raises(RuntimeError, match="another configuration.*lr"):
        _run(tmp_path, "full", "--lr", "0.05")
