"""Driver-side steps of one PPO iteration that act on a DataProto: KL-in-reward and advantages.

Fields read and written use verl's names: ``responses``, ``attention_mask``, ``response_mask``,
``token_level_scores``, ``token_level_rewards``, ``values``, ``old_log_probs``, ``ref_log_prob``,
``reward_baselines`` (batch, [B, R] unless noted) and ``uid`` (non_tensor_batch, group id per response).
"""

from __future__ import annotations

from typing import Any

import torch

from verl.algorithms import core_algos
from verl.algorithms.core_algos import AdvantageEstimator
from verl.protocol import DataProto, DataProtoError, strict_data_check_enabled
from verl.utils.torch_functional import masked_mean


def compute_response_mask(data: DataProto) -> torch.Tensor:
    """[B, R] mask of response tokens: the last R columns of ``attention_mask``."""
    response_length = data.batch["responses"].shape[-1]
    return data.batch["attention_mask"][:, -response_length:]


def _require(data: DataProto, keys: list[str], step: str) -> None:
    missing = [k for k in keys if k not in data.batch]
    if missing:
        raise DataProtoError(f"{step}: expected batch fields {missing}, found only {sorted(data.batch.keys())}")


def apply_kl_penalty(data: DataProto, kl_ctrl: Any, kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * KL(old_log_probs || ref_log_prob) on the mask.

    Updates ``kl_ctrl`` with the batch's mean per-sequence KL (sequence = masked token mean) and
    returns (data, metrics) with ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``
    (the beta used for this batch).
    """
    if "response_mask" not in data.batch:
        data.batch["response_mask"] = compute_response_mask(data)
    _require(data, ["token_level_scores", "old_log_probs", "ref_log_prob", "response_mask"], "apply_kl_penalty")
    response_mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty)
    kld = kld * response_mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = masked_mean(kld, mask=response_mask, axis=-1).mean(dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    if strict_data_check_enabled():
        data.check_consistency(producer="apply_kl_penalty")
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_advantage(
    data: DataProto,
    adv_estimator: str | AdvantageEstimator,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> DataProto:
    """Write ``advantages`` and ``returns`` ([B, R]) into ``data`` using the named estimator.

    gae needs ``values``; grpo, rloo (and their ``_vectorized`` forms) and reinforce_plus_plus_baseline
    need ``uid`` in non_tensor_batch (responses sampled ``num_repeat`` times per prompt share a uid;
    ``num_repeat`` itself is accepted for verl compatibility, the groups come from uid); remax needs
    ``reward_baselines`` [B].
    Estimators registered by users receive token_level_rewards, response_mask, config, and index /
    reward_baselines when present.
    """
    if "response_mask" not in data.batch:
        data.batch["response_mask"] = compute_response_mask(data)
    _require(data, ["token_level_rewards", "response_mask"], "compute_advantage")
    name = adv_estimator.value if isinstance(adv_estimator, AdvantageEstimator) else str(adv_estimator)
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    if config is None:
        config = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}

    if name == AdvantageEstimator.GAE.value:
        _require(data, ["values"], "compute_advantage(gae)")
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=rewards, values=data.batch["values"], response_mask=mask, gamma=gamma, lam=lam
        )
    elif name in (AdvantageEstimator.GRPO.value, AdvantageEstimator.GRPO_VECTORIZED.value):
        # verl hands grpo_vectorized only the generic arguments, so there it always divides by the std;
        # here algorithm.norm_adv_by_std_in_grpo applies to both forms of GRPO.
        estimator = core_algos.get_adv_estimator_fn(name)
        advantages, returns = estimator(
            token_level_rewards=rewards,
            response_mask=mask,
            index=_uid(data, name),
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
    elif name == AdvantageEstimator.REINFORCE_PLUS_PLUS.value:
        advantages, returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            token_level_rewards=rewards, response_mask=mask, gamma=gamma
        )
    else:
        estimator = core_algos.get_adv_estimator_fn(name)
        kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "config": config}
        if name in (AdvantageEstimator.RLOO.value, AdvantageEstimator.RLOO_VECTORIZED.value,
                    AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE.value):
            kwargs["index"] = _uid(data, name)
        elif "uid" in data.non_tensor_batch:
            kwargs["index"] = data.non_tensor_batch["uid"]
        if name == AdvantageEstimator.REMAX.value:
            _require(data, ["reward_baselines"], "compute_advantage(remax)")
        if "reward_baselines" in data.batch:
            kwargs["reward_baselines"] = data.batch["reward_baselines"]
        advantages, returns = estimator(**kwargs)

    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    if strict_data_check_enabled():
        data.check_consistency(producer=f"compute_advantage({name})")
    return data


def _uid(data: DataProto, estimator: str):
    if "uid" not in data.non_tensor_batch:
        raise DataProtoError(
            f"compute_advantage({estimator}): expected non_tensor_batch field 'uid' (group id per response), "
            f"found only {sorted(data.non_tensor_batch)}"
        )
    return data.non_tensor_batch["uid"]
