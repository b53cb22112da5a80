"""Preprocess a local GSM8K jsonl file (``question``, ``answer`` per line) into verl parquet.

``verl data gsm8k --input RAW.jsonl --out DIR [--split train]`` writes ``DIR/<split>.parquet``;
the ground truth is the number after ``#### `` in ``answer`` (commas removed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence

from verl.utils.dataset.arithmetic import write_parquet
from verl.utils.dataset.errors import DatasetError

DATA_SOURCE = "openai/gsm8k"
# Asks for the "#### answer" format that the strict GSM8K reward checks.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_ground_truth(answer: str) -> str | None:
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def load_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise DatasetError(f"gsm8k: expected an input jsonl file, found nothing at {path}")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"gsm8k: {path}:{line_no}: expected a JSON object, found invalid JSON ({err.msg})"
                ) from None
            if not isinstance(record, dict) or not {"question", "answer"} <= set(record):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DatasetError(f"gsm8k: {path}:{line_no}: expected keys 'question' and 'answer', found {found}")
            records.append(record)
    if not records:
        raise DatasetError(f"gsm8k: expected at least one record in {path}, found none")
    return records


def make_rows(records: list[dict], split: str, source: str) -> list[dict]:
    rows = []
    for index, record in enumerate(records):
        ground_truth = extract_ground_truth(record["answer"])
        if ground_truth is None:
            raise DatasetError(f"gsm8k: {source} record {index}: expected '#### <number>' in 'answer', found none")
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": record["question"],
                    "answer": record["answer"],
                },
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``verl data gsm8k --input RAW.jsonl --out DIR``. Returns 0."""
    parser = argparse.ArgumentParser(prog="verl data gsm8k", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="GSM8K jsonl with 'question' and 'answer' per line")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", default="train", help="split name: output file <split>.parquet")
    args = parser.parse_args(argv)
    rows = make_rows(load_jsonl(args.input), args.split, args.input)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.split}.parquet")
    write_parquet(rows, path)
    print(f"gsm8k: {len(rows)} rows -> {path}")
    return 0
