"""``make notebooks``: every chapter converts to a valid notebook with the cells that
the book (and nbval, through ``book/conftest.py``) executes, and a converted notebook
runs.

The full execution of every chapter is the nbval run of ``make test``; here one short
chapter is executed from the converted ``.ipynb`` file itself, in a kernel started in
``book/`` as ``make lab`` and the book build do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(
    p for p in BOOK.glob("*.md") if "kernelspec" in p.read_text(encoding="utf-8")[:400]
)


def _convert(md: Path, out: Path) -> Path:
    target = out / (md.stem + ".ipynb")
    cmd = [sys.executable, "-m", "jupytext", "--quiet", "--to", "ipynb", "-o",
           str(target), str(md)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return target


def test_there_are_chapters():
    assert len(CHAPTERS) >= 9, CHAPTERS


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_converts_to_the_notebook_the_book_runs(md, tmp_path):
    nb = nbformat.read(_convert(md, tmp_path), as_version=4)
    nbformat.validate(nb)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    expected = [c.source for c in jupytext.read(md).cells if c.cell_type == "code"]
    assert code == expected and len(code) > 0
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_converted_notebook_executes(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(_convert(BOOK / "intro.md", tmp_path), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(BOOK)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs, "the intro chapter prints its checks"
    assert not [o for o in outputs if o.output_type == "error"]
