"""The scaling record of KWNG data-parallel, read, checked and tabulated for the book
chapter :ref:`distributed`.

:func:`load_scaling` reads what ``scripts/run_ddp_scaling.sh`` writes
(:mod:`kwng.experiments.ddp_scaling`) and checks its shape and provenance
(:func:`check_scaling`); :func:`scaling_table` and :func:`scaling_facts` turn it into
the chapter's table and the numbers its prose glues. A missing file is ``None``
everywhere (the chapter then says so), never an error.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .provenance import read_json

__all__ = ["SCALING_PATH", "check_scaling", "load_scaling", "scaling_table",
           "scaling_facts"]

#: the committed record (written on a 4-GPU machine, copied here)
SCALING_PATH = (Path(__file__).resolve().parents[1] / "results" / "benchmarks"
                / "ddp_scaling.json")
_METHODS = ("sgd_ddp", "kwng")
_PLAIN = ("sgd_plain", "kwng_plain")
_PROVENANCE = ("command", "config", "git_commit", "device", "date", "seeds")


def _bad(where: str, msg: str) -> ValueError:
    return ValueError(f"{where}: {msg}")


def check_scaling(record: Any, where: str = "ddp_scaling record") -> None:
    """Raise ``ValueError`` naming ``where`` unless ``record`` has the shape the merge
    writes: every world size with a row per method, precision and capture (the plain
    one-GPU rows at ``W = 1``), positive finite medians, efficiencies equal to
    ``t_plain(W = 1) / t`` of the same precision and capture, as many devices as ranks,
    the capture fallbacks counted, and a provenance with command, configuration, commit,
    device, date and seeds."""
    if not isinstance(record, dict) or record.get("benchmark") != "ddp_scaling":
        raise _bad(where, "not a ddp_scaling record (key 'benchmark')")
    sizes = record.get("world_sizes")
    if not isinstance(sizes, list) or 1 not in sizes or len(sizes) < 2:
        raise _bad(where, f"world_sizes must list W = 1 and more, got {sizes!r}")
    prov = record.get("provenance")
    missing = [k for k in _PROVENANCE if not isinstance(prov, dict) or k not in prov]
    if missing:
        raise _bad(where, f"provenance lacks {missing}")
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows:
        raise _bad(where, "no rows")
    key = {(r["world_size"], r["method"], r["precision"], r["capture"]): r
           for r in rows}
    if len(key) != len(rows):
        raise _bad(where, "two rows share (world_size, method, precision, capture)")
    precisions = sorted({r["precision"] for r in rows})
    captures = sorted({r["capture"] for r in rows})
    for W in sizes:
        for m in (*_METHODS, *(_PLAIN if W == 1 else ())):
            for p in precisions:
                for c in captures:
                    r = key.get((W, m, p, c))
                    if r is None:
                        raise _bad(where, f"no row for W={W} {m} {p} {c}")
                    t = r.get("median_ms")
                    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                        raise _bad(where, f"W={W} {m} {p} {c}: median_ms {t!r}")
                    if m in _METHODS:
                        plain = m.replace("_ddp", "") + "_plain"
                        t1 = key[(1, plain, p, c)]["median_ms"]
                        eff = r.get("efficiency")
                        if eff is None or abs(eff - t1 / t) > 1e-9 * (t1 / t):
                            raise _bad(where, f"W={W} {m} {p} {c}: efficiency {eff!r} "
                                       f"is not t_plain(W=1) / t = {t1 / t:.6g}")
        devices = record["provenance"].get("devices", {}).get(str(W))
        if not isinstance(devices, list) or len(devices) != W:
            raise _bad(where, f"W={W}: provenance.devices must list {W} devices")
        fell = sum(1 for r in rows if r["world_size"] == W and r["capture"] == "graph"
                   and not r["captured"])
        if record.get("capture_fallbacks", {}).get(str(W)) != fell:
            raise _bad(where, f"W={W}: capture_fallbacks is not the {fell} graph rows "
                       "timed eagerly")


def load_scaling(path: str | os.PathLike | None = None) -> dict | None:
    """The checked record at ``path`` (default :data:`SCALING_PATH`), or ``None`` when
    there is no such file."""
    path = Path(SCALING_PATH if path is None else path)
    if not path.is_file():
        return None
    record = read_json(path)
    check_scaling(record, str(path))
    return record


def _row(record: dict, W: int, method: str, precision: str, capture: str) -> dict:
    return next(r for r in record["rows"] if r["world_size"] == W
                and r["method"] == method and r["precision"] == precision
                and r["capture"] == capture)


def scaling_table(record: dict, capture: str = "graph"
                  ) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows (for :func:`kwng.tables.markdown_table`): per world
    size and precision, the step times of SGD (DDP) and KWNG, their ratio, both
    weak-scaling efficiencies and the share of KWNG's step that its all-reduce takes
    alone; ``capture`` picks the captured (``"graph"``) or eager rows. A row timed
    eagerly although asked captured is marked ``*``."""
    head = ["GPUs", "global batch", "precision", "SGD+DDP ms", "KWNG ms", "KWNG/SGD",
            "eff. SGD", "eff. KWNG", "all-reduce share"]
    rows = []
    for W in record["world_sizes"]:
        for p in sorted({r["precision"] for r in record["rows"]}, reverse=True):
            s, k = (_row(record, W, m, p, capture) for m in _METHODS)

            def ms(r):
                star = "*" if capture == "graph" and not r["captured"] else ""
                return f"{r['median_ms']:.2f}{star}"

            share = k.get("allreduce_share")
            rows.append([str(W), str(k["global_batch"]), p, ms(s), ms(k),
                         f"{k['median_ms'] / s['median_ms']:.2f}",
                         f"{100 * s['efficiency']:.0f} %",
                         f"{100 * k['efficiency']:.0f} %",
                         "" if share is None else f"{100 * share:.0f} %"])
    return head, rows


def scaling_facts(record: dict | None, precision: str = "bf16", capture: str = "graph"
                  ) -> dict[str, str]:
    """The numbers the chapter's prose quotes, as display strings (``"—"`` without a
    record): at the largest world size, for ``precision`` and ``capture``, the
    efficiencies of SGD and KWNG, their gap in points, whether the gap meets the target
    of 10 points, KWNG's all-reduce share, the world size and the devices."""
    keys = ("world_size", "devices", "eff_sgd", "eff_kwng", "gap", "target",
            "allreduce_share", "kwng_over_sgd")
    if record is None:
        return dict.fromkeys(keys, "—")
    W = max(record["world_sizes"])
    s, k = (_row(record, W, m, precision, capture) for m in _METHODS)
    gap = 100 * (s["efficiency"] - k["efficiency"])
    share = k.get("allreduce_share")
    devices = record["provenance"]["devices"][str(W)]
    return {"world_size": str(W), "devices": f"{W} × {devices[0]}",
            "eff_sgd": f"{100 * s['efficiency']:.0f} %",
            "eff_kwng": f"{100 * k['efficiency']:.0f} %", "gap": f"{gap:.0f}",
            "target": "within" if gap <= 10 else "outside",
            "allreduce_share": "—" if share is None else f"{100 * share:.0f} %",
            "kwng_over_sgd": f"{k['median_ms'] / s['median_ms']:.1f}"}
