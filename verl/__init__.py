"""verl-hpc: HybridFlow (verl) RL post-training on Megatron-core, SGLang and Slurm."""

from verl.version import __version__

__all__ = ["DataFlow", "DataPipeline", "DataProto", "HybridActor", "RLTrainer", "TrainerConfig", "__version__",
           "register"]

# The Python API's names (docs/python_api.md), from verl.api on first use.
_API = ("DataFlow", "DataPipeline", "HybridActor", "RLTrainer", "TrainerConfig", "register")


def __getattr__(name: str):
    # ``from verl import DataProto`` as in verl, without importing torch and tensordict for every
    # ``import verl`` (the CLI and the launch scripts import the package first); the same for the API's names.
    if name == "DataProto":
        from verl.protocol import DataProto

        return DataProto
    if name in _API:
        import verl.api

        return getattr(verl.api, name)
    raise AttributeError(f"module 'verl' has no attribute {name!r}")
