"""What the dspark CLI prints for a person: the shared table printer, and a --help that says what each verb
prints (no model is loaded here)."""

import pytest

from dspark_core.cli.common import KIT, cell, table
from dspark_core.cli.main import build_parser


def test_table_aligns_columns_and_right_aligns_numbers():
    text = table([{"domain": "code", "version": 3, "tau": 2.34567, "champion": True},
                  {"domain": "mathematics", "version": 12, "tau": None, "champion": False}])
    assert text.splitlines() == [
        "DOMAIN       VERSION    TAU  CHAMPION",
        "code               3  2.346  yes",
        "mathematics       12      -  no",
    ]


def test_table_picks_columns_and_reads_sequences_without_a_header():
    rows = [{"a": 1, "b": "x", "c": 9}, {"a": 22, "b": "yy"}]
    assert table(rows, ("b", "a")).splitlines() == ["B    A", "x    1", "yy  22"]
    assert table([("name", "code"), ("aliases", ["challenger", "champion"])], header=False).splitlines() == [
        "name     code", "aliases  challenger champion"]
    assert table([]) == "" and table([], ("a",)) == "A"


@pytest.mark.parametrize("value, text", [
    (None, "-"), (0.012345, "0.01235"), (12345.6, "12346"), (float("nan"), "nan"), (3, "3"),
    ([0.9, 0.75], "0.9 0.75"), ({"loaded": 4, "computed": None}, "loaded=4, computed=-"), ("a\nb", "a\\nb"),
])
def test_cells_are_short_and_on_one_line(value, text):
    assert cell(value) == text


def test_long_cells_are_cut_to_max_width():
    assert table([{"raw": "x" * 100}], max_width=10).splitlines()[1] == "xxxxxxx..."


def test_the_kit_hands_the_table_printer_to_the_plugins():
    assert KIT.table is table


def _subparsers(parser):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            yield from action.choices.items()


@pytest.mark.parametrize("path", [
    ("target", "prepare"), ("generate",), ("traces", "bootstrap"), ("demo",), ("train",), ("eval",), ("calibrate",),
    ("profile-sps",), ("warehouse", "ingest"), ("warehouse", "stats"), ("registry", "list"), ("registry", "show"),
    ("registry", "promote"), ("registry", "rollback"), ("flow", "run"), ("flow", "serve"), ("flow", "demo"),
])
def test_help_of_each_verb_says_what_it_prints(path):
    parser = build_parser()
    for name in path:
        parser = dict(_subparsers(parser))[name]
    assert "print" in (parser.description or "").lower(), " ".join(path)
    json_opts = [a for a in parser._actions if "--json" in a.option_strings]
    assert all(a.help for a in json_opts), " ".join(path)
