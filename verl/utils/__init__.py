"""Shared utilities: tensor helpers, datasets, reward functions."""
