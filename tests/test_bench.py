"""The step-cost benchmark runs end to end on the CPU and writes its table.

Timings are never asserted (they depend on the machine); the table's shape, keys,
provenance and its refusal to replace an existing result are.
"""

import json
from pathlib import Path

import pytest
import torch

from studies.bench import step_cost as bench

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


def test_bench_times_the_kwng_rows_once_per_gpu_path(tmp_path, capsys):
    args = ARGS[:-1] + ["sgd,kwng_fast", "--gpu-paths", "triton,compile"]
    rec = bench.main(args + ["--out", str(tmp_path / "paths.json")])
    assert [(r["mode"], r.get("gpu_path")) for r in rec["rows"]] == [
        ("sgd", None), ("kwng_fast", "triton"), ("kwng_fast", "compile")]
    with pytest.raises(SystemExit):
        bench.main(args[:-1] + ["cudnn", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert ("--gpu-paths must be a comma list of ['auto', 'triton', 'compile', "
            "'eager']") in err


def test_bench_times_each_kwng_row_once_per_refresh_every(tmp_path, capsys):
    """--refresh-every 1,3: every KWNG row once per k (a whole period timed: 3 steps
    for k = 3), the SGD and Adam rows once; mean and median with their ratios."""
    args = ARGS[:-1] + ["sgd,adam,kwng_fast,kwng_reference,diag_fast",
                        "--refresh-every", "1,3", "--steps", "2"]
    rec = bench.main(args + ["--out", str(tmp_path / "k.json")])
    got = [(r["mode"], r.get("refresh_every"), r["steps"]) for r in rec["rows"]]
    assert got == [("sgd", None, 2), ("adam", None, 2),
                   ("kwng_fast", 1, 2), ("kwng_fast", 3, 3),
                   ("kwng_reference", 1, 5), ("kwng_reference", 3, 6),
                   ("diag_fast", 1, 2), ("diag_fast", 3, 3)]
    for r in rec["rows"]:
        assert r["mean_ms"] > 0 and r["ratio_to_sgd_graph"] is None
        if "counters" in r:
            assert r["counters"]["serial_steps"] == r["counters"]["fallbacks"] == 0
    with pytest.raises(SystemExit):
        bench.main(args[:-4] + ["--refresh-every", "0",
                                "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert "--refresh-every must be a comma list of integers >= 1" in err


def test_bench_refuses_to_replace_a_result_and_checks_its_arguments(tmp_path, capsys):
    out = tmp_path / "step_cost.json"
    out.write_text("{}")
    with pytest.raises(SystemExit, match="exists"):
        bench.main(ARGS + ["--out", str(out)])
    assert out.read_text() == "{}"
    with pytest.raises(SystemExit):
        bench.main(
            ["--device", "cpu", "--rows", "turbo", "--out", str(tmp_path / "x.json")]
        )
    assert "--rows must be a comma list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(
            ["--device", "cpu", "--num-basis", "0", "--out", str(tmp_path / "x.json")]
        )
    assert "--num-basis entries must lie in" in capsys.readouterr().err


def test_bench_builds_the_vit_rows_with_every_parameter_batched(tmp_path):
    """--model vit_tiny (the study's ViT at CPU size): SGD, Adam, the exact KWNG step
    and the amortized one (k = 2), with no serial backward pass (the engine batches
    the layer norms, the attention projections and the tokens)."""
    args = ["--device", "cpu", "--model", "vit_tiny", "--batch", "8", "--steps", "2",
            "--warmup", "1", "--num-basis", "2", "--configs", "fp32_nchw",
            "--rows", "sgd,adam,kwng_fast", "--refresh-every", "1,2"]
    rec = bench.main(args + ["--out", str(tmp_path / "vit.json")])
    assert rec["model"] == "vit_tiny"
    assert [(r["mode"], r.get("refresh_every")) for r in rec["rows"]] == [
        ("sgd", None), ("adam", None), ("kwng_fast", 1), ("kwng_fast", 2)]
    for r in rec["rows"][2:]:
        assert r["counters"]["serial_steps"] == 0


RESULTS = Path(__file__).resolve().parent.parent / "results" / "benchmarks"


def test_committed_step_cost_table_is_complete_and_traceable():
    """The committed GPU table: every configuration × row × M of the benchmark,
    each with its precision, memory format, mode and ratio to the SGD row of its
    configuration; the provenance names the commit and the GPU."""
    rec = json.loads((RESULTS / "step_cost.json").read_text())
    prov = rec["provenance"]
    assert len(prov["git_commit"]) >= 7 and "cuda" in prov["command"] + str(
        prov["config"]
    )
    assert rec["device"].startswith("NVIDIA") and rec["model"] == "resnet18"
    assert rec["batch_size"] == 128
    rows = {
        (r["precision"], r["memory_format"], r["mode"], r["num_basis"]): r
        for r in rec["rows"]
    }
    for name in bench.CONFIGS:
        prec = "bf16_autocast" if name.startswith("bf16") else "fp32"
        fmt = "channels_last" if name.endswith("channels_last") else "nchw"
        sgd = rows[(prec, fmt, "sgd", None)]["median_ms"]
        for mode in bench.ROWS:
            for M in (None,) if mode in ("sgd", "sgd_graph", "fwd_bwd_N") else (5, 20):
                r = rows[(prec, fmt, mode, M)]
                assert r["median_ms"] > 0 and r["steps"] >= 5
                assert r["ratio_to_sgd"] == pytest.approx(r["median_ms"] / sgd)
                assert r["peak_mem_mb"] > 0


def test_committed_exactness_record_is_traceable():
    rec = json.loads((RESULTS / "precond_exactness.json").read_text())
    assert rec["provenance"]["device"].startswith("NVIDIA")
    assert len(rec["provenance"]["git_commit"]) >= 7
    res = rec["results"]
    assert set(res) == {
        "float64",
        "fp32_nchw",
        "fp32_channels_last",
        "bf16_channels_last",
    }
    for name in ("fp32_nchw", "fp32_channels_last", "bf16_channels_last"):
        assert res[name]["serial_steps"] == 0  # the fast path ran, not the fallback


def test_capture_step_rejects_bad_input_and_a_missing_gpu():
    from kwng import capture_step

    with pytest.raises(ValueError, match="step must be a callable"):
        capture_step(3)
    with pytest.raises(ValueError, match="warmup"):
        capture_step(lambda: None, warmup=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            capture_step(lambda: None)


def test_engine_parts_benchmark_writes_its_table(tmp_path):
    """studies.bench.engine_parts on tiny shapes on the CPU (eager stands in
    for the compiler): every part's columns, the rule's verdict slot and the
    provenance."""
    from studies.bench import engine_parts as mod

    out = tmp_path / "engine_parts.json"
    mod.main(["--device", "cpu", "--smoke", "--reps", "1", "--compile-backend", "eager",
              "--batch", "4", "--copies", "3", "--json", str(out)])
    rec = json.loads(out.read_text())
    for dt in ("float32", "bfloat16"):
        for part in ("repeat", "relayout", "bn_backward"):
            ms = rec["parts"][dt][part]["ms"]
            assert ms["eager"] > 0 and ms["compile"] > 0 and ms["triton"] is None
    assert rec["parts"]["direction"]["ms"]["compile"] > 0
    assert {"git_commit", "date", "config", "device"} <= set(rec["provenance"])
    assert mod.verdict({"compile": 1.5, "triton": 1.0}, 21.8)["keep_kernel"] is False
    assert mod.verdict({"compile": 2.5, "triton": 1.0}, 21.8)["keep_kernel"] is True


def test_the_house_recheck_is_one_machine_before_and_after():
    """results/benchmarks/recheck: the step-cost table of commit f4a4d91 (before the
    house was rebuilt) and of the rebuilt code, measured in one call on one GPU: the
    same rows, device and configuration, both commits recorded; and the exactness of the
    fast path at the rebuilt commit (fp64 fast vs serial T to round-off)."""
    from studies.bench.figures import compare_steps, step_rows

    before = json.loads((RESULTS / "recheck" / "step_cost_before.json").read_text())
    after = json.loads((RESULTS / "recheck" / "step_cost_after.json").read_text())
    assert before["provenance"]["git_commit"].startswith("f4a4d91")
    assert after["provenance"]["git_commit"] != before["provenance"]["git_commit"]
    assert before["device"] == after["device"] and "H100" in after["device"]
    assert set(step_rows(before)) == set(step_rows(after))
    header, rows = compare_steps(before, after)
    assert len(rows) == len(after["rows"]) and header[-1] == "after / before"
    exact = json.loads((RESULTS / "recheck" / "precond_exactness.json").read_text())
    assert exact["provenance"]["git_commit"] == after["provenance"]["git_commit"]
    assert exact["results"]["float64"]["rel_err_T_fast_vs_serial_fp64"] < 1e-12


def test_the_kernel_verdicts_are_the_code():
    """results/benchmarks/engine_parts.json decided which Triton kernels stay: the kept
    ones are in the engine, the deleted ones are not (the measured rule)."""
    from kwng.engine import triton_support
    from studies.bench.figures import kernel_verdicts, path_rows

    parts = json.loads((RESULTS / "engine_parts.json").read_text())
    assert "H100" in parts["provenance"]["device"]
    verdicts = {(r[0], r[1]): r[-1] for r in kernel_verdicts(parts)[1]}
    kept = {p for (p, _), v in verdicts.items() if v == "kernel kept"}
    deleted = {p for (p, _), v in verdicts.items() if v == "kernel deleted"}
    assert kept == {"bn_backward", "direction"} and deleted == {"repeat", "relayout"}
    assert not hasattr(triton_support, "repeat")
    assert not hasattr(triton_support, "interleave")
    engine = RESULTS.parent.parent / "kwng" / "engine"
    assert (engine / "triton_bn.py").is_file()
    assert (engine / "triton_solve.py").is_file()
    paths = path_rows(json.loads((RESULTS / "step_gpu_paths.json").read_text()))
    assert set(paths) == {(p, g) for p in ("fp32", "bf16_autocast")
                          for g in ("triton", "compile")}


def test_the_amortized_values_set_the_reuse_step_beside_captured_sgd():
    """The committed amortized step cost: the reuse step's ratio is its median over
    captured SGD's (the floor that hiding the refresh could reach), below every mean
    ratio of k > 1, which carries the refreshes."""
    from studies.bench import figures as pb

    base = RESULTS / "amortized"
    am = json.loads((base / "step_cost_amortized.json").read_text())
    old = json.loads((base / "step_cost_amortized_bf16.json").read_text())
    v = pb.amortized_values(am, old)
    for tag in ("bf16", "fp32"):
        ratio = float(v[f"am_{tag}_reuse_ratio"])
        assert ratio == pytest.approx(float(v[f"am_{tag}_reuse"])
                                      / float(v[f"am_{tag}_sgd"]), abs=0.01)
        assert ratio < float(v[f"am_{tag}_k20"]) < float(v[f"am_{tag}_k1"])


def test_profile_step_refuses_a_refresh_interval_below_one_and_unknown_modes():
    from studies.bench import profile_step

    with pytest.raises(SystemExit, match="--refresh-every must be >= 1, got 0"):
        profile_step.main(["--refresh-every", "0"])
    with pytest.raises(SystemExit, match="--modes entries must be among"):
        profile_step.main(["--modes", "sgd,nothing"])


def test_the_reuse_breakdown_splits_the_excess_over_sgd_into_parts():
    """``reuse_breakdown``: each kernel's time beyond SGD's goes to the first part whose
    pattern it matches, the rest to "everything else"; the parts and the rest sum to
    the excess; the committed profile (a reuse step, bf16) has provenance and its
    excess is the difference of its totals."""
    from studies.bench import figures as pb

    rec = {"rows": [
        {"config": "c", "mode": "sgd", "total_us": 100.0,
         "kernels_us": {"conv": 80.0, "copy": 20.0}},
        {"config": "c", "mode": "kwng_fast", "total_us": 160.0,
         "kernels_us": {"conv": 80.0, "copy": 25.0, "_norms_kernel": 10.0,
                        "_system_kernel": 20.0, "CatArrayBatchedCopy_x": 15.0,
                        "getrf_wo_pivot": 10.0}}]}
    header, rows, v = pb.reuse_breakdown(rec, "c")
    assert [r[1] for r in rows[:4]] == ["30", "15", "10", "5"] and rows[4][1] == "60"
    assert v["rp_target"] == "35" and v["rp_bound"] == "45" and v["rp_ratio"] == "1.60"
    committed = json.loads((RESULTS / "amortized" / "profile_reuse.json").read_text())
    assert committed["refresh_every"] > 5 + committed["steps"]  # every step reuses
    assert committed["provenance"]["git_commit"] and committed["provenance"]["device"]
    _, _, cv = pb.reuse_breakdown(committed)
    rows_c = {r["mode"]: r for r in committed["rows"]}
    assert float(cv["rp_excess"]) == pytest.approx(
        rows_c["kwng_fast"]["total_us"] - rows_c["sgd"]["total_us"], abs=0.5)


def test_profile_step_attributes_each_kernel_to_the_innermost_line_of_ours():
    """``source_of`` walks up the profile's op tree to the innermost frame under
    ``kwng/`` or ``studies/``; an op of the autograd engine is the backward pass;
    anything else is named by its outermost op. ``source_times`` sums the kernels."""
    from types import SimpleNamespace as E

    from studies.bench import profile_step as ps

    top = E(name="/x/site/torch/nn/module.py(10): _call", cpu_parent=None)
    ours = E(name="/w/main/kwng/engine/precond.py(450): _step", cpu_parent=top)
    inner = E(name="/w/main/kwng/solve.py(12): safeguard", cpu_parent=ours)
    op = E(name="aten::cat", cpu_parent=inner,
           kernels=[E(duration=30.0), E(duration=10.0)])
    bwd = E(name="aten::convolution_backward",
            cpu_parent=E(name="autograd::engine::evaluate_function: Conv",
                         cpu_parent=None), kernels=[E(duration=50.0)])
    other = E(name="aten::add_", cpu_parent=top, kernels=[E(duration=4.0)])
    assert ps.source_of(op) == "kwng/solve.py:12 safeguard"
    assert ps.source_of(bwd) == "backward pass (autograd)"
    assert ps.source_of(other).startswith("outside kwng/, studies/: /x/site/torch")
    prof = E(events=lambda: [top, ours, inner, op, bwd, other])
    assert ps.source_times(prof, steps=2) == {
        "kwng/solve.py:12 safeguard": 20.0, "backward pass (autograd)": 25.0,
        ps.source_of(other): 2.0}
