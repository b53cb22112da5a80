"""PPO-family algorithms with verl's names, signatures and mathematics.

Shapes: ``B`` = batch size (responses), ``R`` = response length. ``response_mask`` is [B, R] with 1
on generated tokens and 0 on padding. ``index`` is a length-B array of group ids (verl's ``uid``):
responses to the same prompt share an id.

Advantage estimators are registered with :func:`register_adv_est` and looked up by
:func:`get_adv_estimator_fn`; policy losses with :func:`register_policy_loss` /
:func:`get_policy_loss_fn`, so a new algorithm is one decorated function.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F
from verl.errors import InputError
from verl.utils.registry_names import RegistryNames


class AdvantageEstimator(str, Enum):
    """Names accepted by ``algorithm.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"


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
        raise InputError(f"unknown advantage estimator '{name}'; expected one of {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss (signature of :func:`compute_policy_loss_vanilla`)."""

    def decorator(fn: Callable) -> Callable:
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"policy loss '{name}' is already registered to {POLICY_LOSS_REGISTRY[name].__name__}")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


ADV_ESTIMATOR_NAMES = RegistryNames(ADV_ESTIMATOR_REGISTRY, sort=True)  # the registry's names when checked
POLICY_LOSS_NAMES = RegistryNames(POLICY_LOSS_REGISTRY, sort=True)


def get_policy_loss_fn(name: str) -> Callable:
    if name not in POLICY_LOSS_REGISTRY:
        raise InputError(f"unknown policy loss '{name}'; expected one of {sorted(POLICY_LOSS_REGISTRY)}")
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
            raise InputError(f"algorithm.kl_ctrl.horizon: expected > 0, found {horizon}")
        return AdaptiveKLController(
            init_kl_coef=_cfg(kl_ctrl, "kl_coef", 0.001), target_kl=_cfg(kl_ctrl, "target_kl", 0.1), horizon=horizon
        )
    raise InputError(f"algorithm.kl_ctrl.type: expected 'fixed' or 'adaptive', found {ctrl_type!r}")


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


def _group_ids(index: np.ndarray, scores: torch.Tensor) -> torch.Tensor:
    """Dense group numbers 0..G-1 [B] in order of first appearance (any hashable labels)."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index: expected {scores.shape[0]} group ids (one per response), found {len(index)}")
    ids: dict[Any, int] = {}
    return torch.tensor([ids.setdefault(gid, len(ids)) for gid in index], dtype=torch.long, device=scores.device)


def _sorted_group_ids(index: np.ndarray | torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Dense group numbers 0..G-1 [B] of any group labels, by sorting (np.unique), not by a Python loop."""
    if isinstance(index, torch.Tensor):
        group = torch.unique(index.reshape(-1), return_inverse=True)[1].to(scores.device)
    else:
        labels = np.asarray(index).reshape(-1)
        try:
            inverse = np.unique(labels, return_inverse=True)[1]
        except TypeError:  # labels of mixed types do not sort: group by their text
            inverse = np.unique(np.array([str(v) for v in labels]), return_inverse=True)[1]
        group = torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(scores.device)
    if group.numel() != scores.shape[0]:
        raise ValueError(f"index: expected {scores.shape[0]} group ids (one per response), found {group.numel()}")
    return group


def _group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response [B]: its group's mean score, unbiased std (0 for a group of one) and size, for dense group
    numbers ``group`` [B]."""
    groups = int(group.max()) + 1 if group.numel() else 0
    size = torch.bincount(group, minlength=groups).to(scores.dtype)
    mean = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, scores) / size
    squares = torch.zeros_like(mean).index_add_(0, group, (scores - mean[group]) ** 2)
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    return mean[group], std[group], size[group]


def _grpo_advantages(scores: torch.Tensor, group: torch.Tensor, epsilon: float,
                     norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    """Per response [B]: (s - mean_group) / (std_group + epsilon), or s - mean_group; a group of one has mean 0
    and std 1."""
    mean, std, size = _group_stats(scores, group)
    alone = size == 1
    centered = scores - torch.where(alone, torch.zeros_like(mean), mean)
    return centered / (torch.where(alone, torch.ones_like(std), std) + epsilon) if norm_adv_by_std_in_grpo \
        else centered


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True, config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: outcome score normalised within its group of responses to the same prompt.

    Args: token_level_rewards [B, R], response_mask [B, R], index [B] group ids.
    Returns: (advantages, returns), both [B, R] = per-sequence advantage broadcast over the mask.

    A = (s - mean_group) / (std_group + epsilon) (std unbiased), or s - mean_group when
    ``norm_adv_by_std_in_grpo`` is False (Dr.GRPO). A group of one has mean 0 and std 1.
    """
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        advantages = _grpo_advantages(scores, _group_ids(index, scores), epsilon, norm_adv_by_std_in_grpo)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
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
        mean, _, size = _group_stats(scores, _group_ids(index, scores))
        ratio = size / (size - 1).clamp(min=1)
        advantages = torch.where(size > 1, scores * ratio - mean * ratio, scores)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True, config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO as :func:`compute_grpo_outcome_advantage` (same result), with the groups found by sorting the
    labels and the group statistics in float32 tensor ops, so large batches need no per-row Python.

    Args: token_level_rewards [B, R], response_mask [B, R], index [B] group ids.
    Returns: (advantages, returns), both [B, R].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        values = scores.float()
        advantages = _grpo_advantages(values, _sorted_group_ids(index, values), epsilon, norm_adv_by_std_in_grpo)
        advantages = advantages.to(scores.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as :func:`compute_rloo_outcome_advantage` (same result), from group counts and sums:
    A = (n * s - sum_group) / (n - 1) = s - mean(others); a group of one gets 0 (verl's vectorized form).

    Args: token_level_rewards [B, R], response_mask [B, R], index [B].
    Returns: (advantages, returns), both [B, R].
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        mean, _, size = _group_stats(scores, _sorted_group_ids(index, scores))
        advantages = (scores - mean) * size / (size - 1).clamp(min=1) * (size > 1)
        advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, config: Any = None,
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
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch mask.

    Args: token_level_rewards [B, R], response_mask [B, R], index [B].
    Returns: (advantages, returns), both [B, R]: whiten((s - mean_group) * mask) * mask
    (a group of one has baseline 0).
    """
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        mean, _, size = _group_stats(scores, _group_ids(index, scores))
        centered = scores - torch.where(size > 1, mean, torch.zeros_like(mean))
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
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _global_count(what: str, given: Any, local: torch.Tensor, dp_size: int) -> torch.Tensor | float:
    if given is not None:
        return given
    if dp_size > 1:
        # A local count on each rank would weight the ranks' tokens unequally after DP averaging.
        raise ValueError(f"agg_loss: expected {what} (the count over all DP ranks) when dp_size > 1, found None")
    # Local fallback (verl's default); an all-masked batch gives 0 rather than 0/0.
    return local.clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None, global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, R] (micro-)batch loss matrix to a scalar, with verl's keyword arguments.

    Without the global counts the loss is that of this batch alone:
    - token-mean: sum(L*m) / sum(m);
    - token-sum: sum(L*m);
    - seq-mean-token-sum: sum_i sum_t L*m / #sequences with any token;
    - seq-mean-token-mean: sum_i (sum_t L*m / sum_t m) / #sequences with any token;
    - seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default R; Dr.GRPO's constant).

    With ``batch_num_tokens`` (tokens) / ``global_batch_size`` (sequences) counted over the whole
    mini-batch on every DP rank, the result is this micro-batch's share of the mini-batch loss, times
    ``dp_size``: adding the shares over micro-batches and averaging the gradients over DP (what
    Megatron DDP and FSDP do) gives exactly the gradient of the mini-batch loss, however the
    mini-batch is split. ``dp_size > 1`` without the count the mode needs is an error.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise InputError(f"loss_agg_mode: expected one of {list(LOSS_AGG_MODES)}, found {loss_agg_mode!r}")
    if dp_size < 1:
        raise ValueError(f"agg_loss: expected dp_size >= 1, found {dp_size}")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        tokens = _global_count("batch_num_tokens", batch_num_tokens, mask.sum(), dp_size)
        return verl_F.masked_sum(loss_mat, mask) / tokens * dp_size
    if loss_agg_mode == "token-sum":
        return verl_F.masked_sum(loss_mat, mask) * dp_size
    token_counts = mask.sum(dim=-1)
    seq_losses = (loss_mat * mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (token_counts + 1e-8)
    has_tokens = (token_counts > 0).to(loss_mat.dtype)  # all-masked sequences do not count
    sequences = _global_count("global_batch_size", global_batch_size, has_tokens.sum(), dp_size)
    loss = verl_F.masked_sum(seq_losses, has_tokens) / sequences * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        if not loss_scale_factor > 0:
            raise InputError(f"loss_scale_factor: expected > 0, found {loss_scale_factor}")
        loss = loss / loss_scale_factor
    return loss


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
    rollout_is_weights: torch.Tensor | None = None,
    **global_batch_info: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with clip-higher and dual-clip (Ye et al. 2020).

    Args: old_log_prob, log_prob, advantages, response_mask: [B, R]. ratio = exp(log_prob - old_log_prob).
    cliprange_low/high default to cliprange; the ratio is clipped to [1 - low, 1 + high].
    For A < 0 the loss is additionally capped at -A * clip_ratio_c (dual clip, clip_ratio_c > 1).
    ``global_batch_info``: :func:`agg_loss`'s dp_size, batch_num_tokens, global_batch_size, loss_scale_factor.
    Returns: pg_loss (scalar), pg_clipfrac (fraction of tokens where clipping bound the loss),
    ppo_kl (masked mean of old_log_prob - log_prob), pg_clipfrac_lower (fraction hit by the dual clip);
    the three fractions are means over this batch's tokens. ``rollout_is_weights`` [B, R] (verl's rollout
    correction, :mod:`verl.algorithms.rollout_correction`): each token's final loss is multiplied by its weight.
    """
    if clip_ratio_c <= 1.0:
        raise InputError(f"clip_ratio_c: expected > 1.0 for dual-clip PPO, found {clip_ratio_c}")
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    if cliprange_low is None or cliprange_high is None:
        raise InputError("compute_policy_loss: expected cliprange or both cliprange_low and cliprange_high, found None")
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
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Registry form of :func:`compute_policy_loss`, reading the actor config keys
    ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``loss_scale_factor``
    and, as verl, ``global_batch_info`` (agg_loss's global counts). Shapes as there."""
    global_batch_info = dict(_cfg(config, "global_batch_info", None) or {})
    global_batch_info.setdefault("loss_scale_factor", _cfg(config, "loss_scale_factor", None))
    return compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange=_cfg(config, "clip_ratio", 0.2),
        cliprange_low=_cfg(config, "clip_ratio_low", None),
        cliprange_high=_cfg(config, "clip_ratio_high", None),
        clip_ratio_c=_cfg(config, "clip_ratio_c", 3.0),
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **global_batch_info,
    )


GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"
GSPO_MAX_LOG_RATIO = 10.0


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = GSPO_LOSS_AGG_MODE,
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071), token form.

    The importance ratio is the sequence's: s_i = exp(mean_t over the response tokens of
    (log_prob - old_log_prob)), the geometric mean of the token ratios. Each token carries
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] (equal to s_i; its gradient is s_i * grad log pi(y_t)), clipped
    to [1 - clip_ratio_low, 1 + clip_ratio_high] as PPO: L_i,t = max(-A_i,t s_i,t, -A_i,t clip(s_i,t)).
    The log-ratio is capped at 10 before exp(); there is no dual clip.

    As verl, the loss is always aggregated ``seq-mean-token-mean`` (1/G sum_i 1/|y_i| sum_t L_i,t, GSPO's
    objective) whatever ``loss_agg_mode`` says; config keys as :func:`compute_policy_loss_vanilla` (clip_ratio,
    clip_ratio_low, clip_ratio_high, loss_scale_factor, global_batch_info). Shapes [B, R].
    Returns: pg_loss, pg_clipfrac (fraction of tokens where the clip bound the loss), ppo_kl (masked mean
    of old_log_prob - log_prob) and pg_clipfrac_lower (0: no dual clip).
    """
    clip_ratio = _cfg(config, "clip_ratio", 0.2)
    low = _cfg(config, "clip_ratio_low", None)
    high = _cfg(config, "clip_ratio_high", None)
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    if low is None or high is None:
        raise InputError("compute_policy_loss_gspo: expected clip_ratio or both clip_ratio_low and clip_ratio_high, "
                         "found None")
    global_batch_info = dict(_cfg(config, "global_batch_info", None) or {})
    global_batch_info.setdefault("loss_scale_factor", _cfg(config, "loss_scale_factor", None))

    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_MAX_LOG_RATIO))

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:  # verl's rollout correction, on each token's loss as for vanilla
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, GSPO_LOSS_AGG_MODE, **global_batch_info)
    pg_clipfrac = verl_F.masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **global_batch_info: Any
) -> torch.Tensor:
    """Aggregated entropy of the policy: logits [B, R, V], response_mask [B, R] -> scalar
    (``global_batch_info`` as :func:`agg_loss`)."""
    entropy = verl_F.entropy_from_logits(logits)
    return agg_loss(entropy, response_mask, loss_agg_mode, **global_batch_info)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((V - G)^2, (clip(V, V_old ± c) - G)^2)).

    Args: vpreds (new values), returns, values (old values), response_mask: [B, R]; the last four
    are :func:`agg_loss`'s global counts.
    Returns: vf_loss (scalar), vf_clipfrac (fraction of this batch's tokens where the clipped term is larger).
    """
    vpred_clipped = verl_F.clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, dp_size=dp_size,
                             batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                             loss_scale_factor=loss_scale_factor)
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
    raise InputError(
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
