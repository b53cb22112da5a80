"""Greedy accuracy of the base Gemma 3 270M on the word problems' held-out split, by the number of steps a problem's
worked solution takes, with transformers `generate` (the oracle, not an engine of ours) and the job's own reward
(the few-shot completion cut at its next "Question:", verl.utils.reward_score.cut_at_stop).

    python results/gemma3_word_problems/base_accuracy.py DATA_DIR [MODEL_DIR] > logs/base_accuracy.txt

DATA_DIR: what `verl data word-problems --prompt-format fewshot --out DATA_DIR` writes (the job's data stage)."""

import collections
import sys

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.utils.reward_score import cut_at_stop, default_compute_score
from verl.utils.reward_score.word_problems import extract_answer


def main(data_dir: str, model_dir: str = ".cache/gemma-3-270m", new_tokens: int = 48) -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(f"{data_dir}/test.parquet").to_pylist()
    scores, answered = collections.defaultdict(list), collections.defaultdict(list)
    for start in range(0, len(rows), 16):
        batch = rows[start:start + 16]
        enc = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
        for row, ids in zip(batch, out, strict=True):
            text = tokenizer.decode(ids[enc.input_ids.shape[1]:], skip_special_tokens=True)
            steps = row["extra_info"]["answer"].count("=")  # one "=" per step of the worked solution
            truth = row["reward_model"]["ground_truth"]
            scores[steps].append(default_compute_score(row["data_source"], text, truth, row["extra_info"]))
            answered[steps].append(extract_answer(cut_at_stop(text, row["extra_info"])) is not None)
            if start == 0 and len(scores[steps]) == 1:
                print(f"example ({steps}-step, truth {truth}): {text!r}")
    print("steps  problems  greedy accuracy  completions with an answer marker")
    for steps in sorted(scores):
        s, a = scores[steps], answered[steps]
        print(f"{steps:>5}  {len(s):>8}  {sum(s) / len(s):>15.3f}  {sum(a) / len(a):>33.3f}")
    every = [x for s in scores.values() for x in s]
    print(f"  all  {len(every):>8}  {sum(every) / len(every):>15.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
