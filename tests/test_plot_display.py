"""Every figure a plotting helper draws is shown in a notebook, wherever it is called.

The bug this guards against: a helper that drew inside ``plt.rc_context`` restored every
rc parameter on exit, the notebook backend's interactive flag included, so after the
first styled figure the later ones (``fig = plot_...(...)``) were never displayed and
the synthetic chapter showed one figure of five.
"""

from __future__ import annotations

import matplotlib
import nbformat
import pytest

from studies.kit.style import BOOK_STYLE
from studies.synthetic import figures as plotting

IMAGES = {"image/png", "image/svg+xml"}
ROWS = [
    dict(panel="sigma", d=d, bandwidth_spec=s, error=0.1 * s * d)
    for d in (1, 2)
    for s in (0.5, 1.0, 2.0)
]


def test_style_leaves_no_rc_state_behind():
    before = dict(matplotlib.rcParams)
    interactive = matplotlib.is_interactive()
    fig = plotting.plot_bandwidth({"a": ROWS})
    assert fig.axes[0].title.get_fontsize() == BOOK_STYLE["axes.titlesize"]
    assert dict(matplotlib.rcParams) == before
    assert matplotlib.is_interactive() == interactive


def test_every_figure_is_shown_in_a_kernel():
    pytest.importorskip("nbclient")
    from nbclient import NotebookClient

    cells = [
        f"from studies.synthetic import figures as plotting\nrows = {ROWS!r}",
        "fig = plotting.plot_bandwidth({'a': rows})",
        "fig = plotting.plot_bandwidth({'a': rows})\n"
        "fig = plotting.plot_bandwidth({'b': rows})",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2])",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    images = [
        sum(bool(IMAGES & set(o.get("data", {}))) for o in c.outputs) for c in nb.cells
    ]
    assert images == [0, 1, 2, 1], images


def test_book_figures_are_shown_as_svg_and_png():
    """A figure drawn by a book figure function is shown as SVG in a kernel, so the
    book's checker can read the size of its text from the file, with a PNG of it for
    notebook readers."""
    pytest.importorskip("nbclient")
    from nbclient import NotebookClient

    cells = [f"from studies.synthetic import figures as plotting\nrows = {ROWS!r}",
             "fig = plotting.plot_bandwidth({'a': rows})"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    kinds = [set(o.get("data", {})) & IMAGES for o in nb.cells[1].outputs]
    assert kinds == [{"image/svg+xml", "image/png"}], kinds
