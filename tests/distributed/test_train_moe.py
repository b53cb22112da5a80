"""`verl train` with a Qwen3-MoE on 2 local ranks: configs/grpo_qwen3moe_tiny.yaml (actor TP1 x EP2, native
rollout TP1, random init), 2 GRPO steps, with verl's routing replay (rollout.enable_rollout_routing_replay +
actor.router_replay.mode=R3) and with a standalone rollout pool.

Each run passes the trainer's first-step check that the rollout's log-probs are the actor's (a wrong expert
reshard or replay fails it), logs verl's step metrics and the router's under actor/moe/ (layers 0-3 of the model
are all MoE layers)."""

import math

import pytest

pytest.importorskip("megatron.core")

from helpers.tiny_models import arithmetic_data_args  # noqa: E402
from helpers.train_runs import COMMON_KEYS, check_step_record, read_metrics, run_train, train_cmd  # noqa: E402

ROUTER_KEYS = ["actor/moe/load_balancing_loss", "actor/moe/load_imbalance_max",
               *(f"actor/moe/layer_{i}/{k}" for i in range(4) for k in ("load_max", "load_min", "load_imbalance"))]
STEPS = ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
         "trainer.val_before_train=false"]


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory):
    return arithmetic_data_args(tmp_path_factory.mktemp("arith"))


@pytest.mark.parametrize("extra", [
    ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "actor_rollout_ref.actor.router_replay.mode=R3"],
    ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"],
], ids=["routing_replay", "rollout_pool"])
def test_moe_grpo_steps_pass_the_rollout_check_and_log_router_metrics(tmp_path, arithmetic_data, extra):
    run_train(train_cmd("grpo_qwen3moe_tiny.yaml", tmp_path, arithmetic_data, *STEPS, *extra))
    records = read_metrics(tmp_path)
    pool = "actor_rollout_ref.rollout.nnodes=1" in extra
    keys = [k for k in COMMON_KEYS if not (pool and k == "perf/reshard_bytes")]  # a pool logs its own sync
    for step in (1, 2):
        check_step_record(records[step], step, keys + ROUTER_KEYS)
        assert all(math.isfinite(records[step][k]) for k in ROUTER_KEYS)
    # fp32 rollout and actor on the same weights and, under replay, the same routing.
    assert records[1]["training/rollout_probs_diff_max"] < 1e-4
