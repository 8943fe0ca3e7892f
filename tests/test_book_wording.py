"""What the book's pages say, checked from their source: one numbering of the paper's
figures, appendix references that name the section which holds what they cite, and no
sentence about the project's progress where a reader expects the result.

Scanned: the chapters (``book/*.md``), the README, and the package's string literals
(``kwng/**/*.py``: the strings a page glues, and for the figure and appendix checks the
docstrings the API page shows).

* **Figures.** The paper's text holds seven figures (:data:`PAPER_FIGURES`, in the order
  of its LaTeX source); a "Fig. N" outside 1–7 fails, and so does a "Fig. N" whose
  clause names the subject of another figure and not its own (a number used for two
  figures). "Fig. 3 protocol" (the study) is a name, not a figure reference.
* **Appendix.** "App. X.N" must be a section of the paper's appendix
  (:data:`PAPER_APPENDIX`), and a clause about the time figure or the ablation cites
  App. D.3, one about the CIFAR protocol or the Levenberg–Marquardt rule App. D.2.
  With ``KWNG_PAPER_TEX`` pointing at the paper's LaTeX, both tables are checked
  against it.
* **Progress.** :data:`PROCESS` phrases ("pending", "so far", "next GPU run", ...)
  describe the work rather than its result; each use that is about the result (a
  verdict's name in a definition, a rule's own wording) is listed in :data:`ALLOWED`.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the paper's figures in the order of its text: label in the LaTeX source, and the
#: words that name each one's subject (lower case)
PAPER_FIGURES = {
    1: ("fig:relative_error", ("hyper-sphere",)),
    2: ("fig:gaussian_flow", ("flow", "trajector")),
    3: ("fig:cifar10_classification", ("per epoch", "cifar-100")),
    4: ("fig:relative_error_log_normal", ("log-normal",)),
    5: ("fig:sensitivity", ("sensitivity to the bandwidth", "bandwidth sensitivity",
                            "fixed bandwidth", "bandwidth study",
                            "range of bandwidths")),
    6: ("fig:cifar10_timing", ("against time", "wall-clock", "against training time",
                               "time cost", "against the time")),
    7: ("fig:cifar10_ablation", ("ablation", "diagonal conditioning", "damping",
                                 "rq kernel")),
}
#: the sections of the paper's appendix
PAPER_APPENDIX = ("A.1", "A.2", "A.3", "B.1", "B.2", "B.3", "C.1", "C.2", "C.3", "C.4",
                  "D.1", "D.2", "D.3")
#: the appendix section a clause about each subject cites
APPENDIX_TOPICS = {
    "wall-clock": "D.3", "against time": "D.3", "time cost": "D.3", "ablation": "D.3",
    "levenberg": "D.2", "protocol": "D.2", "network architecture": "D.2",
}
#: "Fig. 3" followed by one of these names the study, not the figure
STUDY_NAMES = re.compile(
    r"Fig\. 3(?:'s)?\s+(?:protocol|study|queue|plan|step|steps|answer|page|chapter|"
    r"records|runs|rounds|settings|selection|verdict|sweep|ablations|horizon|layout)"
)
FIG = re.compile(
    r"\b(?:Fig(?:ure)?s?\.?)\s*~?(\d+(?:(?:,\s*|,?\s+and\s+|\s*[-–]\s*)\d+)*)"
)
APP = re.compile(r"\bApp(?:endix|\.)\s*([A-Z])\.(\d+)")

#: phrases that tell the project's progress instead of its result
PROCESS = (
    "pending", "so far", "next gpu", "until then", "not yet", "still queued",
    "runs are in", "as each one's", "gpu budget", "device budget", "session's",
    "this session", "will be run", "is being run", "once the runs", "to be run",
)
#: (file, phrase, words of the one sentence where the phrase is about the result)
ALLOWED = (
    # the ledger's verdict vocabulary defines the word, and the rule names its case
    ("book/claims.md", "pending", "*pending*: the"),
    ("book/claims.md", "pending", "*pending* while any baseline"),
    ("book/claims.md", "pending", "pending while the baseline's"),
    # the 6-epoch appendix is a record of an earlier study, told as such
    ("book/cifar_6epoch.md", "not yet", "had not yet got there"),
    ("book/cifar_6epoch.md", "so far", "for ε to fall so far"),
    ("book/experiments_cifar.md", "not yet", "had not yet moved"),
    # the sentences the package writes while a study has runs left (a finished study's
    # page never shows them)
    ("studies/claims/ledger.py", "so far", "the overall verdict waits"),
    # an error message about a protocol's amendment
    ("studies/fig3/protocol.py", "not yet", "not yet one"),
)


def _md_text(path: Path) -> str:
    """A chapter's prose and the string literals of its code cells (what a page can
    show), one block per line group; comments and code are left out."""
    out, cell = [], None
    for line in path.read_text().splitlines():
        if cell is None and line.startswith("```{code-cell}"):
            cell = []
        elif cell is not None and line.startswith("```"):
            out.extend(s + "\n" for s in _strings("\n".join(cell)))
            cell = None
        elif cell is not None:
            cell.append(line)
        else:
            out.append(line)
    return "\n".join(out)


def _strings(code: str) -> list[str]:
    body = re.sub(r"(?ms)\A---\n.*?^---\n", "", code)
    body = "\n".join(ln for ln in body.splitlines() if not ln.startswith(":"))
    try:
        tree = ast.parse(body)
    except SyntaxError:  # a cell of IPython syntax: its text as it is
        return [body]
    return [n.value for n in ast.walk(tree) if _prose(n)]


def _prose(node: ast.AST) -> bool:
    """A string literal that reads as words (a key or a value such as ``"pending"`` is
    one word and is code, not a sentence)."""
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and " " in node.value.strip())


def _py_text(path: Path, docstrings: bool) -> str:
    """The string literals of a module, with or without its docstrings."""
    tree = ast.parse(path.read_text())
    docs = set()
    if not docstrings:
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                docs.add(id(body[0].value))
    return "\n\n".join(n.value for n in ast.walk(tree)
                       if _prose(n) and id(n) not in docs)


def _sources(docstrings: bool = True) -> dict[str, str]:
    """Every scanned text by its path; ``docstrings``: with the package's docstrings
    (they describe the code, so the progress check leaves them out)."""
    out = {p.relative_to(ROOT).as_posix(): _md_text(p)
           for p in sorted((ROOT / "book").glob("*.md"))}
    out["README.md"] = (ROOT / "README.md").read_text()
    for p in sorted((ROOT / "kwng").rglob("*.py")):
        out[p.relative_to(ROOT).as_posix()] = _py_text(p, docstrings)
    return out


SOURCES = _sources()


def _clause(text: str, start: int, end: int) -> str:
    """The clause around ``text[start:end]``: from the last sentence end, semicolon,
    colon or figure reference before it to the next of these, a comma or a closing
    bracket after it."""
    stops = re.compile(r"[.;:!?](?:\s|$)|\n\s*\n|\bFig\.|\|")
    lo = max([m.end() for m in stops.finditer(text, max(0, start - 300), start)
              if m.end() <= start] or [max(0, start - 300)])
    m = re.compile(stops.pattern + r"|[,)]|\n(?=python )").search(text, end)
    hi = m.start() if m else len(text)
    return " ".join(text[lo:hi].lower().split())


def figure_problems(name: str, text: str) -> list[str]:
    """Each "Fig. N" of ``text`` that is outside the paper's figures, or whose clause
    names another figure's subject and not its own."""
    text = STUDY_NAMES.sub("the study", text)
    out = []
    for m in FIG.finditer(text):
        numbers = [int(k) for k in re.findall(r"\d+", m[1])]
        if any(n not in PAPER_FIGURES for n in numbers):
            out.append(f"{name}: {m[0]!r}: the paper has Figs. 1-{len(PAPER_FIGURES)}")
            continue
        if len(numbers) > 1:
            continue
        n = numbers[0]
        clause = _clause(text, m.start(), m.end())
        own = any(w in clause for w in PAPER_FIGURES[n][1])
        other = [k for k, (_, words) in PAPER_FIGURES.items()
                 if k != n and any(w in clause for w in words)]
        if other and not own:
            out.append(f"{name}: {m[0]!r} in {clause[:120]!r} names the subject of "
                       f"Fig. {other[0]}")
    return out


def appendix_problems(name: str, text: str) -> list[str]:
    out = []
    for m in APP.finditer(text):
        sec = f"{m[1]}.{m[2]}"
        if sec not in PAPER_APPENDIX:
            out.append(f"{name}: App. {sec} is not a section of the paper's appendix")
            continue
        clause = _clause(text, m.start(), m.end())
        for word, want in APPENDIX_TOPICS.items():
            if word in clause and sec != want and sec[0] == want[0]:
                out.append(f"{name}: App. {sec} cited for {word!r} (App. {want} holds "
                           f"it): {clause[:120]!r}")
    return out


def process_problems(name: str, text: str) -> list[str]:
    out = []
    low = " ".join(text.lower().split())
    for phrase in PROCESS:
        for m in re.finditer(r"\b" + re.escape(phrase) + r"\b", low):
            around = low[max(0, m.start() - 120): m.end() + 120]
            if any(name.startswith(f) and p == phrase and w.lower() in around
                   for f, p, w in ALLOWED):
                continue
            out.append(f"{name}: {phrase!r} in '...{around[60:220]}...'")
    return out


def test_figure_numbers_are_the_papers():
    problems = [p for name, text in SOURCES.items()
                for p in figure_problems(name, text)]
    assert not problems, "\n".join(problems)


def test_appendix_references_name_the_right_section():
    problems = [p for name, text in SOURCES.items()
                for p in appendix_problems(name, text)]
    assert not problems, "\n".join(problems)


def test_no_progress_sentences():
    problems = [p for name, text in _sources(docstrings=False).items()
                for p in process_problems(name, text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, bad", [
    ("the paper's Fig. 8 (the ablation)", "Fig. 8"),
    ("the synthetic studies (Figs. 1, 5 and 8)", "Figs. 1"),
    ("sensitivity to the bandwidth (Fig. 6)", "Fig. 5"),
    ("accuracy against time, the paper's Fig. 7.", "Fig. 6"),
])
def test_figure_check_fails_on_a_second_numbering(text, bad):
    problems = figure_problems("page", text)
    assert problems and (bad in problems[0] or "Figs. 1-7" in problems[0])


def test_figure_check_passes_the_papers_numbering():
    text = ("The bandwidth study (Fig. 5). Accuracy against time: the paper's Fig. 6. "
            "The Fig. 3 protocol's ablations, the paper's Fig. 7.")
    assert figure_problems("page", text) == []


def test_appendix_check_fails_on_the_wrong_section():
    assert appendix_problems("p", "accuracy against wall-clock time (App. D.2).")
    assert appendix_problems("p", "see App. D.4")
    assert not appendix_problems("p", "accuracy against wall-clock time (App. D.3).")


def test_process_check_fails_on_a_progress_sentence():
    assert process_problems("book/x.md", "Until then it is marked pending.")
    assert process_problems("book/x.md", "A full run is the next GPU run.")
    assert not process_problems("book/x.md", "KWNG ends at 90 % over three seeds.")


def test_tables_match_the_papers_latex():
    tex = os.environ.get("KWNG_PAPER_TEX")
    if not tex:
        pytest.skip("KWNG_PAPER_TEX (the paper's LaTeX source) not set")
    src = Path(tex).read_text()
    body = src[src.index(r"\begin{document}"):] if r"\begin{document}" in src else src
    labels = re.findall(r"\\begin\{figure\}.*?\\label\{(fig:[^}]+)\}", body, re.S)
    assert labels == [v[0] for v in PAPER_FIGURES.values()]
    app = body[body.index(r"\appendix"):]
    sections, subs = 0, []
    for m in re.finditer(r"\\(section|subsection)\{", app):
        if m[1] == "section":
            sections += 1
            count = 0
        else:
            count += 1
            subs.append(f"{'ABCD'[sections - 1]}.{count}")
    assert tuple(subs) == PAPER_APPENDIX
