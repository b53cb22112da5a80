"""LoRA's keys in `verl train` (verl.engine.lora): accepted on both backends, and bad LoRA input is one line, exit 2,
before any rank starts: a rank <= 0 with LoRA on, targets that match nothing, the other backend's keys, a model
LoRA does not support (MoE), and an adapter directory whose rank or shapes do not fit the model."""

import json
import os

import pytest
import torch
from helpers.tiny_models import write_arithmetic_data

from verl.trainer import main_ppo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
NO_SAVES = ["trainer.save_freq=-1", "trainer.export_hf_at_end=false"]
MEGATRON = ["actor_rollout_ref.model.lora.rank=4", *NO_SAVES]
FSDP = ["model_engine=dp", "actor_rollout_ref.model.lora_rank=4", *NO_SAVES]


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


@pytest.fixture
def no_ranks(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    spawned = []
    monkeypatch.setattr("verl.launcher.spawn.spawn_local",
                        lambda nproc, argv, **kwargs: spawned.append(nproc) or 0)
    monkeypatch.setattr(main_ppo, "run_rank", lambda config, dry_run: pytest.fail("a rank was started"))
    return spawned


def expect_exit_2(capsys, argv, *fragments):
    assert main_ppo.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_lora_keys_are_accepted_on_both_backends(data_args, no_ranks):
    assert main_ppo.main(["--config", GRPO, *data_args, *MEGATRON]) == 0
    assert main_ppo.main(["--config", GRPO, *data_args, *FSDP,
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                          "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]) == 0
    # checkpoints (save_lora_only or not) and HF export of a LoRA actor are accepted
    assert main_ppo.main(["--config", GRPO, *data_args, "actor_rollout_ref.model.lora.rank=4", "trainer.save_freq=1",
                          "trainer.export_hf_every_save=true", "actor_rollout_ref.actor.checkpoint.save_lora_only=true",
                          "actor_rollout_ref.actor.checkpoint.export_merged=true"]) == 0
    assert no_ranks == [2, 2, 2]


def test_bad_lora_input_is_one_line(data_args, no_ranks, capsys, tmp_path):
    base = ["--config", GRPO, *data_args]
    expect_exit_2(capsys, [*base, "actor_rollout_ref.model.lora.rank=-1"], "actor_rollout_ref.model.lora.rank")
    expect_exit_2(capsys, [*base, "model_engine=dp", "actor_rollout_ref.model.lora_rank=-2"],
                  "actor_rollout_ref.model.lora_rank")
    expect_exit_2(capsys, [*base, *MEGATRON, "actor_rollout_ref.model.lora.target_modules=[linear_qvk]"],
                  "actor_rollout_ref.model.lora.target_modules", "linear_qvk", "none matching")
    expect_exit_2(capsys, [*base, *FSDP, "actor_rollout_ref.model.target_modules=[q_prj]"],
                  "actor_rollout_ref.model.target_modules", "q_prj")
    expect_exit_2(capsys, [*base, "actor_rollout_ref.model.lora_rank=8"], "actor_rollout_ref.model.lora_rank",
                  "lora.rank")
    # An adapter of another rank, then one whose shapes are another model's.
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 32}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 999)},
              str(adapter / "adapter_model.safetensors"))
    expect_exit_2(capsys, [*base, *MEGATRON, f"actor_rollout_ref.model.lora.adapter_path={adapter}"],
                  "actor_rollout_ref.model.lora.adapter_path", "rank 4", "r=8")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 32}))
    expect_exit_2(capsys, [*base, *MEGATRON, f"actor_rollout_ref.model.lora.adapter_path={adapter}"],
                  "q_proj.lora_A.weight", "(4, 999)", "another base model")
    expect_exit_2(capsys, [*base, *MEGATRON, f"actor_rollout_ref.model.lora.adapter_path={tmp_path / 'none'}"],
                  "adapter_config.json")


PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")


def test_critic_lora_keys_are_accepted_on_both_backends(data_args, no_ranks):
    assert main_ppo.main(["--config", PPO, *data_args, "critic.model.lora.rank=4", *NO_SAVES]) == 0
    assert main_ppo.main(["--config", PPO, *data_args, "model_engine=dp", "critic.model.lora_rank=4",
                          "critic.model.target_modules=[q_proj,v_proj]", *NO_SAVES]) == 0
    assert no_ranks == [2, 2]


def test_bad_critic_lora_input_is_one_line(data_args, no_ranks, capsys):
    base = ["--config", PPO, *data_args, *NO_SAVES]
    expect_exit_2(capsys, [*base, "critic.model.lora.rank=4", "critic.model.lora.alpha=-1"],
                  "critic.model.lora.alpha")
    expect_exit_2(capsys, [*base, "model_engine=dp", "critic.model.lora_rank=4", "critic.model.target_modules=[q_prj]"],
                  "critic.model.target_modules", "q_prj", "none matching")
    expect_exit_2(capsys, [*base, "critic.model.lora.rank=4", "critic.model.lora.target_modules=[linear_qvk]"],
                  "critic.model.lora.target_modules", "linear_qvk")
    expect_exit_2(capsys, [*base, "critic.model.lora_rank=8"], "critic.model.lora_rank", "critic.model.lora.rank")
    expect_exit_2(capsys, [*base, "model_engine=dp", "critic.model.lora.rank=8"], "critic.model.lora.rank",
                  "critic.model.lora_rank")
    assert no_ranks == []
