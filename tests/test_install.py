"""What an install hands a user: the pins of ``requirements.txt`` (the CPU build of
torch from the PyTorch CPU index, its triton), the version the package reports, the
licence and the typing marker shipped as package data."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import kwng

ROOT = Path(__file__).resolve().parents[1]


def _lines(name: str) -> list[str]:
    text = (ROOT / name).read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]


def test_requirements_name_the_cpu_index_and_pin_the_cpu_torch_with_its_triton():
    lines = _lines("requirements.txt")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    torch_pins = [ln for ln in lines if ln.startswith("torch==")]
    assert torch_pins == ['torch==2.13.0+cpu; sys_platform != "darwin"',
                          'torch==2.13.0; sys_platform == "darwin"']
    # the triton that torch 2.13.0 is built against (its CUDA wheel requires 3.7.1)
    assert [ln.split(";")[0] for ln in lines if ln.startswith("triton")] == [
        "triton==3.7.1"]


def test_the_package_reports_its_version():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        flags=re.M).group(1)
    try:
        installed = importlib.metadata.version("kwng")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kwng is not installed (a bare source tree reports 0+unknown)")
    assert kwng.__version__ == installed == version


def test_license_and_typing_marker_ship_with_the_package():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "the kwng developers" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "kwng" / "py.typed").exists()
    assert '"kwng" = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
