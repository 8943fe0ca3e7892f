"""Sphinx glue for the kwng book (loaded through ``_config.yml`` ``local_extensions``).

The package re-exports its public API at the top level (``kwng.kwng_gradient``), while
the API page documents every object once, in the module that defines it
(``kwng.estimator.kwng_gradient``). A cross-reference to the short name would go nowhere
under ``-n``; this extension resolves it to the documented object instead. References to
classes of other libraries (``torch.Tensor``, ``numpy.ndarray``) are rendered as plain
code: the book is built offline, so there is no inventory to link them to.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from sphinx.util import logging

LOG = logging.getLogger(__name__)
EXTERNAL = ("torch.", "np.", "numpy.", "matplotlib.", "plt.", "scipy.", "collections.",
            "pathlib.", "typing.")


def _locate(name: str):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _canonical(target: str, module: str | None, klass: str | None) -> str | None:
    prefixes = [
        p
        for p in (f"{module}.{klass}" if module and klass else None, module, "kwng")
        if p
    ]
    for name in [f"{p}.{target}" for p in prefixes] + [target]:
        obj = _locate(name)
        if obj is None:
            continue
        owner = getattr(obj, "__module__", None)
        qual = getattr(obj, "__qualname__", None)
        if owner and qual and owner.startswith(("kwng", "studies")):
            return f"{owner}.{qual}"
        if name.count(".") and not callable(obj):  # a module-level constant
            return name
    return None


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    if target.startswith(EXTERNAL):
        return contnode
    domain = env.get_domain("py")
    candidates = []
    canonical = _canonical(target, node.get("py:module"), node.get("py:class"))
    if canonical is not None and canonical != target:
        candidates.append(canonical)
    # a bare method or attribute name: the one documented object of that name
    suffix = "." + target.split(".")[-1]
    named = [name for name in domain.objects if name.endswith(suffix)]
    if len(named) == 1:
        candidates.append(named[0])
    for name in candidates:
        for reftype in (node["reftype"], "obj"):
            found = domain.resolve_xref(
                env, node["refdoc"], app.builder, reftype, name, node, contnode
            )
            if found is not None:
                return found
    if canonical is not None:
        # an object of the package without a docstring (or a private helper): named in
        # the text, not part of the API pages, which list documented public names only
        return contnode
    return None


_BORDER = re.compile(r"^(\s*)(=+)(\s+)(=+)\s*$")


def relayout_simple_tables(lines: list[str]) -> int:
    """Re-align two-column reST simple tables (a cell may overflow into the column
    margin).

    Docstrings write ``\\widehat`` in the source, one character more than the text
    docutils sees, so a table aligned in the editor can be malformed once parsed. Cells
    are split at the first run of two spaces; a row whose first column is blank
    continues the row above. Returns the number of tables changed (edits ``lines`` in
    place).
    """
    changed = 0
    i = 0
    while i < len(lines):
        m = _BORDER.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start2 = m.group(1), len(m.group(1)) + len(m.group(2)) + len(m.group(3))
        borders, j = [i], i + 1
        while j < len(lines) and len(borders) < 3 and lines[j].strip():
            if _BORDER.match(lines[j]):
                borders.append(j)
            j += 1
        if len(borders) < 3:
            i = j
            continue
        rows = []
        for k in range(borders[0] + 1, borders[2]):
            if k == borders[1]:
                continue
            text = lines[k][len(indent) :]
            if text[:start2].strip() == "":
                rows.append((k, "", text.strip()))
            else:
                cells = re.split(r"\s{2,}", text.strip(), maxsplit=1)
                rows.append((k, cells[0], cells[1] if len(cells) > 1 else ""))
        w1 = max(len(c1) for _, c1, _ in rows)
        w2 = max(len(c2) for _, _, c2 in rows)
        before = lines[borders[0] : borders[2] + 1]
        for b in borders:
            lines[b] = f"{indent}{'=' * w1}  {'=' * w2}"
        for k, c1, c2 in rows:
            lines[k] = f"{indent}{c1.ljust(w1)}  {c2}".rstrip()
        changed += lines[borders[0] : borders[2] + 1] != before
        i = borders[2] + 1
    return changed


def _process_docstring(app, what, name, obj, options, lines):
    if relayout_simple_tables(lines):
        LOG.info("kwng_book: re-aligned a simple table in the docstring of %s", name)


_INLINE_SCRIPT = re.compile(r"^\s*<script>.*</script>\s*$")


def dedupe_inline_scripts(html: str) -> str:
    """Drop repeated identical one-line inline ``<script>`` tags from a page's head.

    sphinx-thebe and sphinx-togglebutton register their inline configuration again when
    the theme re-hashes the page assets, and a second ``const THEBE_JS_URL = ...`` is a
    JavaScript error in the browser. Only exact repeats of one-line inline scripts are
    removed.
    """
    head_end = html.find("</head>")
    if head_end < 0:
        return html
    seen, out = set(), []
    for line in html[:head_end].splitlines(keepends=True):
        if _INLINE_SCRIPT.match(line):
            if line.strip() in seen:
                continue
            seen.add(line.strip())
        out.append(line)
    return "".join(out) + html[head_end:]


def _dedupe_pages(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    for path in Path(app.outdir).rglob("*.html"):
        text = path.read_text(encoding="utf-8")
        new = dedupe_inline_scripts(text)
        if new != text:
            path.write_text(new, encoding="utf-8")


def source_link(pathto, sourcename: str, suffix: str = ".md") -> str:
    """The HTML line that ends each chapter: a plain link to the page's own source
    (the jupytext ``.md`` file the book copies to ``_sources/``), which opens as a
    notebook in ``make lab``."""
    source = sourcename.removesuffix(".txt")
    if not source.endswith(suffix):
        return ""
    href = pathto("_sources/" + source, 1)
    return (
        f'<p class="kwng-source">This page is <a href="{href}"><code>{source}</code>'
        "</a> in the repository; <code>make lab</code> opens it as a notebook.</p>"
    )


def _page_source(app, pagename, templatename, context, doctree):
    if doctree is None or "body" not in context or not context.get("sourcename"):
        return
    context["body"] += source_link(context["pathto"], context["sourcename"])


def setup(app):
    app.connect("html-page-context", _page_source)
    app.connect("build-finished", _dedupe_pages)
    app.connect("missing-reference", _missing_reference)
    app.connect("autodoc-process-docstring", _process_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
