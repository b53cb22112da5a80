"""The 3D-HybridEngine: Megatron training layout <-> SGLang rollout layout, resharded in place."""
