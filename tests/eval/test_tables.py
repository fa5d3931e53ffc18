"""The one markdown-table writer: columns from the first row or named with headings, cells through the caller's
formatter, a missing value empty, and `_nothing_` when there is no column to show."""

from components.eval.tables import markdown_table, plain_cell


def test_the_first_rows_keys_are_the_columns_by_default():
    rows = [{"arm": "sao", "runs": 3, "note": None}, {"arm": "grpo"}]  # the second row lacks two columns
    assert markdown_table(rows) == "| arm | runs | note |\n|---|---|---|\n| sao | 3 |  |\n| grpo |  |  |"


def test_named_columns_choose_order_and_headings_and_the_cell_formats():
    rows = [{"p": 0.04321, "mean": 56.66, "extra": "not shown"}]

    def cell(key, value):
        return f"{value:.3f}" if key == "p" else f"{value:.1f}"

    table = markdown_table(rows, {"mean": "held-out % mean", "p": "p (Welch)"}, cell)
    assert table == "| held-out % mean | p (Welch) |\n|---|---|\n| 56.7 | 0.043 |"


def test_no_rows_give_the_header_alone_or_nothing():
    assert markdown_table([], {"seed": "seed", "min": "min"}) == "| seed | min |\n|---|---|"
    assert markdown_table([]) == "_nothing_"
    assert plain_cell("k", None) == "" and plain_cell("k", 1.5) == "1.5"
