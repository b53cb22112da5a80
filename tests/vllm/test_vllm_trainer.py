"""vLLM as the trainer's rollout (`actor_rollout_ref.rollout.name=vllm`): GRPO on the arithmetic task, 2 CPU ranks,
one in-process vLLM engine per rank fed by the 3D-HybridEngine's reshard and vLLM's in-place reload at every step.
Every step's rollout log-probs are the actor's (``training/rollout_probs_diff_max`` within the fp32 bound of the
model), the run ends with exit 0 (vLLM's shutdown leaves the trainer's process group alone) and no rank outlives it.
Three runs:

- ``full``: Megatron TP2 actor, the arithmetic task's 0.7M Qwen2 (head_dim 32; the quickstart's has 16, which vLLM's
  CPU attention does not take);
- ``lora``: the same with LoRA (``model.lora``, merge=false: the base once, then the adapters alone, merged by each
  rollout rank into the buffer it pushes to vLLM). A step whose adapters did not reach vLLM samples from the base;
- ``colocate_async``: verl's V1 colocate_async with vLLM generating (partial rollout: segments in rounds, resumed
  on new weights; tests/vllm/test_vllm_rollout.py checks the resumes): trains on groups a version old, verl's
  off-policy metrics every step (the bound does not apply to off-policy rollouts);
- ``separate_async``: verl's V1 separate_async, vLLM on a standalone pool (2 training ranks, 1 rollout rank)
  generating without pause while the training ranks train per mini-batch: the weights reach it over the pool's
  bridge (``perf/weight_sync_bytes``) and vLLM's reload, and step 1 (groups sampled on version 0) is within the
  bound;
- ``moe``: the tiny Qwen3-MoE (8 experts, top 2), Megatron EP2 actor: the stacked experts reach vLLM's fused MoE as
  their per-expert HF tensors, and vLLM's CPU kernel packs them again after every reload (without that the first
  step is off by ~1e-2 and the trainer stops);
- ``rollout_tp2``: rollout TP 2, both ranks one vLLM engine (vLLM's external launcher, a TP worker per rank), each
  rank's reshard writing its own shard of the rollout layout, which the push copies into vLLM's per-rank parameters.

A length reward (responses to one prompt score differently) in every run but ``full`` makes every step's
update move the weights (LoRA's B starts at zero; lr 1e-2), so a later step's bound checks the weights of that step.
"""

import json
import os
import subprocess

import pytest
import torch
from helpers.tolerance import log_prob_tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.model.lora.merge=false", "actor_rollout_ref.actor.optim.lr=1e-2"]
POOL = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1"]
ASYNC = ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async",
         "algorithm.rollout_correction.rollout_is=token"]
SEPARATE_ASYNC = ["trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async", *POOL]
LENGTH_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
                "    return (len(solution_str) % 4) / 4.0\n"
# (config, model, extra overrides, whether the length reward drives it, the model's widest reduction)
RUNS = {
    "full": ("grpo_arith_tiny.yaml", "qwen2_0p7m_arith.json", [], False, 352),
    "lora": ("grpo_arith_tiny.yaml", "qwen2_0p7m_arith.json", LORA, True, 352),
    "colocate_async": ("grpo_arith_tiny.yaml", "qwen2_0p7m_arith.json", ASYNC, True, 352),
    "separate_async": ("grpo_arith_tiny.yaml", "qwen2_0p7m_arith.json", SEPARATE_ASYNC, True, 352),
    "moe": ("grpo_qwen3moe_tiny.yaml", "qwen3moe_tiny_arith.json", [], True, 128),
    "rollout_tp2": ("grpo_arith_tiny.yaml", "qwen2_0p7m_arith.json",
                    ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], True, 352),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_grpo_with_vllm_rollout_runs_and_matches_the_actor(vllm_python, tmp_path, run):
    config, model, extra, length_reward, width = RUNS[run]
    # |p_rollout - p_actor| <= |log p difference| for p <= 1: the log-prob bound of two fp32 forwards (another
    # sharding of the same weights: Megatron TP2 / EP2 vs vLLM TP1), 4 layers, 32-token vocab.
    tol = log_prob_tolerance(torch.float32, width=width, num_layers=4, vocab=32)
    verl = os.path.join(os.path.dirname(vllm_python), "verl")
    data = tmp_path / "data"
    subprocess.run([verl, "data", "arithmetic", "--out", str(data), "--num-train", "200", "--num-test", "16"],
                   check=True, capture_output=True, cwd=ROOT, timeout=120)
    out = tmp_path / "out"
    if length_reward:
        (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
        extra = [*extra, f"custom_reward_function.path={tmp_path / 'length_reward.py'}",
                 "custom_reward_function.name=compute_score"]
    cmd = [verl, "train", "--config", os.path.join(ROOT, "configs", config),
           f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
           f"data.tokenizer={data / 'tokenizer'}", f"actor_rollout_ref.model.path={ROOT}/configs/models/{model}",
           "actor_rollout_ref.rollout.name=vllm", f"trainer.total_training_steps={STEPS}",
           f"trainer.output_dir={out}", "trainer.save_freq=-1", "trainer.val_before_train=false", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    if run == "rollout_tp2":  # vLLM itself says it runs TP 2 over the trainer's ranks
        logs = proc.stdout + proc.stderr
        assert "tensor_parallel_size=2" in logs and "external_launcher" in logs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r.get("step", 0) >= 1}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, record in steps.items():
        if run.endswith("async"):  # trained on rollouts a version old: verl's off-policy metrics, no bound
            assert "training/off_policy/trajectory_staleness_worst/max" in record, step
            assert run == "separate_async" or "rollout_corr/rollout_is_mean" in record, step
            if run == "separate_async" and step == 1:  # the pool's first groups: version 0, the actor's weights
                assert record["training/rollout_probs_diff_max"] <= tol, record["training/rollout_probs_diff_max"]
        else:
            assert record["training/rollout_probs_diff_max"] <= tol, (step, record["training/rollout_probs_diff_max"])
        assert record["response_length/mean"] > 0
        if length_reward:  # each step's update moved the weights the next step samples from
            assert record["actor/grad_norm"] > 0, record
        if run == "lora":  # the base goes with step 1's sync only; every later sync moves the adapters alone
            assert record["perf/lora_sync_bytes"] > 0 and ("perf/lora_base_sync_bytes" in record) == (step == 1)
            assert step == 1 or record["perf/reshard_bytes"] == record["perf/lora_sync_bytes"], record
        # each update crossed to the pool (step 1's weights are the first sync's)
        if run == "separate_async" and step > 1:
            assert record["perf/weight_sync_bytes"] > 0, record
    if run == "colocate_async":  # the warm-up batch, generated on version 0, trained at step 2 or later (by the
        # policy, not by timing; separate_async's staleness depends on the pool's pace)
        assert max(steps[k]["training/off_policy/trajectory_staleness_worst/max"] for k in steps if k > 1) >= 1
    # The export: the adapters as PEFT writes them (LoRA) or the whole HF model.
    assert (out / "actor_hf" / ("adapter_model.safetensors" if run == "lora" else "config.json")).is_file()
