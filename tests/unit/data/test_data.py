"""Arithmetic task generation, local dataset loading/validation and the resumable batch iterator."""

import json

import pytest

from skyrl_mtp.data.arithmetic_task import (
    ArithmeticTaskConfig,
    generate_rows,
    sft_examples,
    write_arithmetic_dataset,
)
from skyrl_mtp.data.datasets import PromptBatchIterator, load_prompt_dataset
from skyrl_mtp.envs.math_reward import MathReward


def test_arithmetic_rows_deterministic_and_correct(tmp_path):
    cfg = ArithmeticTaskConfig(digits=2, num_train=20, num_test=5, seed=3)
    rows = generate_rows(cfg)
    assert rows == generate_rows(cfg) and rows != generate_rows(ArithmeticTaskConfig(seed=4, num_train=20, num_test=5))
    for r in rows["train"]:
        i = r["extra_info"]
        assert 10 <= i["a"] <= 99 and int(r["reward_model"]["ground_truth"]) == (
            i["a"] + i["b"] if i["op"] == "+" else i["a"] - i["b"])
        assert "\\boxed{}" in r["prompt"][0]["content"]
    sft = sft_examples(rows["train"])
    rw = MathReward()
    assert all(rw.score(s["response"], r["reward_model"]["ground_truth"]).score == 1.0
               for s, r in zip(sft, rows["train"][:5]))
    rw.close()
    paths = write_arithmetic_dataset(tmp_path, cfg)
    for key in ("train", "train_jsonl"):
        ds = load_prompt_dataset(paths[key])
        assert len(ds.examples) == 20 and ds.examples[0].ground_truth == rows["train"][0]["reward_model"]["ground_truth"]
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTaskConfig(digits=0)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_prompt_dataset(tmp_path / "nope.parquet")
    p = tmp_path / "d.jsonl"
    good = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}
    bad = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}}
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="row 1.*reward_model.ground_truth"):
        load_prompt_dataset(p)
    ds = load_prompt_dataset(p, skip_malformed=True)
    assert len(ds.examples) == 1 and ds.num_skipped == 1
    with pytest.raises(ValueError, match="layout"):
        load_prompt_dataset(p, layout="x")


def test_searchr1_layout(tmp_path):
    p = tmp_path / "s.jsonl"
    rows = [{"question": "who?", "golden_answers": ["a", "b"]},
            {"question": "what?", "reward_model": {"ground_truth": {"target": ["c"]}}},
            {"question": "", "golden_answers": ["x"]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="row 2: field 'question'"):
        load_prompt_dataset(p, layout="searchr1")
    ds = load_prompt_dataset(p, layout="searchr1", skip_malformed=True)
    assert [e.ground_truth["target"] for e in ds.examples] == [["a", "b"], ["c"]]
    assert ds.examples[0].prompt == [{"role": "user", "content": "who?"}]   # no prompt field: the bare question


def test_searchr1_layout_keeps_the_rows_instruction_prompt(tmp_path):
    from skyrl_mtp.data.search_task import make_searchr1_row

    row = make_searchr1_row("who?", ["a"], data_source="s", split="train", index=0)   # what the prepare script writes
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(row) + "\n")
    (ex,) = load_prompt_dataset(p, layout="searchr1").examples
    assert ex.prompt == row["prompt"] and "<search>" in ex.prompt[0]["content"] and ex.ground_truth == {"target": ["a"]}


def test_iterator_epochs_and_resume():
    it = PromptBatchIterator(list(range(10)), 4, seed=1)
    b = [it.next_batch() for _ in range(3)]
    assert len(set(b[0] + b[1])) == 8 and it.epoch == 1
    state = it.state_dict()
    nxt = [it.next_batch() for _ in range(3)]
    it2 = PromptBatchIterator(list(range(10)), 4, seed=1)
    it2.load_state_dict(state)
    assert [it2.next_batch() for _ in range(3)] == nxt
    assert PromptBatchIterator(list(range(10)), 4, shuffle=False).next_batch() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="batch_size"):
        PromptBatchIterator([1], 2)
