"""Tables of the GPU benchmarks for the appendix :ref:`gpu-internals`: the exactness
record of the fast path (:func:`exactness_table`), the step-cost table of
:mod:`studies.bench.step_cost` (:func:`step_table`), two such tables of one
machine side by side (:func:`compare_steps`), the verdicts of
:mod:`studies.bench.engine_parts` on the hand-written kernels
(:func:`kernel_verdicts`) and the amortized step's costs (:func:`amortized_table`). Each
takes the parsed JSON record and returns ``(header, rows)`` for
:func:`studies.kit.tables.markdown_table`, or a dict; the ``*_values`` functions return
the numbers the appendix quotes, ``{name: value}`` under the names it glues them by.
"""

from __future__ import annotations

import re

__all__ = ["step_key", "step_rows", "compare_steps", "kernel_verdicts", "path_rows",
           "exactness_table", "exactness_values", "step_table", "step_values",
           "amortized_table", "amortized_values", "REUSE_PARTS", "reuse_breakdown"]

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
    verdict (``parts``: the record of :mod:`studies.bench.engine_parts`)."""
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


def _rel_errors(record: dict) -> dict:
    if not isinstance(record, dict) or not isinstance(record.get("results"), dict):
        raise ValueError("record must be an exactness record (a dict with a 'results' "
                         "dict)")
    return record["results"]


def exactness_table(record: dict) -> tuple[list[str], list[tuple]]:
    """Every relative error of the exactness record (``precond_exactness.json``) per
    configuration, the plain-autograd and direction rows left out."""
    rows = [(name, k.removeprefix("rel_err_"), f"{v:.1e}")
            for name, r in _rel_errors(record).items() for k, v in r.items()
            if k.startswith("rel_err") and "plain" not in k and "direction" not in k]
    return ["configuration", "quantity", "rel. error"], rows


def exactness_values(record: dict) -> dict[str, float]:
    """``gpu_T_f64`` (fast against serial ``T`` in float64), ``gpu_T_fp32_hi`` (the
    larger in fp32), ``gpu_T_serial32`` (serial fp32 against float64), and
    ``gpu_g_bf16`` and ``gpu_g_bf16_plain`` (bf16 gradients, percent)."""
    res = _rel_errors(record)
    f64, bf = res["float64"], res["bf16_channels_last"]
    return {
        "gpu_T_f64": f64["rel_err_T_fast_vs_serial_fp64"],
        "gpu_T_fp32_hi": max(res[c]["rel_err_T"]
                             for c in ("fp32_nchw", "fp32_channels_last")),
        "gpu_T_serial32": f64["rel_err_T_serial_fp32_vs_fp64"],
        "gpu_g_bf16": 100 * bf["rel_err_g"],
        "gpu_g_bf16_plain": 100 * bf["rel_err_g_plain_autograd_same_config"],
    }


def step_table(record: dict) -> tuple[list[str], list[tuple]]:
    """Every step of a step-cost record: ms per step and multiples of the eager SGD step
    of its configuration, by precision, format, SGD first, then ``M`` and mode."""
    rows = sorted(step_rows(record).items(), key=lambda kv: (
        kv[0][0], kv[0][1], kv[0][2] != "sgd", kv[0][3] or 0, kv[0][2]))
    table = [(mode, prec, fmt, M or "–", f"{r['median_ms']:.1f}",
              f"{r['ratio_to_sgd']:.2f}") for (prec, fmt, mode, M), r in rows]
    return ["step", "precision", "format", "M", "ms", "× SGD"], table


def step_values(record: dict, num_basis: int = 5) -> dict[str, float]:
    """For bf16 channels-last, fp32 channels-last and fp32 NCHW, ``gpu_<tag>_<key>``:
    the captured KWNG step (``graph``), its limit ``fwd_bwd_RN`` (``limit``), their
    ratios to each other and to SGD eager and captured, SGD's steps and the eager KWNG
    step (ms, ``num_basis`` columns); ``gpu_M20_<mode>``: the captured and reference
    steps at ``M`` = 20 (bf16 channels-last)."""
    rows = step_rows(record)

    def ms(prec, fmt, mode, M=num_basis):
        return rows[(prec, fmt, mode, None if mode.startswith("sgd") else M)][
            "median_ms"]

    out = {}
    for prec, fmt, tag in [("bf16_autocast", "channels_last", "bf16_channels_last"),
                           ("fp32", "channels_last", "fp32_channels_last"),
                           ("fp32", "nchw", "fp32_nchw")]:
        g, lim = ms(prec, fmt, "kwng_fast_graph"), ms(prec, fmt, "fwd_bwd_RN")
        sgd, sgd_g = ms(prec, fmt, "sgd"), ms(prec, fmt, "sgd_graph")
        out |= {f"gpu_{tag}_{key}": value for key, value in {
            "graph": g, "limit": lim, "per_limit": g / lim, "per_sgd": g / sgd,
            "per_sgd_graph": g / sgd_g, "limit_per_sgd": lim / sgd, "sgd": sgd,
            "sgd_graph": sgd_g, "eager": ms(prec, fmt, "kwng_fast")}.items()}
    for mode in ("kwng_fast_graph", "kwng_reference"):
        out[f"gpu_M20_{mode}"] = ms("bf16_autocast", "channels_last", mode, 20)
    return out


def _sgd_graph(record: dict) -> dict[str, dict]:
    return {r["precision"]: r for r in record["rows"] if r["mode"] == "sgd_graph"}


def amortized_table(record: dict) -> tuple[list[str], list[tuple]]:
    """Every step of the amortized step-cost record but eager SGD: ms median and mean,
    and the mean over the captured SGD step of its precision."""
    sgd_g = _sgd_graph(record)
    rows = [(r["precision"], r["mode"], r.get("refresh_every") or "–",
             f"{r['median_ms']:.2f}", f"{r['mean_ms']:.2f}",
             f"{r['mean_ms'] / sgd_g[r['precision']]['mean_ms']:.2f}")
            for r in record["rows"] if r["mode"] != "sgd"]
    return ["precision", "captured step", "k", "median ms", "mean ms",
            "mean / SGD"], rows


def _bf16_ratios(record: dict) -> dict[tuple, float]:
    base = _sgd_graph(record)["bf16_autocast"]["mean_ms"]
    return {(r["mode"], r["refresh_every"]): r["mean_ms"] / base for r in record["rows"]
            if r["precision"] == "bf16_autocast" and r.get("refresh_every")}


def amortized_values(record: dict, earlier: dict) -> dict[str, str]:
    """Formatted to two decimals: ``am_<prec>_k<k>`` (the captured amortized KWNG step
    over captured SGD, mean, for ``k`` = 1, 5, 20, 100), ``am_<prec>_reuse`` and
    ``am_<prec>_sgd`` (median ms at ``k`` = 100 and of captured SGD),
    ``am_<prec>_reuse_ratio`` (the first over the second), and
    ``am_old_diff``: the largest change of a bf16 ratio from the ``earlier`` record."""
    sgd_g, out = _sgd_graph(record), {}
    for prec, tag in (("bf16_autocast", "bf16"), ("fp32", "fp32")):
        kw = {r["refresh_every"]: r for r in record["rows"]
              if r["mode"] == "kwng_fast_graph" and r["precision"] == prec}
        base = sgd_g[prec]
        out |= {f"am_{tag}_k{k}": f"{kw[k]['mean_ms'] / base['mean_ms']:.2f}"
                for k in (1, 5, 20, 100)}
        out[f"am_{tag}_reuse"] = f"{kw[100]['median_ms']:.2f}"
        out[f"am_{tag}_sgd"] = f"{base['median_ms']:.2f}"
        out[f"am_{tag}_reuse_ratio"] = f"{kw[100]['median_ms'] / base['median_ms']:.2f}"
    new_r, old_r = _bf16_ratios(record), _bf16_ratios(earlier)
    return out | {"am_old_diff": f"{max(abs(new_r[k] - old_r[k]) for k in old_r):.2f}"}


#: the parts of a reuse step's kernel time beyond SGD's (:func:`reuse_breakdown`), each
#: a name and the regular expression its kernels' names match (first match wins)
REUSE_PARTS = (
    ("the four passes over the cached T (Triton: norms, system, direction, write)",
     r"^_(norms|system|raw|write)_kernel$"),
    ("flattening g into one vector (torch.cat)", r"CatArrayBatchedCopy"),
    ("the M × M solve (float64 LU)", r"getrf|getrs|trsm|potrf"),
)


def reuse_breakdown(record: dict, config: str = "bf16_channels_last"
                    ) -> tuple[tuple[str, ...], list[tuple], dict[str, str]]:
    """A ``profile_step --refresh-every`` record read as where a reuse step's kernel
    time goes beyond an SGD step's: ``(header, rows, values)`` with one row per part of
    :data:`REUSE_PARTS` (its microseconds a step and share of the excess), the rest
    of the excess, the excess and both totals; ``values``: ``rp_sgd``, ``rp_reuse``
    (ms a step), ``rp_ratio``, ``rp_excess`` (µs), ``rp_target`` (the µs a reuse step
    must lose to cost 1.25 SGD steps), ``rp_<i>`` (µs of part ``i``) and
    ``rp_norms_kernel``, ``rp_system_kernel`` (µs of those two passes) and ``rp_bound``
    (their sum with the flattening's: the most that caching them and a flat gradient
    buffer could remove)."""
    rows = {r["mode"]: r for r in record["rows"] if r["config"] == config}
    sgd, kw = rows["sgd"], rows["kwng_fast"]
    excess = kw["total_us"] - sgd["total_us"]
    left = {k: v - sgd["kernels_us"].get(k, 0.0) for k, v in kw["kernels_us"].items()}
    out, values = [], {}
    for i, (name, pattern) in enumerate(REUSE_PARTS):
        us = sum(v for k, v in left.items() if re.search(pattern, k))
        left = {k: v for k, v in left.items() if not re.search(pattern, k)}
        out.append((name, f"{us:.0f}", f"{100 * us / excess:.0f} %"))
        values[f"rp_{i}"] = f"{us:.0f}"
    rest = sum(left.values())
    out += [("everything else (copies, additions, small reductions)", f"{rest:.0f}",
             f"{100 * rest / excess:.0f} %"),
            ("**beyond SGD, in all**", f"{excess:.0f}", "100 %"),
            ("an SGD step / a reuse step",
             f"{sgd['total_us']:.0f} / {kw['total_us']:.0f}", "")]
    values |= {"rp_sgd": f"{sgd['total_us'] / 1e3:.2f}",
               "rp_reuse": f"{kw['total_us'] / 1e3:.2f}",
               "rp_ratio": f"{kw['total_us'] / sgd['total_us']:.2f}",
               "rp_excess": f"{excess:.0f}",
               "rp_target": f"{kw['total_us'] - 1.25 * sgd['total_us']:.0f}",
               **{f"rp_{k.strip('_')}": f"{kw['kernels_us'].get(k, 0.0):.0f}"
                  for k in ("_norms_kernel", "_system_kernel")}}
    bound = sum(float(values[k])
                for k in ("rp_norms_kernel", "rp_system_kernel", "rp_1"))
    values["rp_bound"] = f"{bound:.0f}"
    return ("part of the reuse step", "µs a step", "share of the excess"), out, values
