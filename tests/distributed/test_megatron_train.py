"""Training through get_forward_backward_func on 4 gloo ranks: the loss hook, micro-batches, DDP,
the (distributed) optimizer, grad clipping and the LR schedule.

One spawned job trains the same HF initialisation on the same global batch at TP1 (x DP4),
TP2 x DP2 (distributed optimizer), PP2 (x DP2) and TP2 x PP2, and a critic at TP2 x PP2.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, hf_model, model_config, padded_batch, save_hf, sft_loss  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

STEPS = 20
GLOBAL_BATCH = 8
MICRO_BATCH = 2
RUNS = {  # name -> (tp, pp, distributed optimizer)
    "tp1": (1, 1, False),
    "tp2_dp2_distopt": (2, 1, True),
    "pp2": (1, 2, False),
    "tp2_pp2": (2, 2, False),
}




def value_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"].float()
    loss = (((outputs["values"] - micro_batch["returns"]) ** 2) * mask).sum() / mask.sum()
    return loss, {}


def _train_job(hf_dir, critic_dir, batch):
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor, Critic
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = model_config(hf_dir)
    curves = {}
    for name, (tp, pp, distopt) in RUNS.items():
        initialize_megatron(tp, pp, seed=3)
        optim = OptimConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=2,
                            total_training_steps=STEPS, lr_decay_style="cosine", min_lr=3e-4,
                            use_distributed_optimizer=distopt)
        engine = MegatronEngine(config, optim=optim)
        load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        share = GLOBAL_BATCH // dp
        my_batch = {k: v[dp_rank * share:(dp_rank + 1) * share] for k, v in batch.items()}
        actor = Actor(engine, micro_batch_size=MICRO_BATCH)
        steps = [actor.update_policy(my_batch, sft_loss) for _ in range(STEPS)]
        optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        fused = [group["fused"] for inner in optimizers for group in inner.optimizer.param_groups]
        curves[name] = {"loss": [m["loss"] for m in steps], "lr": [m["lr"] for m in steps],
                        "grad_norm": [m["grad_norm"] for m in steps], "fused_adam": fused}
        destroy_megatron()

    initialize_megatron(2, 2, seed=3)
    critic_config = model_config(critic_dir)
    engine = MegatronEngine(critic_config, head="value", optim=OptimConfig(lr=3e-3, weight_decay=0.0))
    critic = Critic(engine, micro_batch_size=MICRO_BATCH)
    curves["critic_tp2_pp2"] = {"loss": [critic.update_critic(batch, value_loss)["loss"] for _ in range(STEPS)]}
    curves["critic_values_shape"] = list(critic.compute_values(batch)["values"].shape)
    destroy_megatron()
    return curves


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    hf_dir = save_hf(hf_model("qwen2_gqa_tied", seed=5), str(tmp_path_factory.mktemp("actor")), sharded=False)
    critic_dir = save_hf(hf_model("llama_gqa_untied", seed=6), str(tmp_path_factory.mktemp("critic")), sharded=False)
    batch = padded_batch(seed=2, batch=GLOBAL_BATCH)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    batch["returns"] = torch.linspace(-1.0, 1.0, GLOBAL_BATCH * RESPONSE).reshape(GLOBAL_BATCH, RESPONSE)
    return run_ranks(_train_job, 4, hf_dir, critic_dir, batch, timeout_s=300)


@pytest.mark.parametrize("run", ["tp2_dp2_distopt", "pp2", "tp2_pp2", "critic_tp2_pp2"])
def test_loss_decreases(curves, run):
    loss = curves[0][run]["loss"]
    assert all(r[run]["loss"] == loss for r in curves), f"{run}: ranks report different losses"
    assert loss[-1] < 0.8 * loss[0], f"{run}: loss {loss[0]:.4f} -> {loss[-1]:.4f} over {STEPS} steps"


@pytest.mark.parametrize("run", ["tp2_dp2_distopt", "pp2", "tp2_pp2"])
def test_parallel_layouts_follow_the_tp1_curve(curves, run):
    reference, loss = curves[0]["tp1"]["loss"], curves[0][run]["loss"]
    worst = max(abs(a - b) for a, b in zip(reference, loss, strict=False))
    assert worst <= 1e-5, f"{run} vs tp1: max |loss difference| over {STEPS} steps = {worst:.3e}"


def test_lr_schedule_warms_up_then_decays(curves):
    lr = curves[0]["tp1"]["lr"]
    assert lr[0] < lr[1] <= 3e-3 + 1e-12 and lr[-1] < lr[2] and min(lr) >= 3e-4 - 1e-12


def test_critic_values_cover_the_response(curves):
    assert curves[0]["critic_values_shape"] == [GLOBAL_BATCH, RESPONSE]


def test_cpu_adam_runs_fused(curves):
    """Megatron's torch AdamW fallback steps every CPU tensor in one fused kernel (not a loop per tensor)."""
    for run in RUNS:
        assert curves[0][run]["fused_adam"] and all(curves[0][run]["fused_adam"]), run
