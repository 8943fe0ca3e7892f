"""The configuration of a CIFAR run (:mod:`studies.cifar.config`): validated
once when built (a variant too), built from a dict that names only known settings,
stored as the records store it, and the single-run options generated from its fields;
a sweep's help lists no option of its workers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from studies.cifar import cli
from studies.cifar.config import SETTINGS, RunConfig


def test_built_once_validated_and_frozen():
    cfg = RunConfig(method="sgd", lr="0.5", model="tiny")
    assert cfg.lr == 0.5 and cfg.batch == 128 and cfg.world_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(ValueError, match="epochs must be an integer >= 1, got 0"):
        dataclasses.replace(cfg, epochs=0)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        dataclasses.replace(cfg, world_size=0)
    with pytest.raises(ValueError, match="method must be one of"):
        RunConfig(method="nope")
    with pytest.raises(ValueError, match="eval_test=True needs val_size > 0"):
        RunConfig(eval_test=True)


def test_from_dict_and_to_dict():
    with pytest.raises(ValueError, match=r"unknown run settings \['colour'\]"):
        RunConfig.from_dict({"colour": "red"})
    cfg = RunConfig.from_dict({"method": "sgd", "lr": 0.1})
    stored = cfg.to_dict()
    assert "world_size" not in stored and set(stored) == set(SETTINGS) - {"world_size"}
    assert RunConfig.from_dict(stored) == cfg
    wide = dataclasses.replace(cfg, world_size=2)
    assert wide.to_dict()["world_size"] == 2 and RunConfig.of(wide.to_dict()) == wide


def test_options_come_from_the_fields(capsys):
    parsed = cli._run_parser().parse_args(["--method", "adam", "--val-size", "5"])
    assert (parsed.method, parsed.val_size, parsed.eval_test) == ("adam", 5, False)
    for hidden in ("eval_batch_size", "deadline", "protocol", "world_size"):
        assert not hasattr(parsed, hidden)
    with pytest.raises(SystemExit):
        cli.main(["cifar", "sweep", "--help"])
    out = capsys.readouterr().out
    for worker_only in ("--session", "--offset", "--deadline ", "--start-by ",
                        "--finish-by "):
        assert worker_only not in out


def test_a_sweep_takes_only_the_seeds_asked(tmp_path, monkeypatch):
    from studies.cifar import sweep as cifar_sweep
    runs = [RunConfig(method="sgd", model="tiny", seed=s).to_dict() for s in (0, 1, 2)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(runs))
    seen = []
    monkeypatch.setattr(cifar_sweep, "sweep",
                        lambda jobs, *a, **k: seen.extend(j["seed"] for j in jobs) or 0)
    assert cli.main(["cifar", "sweep", "--plan", str(plan), "--seeds", "2,0"]) == 0
    assert seen == [0, 2]  # the plan's order, without seed 1
    with pytest.raises(SystemExit):
        cli.main(["cifar", "sweep", "--plan", str(plan), "--seeds", "1,x"])
