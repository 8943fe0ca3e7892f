"""The scaling benchmark of KWNG data-parallel runs end to end on CPUs: the shell
driver ``scripts/run_ddp_scaling.sh`` with gloo, W = 1 and 2, a tiny CNN, writes one
merged file that :func:`studies.bench.ddp_record.check_scaling` accepts,
with every graph row recorded as not captured (no CUDA: counted, with the reason),
and never overwrites it. The numbers of such a dry run mean nothing and are never
committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studies.bench.ddp_figures import scaling_facts, scaling_table
from studies.bench.ddp_record import check_scaling, load_scaling

ROOT = Path(__file__).resolve().parents[1]


def _driver(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "DEVICE": "cpu",
           "MODEL": "tiny", "BATCH": "8", "NUM_BASIS": "3", "STEPS": "3", "WARMUP": "1",
           "WORLD_SIZES": "1 2", "EXTRA": "--image-size 8 --precisions fp32",
           "PER_W_TIMEOUT": "90"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "run_ddp_scaling.sh")],
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_scaling")
    res = _driver(out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_driver_writes_one_checked_file_and_never_overwrites_it(dry_run):
    path = dry_run / "ddp_scaling.json"
    record = load_scaling(path)
    assert record["world_sizes"] == [1, 2] and record["per_rank_batch"] == 8
    assert record["capture_fallbacks"] == {"1": 4, "2": 2}
    graph = [r for r in record["rows"] if r["capture"] == "graph"]
    assert all(r["capture_error"].startswith("no CUDA device") for r in graph)
    assert record["collectives"]["2"]["allreduce_kwng"]["values"] == 4 * record["q"]
    assert "run_ddp_scaling.sh" in record["provenance"]["driver"]
    head, rows = scaling_table(record)
    assert len(rows) == 2 and len(head) == len(rows[0])
    assert scaling_facts(record, "fp32")["world_size"] == "2"
    for W in ("1", "2"):  # each part records its own command
        assert "ddp_scaling" in record["provenance"]["part_commands"][W]
    before = path.read_bytes()
    again = _driver(dry_run)
    assert again.returncode == 2 and "exists" in again.stderr
    assert path.read_bytes() == before


def test_check_scaling_refuses_a_wrong_efficiency(dry_run):
    record = json.loads((dry_run / "ddp_scaling.json").read_text())
    row = next(r for r in record["rows"] if r["method"] == "kwng")
    row["efficiency"] *= 1.01
    with pytest.raises(ValueError, match="efficiency .* is not t_plain"):
        check_scaling(record)
    del record["provenance"]["git_commit"]
    with pytest.raises(ValueError, match="provenance lacks"):
        check_scaling(record)
