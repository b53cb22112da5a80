"""A verl recipe's module as `verl train` imports it (``actor_rollout_ref.model.external_lib``): an advantage
estimator and a policy loss registered at import, each leaving a value the run's metrics show."""

from verl.algorithms.core_algos import register_adv_est, register_policy_loss

ADVANTAGE = 0.5  # every response token's advantage: critic/advantages/mean
LOSS = 37.0      # the policy loss of every micro-batch: actor/pg_loss sums it over the step's micro-batches


@register_adv_est("toy_constant")
def constant_advantage(token_level_rewards, response_mask, config=None, index=None, **kwargs):
    advantages = response_mask.to(token_level_rewards.dtype) * ADVANTAGE
    return advantages, advantages


@register_policy_loss("toy_constant")
def constant_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    zero = (log_prob * response_mask).sum() * 0  # keeps the graph: the update runs, the weights do not move
    return zero + LOSS, zero, zero, zero
