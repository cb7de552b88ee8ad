"""Tables as text: every column padded to its widest cell and aligned left or right, as plain text
(a rule of dashes under the header) or as Markdown. loadgen's report and the scripts' tables are
all laid out here (the scripts import it from loadgen, which imports nothing of theirs)."""
from __future__ import annotations

from collections.abc import Sequence

LEFT, RIGHT = "<", ">"
GAP = 3  # spaces between two columns of a plain table


def aligned_rows(rows: Sequence[Sequence[str]], align: str, gap: int = GAP) -> list[str]:
    """Each row as one line, its cells padded to their column's widest cell and aligned as that
    column's character of `align` says (LEFT or RIGHT). A row shorter than `align` leaves the last
    columns empty; trailing spaces are dropped."""
    widths = [max((len(row[i]) for row in rows if i < len(row)), default=0) for i in range(len(align))]
    return [(" " * gap).join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)).rstrip() for row in rows]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str, gap: int = GAP) -> list[str]:
    """The header, a rule of dashes as wide as the widest line, then the rows (`aligned_rows`)."""
    lines = aligned_rows([header, *rows], align, gap)
    return [lines[0], "-" * max(map(len, lines)), *lines[1:]]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """A Markdown table whose cells are padded as in `aligned_rows`, so that its source lines up
    too; RIGHT columns are marked right-aligned (`---:`)."""
    widths = [max(3, *(len(row[i]) for row in [header, *rows] if i < len(row))) for i in range(len(align))]

    def line(cells: Sequence[str]) -> str:
        padded = [f"{cell:{a}{w}}" for cell, a, w in zip([*cells, *[""] * len(align)], align, widths)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if a == RIGHT else "-" * (w + 2) for a, w in zip(align, widths)) + "|"
    return [line(header), rule, *(line(row) for row in rows)]
