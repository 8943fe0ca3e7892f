"""The READMEs keep their places: the root ``README.md`` is for a user (short, no commit
hashes, no rounds, no machines), each study folder has its own ``README.md`` with its
commands, and every command and module those READMEs name exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import studies
from studies.cifar import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: the study folders and kits that carry a README (``kit/`` and ``toy/`` are described
#: in ``studies/README.md``)
FOLDERS = ("cifar", "synthetic", "fisher", "fig3", "fig3/amortized", "authors100",
           "claim_suite", "study6", "bench", "vit", "claims")
STUDY_READMES = {f"studies/{f}/README.md": (ROOT / "studies" / f / "README.md")
                 for f in FOLDERS}
ALL = "\n".join([README, (ROOT / "studies" / "README.md").read_text(),
                 *(p.read_text() for p in STUDY_READMES.values() if p.exists())])


def test_the_root_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_the_root_readme_is_no_logbook():
    """No commit hash, no round of a queue, no machine or device seconds: they live in
    the study READMEs and the records."""
    assert re.findall(r"\b[0-9a-f]{7,40}\b", README) == []
    assert re.findall(r"\brounds?\b(?!-)", README, re.I) == []
    assert re.findall(r"\b[HAV]100\b|\bH200\b|device seconds", README) == []


@pytest.mark.parametrize("path", sorted(STUDY_READMES))
def test_every_study_folder_has_a_readme_the_root_or_index_names(path):
    assert STUDY_READMES[path].is_file(), path
    index = (ROOT / "studies" / "README.md").read_text()
    folder = path.removeprefix("studies/").removesuffix("/README.md")
    assert path in README or path in index or f"`{folder}/`" in index, path


def test_every_experiment_and_cifar_command_is_documented():
    for name in studies.EXPERIMENTS:
        assert f"python -m studies {name}" in ALL, name
    for command in set(cli.COMMANDS) - {"worker"}:  # the sweep's own workers
        assert f"studies cifar {command}" in ALL, command


def test_every_module_a_readme_runs_exists():
    """(``kwng.bench`` in the step-cost recheck is the baseline commit's module.)"""
    modules = set(re.findall(r"python3? -m (studies(?:\.\w+)+)", ALL))
    assert modules
    for name in sorted(modules):
        assert importlib.util.find_spec(name) is not None, name


def test_every_path_a_readme_names_exists():
    """The files and folders the READMEs cite by path (code, scripts, results)."""
    top = r"(?:kwng|studies|scripts|tests|tools|examples)"
    paths = set(re.findall(rf"`({top}/[\w./-]+)`", ALL))
    paths |= set(re.findall(r"`(results/[\w./-]+?)/?`", ALL))
    missing = [p for p in sorted(paths) if "<" not in p and not (ROOT / p).exists()]
    assert missing == []
