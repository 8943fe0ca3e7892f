"""The scaling record of :mod:`studies.bench.ddp_scaling`: :func:`merge` makes
one record from the per-``W`` files, with the weak-scaling efficiency of every row and
the summary the scaling target reads; :func:`check_scaling` audits its shape and
provenance and :func:`load_scaling` reads the committed one (book chapter
:ref:`distributed`; ``None`` when it does not exist, never an error)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from kwng.scale_switch import REPO_ROOT
from studies.bench.ddp_scaling import CAPTURES, PLAIN, PRECISIONS, SCALING_METHODS
from studies.kit import paths
from studies.kit.guard import write_json_guarded
from studies.kit.provenance import make_provenance, read_json

__all__ = ["merge", "TARGET_POINTS", "SCALING_PATH", "check_scaling", "load_scaling"]

#: the scaling target in points (KWNG's efficiency at most this far below SGD's)
TARGET_POINTS = 10.0


def _family(method: str) -> str:
    return "kwng" if method.startswith("kwng") else "sgd"


def _rows_with_efficiency(recs: list[dict]) -> list[dict]:
    """Every row of every part with its ``world_size``, ``efficiency`` against the
    one-GPU plain row of its family and its all-reduce share."""
    base = {(_family(r["method"]), r["precision"], r["capture"]): r["median_ms"]
            for rec in recs if rec["world_size"] == 1 for r in rec["rows"]
            if r["method"] in PLAIN.values()}
    rows = []
    for rec in recs:
        coll = rec.get("collectives", {})
        for r in rec["rows"]:
            fam = _family(r["method"])
            t1 = base.get((fam, r["precision"], r["capture"]))
            ar = coll.get(f"allreduce_{fam}", {}).get("median_ms")
            plain = r["method"] in PLAIN.values()
            eff = None if plain or t1 is None else t1 / r["median_ms"]
            rows.append({**r, "world_size": rec["world_size"],
                         "global_batch": rec["global_batch"], "efficiency": eff,
                         "allreduce_ms": None if plain else ar,
                         "allreduce_share": None if plain or ar is None
                         else ar / r["median_ms"]})
    return rows


def _summary(rows: list[dict], top: int) -> list[dict]:
    """Both efficiencies at the largest ``W``, their gap in points and the target."""
    summary = []
    for precision in PRECISIONS:
        for capture in CAPTURES:
            eff = {r["method"]: r["efficiency"] for r in rows if r["world_size"] == top
                   and r["precision"] == precision and r["capture"] == capture}
            if eff.get("sgd_ddp") is None or eff.get("kwng") is None:
                continue
            gap = 100 * (eff["sgd_ddp"] - eff["kwng"])
            summary.append({"world_size": top, "precision": precision,
                            "capture": capture, "efficiency_sgd": eff["sgd_ddp"],
                            "efficiency_kwng": eff["kwng"],
                            "gap_points": gap,
                            "within_target": gap <= TARGET_POINTS})
    return summary


def merge(parts: list[str | os.PathLike]) -> dict:
    """One record from the per-``W`` files: every row with ``world_size``,
    ``efficiency`` (``t_plain(W=1) / t``, same method family, precision and capture;
    ``None`` for the plain rows themselves) and ``allreduce_share`` (the step's
    all-reduce timed alone ÷ the step), the collectives per ``W``, and a ``summary`` at
    the largest ``W``: both efficiencies, their gap in points and whether KWNG is within
    10 points of SGD (the scaling target)."""
    recs = sorted((read_json(p) for p in parts), key=lambda r: r["world_size"])
    sizes = [r["world_size"] for r in recs]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"the parts must have distinct world sizes, got {sizes}")
    for key in ("model", "per_rank_batch", "num_basis", "q"):
        if len({r[key] for r in recs}) != 1:
            raise ValueError(f"the parts disagree on {key}: {[r[key] for r in recs]}")
    rows = _rows_with_efficiency(recs)
    top = max(sizes)
    summary = _summary(rows, top)
    first = recs[0]
    prov = make_provenance(
        {"parts": [str(p) for p in parts],
         "part_configs": {r["world_size"]: r["provenance"]["config"] for r in recs}},
        seeds={r["world_size"]: r["provenance"]["seeds"] for r in recs},
        device=None, devices={r["world_size"]: r["devices"] for r in recs},
        driver=os.environ.get("KWNG_DDP_DRIVER"),
        part_commands={r["world_size"]: r["provenance"]["command"] for r in recs},
        part_dates={r["world_size"]: r["provenance"]["date"] for r in recs},
        wall_time_s=sum(r["provenance"].get("wall_time_s") or 0.0 for r in recs))
    prov["device"] = f"{top} × {recs[-1]['devices'][0]}"
    return {"benchmark": "ddp_scaling", "methods": list(SCALING_METHODS),
            "model": first["model"], "q": first["q"],
            "per_rank_batch": first["per_rank_batch"], "num_basis": first["num_basis"],
            "world_sizes": sizes, "rows": rows,
            "collectives": {r["world_size"]: r.get("collectives") for r in recs},
            "capture_fallbacks": {r["world_size"]: r["capture_fallbacks"]
                                  for r in recs},
            "summary": summary, "provenance": prov}


#: the committed record, ``results/benchmarks/ddp_scaling.json`` (written on a 4-GPU
#: machine, copied here)
#:
#: :meta hide-value:
SCALING_PATH = REPO_ROOT / paths.RESULTS / "benchmarks" / "ddp_scaling.json"


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
    if record.get("methods") != list(SCALING_METHODS):
        raise _bad(where, f"methods must be {list(SCALING_METHODS)}, "
                   f"got {record.get('methods')!r}")
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
        for m in (*SCALING_METHODS, *(PLAIN.values() if W == 1 else ())):
            for p in precisions:
                for c in captures:
                    r = key.get((W, m, p, c))
                    if r is None:
                        raise _bad(where, f"no row for W={W} {m} {p} {c}")
                    t = r.get("median_ms")
                    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                        raise _bad(where, f"W={W} {m} {p} {c}: median_ms {t!r}")
                    if m in SCALING_METHODS:
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


def main(argv: list[str] | None = None) -> dict:
    """``python -m studies.bench.ddp_record PART... --out FILE [--force]``:
    merge the per-``W`` files into one record (never replacing a different file unless
    ``--force``, which moves it to a dated backup)."""
    p = argparse.ArgumentParser(prog="python -m studies.bench.ddp_record",
                                description="merge the per-W files of ddp_scaling")
    p.add_argument("parts", nargs="+", help="the per-W files")
    p.add_argument("--out", required=True, help="the merged record")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    record = merge(args.parts)
    write_json_guarded(args.out, record, args.force)
    print(f"wrote {args.out} ({len(record['rows'])} rows)")
    return record


if __name__ == "__main__":
    main()
