"""The reward pool's figure (issue 47, item 3): a GRPO step of the tiny arithmetic config on 2 local CPU ranks whose
reward function sleeps ``--sleep-ms`` per sample, with rewards in the step and with ``reward.num_workers``
processes scoring while old-log-prob and ref run. Prints s/step and the reward's critical-path seconds of each
(the mean over the steps after the first, which boots the pool), and whether both runs did the same work (each
step's mean score and response length equal: the same seed samples the same responses); nothing is asserted.

    python -m verl.bench.reward_pool [--workers 4] [--steps 4] [--sleep-ms 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

SLOW_SCORER = '''import os
import time

from verl.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(os.environ["VERL_BENCH_REWARD_SLEEP_MS"]) / 1000)  # stands for a slow scorer or a remote call
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def _run(out: str, data_dir: str, scorer: str, workers: int, steps: int, sleep_ms: float, batch: int,
         n: int) -> dict[str, float]:
    from verl.utils.tracking import read_metrics

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "verl.cli", "train", "--config", os.path.join(repo, "configs", "grpo_arith_tiny.yaml"),
           f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
           f"data.tokenizer={data_dir}/tokenizer", f"trainer.output_dir={out}", "trainer.logger=[console]",
           f"data.train_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}", f"trainer.total_training_steps={steps}",
           # one micro-batch a rank (the config's 64 at the figure's 32 x 4)
           f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={max(1, batch * n // 2)}",
           "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
           f"custom_reward_function.path={scorer}", f"reward.num_workers={workers}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=repo, OMP_NUM_THREADS="1", VERL_BENCH_REWARD_SLEEP_MS=str(sleep_ms))
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"verl train exited {proc.returncode}: {proc.stderr[-2000:]}")
    every = read_metrics(out)
    records = [r for r in every if r["step"] > 1]
    summary = {key: sum(r[f"timing_s/{key}"] for r in records) / len(records) for key in ("step", "reward")}
    # The work done, step by step: the same seed samples the same responses, which the same scorer scores alike.
    summary["work"] = [(r["step"], r["critic/score/mean"], r["response_length/mean"]) for r in every]
    return summary


def benchmark(workers: int = 4, steps: int = 4, sleep_ms: float = 20.0, batch: int = 32, n: int = 4) -> dict:
    """Both runs' mean ``timing_s/step`` and ``timing_s/reward`` over steps 2..``steps``, printed and returned."""
    from verl.utils.dataset import arithmetic

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "data")
        arithmetic.main(["--out", data_dir, "--num-train", str(batch * steps), "--num-test", "4"])
        scorer = os.path.join(tmp, "slow_scorer.py")
        with open(scorer, "w", encoding="utf-8") as f:
            f.write(SLOW_SCORER)
        results = {label: _run(os.path.join(tmp, label), data_dir, scorer, w, steps, sleep_ms, batch, n)
                   for label, w in (("in_step", 0), (f"pool_{workers}", workers))}
    samples = batch * n
    print(f"reward pool: {samples} samples/step x {sleep_ms:g} ms scorer ({samples * sleep_ms / 1000:.2f} s of "
          f"scoring per rank), 2 CPU ranks, mean of steps 2..{steps}")
    for label, r in results.items():
        print(f"  {label:>10}: {r['step']:.3f} s/step, reward on the critical path {r['reward']:.3f} s")
    base, pooled = results["in_step"]["step"], results[f"pool_{workers}"]["step"]
    print(f"  step time with the pool: {pooled / base:.2f}x of in-step ({base - pooled:+.3f} s/step saved)")
    # Both sides did the same work: every step's mean score and response length are equal.
    results["same_work"] = results["in_step"]["work"] == results[f"pool_{workers}"]["work"]
    print(f"  same work on both sides (per-step score and response length): {results['same_work']}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.bench.reward_pool", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    results = benchmark(args.workers, args.steps, args.sleep_ms)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
