"""Open every page of the built book in headless Chromium, offline, and report what a
reader would see go wrong.

Usage::

    python tools/check_book.py _build/html [--screenshots _build/screenshots]
        [--width 1440 --width 1280 --width 390]

Each page is loaded from disk, once at each width (by default 1440 and 1280 px, a
laptop, and 390 px, a phone), (``file://``, as a reader opens
``_build/html/index.html``) in Debian's Chromium driven by Playwright, with every
request that is not a local file refused and counted. After MathJax has finished
typesetting, the page fails on

* ``network``: a request for anything outside the book (a CDN script, a web font);
* ``raw-tex``: TeX that MathJax did not render (``\\(``, ``\\[``, ``$$`` or a math
  element with no rendered formula), or MathJax missing on a page that has mathematics;
* ``mathjax-error``: a formula that MathJax rendered as an error;
* ``broken-image``: an image that did not load;
* ``broken-link``: a link to a file of the book that does not exist, or to an anchor
  that the target page does not have;
* ``pipe-table``: a paragraph of Markdown table syntax (``| a | b |`` / ``|---|``), the
  trace of a table that was parsed as plain text;
* ``console``: a JavaScript error or a console message of level error;
* ``wide-equation``: a display equation wider than the box that holds it (the
  narrowest of its own scroll box, its ancestors and the text column). At a phone's
  width (below :data:`NARROW` px) an equation may instead scroll inside its own box if
  the box shows a scroll cue (a background image: the book's CSS draws a shadow at the
  edge that hides more formula); those are counted per page, not failed;
* ``wide-table``: a table wider than its box, by the same rule (cut or scrolling at a
  laptop's width; at a phone's width allowed, and counted, in a cued scroll box);
* ``hidden-answer``: a table that names the columns holding its answer (classes
  ``kwng-answer-col-<i>``, from ``studies.kit.tables.markdown_table(..., answer=...)``)
  with one of them outside the window or outside the box the table scrolls in, as the
  page opens: at a phone's width the reader must not scroll a table to find its
  answer (reorder, stack or split it instead);
* ``wide-code``: a code cell or a printed output wider than its block (it scrolls
  sideways); at a phone's width, where an 80-column line cannot fit, counted instead;
* ``wide-page``: a page wider than the window (the reader must scroll the whole page);
* ``long-cell``: a code cell that shows more than :data:`MAX_CELL_LINES` lines (folded
  ``hide-input`` cells do not count; a cell tagged ``show-code``, whose code is the
  point, may);
* ``missing-figure``: a code cell that draws a figure (calls a ``plot_*`` or ``fig_*``
  helper, ``plt.subplots`` or ``plt.figure``) but shows no image;
* ``figure-count``: a page that shows fewer images in its cell outputs than its cells
  make figure calls (helpers the page defines itself, e.g. one that draws on a given
  axis, are not counted);
* ``figure-text``: a figure whose smallest text is below :data:`MIN_TEXT_PX` px at the
  width it is shown, computed from the figure file (its size and the size of each
  glyph in it, a sub- or superscript at its own size) and the displayed width; a raster
  figure cannot be measured and is reported;
* ``empty-axes``: a figure with a framed axes that shows nothing;
* ``screenshot-offset``: the full-page screenshot draws a heading away from where the
  page has it (compared with a screenshot of the heading alone), after four tries, the
  later ones after a fresh load and a wait of 0.5, 1 and 1.5 s (on a loaded machine a
  page can still be settling after the first tries).

At a phone's width the blocks that scroll sideways in a cued box (equations, tables,
code) are counted per page and summed in the summary and in ``report.json``.

A full-page screenshot of each page goes to the screenshot folder, with ``report.json``
listing every defect found. The exit status is 1 when any page has a defect, 2 when the
browser cannot be started.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no name resolves: the network is off
]
LOCAL = ("file:", "data:", "blob:", "about:")
SKIP_DIRS = {
    "_static",
    "_sources",
    "_images",
    "_sphinx_design_static",
    "_panels_static",
}
SKIP_PAGES = {"search.html"}
KINDS = (
    "network",
    "raw-tex",
    "mathjax-error",
    "broken-image",
    "broken-link",
    "pipe-table",
    "console",
    "wide-equation",
    "wide-code",
    "wide-page",
    "missing-figure",
    "figure-count",
    "wide-table",
    "long-cell",
    "figure-text",
    "hidden-answer",
    "empty-axes",
    "screenshot-offset",
)
SCROLLING = ("equations", "tables", "code")  # counted at a phone's width
WIDTHS = (1440, 1280, 390)
NARROW = 600  # below this width the page is read on a phone

# Runs in the page once MathJax is done: the defects it can see in the DOM, the counts
# of blocks that scroll, the figures shown and where the heading is (see the file).
PAGE_PROBE = (Path(__file__).with_name("check_book_probe.js")).read_text()
MAX_CELL_LINES = 15  # code lines a cell may show unless tagged ``show-code``
MIN_TEXT_PX = 7.0  # the smallest figure text a reader can read, at display size
SHOT_TOLERANCE = 12  # px a screenshot may draw a heading away from its place

WAIT_FOR_MATHJAX = r"""
async () => {
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise)
    await window.MathJax.startup.promise;
  if (document.fonts) await document.fonts.ready;
  return true;
}
"""


# Waits until no CSS transition or animation runs and two frames have been drawn.
SETTLE = r"""
async () => {
  const t0 = performance.now();
  while (document.getAnimations().some(a => a.playState === 'running')
         && performance.now() - t0 < 2000)
    await new Promise(r => setTimeout(r, 50));
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return true;
}
"""


@dataclass
class Defect:
    page: str
    kind: str
    detail: str
    width: int = 0


def find_pages(root: Path) -> list[Path]:
    """Every HTML page of a built book, without Sphinx's own asset folders and search
    page."""
    if not root.is_dir():
        raise ValueError(
            f"root must be a built book folder (with index.html), got {root}"
        )
    pages = []
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP_DIRS or rel.name in SKIP_PAGES:
            continue
        pages.append(path)
    if not pages:
        raise ValueError(f"no HTML pages under {root}")
    return pages


_ID_CACHE: dict[Path, set[str]] = {}


def _ids(path: Path) -> set[str]:
    if path not in _ID_CACHE:
        text = path.read_text(encoding="utf-8", errors="replace")
        _ID_CACHE[path] = set(re.findall(r'\sid="([^"]+)"', text))
        _ID_CACHE[path] |= set(re.findall(r'\sname="([^"]+)"', text))
    return _ID_CACHE[path]


def check_links(links: list[str], page: Path) -> list[str]:
    """Links to local files that do not exist, or anchors their target page does not
    have."""
    bad = []
    for href in dict.fromkeys(links):
        parts = urlsplit(href)
        if parts.scheme != "file":
            continue
        target = Path(unquote(parts.path))
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            bad.append(f"{href} (no such file)")
        elif parts.fragment and target.suffix == ".html":
            if unquote(parts.fragment) not in _ids(target):
                bad.append(f"{href} (no anchor #{parts.fragment} in {target.name})")
    return bad


_SVG = "{http://www.w3.org/2000/svg}"
# matplotlib draws a text as glyph paths in a group scaled by size / 100 (y flipped)
_TEXT_SCALE = re.compile(r"scale\(\s*([0-9.eE+-]+)[ ,]+-([0-9.eE+-]+)\s*\)")
# what an axes shows: lines, collections, images, a legend
_DATA_ID = re.compile(
    r"^(line2d|\w*Collection|QuadMesh|image|legend|text)_\d+$", re.IGNORECASE
)


_GLYPH_SCALE = re.compile(r"scale\(\s*([0-9.eE+-]+)\s*\)")  # one factor: a script


def _glyph_sizes(el, size: float) -> list[float]:
    """The size of each glyph drawn under ``el`` (a text group of font ``size``): a
    sub- or superscript of mathtext (``10⁻⁴`` on a log axis, ``U_k``) is a glyph
    under a further ``scale(0.7)`` (``0.49`` for a script of a script)."""
    out = []
    for child in el:
        if child.tag == _SVG + "defs":
            continue
        m = _GLYPH_SCALE.search(child.get("transform", ""))
        here = size * float(m[1]) if m else size
        if child.tag in (_SVG + "use", _SVG + "path"):
            out.append(here)
        out.extend(_glyph_sizes(child, here))
    return out


def svg_figure_facts(path: Path) -> dict:
    """What a matplotlib SVG figure shows: its width in its own units, the size of each
    text in those units and the number of empty axes (a framed axes that shows no
    line, collection, image, legend or text other than its tick labels and title).

    The returned ``{"width", "text_sizes", "empty_axes"}`` are read from the file:
    text is drawn as glyphs under ``scale(s, -s)`` with ``s`` = font size / 100, a
    mathtext sub- or superscript under a further ``scale(k)`` (:func:`_glyph_sizes`:
    its size is ``k`` times the text's), and each axes is a group ``axes_N``; the axis
    titles are ``text_N`` children only when set, so an axes with nothing but a title
    counts as empty.
    """
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    box = root.get("viewBox")
    if box:
        width = float(box.split()[2])
    else:
        width = float(re.sub(r"[a-z%]+$", "", root.get("width", "0")))
    sizes = []
    for g in root.iter(_SVG + "g"):
        m = _TEXT_SCALE.search(g.get("transform", ""))
        if m and abs(float(m[1]) - float(m[2])) < 1e-12:
            size = 100.0 * float(m[1])
            sizes.extend(_glyph_sizes(g, size) or [size])
    empty = 0
    for g in root.iter(_SVG + "g"):
        if not re.fullmatch(r"axes_\d+", g.get("id", "")):
            continue
        ids = [c.get("id", "") for c in g]
        framed = any(i.startswith("matplotlib.axis") for i in ids)
        shows = [i for i in ids if _DATA_ID.match(i) and not i.startswith("text_")]
        patches = sum(i.startswith("patch_") for i in ids)
        if framed and not shows and patches <= 5:  # background + four spines
            empty += 1
    return {"width": width, "text_sizes": sizes, "empty_axes": empty}


def check_figures(figures: list[dict]) -> list[tuple[str, str]]:
    """``(kind, detail)`` of each figure shown whose text is below
    :data:`MIN_TEXT_PX` at the width it is displayed, or that has empty axes.

    ``figures`` are the probe's ``{"src", "natural", "shown"}``. A raster image
    (PNG) carries no record of its text, so it cannot be checked and is reported: the
    book's figures are vector (SVG)."""
    out = []
    for fig in figures:
        parts = urlsplit(fig["src"])
        path = Path(unquote(parts.path))
        name = path.name[:16]
        if parts.scheme != "file" or not path.exists():
            continue
        if path.suffix.lower() != ".svg":
            out.append(("figure-text", f"{name}: a raster figure, its text size "
                        "cannot be measured (draw it as SVG)"))
            continue
        facts = svg_figure_facts(path)
        scale = fig["shown"] / facts["width"] if facts["width"] else 0.0
        if facts["text_sizes"]:
            smallest = min(facts["text_sizes"]) * scale
            if smallest < MIN_TEXT_PX:
                out.append(("figure-text", f"{name}: text {smallest:.1f}px < "
                            f"{MIN_TEXT_PX:g}px at {fig['shown']:.0f}px wide"))
        if facts["empty_axes"]:
            out.append(("empty-axes", f"{name}: {facts['empty_axes']} empty axes"))
    return out


def _gray(png: bytes):
    import io

    import numpy as np
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # a long page is a tall screenshot, not an attack
    return np.asarray(Image.open(io.BytesIO(png)).convert("L"))


def screenshot_offset(full, ref: bytes, x: int, y: int, reach: int = 400
                      ) -> int | None:
    """How many px (negative: to the left) a full-page screenshot ``full`` (PNG bytes,
    or the gray image of :func:`_gray`) draws a heading away from its place ``(x, y)``
    (document px), found by sliding ``ref``, a screenshot of the heading's box alone,
    along the heading's band; ``None`` when it is within :data:`SHOT_TOLERANCE` px of
    its place (or nothing is drawn there to compare with)."""
    import numpy as np

    if isinstance(full, bytes):
        full = _gray(full)
    b = _gray(ref).astype(float)
    h, w = b.shape
    if h == 0 or w == 0 or b.std() < 1.0 or y + h > full.shape[0]:
        return None
    band = full[y : y + h].astype(float)
    costs = {
        dx: abs(band[:, x + dx : x + dx + w] - b).mean()
        for dx in range(max(-reach, -x), min(reach, full.shape[1] - w - x) + 1)
    }
    if not costs:
        return None
    best = min(costs, key=costs.get)
    near = range(-SHOT_TOLERANCE, SHOT_TOLERANCE + 1)
    here = min(costs.get(dx, np.inf) for dx in near)
    # in place when the heading is drawn where it should be (up to anti-aliasing), or
    # when no other place matches it clearly better (a mostly blank heading box)
    if abs(best) <= SHOT_TOLERANCE or here <= 2.0 or costs[best] > 0.5 * here:
        return None
    return best


def find_chromium() -> str | None:
    for name in (
        os.environ.get("CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _router(add):
    """Let local files through; refuse (and report) any request that would leave the
    machine."""

    def route(r):
        url = r.request.url
        if url.startswith(LOCAL):
            r.continue_()
        else:
            add("network", url)
            r.abort("internetdisconnected")

    return route


def _console(add):
    def on_console(msg):
        # a failed load is reported once, with its URL, by the requestfailed handler
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            add("console", msg.text)

    return on_console


def _failed(add):
    def on_failed(request):
        if request.url.startswith("file:"):
            kind = "broken-image" if request.resource_type == "image" else "broken-link"
            add(kind, f"{request.url} ({request.failure})")

    return on_failed


def _shot_offset(page, full, anchor: dict) -> int | None:
    """The offset of one heading in the full-page screenshot ``full``, against a
    screenshot of that heading alone (:func:`screenshot_offset`)."""
    el = page.query_selector(f'[data-kwng-anchor="{anchor["k"]}"]')
    if el is None or anchor["w"] < 8 or anchor["h"] < 4:
        return None
    ref = el.screenshot()
    return screenshot_offset(full, ref, round(anchor["x"]), round(anchor["y"]))


def _inspect(page, page_path: Path, name: str, add, screenshots: Path | None,
             width: int, count_lines: bool) -> dict:
    """Load one page, run the probe and the file-based checks, take (and check) its
    screenshot; return the counts of blocks that scroll sideways."""
    page.goto(page_path.as_uri(), wait_until="load")
    page.evaluate(WAIT_FOR_MATHJAX)
    opts = {"narrow": width < NARROW, "lines": count_lines, "maxLines": MAX_CELL_LINES}
    result = page.evaluate(PAGE_PROBE, opts)
    for d in result["defects"]:
        add(d["kind"], d["detail"])
    for bad in check_links(result["links"], page_path):
        add("broken-link", bad)
    for kind, detail in check_figures(result["figures"]):
        add(kind, detail)
    if screenshots is not None:
        shot = screenshots / (
            name.replace("/", "__").removesuffix(".html") + f"-{width}.png"
        )
        anchors = result["anchors"]
        # a layout still settling is drawn shifted: again, from a fresh load of the
        # page, given longer to settle each time
        for attempt in range(4):
            if attempt:
                page.reload(wait_until="load")
                page.evaluate(WAIT_FOR_MATHJAX)
                page.wait_for_timeout(500 * attempt)
                anchors = page.evaluate(PAGE_PROBE, opts)["anchors"]
            page.evaluate(SETTLE)
            full = page.screenshot(full_page=True)
            gray = _gray(full)
            offsets = [(a, _shot_offset(page, gray, a)) for a in anchors]
            offsets = [(a, dx) for a, dx in offsets if dx is not None]
            page.evaluate("() => window.scrollTo(0, 0)")
            if not offsets:
                break
        shot.write_bytes(full)
        for a, dx in offsets[:1]:
            side = "left" if dx < 0 else "right"
            add("screenshot-offset", f"{shot.name}: a heading at y = {a['y']:.0f}px "
                f"is drawn {abs(dx)}px to the {side} of its place")
    return result["counts"]


def check_pages(
    root: Path,
    pages: list[Path],
    screenshots: Path | None,
    width: int = 1440,
    height: int = 900,
    executable: str | None = None,
    count_lines: bool = True,
    scrolls: dict | None = None,
) -> list[Defect]:
    """Open each page offline in headless Chromium; return the defects found (see module
    doc). ``scrolls``, if given, receives ``{page: {"equations", "tables",
    "code"}}``, the blocks that scroll sideways inside a cued box at a phone's width;
    ``count_lines`` checks the code lines each cell shows (once per page is enough)."""
    if width < 320 or height < 200:
        raise ValueError(
            f"width must be >= 320 and height >= 200, got {width}x{height}"
        )
    from playwright.sync_api import sync_playwright

    executable = executable or find_chromium()
    if executable is None:
        raise FileNotFoundError(
            "no Chromium found (Debian: apt-get install chromium); "
            "or set CHROMIUM to its path"
        )
    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
    defects: list[Defect] = []
    root = root.resolve()
    pages = [p.resolve() for p in pages]
    with (
        tempfile.TemporaryDirectory(prefix="kwng-chromium-") as profile,
        sync_playwright() as p,
    ):
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": width, "height": height},
            offline=True,
        )
        for page_path in pages:
            name = page_path.relative_to(root).as_posix()
            found: list[Defect] = []

            def add(kind: str, detail: str, _found=found, _name=name) -> None:
                _found.append(Defect(_name, kind, detail[:300], width))

            page = context.new_page()
            page.route("**/*", _router(add))
            page.on(
                "pageerror", lambda e, _add=add: _add("console", f"page error: {e}")
            )
            page.on("console", _console(add))
            page.on("requestfailed", _failed(add))
            redirect = re.search(
                r'http-equiv="refresh"[^>]*url=([^"]+)"',
                page_path.read_text(encoding="utf-8", errors="replace"),
                re.IGNORECASE,
            )
            if redirect:  # Sphinx's root index.html only forwards to the first chapter
                for bad in check_links(
                    [(page_path.parent / redirect.group(1)).as_uri()], page_path
                ):
                    add("broken-link", bad)
                defects.extend(found)
                print(f"{name}: redirect to {redirect.group(1)}", flush=True)
                page.close()
                continue
            counts = _inspect(page, page_path, name, add, screenshots, width,
                              count_lines)
            page.close()
            defects.extend(found)
            scrolling = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
            if width < NARROW and scrolls is not None:
                scrolls[name] = counts
            status = "ok" if not found else f"{len(found)} defect(s)"
            if scrolling:
                status += f"; scroll sideways: {scrolling}"
            print(f"{name} at {width} px: {status}", flush=True)
            for d in found[:20]:
                print(f"    [{d.kind}] {d.detail}", flush=True)
            if len(found) > 20:
                print(f"    ... and {len(found) - 20} more", flush=True)
        context.close()
    return defects


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, nargs="?", default=Path("_build/html"))
    parser.add_argument("--screenshots", type=Path, default=Path("_build/screenshots"))
    parser.add_argument(
        "--width",
        type=int,
        action="append",
        default=[],
        help="viewport width in CSS pixels, repeatable (default: "
        + ", ".join(map(str, WIDTHS)) + ": two laptops and a phone)",
    )
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PAGE:KIND",
        help="report, but do not fail on, defects of KIND on PAGE (a known defect "
        "that is being fixed elsewhere; listed loudly in the summary)",
    )
    parser.add_argument(
        "--page",
        action="append",
        default=[],
        help="check only these pages (paths relative to root)",
    )
    args = parser.parse_args(argv)
    try:
        pages = find_pages(args.root)
    except ValueError as err:
        print(f"check_book: {err}", file=sys.stderr)
        return 2
    if args.page:
        pages = [args.root / p for p in args.page]
    defects, scrolls = [], {}
    for i, width in enumerate(args.width or WIDTHS):
        scrolls[width] = {}
        try:
            defects += check_pages(args.root, pages, args.screenshots, width=width,
                                   count_lines=i == 0, scrolls=scrolls[width])
        except FileNotFoundError as err:
            print(f"check_book: {err}", file=sys.stderr)
            return 2
    args.screenshots.mkdir(parents=True, exist_ok=True)
    report = {
        "pages": [
            p.resolve().relative_to(args.root.resolve()).as_posix() for p in pages
        ],
        "defects": [asdict(d) for d in defects],
        "scrolls": {w: c for w, c in scrolls.items() if c},
    }
    (args.screenshots / "report.json").write_text(json.dumps(report, indent=1))
    allowed = set()
    for item in args.allow:
        page, _, kind = item.rpartition(":")
        if not page or kind not in KINDS:
            print(
                f"check_book: --allow takes PAGE:KIND, KIND in {KINDS}; got {item!r}",
                file=sys.stderr,
            )
            return 2
        allowed.add((page, kind))
    failing = [d for d in defects if (d.page, d.kind) not in allowed]
    tolerated = [d for d in defects if (d.page, d.kind) in allowed]
    counts = {k: sum(d.kind == k for d in failing) for k in KINDS}
    summary = ", ".join(f"{k}: {v}" for k, v in counts.items() if v) or "no defects"
    print(
        f"check_book: {len(pages)} pages at "
        f"{', '.join(map(str, args.width or WIDTHS))} px,"
        f" {summary}; screenshots in {args.screenshots}"
    )
    for width, by_page in scrolls.items():
        if by_page:
            total = {k: sum(c[k] for c in by_page.values()) for k in SCROLLING}
            print(f"check_book: at {width} px, scrolling sideways in a cued box: "
                  + ", ".join(f"{v} {k}" for k, v in total.items()))
    if tolerated:
        for page, kind in sorted(allowed):
            n = sum(d.page == page and d.kind == kind for d in tolerated)
            if n:
                print(f"check_book: ALLOWED, NOT FIXED: {n} {kind} on {page} (--allow)")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
