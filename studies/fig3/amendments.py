"""The amendments to the Fig. 3 protocol (book chapter :ref:`cifar-fig3`): each one is
an entry of ``results/cifar/fig3/amendments.json``, committed before the first run it
changes, with its reason (``why``) and its ``evidence``, and applied to the protocol
by :func:`studies.fig3.protocol.load_protocol` through :func:`apply_amendment`.

Two kinds, one key each:

* ``{"substitute": {old: new}}`` runs the method ``new`` wherever the protocol names
  ``old`` (its lists, windows, window sources and order);
* ``{"add": {part: [new, ...]}, "windows": {...}, "window_sources": {...}}`` adds
  methods to a part of the protocol's ``methods`` (``both``, ``ill_only``,
  ``well_only``), each with its grid window per conditioning and the window's source,
  at the end of the order; everything else (grid, split, horizon, schedule, early stop,
  extension and selection rules, seeds, verdict rule) is the protocol's. They are
  listed in ``p["added"]``: baselines beyond the paper's, whose verdicts the book
  reports beside the paper's claim, not inside it.
"""

from __future__ import annotations

from studies.kit.provenance import ResultFileError

__all__ = ["apply_amendment"]


def apply_amendment(p: dict, a: dict) -> None:
    """Apply the amendment ``a`` to the protocol ``p`` in place; raise
    :class:`~studies.kit.provenance.ResultFileError` if it names a method wrongly."""
    if ("substitute" in a) == ("add" in a):
        raise ResultFileError(f"amendment: needs one of 'substitute' or 'add', got "
                              f"keys {sorted(a)}")
    for old, new in a.get("substitute", {}).items():
        _substitute(p, old, new)
    for part, new in a.get("add", {}).items():
        _add(p, part, list(new), a.get("windows", {}), a.get("window_sources", {}))


def _substitute(p: dict, old: str, new: str) -> None:
    if old not in p["order"] or new in p["order"]:
        raise ResultFileError(f"amendment: {old!r} must be a method of the protocol "
                              f"and {new!r} not yet one")
    for part, ms in p["methods"].items():
        p["methods"][part] = [new if m == old else m for m in ms]
    p["order"] = [new if m == old else m for m in p["order"]]
    for table in ("windows", "window_sources"):
        p[table] = {(k.split("/")[0] + "/" + new if k.split("/")[1] == old else k): v
                    for k, v in p[table].items()}


def _add(p: dict, part: str, new: list[str], windows: dict, sources: dict) -> None:
    if part not in ("both", "ill_only", "well_only"):
        raise ResultFileError(f"amendment: adds to 'both', 'ill_only' or 'well_only', "
                              f"got {part!r}")
    old = [m for m in new if m in p["order"]]
    if old or len(set(new)) != len(new):
        raise ResultFileError(f"amendment: adds only new methods, once each; "
                              f"{sorted(set(old))} are already in the protocol")
    conds = p["conditionings"] if part == "both" else [part.split("_")[0]]
    keys = {f"{c}/{m}" for c in conds for m in new}
    for name, table in (("windows", windows), ("window_sources", sources)):
        missing = sorted(keys - set(table))
        if missing:
            raise ResultFileError(f"amendment: no {name} for {missing}")
        p[name].update({k: table[k] for k in sorted(keys)})
    p["methods"][part] = list(p["methods"].get(part, [])) + new
    p["order"] = list(p["order"]) + new
    p["added"] = list(p.get("added", [])) + new
