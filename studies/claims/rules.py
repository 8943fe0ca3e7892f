"""When each rule of the claims ledger (book chapter :ref:`claims`) was set: the
commit that first holds it, against the commits that added the records it decides."""

from __future__ import annotations

__all__ = ["RULES", "rule_when"]

_FIG3 = "results/cifar/fig3"
_SEEDED = (f"{_FIG3}/grid", f"{_FIG3}/seeds")


def _runs_of(*tails: str) -> tuple[str, ...]:
    """Git pathspecs of the Fig. 3 grid and seed records whose path ends in one of
    ``tails`` (``"ill/kfac"``, ``"*/kfac"``)."""
    return tuple(f":(glob){part}/*/cifar10/{t}/**" for part in _SEEDED for t in tails)


#: Every rule the ledger applies, and when it was set. ``marker`` is a phrase of the
#: rule's first wording in ``source``; ``records`` are git pathspecs of the records it
#: decides. ``commit`` and ``set`` are the first commit holding ``marker`` and its
#: date, ``first_record`` and ``last_record`` the dates of the first and the last
#: commit adding one of ``records`` (UTC, to the minute): the rule was set before,
#: during or after its runs (:func:`rule_when`). ``tests/test_claims_rules.py`` reads
#: them again from ``git log``.
#:
#: :meta hide-value:
RULES: dict[str, dict] = {
    "fig1_N": {"source": "book/claims.md",
               "marker": "the mean error falls at every $d$",
               "records": ("results/relerr",), "commit": "0131930",
               "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
               "last_record": "2026-11-26 01:48"},
    "fig1_d": {"source": "book/claims.md",
               "marker": "the median error varies by at most 2×",
               "records": ("results/relerr",), "commit": "0131930",
               "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
               "last_record": "2026-11-26 01:48"},
    "fig1_M": {"source": "book/claims.md", "marker": "a threshold inside the grid at",
               "records": ("results/relerr",), "commit": "0131930",
               "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
               "last_record": "2026-11-26 01:48"},
    "fig4": {"source": "book/claims.md",
             "marker": "the error falls with $N$ and its mean stays below 1",
             "records": ("results/relerr",), "commit": "0131930",
             "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
             "last_record": "2026-11-26 01:48"},
    "fig5": {"source": "book/claims.md",
             "marker": "the mean error stays within 2× of its best",
             "records": ("results/bandwidth",), "commit": "0131930",
             "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
             "last_record": "2026-11-26 01:48"},
    "fig2_wng": {"source": "book/claims.md", "marker": "WNG ends below EG",
                 "records": ("results/flow",), "commit": "0131930",
                 "set": "2026-11-27 07:21", "first_record": "2026-11-26 01:48",
                 "last_record": "2026-11-26 01:48"},
    "fig2_kwng": {"source": "book/claims.md",
                  "marker": "the KWNG runs that never diverge",
                  "records": ("results/flow", "results/flow_study"),
                  "commit": "0131930", "set": "2026-11-27 07:21",
                  "first_record": "2026-11-26 01:48",
                  "last_record": "2026-11-26 07:50"},
    "fig3": {"source": f"{_FIG3}/protocol.json", "marker": "verdict_rule",
             "records": _SEEDED, "commit": "2aff154", "set": "2026-11-27 06:36",
             "first_record": "2026-11-27 07:10", "last_record": "2026-11-29 19:10"},
    "kfac_drop": {"source": "book/claims.md",
                  "marker": "its drop from WC to IC exceeds its seed spread",
                  "records": _runs_of("*/kfac"), "commit": "2ba0ac9",
                  "set": "2026-11-27 18:24", "first_record": "2026-11-27 13:02",
                  "last_record": "2026-11-27 18:21"},
    "momentum": {"source": "book/claims.md",
                 "marker": "momentum's mean ends above KWNG's",
                 "records": _runs_of("well/kwng_mom", "well/kwng"),
                 "commit": "77626b7", "set": "2026-11-27 21:16",
                 "first_record": "2026-11-27 10:05", "last_record": "2026-11-27 21:01"},
    "time": {"source": "book/claims.md",
             "marker": "reaches 85 % test accuracy in fewer training seconds",
             "records": (f"{_FIG3}/timing", *_runs_of("ill/*")), "commit": "77626b7",
             "set": "2026-11-27 21:16", "first_record": "2026-11-27 07:10",
             "last_record": "2026-11-29 19:10"},
    "ablation": {"source": "book/claims.md",
                 "marker": "each variant's mean ends below KWNG's by more than",
                 "records": (f"{_FIG3}/ablation", *_runs_of("ill/kwng")),
                 "commit": "2ba0ac9", "set": "2026-11-27 18:24",
                 "first_record": "2026-11-27 07:10", "last_record": "2026-11-27 18:12"},
    "ablation_unstable": {
        "source": "book/claims.md", "marker": "is unstable, not below",
        "records": (f"{_FIG3}/ablation", *(
            f"results/cifar/amortized_seeds/lr10/cifar10/ill/{m}" for m in (
                "kwng_D_identity", "kwng_D_T", "kwng_diag_T", "diag_Ttilde",
                "kwng_kernel_rq"))),
        "commit": "5dc81bc", "set": "2026-11-29 19:16",
        "first_record": "2026-11-27 15:25", "last_record": "2026-11-29 19:10"},
}


def rule_when(name: str) -> str:
    """When the ledger's rule ``name`` (:data:`RULES`) was set, in words: "set
    2026-11-27 18:24 (2ba0ac9), after its runs (last record 2026-11-27 18:21)"; before
    its first record, during its runs, or after its last one."""
    r = RULES[name]
    if r["set"] < r["first_record"]:
        rel = f"before its runs (first record {r['first_record']})"
    elif r["set"] > r["last_record"]:
        rel = f"after its runs (last record {r['last_record']})"
    else:
        rel = (f"during its runs (records from {r['first_record']} to "
               f"{r['last_record']})")
    return f"set {r['set']} ({r['commit']}), {rel}"
