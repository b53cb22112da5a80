"""Learning curves of two GRPO runs on one PNG (docs/lora.md's LoRA vs full fine-tuning figure).

    python launch/plot_lora_vs_full.py outputs/quickstart_smollm2/metrics.jsonl \\
        outputs/quickstart_smollm2_lora/metrics.jsonl --labels "full FT (lr 1e-5)" "LoRA r16 (lr 1e-4)" \\
        --out docs/lora_grpo_smollm2.png

Left: greedy ``val/accuracy`` at each validation step; right: the training ``critic/score/mean`` per step
with a 5-step running mean.
"""

from __future__ import annotations

import argparse
import sys

from verl.errors import InputError
from verl.utils.tracking import read_metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", help="metrics.jsonl of each run")
    p.add_argument("--labels", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="GRPO on word problems, SmolLM2-135M-Instruct, 2 CPU ranks")
    args = p.parse_args(argv)
    if len(args.labels) != len(args.metrics):
        raise InputError(f"--labels: expected {len(args.metrics)} labels (one per run), found {len(args.labels)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_score) = plt.subplots(1, 2, figsize=(10, 3.8))
    for path, label in zip(args.metrics, args.labels, strict=True):
        records = read_metrics(path)
        val = sorted((r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r)
        score = sorted((r["step"], r["critic/score/mean"]) for r in records if "critic/score/mean" in r)
        if not val:
            raise InputError(f"{path}: expected val/accuracy records, found none")
        line, = ax_val.plot([s for s, _ in val], [v for _, v in val], marker="o", label=label)
        steps = [s for s, _ in score]
        values = [v for _, v in score]
        smooth = [sum(values[max(0, i - 4):i + 1]) / len(values[max(0, i - 4):i + 1]) for i in range(len(values))]
        ax_score.plot(steps, values, color=line.get_color(), alpha=0.25)
        ax_score.plot(steps, smooth, color=line.get_color(), label=label)
    ax_val.set(xlabel="step", ylabel="greedy val/accuracy (64 held-out)", title="held-out accuracy")
    ax_score.set(xlabel="step", ylabel="critic/score/mean", title="training reward (5-step mean)")
    for ax in (ax_val, ax_score):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
