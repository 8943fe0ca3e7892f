"""Chapter code cells stay short (style item 12): at most :data:`MAX_CELL_LINES` lines
per code cell of every ``book/*.md``, counted as a reader of the file counts them: every
line between the opening ```` ```{code-cell} ```` fence and the closing ```` ``` ````
fence, the cell's options (a ``---`` YAML block or ``:tags:`` lines) included.

The cells not shortened yet are named in :data:`TOO_LONG`, by chapter and first line
of code, so the list can only shrink: a new long cell fails, and so does an entry whose
cell is now short enough (or gone), which must then leave the list.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
MAX_CELL_LINES = 15

#: (chapter, first line of code of the cell) of every code cell still longer than the
#: limit; a pair listed twice names two cells that start alike
TOO_LONG: list[tuple[str, str]] = []

CHAPTERS = sorted(BOOK.glob("*.md"))

OPEN = "```{code-cell}"
CLOSE = "```"


def _raw_cells(path: Path) -> list[list[str]]:
    """The lines between the fences of every code cell of ``path``, options included:
    from a line that starts with ```` ```{code-cell} ```` to the next line that starts
    with ```` ``` ````."""
    cells, body = [], None
    for line in path.read_text().splitlines():
        if body is None:
            if line.startswith(OPEN):
                body = []
        elif line.startswith(CLOSE):
            cells.append(body)
            body = None
        else:
            body.append(line)
    assert body is None, f"{path.name}: a code cell is not closed"
    return cells


def _first_code_line(body: list[str]) -> str:
    """The first line of ``body`` after its options (a ``---`` block or ``:key:``
    lines)."""
    i = 0
    if body and body[0] == "---":
        i = body.index("---", 1) + 1
    while i < len(body) and body[i].startswith(":"):
        i += 1
    return body[i] if i < len(body) else ""


def _long_cells(path: Path) -> list[tuple[str, str, int]]:
    """``(chapter, first line of code, lines)`` of every code cell of ``path`` over the
    limit, its option lines counted."""
    return [(path.name, _first_code_line(body), len(body))
            for body in _raw_cells(path) if len(body) > MAX_CELL_LINES]


def test_the_option_lines_are_counted(tmp_path):
    """Options and code together must stay within the limit: with a 3-line ``---``
    block or a ``:tags:`` line a cell fails with fewer lines of code than without, and
    a cell of exactly the limit passes."""
    def cell(options: str, n: int) -> str:
        code = "\n".join(f"x{i} = {i}" for i in range(n))
        return f"```{{code-cell}} ipython3\n{options}{code}\n```\n\n"

    yaml, tag, n = "---\ntags: [hide-input]\n---\n", ":tags: [remove-input]\n", 15
    md = tmp_path / "a.md"
    md.write_text("# A\n\n" + cell(yaml, n - 2) + cell(yaml, n - 3) + cell(tag, n)
                  + cell(tag, n - 1) + cell("", n) + cell("", n + 1))
    assert MAX_CELL_LINES == n
    assert _long_cells(md) == [("a.md", "x0 = 0", n + 1)] * 3
    # jupytext reads the same six cells; the source of the first, its options left
    # out, is within the limit, so counting the source alone would let it pass
    sources = [c.source for c in jupytext.read(md).cells if c.cell_type == "code"]
    assert len(sources) == 6 and len(sources[0].splitlines()) == n - 2


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_the_walk_finds_the_cells_jupytext_reads(chapter):
    """The fence walk finds every code cell jupytext reads, each with at least the
    lines of its source."""
    nb = jupytext.read(chapter)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    raw = _raw_cells(chapter)
    assert len(raw) == len(sources)
    assert all(len(b) >= len(s.splitlines()) for b, s in zip(raw, sources))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_every_code_cell_is_short_or_listed(chapter):
    allowed = Counter((c, first) for c, first in TOO_LONG if c == chapter.name)
    found = Counter((c, first) for c, first, _ in _long_cells(chapter))
    new = found - allowed
    assert not new, (
        f"code cells longer than {MAX_CELL_LINES} lines (options included) in "
        f"{chapter.name} (shorten them: one-line options, split, or move the recipe "
        f"into kwng): "
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
