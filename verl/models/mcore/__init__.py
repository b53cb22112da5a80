"""Qwen2 / Llama on megatron-core: model builder and HF <-> Megatron weight layout rules."""
