"""Configuration errors are one line: an unknown subcommand or a bad option value exits
with status 2 and a message that names the option and the cause, with no traceback and
nothing written; the two-rank ``cifar ddp`` prints at most one line per rank. And the
README's ``cifar select`` runs on a fresh checkout of the committed selection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studies.__main__ import main as experiments_main
from studies.bench.distributed_check import launch
from studies.cifar.cli import ddp_main
from studies.cifar.methods import METHODS
from studies.cifar.results import select_lrs

ROOT = Path(__file__).resolve().parent.parent
SELECTION = ROOT / "results" / "cifar" / "claim" / "selection"

#: (argv of ``python -m studies``, the words stderr must hold)
CASES = [
    (["cifar", "run"], "error: unknown cifar subcommand 'run'; use sweep, worker"),
    (["cifar", "--epochs", "0"], "argument --epochs: must be an integer >= 1, got '0'"),
    (["cifar", "--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["cifar", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["cifar", "--train-subset", "0"], "argument --train-subset: must be an integer"),
    (["cifar", "sweep", "--plan", "bogus"],
     "argument --plan: must be one of amortized, amortized_seeds, authors100"),
    (["cifar", "sweep", "--plan", "bogus"],
     "or a JSON file of run settings, got 'bogus'"),
    (["cifar", "sweep", "--plan", "claim", "--gpus", "-1"],
     "argument --gpus: must be an integer >= 0, got '-1'"),
    (["cifar", "sweep", "--plan", "claim", "--procs-per-gpu", "0"],
     "argument --procs-per-gpu: must be an integer >= 1"),
    (["cifar", "sweep", "--plan", "claim", "--epochs", "x"],
     "argument --epochs: must be an integer >= 1 or 'auto', got 'x'"),
    (["cifar", "sweep", "--plan", "claim", "--seeds", "1,-2"],
     "argument --seeds: must be a comma list of integers >= 0, got '1,-2'"),
    (["cifar", "sweep", "--plan", "claim", "--set", "nope=1"],
     "--set takes KEY=VALUE with KEY one of"),
    (["cifar", "trainer-timing", "--precisions", "fp16"],
     "argument --precisions: must be a comma list of fp32, bf16; got 'fp16'"),
    (["cifar", "trainer-timing", "--methods", "sgd,nope"],
     "argument --methods: must be a comma list of sgd"),
    (["cifar", "timing", "--methods", "nope"], "argument --methods: must be a comma "),
    (["cifar", "timing", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["cifar", "trainer-timing", "--device", "xyz"],
     "--device must be a torch device such as cpu or cuda:0, got 'xyz'"),
    (["cifar", "timing", "--device", "xyz"], "--device must be a torch device"),
    (["cifar", "schedule", "--budget-s", "-5"],
     "argument --budget-s: must be a finite number > 0, got '-5'"),
    (["flow", "--mem-gb", "-5"], "argument --mem-gb: must be a finite number > 0"),
    (["flow", "--mem-gb", "8"], "--mem-gb and --model are options of the relerr and "
     "bandwidth sweeps; flow does not use them"),
    (["relerr", "--mem-gb", "0"], "argument --mem-gb: must be a finite number > 0"),
    (["fisher", "--threads", "0"], "argument --threads: must be an integer >= 1"),
]


def _exit_code(call) -> int:
    try:
        return call()
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_config_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)  # anything written would land here
    assert _exit_code(lambda: experiments_main(argv)) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_ddp_timeout_is_checked_before_the_process_group(tmp_path, capsys,
                                                         monkeypatch, timeout):
    monkeypatch.chdir(tmp_path)
    assert _exit_code(lambda: ddp_main(["--device", "cpu", "--timeout", timeout])) == 2
    err = capsys.readouterr().err
    assert f"argument --timeout: must be a finite number > 0, got '{timeout}'" in err
    assert list(tmp_path.iterdir()) == []


def test_ddp_without_data_says_so_in_one_line_per_rank(tmp_path):
    argv = ["-m", "studies", "cifar", "ddp", "--device", "cpu", "--model",
            "tiny", "--data-root", str(tmp_path / "none"), "--out",
            str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck"),
            "--no-progress", "--timeout", "30"]
    with pytest.raises(RuntimeError, match="exited with status 2"):
        launch(argv, 2, timeout=90, logdir=tmp_path)
    for r in range(2):
        text = (tmp_path / f"rank{r}.log").read_text()
        assert "Traceback" not in text and len(text.strip().splitlines()) <= 1, text
    assert "rank 0: error: data_root" in (tmp_path / "rank0.log").read_text()


# ------------------------------------------------- cifar select on the committed runs
def test_select_on_the_committed_selection_changes_nothing(tmp_path):
    root = tmp_path / "selection"
    shutil.copytree(SELECTION, root)
    before = (root / "selected.json").read_bytes()
    select_lrs(root)
    assert (root / "selected.json").read_bytes() == before, (
        "the committed selection lags the method table (a method with lr_from was "
        "added): run `python -m studies cifar select` and commit the file")


def test_select_adds_a_new_method_inheritance_and_refuses_a_changed_one(tmp_path):
    from studies.kit.guard import ConfigMismatchError

    root = tmp_path / "selection"
    shutil.copytree(SELECTION, root)
    path = root / "selected.json"
    old = json.loads(path.read_text())
    current = dict(old["inherit"])
    del old["inherit"]["kwng_basis20"]  # a selection written before the method
    path.write_text(json.dumps(old))
    assert select_lrs(root)["inherit"] == current
    assert json.loads(path.read_text())["inherit"] == current
    # another inheritance of a live method: refused
    old["inherit"] = {**current, "kwng_lm_same_batch": "adam"}
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigMismatchError, match="inherit.kwng_lm_same_batch"):
        select_lrs(root)
    # the entries of methods that have left the table stay as recorded
    assert {"kwng_m20", "diag_T"} <= set(current)
    assert not {"kwng_m20", "diag_T"} & set(METHODS)
