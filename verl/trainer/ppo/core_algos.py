"""PPO-family algorithms with verl's names, signatures and mathematics.

Shapes: ``B`` = batch size (responses), ``R`` = response length. ``response_mask`` is [B, R] with 1
on generated tokens and 0 on padding. ``index`` is a length-B array of group ids (verl's ``uid``):
responses to the same prompt share an id.

Advantage estimators are registered with :func:`register_adv_est` and looked up by
:func:`get_adv_estimator_fn`; policy losses with :func:`register_policy_loss` /
:func:`get_policy_loss_fn`, so a new algorithm is one decorated function.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F


class AdvantageEstimator(str, Enum):
    """Names accepted by ``algorithm.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable] = {}


def _registry_name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else str(name_or_enum)


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name_or_enum``."""
    name = _registry_name(name_or_enum)

    def decorator(fn: Callable) -> Callable:
        if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name] is not fn:
            raise ValueError(
                f"advantage estimator '{name}' is already registered to {ADV_ESTIMATOR_REGISTRY[name].__name__}"
            )
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    name = _registry_name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator '{name}'; expected one of {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss (signature of :func:`compute_policy_loss_vanilla`)."""

    def decorator(fn: Callable) -> Callable:
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"policy loss '{name}' is already registered to {POLICY_LOSS_REGISTRY[name].__name__}")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss '{name}'; expected one of {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


# --------------------------------------------------------------------------- KL controllers
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): nudges ``value`` so the KL tracks ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """The coefficient is fixed; nothing to update."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict, OmegaConf node or attribute object."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller from ``algorithm.kl_ctrl`` (keys: type, kl_coef, target_kl, horizon)."""
    ctrl_type = _cfg(kl_ctrl, "type", "fixed")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=_cfg(kl_ctrl, "kl_coef", 0.001))
    if ctrl_type == "adaptive":
        horizon = _cfg(kl_ctrl, "horizon", 10000)
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon: expected > 0, found {horizon}")
        return AdaptiveKLController(
            init_kl_coef=_cfg(kl_ctrl, "kl_coef", 0.001), target_kl=_cfg(kl_ctrl, "target_kl", 0.1), horizon=horizon
        )
    raise ValueError(f"algorithm.kl_ctrl.type: expected 'fixed' or 'adaptive', found {ctrl_type!r}")


# --------------------------------------------------------------------------- advantage estimators
@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    Args: token_level_rewards [B, R], values [B, R], response_mask [B, R], gamma, lam.
    Returns: advantages [B, R] (whitened over the mask), returns [B, R] (= raw advantages + values).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, scanning right to
    left. Masked positions are skipped: they neither bootstrap V nor carry the running advantage.
    """
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_values = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages_reversed = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
            last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
            advantages_reversed.append(last_gae)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = verl_F.masked_whiten(advantages, response_mask)
    return advantages, returns


def _group_scores(scores: torch.Tensor, index: np.ndarray) -> dict[Any, list[torch.Tensor]]:
    if len(index) != scores.shape[0]:
        raise ValueError(f"index: expected {scores.shape[0]} group ids (one per response), found {len(index)}")
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    return groups


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: outcome score normalised within its group of responses to the same prompt.

    Args: token_level_rewards [B, R], response_mask [B, R], index [B] group ids.
    Returns: (advantages, returns), both [B, R] = per-sequence advantage broadcast over the mask.

    A = (s - mean_group) / (std_group + epsilon) (std unbiased), or s - mean_group when
    ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO). A group of one has mean 0 and std 1.
    """
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        groups = _group_scores(scores, index)
        group_mean, group_std = {}, {}
        for gid, members in groups.items():
            if len(members) == 1:
                group_mean[gid], group_std[gid] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(members)
                group_mean[gid], group_std[gid] = stacked.mean(), stacked.std()
        advantages = scores.clone()
        for i in range(scores.shape[0]):
            centered = scores[i] - group_mean[index[i]]
            advantages[i] = centered / (group_std[index[i]] + epsilon) if norm_adv_by_std_in_grpo else centered
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* responses of its group (leave-one-out).

    Args: token_level_rewards [B, R], response_mask [B, R], index [B].
    Returns: (advantages, returns), both [B, R].

    With n responses and group mean m: A = s * n/(n-1) - m * n/(n-1) = s - mean(others).
    A group of one keeps its raw score.
    """
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        groups = _group_scores(scores, index)
        advantages = scores.clone()
        for i in range(scores.shape[0]):
            members = groups[index[i]]
            n = len(members)
            if n > 1:
                mean = torch.stack(members).mean()
                advantages[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    config: Any = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch mask.

    Args: token_level_rewards [B, R], response_mask [B, R], gamma.
    Returns: advantages [B, R] (whitened, masked), returns [B, R] (G_t = r_t + gamma * G_{t+1}).
    """
    if config is not None:
        gamma = _cfg(config, "gamma", gamma)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            # Padding after EOS must not leak return into the tokens before it.
            running = running * response_mask[:, t]
        advantages = verl_F.masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch mask.

    Args: token_level_rewards [B, R], response_mask [B, R], index [B].
    Returns: (advantages, returns), both [B, R]: whiten((s - mean_group) * mask) * mask
    (a group of one has baseline 0).
    """
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        groups = _group_scores(scores, index)
        centered = scores.clone()
        for i in range(scores.shape[0]):
            members = groups[index[i]]
            baseline = torch.stack(members).mean() if len(members) > 1 else torch.tensor(0.0)
            centered[i] = scores[i] - baseline
        advantages = centered.unsqueeze(-1) * response_mask
        advantages = verl_F.masked_whiten(advantages, response_mask) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return-to-go minus the greedy rollout's reward as baseline.

    Args: token_level_rewards [B, R], reward_baselines [B], response_mask [B, R].
    Returns: advantages [B, R] = G_t - b (on the mask), returns [B, R] (undiscounted G_t).
    """
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# --------------------------------------------------------------------------- losses
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a [B, R] loss matrix to a scalar.

    - token-mean: sum(L*m) / sum(m) over the whole batch;
    - seq-mean-token-sum: mean over sequences of sum_t L*m;
    - seq-mean-token-mean: mean over sequences of (sum_t L*m / sum_t m);
    - seq-mean-token-sum-norm: sum(L*m) / R (Dr.GRPO's constant normaliser).
    """
    if loss_agg_mode == "token-mean":
        return verl_F.masked_mean(loss_mat, loss_mask)
    seq_sums = (loss_mat * loss_mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if loss_agg_mode == "seq-mean-token-mean":
        # The 1e-8 keeps an empty (all-masked) sequence at 0 instead of NaN.
        return (seq_sums / (loss_mask.sum(dim=-1) + 1e-8)).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / loss_mask.shape[-1]
    raise ValueError(f"loss_agg_mode: expected one of {list(LOSS_AGG_MODES)}, found {loss_agg_mode!r}")


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with clip-higher and dual-clip (Ye et al. 2020).

    Args: old_log_prob, log_prob, advantages, response_mask: [B, R]. ratio = exp(log_prob - old_log_prob).
    cliprange_low/high default to cliprange; the ratio is clipped to [1 - low, 1 + high].
    For A < 0 the loss is additionally capped at -A * clip_ratio_c (dual clip, clip_ratio_c > 1).
    Returns: pg_loss (scalar), pg_clipfrac (fraction of tokens where clipping bound the loss),
    ppo_kl (masked mean of old_log_prob - log_prob), pg_clipfrac_lower (fraction hit by the dual clip).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c: expected > 1.0 for dual-clip PPO, found {clip_ratio_c}")
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("compute_policy_loss: expected cliprange or both cliprange_low and cliprange_high, found None")
    # Clamp so exp() cannot overflow on a stale or diverged log-prob.
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3).float() * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registry form of :func:`compute_policy_loss`, reading the actor config keys
    ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``. Shapes as there."""
    clip_ratio = _cfg(config, "clip_ratio", 0.2)
    return compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange=clip_ratio,
        cliprange_low=_cfg(config, "clip_ratio_low", None),
        cliprange_high=_cfg(config, "clip_ratio_high", None),
        clip_ratio_c=_cfg(config, "clip_ratio_c", 3.0),
        loss_agg_mode=loss_agg_mode,
    )


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated entropy of the policy: logits [B, R, V], response_mask [B, R] -> scalar."""
    entropy = verl_F.entropy_from_logits(logits)
    return agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((V - G)^2, (clip(V, V_old ± c) - G)^2)).

    Args: vpreds (new values), returns, values (old values), response_mask: [B, R].
    Returns: vf_loss (scalar), vf_clipfrac (fraction of tokens where the clipped term is larger).
    """
    vpred_clipped = verl_F.clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(loss_mat=clipped_vf_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    vf_clipfrac = verl_F.masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# With a trailing "+": the straight-through variant (forward as named, gradient of k2).
KL_PENALTY_CHOICES = KL_PENALTY_TYPES + tuple(name + "+" for name in KL_PENALTY_TYPES)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs [B, R] -> [B, R].

    k1 / kl: log p - log q; abs: |log p - log q|; k2 / mse: 0.5 (log p - log q)^2;
    k3 / low_var_kl: q/p - log(q/p) - 1 (Schulman's unbiased low-variance estimator), clamped to [-10, 10].
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise ValueError(
        f"kl_penalty: expected one of {list(KL_PENALTY_TYPES)} (optionally with a '+' suffix), found {kl_penalty!r}"
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """KL estimator of type ``kl_penalty`` on [B, R] log-probs -> [B, R].

    A trailing '+' (e.g. ``k3+``) is a straight-through estimator: the forward value is the named
    estimator, the gradient is that of k2 (an unbiased gradient of the KL).
    """
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    forward_score = kl_penalty_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()
