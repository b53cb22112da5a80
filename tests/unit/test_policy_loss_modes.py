"""actor.policy_loss.loss_mode: the actor's loss goes through the policy-loss registry, and GSPO (verl's
``gspo``) matches a reference written from the paper's formula, value and gradient."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos
from verl.workers.actor_rollout_ref_worker import policy_loss_fn

pytestmark = pytest.mark.unit


def _sequences(old_log_prob, log_prob, mask, low, high):
    """Per sequence with tokens: (row, its token positions, its GSPO ratio s_i, s_i clipped)."""
    for i in range(len(mask)):
        tokens = [t for t in range(len(mask[i])) if mask[i][t]]
        if tokens:
            s = math.exp(sum(log_prob[i][t] - old_log_prob[i][t] for t in tokens) / len(tokens))
            yield i, tokens, s, min(max(s, 1 - low), 1 + high)


def gspo_reference(old_log_prob, log_prob, advantages, mask, low, high):
    """GSPO-token by hand: per sequence i the ratio s_i = exp(mean_t log(pi / pi_old)) over its tokens;
    per token max(-A s_i, -A clip(s_i, 1 - low, 1 + high)); the mean over a sequence's tokens, then over
    the sequences that have tokens. Plain Python loops over floats."""
    seq_losses = []
    for i, tokens, s, clipped in _sequences(old_log_prob, log_prob, mask, low, high):
        seq_losses.append(sum(max(-advantages[i][t] * s, -advantages[i][t] * clipped) for t in tokens) / len(tokens))
    return sum(seq_losses) / len(seq_losses)


def gspo_reference_grad(old_log_prob, log_prob, advantages, mask, low, high):
    """d loss / d log_prob[i][t]: the token term's derivative is -A s_i where the unclipped term is the
    max (the clip is flat), 0 elsewhere, divided by |y_i| and the number of sequences."""
    n_seqs = sum(1 for row in mask if any(row))
    grad = [[0.0] * len(row) for row in mask]
    for i, tokens, s, clipped in _sequences(old_log_prob, log_prob, mask, low, high):
        for t in tokens:
            a = advantages[i][t]
            if -a * s >= -a * clipped:
                grad[i][t] = -a * s / len(tokens) / n_seqs
    return grad


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3 - 1.0
    new = old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.25
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 6).clone()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    return old, new, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gspo_matches_the_hand_written_formula_in_value_and_gradient(seed):
    old, new, adv, mask = batch(seed)
    low, high = 0.05, 0.08  # narrow: some sequences clip
    log_prob = new.clone().requires_grad_(True)
    config = {"clip_ratio": 0.2, "clip_ratio_low": low, "clip_ratio_high": high}
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.get_policy_loss_fn("gspo")(
        old, log_prob, adv, mask, "token-mean", config)
    args = (old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), low, high)
    # rel 1e-7: agg_loss's seq-mean-token-mean divides by (tokens + 1e-8), as verl's.
    assert pg_loss.item() == pytest.approx(gspo_reference(*args), rel=1e-7)
    pg_loss.backward()
    assert torch.allclose(log_prob.grad, torch.tensor(gspo_reference_grad(*args), dtype=torch.float64),
                          rtol=1e-7, atol=1e-14)
    assert ppo_kl.item() == pytest.approx(((old - new) * mask).sum().item() / mask.sum().item(), rel=1e-7)
    assert clipfrac_lower.item() == 0.0
    assert 0.0 <= clipfrac.item() <= 1.0


def test_gspo_ratio_is_per_sequence_not_per_token():
    # Sequence 0: token log-ratios +0.1 and -0.1 -> s = 1 (no clip at all); vanilla PPO clips both tokens.
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[0.1, -0.1]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2)
    config = {"clip_ratio": 0.05}
    gspo, gspo_clipfrac, *_ = core_algos.get_policy_loss_fn("gspo")(old, new, adv, mask, config=config)
    vanilla, vanilla_clipfrac, *_ = core_algos.get_policy_loss_fn("vanilla")(old, new, adv, mask, config=config)
    assert gspo.item() == pytest.approx(-1.0, rel=1e-7)
    assert gspo_clipfrac.item() == 0.0
    assert vanilla_clipfrac.item() == 0.5 and vanilla.item() != pytest.approx(-1.0)


def test_gspo_aggregates_seq_mean_token_mean_with_the_global_counts():
    old, new, adv, mask = batch(5)
    counts = {"dp_size": 2, "batch_num_tokens": 99, "global_batch_size": 7}
    config = {"clip_ratio": 0.2, "global_batch_info": counts, "loss_scale_factor": None}
    pg_loss, *_ = core_algos.get_policy_loss_fn("gspo")(old, new, adv, mask, "token-mean", config)
    local, *_ = core_algos.get_policy_loss_fn("gspo")(old, new, adv, mask, "token-sum", {"clip_ratio": 0.2})
    # Local: the mean over the 3 sequences with tokens; global: the same sum over 7 sequences, times dp 2.
    assert pg_loss.item() == pytest.approx(local.item() * 3 / 7 * 2, rel=1e-10)


def actor_config(mode, **extra):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                             "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False,
                             "loss_scale_factor": None, "policy_loss": {"loss_mode": mode}, **extra})


def test_the_actor_loss_uses_the_configured_registered_mode():
    old, new, adv, mask = batch(7)
    mb = {"old_log_probs": old, "advantages": adv, "response_mask": mask}
    outputs = {"log_probs": new}
    losses = {mode: policy_loss_fn(actor_config(mode), {})(outputs, mb)[0].item() for mode in ("vanilla", "gspo")}
    expected = {mode: core_algos.get_policy_loss_fn(mode)(old, new, adv, mask, "token-mean",
                                                          {"clip_ratio": 0.2})[0].item()
                for mode in ("vanilla", "gspo")}
    assert losses == pytest.approx(expected, rel=1e-12)
    assert losses["vanilla"] != pytest.approx(losses["gspo"])


def test_a_user_registered_mode_is_called_with_verl_config_access():
    seen = {}

    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        seen.update(clip=config.clip_ratio, high=config.get("clip_ratio_high"), info=config.global_batch_info,
                    mode=loss_agg_mode)
        zero = log_prob.sum() * 0
        return zero + 42.0, zero, zero, zero

    core_algos.register_policy_loss("test_user_mode")(my_loss)
    try:
        counts = {"dp_size": 1, "batch_num_tokens": 9, "global_batch_size": 4}
        old, new, adv, mask = batch(8)
        loss, metrics = policy_loss_fn(actor_config("test_user_mode", clip_ratio_high=0.3), counts)(
            {"log_probs": new}, {"old_log_probs": old, "advantages": adv, "response_mask": mask})
        assert loss.item() == 42.0 and metrics["actor/pg_loss"].item() == 42.0
        assert seen == {"clip": 0.2, "high": 0.3, "info": counts, "mode": "token-mean"}
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("test_user_mode")


def test_config_choices_come_from_the_registry():
    from verl.trainer.config.ppo import RULES

    assert set(RULES["actor_rollout_ref.actor.policy_loss.loss_mode"].choices) >= {"vanilla", "gspo"}


def test_on_policy_update_reads_the_current_log_probs_not_the_old_ones():
    """verl's on-policy actor: with one epoch over one mini-batch, old = current (detached), ratio 1."""
    from omegaconf import OmegaConf

    from verl.workers.actor_rollout_ref_worker import policy_loss_fn

    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False,
                            "loss_scale_factor": None, "policy_loss": {"loss_mode": "vanilla"}})
    torch.manual_seed(0)
    log_prob = torch.randn(4, 6, requires_grad=True)
    mb = {"response_mask": torch.ones(4, 6), "advantages": torch.randn(4, 6),
          "old_log_probs": torch.full((4, 6), float("nan"))}  # must not be read on-policy
    counts = {"dp_size": 1, "batch_num_tokens": 24, "global_batch_size": 4}
    loss, metrics = policy_loss_fn(cfg, counts, on_policy=True)({"log_probs": log_prob}, mb)
    loss.backward()
    grad = log_prob.grad.clone()
    log_prob.grad = None
    full, _ = policy_loss_fn(cfg, counts)({"log_probs": log_prob}, {**mb, "old_log_probs": log_prob.detach()})
    full.backward()
    assert torch.isfinite(loss) and loss.item() == full.item() and torch.equal(grad, log_prob.grad)
    assert metrics["actor/ppo_kl"].item() == 0.0
