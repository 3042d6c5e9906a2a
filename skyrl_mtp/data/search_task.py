"""Synthetic knowledge task for the tiny SearchR1 default: made-up facts only the corpus knows.

Every entity (e.g. "Zorbia") gets one document per relation ("The capital of Zorbia is Quenta."), so a
question can only be answered by searching. Warm-start traces (search -> information -> answer, with the
information the BM25 retriever really returns) seed a supervised stage. With `num_warmstart_entities > 0`
the traces are about entities of their own (in the corpus, never asked in train or test), so the warm start
can teach the search-and-copy skill but cannot teach any RL or eval answer: every correct answer the policy
gives later was read from a retrieved passage. Output follows the Search-R1 layout and is a pure function of
the spec (same seed, same bytes).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from skyrl_mtp.data.search_protocol import (
    INSTRUCTION_STYLES,
    build_search_prompt,
    format_documents,
    information_block,
)


@dataclass(frozen=True)
class Relation:
    name: str
    fact: str       # "{e}" entity, "{v}" value
    question: str
    query: str


RELATIONS = (
    Relation("capital", "The capital of {e} is {v}.", "What is the capital of {e}?", "capital of {e}"),
    Relation("founder", "{e} was founded by {v}.", "Who founded {e}?", "who founded {e}"),
    Relation("river", "The longest river of {e} is the {v}.", "What is the longest river of {e}?", "longest river of {e}"),
    Relation("currency", "The currency used in {e} is the {v}.", "What currency is used in {e}?", "currency of {e}"),
)
RELATION_NAMES = tuple(r.name for r in RELATIONS)
FORMATS = ("parquet", "jsonl")

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr", "zh")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("", "", "n", "r", "s", "l", "x", "th")


@dataclass(frozen=True)
class SearchTaskSpec:
    num_entities: int = 64
    relations: tuple[str, ...] = RELATION_NAMES
    test_fraction: float = 0.125
    topk: int = 3
    instruction_style: str = "short"
    seed: int = 0
    data_source: str = "synthetic_kb"
    # 0: warm-start traces answer the train questions; > 0: they answer facts of this many separate entities
    num_warmstart_entities: int = 0

    def __post_init__(self):
        if not isinstance(self.num_entities, int) or not 1 <= self.num_entities <= 5000:
            raise ValueError(f"num_entities={self.num_entities!r} must be an int in [1, 5000]")
        if not isinstance(self.num_warmstart_entities, int) or not 0 <= self.num_warmstart_entities <= 20000:
            raise ValueError(f"num_warmstart_entities={self.num_warmstart_entities!r} must be an int in [0, 20000]")
        bad = [r for r in self.relations if r not in RELATION_NAMES]
        if not self.relations or bad:
            raise ValueError(f"relations={self.relations!r}: unknown {bad}; allowed: {RELATION_NAMES}")
        if not 0.0 <= self.test_fraction < 1.0:
            raise ValueError(f"test_fraction={self.test_fraction} must be in [0, 1)")
        if not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk={self.topk!r} must be an int >= 1")
        if self.instruction_style not in INSTRUCTION_STYLES:
            raise ValueError(f"instruction_style={self.instruction_style!r}; allowed: {sorted(INSTRUCTION_STYLES)}")


@dataclass
class SearchTask:
    corpus: list[dict]       # {"id", "contents"}
    train: list[dict]        # Search-R1 rows
    test: list[dict]
    warmstart: list[dict]    # train questions with a full search -> answer trace
    stats: dict


def make_searchr1_row(question: str, answers: list[str], *, data_source: str, split: str, index: int,
                      style: str = "full", extra: dict | None = None) -> dict:
    """One row in the Search-R1 (verl) layout with the instruction prompt built in."""
    return {
        "data_source": data_source,
        "question": question,
        "golden_answers": list(answers),
        "prompt": [{"role": "user", "content": build_search_prompt(question, style)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
        "extra_info": {"split": split, "index": index, **(extra or {})},
    }


class _NameMaker:
    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def __call__(self, syllables: int) -> str:
        while True:
            name = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            name = (name + self.rng.choice(_CODAS)).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name


def _value(rel: str, names: _NameMaker) -> str:
    if rel == "founder":
        return f"{names(2)} {names(2)}"
    return names(2) + (" River" if rel == "river" else "")


def build_search_task(spec: SearchTaskSpec = SearchTaskSpec()) -> SearchTask:
    from skyrl_mtp.data.corpus_index import BM25Index, Document

    rng = random.Random(spec.seed)
    names = _NameMaker(rng)
    relations = [r for r in RELATIONS if r.name in spec.relations]

    def entity_facts(num: int) -> list[tuple[str, Relation, str]]:
        out = []
        for _ in range(num):
            entity = names(rng.choice((2, 3)))
            out += [(entity, rel, _value(rel.name, names)) for rel in relations]
        return out

    facts = entity_facts(spec.num_entities)  # (entity, relation, value)
    order = list(range(len(facts)))
    rng.shuffle(order)
    num_test = int(round(spec.test_fraction * len(facts)))
    test_ids, train_ids = sorted(order[:num_test]), sorted(order[num_test:])
    first_ws = len(facts)
    facts += entity_facts(spec.num_warmstart_entities)   # drawn last: the train/test facts do not depend on it
    corpus = [{"id": str(i), "contents": f"{e}\n{rel.fact.format(e=e, v=v)}"} for i, (e, rel, v) in enumerate(facts)]
    ws_ids = list(range(first_ws, len(facts))) if spec.num_warmstart_entities else train_ids

    index = BM25Index([Document(**d) for d in corpus])
    ws_queries = [facts[i][1].query.format(e=facts[i][0]) for i in ws_ids]
    hits = index.search(ws_queries, spec.topk) if ws_ids else []

    def row(i: int, split: str, n: int) -> dict:
        e, rel, v = facts[i]
        return make_searchr1_row(rel.question.format(e=e), [v], data_source=spec.data_source, split=split, index=n,
                                 style=spec.instruction_style, extra={"doc_id": str(i), "relation": rel.name})

    train = [row(i, "train", n) for n, i in enumerate(train_ids)]
    test = [row(i, "test", n) for n, i in enumerate(test_ids)]
    ws_rows = [row(i, "warmstart", n) for n, i in enumerate(ws_ids)] if spec.num_warmstart_entities else train
    warmstart, top1 = [], 0
    for n, (i, query, per_q) in enumerate(zip(ws_ids, ws_queries, hits)):
        top1 += per_q[0].document.id == str(i)
        segments = [
            {"role": "policy", "text": f"<search>{query}</search>"},
            {"role": "tool", "text": information_block(format_documents([h.document.contents for h in per_q]))},
            {"role": "policy", "text": f"<answer>{facts[i][2]}</answer>"},
        ]
        warmstart.append({**ws_rows[n], "segments": segments, "response": "".join(s["text"] for s in segments)})
    stats = {"num_documents": len(corpus), "num_train": len(train), "num_test": len(test),
             "num_warmstart": len(warmstart), "warmstart_gold_top1_frac": top1 / max(len(ws_ids), 1),
             "spec": asdict(spec)}
    return SearchTask(corpus, train, test, warmstart, stats)


def _write_rows(rows: list[dict], path: Path) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)  # columns: union of all rows
    else:
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def write_search_task(out_dir: str | Path, spec: SearchTaskSpec = SearchTaskSpec(), fmt: str = "parquet") -> dict[str, Path]:
    """Write corpus.jsonl, train/test.{fmt}, warmstart.{fmt} and stats.json; returns their paths."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}; allowed: {FORMATS}")
    task = build_search_task(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out / "corpus.jsonl", "train": out / f"train.{fmt}", "test": out / f"test.{fmt}",
             "warmstart": out / f"warmstart.{fmt}", "stats": out / "stats.json"}
    _write_rows(task.corpus, paths["corpus"])
    for split in ("train", "test", "warmstart"):
        _write_rows(getattr(task, split), paths[split])
    paths["stats"].write_text(json.dumps(task.stats, indent=2, sort_keys=True) + "\n")
    return paths
