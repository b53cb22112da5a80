"""The FSDP actor as an HF model directory, streamed: one parameter is gathered to full size at a time
(``DTensor.full_tensor``, a collective every rank runs), rank 0 writes it into the current safetensors shard
and drops it, so no rank ever holds the whole model (see :func:`verl.models.hf_io.write_hf_dir`).

The engine calls this module (lazily, when it exports); this module names the engine only as a type
(``TYPE_CHECKING``), so the two files form no import loop at run time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from verl.models.hf_export import with_architectures
from verl.models.hf_io import generation_config, read_config, write_hf_dir

if TYPE_CHECKING:  # the engine imports this module when it saves: a type, not an import at run time
    from verl.engine.fsdp.engine import FSDPEngine


def iter_full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) per parameter; a collective: every rank must run it to the end."""
    for name, param in module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.data
        yield name, full.detach().to("cpu", copy=True)


def export_actor_hf(engine: FSDPEngine, model_path: str, out_dir: str, tokenizer: Any | None,
                    stream: Iterator[tuple[str, torch.Tensor]] | None = None) -> None:
    """Collective over every rank; rank 0 writes ``out_dir`` (replaced atomically). ``stream``: the (HF name,
    full tensor) pairs to write instead of the module's parameters (a LoRA actor's merged weights)."""
    hf_config = with_architectures(read_config(model_path), engine.config.model_type)
    generation = generation_config(model_path, tokenizer)
    stream = iter_full_tensors(engine.module) if stream is None else stream
    if dist.get_rank() == 0:
        write_hf_dir(out_dir, stream, hf_config, tokenizer, generation)
    else:
        for _ in stream:  # the gathers rank 0 waits for
            pass
    dist.barrier()
