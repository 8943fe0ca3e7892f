"""Each rule of the claims ledger says when it was set: the dates and commits of
``studies.claims.rules.RULES`` against ``git log``, and the ledger quoting
them."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from studies.claims import rules as claim_rules

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return out.splitlines()


def _minute(iso: str) -> str:
    return datetime.fromisoformat(iso).astimezone(timezone.utc).strftime(
        "%Y-%m-%d %H:%M")


@pytest.fixture(scope="module")
def history():
    if not (ROOT / ".git").exists():
        pytest.skip("no git history in this copy")
    if _git("rev-parse", "--is-shallow-repository") == ["true"]:
        pytest.skip("a shallow clone lacks the rules' first commits")


@pytest.mark.parametrize("name", sorted(claim_rules.RULES))
def test_a_rules_date_is_its_first_commit_and_its_records_dates_are_gits(history,
                                                                         name):
    r = claim_rules.RULES[name]
    first = _git("log", f"-S{r['marker']}", "--reverse", "--format=%H %cI", "--",
                 r["source"])
    assert first, f"{name}: {r['marker']!r} never appears in {r['source']}"
    commit, when = first[0].split()
    assert commit.startswith(r["commit"]) and _minute(when) == r["set"], name
    added = _git("log", "--diff-filter=A", "--format=%cI", "--", *r["records"])
    assert added, f"{name}: no record under {r['records']}"
    assert _minute(added[0]) == r["last_record"], name
    assert _minute(added[-1]) == r["first_record"], name


def test_rule_when_places_the_rule_against_its_runs():
    words = {k: claim_rules.rule_when(k).split("), ")[1].split()[0]
             for k in claim_rules.RULES}
    assert words["fig3"] == "before"  # the protocol's verdict rule
    assert words["time"] == "during"
    for k in ("kfac_drop", "momentum", "ablation", "fig1_N", "fig5", "fig2_kwng"):
        assert words[k] == "after", k


def test_the_ledger_says_when_each_rule_was_set():
    text = (ROOT / "book" / "claims.md").read_text()
    for name in claim_rules.RULES:
        assert f"cl_rule_{name}`" in text, name
    rows = [ln for ln in text.splitlines() if ln.startswith("|") and "rule" in ln]
    for ln in rows:
        for m in re.finditer(r"\(rule\b", ln):
            assert ln[m.end():].startswith(", {glue:text}`cl_rule_"), ln[:80]
