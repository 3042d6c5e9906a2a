#!/usr/bin/env python
"""Prepare SearchR1 training data.

  convert:   user-provided Search-R1-format parquet/JSONL rows (question + golden_answers, or
             reward_model.ground_truth.target) -> the project's training layout with the search instruction prompt.
  synthetic: the tiny default's made-up knowledge corpus, questions and warm-start traces.

Both validate every row and print a JSON report of counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skyrl_mtp.data.search_protocol import INSTRUCTION_STYLES
from skyrl_mtp.data.search_task import FORMATS, SearchTaskSpec, make_searchr1_row, write_search_task

INPUT_SUFFIXES = (".parquet", ".jsonl", ".json")
OUTPUT_SUFFIXES = (".parquet", ".jsonl")


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def row_answers(row: dict, i: int) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:
        gt = (row.get("reward_model") or {}).get("ground_truth")
        answers = gt.get("target") if isinstance(gt, dict) else None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError(f"row {i}: field 'golden_answers' (or 'reward_model.ground_truth.target') must be a "
                         f"non-empty string or list of non-empty strings, got {answers!r}")
    return [a.strip() for a in answers]


def convert_rows(rows: list[dict], *, style: str, split: str, data_source: str | None,
                 skip_malformed: bool) -> tuple[list[dict], dict]:
    out, skipped = [], []
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise ValueError(f"row {i}: must be an object, got {type(row).__name__}")
            q = row.get("question")
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"row {i}: field 'question' must be a non-empty string, got {q!r}")
            answers = row_answers(row, i)
        except ValueError as e:
            if not skip_malformed:
                raise
            skipped.append(str(e))
            continue
        source = data_source or str(row.get("data_source") or "searchr1")
        extra = {k: v for k, v in (row.get("extra_info") or {}).items() if k not in ("split", "index")}
        out.append(make_searchr1_row(q.strip(), answers, data_source=source, split=split, index=len(out),
                                     style=style, extra={"source_row": i, **extra}))
    report = {"rows_read": len(rows), "rows_written": len(out), "rows_skipped": len(skipped),
              "skipped_examples": skipped[:5]}
    return out, report


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)  # columns: union of all rows
    else:
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def cmd_convert(args) -> dict:
    src, dst = Path(args.input), Path(args.output)
    if src.suffix not in INPUT_SUFFIXES:
        raise ValueError(f"--input {src} has suffix {src.suffix!r}; allowed: {INPUT_SUFFIXES}")
    if dst.suffix not in OUTPUT_SUFFIXES:
        raise ValueError(f"--output {dst} has suffix {dst.suffix!r}; allowed: {OUTPUT_SUFFIXES}")
    if not src.is_file():
        raise FileNotFoundError(f"--input {src} not found")
    rows, report = convert_rows(read_rows(src), style=args.instruction_style, split=args.split,
                                data_source=args.data_source, skip_malformed=args.skip_malformed)
    if not rows:
        raise ValueError(f"--input {src}: no usable rows ({report['rows_read']} read, {report['rows_skipped']} skipped)")
    write_rows(rows, dst)
    return {"output": str(dst), **report}


def cmd_synthetic(args) -> dict:
    spec = SearchTaskSpec(num_entities=args.num_entities, seed=args.seed, test_fraction=args.test_fraction,
                          topk=args.topk, instruction_style=args.instruction_style)
    paths = write_search_task(args.out_dir, spec, fmt=args.format)
    return {**json.loads(paths["stats"].read_text()), "files": {k: str(v) for k, v in paths.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="Search-R1-format rows -> training layout")
    c.add_argument("--input", required=True)
    c.add_argument("--output", required=True)
    c.add_argument("--split", default="train")
    c.add_argument("--data-source", default=None, help="overrides each row's data_source")
    c.add_argument("--instruction-style", default="full", choices=sorted(INSTRUCTION_STYLES))
    c.add_argument("--skip-malformed", action="store_true", help="skip (and count) bad rows instead of failing")
    s = sub.add_parser("synthetic", help="the tiny default's synthetic knowledge task")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--num-entities", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--test-fraction", type=float, default=0.125)
    s.add_argument("--topk", type=int, default=3)
    s.add_argument("--instruction-style", default="short", choices=sorted(INSTRUCTION_STYLES))
    s.add_argument("--format", default="parquet", choices=FORMATS)
    args = ap.parse_args(argv)
    try:
        report = cmd_convert(args) if args.command == "convert" else cmd_synthetic(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
