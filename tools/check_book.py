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
* ``wide-equation``: a display equation wider than the text column. At a phone's width
  (below :data:`NARROW` px) an equation may instead scroll inside its own box if the box
  shows a scroll cue (a background image: the book's CSS draws a shadow at the edge that
  hides more formula);
* ``wide-code``: a code cell or a printed output wider than its block (it scrolls
  sideways); not checked below :data:`NARROW` px, where an 80-column line cannot fit;
* ``wide-page``: a page wider than the window (the reader must scroll the whole page);
* ``missing-figure``: a code cell that draws a figure (calls a ``plot_*`` or ``fig_*``
  helper, ``plt.subplots`` or ``plt.figure``) but shows no image;
* ``figure-count``: a page that shows fewer images in its cell outputs than its cells
  make figure calls (helpers the page defines itself, e.g. one that draws on a given
  axis, are not counted).

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
)
WIDTHS = (1440, 1280, 390)
NARROW = 600  # below this width the page is read on a phone

# Runs in the page once MathJax is done; returns the defects it can see in the DOM.
PAGE_PROBE = r"""
(narrow) => {
  const out = [];
  const add = (kind, detail) => out.push({kind, detail: String(detail).slice(0, 300)});
  const main = document.querySelector('main article, article, main, [role=main]')
               || document.body;
  const skip = el => el.closest('pre, code, script, style, textarea, mjx-container, '
                                + 'mjx-assistive-mml, .highlight, .MathJax_Preview');
  // raw TeX left in the text of the page
  const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
  const texRe = /(\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac\{|\\mathcal\{)/;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement || skip(n.parentElement)) continue;
    const m = n.nodeValue.match(texRe);
    if (m) add('raw-tex', n.nodeValue.trim().slice(0, 160));
  }
  // math elements that did not become a formula
  const mathEls = main.querySelectorAll('div.math, span.math');
  for (const el of mathEls) {
    if (!el.querySelector('mjx-container') && el.textContent.trim())
      add('raw-tex', 'math not typeset: ' + el.textContent.trim().slice(0, 120));
  }
  if (mathEls.length && !(window.MathJax && window.MathJax.startup))
    add('raw-tex', 'page has ' + mathEls.length + ' formulas but MathJax did not load');
  for (const el of main.querySelectorAll('mjx-merror, [data-mjx-error]'))
    add('mathjax-error', el.getAttribute('data-mjx-error') || el.textContent);
  // images
  for (const img of document.images)
    if (!img.complete || img.naturalWidth === 0) add('broken-image',
    img.getAttribute('src'));
  // Markdown tables that stayed text
  const pipeRe = /\|\s*:?-{3,}:?\s*\|/;
  for (const p of main.querySelectorAll('p, div.output pre, div.cell_output pre')) {
    const t = p.textContent;
    if (pipeRe.test(t)) add('pipe-table', t.trim().slice(0, 160));
  }
  // widths: the text column is the article's content box
  const col = (document.querySelector('main article') || main).getBoundingClientRect();
  for (const c of main.querySelectorAll('mjx-container[display="true"]')) {
    const w = Math.max(c.scrollWidth,
                       ...[...c.querySelectorAll('mjx-math')].map(m =>
                       m.getBoundingClientRect().width));
    if (w > col.width + 1) {
      if (narrow) {  // on a phone a wide formula may scroll in a box that says so
        let box = c;
        while (box && box !== main) {
          const st = getComputedStyle(box);
          if (['auto', 'scroll'].includes(st.overflowX)) break;
          box = box.parentElement;
        }
        if (box && box !== main && box.getBoundingClientRect().width <= col.width + 1
            && getComputedStyle(box).backgroundImage !== 'none') continue;
      }
      const src = c.closest('.math');
      const tex = c.querySelector('mjx-assistive-mml math');
      add('wide-equation', Math.round(w) + 'px > column ' + Math.round(col.width)
          + 'px: ' + (src && src.id ? src.id + ' ' : '')
          + (tex ? tex.textContent.slice(0, 80) : ''));
    }
  }
  if (!narrow) {
    for (const pre of main.querySelectorAll('pre')) {
      if (pre.scrollWidth > pre.clientWidth + 1) {
        const lines = pre.textContent.split('\n');
        const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
        add('wide-code', pre.scrollWidth + 'px > ' + pre.clientWidth + 'px: '
            + longest.trim().slice(0, 120));
      }
    }
  }
  const pageW = Math.max(document.documentElement.scrollWidth,
                         document.body.scrollWidth);
  if (pageW > window.innerWidth + 1)
    add('wide-page', 'page ' + pageW + 'px > window ' + window.innerWidth + 'px');
  // figures: a cell that draws one shows an image; the page shows as many as it draws
  const cells = [...main.querySelectorAll('div.cell')];
  const src = el => { const i = el.querySelector('.cell_input');
                      return i ? i.textContent : ''; };
  const own = new Set();
  for (const cell of cells)
    for (const m of src(cell).matchAll(/\bdef\s+(\w+)/g)) own.add(m[1]);
  const callRe = /(?:\b([A-Za-z_]\w*)\.)?\b((?:plot|fig)_\w+|subplots|figure)\s*\(/g;
  let calls = 0, images = 0;
  for (const cell of cells) {
    let n = 0;
    for (const m of src(cell).replace(/#.*$/gm, '').matchAll(callRe)) {
      const [, owner, name] = m;
      if (name === 'subplots' || name === 'figure') { if (owner === 'plt') n++; }
      else if (!own.has(name)) n++;
    }
    const out = cell.querySelector('.cell_output');
    const k = out ? out.querySelectorAll('img').length : 0;
    calls += n; images += k;
    if (n && !k) add('missing-figure', 'no image from: '
                     + src(cell).trim().split('\n').slice(0, 3).join(' / ')
                       .slice(0, 160));
  }
  if (images < calls)
    add('figure-count', images + ' images for ' + calls + ' figure calls');
  // links, checked by the caller against the files on disk
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  return {defects: out, links};
}
"""

WAIT_FOR_MATHJAX = r"""
async () => {
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise)
    await window.MathJax.startup.promise;
  if (document.fonts) await document.fonts.ready;
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


def check_pages(
    root: Path,
    pages: list[Path],
    screenshots: Path | None,
    width: int = 1440,
    height: int = 900,
    executable: str | None = None,
) -> list[Defect]:
    """Open each page offline in headless Chromium; return the defects found (see module
    doc)."""
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
            page.goto(page_path.as_uri(), wait_until="load")
            page.evaluate(WAIT_FOR_MATHJAX)
            result = page.evaluate(PAGE_PROBE, width < NARROW)
            for d in result["defects"]:
                add(d["kind"], d["detail"])
            for bad in check_links(result["links"], page_path):
                add("broken-link", bad)
            if screenshots is not None:
                shot = screenshots / (
                    name.replace("/", "__").removesuffix(".html") + f"-{width}.png"
                )
                page.screenshot(path=str(shot), full_page=True)
            page.close()
            defects.extend(found)
            status = "ok" if not found else f"{len(found)} defect(s)"
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
    defects = []
    for width in args.width or WIDTHS:
        try:
            defects += check_pages(args.root, pages, args.screenshots, width=width)
        except FileNotFoundError as err:
            print(f"check_book: {err}", file=sys.stderr)
            return 2
    args.screenshots.mkdir(parents=True, exist_ok=True)
    report = {
        "pages": [
            p.resolve().relative_to(args.root.resolve()).as_posix() for p in pages
        ],
        "defects": [asdict(d) for d in defects],
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
    if tolerated:
        for page, kind in sorted(allowed):
            n = sum(d.page == page and d.kind == kind for d in tolerated)
            if n:
                print(f"check_book: ALLOWED, NOT FIXED: {n} {kind} on {page} (--allow)")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
