"""Tables for the book: rows of already formatted cells as a Markdown table.

The chapters print their summaries through :func:`markdown_table` and IPython's
``display(Markdown(...))``, which myst-nb renders as an HTML table (the book's
``nb_render_markdown_format`` is ``myst``).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["markdown_table", "kwng_criteria_rows"]


def _cell(value) -> str:
    text = str(value).replace("\n", " ")
    return text.replace("|", r"\|")


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence], align: str | None = None,
    answer: Sequence[str] = (),
) -> str:
    """A Markdown table with the given header and rows (cells are ``str``-ed, pipes
    escaped). ``align`` holds one character per column, ``l``, ``r`` or ``c``
    (default: the first column left, the others right). ``answer`` names the columns
    that hold the table's answer (header names): the table is then wrapped in a MyST
    ``table`` directive whose classes ``kwng-answer-col-<i>`` (1-based) mark them, and
    ``tools/check_book.py`` checks that they are on screen at every width, a phone's
    included, without scrolling the table."""
    header = list(header)
    missing = [a for a in answer if a not in header]
    if missing:
        raise ValueError(f"answer columns {missing} are not in the header {header}")
    if not header:
        raise ValueError("header must name at least one column")
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - set("lrc"):
        raise ValueError(
            f"align must give one of 'l', 'r', 'c' per column ({len(header)}), "
            f"got {align!r}"
        )
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = [
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "|" + "|".join(rule[a] for a in align) + "|",
    ]
    for row in rows:
        row = list(row)
        if len(row) != len(header):
            raise ValueError(
                f"every row needs {len(header)} cells, got {len(row)}: {row}"
            )
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    if not answer:
        return "\n".join(lines)
    marks = " ".join(f"kwng-answer-col-{header.index(a) + 1}" for a in answer)
    return "\n".join(["```{table}", f":class: kwng-answer {marks}", "", *lines, "```"])


def kwng_criteria_rows(v: dict, within: str, above: str) -> list[tuple]:
    """The two criteria that the CIFAR verdict rules share, as table rows
    ``(criterion, numbers, holds)``: KWNG's IC accuracy within 5 points of its WC one
    (``v[within]``), and at least 20 points above SGD's in IC (``v[above]``); ``v``
    holds ``kwng_ill``, ``kwng_well`` and ``sgd_ill`` as fractions."""
    kwng = f"{100 * v['kwng_ill']:.1f} vs "
    return [("1. IC within 5 points of WC", kwng + f"{100 * v['kwng_well']:.1f} %",
             v[within]),
            ("2. IC at least 20 points above SGD", kwng + f"{100 * v['sgd_ill']:.1f} %",
             v[above])]
