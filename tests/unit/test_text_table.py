"""loadgen/text_table.py: columns padded to their widest cell, aligned per column."""
from __future__ import annotations

from loadgen.text_table import aligned_rows, markdown_table, text_table


def test_columns_are_as_wide_as_their_widest_cell_and_aligned() -> None:
    assert aligned_rows([["name", "n"], ["a", "100"], ["longer"]], "<>", gap=2) == [
        "name      n",
        "a       100",
        "longer",
    ]


def test_a_plain_table_has_a_rule_as_wide_as_its_widest_line() -> None:
    assert text_table(["x", "value"], [["first", "1.5"]], "<>", gap=1) == ["x     value", "-----------",
                                                                         "first   1.5"]


def test_a_markdown_table_marks_right_aligned_columns() -> None:
    assert markdown_table(["cell", "n"], [["a", "12"]], "<>") == [
        "| cell |   n |",
        "|------|----:|",
        "| a    |  12 |",
    ]
