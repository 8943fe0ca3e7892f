"""Lists of names in running text, as the book's glued sentences write them."""

from __future__ import annotations

__all__ = ["name_list"]


def name_list(names: list[str]) -> str:
    """Names in running text: "A", "A and B", "A, B and C"; "none" for no names."""
    if not names:
        return "none"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
