"""Training a Qwen3-MoE with expert parallelism on 4 gloo ranks: the same curve at every layout.

One spawned job trains the same HF initialisation (tests/helpers/moe_models.py "qwen3_moe": a dense layer
among MoE layers, top-2 of 4 experts) on the same global batch for a few optimizer steps at EP1 x DP4 (the
reference), EP2 (each rank holds 2 of the 4 experts), EP2 with the distributed optimizer
(dense and expert parameters in two buffers), TP2 x EP2 (with sequence parallelism) and PP2 x EP2. The
router's load-balancing loss (coefficient 0.01, megatron's aux-loss autoscaler) is part of every backward, so
a layout that dropped or double-counted it, counted padding tokens in it (EP ranks run micro-batches padded to
one agreed width: before padding_mask, a pad token's gradient moved the embedding's grad norm 2.9 -> 47), or
reduced an expert's gradient over the wrong group, leaves the reference curve.
"""

import pytest

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, padded_batch, sft_loss  # noqa: E402
from helpers.moe_models import hf_model  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 8
MICRO_BATCH = 2
RUNS = {  # name -> (tp, pp, ep, distributed optimizer)
    "ep1": (1, 1, 1, False),
    "ep2": (1, 1, 2, False),
    "ep2_distopt": (1, 1, 2, True),
    "tp2_ep2": (2, 1, 2, False),
    "pp2_ep2": (1, 2, 2, False),
}


def _train_job(hf_dir, batch):
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = ModelConfig.from_pretrained(hf_dir)
    curves = {}
    for name, (tp, pp, ep, distopt) in RUNS.items():
        initialize_megatron(tp, pp, seed=3, ep_size=ep)
        optim = OptimConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0, total_training_steps=STEPS,
                            use_distributed_optimizer=distopt)
        # megatron trains MoE under TP only with sequence parallelism (refused otherwise).
        engine = MegatronEngine(config, optim=optim, sequence_parallel=tp > 1)
        load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        share = GLOBAL_BATCH // dp
        my_batch = {k: v[dp_rank * share:(dp_rank + 1) * share] for k, v in batch.items()}
        actor = Actor(engine, micro_batch_size=MICRO_BATCH)
        steps = [actor.update_policy(my_batch, sft_loss) for _ in range(STEPS)]
        curves[name] = {"loss": [m["loss"] for m in steps], "grad_norm": [m["grad_norm"] for m in steps],
                        "router": {k: v for k, v in steps[0].items() if k.startswith("actor/moe/")}}
        destroy_megatron()
    return curves


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe"))
    hf_model("qwen3_moe", seed=5).save_pretrained(path)
    batch = padded_batch(seed=2, batch=GLOBAL_BATCH)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:]
    return run_ranks(_train_job, 4, path, batch, timeout_s=400)


def test_the_reference_learns(curves):
    loss = curves[0]["ep1"]["loss"]
    assert loss[-1] < 0.8 * loss[0], f"ep1: loss {loss[0]:.4f} -> {loss[-1]:.4f} over {STEPS} steps"


@pytest.mark.parametrize("run", [r for r in RUNS if r != "ep1"])
def test_expert_parallel_layouts_follow_the_ep1_curve(curves, run):
    """fp32, a 4-layer model whose widest reduction is 64 terms, 6 Adam steps at lr 3e-3: another summation
    order moves the loss by ~1e-7 per step; 1e-5 is the dense layouts' bound (test_megatron_train.py), and a
    wrong expert gradient (one EP rank's experts unreduced, the aux loss lost) moves it by > 1e-3."""
    assert all(r[run]["loss"] == curves[0][run]["loss"] for r in curves), f"{run}: ranks report different losses"
    for key in ("loss", "grad_norm"):
        reference, found = curves[0]["ep1"][key], curves[0][run][key]
        worst = max(abs(a - b) for a, b in zip(reference, found, strict=True))
        assert worst <= 1e-5 * max(1.0, max(abs(x) for x in reference)), \
            f"{run} vs ep1: max |{key} difference| over {STEPS} steps = {worst:.3e}"


@pytest.mark.parametrize("run", list(RUNS))
def test_router_metrics_count_every_token_once_whatever_the_layout(curves, run):
    """actor/moe/*: per MoE layer (0, 2, 3: layer 1 is dense) the load-balancing loss and the spread of the routed
    tokens over the 4 experts, the same at every layout on the first step (same weights, same tokens: a layout
    that counted a token twice or missed a DP rank's would move the fractions)."""
    reference, found = curves[0]["ep1"]["router"], curves[0][run]["router"]
    assert sorted(found) == sorted(reference)
    assert {k.split("/")[2] for k in found if k.count("/") == 3} == {"layer_0", "layer_2", "layer_3"}
    for key, value in reference.items():
        assert abs(found[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, value, found[key])
    for layer in (0, 2, 3):
        assert 0.0 <= found[f"actor/moe/layer_{layer}/load_min"] <= 0.25 <= found[f"actor/moe/layer_{layer}/load_max"]
        assert found[f"actor/moe/layer_{layer}/load_imbalance"] == pytest.approx(
            4 * found[f"actor/moe/layer_{layer}/load_max"])
        assert found[f"actor/moe/layer_{layer}/load_balancing_loss"] >= 1.0  # E * sum(f_i * P_i) >= 1, = 1 if uniform
    assert found["actor/moe/load_imbalance_max"] >= 1.0
