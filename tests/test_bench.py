"""The step-cost benchmark runs end to end on the CPU and writes its table.

Timings are never asserted (they depend on the machine); the table's shape, keys,
provenance and its refusal to replace an existing result are.
"""

import json

import pytest

from kwng import bench

ARGS = [
    "--device",
    "cpu",
    "--model",
    "mlp",
    "--batch",
    "16",
    "--steps",
    "1",
    "--warmup",
    "1",
    "--num-basis",
    "2",
    "--configs",
    "fp32_nchw",
    "--rows",
    "sgd,fwd_bwd_RN,kwng_fast,kwng_reference",
]


def test_bench_writes_one_row_per_mode_with_ratios(tmp_path):
    out = tmp_path / "step_cost.json"
    rec = bench.main(ARGS + ["--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["rows"] == json.loads(json.dumps(rec["rows"]))
    modes = [(r["mode"], r["num_basis"]) for r in rec["rows"]]
    assert modes == [
        ("sgd", None),
        ("fwd_bwd_RN", 2),
        ("kwng_fast", 2),
        ("kwng_reference", 2),
    ]
    for r in rec["rows"]:
        assert (
            r["precision"] == "fp32"
            and r["memory_format"] == "nchw"
            and r["median_ms"] > 0
        )
        assert r["ratio_to_sgd"] == pytest.approx(
            r["median_ms"] / rec["rows"][0]["median_ms"]
        )
    fast = next(r for r in rec["rows"] if r["mode"] == "kwng_fast")
    assert (
        fast["counters"]["serial_steps"] == 0
    )  # the replicated engine ran, not the fallback
    assert {"git_commit", "date", "config", "device"} <= set(rec["provenance"])


def test_bench_refuses_to_replace_a_result_and_checks_its_arguments(tmp_path):
    out = tmp_path / "step_cost.json"
    out.write_text("{}")
    with pytest.raises(SystemExit, match="exists"):
        bench.main(ARGS + ["--out", str(out)])
    assert out.read_text() == "{}"
    with pytest.raises(SystemExit, match="--rows"):
        bench.main(
            ["--device", "cpu", "--rows", "turbo", "--out", str(tmp_path / "x.json")]
        )
    with pytest.raises(SystemExit, match="--num-basis"):
        bench.main(
            ["--device", "cpu", "--num-basis", "0", "--out", str(tmp_path / "x.json")]
        )
