"""The Fig. 3 protocol's time-to-accuracy table, as the chapter shows and quotes it.

:func:`tta_table` turns :func:`studies.fig3.clocks.seconds_to_accuracy`
into a Markdown table, :func:`tta_values` into the named numbers the prose glues.
"""

from __future__ import annotations

from studies.cifar.methods import METHODS
from studies.kit.tables import markdown_table
from studies.kit.wording import fixed, name_list

__all__ = ["TTA_HEADER", "TTA_ANSWER", "tta_table", "tta_values", "threshold_table"]

#: the columns of :func:`tta_table`, the answers (:data:`TTA_ANSWER`) first after the
#: row's name, so that a phone shows them without scrolling the table
TTA_HEADER = ("cond.", "method", "s to 85 %", "epochs to 85 %", "s to 80 %",
              "s / epoch", "step", "runs")
#: the columns of :data:`TTA_HEADER` that answer the time question
TTA_ANSWER = ("s to 85 %", "epochs to 85 %")


def _sec(v: float | None) -> str:
    return "never" if v is None else fixed(v, 0)


def _epochs(v: float | None) -> str:
    return "never" if v is None else fixed(v)


def tta_table(tta: dict[str, dict]) -> str:
    """One row per ``"<conditioning>/<method>"`` of ``tta``: its step (marked "not
    final" while its selection is not), runs, seconds an epoch, seconds to 80 % and
    85 % test accuracy and epochs to 85 % ("never" when a run did not get there)."""
    if not isinstance(tta, dict):
        raise TypeError(f"tta must be a dict of seconds_to_accuracy, got {type(tta)}")
    rows = [(*k.split("/"), _sec(v["to"][0.85]), _epochs(v["epoch_to"][0.85]),
             _sec(v["to"][0.8]), fixed(v["s_per_epoch"], 2),
             f"{v['lr']:g}" + ("" if v["final"] else " (not final)"), v["runs"])
            for k, v in tta.items()]
    return markdown_table(TTA_HEADER, rows, align="llrrrrrr", answer=TTA_ANSWER)


def tta_values(tta: dict[str, dict]) -> dict[str, str]:
    """``tta_<cond>_<method>_80`` and ``_85`` (seconds), ``tta_ep_<cond>_<method>``
    (epochs to 85 %) and ``tta_spe_<cond>_<method>`` (seconds an epoch), as text, and
    ``tta_never80_<cond>``: the methods (labels) whose runs never reach 80 % there."""
    out, never = {}, {}
    for k, v in tta.items():
        cond, m = k.split("/")
        never.setdefault(cond, [])
        if v["to"][0.8] is None:
            never[cond].append(METHODS[m].label)
        name = k.replace("/", "_")
        for t in (0.8, 0.85):
            out[f"tta_{name}_{round(100 * t)}"] = _sec(v["to"][t])
        out[f"tta_ep_{name}"] = _epochs(v["epoch_to"][0.85])
        out[f"tta_spe_{name}"] = fixed(v["s_per_epoch"], 2)
    out.update({f"tta_never80_{c}": name_list(ms) for c, ms in never.items()})
    return out


def threshold_table(curve: dict) -> str:
    """One row per threshold of ``curve``
    (:func:`studies.fig3.clocks.time_to_thresholds`): the seconds each
    method that reaches the lowest one needs to get there ("never" when a run did not),
    the fastest in bold."""
    ms = [m for m, v in curve["seconds"].items() if any(x is not None for x in v)]
    rows = []
    for i, t in enumerate(curve["thresholds"]):
        got = {m: curve["seconds"][m][i] for m in ms}
        best = min((v for v in got.values() if v is not None), default=None)
        rows.append((f"{t} %", *(f"**{_sec(v)}**" if v is not None and v == best
                                 else _sec(v) for v in got.values())))
    header = ("test acc. ≥", *(f"{METHODS[m].label} (s)" for m in ms))
    return markdown_table(header, rows, align="r" * len(header))
