"""Records say what ran: a ``--capture`` that cannot capture (no CUDA device) is
recorded as eager or refused, and the trainer timing writes no captured-vs-eager loss
match for a capture that never ran. CPU, the tiny network on the bundled sample of
CIFAR-10."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from studies.cifar import train
from studies.cifar.cli import ddp_main
from studies.cifar.timing import trainer_timing

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the cases are about a machine without CUDA")


def _run_cfg(tmp_path: Path, **kw) -> dict:
    return {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 1,
            "lr": 0.1, "device": "cpu", "out": str(tmp_path / "res"),
            "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 200,
            "method": "sgd", **kw}


def test_capture_on_a_cpu_is_recorded_as_eager(tmp_path, caplog):
    record = train.run(_run_cfg(tmp_path, capture=True), progress=False)
    assert record["capture"] is False
    on_disk = json.loads(next((tmp_path / "res").rglob("metrics.json")).read_text())
    assert on_disk["capture"] is False
    assert "capture needs a CUDA device: the steps run eagerly on cpu" in caplog.text


def test_ddp_capture_without_cuda_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        ddp_main(["--device", "cpu", "--capture", "--model", "tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--capture replays CUDA graphs: it needs --device cuda" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_trainer_timing_on_a_cpu_writes_no_loss_match(tmp_path):
    out = tmp_path / "timing.json"
    res = trainer_timing(["sgd"], out, epochs=1, trace_steps=2, source="sample",
                         model="tiny", device="cpu", train_subset=200)
    assert res["loss_match"] == []
    assert json.loads(out.read_text())["loss_match"] == []
    rows = {r["asked_capture"]: r for r in res["rows"]}
    assert rows[True]["mode"] == "eager" and rows[True]["why_eager"] == "not on CUDA"
