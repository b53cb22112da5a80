"""Zero configuration (issue 48 item 8): the parallel layout chosen from the model's size, the ranks and a simulated
memory per device (verl.models.layout_choice), checked against the estimator; a layout the user names wins."""

import os

import pytest

from verl.errors import InputError
from verl.models import layout_choice
from verl.models.config import ModelConfig
from verl.models.layout_choice import GiB, choose_layout
from verl.models.memory import estimate_rank_memory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "models", "qwen2_tiny_arith.json")
HALF_B = os.path.join(REPO, "configs", "models", "qwen2p5_0p5b.json")  # Qwen2.5-0.5B's shape
MOE_30B = os.path.join(REPO, "configs", "models", "qwen3moe_30b_a3b.json")


def state(model, dtype_bytes=4):
    """(the whole training state, the rollout's weights) per the estimator, unsharded."""
    whole = estimate_rank_memory(model, tp=1, pp=1, dp=1, dtype_bytes=dtype_bytes, distributed_optimizer=False)
    return whole.training_bytes, whole.rollout_bytes


def test_tiny_model_trains_data_parallel_with_fsdp_and_says_why():
    model = ModelConfig.from_pretrained(TINY)
    choice = choose_layout(model, 2, device_memory=10 * GiB, accelerator=False)
    assert (choice.engine, choice.offload, choice.rollout_tp, choice.dp) == ("fsdp", False, 1, 2)
    assert choice.overrides == {"model_engine": "dp", "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
                                "actor_rollout_ref.actor.fsdp_config.param_offload": False,
                                "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False}
    block = choice.describe().splitlines()
    assert all(line.startswith("[layout] ") for line in block)
    assert block[0] == "[layout] no parallel layout named: chose data-parallel FSDP, rollout tp=1"
    assert any("small model" in line for line in block) and any("fits without offload" in line for line in block)


def test_half_b_model_fsdp_then_offload_then_refused_as_device_memory_shrinks():
    model = ModelConfig.from_pretrained(HALF_B)
    training, rollout = state(model)
    # 80 GiB per GPU: FSDP over 2 ranks fits as it is.
    roomy = choose_layout(model, 2, device_memory=80 * GiB, accelerator=True, host_memory_bytes=512 * GiB)
    assert (roomy.engine, roomy.offload, roomy.rollout_tp) == ("fsdp", False, 1)
    assert roomy.per_rank_bytes == training // 2 + rollout
    # 6 GiB per GPU: the sharded state + rollout weights exceed 75% of it; offloaded, the device keeps the rollout's
    # half of the weights (tp 2 to fit half of the rollout's 50% share) and two gathered units.
    assert training // 2 + rollout // 2 > 0.75 * 6 * GiB
    tight = choose_layout(model, 2, device_memory=6 * GiB, accelerator=True, host_memory_bytes=512 * GiB)
    assert (tight.engine, tight.offload, tight.rollout_tp) == ("fsdp", True, 2)
    assert rollout / 2 <= 0.25 * 6 * GiB < rollout
    assert tight.overrides["actor_rollout_ref.actor.fsdp_config.param_offload"] is True
    assert "with CPU offload" in tight.describe().splitlines()[0]
    # The same memory without an accelerator: offload would move nothing; no layout fits: one error line.
    with pytest.raises(InputError, match=r"^layout: expected a layout whose estimated state fits in 4\.50 GiB "
                                         r"per device .* found [0-9.]+ GiB at Megatron tp=2 pp=1"):
        choose_layout(model, 2, device_memory=6 * GiB, accelerator=False)


def test_large_models_train_with_megatron_at_the_smallest_layout_that_fits(monkeypatch):
    model = ModelConfig.from_pretrained(HALF_B)
    monkeypatch.setattr(layout_choice, "SMALL_MAX_PARAMS", 1e8)  # the 0.5B shape as a "large" model
    choice = choose_layout(model, 4, device_memory=7 * GiB, accelerator=True, host_memory_bytes=512 * GiB)
    assert choice.engine == "megatron" and choice.overrides["model_engine"] == "megatron"
    usable = 0.75 * 7 * GiB

    def need(tp, pp):
        est = estimate_rank_memory(model, tp=tp, pp=pp, dp=4 // (tp * pp), dtype_bytes=4, rollout_tp=choice.rollout_tp)
        return est.training_bytes + est.rollout_bytes

    assert need(1, 1) > usable  # so tp grows first (2 divides the 14 heads and 2 kv heads), pp stays 1
    assert (choice.tp, choice.pp, choice.dp) == (2, 1, 2) and need(2, 1) <= usable
    assert choice.per_rank_bytes == need(2, 1)
    # A 30B MoE on 16 x 80 GiB: Megatron with expert parallelism, never FSDP.
    moe = choose_layout(ModelConfig.from_pretrained(MOE_30B), 16, device_memory=80 * GiB, accelerator=True,
                        host_memory_bytes=2048 * GiB, dtype_bytes=2)
    assert moe.engine == "megatron" and moe.ep > 1
    assert moe.overrides["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == moe.ep


def test_the_api_applies_a_choice_only_when_no_layout_is_named(capsys):
    from verl.trainer.api.dataflow import TrainerConfig, auto_layout

    tree = TrainerConfig(model=HALF_B, tokenizer="tok").verl_config(2)
    choice = auto_layout(tree, [], 2, device_memory_gib=80)
    block = capsys.readouterr().out.strip().splitlines()
    assert block[0].startswith("[layout] no parallel layout named: chose data-parallel FSDP")
    assert all(line.startswith("[layout] ") for line in block)
    assert tree["model_engine"] == "dp" and choice.engine == "fsdp"
    assert tree["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == choice.rollout_tp

    named = TrainerConfig(model=HALF_B, tokenizer="tok",
                          overrides={"actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2}).verl_config(2)
    before = repr(named)
    assert auto_layout(named, [], 2, device_memory_gib=80) is None and repr(named) == before
    plain = TrainerConfig(model=HALF_B, tokenizer="tok").verl_config(2)
    assert auto_layout(plain, ["model_engine=megatron"], 2, device_memory_gib=80) is None
    assert "model_engine" not in plain and capsys.readouterr().out == ""
