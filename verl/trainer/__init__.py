"""Trainers: the single-controller RL dataflow and its algorithms."""
