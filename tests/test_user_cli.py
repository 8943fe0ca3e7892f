"""The experiment commands as a new user meets them: ``--help``, a method without a
selected step size, conflicting data flags and the JPEG decode cache."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from studies import EXPERIMENTS
from studies.__main__ import main as experiments_main
from studies.cifar import data as kdata
from studies.cifar import images as kimages
from studies.cifar.cli import COMMANDS, PURPOSES
from studies.cifar.cli import main as cifar_main
from studies.cifar.config import RunConfig
from studies.cifar.runtime import resolve_lr, split_data


def test_help_says_what_each_experiment_is_for(capsys):
    assert experiments_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in EXPERIMENTS:
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line
    assert set(PURPOSES) == set(COMMANDS)
    with pytest.raises(SystemExit):
        cifar_main(["select", "--help"])
    assert PURPOSES["select"] in capsys.readouterr().out


def test_a_method_without_a_selected_step_size_is_a_one_line_refusal(tmp_path):
    """``cifar --method kwng_k5`` without ``--lr``: a refusal naming the missing entry
    and the way out, not a KeyError traceback."""
    sel = tmp_path / "selected.json"
    sel.write_text('{"selected": {"cifar10/ill/kwng": {"lr": 1.0}}}')
    cfg = RunConfig.small(method="kwng_k5", selection_file=str(sel))
    with pytest.raises(ValueError, match=r"no step size for cifar10/ill/kwng_k5.*--lr"):
        resolve_lr(cfg)
    assert cifar_main(["--method", "kwng_k5", "--selection-file", str(sel),
                       "--out", str(tmp_path / "o"),
                       "--checkpoint-dir", str(tmp_path / "c")]) == 2


def test_the_sample_source_with_a_data_root_is_refused(tmp_path):
    """``--source sample --data-root X`` would log X and train on the sample."""
    with pytest.raises(ValueError, match="source='sample'.*data_root"):
        RunConfig.small(source="sample", data_root=str(tmp_path))
    with pytest.raises(SystemExit):
        cifar_main(["--source", "sample", "--data-root", str(tmp_path),
                    "--lr", "0.1", "--out", str(tmp_path / "o")])


def _npz(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    npz = folder / "cifar10_jpeg.npz"
    shutil.copy(kdata.SAMPLE_PATH, npz)
    return folder, npz


def test_the_decode_cache_lives_in_the_user_cache_folder(tmp_path, monkeypatch):
    """Never beside the data: in ``$KWNG_CACHE`` (default ``~/.cache/kwng``)."""
    folder, npz = _npz(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KWNG_CACHE", str(cache))
    x, y = kimages.load_jpeg_npz(npz, "test")
    assert sorted(p.name for p in folder.iterdir()) == ["cifar10_jpeg.npz"]
    assert (cache / "cifar10_jpeg_test_x.npy").is_file()
    x2, _ = kimages.load_jpeg_npz(npz, "test")
    np.testing.assert_array_equal(x, x2)
    monkeypatch.delenv("KWNG_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    kimages.load_jpeg_npz(npz, "test")
    assert (tmp_path / "home" / ".cache" / "kwng" / "cifar10_jpeg_test_x.npy").is_file()


def test_a_subset_decodes_only_its_images(tmp_path, monkeypatch, caplog):
    """``--train-subset 32`` of a JPEG npz decodes 32 images (not the whole split) and
    trains on the same images as a subset of the fully decoded set."""
    folder, npz = _npz(tmp_path)
    monkeypatch.setenv("KWNG_CACHE", str(tmp_path / "cache"))
    decoded = []
    real = kimages._decode_jpegs

    def counting(buf, offsets, path="npz", rows=None):
        out = real(buf, offsets, path, rows)
        decoded.append(len(out))
        return out

    monkeypatch.setattr(kimages, "_decode_jpegs", counting)
    cfg = RunConfig.small(source="jpeg", data_root=str(npz), train_subset=32)
    x, y, xt, yt = split_data(cfg)
    assert decoded == [32, 200]  # the subset, then the test split
    assert not (tmp_path / "cache" / "cifar10_jpeg_train_x.npy").exists()
    full = np.random.default_rng(12345).permutation(500)[:32]
    xa, ya = kdata.load_sample("train")
    np.testing.assert_array_equal(x, xa[np.sort(full)])
    np.testing.assert_array_equal(y, ya[np.sort(full)])
    # a held-out split with a subset: the same rows as slicing the decoded set
    cfg = RunConfig.small(source="jpeg", data_root=str(npz), train_subset=20,
                          val_size=50)
    with caplog.at_level(logging.INFO):
        xs, ys, xv, yv = split_data(cfg)
    perm = np.random.default_rng(12345).permutation(500)
    np.testing.assert_array_equal(xs, xa[perm[50:70]])
    np.testing.assert_array_equal(yv, ya[perm[:50]])
    assert "decoding 70 of 500" in caplog.text
