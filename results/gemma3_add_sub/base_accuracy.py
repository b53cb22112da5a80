"""The base Gemma 3 270M on the addition/subtraction word problems, by the operation a problem needs and by the
prompt's shots: greedy accuracy and the mean reward of 4 samples at the job's temperature (0.8), with transformers
`generate` as the oracle (not an engine of ours) and the job's own reward, each completion cut at the first blank line
as the job's rollout stops there (stop_token_ids [108], "\\n\\n").

    python results/gemma3_add_sub/base_accuracy.py LABEL=DATA_DIR [LABEL=DATA_DIR ...] > logs/base_accuracy.txt

DATA_DIR: what `verl data word-problems --prompt-format fewshot --kinds loses_some,gets_more [--num-shots N]` writes
(test.parquet, the held-out problems)."""

import collections
import sys

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.utils.reward_score import default_compute_score

MODEL = ".cache/gemma-3-270m"
NEW_TOKENS, SAMPLES, TEMPERATURE = 32, 4, 0.8


def score(row: dict, text: str) -> float:
    text = text.split("\n\n")[0]
    return default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"])


def main(specs: list[str]) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    print(f"{'prompt':<28} {'operation':<12} {'problems':>8} {'greedy':>7} {'sampled (T 0.8)':>16}")
    for spec in specs:
        label, data_dir = spec.split("=", 1)
        rows = pq.read_table(f"{data_dir}/test.parquet").to_pylist()
        greedy, sampled = collections.defaultdict(list), collections.defaultdict(list)
        for start in range(0, len(rows), 16):
            batch = rows[start:start + 16]
            enc = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True)
            width = enc.input_ids.shape[1]
            with torch.no_grad():
                best = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
                drawn = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE,
                                       top_k=0, top_p=1.0, num_return_sequences=SAMPLES)
            for i, row in enumerate(batch):
                op = "addition" if " + " in row["extra_info"]["answer"] else "subtraction"
                answer = tokenizer.decode(best[i, width:], skip_special_tokens=True)
                greedy[op].append(score(row, answer))
                for k in range(SAMPLES):
                    text = tokenizer.decode(drawn[i * SAMPLES + k, width:], skip_special_tokens=True)
                    sampled[op].append(score(row, text))
                if start == 0 and i < 2:
                    truth = row["reward_model"]["ground_truth"]
                    print(f"  {label}: truth {truth}, greedy {answer.split(chr(10))[0]!r}")
        for op in (*sorted(greedy), "all"):
            g = greedy[op] if op != "all" else [x for v in greedy.values() for x in v]
            s = sampled[op] if op != "all" else [x for v in sampled.values() for x in v]
            print(f"{label:<28} {op:<12} {len(g):>8} {sum(g) / len(g):>7.3f} {sum(s) / len(s):>16.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
