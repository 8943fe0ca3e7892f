"""Tables of the GPU benchmarks for the appendix :ref:`gpu-internals`: the step-cost
table of :mod:`kwng.experiments.bench.step_cost`, two such tables of one machine side
by side (:func:`compare_steps`), and the verdicts of
:mod:`kwng.experiments.bench.engine_parts` on the hand-written kernels
(:func:`kernel_verdicts`). Each takes the parsed JSON record and returns ``(header,
rows)`` for :func:`kwng.plots.tables.markdown_table`, or a dict.
"""

from __future__ import annotations

__all__ = ["step_key", "step_rows", "compare_steps", "kernel_verdicts", "path_rows"]

#: the order of the precisions and memory formats in the tables
_ORDER = {"fp32": 0, "bf16_autocast": 1, "nchw": 0, "channels_last": 1}


def step_key(row: dict) -> tuple:
    """``(precision, memory format, mode, M)`` of a step-cost row (``M`` ``None`` for
    the rows without a basis)."""
    return (row["precision"], row["memory_format"], row["mode"], row.get("num_basis"))


def _sort(key: tuple) -> tuple:
    prec, fmt, mode, M = key
    return (_ORDER.get(prec, 9), _ORDER.get(fmt, 9), mode != "sgd", M or 0, mode)


def step_rows(record: dict) -> dict[tuple, dict]:
    """The rows of a step-cost record by :func:`step_key`."""
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise ValueError("record must be a step-cost record (a dict with a 'rows' "
                         "list)")
    return {step_key(r): r for r in record["rows"]}


def compare_steps(before: dict, after: dict) -> tuple[list[str], list[tuple]]:
    """Every step of both records: ms before, ms after and ``after / before`` (the
    records should come from one machine in one run: the ratio is then the code's)."""
    b, a = step_rows(before), step_rows(after)
    rows = [(k[2], k[0], k[1], k[3] or "–", f"{b[k]['median_ms']:.2f}",
             f"{a[k]['median_ms']:.2f}", f"{a[k]['median_ms'] / b[k]['median_ms']:.3f}")
            for k in sorted(set(a) & set(b), key=_sort)]
    header = ["step", "precision", "format", "M", "ms before", "ms after",
              "after / before"]
    return header, rows


def kernel_verdicts(parts: dict) -> tuple[list[str], list[tuple]]:
    """Per part of the fast step with a hand-written kernel: ms a step eager, compiled
    and as the kernel, the compiled form's excess, the rule's allowance and the
    verdict (``parts``: the record of :mod:`kwng.experiments.bench.engine_parts`)."""
    rows = []
    entries = [(dt, name, v) for dt in ("float32", "bfloat16")
               for name, v in parts["parts"][dt].items()]
    entries.append(("float32", "direction", parts["parts"]["direction"]))
    for dt, name, v in entries:
        verdict = v.get("verdict")
        if verdict is None:
            continue
        ms = v["ms"]
        rows.append((name, dt, f"{ms['eager']:.2f}", f"{ms['compile']:.2f}",
                     f"{ms['triton']:.2f}", f"{verdict['compile_minus_triton_ms']:.2f}",
                     f"{verdict['allowed_ms']:.2f}",
                     "kernel kept" if verdict["keep_kernel"] else "kernel deleted"))
    return ["part", "dtype", "eager ms", "compiled ms", "kernel ms", "excess ms",
            "allowed ms", "verdict"], rows


def path_rows(record: dict) -> dict[tuple, float]:
    """The captured step's ms by ``(precision, GPU path)`` from a step-cost record timed
    on both paths (``--gpu-paths triton,compile``)."""
    return {(r["precision"], r["gpu_path"]): r["median_ms"] for r in record["rows"]
            if r.get("gpu_path") and r["mode"] == "kwng_fast_graph"}
