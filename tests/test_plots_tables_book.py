"""The chapter-table helpers of the studies' table modules reject input that is not
the record
they read, naming the argument."""

from __future__ import annotations

import pytest

from studies.bench import figures as bench
from studies.claim_suite import figures as claim_suite
from studies.fisher import tables as fisher_tables
from studies.study6 import figures as six_epoch


def test_selection_rule_needs_the_stored_rule():
    with pytest.raises(ValueError, match="selected"):
        claim_suite.selection_rule({})
    rule = "first.\n\nPick :func:`~kwng.a.b`   by\nheld-out accuracy."
    expected = "Pick `kwng.a.b` by held-out accuracy."
    assert claim_suite.selection_rule({"rule": rule}) == expected


def test_verdict_word_reads_three_states():
    assert [claim_suite.verdict_word(h) for h in (True, False, None)] == [
        "holds", "does not hold", "is undecided"]


def test_fisher_tables_need_rows():
    with pytest.raises(ValueError, match="rows"):
        fisher_tables.convergence([])


def test_bench_tables_name_the_record():
    with pytest.raises(ValueError, match="record"):
        bench.exactness_table({"rows": []})
    with pytest.raises(ValueError, match="record"):
        bench.step_table({})


def test_step_time_table_needs_sgd():
    with pytest.raises(ValueError, match="timing"):
        six_epoch.step_time_table({}, {"methods": {}})
