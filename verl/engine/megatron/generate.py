"""Greedy generation on the megatron engine: the (slow, cache-free) parity oracle for rollout engines.

``verl generate --engine megatron --model D --tp T --pp P [--ep E --etp F] --input-ids 1,2,3 --max-new-tokens K
--temperature 0 --json PATH`` writes ``{"output_ids": [[...]], "logprobs": [[...]]}``: the new token
ids and their log-probabilities. Every step re-runs the full sequence (no KV cache). Argmax and
log-prob come from the vocab-parallel logits, so no rank builds the full vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from verl.engine.megatron.engine import MegatronEngine
from verl.engine.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy

USAGE_ERROR = 2


def _last_token_choice(engine: MegatronEngine):
    """output_fn: greedy next token (ties -> lowest id, as torch.argmax) and its log-prob."""
    from megatron.core import parallel_state as mpu

    def output_fn(logits, aligned_ids, shifts, micro_batch):
        last = micro_batch["attention_mask"].sum(dim=1).long() - 1  # rows are left-aligned
        rows = torch.arange(logits.size(0), device=logits.device)
        local = logits[rows, last].float()  # [B, V/tp]
        start = mpu.get_tensor_model_parallel_rank() * local.size(-1)
        ids = torch.arange(start, start + local.size(-1), device=local.device)
        local = local.masked_fill(ids >= engine.config.vocab_size, float("-inf"))
        value, index = local.max(dim=-1)
        candidates = torch.stack([value, (index + start).float()], dim=-1)
        gathered = [torch.empty_like(candidates) for _ in range(mpu.get_tensor_model_parallel_world_size())]
        dist.all_gather(gathered, candidates, group=mpu.get_tensor_model_parallel_group())
        values = torch.stack([g[:, 0] for g in gathered], dim=-1)
        token = torch.stack([g[:, 1] for g in gathered], dim=-1).gather(
            1, values.argmax(dim=-1, keepdim=True)).squeeze(1).long()  # first max = lowest vocab shard
        log_prob, _ = vocab_parallel_log_probs_and_entropy(logits[rows, last][:, None], token[:, None],
                                                           engine.config.vocab_size, compute_entropy=False)
        return {"token": token, "log_prob": log_prob.squeeze(1)}

    return output_fn


def greedy_generate(engine: MegatronEngine, prompt: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> tuple[list[int], list[float]]:
    """Collective over the model-parallel group; returns (new token ids, their log-probs)."""
    ids = list(prompt)
    new_ids, log_probs = [], []
    output_fn = _last_token_choice(engine)
    for _ in range(max_new_tokens):
        input_ids = torch.tensor([ids])
        out = engine.forward({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}, 1, output_fn)
        token = int(out["token"][0])
        new_ids.append(token)
        log_probs.append(float(out["log_prob"][0]))
        ids.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
    return new_ids, log_probs


def _generate_rank(model_dir: str, tp: int, pp: int, prompt: list[int], max_new_tokens: int, ep: int = 1,
                   etp: int | None = None) -> dict:
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(tp, pp, ep_size=ep, etp_size=etp)
    config = ModelConfig.from_pretrained(model_dir)
    engine = MegatronEngine(config)
    checkpoint = HFCheckpoint(model_dir)
    load_hf_into_model(engine.module, config, checkpoint.get, names=checkpoint.files)
    output_ids, logprobs = greedy_generate(engine, prompt, max_new_tokens)
    destroy_megatron()
    return {"output_ids": [output_ids], "logprobs": [logprobs]}


def _default_nproc(tp: int, pp: int, ep: int, etp: int | None) -> int:
    """tp*pp ranks, times the data-parallel replicas expert parallelism needs (ep*etp ranks per stage)."""
    per_stage = ep * (tp if etp is None else etp)
    return pp * math.lcm(tp, per_stage)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl generate --engine megatron", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn (default tp*pp, or the smallest multiple of it ep*etp fits in)")
    parser.add_argument("--input-ids", required=True, help="comma-separated prompt token ids")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", required=True, help="output path")
    return parser


def main(argv: list[str] | None = None) -> int:
    from verl.errors import InputError
    from verl.launcher.spawn import run_ranks
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.model import check_parallel_layout

    args = _parser().parse_args(argv)
    try:
        if args.temperature != 0:
            raise InputError(f"--temperature: expected 0 (the megatron engine is greedy), found {args.temperature}")
        if args.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens: expected a positive integer, found {args.max_new_tokens}")
        try:
            prompt = [int(x) for x in args.input_ids.split(",")]
        except ValueError:
            raise InputError(f"--input-ids: expected comma-separated integers, found {args.input_ids!r}") from None
        config = ModelConfig.from_pretrained(args.model)
        nproc = args.nproc or _default_nproc(args.tp, args.pp, args.ep, args.etp)
        check_parallel_layout(config, args.tp, args.pp, args.ep, args.etp, world_size=nproc)
        if nproc % (args.tp * args.pp):
            raise InputError(f"--nproc: expected a multiple of tp*pp={args.tp * args.pp}, found {nproc}")
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise InputError(f"--input-ids: expected ids in [0, {config.vocab_size}), found {bad}")
        HFCheckpoint(args.model)
    except InputError as exc:
        print(f"verl generate: {exc}", file=sys.stderr)
        return USAGE_ERROR
    result = run_ranks(_generate_rank, nproc, os.path.abspath(args.model), args.tp, args.pp,
                       prompt, args.max_new_tokens, args.ep, args.etp, timeout_s=600)[0]
    staging = args.json + ".tmp"
    with open(staging, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(staging, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
