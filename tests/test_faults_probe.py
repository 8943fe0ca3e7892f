"""Fault cases: the smaller items, and a probe table in which each
public function and command-line option gets a wrong type, an empty input, NaN or a
missing path, and must answer with an error that names the argument (or file) and the
cause, before any work is done."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import kwng
from kwng.engine.lm import LevenbergMarquardt
from studies.cifar import data as kdata
from studies.cifar import images as kimages
from studies.toy import setup as synthetic_setup

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers of the table
def _lm_state(**change) -> dict:
    return {**LevenbergMarquardt(1e-3).state_dict(), **change}


def _npz(tmp: Path, **change) -> Path:
    """The committed sample with some arrays changed, written to ``tmp``."""
    z = dict(np.load(kdata.SAMPLE_PATH))
    z.update(change)
    path = tmp / "changed.npz"
    np.savez(path, **z)
    return path


def _truncated(tmp: Path) -> Path:
    path = tmp / "cut.npz"
    raw = kdata.SAMPLE_PATH.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


def _estimate(X, grad=None, **kw):
    grad = torch.ones(3, dtype=torch.float64) if grad is None else grad
    args = dict(num_basis=2, eps=1e-3, kernel=kwng.GaussianKernel(1.0))
    args.update(kw)
    return kwng.kwng_gradient(lambda t: X, torch.zeros(3, dtype=torch.float64), grad,
                              **args)


def _offsets_shifted(tmp: Path) -> Path:
    z = np.load(kdata.SAMPLE_PATH)
    return _npz(tmp, train_offsets=z["train_offsets"][:-2])


#: (case, call(tmp_path), exception, pattern the message must match)
FUNCTIONS = [
    ("kernel bandwidth: a tensor of two values",
     lambda t: kwng.GaussianKernel(torch.tensor([1.0, 2.0])), ValueError,
     r"bandwidth must be a real number \(a scalar\), got a tensor of shape \(2,\)"),
    ("kernel bandwidth: NaN", lambda t: kwng.GaussianKernel(float("nan")), ValueError,
     r"bandwidth must be a finite number in \(0, inf\), got nan"),
    ("kernel bandwidth: a string", lambda t: kwng.GaussianKernel("abc"), ValueError,
     "bandwidth must be a real number, got str"),
    ("LM load_state_dict(None)",
     lambda t: LevenbergMarquardt(1e-3).load_state_dict(None), ValueError,
     "state must be a dict.*got NoneType"),
    ("LM has_prev='no'",
     lambda t: LevenbergMarquardt(1e-3).load_state_dict(_lm_state(has_prev="no")),
     ValueError, r"state\['has_prev'\] must be True or False, got 'no'"),
    ("LM negative counter",
     lambda t: LevenbergMarquardt(1e-3).load_state_dict(_lm_state(ups=-1)),
     ValueError, r"state\['ups'\] must be an integer in \[0, inf\], got -1"),
    ("LM ratio 'abc'",
     lambda t: LevenbergMarquardt(1e-3).load_state_dict(_lm_state(ratio="abc")),
     ValueError, r"state\['ratio'\] must be a real number, got str"),
    ("npz: missing path",
     lambda t: kimages.load_jpeg_npz(t / "nowhere.npz", "train"), FileNotFoundError,
     "nowhere.npz does not exist"),
    ("npz: truncated", lambda t: kimages.load_jpeg_npz(_truncated(t), "train"),
     ValueError, "cut.npz: not a readable CIFAR JPEG npz, truncated or damaged"),
    ("npz: a label outside [0, 9]",
     lambda t: kimages.load_jpeg_npz(_npz(t, y_train=np.full(500, 10)), "train"),
     ValueError, r"changed.npz \(y_train\): 500 label\(s\) outside \[0, 9\]"),
    ("npz: negative label (sample loader)",
     lambda t: kdata.load_sample("train", _npz(t, y_train=-np.ones(500, int))),
     ValueError, r"label\(s\) outside \[0, 9\]"),
    ("npz: offsets that do not match the labels",
     lambda t: kimages.load_jpeg_npz(_offsets_shifted(t), "train"), ValueError,
     "train_offsets must be 501 increasing byte offsets"),
    ("official archive: a label outside [0, 9]",
     lambda t: kdata.read_official_cifar(kdata.write_official_cifar(
         t, "cifar10", np.zeros((5, 32, 32, 3), np.uint8), np.array([0, 1, 2, 3, 12]),
         np.zeros((2, 32, 32, 3), np.uint8), np.array([0, 1])), "cifar10", "train"),
     ValueError, r"data_batch_\d: 1 label\(s\) outside \[0, 9\] \(first: 12"),
    ("estimator: no samples", lambda t: _estimate(torch.zeros(0, 2)), ValueError,
     "X must hold at least 2 samples"),
    ("estimator: NaN sample",
     lambda t: _estimate(torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]])),
     ValueError, "X .* must contain only finite values: found 1 NaN"),
    ("estimator: num_basis a string",
     lambda t: _estimate(torch.randn(5, 2), num_basis="2"), ValueError,
     "num_basis must be an integer, got str"),
    ("estimator: grad a list",
     lambda t: _estimate(torch.randn(5, 2), grad=[1.0, 2.0, 3.0]), ValueError,
     "grad must be a 1-d torch.Tensor.*got list"),
]


@pytest.mark.parametrize("case, call, exc, pattern", FUNCTIONS,
                         ids=[c[0] for c in FUNCTIONS])
def test_function_errors_name_argument_and_cause(tmp_path, case, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(tmp_path)


_SMALL = ["--source", "sample", "--model", "tiny", "--epochs", "1", "--method", "sgd",
          "--no-progress"]

#: (case, module, argv, pattern of the error on stderr); every one exits with status 2
#: before any computation
COMMANDS = [
    ("cifar --lr abc", "cifar", [*_SMALL, "--lr", "abc"],
     "argument --lr: must be a finite number > 0 or 'selected', got 'abc'"),
    ("cifar --lr nan", "cifar", [*_SMALL, "--lr", "nan"],
     "argument --lr: must be a finite number > 0 or 'selected', got 'nan'"),
    ("cifar --device xyz", "cifar", [*_SMALL, "--lr", "0.1", "--device", "xyz"],
     "--device must be a torch device such as cpu or cuda:0, got 'xyz'"),
    ("cifar --out ''", "cifar", [*_SMALL, "--lr", "0.1", "--out", ""],
     "--out is an empty path"),
    ("cifar --data-root ''", "cifar", [*_SMALL, "--lr", "0.1", "--data-root", " "],
     "--data-root is an empty path"),
    ("bench --num-basis abc", "bench", ["--num-basis", "abc"],
     "--num-basis must be a comma list of integers, got 'abc'"),
    ("bench *_graph rows on a CPU", "bench",
     ["--device", "cpu", "--rows", "sgd,sgd_graph"],
     "--rows sgd_graph need a CUDA device, got --device cpu"),
    ("bench --steps 0", "bench", ["--steps", "0"], "--steps must be an integer >= 1"),
    ("bench --device xyz", "bench", ["--device", "xyz"],
     "--device must be a torch device"),
    ("bench --rows ''", "bench", ["--device", "cpu", "--rows", ","],
     "--rows must be a comma list of"),
    ("relerr --device xyz", "relerr", ["relerr", "--device", "xyz"],
     "--device must be a torch device"),
    ("relerr --out ''", "relerr", ["relerr", "--out", ""], "--out is an empty path"),
    ("fisher --out ''", "fisher", ["fisher", "--out", ""], "--out is an empty path"),
]
if not torch.cuda.is_available():
    COMMANDS += [
        ("cifar --device cuda without CUDA", "cifar",
         [*_SMALL, "--lr", "0.1", "--device", "cuda"],
         "--device cuda: CUDA is not available here"),
        ("bench --device cuda without CUDA", "bench", ["--device", "cuda"],
         "--device cuda: CUDA is not available"),
    ]


def _main(module: str):
    from studies.bench import step_cost as bench
    from studies.cifar import cli as cifar
    from studies.fisher import cli as fisher
    from studies.synthetic import sweep as synthetic

    return {"cifar": cifar.main, "bench": bench.main, "relerr": synthetic.main,
            "fisher": fisher.main}[module]


@pytest.mark.parametrize("case, module, argv, pattern", COMMANDS,
                         ids=[c[0] for c in COMMANDS])
def test_command_errors_name_option_and_cause(tmp_path, capsys, monkeypatch, case,
                                              module, argv, pattern):
    monkeypatch.chdir(tmp_path)  # anything written would land here
    out = tmp_path / "bench.json"
    argv = [*argv, "--out", str(out)] if module == "bench" and "--out" not in argv \
        else argv
    with pytest.raises(SystemExit) as exc:
        _main(module)(argv)
    assert exc.value.code == 2
    assert pattern in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


# --------------------------------------------------------------- the smaller items
def test_a_second_fast_preconditioner_on_one_model_is_refused():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    first = kwng.KWNGPreconditioner(model, num_basis=4, eps=1e-3, eps_schedule=None)
    with pytest.raises(ValueError, match="already carries a KWNG preconditioner"):
        kwng.KWNGPreconditioner(model, num_basis=4, eps=1e-3, eps_schedule=None)
    first.remove_hooks()  # the documented way out
    second = kwng.KWNGPreconditioner(model, num_basis=4, eps=1e-3, eps_schedule=None)
    assert second._engine is not None  # fast mode, not serial passes


def test_data_root_at_small_scale_says_which_model_trains(tmp_path, caplog,
                                                          monkeypatch):
    import shutil

    from studies.cifar import cli as cifar

    monkeypatch.setenv("KWNG_SCALE", "small")
    root = tmp_path / "cifar10_jpeg.npz"  # a copy: its decode cache goes beside it
    shutil.copy(kdata.SAMPLE_PATH, root)
    argv = ["--data-root", str(root), "--lr", "0.1", "--epochs", "1",
            "--train-subset", "50", "--device", "cpu", "--method", "sgd",
            "--out", str(tmp_path / "res"), "--checkpoint-dir", str(tmp_path / "ck"),
            "--no-progress", "--stop-after-epoch", "1", "--max-steps", "1"]
    with caplog.at_level(logging.WARNING):
        cifar.main(argv)
    assert "KWNG_SCALE=small: --data-root trains the small model 'tiny'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cifar.main([*argv, "--model", "tiny"])  # asked for explicitly: no warning
    assert "--data-root trains the small model" not in caplog.text


def test_provenance_command_can_be_typed_again(monkeypatch):
    from studies.kit import provenance

    spec = types.SimpleNamespace(name="studies.__main__")
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=spec))
    monkeypatch.setattr(sys, "argv", ["/somewhere/kwng/experiments/__main__.py",
                                      "relerr", "--out", "my results"])
    cmd = provenance.make_provenance({})["command"]
    assert cmd.split(" ", 1)[1] == "-m studies relerr --out 'my results'"


def _interrupt_then_resume(monkeypatch, module, name: str, kill_at: int, run,
                           provenance) -> None:
    """Kill ``run()`` by a KeyboardInterrupt at call ``kill_at`` of ``module.name``,
    resume it, and check that the provenance counts the time of both parts."""
    import json

    real, calls = getattr(module, name), {"n": 0}

    def killed(*args, **kw):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt  # as a kill between two points
        return real(*args, **kw)

    monkeypatch.setattr(module, name, killed)
    with pytest.raises(KeyboardInterrupt):
        run()
    cut = json.loads(provenance.read_text())
    assert cut["in_progress"] and cut["wall_time_total_s"] > 0
    monkeypatch.setattr(module, name, real)
    done = run()
    assert "in_progress" not in done
    assert done["wall_time_total_s"] == pytest.approx(
        cut["wall_time_total_s"] + done["wall_time_s"])


def test_interrupted_sweep_time_is_counted(tmp_path, monkeypatch):
    from studies.synthetic import sweep as syn

    cfg = synthetic_setup.relerr_config("small")
    cfg.update(models=["sphere"], dims=[1, 2], N_values=[60], N_fixed=60,
               M_values=[5], runs=2)
    _interrupt_then_resume(monkeypatch, syn, "_compute_point", 3,
                           lambda: syn.run_sweep(cfg, tmp_path, progress=False),
                           tmp_path / "provenance.json")


def test_interrupted_fisher_sweep_time_is_counted(tmp_path, monkeypatch):
    from studies.fisher import cli as E
    from studies.fisher import sweep as FS

    cfg = E.sweep_config("small")
    cfg.update(models=["normal"], dims=[2], N_values=[100, 200], M_values=[10],
               N_fixed=200, runs=2)
    _interrupt_then_resume(monkeypatch, FS, "compare_once", 5,
                           lambda: FS.run_sweep(cfg, tmp_path, progress=False),
                           tmp_path / "fisher-sweep.provenance.json")
