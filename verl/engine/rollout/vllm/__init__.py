"""vLLM as a rollout engine (``rollout.name=vllm``): see :mod:`verl.engine.rollout.vllm.engine`."""
