"""verl-hpc: HybridFlow (verl) RL post-training on Megatron-core, SGLang and Slurm."""

__version__ = "0.1.0"

__all__ = ["DataProto", "__version__"]


def __getattr__(name: str):
    # ``from verl import DataProto`` as in verl, without importing torch and tensordict for every
    # ``import verl`` (the CLI and the launch scripts import the package first).
    if name == "DataProto":
        from verl.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'verl' has no attribute {name!r}")
