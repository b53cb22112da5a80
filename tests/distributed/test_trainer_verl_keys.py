"""verl's trainer keys in `verl train` on 2 local ranks (gloo, CPU, tiny Qwen2 on the arithmetic task).

- PPO (critic, DP=2) with trainer.critic_warmup=3, balance_batch, rollout/validation dumps,
  train/val_max_samples, dataloader_num_workers=2, max_actor/critic_ckpt_to_keep and token-budget
  micro-batches for every role (use_dynamic_bsz), saving every step:
  two warm-up steps, then a run resumed from the step-2 checkpoint (an actor that never stepped)
  trains the actor from step 3 and prunes the old checkpoints' parts;
- GRPO on DP=2, plain (balance_batch off, fixed micro-batches) and with balance_batch on together with
  token-budget micro-batches (use_dynamic_bsz): the first step's losses, gradient norms and statistics are
  the same (balancing moves rows between ranks inside each mini-batch; the budget only changes how each
  rank's rows are cut into micro-batches; either one changing the step makes the two runs differ).
"""

import json
import os

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import read_metrics, run_train, train_cmd  # noqa: E402


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"), num_train=200, num_test=40)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _parts(checkpoints):
    return {name: sorted(p for p in ("actor", "critic") if (checkpoints / name / p).is_dir())
            for name in sorted(os.listdir(checkpoints)) if name.startswith("global_step_")}


def test_ppo_critic_warmup_dumps_limits_workers_and_checkpoint_pruning(tmp_path, arithmetic_data):
    out = tmp_path / "run"
    keys = ["trainer.critic_warmup=3", f"trainer.rollout_data_dir={out / 'rollout'}",
            f"trainer.validation_data_dir={out / 'val'}", "data.train_max_samples=128", "data.val_max_samples=24",
            "data.dataloader_num_workers=2", "trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=2",
            "trainer.save_freq=1", "trainer.test_freq=4", "trainer.export_hf_at_end=false",
            # Micro-batch sizes of 3 rows divide no share: a role that ignored its token budget would fail.
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
            "critic.ppo_max_token_len_per_gpu=50", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "critic.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3"]
    run_train(train_cmd("ppo_arith_tiny.yaml", out, arithmetic_data, *keys, "trainer.total_training_steps=2"))
    checkpoints = out / "checkpoints"
    assert _parts(checkpoints) == {"global_step_1": ["critic"], "global_step_2": ["actor", "critic"]}
    proc = run_train(train_cmd("ppo_arith_tiny.yaml", out, arithmetic_data, *keys, "trainer.total_training_steps=4",
                               "trainer.resume_mode=auto"))
    assert "resumed from" in proc.stdout and "global_step_2" in proc.stdout
    metrics = read_metrics(out)
    assert sorted(metrics) == [0, 1, 2, 3, 4]

    # critic_warmup=3: steps 1 and 2 train only the critic (verl: the actor once critic_warmup <= step).
    for step in (1, 2, 3, 4):
        assert "critic/vf_loss" in metrics[step]
        assert ("actor/pg_loss" in metrics[step]) == (step >= 3), step
    # balance_batch (default true): verl's metrics, the balanced spread no wider than the unbalanced one.
    for step in (1, 2, 3, 4):
        m = metrics[step]
        assert m["global_seqlen/balanced_max"] - m["global_seqlen/balanced_min"] <= m["global_seqlen/minmax_diff"]
        assert m["global_seqlen/min"] <= m["global_seqlen/mean"] <= m["global_seqlen/max"]

    # rollout_data_dir: every step's 64 generations; validation_data_dir: each validation's.
    records = {step: _jsonl(out / "rollout" / f"{step}.jsonl") for step in (1, 2, 3, 4)}
    assert all(len(r) == 64 and {x["step"] for x in r} == {step} for step, r in records.items())
    assert set(records[1][0]) == {"input", "output", "gts", "score", "step"}
    assert sorted(os.listdir(out / "val")) == ["0.jsonl", "2.jsonl", "4.jsonl"]  # 2: the first run's last step
    assert len(_jsonl(out / "val" / "0.jsonl")) == 24  # val_max_samples
    # train_max_samples=128: two batches an epoch, and the second epoch's prompts are the first's.
    epoch = [{r["input"] for r in records[s]} for s in (1, 2, 3, 4)]
    assert len(epoch[0] | epoch[1]) == 128 and epoch[2] | epoch[3] == epoch[0] | epoch[1]

    # max_actor_ckpt_to_keep=1 / max_critic_ckpt_to_keep=2: the newest actor, the two newest critics.
    assert _parts(checkpoints) == {"global_step_3": ["critic"], "global_step_4": ["actor", "critic"]}
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_balance_batch_and_dynamic_bsz_do_not_change_the_step(tmp_path, arithmetic_data):
    """GRPO on DP=2 (TP=1): 512 responses, two mini-batches of 128 rows per rank; sequences of at most 14
    tokens, so a 40-token budget cuts micro-batches of 2 to 5 rows, for the log-probs, the reference and the
    update alike."""
    common = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "trainer.total_training_steps=1",
              "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
              "trainer.export_hf_at_end=false", "data.dataloader_num_workers=0",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"]
    # A random model solves nothing: all scores 0, all GRPO advantages 0, no policy gradient to compare.
    # Scoring the digits of each response gives every group a spread.
    reward = tmp_path / "digits.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return sum(c.isdigit() for c in solution_str) / 6\n")
    runs = {}
    # One run with both features on (not one run each): either one changing the step makes it differ from the
    # plain run, and each run here is mostly the 2-rank start-up.
    for name, keys in (("plain", ["trainer.balance_batch=false"]),
                       # Micro-batch sizes of 3 rows divide no share: a role that ignored the budget fails.
                       ("balanced_tokens", ["trainer.balance_batch=true",
                                            "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                                            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                                            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3"])):
        out = tmp_path / name
        run_train(train_cmd("grpo_arith_tiny.yaml", out, arithmetic_data, *common, *keys,
                            f"custom_reward_function.path={reward}"))
        runs[name] = read_metrics(out)[1]
    plain, balanced = runs["plain"], runs["balanced_tokens"]
    assert plain["critic/advantages/max"] > 0.5 and plain["actor/grad_norm"] > 1e-3
    assert balanced["global_seqlen/balanced_max"] - balanced["global_seqlen/balanced_min"] < \
        balanced["global_seqlen/minmax_diff"], "the batch was already balanced: nothing would be compared"
    # The losses (shares of each mini-batch's loss, added up) and the gradients: the training math. Not
    # compared: ppo_kl and pg_clipfrac, means per micro-batch averaged over micro-batches (as verl reports
    # them), which depend on which rows share a micro-batch.
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                "critic/advantages/mean", "critic/advantages/max", "response_length/mean"):
        assert balanced[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
