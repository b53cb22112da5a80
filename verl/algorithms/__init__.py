"""The PPO-family math (losses, advantage estimators, KL control) and its registries, in a layer below the
workers that compute losses and the trainer that computes advantages. verl's public path for it,
``verl.trainer.ppo.core_algos``, is this same module."""
