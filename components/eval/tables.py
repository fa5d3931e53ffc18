"""The one markdown-table writer: the sweep's and the experiment's `results.md`, the flows' Prefect artifacts.

Callers choose the columns and how a value reads (decimals, a mark for a missing one); the writer only lays the
cells out, so every table of the project has the same shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def plain_cell(key: str, value: object) -> str:
    """A value as it prints; nothing for None (a row that lacks the column)."""
    return "" if value is None else str(value)


def markdown_table(
    rows: Sequence[Mapping[str, object]],
    columns: Mapping[str, str] | None = None,
    cell: Callable[[str, object], str] = plain_cell,
) -> str:
    """`rows` as a markdown table: a column per key of `columns`, headed by its value (by default the first row's
    keys, each heading itself), and per row the cells `cell(key, row.get(key))`. With no column to show (no rows
    and none named) the table is `_nothing_`. No trailing newline."""
    columns = columns if columns is not None else {key: key for key in (rows[0] if rows else {})}
    if not columns:
        return "_nothing_"
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(key, row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)
