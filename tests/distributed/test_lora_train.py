"""`verl train` GRPO with Megatron LoRA (TP 2, 2 gloo ranks, 2 steps): the run trains, the reference is the base
model with the adapters off (the KL loss is exactly 0 at step 1, when B = 0 makes actor = base, and moves after
the first update), and the rollout gets the base at the first sync and only the adapters after it (verl's default
``lora.merge=false``: fewer bytes at step 2, the first-step rollout_probs_diff_max gate holds). With
``save_lora_only`` the step-2 checkpoint holds the adapters only, and the HF export at the end is a PEFT adapter
directory (plus the merged model with ``checkpoint.export_merged``)."""

import json

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import COMMON_KEYS, check_step_record, read_metrics, run_train, train_cmd  # noqa: E402


def test_grpo_megatron_lora_two_ranks(tmp_path):
    data = arithmetic_data_args(tmp_path / "arith")
    out = tmp_path / "run"
    run_train(train_cmd("grpo_arith_tiny.yaml", out, data, "trainer.total_training_steps=2", "trainer.save_freq=2",
                        "trainer.export_hf_at_end=true", "actor_rollout_ref.actor.checkpoint.save_lora_only=true",
                        "actor_rollout_ref.actor.checkpoint.export_merged=true",
                        "trainer.test_freq=-1", "trainer.val_before_train=false",
                        "actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8",
                        "actor_rollout_ref.actor.optim.lr=1e-2",
                        # one update per step, and a gradient even where every reward of the random init is 0
                        "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.entropy_coeff=0.01"))
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        check_step_record(metrics[step], step, COMMON_KEYS + ["actor/kl_loss"])
    assert metrics[1]["actor/kl_loss"] == 0.0  # B = 0: the actor is the base, which is the reference
    assert metrics[2]["actor/kl_loss"] > 0.0  # the adapters moved the actor away from the base
    assert metrics[1]["perf/reshard_bytes"] > 0
    # adapter-only sync: step 2 moves the adapters alone (the base came at step 1)
    assert metrics[2]["perf/reshard_bytes"] == metrics[2]["perf/lora_sync_bytes"] == metrics[1]["perf/lora_sync_bytes"]
    assert metrics[2]["perf/reshard_bytes"] < metrics[1]["perf/reshard_bytes"] / 2, metrics[2]["perf/reshard_bytes"]
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3
    with open(out / "checkpoints" / "global_step_2" / "actor" / "verl_checkpoint.json") as f:
        manifest = json.load(f)
    assert manifest["lora_only"] and manifest["lora"] == {"rank": 4, "alpha": 8.0}, manifest
    assert (out / "actor_hf" / "adapter_config.json").is_file()
    assert (out / "actor_hf" / "adapter_model.safetensors").is_file()
    assert (out / "actor_hf_merged" / "config.json").is_file()
