"""The real-browser checker of the book (tools/check_book.py) finds each defect class.

Each test writes a small book-like folder with one page seeded with one defect and runs
the checker on it in headless Chromium; a clean page with formulas rendered by the
book's own MathJax copy must pass. Needs Chromium and the MathJax copy (``make
check-book`` installs both and runs these tests with ``KWNG_REQUIRE_BROWSER=1``, so a
missing browser fails there; under a plain ``make test`` on a machine without Chromium
they are skipped with the reason).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATHJAX = ROOT / ".mathjax" / "mathjax"

spec = importlib.util.spec_from_file_location(
    "check_book", ROOT / "tools" / "check_book.py"
)
check_book = importlib.util.module_from_spec(spec)
sys.modules["check_book"] = check_book
spec.loader.exec_module(check_book)

_missing = []
if check_book.find_chromium() is None:
    _missing.append("Chromium (apt-get install chromium)")
if importlib.util.find_spec("playwright") is None:
    _missing.append("playwright (pip install playwright)")
if not (MATHJAX / "tex-chtml.js").exists():
    _missing.append("the MathJax copy (make mathjax)")
if _missing:
    if os.environ.get("KWNG_REQUIRE_BROWSER") == "1":
        raise RuntimeError("the browser check needs " + ", ".join(_missing))
    pytestmark = pytest.mark.skip(
        reason="needs " + ", ".join(_missing) + "; make check-book installs them"
    )

HEAD = """<!DOCTYPE html><html><head><meta charset="utf-8"> <script>window.MathJax =
{tex: {inlineMath: [['\\\\(', '\\\\)']]}, options: {processHtmlClass: 'math',
ignoreHtmlClass: 'document'}};</script> <script defer
src="_static/mathjax/tex-chtml.js"></script> <style>body {margin: 0} main {max-width:
600px} pre, div.math {overflow-x: auto} .cue {overflow-x: auto; background-image:
linear-gradient(to left, #0003, #0000 12px)} </style> </head><body
class="document"><main><article>
"""
TAIL = "</article></main></body></html>\n"
CLEAN = r"""<h1 id="top">A page</h1> <p>Inline <span class="math">\(x^2 +
\sigma\)</span> and a display:</p> <div class="math">\[ \|x - y\|^2 = \sum_i (x_i -
y_i)^2 \]</div> <pre>print("a line well inside the block")</pre> <p><a
href="#top">up</a> <a href="other.html#there">there</a></p>
"""
SEEDED = {
    "raw-tex": r"<p>Inline <span>\(x^2\)</span> left as text.</p>",
    "mathjax-error": r'<div class="math">\[ x^^2 \]</div>',
    "broken-image": '<p><img src="_images/missing.png" alt="gone"></p>',
    "broken-link": '<p><a href="nowhere.html">a</a> <a href="other.html#no">b</a></p>',
    "pipe-table": "<p>| method | accuracy |\n|---|---|\n| sgd | 0.9 |</p>",
    "console": "<script>throw new Error('boom');</script>",
    "wide-equation": r'<div class="math">\[ '
    + " + ".join(f"x_{{{i}}}^{{{i}}}" for i in range(60))
    + r" \]</div>",
    "wide-code": "<pre>" + "x = " + " + ".join(["value"] * 40) + "</pre>",
    "network": '<script src="https://cdn.example.org/lib.js"></script>',
    "wide-page": '<div style="width: 1500px">a table set wider than any screen</div>',
    "figure-count": (
        '<div class="cell"><div class="cell_input"><pre>fig = plotting.plot_relerr(a)\n'
        "fig = plotting.plot_relerr(b)</pre></div>"
        '<div class="cell_output"><img src="{png}" alt="one"></div></div>'
    ),
}
# One cell that draws a figure and shows none: a missing figure, and the page then shows
# fewer images than it draws.
MISSING_FIGURE = (
    '<div class="cell"><div class="cell_input">'
    "<pre>fig = pc.fig_eps(results)</pre></div>"
    '<div class="cell_output"><pre>figure drawn, never shown</pre></div></div>'
)
# A helper the page defines itself draws on a given axis: its calls are not figures.
OWN_HELPER = (
    '<div class="cell"><div class="cell_input"><pre>def plot_panel(ax):\n'
    "    ax.plot([1, 2])</pre></div></div>"
    '<div class="cell"><div class="cell_input"><pre>fig, axes = plt.subplots(1, 2)\n'
    "for ax in axes:\n    plot_panel(ax)  # plot_fig_(x) in a comment</pre></div>"
    '<div class="cell_output"><img src="{png}" alt="one"></div></div>'
)
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
    "nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
)
WIDE_EQ = (
    r'<div class="math">\[ '
    + " + ".join(f"x_{{{i}}}^{{{i}}}" for i in range(60))
    + r" \]</div>"
)


def _book(tmp_path: Path, body: str) -> Path:
    root = tmp_path / "html"
    (root / "_static").mkdir(parents=True)
    os.symlink(MATHJAX, root / "_static" / "mathjax")
    (root / "index.html").write_text(HEAD + CLEAN + body.replace("{png}", PNG) + TAIL)
    (root / "other.html").write_text(HEAD + '<h1 id="there">Other</h1>' + TAIL)
    return root


def _run(root: Path, tmp_path: Path, width: int = 900):
    shots = tmp_path / "shots"
    defects = check_book.check_pages(
        root, check_book.find_pages(root), shots, width=width
    )
    return defects, shots


def test_clean_pages_pass_and_leave_screenshots(tmp_path):
    root = _book(tmp_path, "")
    defects, shots = _run(root, tmp_path)
    assert defects == []
    assert sorted(p.name for p in shots.glob("*.png")) == [
        "index-900.png",
        "other-900.png",
    ]


@pytest.mark.parametrize("width", check_book.WIDTHS)
def test_clean_pages_pass_at_every_width(tmp_path, width):
    defects, _ = _run(_book(tmp_path, OWN_HELPER), tmp_path, width)
    assert defects == []


@pytest.mark.parametrize("kind", sorted(SEEDED))
def test_each_defect_class_fails(tmp_path, kind):
    root = _book(tmp_path, SEEDED[kind])
    defects, _ = _run(root, tmp_path)
    kinds = {d.kind for d in defects}
    assert kind in kinds, defects
    assert all(d.page == "index.html" for d in defects), defects
    # the seeded defect is the only kind found (the console test also sees nothing else)
    assert kinds == {kind}, defects


def test_missing_figure_fails(tmp_path):
    defects, _ = _run(_book(tmp_path, MISSING_FIGURE), tmp_path)
    assert {d.kind for d in defects} == {"missing-figure", "figure-count"}, defects
    assert (
        "1 figure calls" in [d for d in defects if d.kind == "figure-count"][0].detail
    )


def test_cut_equation_at_a_laptop_width_fails(tmp_path):
    defects, _ = _run(_book(tmp_path, WIDE_EQ), tmp_path, width=1280)
    assert {(d.kind, d.width) for d in defects} == {("wide-equation", 1280)}, defects
    # a scroll box with a cue does not excuse it on a laptop
    cued = WIDE_EQ.replace('class="math"', 'class="math cue"')
    defects, _ = _run(_book(tmp_path / "b", cued), tmp_path, width=1280)
    assert {d.kind for d in defects} == {"wide-equation"}, defects


def test_page_wider_than_a_phone_fails(tmp_path):
    defects, _ = _run(_book(tmp_path, SEEDED["wide-page"]), tmp_path, width=390)
    assert {(d.kind, d.width) for d in defects} == {("wide-page", 390)}, defects


def test_phone_takes_a_cued_scrolling_equation_but_not_a_bare_one(tmp_path):
    cued = WIDE_EQ.replace('class="math"', 'class="math cue"')
    assert _run(_book(tmp_path / "a", cued), tmp_path, width=390)[0] == []
    bare = WIDE_EQ.replace('class="math"', 'class="math" style="overflow-x: auto"')
    defects, _ = _run(_book(tmp_path / "b", bare), tmp_path, width=390)
    assert {d.kind for d in defects} == {"wide-equation"}, defects
    # a wide code block scrolls on a phone (80 columns cannot fit): not a defect there
    assert (
        _run(_book(tmp_path / "c", SEEDED["wide-code"]), tmp_path, width=390)[0] == []
    )


def test_page_without_mathjax_is_raw_tex(tmp_path):
    root = _book(tmp_path, "")
    shutil.rmtree(root / "_static")
    (root / "_static").mkdir()
    defects, _ = _run(root, tmp_path)
    kinds = {d.kind for d in defects}
    assert "raw-tex" in kinds and kinds <= {"raw-tex", "broken-link"}, defects


def test_main_exit_status(tmp_path):
    root = _book(tmp_path, SEEDED["pipe-table"])
    assert check_book.main([str(root), "--screenshots", str(tmp_path / "s")]) == 1
    (root / "index.html").write_text(HEAD + CLEAN + TAIL)
    assert check_book.main([str(root), "--screenshots", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "report.json").exists()


def test_allow_reports_but_does_not_fail(tmp_path, capsys):
    root = _book(tmp_path, SEEDED["wide-code"])
    shots = str(tmp_path / "s")
    assert (
        check_book.main(
            [str(root), "--screenshots", shots, "--allow", "index.html:wide-code"]
        )
        == 0
    )
    assert "ALLOWED, NOT FIXED: 2 wide-code on index.html" in capsys.readouterr().out
    # (found at 1440 and 1280 px; not a defect at 390)
    # an allowance for another kind or page does not hide the defect
    assert (
        check_book.main(
            [str(root), "--screenshots", shots, "--allow", "index.html:raw-tex"]
        )
        == 1
    )
    assert (
        check_book.main(
            [str(root), "--screenshots", shots, "--allow", "index.html:nonsense"]
        )
        == 2
    )


def test_rejects_a_folder_without_pages(tmp_path):
    with pytest.raises(ValueError, match="no HTML pages"):
        check_book.find_pages(tmp_path)
    with pytest.raises(ValueError, match="built book folder"):
        check_book.find_pages(tmp_path / "absent")


# --- what a reader sees: each block against its own box, code, figures, screenshots

# An equation narrower than the column but wider than the box the page gives it.
BOXED_EQ = (
    '<div class="math" style="width: 240px">\\[ '
    + " + ".join(f"x_{{{i}}}" for i in range(14))
    + " \\]</div>"
)
WIDE_TABLE = (
    '<table class="table" style="display: block; overflow-x: auto; max-width: 100%">'
    "<tr>" + "".join(f"<th>column {i}</th>" for i in range(14)) + "</tr>"
    "<tr>" + "".join(f"<td>{i}.0</td>" for i in range(14)) + "</tr></table>"
)
NARROW_TABLE = (
    '<table class="table"><tr><th>method</th><th>accuracy</th></tr>'
    "<tr><td>sgd</td><td>0.9</td></tr></table>"
)


def _cell(lines: int, cls: str = "", folded: bool = False) -> str:
    code = "\n".join(f"x{i} = {i}" for i in range(lines))
    body = f'<div class="cell_input"><pre>{code}</pre></div>'
    if folded:
        body = f"<details><summary>Show code</summary>{body}</details>"
    return f'<div class="cell {cls}">{body}</div>'


def _kinds(body: str, tmp_path: Path, width: int = 1280, **kw):
    root = _book(tmp_path, body)
    shots = tmp_path / "shots"
    defects = check_book.check_pages(
        root, check_book.find_pages(root), shots, width=width, **kw
    )
    return defects


def test_equation_wider_than_its_own_box_is_cut(tmp_path):
    defects = _kinds(BOXED_EQ, tmp_path)
    assert {d.kind for d in defects} == {"wide-equation"}, defects
    assert "its box 240px" in defects[0].detail


def test_phone_counts_a_cued_scrolling_equation(tmp_path):
    cued = BOXED_EQ.replace('class="math"', 'class="math cue"')
    scrolls: dict = {}
    assert _kinds(cued, tmp_path, width=390, scrolls=scrolls) == []
    assert scrolls["index.html"]["equations"] == 1, scrolls


def test_table_wider_than_its_column_fails_on_a_laptop(tmp_path):
    defects = _kinds(WIDE_TABLE, tmp_path)
    assert {d.kind for d in defects} == {"wide-table"}, defects
    assert "column 0 | column 1" in defects[0].detail
    assert _kinds(NARROW_TABLE, tmp_path / "b") == []


def test_phone_takes_a_cued_scrolling_table_but_not_a_bare_one(tmp_path):
    scrolls: dict = {}
    cued = WIDE_TABLE.replace('class="table"', 'class="table cue"')
    assert _kinds(cued, tmp_path / "a", width=390, scrolls=scrolls) == []
    assert scrolls["index.html"]["tables"] == 1, scrolls
    defects = _kinds(WIDE_TABLE, tmp_path / "b", width=390)
    assert {d.kind for d in defects} == {"wide-table"}, defects


def _answer_table(col: int) -> str:
    """A cued scrolling table of 10 columns whose answer is column ``col`` (1-based), as
    ``studies.kit.tables.markdown_table(..., answer=...)`` marks it."""
    head = "".join(f"<th>column {i}</th>" for i in range(1, 11))
    return (f'<table class="table cue kwng-answer kwng-answer-col-{col}" '
            'style="display: block; overflow-x: auto; max-width: 100%">'
            f"<thead><tr>{head}</tr></thead><tbody><tr>"
            + "".join(f"<td>{i}.00</td>" for i in range(1, 11))
            + "</tr></tbody></table>")


def test_phone_fails_a_table_whose_answer_column_scrolls_out_of_view(tmp_path):
    defects = _kinds(_answer_table(9), tmp_path / "a", width=390)
    assert {d.kind for d in defects} == {"hidden-answer"}, defects
    assert 'column "column 9"' in defects[0].detail
    # the same table with its answer in view passes (and is counted as scrolling)
    scrolls: dict = {}
    assert _kinds(_answer_table(2), tmp_path / "b", width=390, scrolls=scrolls) == []
    assert scrolls["index.html"]["tables"] == 1, scrolls
    # a named column the table does not have is a defect too
    defects = _kinds(_answer_table(2).replace("col-2", "col-12"), tmp_path / "c",
                     width=390)
    assert {d.kind for d in defects} == {"hidden-answer"}, defects


def test_markdown_table_names_its_answer_columns():
    from studies.kit.tables import markdown_table

    text = markdown_table(("method", "step", "mean (%)"), [("sgd", "0.1", "90.0")],
                          answer=("mean (%)",))
    assert text.startswith("```{table}\n:class: kwng-answer kwng-answer-col-3\n")
    assert text.endswith("| sgd | 0.1 | 90.0 |\n```")
    with pytest.raises(ValueError, match="not in the header"):
        markdown_table(("a", "b"), [("1", "2")], answer=("c",))


def test_phone_counts_scrolling_code(tmp_path):
    scrolls: dict = {}
    assert _kinds(SEEDED["wide-code"], tmp_path, width=390, scrolls=scrolls) == []
    assert scrolls["index.html"] == {"equations": 0, "tables": 0, "code": 1}


def test_cell_showing_more_than_fifteen_lines_fails(tmp_path):
    defects = _kinds(_cell(16), tmp_path)
    assert {d.kind for d in defects} == {"long-cell"}, defects
    assert defects[0].detail.startswith("16 lines")
    # fifteen lines, a folded cell, or a cell whose code is the point pass
    assert _kinds(_cell(15), tmp_path / "a") == []
    assert _kinds(_cell(40, folded=True), tmp_path / "b") == []
    assert _kinds(_cell(40, cls="tag_show-code"), tmp_path / "c") == []
    # counted once per page when asked
    assert _kinds(_cell(16), tmp_path / "d", count_lines=False) == []


def _svg(root: Path, name: str, width_in: float, fontsize: float, empty: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(width_in, width_in / 3))
    for ax in axes[: 1 if empty else 2]:
        ax.plot([1, 2, 3], label="a")
        ax.legend(fontsize=fontsize)
    for ax in axes:
        ax.tick_params(labelsize=fontsize)
    (root / "_images").mkdir(exist_ok=True)
    fig.savefig(root / "_images" / name, format=name.rsplit(".", 1)[1])
    plt.close(fig)
    return (
        f'<div class="cell_output"><img src="_images/{name}" alt="figure" '
        'style="max-width: 100%"></div>'
    )


def test_figure_text_below_seven_px_at_display_size_fails(tmp_path):
    root = _book(tmp_path, "")
    body = _svg(root, "small.svg", width_in=12.0, fontsize=7.0)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    defects = check_book.check_pages(root, [root / "index.html"], None, width=1280)
    assert {d.kind for d in defects} == {"figure-text"}, defects
    assert "px at 600px wide" in defects[0].detail  # drawn 1152 px, shown 600
    # the same text on a figure shown at its own size passes
    body = _svg(root, "fits.svg", width_in=5.0, fontsize=7.0)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    assert check_book.check_pages(root, [root / "index.html"], None, width=1280) == []


def _log_svg(root: Path, name: str, plain: bool) -> str:
    """A figure whose log axis is labelled 10 with a superscript exponent (matplotlib's
    default, the exponent at 0.7 of the label's size), or plainly
    (:func:`studies.kit.style.plain_log_ticks`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from studies.kit.style import plain_log_ticks

    fig, ax = plt.subplots(figsize=(6.2, 2.5))
    ax.loglog([1e-6, 1e2], [1e-3, 1.0])
    ax.tick_params(labelsize=9.5)
    if plain:
        plain_log_ticks(fig)
    (root / "_images").mkdir(exist_ok=True)
    fig.savefig(root / "_images" / name, format="svg")
    plt.close(fig)
    return (f'<div class="cell_output"><img src="_images/{name}" alt="figure" '
            'style="max-width: 100%"></div>')


def test_figure_superscript_below_seven_px_on_a_phone_fails(tmp_path):
    """9.5 pt labels pass on a phone (7.3 px), their superscript exponents (6.65 pt,
    5.1 px) do not; the book's plain labels pass."""
    facts_root = tmp_path / "f"
    facts_root.mkdir()
    _log_svg(facts_root, "sci.svg", plain=False)
    facts = check_book.svg_figure_facts(facts_root / "_images" / "sci.svg")
    sizes = facts["text_sizes"]
    assert min(sizes) == pytest.approx(0.7 * 9.5)
    root = _book(tmp_path, "")
    body = _log_svg(root, "sci.svg", plain=False)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    defects = check_book.check_pages(root, [root / "index.html"], None, width=390)
    assert {d.kind for d in defects} == {"figure-text"}, defects
    body = _log_svg(root, "plain.svg", plain=True)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    assert check_book.check_pages(root, [root / "index.html"], None, width=390) == []


def test_raster_figure_cannot_be_measured(tmp_path):
    root = _book(tmp_path, "")
    body = _svg(root, "figure.png", width_in=5.0, fontsize=12.0)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    defects = check_book.check_pages(root, [root / "index.html"], None, width=1280)
    assert [d.kind for d in defects] == ["figure-text"], defects
    assert "raster" in defects[0].detail


def test_empty_axes_fail(tmp_path):
    root = _book(tmp_path, "")
    body = _svg(root, "half.svg", width_in=5.0, fontsize=12.0, empty=True)
    (root / "index.html").write_text(HEAD + CLEAN + body + TAIL)
    defects = check_book.check_pages(root, [root / "index.html"], None, width=1280)
    assert [(d.kind, d.detail) for d in defects] == [
        ("empty-axes", "half.svg: 1 empty axes")
    ], defects


def test_svg_facts_read_text_sizes_and_axes(tmp_path):
    _svg(tmp_path, "f.svg", width_in=6.0, fontsize=9.0, empty=True)
    facts = check_book.svg_figure_facts(tmp_path / "_images" / "f.svg")
    assert facts["width"] == pytest.approx(6.0 * 72)
    assert min(facts["text_sizes"]) == pytest.approx(9.0)
    assert facts["empty_axes"] == 1


# The page moves its article once the checker has measured it (it marks the headings
# it will look for), so the full-page screenshot draws every heading 150 px to the
# left of the place the page reported: the screenshot is not what the page measured.
SHIFTING = """<div style="height: 1600px">a long page</div><h2>Further down</h2>
<script>new MutationObserver(() => { document.querySelector('article').style
.marginLeft = '-150px'; }).observe(document.body, {attributes: true, subtree: true,
attributeFilter: ['data-kwng-anchor']});</script>
"""


def test_screenshot_that_draws_the_page_shifted_fails(tmp_path):
    page = HEAD.replace("main {max-width:\n600px}", "main {max-width: 600px; "
                        "margin-left: 200px}")
    root = _book(tmp_path, "")
    (root / "index.html").write_text(page + CLEAN + SHIFTING + TAIL)
    defects = check_book.check_pages(
        root, [root / "index.html"], tmp_path / "s", width=1280
    )
    assert {d.kind for d in defects} == {"screenshot-offset"}, defects
    assert "150px to the left" in defects[0].detail
    # the same page without the move passes
    still = SHIFTING.split("<script>")[0]
    (root / "index.html").write_text(page + CLEAN + still + TAIL)
    assert check_book.check_pages(
        root, [root / "index.html"], tmp_path / "s", width=1280
    ) == []


def test_screenshot_offset_finds_the_shift():
    import io

    import numpy as np
    from PIL import Image

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(a.astype(np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    rng = np.random.default_rng(0)
    heading = rng.integers(0, 255, size=(20, 60))
    full = np.full((100, 400), 255)
    full[40:60, 100:160] = heading  # drawn at x = 100
    assert check_book.screenshot_offset(png(full), png(heading), 100, 40) is None
    assert check_book.screenshot_offset(png(full), png(heading), 230, 40) == -130


def test_a_glued_figure_is_shown_by_its_numbered_figure(tmp_path):
    cell = (
        '<div class="cell"><div class="cell_input"><pre>fig = pc.fig_eps(results)\n'
        'glue("fig-eps", fig, display=False)</pre></div></div>'
    )
    shown = (
        '<figure><img src="{png}" alt="eps"><figcaption>Fig. 1</figcaption></figure>'
    )
    assert _kinds(cell + shown, tmp_path / "a") == []
    # without the numbered figure, the page shows fewer images than it draws
    defects = _kinds(cell, tmp_path / "b")
    assert {d.kind for d in defects} == {"figure-count"}, defects
