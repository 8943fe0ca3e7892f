"""Chapter code cells stay short (style item 12): at most :data:`MAX_CELL_LINES` lines
of source per code cell of every ``book/*.md``, its ``---``/``:tags:`` metadata block
not counted.

The cells not shortened yet are named in :data:`TOO_LONG`, by chapter and first line, so
the list can only shrink: a new long cell fails, and so does an entry whose cell is now
short enough (or gone), which must then leave the list.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
MAX_CELL_LINES = 15

#: (chapter, first line of the cell) of every code cell still longer than the limit;
#: a pair listed twice names two cells that start alike
TOO_LONG: list[tuple[str, str]] = []

CHAPTERS = sorted(BOOK.glob("*.md"))


def _code_cells(path: Path) -> list[str]:
    nb = jupytext.read(path)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _long_cells(path: Path) -> list[tuple[str, str, int]]:
    """``(chapter, first line, lines)`` of every code cell of ``path`` over the
    limit."""
    out = []
    for src in _code_cells(path):
        lines = src.splitlines()
        if len(lines) > MAX_CELL_LINES:
            out.append((path.name, lines[0], len(lines)))
    return out


def test_the_lines_are_counted_without_the_metadata(tmp_path):
    body = "\n".join(f"x{i} = {i}" for i in range(MAX_CELL_LINES + 1))
    md = tmp_path / "a.md"
    md.write_text(
        "# A\n\n```{code-cell} ipython3\n---\ntags: [hide-input]\n---\n" + body
        + "\n```\n\n```{code-cell} ipython3\n:tags: [remove-input]\n"
        + "\n".join(body.splitlines()[:MAX_CELL_LINES]) + "\n```\n"
    )
    assert _long_cells(md) == [("a.md", "x0 = 0", MAX_CELL_LINES + 1)]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_code_cell_is_short_or_listed(chapter):
    allowed = Counter((c, first) for c, first in TOO_LONG if c == chapter.name)
    found = Counter((c, first) for c, first, _ in _long_cells(chapter))
    new = found - allowed
    assert not new, (
        f"code cells longer than {MAX_CELL_LINES} lines in {chapter.name} "
        f"(shorten them: split, or move the recipe into kwng): "
        f"{[(first, n) for c, first, n in _long_cells(chapter) if (c, first) in new]}"
    )


def test_the_list_names_only_cells_still_too_long():
    listed = Counter(TOO_LONG)
    found = Counter((c, first) for p in CHAPTERS for c, first, _ in _long_cells(p))
    stale = listed - found
    assert not stale, (
        f"TOO_LONG names cells that are short now or gone; remove them: "
        f"{sorted(stale.elements())}"
    )


#: the widest code line, in characters, that fits the book's code column at 1280 px
#: (tools/check_book.py measures the pixels; this catches it before a build)
MAX_CODE_COLUMNS = 81


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_shown_code_line_fits_the_page(chapter):
    """Code a reader can open (every cell but ``remove-input`` ones) stays within
    :data:`MAX_CODE_COLUMNS` characters a line."""
    nb = jupytext.read(chapter)
    wide = [line for c in nb.cells if c.cell_type == "code"
            and "remove-input" not in c.metadata.get("tags", [])
            for line in c.source.splitlines() if len(line) > MAX_CODE_COLUMNS]
    assert not wide, f"code lines over {MAX_CODE_COLUMNS} columns: {wide}"
