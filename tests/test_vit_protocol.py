"""The ViT study's protocol (``studies.vit.protocol``): built from the Fig. 3 protocol
and its selections, written once, read by the Fig. 3 code; its plan; AdamW and the
``half`` schedule it uses; and, once committed, it precedes every record."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import torch

from studies.cifar import train
from studies.cifar.methods import METHODS, OPTIMIZERS, milestones_for
from studies.fig3 import protocol as fig3
from studies.vit import protocol as vp

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
P3 = fig3.load_protocol(FIG3 / "protocol.json")


@pytest.fixture(scope="module")
def spec():
    return vp.protocol_spec(P3, FIG3)


def test_the_protocol_is_fig3s_on_the_vit_at_50_epochs(spec):
    assert spec["settings"] == {**P3["settings"], "model": "vit", "epochs": 50,
                                "schedule": "half"}
    for k in ("grid", "early_stop", "early_stop_rule", "seeds", "verdict_rule",
              "selection_rule", "extension_rule", "split", "dataset"):
        assert spec[k] == P3[k], k
    assert spec["methods"] == {"both": list(vp.METHODS_VIT)}
    assert not spec["ablations"]["runs"]


def test_each_window_is_centred_on_the_resnets_selected_step(spec):
    state = fig3.grid_state(P3, FIG3)
    for cond in ("ill", "well"):
        for m in vp.METHODS_VIT:
            src = vp.WINDOW_OF.get(m, m)
            sel = state[f"{cond}/{src}"]["selected"]
            win = spec["windows"][f"{cond}/{m}"]
            assert len(win) == 3 and sel in win and win == sorted(win, reverse=True)
            assert spec["window_sources"][f"{cond}/{m}"]["resnet18_selected"] == sel
            # centred unless the selection is an end of the paper's grid
            assert win[1] == sel or sel in (max(P3["grid"]), min(P3["grid"]))


def test_the_fig3_code_reads_the_written_protocol_and_plans_its_grid(tmp_path,
                                                                      monkeypatch):
    out = tmp_path / "vit" / "protocol.json"
    assert vp.main(["--out", str(out)]) == 0
    assert vp.main(["--out", str(out)]) == 1  # never overwritten
    p = vp.load_vit_protocol(out)
    monkeypatch.setenv("KWNG_PROTOCOL_COMMIT", "c0ffee")
    jobs = vp.vit_plan({"data_root": "DATA"}, root=tmp_path / "vit", path=out)
    assert len(jobs) == sum(len(w) for w in p["windows"].values()) == 36
    for j in jobs:
        assert (j["model"], j["epochs"], j["schedule"]) == ("vit", 50, "half")
        assert j["protocol"] == "c0ffee" and j["early_stop"] == "fig3"
        assert Path(j["out"]).parent == tmp_path / "vit" / "grid"
    with pytest.raises(ValueError, match="not the ViT protocol"):
        vp.load_vit_protocol(FIG3 / "protocol.json")


def test_half_schedule_and_adamw_decouple_the_weight_decay():
    assert milestones_for(50, "half") == [25] and milestones_for(2, "half") == [1]
    w = torch.nn.Linear(3, 1, bias=False)
    w.weight.data.fill_(2.0)
    opt = OPTIMIZERS["adamw"](w, 0.1, METHODS["adamw"].spec)
    w.weight.grad = torch.zeros_like(w.weight)
    opt.step()  # a zero gradient: only the decoupled decay moves the weights
    assert torch.allclose(w.weight, torch.full_like(w.weight, 2.0 * (1 - 0.1 * 0.05)))


@pytest.mark.parametrize("method", ["adamw", "kwng_k20"])
def test_a_vit_run_of_the_protocols_methods_trains_on_the_cpu(tmp_path, method):
    rec = train.run({"source": "sample", "model": "vit_tiny", "batch_size": 50,
                     "epochs": 2, "schedule": "half", "lr": 1e-3, "device": "cpu",
                     "method": method, "out": str(tmp_path / "res"),
                     "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 100},
                    progress=False)
    assert rec["complete"] and not rec["diverged"] and rec["milestones"] == [1]


def test_the_committed_protocol_precedes_every_record():
    """Once ``results/vit/protocol.json`` is committed: it is what
    :func:`~studies.vit.protocol.protocol_spec` builds from the Fig. 3 records, and
    every ViT record names its commit and started after it."""
    path = ROOT / vp.PROTOCOL_FILE
    if not path.is_file():
        pytest.skip("the ViT protocol is not written yet")
    assert json.loads(path.read_text()) == json.loads(json.dumps(
        vp.protocol_spec(P3, FIG3)))
    try:
        log = subprocess.run(["git", "log", "--format=%H %cI", "--",
                              str(vp.PROTOCOL_FILE)], capture_output=True, text=True,
                             check=True, cwd=ROOT).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history")
    if not log:
        pytest.skip("the protocol is not committed yet (or a shallow clone)")
    commit, date = log[0], datetime.fromisoformat(log[1])
    for prov in (ROOT / vp.VIT).glob("*/lr*/*/*/*/seed*/provenance.json"):
        rec = json.loads(prov.read_text())
        assert rec["config"]["protocol"] == commit, prov
        assert datetime.fromisoformat(rec["date"]) > date, prov


def _fake_record(path: Path, p: dict, cond: str, method: str, lr: float,
                 final_val: float) -> None:
    """A record of the protocol's settings whose validation and test accuracy climb
    to ``final_val`` over the horizon (what the selection and verdicts read)."""
    E = int(p["settings"]["epochs"])
    rows = [{"epoch": e, "steps": 352 * e, "train_loss": 1.0 / e,
             "val_acc": final_val * e / E, "test_acc": final_val * e / E,
             "time_train": 2.0 * e} for e in range(1, E + 1)]
    path.mkdir(parents=True)
    (path / "metrics.json").write_text(json.dumps({
        "config": {**p["settings"], "dataset": p["dataset"], "conditioning": cond,
                   "method": method}, "lr": lr, "complete": True, "diverged": False,
        "epochs": rows}))


def test_the_fig3_readers_select_and_judge_a_vit_record_tree(tmp_path, spec):
    """The Fig. 3 code reads the ViT protocol unchanged: with a grid whose middle step
    wins for every method, the selection is final there, the plan asks for the seeds,
    and with those seeds in, every baseline has a verdict by the Fig. 3 rule (KWNG
    made to keep its accuracy, the baselines to drop 20 points)."""
    from studies.fig3 import plan as fig3_plan
    from studies.fig3 import verdicts

    out = tmp_path / "vit" / "protocol.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(spec))
    p = vp.load_vit_protocol(out)
    root = out.parent

    def acc(cond, m):
        return 0.85 if cond == "well" or m.startswith("kwng") else 0.65

    for key, win in p["windows"].items():
        cond, m = key.split("/")
        for lr in win:
            best = lr == win[1]
            _fake_record(root / "grid" / f"lr{lr:g}" / "cifar10" / cond / m / "seed0",
                         p, cond, m, lr, acc(cond, m) if best else 0.5)
    state = fig3.grid_state(p, root)
    assert all(st["final"] and st["selected"] == p["windows"][k][1]
               for k, st in state.items())
    seeds = fig3_plan.fig3_plan({}, p, root, commit="c0ffee")
    assert len(seeds) == len(vp.METHODS_VIT) * (3 - 1 + 2 - 1)
    assert {j["out"].split("/")[-2] for j in seeds} == {"seeds"}
    for j in seeds:
        _fake_record(Path(j["out"]) / "cifar10" / j["conditioning"] / j["method"]
                     / f"seed{j['seed']}", p, j["conditioning"], j["method"], j["lr"],
                     acc(j["conditioning"], j["method"]))
    got = verdicts.fig3_verdicts(p, root)
    assert set(got) == set(vp.METHODS_VIT) - {"kwng"}
    assert got["kwng_k20"]["verdict"] == "within spread"  # keeps its accuracy as KWNG
    assert all(got[m]["verdict"] == "holds" for m in got if m != "kwng_k20")
