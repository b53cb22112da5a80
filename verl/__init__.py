"""verl-hpc: HybridFlow (verl) RL post-training on Megatron-core, SGLang and Slurm."""

__version__ = "0.1.0"
