#!/usr/bin/env bash
# README command (A): set everything up, then the main CPU job -- a tiny Qwen2 that visibly learns
# arithmetic by RL on 2 CPU ranks: data -> SFT warm start -> GRPO (Megatron TP=2 actor, native rollout
# TP=1, so the 3D-HybridEngine reshards every step), then a summary table and a plot.
#
#   bash launch/quickstart.sh                           # -> outputs/quickstart/{metrics.jsonl,metrics.png,...}
#   bash launch/quickstart.sh --fresh                   # start over instead of resuming
#   bash launch/quickstart.sh --config configs/ppo_arith_tiny.yaml --out outputs/quickstart_ppo   # PPO + critic
#   bash launch/quickstart.sh --config configs/grpo_qwen3moe_tiny.yaml   # Qwen3-MoE, EP=2 -> outputs/quickstart_grpo_qwen3moe_tiny
#   bash launch/quickstart.sh trainer.total_training_steps=50   # extra args: verl train overrides
#   bash launch/quickstart.sh --config configs/grpo_smollm2_gsm.yaml --out outputs/quickstart_smollm2   # a real
#     pretrained chat model (SmolLM2-135M-Instruct), no SFT stage: GRPO on generated GSM8K-format word problems
#   bash launch/quickstart.sh actor_rollout_ref.rollout.name=sglang   # SGLang rollout (sets up .venv-sglang)
#   bash launch/quickstart.sh --config configs/grpo_qwen3moe_tiny.yaml actor_rollout_ref.rollout.name=vllm
#     # vLLM rollout (sets up .venv-vllm); vLLM's CPU attention needs head_dim >= 32: the MoE variant has 32, the
#     # default tiny model 16
#
# Rerunning resumes: finished stages (data, SFT) are skipped, GRPO resumes from its last checkpoint
# (trainer.resume_mode=auto); Ctrl-C during GRPO checkpoints the current step first. Under Slurm,
# `sbatch slurm/quickstart_cpu.sbatch` runs the RL stage alone (see slurm/README.md).
# A bad override or --config is one line and exit 2 before any stage runs (launch/quickstart.py checks
# both trainer configs first). Stage logs: outputs/quickstart/logs/. Details: `python -m launch.quickstart --help`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash launch/setup_env.sh
# SGLang or vLLM as the rollout (actor_rollout_ref.rollout.name=sglang|vllm): the environment holding that engine
# and Megatron.
for arg in "$@"; do
  if [[ $arg =~ rollout\.name=(sglang|vllm)$ ]]; then
    bash "launch/setup_${BASH_REMATCH[1]}.sh"
    exec ".venv-${BASH_REMATCH[1]}/bin/python" -m launch.quickstart "$@"
  fi
done
exec .venv/bin/python -m launch.quickstart "$@"
