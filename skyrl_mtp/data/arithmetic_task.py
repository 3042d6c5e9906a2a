"""Synthetic multi-digit addition/subtraction task in the DAPO layout, for tiny-model RL and SFT warm start."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    digits: int = 2
    ops: tuple[str, ...] = ("+", "-")
    num_train: int = 256
    num_test: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits={self.digits} must be >= 1")
        bad = [o for o in self.ops if o not in ("+", "-")]
        if bad or not self.ops:
            raise ValueError(f"ops={self.ops} invalid; allowed: '+', '-' (non-empty)")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(f"num_train={self.num_train}, num_test={self.num_test} must be >= 0")


def make_row(a: int, op: str, b: int, split: str, index: int) -> dict:
    answer = a + b if op == "+" else a - b
    question = f"What is {a}{op}{b}? Put the final answer in \\boxed{{}}."
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def sft_response(row: dict) -> str:
    info = row["extra_info"]
    ans = row["reward_model"]["ground_truth"]
    return f"{info['a']}{info['op']}{info['b']}={ans}. \\boxed{{{ans}}}"


def generate_rows(cfg: ArithmeticTaskConfig) -> dict[str, list[dict]]:
    rng = random.Random(cfg.seed)
    lo, hi = 10 ** (cfg.digits - 1) if cfg.digits > 1 else 0, 10**cfg.digits - 1
    out: dict[str, list[dict]] = {}
    for split, n in (("train", cfg.num_train), ("test", cfg.num_test)):
        rows = []
        for i in range(n):
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(cfg.ops)
            rows.append(make_row(a, op, b, split, i))
        out[split] = rows
    return out


def sft_examples(rows: list[dict]) -> list[dict]:
    """[{"prompt": messages, "response": short correct answer}] for a warm-start stage."""
    return [{"prompt": r["prompt"], "response": sft_response(r)} for r in rows]


def write_arithmetic_dataset(out_dir: str | Path, cfg: ArithmeticTaskConfig = ArithmeticTaskConfig()) -> dict[str, Path]:
    """Write {train,test}.parquet and .jsonl; returns {"train": parquet path, "test": ..., "*_jsonl": ...}."""
    import datasets

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, rows in generate_rows(cfg).items():
        jp = out / f"{split}.jsonl"
        jp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pp = out / f"{split}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(pp))
        paths[split], paths[f"{split}_jsonl"] = pp, jp
    return paths
