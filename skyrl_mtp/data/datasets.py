"""Local prompt datasets (verl/DAPO-Math and Search-R1 layouts) validated row by row, plus a resumable iterator."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYOUTS = ("dapo", "searchr1")
# file suffix -> the `datasets` builder that reads it
DATA_FILE_KINDS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass
class PromptExample:
    prompt: list[dict[str, str]]
    ground_truth: Any
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)


@dataclass
class LoadedDataset:
    examples: list[PromptExample]
    num_skipped: int = 0


def _dapo_row(row: dict, i: int) -> PromptExample:
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        raise ValueError(f"row {i}: field 'prompt' must be a non-empty list of {{role, content}} messages, got {prompt!r}")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise ValueError(f"row {i}: field 'reward_model.ground_truth' missing, got reward_model={rm!r}")
    return PromptExample(
        [{"role": m["role"], "content": m["content"]} for m in prompt],
        rm["ground_truth"], str(row.get("data_source") or ""), dict(row.get("extra_info") or {}),
    )


def _searchr1_row(row: dict, i: int) -> PromptExample:
    q = row.get("question")
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"row {i}: field 'question' must be a non-empty string, got {q!r}")
    answers = row.get("golden_answers")
    if answers is None:
        gt = (row.get("reward_model") or {}).get("ground_truth")
        answers = gt.get("target") if isinstance(gt, dict) else None
    if answers is None or (isinstance(answers, list) and not answers):
        raise ValueError(f"row {i}: field 'golden_answers' (or 'reward_model.ground_truth.target') missing or empty")
    answers = [answers] if isinstance(answers, str) else list(answers)
    # the row's own prompt when it has one (Search-R1's files and scripts/prepare_searchr1_data.py put the search
    # instructions there); else the bare question
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        messages = [{"role": "user", "content": q}]
    return PromptExample(messages, {"target": answers},
                         str(row.get("data_source") or "searchr1"), dict(row.get("extra_info") or {}))


def parse_row(row: dict, i: int, layout: str) -> PromptExample:
    """Row `i` of a data file in `layout` ("dapo" or "searchr1"); ValueError naming the field that is wrong."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} unknown; allowed: {LAYOUTS}")
    return (_dapo_row if layout == "dapo" else _searchr1_row)(row, i)


def load_prompt_dataset(path: str | Path, *, layout: str = "dapo", skip_malformed: bool = False) -> LoadedDataset:
    """Load a local .parquet/.jsonl/.json file with the `datasets` library (never the hub)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} unknown; allowed: {LAYOUTS}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    kinds = DATA_FILE_KINDS
    if p.suffix not in kinds:
        raise ValueError(f"dataset file {p} has suffix {p.suffix!r}; allowed: {sorted(kinds)}")
    import datasets

    ds = datasets.load_dataset(kinds[p.suffix], data_files=str(p), split="train")
    out, skipped = [], 0
    for i, row in enumerate(ds):
        try:
            out.append(parse_row(row, i, layout))
        except ValueError:
            if not skip_malformed:
                raise
            skipped += 1
    return LoadedDataset(out, skipped)


class PromptBatchIterator:
    """Yields lists of `batch_size` examples, reshuffled each epoch from (seed, epoch); drops the last partial batch.

    state_dict() captures (epoch, position) so a resumed run continues with the same next batch.
    """

    def __init__(self, examples: list, batch_size: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if batch_size < 1 or batch_size > len(examples):
            raise ValueError(f"batch_size={batch_size} must be in [1, len(examples)={len(examples)}]")
        self.examples, self.batch_size, self.shuffle, self.seed = examples, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        idx = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(idx)
        return idx

    def next_batch(self) -> list:
        if self.position + self.batch_size > len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order()
        batch = [self.examples[j] for j in order[self.position : self.position + self.batch_size]]
        self.position += self.batch_size
        return batch

    def __iter__(self) -> Iterator[list]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in ("epoch", "position"):
            if k not in state or int(state[k]) < 0:
                raise ValueError(f"state[{k!r}]={state.get(k)!r} missing or negative")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
