"""scripts/prepare_searchr1_data.py run as a user would: convert Search-R1 rows, and the synthetic task."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from skyrl_mtp.data.datasets import load_prompt_dataset
from skyrl_mtp.data.search_protocol import build_search_prompt

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "prepare_searchr1_data.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


ROWS = [
    {"id": "a", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare", "William Shakespeare"],
     "data_source": "nq"},
    {"id": "b", "question": "capital of france", "reward_model": {"ground_truth": {"target": ["Paris"]}}},
    {"id": "c", "question": "", "golden_answers": ["x"]},
    {"id": "d", "question": "no answers", "golden_answers": []},
]


def test_convert_parquet(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_struct_array(pa.array(ROWS[:2])), src)
    proc = run("convert", "--input", src, "--output", tmp_path / "out.parquet", "--split", "test")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["rows_read"], report["rows_written"], report["rows_skipped"]) == (2, 2, 0)
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert out[0]["prompt"] == [{"role": "user", "content": build_search_prompt("who wrote hamlet?")}]
    assert out[0]["reward_model"]["ground_truth"]["target"] == ["Shakespeare", "William Shakespeare"]
    assert (out[0]["data_source"], out[1]["data_source"]) == ("nq", "searchr1")
    assert out[1]["golden_answers"] == ["Paris"] and out[1]["extra_info"]["split"] == "test"
    assert len(load_prompt_dataset(tmp_path / "out.parquet", layout="searchr1").examples) == 2


def test_convert_rejects_or_skips_malformed_rows(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    proc = run("convert", "--input", src, "--output", tmp_path / "out.jsonl")
    assert proc.returncode == 2 and "row 2: field 'question'" in proc.stderr
    proc = run("convert", "--input", src, "--output", tmp_path / "out.jsonl", "--skip-malformed")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["rows_read"], report["rows_written"], report["rows_skipped"]) == (4, 2, 2)
    assert "row 3: field 'golden_answers'" in report["skipped_examples"][1]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    proc = run("convert", "--input", tmp_path / "in.csv", "--output", tmp_path / "o.jsonl")
    assert proc.returncode == 2 and "suffix '.csv'" in proc.stderr


def test_synthetic_subcommand(tmp_path):
    proc = run("synthetic", "--out-dir", tmp_path, "--num-entities", 8, "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["num_documents"], report["num_train"] + report["num_test"]) == (32, 32)
    assert sum(1 for _ in open(report["files"]["warmstart"])) == report["num_train"]
