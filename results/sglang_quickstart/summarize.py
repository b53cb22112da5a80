"""Summarize results/sglang_quickstart/logs: the quickstart (configs/grpo_arith_tiny.yaml) with the native rollout and
with SGLang, 3 seeds each, run for run on the same seeds, one run at a time on an otherwise idle 2-core box.

    python results/sglang_quickstart/summarize.py results/sglang_quickstart/logs              # per run
    python results/sglang_quickstart/summarize.py results/sglang_quickstart/logs --markdown   # the README tables

From each run's ``metrics.jsonl`` (results/rollout_comparison.py): greedy ``val/accuracy`` on the 256 held-out
problems at step 0 (the SFT warm start: the same for both rollouts of a seed), at the last step and at the best
validated step; the medians over the run's steps of ``timing_s/step`` and ``timing_s/gen``; the largest
``training/rollout_probs_diff_max`` of any step (the rollout's log-probs against the actor's on the same tokens)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/: the figures' shared summary
from rollout_comparison import columns, groups, learning_table, spread  # noqa: E402

ROLLOUTS = {"native": "native (the embedded engine)", "sglang": "SGLang (`rollout.name=sglang`, sglang 0.5.23 CPU)"}


def lines(logs: Path) -> list[str]:
    return [f"{rollout} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step {f['last_step']}, "
            f"{f['gain']:+.1f} points, best {f['best']:.3f}); step {f['step_s']:.2f} s, gen {f['gen_s']:.2f} s "
            f"(medians); rollout_probs_diff_max <= {f['diff_max']:.1e}"
            for rollout, runs in groups(logs, ROLLOUTS).items() for seed, f in runs.items()]


def markdown(logs: Path) -> list[str]:
    data = groups(logs, ROLLOUTS)
    speed = ["<!-- results/sglang_quickstart:speed -->",
             "| rollout (3 seeds: mean ± sd [min, max]) | s/step (median of a run) | gen s/step | largest "
             "rollout_probs_diff_max of a run |",
             "|---|---|---|---|"]
    for rollout, runs in data.items():
        col = columns(logs, data, rollout)
        speed.append(f"| {ROLLOUTS[rollout]}, seeds {', '.join(map(str, runs))} | {spread(col['step_s'], '.2f')} | "
                     f"{spread(col['gen_s'], '.2f')} | {max(col['diff_max']):.1e} |")
    learning = learning_table(logs, data, ROLLOUTS, "<!-- results/sglang_quickstart:learning -->", "sglang", "SGLang")
    return learning + [""] + speed


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
