"""PPO-family algorithms: advantage estimators, losses, KL control."""
