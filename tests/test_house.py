"""The package's structure, checked from its source (style items 14-15).

* ``import kwng`` loads the core and the engine's preconditioner only: no theory, plot,
  experiment or GPU-kernel module (the kernels load on the first fast step on a GPU).
* Folders are floors and imports only go down: core (``kwng/*.py``) < ``kwng/engine`` <
  ``kwng/theory`` < ``kwng/experiments`` < ``kwng/plots`` (figures drawn from what the
  experiments' results modules compute, never the reverse); no import cycle between
  modules.
* No module over 400 lines (the documented exemptions of ``LONG_MODULES`` excepted),
  no function over 60.
* One home per name: every ``from kwng.X import name`` in the package, the book's code
  cells and the tests names the module that *defines* ``name`` (``from kwng import
  name`` only for the curated names of ``kwng/__init__.py``), and every ``alias.name``
  on a kwng module alias reads a name that module defines; so no module re-exports
  another's names.
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
PKG = ROOT / "kwng"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
#: modules allowed past MAX_MODULE_LINES, each with its reason (functions stay short)
LONG_MODULES = {
    "kwng/engine/precond.py": "the preconditioner's class, state and step read in one "
    "file (issue #44)",
}
FLOORS = {"engine": 1, "theory": 2, "experiments": 3, "plots": 4}  # core: 0


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _floor(mod: str) -> int:
    parts = mod.split(".")
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
            and (n.module or "").split(".")[0] == "kwng"
        ):
            for a in n.names:
                yield n.lineno, n.module, a.name, a.asname or a.name
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("kwng.") and a.asname:
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
        if m.startswith(("kwng.theory", "kwng.plots", "kwng.experiments"))
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
            if target in MODULES and target != m and target != "kwng":
                edges[m].add(target)
    return edges


def test_imports_only_go_down_and_never_in_a_circle():
    edges = _edges()
    upward = [
        f"{a} -> {b}"
        for a, bs in edges.items()
        for b in bs
        if _floor(b) > _floor(a) and a != "kwng"
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
        if m != "kwng":
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
                     if m not in documented)
    assert not missing, f"the API pages (book/api*.md) lack: {missing}"


def test_every_all_lists_only_what_its_module_defines():
    """No ``__all__`` hands on a name defined elsewhere (the package face excepted)."""
    bad = {}
    for m in MODULES:
        if m == "kwng":
            continue
        for n in _tree(m).body:
            is_assign = isinstance(n, ast.Assign)
            target = getattr(n.targets[0], "id", "") if is_assign else ""
            if target == "__all__":
                names = set(ast.literal_eval(n.value)) - _defines(m)
                if names:
                    bad[m] = sorted(names)
    assert not bad, f"__all__ names defined elsewhere: {bad}"
