"""core_algos / advantage against hand-computed values (derivations in the comments)."""

import math
import statistics

import numpy as np
import pytest
import torch

from verl.protocol import DataProto, DataProtoError
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.advantage import apply_kl_penalty, compute_advantage
from verl.utils import torch_functional as verl_F


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("VERL_STRICT_DATA_CHECK", "1")


def whiten(xs):
    """Oracle for masked_whiten on the valid entries: (x - mean) / sqrt(unbiased var + 1e-8)."""
    mean, var = statistics.mean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------------------- GAE
# gamma=0.9, lam=0.8 (gamma*lam = 0.72).
# Row 0, mask [1,1,1], r=[0,0,1], V=[0.5,0.6,0.7]:
#   t2: delta = 1 - 0.7 = 0.3                 A2 = 0.3
#   t1: delta = 0.9*0.7 - 0.6 = 0.03          A1 = 0.03 + 0.72*0.3   = 0.246
#   t0: delta = 0.9*0.6 - 0.5 = 0.04          A0 = 0.04 + 0.72*0.246 = 0.21712
# Row 1, mask [1,1,0], r=[0,2,0], V=[1.0,0.5,9.0] (9.0 sits on padding and must be ignored):
#   t2: masked -> running advantage and bootstrap value stay 0
#   t1: delta = 2 + 0.9*0 - 0.5 = 1.5         A1 = 1.5
#   t0: delta = 0.9*0.5 - 1.0 = -0.55         A0 = -0.55 + 0.72*1.5 = 0.53
# returns = raw A + V; advantages = whiten(raw A over the 5 valid tokens).
def test_gae_three_token_example_with_mask():
    rewards = t([[0, 0, 1], [0, 2, 0]])
    values = t([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    raw = [0.21712, 0.246, 0.3, 0.53, 1.5]
    valid = mask.bool()
    torch.testing.assert_close(ret[valid], t([0.71712, 0.846, 1.0, 1.53, 2.0]))
    torch.testing.assert_close(adv[valid], t(whiten(raw)))


def test_gae_with_gamma_lam_one_returns_are_reward_to_go():
    # gamma = lam = 1: returns = sum of future rewards = 1 on every token of row 0.
    rewards = t([[0, 0, 1], [0, 0, 0]])
    values = t([[0.5, 0.6, 0.7], [0.1, 0.2, 0.3]])
    _, ret = core_algos.compute_gae_advantage_return(rewards, values, torch.ones(2, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, t([[1, 1, 1], [0, 0, 0]]))


# ----------------------------------------------------------------------------- outcome estimators
# Scores (row sums): 1, 0, 0.5 with groups a, a, b.
# Group a: mean 0.5, unbiased std sqrt((0.25+0.25)/1) = sqrt(0.5) -> A = +-0.5/sqrt(0.5) = +-0.70711.
# Group b has one member: mean 0, std 1 -> A = 0.5 / (1 + 1e-6).
GRPO_REWARDS = [[0, 0, 1], [0, 0, 0], [0, 0.5, 0]]
GRPO_MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]


def test_grpo_group_of_one_uses_mean_zero_std_one():
    index = np.array(["a", "a", "b"], dtype=object)
    adv, ret = core_algos.compute_grpo_outcome_advantage(t(GRPO_REWARDS), t(GRPO_MASK), index)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    b = 0.5 / (1 + 1e-6)
    torch.testing.assert_close(adv, t([[a, a, a], [-a, -a, -a], [b, b, 0]]))
    assert ret is adv


def test_grpo_without_std_normalisation_is_mean_centred():
    index = np.array(["a", "a", "b"], dtype=object)
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        t(GRPO_REWARDS), t(GRPO_MASK), index, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(adv, t([[0.5] * 3, [-0.5] * 3, [0.5, 0.5, 0]]))


def test_grpo_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="expected 3 group ids"):
        core_algos.compute_grpo_outcome_advantage(t(GRPO_REWARDS), t(GRPO_MASK), np.array(["a", "b"]))


def test_rloo_subtracts_mean_of_other_responses():
    # Group a = {1, 0, 0.5}: 1 - (0+0.5)/2 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0. Group b = {2}: raw 2.
    rewards = t([[1, 0], [0, 0], [0, 0.5], [0, 2]])
    mask = torch.ones(4, 2)
    adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, np.array([0, 0, 0, 1]))
    torch.testing.assert_close(adv, t([[0.75] * 2, [-0.75] * 2, [0, 0], [2, 2]]))


def _grouped_rewards(seed, sizes, response_length=5):
    """fp32 token rewards of responses in shuffled groups of the given sizes; labels as strings."""
    g = torch.Generator().manual_seed(seed)
    labels = np.array([f"uid-{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    order = torch.randperm(len(labels), generator=g).numpy()
    rewards = torch.randn(len(labels), response_length, generator=g)
    mask = (torch.rand(len(labels), response_length, generator=g) > 0.2).long()
    return rewards, mask, labels[order]


def _fp32_bound(rewards, index, n):
    """The two forms sum each group in a different order: each group sum of n fp32 terms is off by at most
    (n - 1) * eps * sum|s|, which the division by the group std can magnify by max|s| / min std."""
    scores = rewards.sum(-1)
    groups = [scores[torch.as_tensor(index == gid)] for gid in set(index)]
    smallest = min((g.std().item() for g in groups if g.numel() > 1), default=1.0)
    return 4 * n * torch.finfo(torch.float32).eps * scores.abs().max().item() / min(smallest, 1.0)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_matches_the_grouped_form(norm):
    sizes = [2, 3, 8, 16, 1]  # group of one included: mean 0, std 1 in both forms
    rewards, mask, index = _grouped_rewards(0, sizes)
    expected, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    adv, ret = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    bound = _fp32_bound(rewards, index, max(sizes))
    torch.testing.assert_close(adv, expected, rtol=bound, atol=bound)
    assert ret is adv and adv.dtype == torch.float32
    # Group ids as integers or as a tensor give the same groups.
    as_ints = np.array([int(u.split("-")[1]) for u in index])
    for ids in (as_ints, torch.as_tensor(as_ints)):
        again, _ = core_algos.compute_grpo_vectorized_outcome_advantage(
            rewards, mask, ids, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(again, adv, rtol=0, atol=0)


def test_rloo_vectorized_matches_the_grouped_form_and_zeroes_a_group_of_one():
    sizes = [2, 4, 7, 16]
    rewards, mask, index = _grouped_rewards(1, sizes)
    expected, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, index)
    adv, _ = core_algos.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    # No std division here: n * s - sum is off by about n * eps * sum|s| / (n - 1).
    bound = 4 * max(sizes) * torch.finfo(torch.float32).eps * rewards.sum(-1).abs().max().item()
    torch.testing.assert_close(adv, expected, rtol=bound, atol=bound)
    # verl's vectorized RLOO gives a response with no other in its group 0 (the grouped form keeps its score).
    alone, _ = core_algos.compute_rloo_vectorized_outcome_advantage(t([[0, 2]]).float(), torch.ones(1, 2), ["x"])
    assert alone.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="expected 2 group ids"):
        core_algos.compute_rloo_vectorized_outcome_advantage(t([[1.0]] * 2), torch.ones(2, 1), ["a"])


def test_vectorized_estimators_are_registered_under_verls_names():
    assert core_algos.AdvantageEstimator("grpo_vectorized") is core_algos.AdvantageEstimator.GRPO_VECTORIZED
    assert core_algos.get_adv_estimator_fn("grpo_vectorized") is core_algos.compute_grpo_vectorized_outcome_advantage
    assert core_algos.get_adv_estimator_fn("rloo_vectorized") is core_algos.compute_rloo_vectorized_outcome_advantage
    rewards = t([[0, 1], [0, 0], [0, 0.5], [0, 1.5]])
    mask = torch.ones(4, 2, dtype=torch.long)

    def batch():
        return DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask},
                                   {"uid": np.array(["a", "a", "b", "b"], dtype=object)})

    # Group a = {1, 0}: mean 0.5; group b = {0.5, 1.5}: mean 1 -> Dr.GRPO (no std): +-0.5 in each group.
    data = compute_advantage(batch(), "grpo_vectorized", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(data.batch["advantages"], t([[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.5]]))
    # RLOO: s - mean(others) = +-1 in each group of two.
    data = compute_advantage(batch(), "rloo_vectorized")
    torch.testing.assert_close(data.batch["advantages"], t([[1, 1], [-1, -1], [-1, -1], [1, 1]]))
    with pytest.raises(DataProtoError, match=r"compute_advantage\(rloo_vectorized\): expected non_tensor_batch field"):
        compute_advantage(DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask}),
                          "rloo_vectorized")


def test_reinforce_plus_plus_discounts_and_stops_at_padding():
    # gamma = 0.5. Row 0 r=[0,0,1]: G = [0.25, 0.5, 1]. Row 1 r=[0,1,5], mask [1,1,0]: the padded
    # reward 5 is cut off by the mask, G = [0.5, 1, (5)]. Advantages = whiten over the 5 valid G, 0 on pad.
    rewards = t([[0, 0, 1], [0, 1, 5]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret[mask.bool()], t([0.25, 0.5, 1, 0.5, 1]))
    torch.testing.assert_close(adv[mask.bool()], t(whiten([0.25, 0.5, 1, 0.5, 1])))
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    # Scores 1, 0 (group a, mean 0.5) and 3 (group b, alone -> baseline 0): centred 0.5, -0.5, 3,
    # broadcast over the 2 + 2 + 1 valid tokens, whitened together.
    rewards = t([[0, 1], [0, 0], [3, 0]])
    mask = t([[1, 1], [1, 1], [1, 0]])
    adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        rewards, mask, np.array(["a", "a", "b"], dtype=object)
    )
    torch.testing.assert_close(adv[mask.bool()], t(whiten([0.5, 0.5, -0.5, -0.5, 3])))
    assert adv[2, 1] == 0


def test_remax_subtracts_greedy_baseline_from_return_to_go():
    # Row 0 G=[1,1,1], b=0.5 -> 0.5 each; row 1 r=[0,2,0] mask [1,1,0] G=[2,2,0], b=1 -> [1,1,0].
    rewards = t([[0, 0, 1], [0, 2, 0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = core_algos.compute_remax_outcome_advantage(rewards, t([0.5, 1.0]), mask)
    torch.testing.assert_close(ret, t([[1, 1, 1], [2, 2, 0]]))
    torch.testing.assert_close(adv, t([[0.5] * 3, [1, 1, 0]]))


# ----------------------------------------------------------------------------- policy / value loss
# old_log_prob = 0, so ratio = exp(log_prob); cliprange 0.2 -> ratio clipped to [0.8, 1.2]; c = 3.
#   t0: A=+1, r=1.5: max(-1.5, -1.2) = -1.2          (clipped)
#   t1: A=-1, r=0.5: max(0.5, 0.8) = 0.8, min(3, 0.8) = 0.8 (clipped)
#   t2: A=-1, r=5.0: max(5.0, 1.2) = 5.0, min(3, 5.0) = 3   (dual clip)
#   t3: A=+2, r=1.0: -2
# token-mean = (-1.2 + 0.8 + 3 - 2) / 4 = 0.15; clipfrac 2/4; clipfrac_lower 1/4;
# ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 5 + 0) / 4.
RATIOS = [1.5, 0.5, 5.0, 1.0]
ADVANTAGES = [1.0, -1.0, -1.0, 2.0]


def test_policy_loss_dual_clip_branch():
    log_prob = torch.log(t([RATIOS])).requires_grad_(True)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
        old_log_prob=torch.zeros(1, 4, dtype=torch.float64),
        log_prob=log_prob,
        advantages=t([ADVANTAGES]),
        response_mask=torch.ones(1, 4),
        cliprange=0.2,
        clip_ratio_c=3.0,
    )
    torch.testing.assert_close(pg_loss, torch.tensor(0.15, dtype=torch.float64))
    assert clipfrac.item() == pytest.approx(0.5)
    assert clipfrac_lower.item() == pytest.approx(0.25)
    assert ppo_kl.item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(5.0)) / 4)
    pg_loss.backward()
    # Clipped and dual-clipped tokens carry no gradient; t3 carries d(-A r)/d logp / 4 = -2 * 1 / 4.
    torch.testing.assert_close(log_prob.grad, t([[0, 0, 0, -0.5]]))


def test_policy_loss_clip_higher_uses_asymmetric_bounds():
    # cliprange_low 0.2, cliprange_high 0.28: t0 clips at 1.28 instead of 1.2 -> (-1.28+0.8+3-2)/4 = 0.13.
    pg_loss, *_ = core_algos.compute_policy_loss(
        torch.zeros(1, 4, dtype=torch.float64),
        torch.log(t([RATIOS])),
        t([ADVANTAGES]),
        torch.ones(1, 4),
        cliprange=0.2,
        cliprange_low=0.2,
        cliprange_high=0.28,
    )
    assert pg_loss.item() == pytest.approx(0.13)


def test_policy_loss_ignores_masked_tokens_and_rejects_bad_clip_ratio_c():
    log_prob = torch.log(t([RATIOS + [100.0]]))
    pg_loss, *_ = core_algos.compute_policy_loss(
        torch.zeros(1, 5, dtype=torch.float64),
        log_prob,
        t([ADVANTAGES + [-50.0]]),
        torch.tensor([[1, 1, 1, 1, 0]]),
        cliprange=0.2,
    )
    assert pg_loss.item() == pytest.approx(0.15)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        core_algos.compute_policy_loss(log_prob, log_prob, log_prob, torch.ones(1, 5), cliprange=0.2, clip_ratio_c=1.0)


def test_registered_vanilla_policy_loss_reads_actor_config_keys():
    fn = core_algos.get_policy_loss_fn("vanilla")
    out = fn(
        torch.zeros(1, 4, dtype=torch.float64),
        torch.log(t([RATIOS])),
        t([ADVANTAGES]),
        torch.ones(1, 4),
        config={"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
    )
    assert out[0].item() == pytest.approx(0.13)


def test_value_loss_clips_around_old_values():
    # t0: clip(1.0, 0-0.5, 0+0.5) = 0.5; max((1-1.2)^2, (0.5-1.2)^2) = 0.49 (clipped term larger)
    # t1: clip(2, 1.5, 2.5) = 2;        max(4, 4) = 4                     (equal, not counted)
    # vf_loss = 0.5 * (0.49 + 4) / 2 = 1.1225; clipfrac 1/2.
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
        vpreds=t([[1.0, 2.0]]),
        returns=t([[1.2, 0.0]]),
        values=t([[0.0, 2.0]]),
        response_mask=torch.ones(1, 2),
        cliprange_value=0.5,
    )
    assert vf_loss.item() == pytest.approx(1.1225)
    assert vf_clipfrac.item() == pytest.approx(0.5)


# ----------------------------------------------------------------------------- KL estimators
# log p = [-1, -2], log q = [-1.5, -1]: d = log p - log q = [0.5, -1].
#   k1 = d = [0.5, -1]; abs = [0.5, 1]; k2 = d^2/2 = [0.125, 0.5];
#   k3 = e^{-d} + d - 1 = [e^-0.5 - 0.5, e^1 - 2] = [0.1065307, 0.7182818].
KL_CASES = {
    "kl": [0.5, -1.0],
    "k1": [0.5, -1.0],
    "abs": [0.5, 1.0],
    "mse": [0.125, 0.5],
    "k2": [0.125, 0.5],
    "low_var_kl": [math.exp(-0.5) - 0.5, math.e - 2],
    "k3": [math.exp(-0.5) - 0.5, math.e - 2],
}


@pytest.mark.parametrize("name", sorted(KL_CASES))
def test_kl_estimator_values(name):
    out = core_algos.kl_penalty(t([[-1.0, -2.0]]), t([[-1.5, -1.0]]), name)
    torch.testing.assert_close(out, t([KL_CASES[name]]))


@pytest.mark.parametrize("name", sorted(KL_CASES))
def test_kl_straight_through_keeps_value_and_takes_k2_gradient(name):
    logprob = t([[-1.0, -2.0]]).requires_grad_(True)
    out = core_algos.kl_penalty(logprob, t([[-1.5, -1.0]]), name + "+")
    torch.testing.assert_close(out.detach(), t([KL_CASES[name]]))
    out.sum().backward()
    # d/dlogp of (logp - logq)^2 / 2 = d = [0.5, -1].
    torch.testing.assert_close(logprob.grad, t([[0.5, -1.0]]))


def test_low_var_kl_is_clamped_and_unknown_name_rejected():
    # ref - logp = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10.
    out = core_algos.kl_penalty(t([[-30.0]]), t([[0.0]]), "low_var_kl")
    assert out.item() == 10.0
    with pytest.raises(ValueError, match="expected one of"):
        core_algos.kl_penalty(t([[0.0]]), t([[0.0]]), "k4")


# ----------------------------------------------------------------------------- agg_loss / entropy
# L = [[1,2,3],[4,5,6]], m = [[1,1,1],[1,0,0]]; masked sums: 6 and 4 (3 + 1 tokens, R = 3).
AGG_CASES = {
    "token-mean": 10 / 4,
    "token-sum": 10,
    "seq-mean-token-sum": (6 + 4) / 2,
    "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,
    "seq-mean-token-sum-norm": (6 + 4) / 2 / 3,  # verl 0.9.1: the sequence mean over R (was sum / R)
}


@pytest.mark.parametrize("mode", sorted(AGG_CASES))
def test_agg_loss_modes(mode):
    out = core_algos.agg_loss(t([[1, 2, 3], [4, 5, 6]]), t([[1, 1, 1], [1, 0, 0]]), mode)
    assert out.item() == pytest.approx(AGG_CASES[mode])


def verl_agg_loss(loss, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl 0.9.1's agg_loss (verl/trainer/ppo/core_algos.py) written out with Python lists."""
    rows = list(zip(loss.tolist(), mask.tolist(), strict=True))
    seq_sums = [sum(x * m for x, m in zip(lr, mr, strict=True)) for lr, mr in rows]
    seq_tokens = [sum(mr) for _, mr in rows]
    if mode == "token-mean":
        tokens = sum(seq_tokens) if batch_num_tokens is None else batch_num_tokens
        return sum(seq_sums) / tokens * dp_size
    if mode == "token-sum":
        return sum(seq_sums) * dp_size
    kept = [i for i, n in enumerate(seq_tokens) if n > 0]  # fully masked sequences are excluded
    sequences = len(kept) if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        per_seq = [seq_sums[i] / (seq_tokens[i] + 1e-8) for i in kept]
    else:
        per_seq = [seq_sums[i] for i in kept]
    out = sum(per_seq) / sequences * dp_size
    if mode == "seq-mean-token-sum-norm":
        out /= loss.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return out


def ragged_batch(seed, rows=6, width=5):
    """Random losses with a mask of ragged lengths, one row fully masked."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, width, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float64)
    return loss, mask


GLOBAL_KWARGS = [
    {},
    {"loss_scale_factor": 7.0},
    {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 12},
    {"dp_size": 4, "batch_num_tokens": 17, "global_batch_size": 9, "loss_scale_factor": 2.5},
    {"batch_num_tokens": 3, "global_batch_size": 30},
]


@pytest.mark.parametrize("kwargs", GLOBAL_KWARGS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "local")
@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_agg_loss_matches_verl_091(mode, kwargs):
    loss, mask = ragged_batch(seed=len(kwargs))
    out = core_algos.agg_loss(loss, mask, mode, **kwargs)
    assert out.item() == pytest.approx(verl_agg_loss(loss, mask, mode, **kwargs), rel=1e-12)


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_agg_loss_global_shares_add_up_to_the_full_batch_loss_and_gradient(mode):
    # 2 DP ranks x 2 micro-batches of 3 rows with unequal token counts (every row has a token, so the
    # row count is also verl's local sequence count). Each share is normalised by the global counts and
    # scaled by dp_size; adding the shares over micro-batches and averaging over the ranks (DDP's
    # gradient average) must give the loss and the gradient of the whole batch in one piece.
    loss, mask = ragged_batch(seed=11, rows=12, width=6)
    mask[2, 0] = 1
    full_leaf = loss.clone().requires_grad_(True)
    full = core_algos.agg_loss(full_leaf, mask, mode, loss_scale_factor=4.0)
    full.backward()
    split_leaf = loss.clone().requires_grad_(True)
    counts = {"dp_size": 2, "batch_num_tokens": mask.sum(), "global_batch_size": 12, "loss_scale_factor": 4.0}
    shares = [core_algos.agg_loss(split_leaf[i:i + 3], mask[i:i + 3], mode, **counts) for i in range(0, 12, 3)]
    split = (shares[0] + shares[1] + shares[2] + shares[3]) / 2
    split.backward()
    assert split.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(split_leaf.grad, full_leaf.grad)


def test_agg_loss_local_share_is_not_dp_invariant():
    # The reason for the global counts: per-rank token means weight the ranks' tokens unequally.
    loss, mask = ragged_batch(seed=11, rows=12, width=6)
    local = sum(core_algos.agg_loss(loss[i:i + 6], mask[i:i + 6], "token-mean") for i in (0, 6)) / 2
    assert abs(local.item() - core_algos.agg_loss(loss, mask, "token-mean").item()) > 1e-3


def test_agg_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        core_algos.agg_loss(t([[1.0]]), t([[1.0]]), "token-max")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        core_algos.agg_loss(t([[1.0]]), t([[1.0]]), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        core_algos.agg_loss(t([[1.0]]), t([[1.0]]), "seq-mean-token-mean", dp_size=2, batch_num_tokens=4)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        core_algos.agg_loss(t([[1.0]]), t([[1.0]]), "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="dp_size"):
        core_algos.agg_loss(t([[1.0]]), t([[1.0]]), "token-sum", dp_size=0)


def test_agg_loss_all_masked_batch_is_zero_not_nan():
    for mode in core_algos.LOSS_AGG_MODES:
        assert core_algos.agg_loss(t([[1.0, 2.0]]), t([[0.0, 0.0]]), mode).item() == 0.0


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_policy_and_value_losses_take_verl_global_kwargs(mode):
    g = torch.Generator().manual_seed(3)
    log_prob, old_log_prob, advantages, vpreds, values, returns = (
        torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.3 for _ in range(6))
    _, mask = ragged_batch(seed=4, rows=4, width=5)
    counts = {"dp_size": 2, "batch_num_tokens": 23, "global_batch_size": 8, "loss_scale_factor": 3.0}
    # With cliprange 10 and clip_ratio_c 1e9 nothing is clipped: the loss matrix is -A * ratio.
    pg_loss, *_ = core_algos.compute_policy_loss(old_log_prob, log_prob, advantages, mask, cliprange=10.0,
                                                 clip_ratio_c=1e9, loss_agg_mode=mode, **counts)
    surrogate = -advantages * torch.exp(log_prob - old_log_prob)
    assert pg_loss.item() == pytest.approx(verl_agg_loss(surrogate, mask, mode, **counts), rel=1e-12)
    # The registry form reads verl's config.global_batch_info and config.loss_scale_factor.
    config = {"clip_ratio": 10.0, "clip_ratio_c": 1e9, "loss_scale_factor": 3.0,
              "global_batch_info": {"dp_size": 2, "batch_num_tokens": 23, "global_batch_size": 8}}
    vanilla, *_ = core_algos.get_policy_loss_fn("vanilla")(old_log_prob, log_prob, advantages, mask, mode, config)
    assert vanilla.item() == pytest.approx(pg_loss.item(), rel=1e-12)
    # Value loss with a huge clip range: 0.5 * agg((V - G)^2).
    vf_loss, _ = core_algos.compute_value_loss(vpreds, returns, values, mask, cliprange_value=1e9,
                                               loss_agg_mode=mode, **counts)
    expected = 0.5 * verl_agg_loss((vpreds - returns) ** 2, mask, mode, **counts)
    assert vf_loss.item() == pytest.approx(expected, rel=1e-12)


def test_entropy_loss_of_known_distributions():
    # Row 0: uniform over 4 -> ln 4. Row 1: p = [1/4, 3/4, 0-ish...] via logits [0, ln 3, -inf-ish]
    # -> -(1/4 ln 1/4 + 3/4 ln 3/4). Third token is masked.
    logits = t([[[0, 0, 0, 0], [0, math.log(3), -1e4, -1e4], [5, 0, 0, 0]]])
    expected = (math.log(4) + (0.25 * math.log(4) + 0.75 * math.log(4 / 3))) / 2
    out = core_algos.compute_entropy_loss(logits, torch.tensor([[1, 1, 0]]))
    assert out.item() == pytest.approx(expected)


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="at least two"):
        verl_F.masked_var(t([1.0, 2.0]), t([1.0, 0.0]))


# ----------------------------------------------------------------------------- KL controllers / registries
def test_adaptive_kl_controller_moves_towards_target():
    ctrl = core_algos.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0, "horizon": 100})
    ctrl.update(current_kl=2.0, n_steps=10)  # error clipped to +0.2 -> x (1 + 0.2*10/100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.5, n_steps=10)  # error -0.5 clipped to -0.2 -> x 0.98
    assert ctrl.value == pytest.approx(0.102 * 0.98)
    restored = core_algos.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "target_kl": 1.0, "horizon": 100})
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_kl_controller_and_bad_type():
    ctrl = core_algos.get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    ctrl.update(current_kl=9.0, n_steps=100)
    assert ctrl.value == 0.05
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        core_algos.get_kl_controller({"type": "pid"})


def test_registries_list_builtins_and_reject_duplicates():
    for est in core_algos.AdvantageEstimator:
        assert callable(core_algos.get_adv_estimator_fn(est))
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        core_algos.get_adv_estimator_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        core_algos.register_adv_est("grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="unknown policy loss"):
        core_algos.get_policy_loss_fn("nope")


# ----------------------------------------------------------------------------- DataProto drivers
def _batch(**tensors):
    return DataProto.from_dict(tensors, {"uid": np.array(["a", "a", "b"], dtype=object)})


def test_apply_kl_penalty_subtracts_beta_times_kl_on_mask():
    # k1 per token = old - ref = [[0.5, 0.5], [1, (pad)], [0, 0]]; beta = 0.1.
    # Per-sequence masked means 0.5, 1, 0 -> batch mean 0.5.
    data = _batch(
        token_level_scores=t([[0, 1], [0, 0], [1, 0]]),
        old_log_probs=t([[-1, -1], [-1, -1], [-2, -2]]),
        ref_log_prob=t([[-1.5, -1.5], [-2, -9], [-2, -2]]),
        response_mask=torch.tensor([[1, 1], [1, 0], [1, 1]]),
    )
    ctrl = core_algos.FixedKLController(0.1)
    data, metrics = apply_kl_penalty(data, ctrl, kl_penalty="kl")
    torch.testing.assert_close(data.batch["token_level_rewards"], t([[-0.05, 0.95], [-0.1, 0], [1, 0]]))
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.5), "actor/reward_kl_penalty_coeff": 0.1}


def test_compute_advantage_dispatches_on_dataproto_fields():
    rewards = t([[0, 1], [0, 0], [0, 0.5]])
    mask = torch.ones(3, 2, dtype=torch.long)
    data = compute_advantage(_batch(token_level_rewards=rewards, response_mask=mask), "grpo")
    expected, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, np.array(["a", "a", "b"], dtype=object))
    torch.testing.assert_close(data.batch["advantages"], expected)

    data = compute_advantage(
        _batch(token_level_rewards=rewards, response_mask=mask, values=t([[0.1, 0.2]] * 3)),
        core_algos.AdvantageEstimator.GAE,
        gamma=1.0,
        lam=1.0,
    )
    # gamma = lam = 1: returns = reward-to-go.
    torch.testing.assert_close(data.batch["returns"], t([[1, 1], [0, 0], [0.5, 0.5]]))

    data = compute_advantage(_batch(token_level_rewards=rewards, response_mask=mask), "rloo")
    # Group a = {1, 0}: 1 - 0 = 1 and 0 - 1 = -1; group b alone keeps 0.5.
    torch.testing.assert_close(data.batch["advantages"], t([[1, 1], [-1, -1], [0.5, 0.5]]))

    with pytest.raises(DataProtoError, match="reward_baselines"):
        compute_advantage(_batch(token_level_rewards=rewards, response_mask=mask), "remax")
    with pytest.raises(DataProtoError, match="'values'"):
        compute_advantage(_batch(token_level_rewards=rewards, response_mask=mask), "gae")


def test_compute_advantage_uses_user_registered_estimator():
    @core_algos.register_adv_est("test_sign_only")
    def sign_only(token_level_rewards, response_mask, config=None, index=None):
        sign = torch.sign(token_level_rewards.sum(-1, keepdim=True)) * response_mask
        return sign, sign

    try:
        rewards = t([[0, 2], [0, -1], [0, 0]])
        mask = torch.ones(3, 2, dtype=torch.long)
        data = compute_advantage(_batch(token_level_rewards=rewards, response_mask=mask), "test_sign_only")
        torch.testing.assert_close(data.batch["advantages"], t([[1, 1], [-1, -1], [0, 0]]))
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("test_sign_only")


def test_verls_public_path_is_the_module_the_workers_and_trainer_use():
    """A recipe registering through verl's path (verl.trainer.ppo.core_algos) registers in the one registry
    the roles and the trainer read (verl.algorithms.core_algos, a layer below the workers)."""
    import verl.algorithms.core_algos as lower
    from verl.trainer.ppo import core_algos as public

    assert public is lower

    @public.register_adv_est("test_public_path_estimator")
    def estimator(**kwargs):
        return kwargs

    try:
        assert lower.get_adv_estimator_fn("test_public_path_estimator") is estimator
    finally:
        del lower.ADV_ESTIMATOR_REGISTRY["test_public_path_estimator"]
