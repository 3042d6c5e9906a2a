"""Synthetic knowledge task: deterministic, answerable only through the corpus, consistent warm-start traces."""

import json

import pytest

from skyrl_mtp.data.datasets import load_prompt_dataset
from skyrl_mtp.data.search_task import SearchTaskSpec, build_search_task, write_search_task
from skyrl_mtp.envs.retriever import BM25Index, Document
from skyrl_mtp.envs.search_reward import score_response
from skyrl_mtp.envs.search_tool import parse_last_action

SPEC = SearchTaskSpec(num_entities=16, seed=3)


@pytest.fixture(scope="module")
def task():
    return build_search_task(SPEC)


def test_sizes_and_disjoint_splits(task):
    assert len(task.corpus) == 16 * 4
    assert len(task.train) + len(task.test) == 64 and len(task.test) == 8
    train_docs = {r["extra_info"]["doc_id"] for r in task.train}
    assert train_docs.isdisjoint(r["extra_info"]["doc_id"] for r in task.test)
    assert len({d["contents"].split("\n")[0] for d in task.corpus}) == 16


def test_answers_live_only_in_their_document(task):
    contents = {d["id"]: d["contents"] for d in task.corpus}
    for row in task.train + task.test:
        answer = row["golden_answers"][0]
        holders = [i for i, c in contents.items() if answer in c]
        assert holders == [row["extra_info"]["doc_id"]]
        assert answer not in row["prompt"][0]["content"]


def test_warmstart_traces_search_then_answer(task):
    index = BM25Index([Document(**d) for d in task.corpus])
    assert task.stats["warmstart_gold_top1_frac"] == 1.0
    for w in task.warmstart:
        roles = [s["role"] for s in w["segments"]]
        assert roles == ["policy", "tool", "policy"]
        search = parse_last_action(w["segments"][0]["text"])
        assert search.kind == "search"
        top = index.search([search.content], 1)[0][0].document
        assert top.id == w["extra_info"]["doc_id"]
        assert w["golden_answers"][0] in w["segments"][1]["text"]
        assert score_response(w["response"], w["reward_model"]["ground_truth"]).score == 1.0


def test_deterministic_files_and_loader_compatible(tmp_path):
    a = write_search_task(tmp_path / "a", SPEC)
    b = write_search_task(tmp_path / "b", SPEC)
    for key in ("corpus", "train", "test", "warmstart"):
        assert a[key].read_bytes() == b[key].read_bytes(), key
    c = write_search_task(tmp_path / "c", SearchTaskSpec(num_entities=16, seed=4), fmt="jsonl")
    assert c["corpus"].read_bytes() != a["corpus"].read_bytes()
    loaded = load_prompt_dataset(a["train"], layout="searchr1")
    assert len(loaded.examples) == json.loads(a["stats"].read_text())["num_train"]
    assert loaded.examples[0].ground_truth["target"] == build_search_task(SPEC).train[0]["golden_answers"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_entities": 0}, "num_entities"),
    ({"relations": ("capital", "mayor")}, "relations"),
    ({"test_fraction": 1.0}, "test_fraction"),
    ({"instruction_style": "verbose"}, "instruction_style"),
])
def test_spec_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SearchTaskSpec(**kwargs)
