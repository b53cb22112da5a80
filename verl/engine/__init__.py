"""Engines: the Megatron training engine and the rollout engines (native, SGLang)."""
