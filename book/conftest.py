"""Run every jupytext MyST chapter of the book as an nbval test.

nbval collects ``.ipynb`` files only; here each ``book/*.md`` chapter with a jupytext header is
read with ``jupytext`` and handed to nbval's collector, so the kernel runs in ``book/`` exactly
as in ``jupyter-book build``. Chapters store no outputs, so the checks live in ``assert``s.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbval.plugin as nbval_plugin

HERE = Path(__file__).parent


class MarkdownNotebook(nbval_plugin.IPyNbFile):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compare_outputs = False  # .md chapters carry no stored outputs

    def collect(self):
        original = nbval_plugin.nbformat.read
        nbval_plugin.nbformat.read = lambda path, as_version=4: jupytext.read(path)
        try:
            items = list(super().collect())
        finally:
            nbval_plugin.nbformat.read = original
        yield from items


def _is_chapter(path: Path) -> bool:
    if path.suffix != ".md" or path.parent != HERE:
        return False
    head = path.read_text(encoding="utf-8")[:400]
    return "jupytext" in head and "kernelspec" in head


def pytest_collect_file(file_path, parent):
    if _is_chapter(Path(file_path)):
        return MarkdownNotebook.from_parent(parent, path=file_path)
    return None
