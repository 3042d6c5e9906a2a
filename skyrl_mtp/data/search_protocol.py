"""The text protocol of the search tool: parse the policy's <search>/<answer> action, format <information> blocks.

The policy writes `<search>query</search>` to call the retriever or `<answer>text</answer>` to finish;
retrieved documents come back as `\\n\\n<information>Doc 1(Title: T) text ...</information>\\n\\n`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
STOP_STRINGS = (SEARCH_CLOSE, ANSWER_CLOSE)
ACTION_KINDS = ("search", "answer")

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

SEARCH_INSTRUCTION = (
    "Answer the question below. Think step by step inside <think> </think> whenever you receive new "
    "information. If you are missing knowledge, query the search engine by writing <search> your query "
    "</search>; the top results will be returned between <information> and </information>. You may search "
    "several times. When no more knowledge is needed, give only the final answer inside <answer> and "
    "</answer>, e.g. <answer> Paris </answer>. Question: {question}\n"
)
SHORT_SEARCH_INSTRUCTION = "Use <search>query</search> to look things up, then reply <answer>text</answer>. Question: {question}\n"
INSTRUCTION_STYLES = {"full": SEARCH_INSTRUCTION, "short": SHORT_SEARCH_INSTRUCTION}


@dataclass(frozen=True)
class Action:
    kind: str      # "search" | "answer"
    content: str   # stripped text between the tags


def build_search_prompt(question: str, style: str = "full") -> str:
    if style not in INSTRUCTION_STYLES:
        raise ValueError(f"instruction style={style!r} unknown; allowed: {sorted(INSTRUCTION_STYLES)}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    return INSTRUCTION_STYLES[style].format(question=question.strip())


def parse_last_action(text: str) -> Action | None:
    """The LAST complete `<search>..</search>` or `<answer>..</answer>` in `text`; None when there is none."""
    matches = _ACTION_RE.findall(text)
    if not matches:
        return None
    kind, content = matches[-1]
    return Action(kind=kind, content=content.strip())


def extract_answer(text: str) -> str | None:
    """Content of the last complete <answer>..</answer> in `text` (None when absent)."""
    answers = [c for k, c in _ACTION_RE.findall(text) if k == "answer"]
    return answers[-1].strip() if answers else None


def split_title(contents: str) -> tuple[str, str]:
    """Search-R1 corpus convention: first line is the title, the rest the text."""
    title, _, body = contents.partition("\n")
    return title.strip().strip('"'), body.strip()


def format_documents(contents: Sequence[str]) -> str:
    """'Doc 1(Title: T) text\\nDoc 2(Title: ...) ...' for the documents' contents, best first."""
    lines = []
    for i, c in enumerate(contents, start=1):
        title, body = split_title(c)
        lines.append(f"Doc {i}(Title: {title}) {body}")
    return "\n".join(lines)


def information_block(text: str) -> str:
    """The tool-output string appended to the trajectory after a search."""
    return f"\n\n<information>{text.strip()}</information>\n\n"


def search_failure_text(error: str) -> str:
    """What the policy sees when the retriever failed (scored, not raised)."""
    return f"Search failed: {error}. No documents were retrieved."
