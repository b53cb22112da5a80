"""Benchmarks behind `verl bench`: kernels, reshard, rollout."""
