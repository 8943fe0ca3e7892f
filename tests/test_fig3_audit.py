"""The Fig. 3 record audited: the early-stop rule evaluated as written, live (a
sibling's later epochs count once they exist) and post hoc over the committed
records."""

from __future__ import annotations

from pathlib import Path

from kwng.experiments.cifar import fig3

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
P = fig3.load_protocol(FIG3 / "protocol.json")


def _row(e: int, acc: float) -> dict:
    return {"epoch": e, "train_loss": 1.0, "val_acc": acc}


def test_live_rule_reads_a_slower_siblings_later_epochs():
    """A run 30 points behind at epoch 30 that trains faster than its sibling: when its
    epoch 35 ends the sibling has reached epoch 31 only. The latest-row comparison
    sees nothing; the run's earlier epochs against the sibling's rows stop it."""
    rows = [_row(e, 0.30) for e in range(1, 36)]
    sib = {"lr1": [_row(e, 0.60) for e in range(1, 32)]}
    assert fig3.stop_reason(rows[-1], sib, 10) is None
    got = fig3.stop_reason(rows[-1], sib, 10, rows=rows)
    assert got["reason"] == "behind" and got["epoch"] == 35
    assert got["compared_at"] == 30 and got["sibling"] == "lr1"
    # 24 points behind at every shared epoch: it goes on
    close = {"lr1": [_row(e, 0.54) for e in range(1, 32)]}
    assert fig3.stop_reason(rows[-1], close, 10, rows=rows) is None
    # epochs before 30 never count, however far behind
    early = {"lr1": [_row(e, 0.99) for e in range(1, 30)]}
    assert fig3.stop_reason(rows[-1], early, 10, rows=rows) is None


def test_posthoc_rule_condemns_the_three_runs_that_ran_on():
    post = fig3.posthoc_stops(P, FIG3)
    ran_on = {k: v["posthoc"] for k, v in post.items()
              if v["posthoc"] and not v["live"]}
    assert {k: (v["reason"], v["epoch"], v["sibling"]) for k, v in ran_on.items()} == {
        "ill/sgd/lr10": ("behind", 40, "lr1"),
        "ill/sgd_momentum/lr1": ("behind", 31, "lr0.1"),
        "ill/ekfac_s10/lr10": ("behind", 30, "lr1")}
    for v in ran_on.values():
        assert v["sibling_val_acc"] - v["val_acc"] >= fig3.GAP
    # every run stopped live is condemned post hoc, for the same reason
    live = {k: v for k, v in post.items() if v["live"]}
    assert len(live) == 3
    for v in live.values():
        assert v["posthoc"] and v["posthoc"]["reason"] == v["live"]["reason"]
        assert v["posthoc"]["epoch"] <= v["live"]["epoch"]


def test_no_run_the_rule_condemns_is_a_selected_step():
    state = fig3.grid_state(P, FIG3)
    for k, v in fig3.posthoc_stops(P, FIG3).items():
        cond, m, lr = k.split("/")
        if v["posthoc"]:
            assert f"lr{state[f'{cond}/{m}']['selected']:g}" != lr, k
