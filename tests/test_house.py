"""The structure of the library and of the studies beside it, checked from the source.

* ``import kwng`` loads the core and the engine's preconditioner only: no theory, no
  study and no GPU-kernel module (the kernels load on the first fast step on a GPU).
* The library's floors: core (``kwng/*.py``) < ``kwng/engine`` < ``kwng/theory``;
  imports only go down, and never into ``studies/`` (the library knows no study).
* The studies' rooms, and the arrows that never exist: ``studies.kit`` (shared by all)
  imports no other room of ``studies``; a kit (``studies.cifar``, ``studies.toy``)
  imports no study and not the ledger; a study (``studies.<name>``, its sub-packages
  included) imports no other study and not the ledger; only the ledger
  (``studies.claims``) and the top (``studies``, ``studies.__main__``) read several
  studies. A study adds to a kit by registering (``studies.cifar.hooks``).
* No import cycle; no module over 400 lines (the exemptions are named, with their
  reason, in :data:`LONG_MODULES`), no function over 60.
* One home per name: every ``from kwng.X import name`` / ``from studies.X import name``
  in the code, the book's code cells and the tests names the module that *defines*
  ``name`` (``from kwng import name`` only for the curated names of
  ``kwng/__init__.py``), and every ``alias.name`` on such a module alias reads a name
  that module defines; so no module re-exports another's names.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kwng", "studies")
MAX_MODULE_LINES = 400
#: modules allowed over the line cap, with the reason
LONG_MODULES: dict[str, str] = {
    "kwng/engine/precond.py": "the preconditioner's class, state and step read in one "
    "file (issue #44)",
}
MAX_FUNCTION_LINES = 60
FLOORS = {"engine": 1, "theory": 2}  # core: 0; every studies module is above them
STUDY_FLOOR = 10
KITS = ("studies.cifar", "studies.toy")
LEDGER = "studies.claims"
#: a study built on another study's protocol code (study -> the study it reads), with
#: the reason; every other arrow between two studies is refused
STUDIES_BUILT_ON: dict[tuple[str, str], str] = {
    ("vit", "fig3"): "the Fig. 3 protocol run on another network: the Fig. 3 code "
    "selects, extends, stops early, queues, checks and judges the ViT protocol's runs "
    "unchanged (studies.vit.protocol)",
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(f for p in PACKAGES for f in (ROOT / p).rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _floor(mod: str) -> int:
    parts = mod.split(".")
    if parts[0] == "studies":
        return STUDY_FLOOR
    return (
        FLOORS.get(parts[1], 0)
        if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS)
        else 0
    )


@functools.lru_cache(maxsize=None)
def _tree(mod: str) -> ast.Module:
    return ast.parse(MODULES[mod].read_text())


def _top_level(body, defs: set, imports: dict) -> None:
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.add(n.name)
        elif isinstance(n, ast.Assign):
            defs.update(
                x.id for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Name)
            )
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)) and isinstance(
            n.target, ast.Name
        ):
            defs.add(n.target.id)
        elif isinstance(n, ast.ImportFrom) and n.module:
            imports.update({a.asname or a.name: (n.module, a.name) for a in n.names})
        elif isinstance(n, (ast.If, ast.Try, ast.For, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                _top_level(getattr(n, block, []), defs, imports)
            for h in getattr(n, "handlers", []):
                _top_level(h.body, defs, imports)


@functools.lru_cache(maxsize=None)
def _defines(mod: str) -> frozenset[str]:
    defs: set[str] = set()
    _top_level(_tree(mod).body, defs, {})
    return frozenset(defs)


def _kwng_imports(tree: ast.AST):
    """``(lineno, module, name, alias)`` of every ``from kwng... import`` in
    ``tree``."""
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.ImportFrom)
            and n.level == 0
            and (n.module or "").split(".")[0] in PACKAGES
        ):
            for a in n.names:
                yield n.lineno, n.module, a.name, a.asname or a.name
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(("kwng.", "studies.")) and a.asname:
                    yield n.lineno, a.name, None, a.asname


CURATED = frozenset(
    ast.literal_eval(
        next(
            n.value
            for n in _tree("kwng").body
            if isinstance(n, ast.Assign)
            and getattr(n.targets[0], "id", "") == "__all__"
        )
    )
)


def _problems(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    out, aliases = [], {}
    for line, mod, name, alias in _kwng_imports(tree):
        if name is None:
            aliases[alias] = mod
        elif f"{mod}.{name}" in MODULES:
            aliases[alias] = f"{mod}.{name}"
        elif mod not in MODULES:
            out.append(f"{where}:{line}: no module {mod}")
        elif mod == "kwng":
            if name not in CURATED:
                out.append(f"{where}:{line}: {name} is not in kwng.__all__")
        elif name not in _defines(mod):
            out.append(
                f"{where}:{line}: {mod} does not define {name} "
                "(import it from its home)"
            )
    rebound = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)} | {
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    aliases = {a: m for a, m in aliases.items() if a not in rebound}  # e.g. a parameter
    for n in ast.walk(tree):
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in aliases
        ):
            mod = aliases[n.value.id]
            if f"{mod}.{n.attr}" not in MODULES and n.attr not in _defines(mod):
                out.append(
                    f"{where}:{n.lineno}: {n.value.id}.{n.attr}: "
                    f"{mod} does not define it"
                )
    return out


def _chapter_code(path: Path) -> str:
    cells = re.findall(
        r"```\{code-cell\}[^\n]*\n(.*?)```", path.read_text(), flags=re.S
    )
    cells = [re.sub(r"\A---\n.*?\n---\n", "", c, flags=re.S) for c in cells]
    cells = [re.sub(r"\A(?::\w[\w-]*:[^\n]*\n)+", "", c) for c in cells]  # :tags: ...
    return "\n".join(re.sub(r"^[%!].*$", "", c, flags=re.M) for c in cells)


def test_import_kwng_loads_no_theory_plots_experiments_or_gpu_kernels():
    code = (
        "import sys, kwng; print(' '.join(m for m in sys.modules "
        "if m.startswith('kwng') or m == 'triton' or m.startswith('triton.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    bad = [
        m
        for m in loaded
        if m.startswith(("kwng.theory", "studies"))
        or "triton" in m
    ]
    assert not bad, f"import kwng loaded {bad}"


def test_modules_and_functions_are_short():
    long_modules = {
        m: n
        for m, f in MODULES.items()
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
        and str(f.relative_to(ROOT)) not in LONG_MODULES
    }
    long_functions = [
        f"{m}.{n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for m in MODULES
        for n in ast.walk(_tree(m))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long_modules and not long_functions, (
        f"modules over {MAX_MODULE_LINES} lines: {long_modules}; "
        f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
    )


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for _, mod, name, _ in _kwng_imports(_tree(m)):
            target = f"{mod}.{name}" if f"{mod}.{name}" in MODULES else mod
            if target in MODULES and target != m and target not in PACKAGES:
                edges[m].add(target)
    return edges


def test_imports_only_go_down_and_never_in_a_circle():
    edges = _edges()
    upward = [
        f"{a} -> {b}"
        for a, bs in edges.items()
        for b in bs
        if _floor(b) > _floor(a) and a not in PACKAGES
    ]  # the curated face may name any floor
    assert not upward, f"imports from a lower floor to a higher one: {upward}"
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for b in sorted(edges[m]):
            if state.get(b) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(b) :] + [b]))
            if b not in state:
                visit(b, path + [b])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [m])


def test_every_name_is_imported_from_its_one_home():
    problems = []
    for m, f in MODULES.items():
        if m not in PACKAGES:
            problems += _problems(f.read_text(), str(f.relative_to(ROOT)))
    for f in sorted((ROOT / "tests").glob("*.py")):
        problems += _problems(f.read_text(), str(f.relative_to(ROOT)))
    for f in sorted((ROOT / "book").glob("*.md")):
        problems += _problems(_chapter_code(f), str(f.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_re_export():
    """A name imported through a module that only re-imports it is reported."""
    src = (
        "from kwng.estimator import check_sample_resolution\nfrom kwng import nosync\n"
    )
    assert (
        _problems(src, "seed")
        == [
            "seed:1: kwng.estimator does not define check_sample_resolution "
            "(import it from its home)"
        ]
        or "kwng.samples" not in MODULES
    )
    assert _problems("from kwng import nosync as ns\nns.not_a_name\n", "seed")


def test_the_api_page_documents_every_module():
    """The API pages (``book/api*.md``) have an ``automodule`` for every public module
    of the package (a new module cannot be left out of the reference)."""
    page = "\n".join(p.read_text() for p in sorted((ROOT / "book").glob("api*.md")))
    documented = set(re.findall(r"^\.\. automodule:: ([\w.]+)$", page, flags=re.M))
    missing = sorted(m for m, f in MODULES.items()
                     if not f.stem.startswith("_") or f.stem == "__init__"
                     if m not in documented and m != "studies.__main__")
    assert not missing, f"the API pages (book/api*.md) lack: {missing}"


def test_every_all_lists_only_what_its_module_defines():
    """No ``__all__`` hands on a name defined elsewhere (the package face excepted)."""
    bad = {}
    for m in MODULES:
        if m in PACKAGES:
            continue
        for n in _tree(m).body:
            is_assign = isinstance(n, ast.Assign)
            target = getattr(n.targets[0], "id", "") if is_assign else ""
            if target == "__all__":
                names = set(ast.literal_eval(n.value)) - _defines(m)
                if names:
                    bad[m] = sorted(names)
    assert not bad, f"__all__ names defined elsewhere: {bad}"


def _room(mod: str) -> str:
    """``library``, ``top``, ``kit``, a kit's name, ``ledger``, or the study's name
    (its sub-packages belong to it)."""
    parts = mod.split(".")
    if parts[0] == "kwng":
        return "library"
    if len(parts) == 1 or parts[1] == "__main__":
        return "top"
    name = ".".join(parts[:2])
    if name == "studies.kit":
        return "kit"
    if name in KITS or name == LEDGER:
        return "ledger" if name == LEDGER else name
    return "study:" + parts[1]


def never(a: str, b: str) -> str | None:
    """Why the import ``a -> b`` must not exist, or ``None``."""
    ra, rb = _room(a), _room(b)
    if ra == rb or rb == "library" or ra in ("top", "ledger"):
        return None
    if ra == "library":
        return "the library imports no study"
    if ra == "kit":
        return "studies.kit imports no other room of studies"
    if ra in KITS and (rb.startswith("study:") or rb in ("ledger", "top")):
        return "a kit imports no study"
    if ra in KITS and rb in KITS:
        return "a kit imports no other kit"
    if ra.startswith("study:") and rb.startswith("study:") \
            and (ra[6:], rb[6:]) in STUDIES_BUILT_ON:
        return None
    if ra.startswith("study:") and rb != "kit" and rb not in KITS:
        return "a study imports no other study (only the ledger reads several)"
    return None


def test_the_never_arrows():
    """The library never imports the studies, a kit never imports a study, a study never
    imports another study or the ledger."""
    bad = [f"{a} -> {b}: {why}" for a, bs in _edges().items() for b in sorted(bs)
           if (why := never(a, b))]
    assert not bad, "\n".join(bad)


def test_the_never_rule_sees_each_kind_of_arrow():
    assert never("kwng.estimator", "studies.kit.provenance")
    assert never("studies.kit.guard", "studies.cifar.methods")
    assert never("studies.cifar.train", "studies.fig3.protocol")
    assert never("studies.cifar.train", "studies.toy.setup")
    assert never("studies.fig3.protocol", "studies.authors100.plan")
    assert never("studies.vit.protocol", "studies.fig3.plan") is None  # declared
    assert never("studies.fig3.plan", "studies.vit.protocol")  # not the other way
    assert never("studies.synthetic.tables", "studies.claims.ledger")
    assert never("studies.fig3.amortized.plan", "studies.fig3.plan") is None
    assert never("studies.claims.ledger", "studies.fig3.verdicts") is None
    assert never("studies.fig3.plan", "studies.cifar.hooks") is None
    assert never("studies.bench.step_cost", "kwng.engine.precond") is None


#: chapters that read more than one study, and why (every other chapter reads the
#: library, the kits, the ledger and at most one study)
CHAPTERS_READING_SEVERAL = {
    "ten_minutes.md": "the book in ten minutes: one finding of each study",
    "deep_learning.md": "the user's guide: the step's cost (bench) and the evidence "
                        "for the amortized step and the variants (fig3)",
    "experiments_cifar.md": "the overview of the CIFAR studies: the claim suite and "
                            "the authors' horizon",
    "cifar_6epoch.md": "the 6-epoch study, whose forward notes quote the claim suite",
}


def _chapter_studies(path: Path) -> set[str]:
    code = _chapter_code(path)
    mods = re.findall(r"^\s*(?:from|import) (studies(?:\.\w+)?)", code, flags=re.M)
    return {m for m in mods if _room(m).startswith("study:")}


def test_a_chapter_reads_one_study_unless_it_says_why():
    several = {p.name: sorted(_chapter_studies(p))
               for p in sorted((ROOT / "book").glob("*.md"))
               if len(_chapter_studies(p)) > 1}
    unlisted = {k: v for k, v in several.items() if k not in CHAPTERS_READING_SEVERAL}
    assert not unlisted, f"chapters reading several studies: {unlisted}"
    stale = sorted(set(CHAPTERS_READING_SEVERAL) - set(several))
    assert not stale, f"listed but reading one study or none: {stale}"
