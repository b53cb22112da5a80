"""Workers of the RL dataflow (actor, critic, rollout, reward)."""
