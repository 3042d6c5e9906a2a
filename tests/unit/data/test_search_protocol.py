"""Parsing the policy's search/answer actions and formatting tool output."""

import pytest

from skyrl_mtp.data.search_protocol import (
    Action,
    build_search_prompt,
    extract_answer,
    format_documents,
    information_block,
    parse_last_action,
)


@pytest.mark.parametrize("text, expected", [
    ("I think <search> capital of Zorbia </search>", Action("search", "capital of Zorbia")),
    ("<search>a</search> then <answer>Quenta</answer>", Action("answer", "Quenta")),
    ("<answer>x</answer> more <search>q2</search>\n", Action("search", "q2")),
    ("<answer>multi\nline</answer>", Action("answer", "multi\nline")),
    ("no action here", None),
    ("<search>unclosed", None),
    ("<search>mismatched</answer>", None),
])
def test_parse_last_action(text, expected):
    assert parse_last_action(text) == expected


def test_extract_answer_takes_last_answer():
    assert extract_answer("<answer>a</answer><search>s</search><answer> b </answer>") == "b"
    assert extract_answer("<search>s</search>") is None


def test_format_documents_uses_title_line():
    text = format_documents(["Zorbia\nThe capital of Zorbia is Quenta.", '"Blorp"\nBlorp is small.\nIt is old.'])
    assert text == "Doc 1(Title: Zorbia) The capital of Zorbia is Quenta.\nDoc 2(Title: Blorp) Blorp is small.\nIt is old."
    assert information_block(" x ") == "\n\n<information>x</information>\n\n"


def test_build_search_prompt_validates():
    assert build_search_prompt("Who?", "short").endswith("Question: Who?\n")
    assert "<search>" in build_search_prompt("Who?")
    with pytest.raises(ValueError, match="style"):
        build_search_prompt("Who?", "long")
    with pytest.raises(ValueError, match="question"):
        build_search_prompt("  ")
