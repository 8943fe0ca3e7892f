"""Dispatch ``python -m studies <name> ...`` to the module that implements
``name``."""

from __future__ import annotations

import importlib
import sys

from studies import EXPERIMENTS, PURPOSES, load_all


def usage() -> str:
    """The help text: each experiment with what it is for."""
    width = max(map(len, EXPERIMENTS))
    rows = [f"  {name:<{width}}  {PURPOSES[name]}" for name in EXPERIMENTS]
    return ("usage: python -m studies <name> [options]   "
            "(python -m studies <name> --help: its options)\n\n"
            "experiments:\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name = argv[0]
    if name not in EXPERIMENTS:
        print(
            f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}",
            file=sys.stderr,
        )
        return 2
    load_all()  # every study registers its plans, checks and early-stop rule
    module = importlib.import_module(EXPERIMENTS[name])
    try:
        return int(module.main([name] + argv[1:]) or 0)
    except (ValueError, FileNotFoundError) as exc:  # a setting or a file: one line
        print(f"python -m studies {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
