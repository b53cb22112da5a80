"""verl-equal loss aggregation through the roles' loss hooks and the Megatron micro-batch loop.

The same 4-row PPO mini-batch (ragged response masks: 8 tokens in rows 0-1, 5 in rows 2-3) trains one
step, for every ``loss_agg_mode``, of the actor (policy_loss_fn: pg + entropy + KL terms) and of the
critic (value_loss_fn), laid out as
  dp2      TP1 x DP2 on 2 gloo ranks, one micro-batch of 2 rows each, global counts (the roles' path);
  dp1_mb2  DP1 on 1 rank, two micro-batches of 2 rows, global counts;
  full     DP1, one micro-batch of 4 rows, verl's default local aggregation: the definition of the loss;
  dp2_local  as dp2 with local aggregation (what the roles did before): it differs for token-mean.
  dp2_tokens   as dp2 with token-budget micro-batches (verl's use_dynamic_bsz) of 12 tokens: one row each;
  dp1_tokens   DP1 with a 31-token budget: micro-batches of 3 rows and 1 row;
  dp1_tokens22 DP1 with a 22-token budget: rows {0, 2} and {1, 3}, out of the batch's order.
lr = 0 and no clipping, so the gradients Megatron all-reduced into ``main_grad`` are compared directly; the
log-probs and values each layout computes (forward micro-batches cut the same way) are compared too.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, hf_model, padded_batch, save_hf  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402
from verl.trainer.ppo.core_algos import LOSS_AGG_MODES  # noqa: E402

ROWS = 4


def _config(mode: str):
    from omegaconf import OmegaConf

    actor = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                              "loss_agg_mode": mode, "entropy_coeff": 0.01, "use_kl_loss": True,
                              "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "loss_scale_factor": None,
                              "policy_loss": {"loss_mode": "vanilla"}})
    critic = OmegaConf.create({"cliprange_value": 0.5, "loss_agg_mode": mode, "loss_scale_factor": 3.0})
    return actor, critic


def _grads(engine) -> dict[str, torch.Tensor]:
    return {name: param.main_grad.detach().clone() for name, param in engine.model.module.named_parameters()}


def _grad_job(actor_dir, critic_dir, batch, layouts):
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor, Critic
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model
    from verl.workers.actor_rollout_ref_worker import POLICY_LOSS_SHARES, policy_loss_fn
    from verl.workers.critic_worker import value_loss_fn
    from verl.workers.role_utils import global_batch_info

    initialize_megatron(1, 1, seed=3)
    optim = OptimConfig(lr=0.0, weight_decay=0.0, clip_grad=0.0)  # lr 0: every mode starts from the same weights
    actor_config, critic_config = ModelConfig.from_pretrained(actor_dir), ModelConfig.from_pretrained(critic_dir)
    actor_engine = MegatronEngine(actor_config, optim=optim)
    load_hf_into_model(actor_engine.module, actor_config, HFCheckpoint(actor_dir).get)
    critic_engine = MegatronEngine(critic_config, head="value", optim=optim)
    checkpoint = HFCheckpoint(critic_dir)
    value_head = torch.randn(1, critic_config.hidden_size, generator=torch.Generator().manual_seed(9))
    load_hf_into_model(critic_engine.module, critic_config,
                       lambda name: value_head if name == "score.weight" else checkpoint.get(name), "value")
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    share = ROWS // dp
    mine = {k: v[dp_rank * share:(dp_rank + 1) * share] for k, v in batch.items()}

    results = {}
    for layout, (micro_batch, global_loss, *budget) in layouts.items():
        max_token_len = budget[0] if budget else None
        actor = Actor(actor_engine, micro_batch, max_token_len=max_token_len)
        critic = Critic(critic_engine, micro_batch, max_token_len=max_token_len,
                                forward_max_token_len=max_token_len)
        # Old log-probs near the current ones (some ratios clip), a reference policy further off.
        log_probs = actor.compute_log_prob(mine, calculate_entropy=False)["log_probs"]
        values = critic.compute_values(mine)["values"]
        data = dict(mine, old_log_probs=log_probs + 0.3 * mine["noise_old"],
                    ref_log_prob=log_probs + 0.5 * mine["noise_ref"])
        counts = global_batch_info(mine["response_mask"]) if global_loss else {}
        for mode in LOSS_AGG_MODES:
            actor_cfg, critic_cfg = _config(mode)
            m = actor.update_policy(data, policy_loss_fn(actor_cfg, counts), calculate_entropy=True,
                                    global_loss=global_loss, summed_metrics=POLICY_LOSS_SHARES)
            actor_grads = _grads(actor_engine)
            c = critic.update_critic(data, value_loss_fn(critic_cfg, counts), global_loss=global_loss,
                                     summed_metrics=("critic/vf_loss",))
            results[layout, mode] = {"actor": actor_grads, "critic": _grads(critic_engine),
                                     "pg_loss": m["actor/pg_loss"], "loss": m["loss"], "vf_loss": c["critic/vf_loss"],
                                     "log_probs": log_probs, "values": values}
    destroy_megatron()
    if dp_rank == 0:
        return results
    # The DP ranks hold the same all-reduced gradients; their forward results are their own rows'.
    return {key: {"log_probs": r["log_probs"], "values": r["values"]} for key, r in results.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    actor_dir = save_hf(hf_model("qwen2_gqa_tied", seed=5), str(tmp_path_factory.mktemp("actor")), sharded=False)
    critic_dir = save_hf(hf_model("llama_gqa_untied", seed=6), str(tmp_path_factory.mktemp("critic")), sharded=False)
    batch = padded_batch(seed=2, batch=ROWS)
    batch["response_mask"] = batch["attention_mask"][:, -RESPONSE:].float()
    assert batch["response_mask"].sum(dim=1).tolist() == [4, 4, 2, 3]  # unequal tokens per DP rank: 8 and 5
    g = torch.Generator().manual_seed(4)
    for name in ("advantages", "returns", "values", "noise_old", "noise_ref"):
        batch[name] = torch.randn(ROWS, RESPONSE, generator=g)
    assert batch["attention_mask"].sum(dim=1).tolist() == [12, 9, 10, 9]  # the token budgets below rely on it
    dp2 = run_ranks(_grad_job, 2, actor_dir, critic_dir, batch, {"dp2": (2, True), "dp2_local": (2, False),
                                                                 "dp2_tokens": (2, True, 12)}, timeout_s=300)
    dp1 = run_ranks(_grad_job, 1, actor_dir, critic_dir, batch, {"dp1_mb2": (2, True), "full": (4, False),
                                                                 "dp1_tokens": (2, True, 31),
                                                                 "dp1_tokens22": (2, True, 22)}, timeout_s=300)[0]
    for layout in ("dp2", "dp2_tokens"):  # each DP rank's half of the rows, in order
        for key in ("log_probs", "values"):
            dp2[0][layout, LOSS_AGG_MODES[0]][key] = torch.cat([dp2[r][layout, LOSS_AGG_MODES[0]][key]
                                                                for r in (0, 1)])
    return dp2[0] | dp1


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _scale(grads: dict[str, torch.Tensor]) -> float:
    return max(g.abs().max().item() for g in grads.values())


GLOBAL_LAYOUTS = ["dp2", "dp1_mb2", "dp2_tokens", "dp1_tokens", "dp1_tokens22"]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("layout", GLOBAL_LAYOUTS)
def test_gradient_is_the_full_batch_gradient(runs, layout, role, mode):
    full, got = runs["full", mode][role], runs[layout, mode][role]
    assert _scale(full) > 1e-4, "the reference gradient vanished: nothing would be compared"
    worst = _max_diff(got, full)
    assert worst <= 1e-5 * _scale(full), f"{layout} {role} {mode}: max |grad - full-batch grad| = {worst:.3e}"


@pytest.mark.parametrize("layout", GLOBAL_LAYOUTS)
def test_token_budget_forward_returns_rows_in_the_batch_order(runs, layout):
    for key in ("log_probs", "values"):
        full, got = runs["full", LOSS_AGG_MODES[0]][key], runs[layout, LOSS_AGG_MODES[0]][key]
        assert torch.allclose(got, full, rtol=1e-5, atol=1e-6), f"{layout} {key}"


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("layout", GLOBAL_LAYOUTS)
def test_reported_losses_are_the_mini_batch_losses(runs, layout, mode):
    for key in ("pg_loss", "loss", "vf_loss"):
        assert runs[layout, mode][key] == pytest.approx(runs["full", mode][key], rel=1e-5, abs=1e-7), key


def test_local_aggregation_is_not_dp_invariant(runs):
    # What the roles did before: a token mean per DP rank over 8 and 5 tokens, averaged by DDP.
    full, local = runs["full", "token-mean"]["actor"], runs["dp2_local", "token-mean"]["actor"]
    assert _max_diff(local, full) > 1e-3 * _scale(full)
