"""vLLM as the trainer's rollout (`actor_rollout_ref.rollout.name=vllm`): GRPO on the arithmetic task, 2 CPU ranks,
Megatron TP2 actor, one in-process vLLM engine per rank fed by the 3D-HybridEngine's reshard and vLLM's in-place
reload at every step. Every step's rollout log-probs are the actor's (``training/rollout_probs_diff_max`` within the
fp32 bound of this model), the run ends with exit 0 (vLLM's shutdown leaves the trainer's process group alone) and
no rank outlives it. The model: the arithmetic task's 0.7M Qwen2 (head_dim 32; the quickstart's has 16, which
vLLM's CPU attention does not take).

With LoRA (``model.lora``, merge=false: the base once, then the adapters alone, merged by each rollout rank into the
buffer it pushes to vLLM) the same bound holds at every step: a step whose adapters did not reach vLLM samples from
the base. A length reward (responses to one prompt score differently) makes every step's update move the adapters
(B starts at zero; lr 1e-2)."""

import json
import os
import subprocess

import pytest
import torch
from helpers.tolerance import log_prob_tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
MODEL = os.path.join(ROOT, "configs", "models", "qwen2_0p7m_arith.json")
STEPS = 3
# |p_rollout - p_actor| <= |log p difference| for p <= 1: the log-prob bound of two fp32 forwards (another sharding
# of the same weights: Megatron TP2 vs vLLM TP1), widest reduction the MLP's 352 terms, 4 layers, 32-token vocab.
TOL = log_prob_tolerance(torch.float32, width=352, num_layers=4, vocab=32)


LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.model.lora.merge=false", "actor_rollout_ref.actor.optim.lr=1e-2"]
LENGTH_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
                "    return (len(solution_str) % 4) / 4.0\n"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_with_vllm_rollout_runs_and_matches_the_actor(vllm_python, tmp_path, lora):
    verl = os.path.join(os.path.dirname(vllm_python), "verl")
    data = tmp_path / "data"
    subprocess.run([verl, "data", "arithmetic", "--out", str(data), "--num-train", "200", "--num-test", "16"],
                   check=True, capture_output=True, cwd=ROOT, timeout=120)
    out = tmp_path / "out"
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    reward = [f"custom_reward_function.path={tmp_path / 'length_reward.py'}",
              "custom_reward_function.name=compute_score"]
    cmd = [verl, "train", "--config", CONFIG, f"data.train_files={data / 'train.parquet'}",
           f"data.val_files={data / 'test.parquet'}", f"data.tokenizer={data / 'tokenizer'}",
           f"actor_rollout_ref.model.path={MODEL}", "actor_rollout_ref.rollout.name=vllm",
           f"trainer.total_training_steps={STEPS}", f"trainer.output_dir={out}", "trainer.save_freq=-1",
           *(LORA + reward if lora else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r.get("step", 0) >= 1}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, record in steps.items():
        assert record["training/rollout_probs_diff_max"] <= TOL, (step, record["training/rollout_probs_diff_max"])
        assert record["response_length/mean"] > 0
        if lora:  # the base went before step 1; each step's sync moves the adapters alone, after a real update
            assert record["perf/reshard_bytes"] == record["perf/lora_sync_bytes"] > 0, record
            assert record["actor/grad_norm"] > 0, record
    # The export: the adapters as PEFT writes them (LoRA) or the whole HF model.
    assert (out / "actor_hf" / ("adapter_model.safetensors" if lora else "config.json")).is_file()
