import pytest

from studies.kit.tables import markdown_table


def test_markdown_table_layout_and_escaping():
    text = markdown_table(["method", "acc"], [["sgd", "0.9"], ["a|b", 1]])
    assert text.splitlines() == [
        "| method | acc |",
        "|:---|---:|",
        "| sgd | 0.9 |",
        r"| a\|b | 1 |",
    ]
    assert markdown_table(["x"], [], align="c").splitlines()[1] == "|:---:|"


def test_markdown_table_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one of"):
        markdown_table(["a", "b"], [], align="l")
    with pytest.raises(ValueError, match="needs 2 cells"):
        markdown_table(["a", "b"], [["only one"]])
    with pytest.raises(ValueError, match="at least one"):
        markdown_table([], [])
