"""Megatron-core workers: actor, critic and reference on TP/PP/DP process groups."""
