"""HF export of a Megatron model: a directory transformers loads with ``from_pretrained``, written as a stream.

Used by the actor export at the end of ``verl train``, ``verl sft``'s ``<output_dir>/hf`` and
``verl convert mcore-to-hf``. The tensors are gathered over the TP/PP group one at a time
(``verl.models.mcore.weights.iter_hf_from_model``) and written by :func:`verl.models.hf_io.write_hf_dir`
(streamed into shards, atomically; the directory's layout is described there): config.json with
``torch_dtype`` set to the exported dtype and ``architectures``, the tokenizer files and
generation_config.json when given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl.models.config import ModelConfig
from verl.models.hf_io import DEFAULT_MAX_SHARD_BYTES, generation_config, read_config, write_hf_dir
from verl.models.spec.registry import model_spec


def with_architectures(hf_config: dict, model_type: str) -> dict:
    """A copy of ``hf_config`` naming its ``architectures``: the model's own, else the family spec's (looked up
    only then, so a config.json that names them is exported whatever its family)."""
    hf_config = dict(hf_config)
    if "architectures" not in hf_config:
        hf_config["architectures"] = [model_spec(model_type).architecture]
    return hf_config


def export_model_hf(module: torch.nn.Module, config: ModelConfig, out_dir: str, hf_config: dict,
                    tokenizer: Any | None = None, generation: dict | None = None, head: str = "lm",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace: bool = True,
                    gather: bool = True) -> str | None:
    """Collective over the model-parallel group of ``module`` (ranks with ``gather`` False skip it, unless
    the experts live beyond that group: then every rank takes part): its (tp 0, pp 0) rank of the first DP
    replica writes ``out_dir`` from the tensors streamed to it; returns the path there, None elsewhere."""
    from megatron.core import parallel_state as mpu

    from verl.models.mcore.weights import export_spans_data_parallel, iter_hf_from_model

    spans = export_spans_data_parallel()
    if not gather and not spans:
        return None
    stream = iter_hf_from_model(module, config, head)
    if (mpu.get_tensor_model_parallel_rank() != 0 or mpu.get_pipeline_model_parallel_rank() != 0
            or (spans and mpu.get_data_parallel_rank() != 0)):
        for _ in stream:  # sends this rank's shards; yields nothing here
            pass
        return None
    return write_hf_dir(out_dir, stream, with_architectures(hf_config, config.model_type), tokenizer, generation,
                        max_shard_bytes, replace)


def export_actor_hf(engine: Any, config: ModelConfig, model_path: str, out_dir: str, tokenizer: Any | None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Collective over every rank: the first DP replica streams the weights (over its TP/PP group) to
    global rank 0, which writes them; every rank returns once the directory is in place. The model's
    generation settings are kept (:func:`verl.models.hf_io.generation_config`)."""
    from megatron.core import parallel_state as mpu

    export_model_hf(engine.module, config, out_dir, read_config(model_path), tokenizer,
                    generation_config(model_path, tokenizer), "lm", max_shard_bytes,
                    gather=mpu.get_data_parallel_rank() == 0)
    dist.barrier()
