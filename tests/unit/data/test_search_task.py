"""Synthetic knowledge task: deterministic, answerable only through the corpus, consistent warm-start traces."""

import json

import pytest

from skyrl_mtp.data.datasets import load_prompt_dataset
from skyrl_mtp.data.search_protocol import parse_last_action
from skyrl_mtp.data.search_task import SearchTaskSpec, build_search_task, write_search_task
from skyrl_mtp.envs.retriever import BM25Index, Document
from skyrl_mtp.envs.search_reward import score_response

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


def test_warmstart_entities_of_their_own_never_teach_a_train_or_test_answer():
    spec = SearchTaskSpec(num_entities=16, seed=3, relations=("capital",), topk=1, num_warmstart_entities=40)
    task = build_search_task(spec)
    base = build_search_task(SearchTaskSpec(num_entities=16, seed=3, relations=("capital",), topk=1))
    assert task.train == base.train and task.test == base.test   # the asked facts do not depend on it
    assert len(task.warmstart) == 40 and len(task.corpus) == 16 + 40
    asked = {r["question"].split(" of ")[-1] for r in task.train + task.test}
    taught = {w["question"].split(" of ")[-1] for w in task.warmstart}
    assert asked.isdisjoint(taught)
    answers = {r["golden_answers"][0] for r in task.train + task.test}
    assert not any(a in w["response"] for w in task.warmstart for a in answers)
    assert task.stats["warmstart_gold_top1_frac"] == 1.0 and task.stats["num_warmstart"] == 40
    assert all(w["extra_info"]["split"] == "warmstart" for w in task.warmstart)


def test_config_keys_reach_the_task_spec():
    from skyrl_mtp.config.loader import load_config
    from skyrl_mtp.errors import ConfigError
    from skyrl_mtp.trainer.launch import search_task_spec
    from skyrl_mtp.trainer.run_plan import data_settings

    cfg = load_config(["recipe=tiny_searchr1", "data.synthetic_num_train=100", "data.synthetic_num_val=20",
                       "data.synthetic_search_relations=[capital,currency]",
                       "data.synthetic_search_warmstart_entities=30"])
    spec = search_task_spec(dict(data_settings(cfg).synthetic_params))
    assert (spec.num_entities, spec.relations, spec.num_warmstart_entities) == (60, ("capital", "currency"), 30)
    task = build_search_task(spec)
    assert (len(task.train), len(task.test)) == (100, 20)
    legacy = load_config(["data.synthetic=search", "environment.name=search"])
    assert search_task_spec(dict(data_settings(legacy).synthetic_params)) == SearchTaskSpec(
        num_entities=500, seed=legacy.trainer.seed, topk=3)
    with pytest.raises(ConfigError, match=r"data.synthetic_search_relations=\['capital', 'mayor'\].*distinct names"):
        load_config(["recipe=tiny_searchr1", "data.synthetic_search_relations=[capital,mayor]"])
    with pytest.raises(ConfigError, match=r"data.synthetic_search_warmstart_entities=-1"):
        load_config(["recipe=tiny_searchr1", "data.synthetic_search_warmstart_entities=-1"])
