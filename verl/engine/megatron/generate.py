"""Greedy generation on the megatron engine: the (slow, cache-free) parity oracle for rollout engines.

``verl generate --engine megatron --model D --tp T --pp P [--ep E --etp F] --input-ids 1,2,3 [--input-ids 4,5 ...]
--max-new-tokens K --temperature 0 --json PATH`` writes ``{"output_ids": [[...], ...], "logprobs": [[...], ...]}``:
per prompt, in order, the new token ids and their log-probabilities, cut after the first of the model's eos ids
(kept; ``--ignore-eos`` runs K tokens). Every step re-runs the full sequences (no KV cache). Argmax and log-prob
come from the vocab-parallel logits, so no rank builds the full vocabulary.
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
    stop = () if eos_token_id is None else (eos_token_id,)
    (new_ids, log_probs), = greedy_generate_batch(engine, [prompt], max_new_tokens, stop)
    return new_ids, log_probs


def greedy_generate_batch(engine: MegatronEngine, prompts: list[list[int]], max_new_tokens: int,
                          stop_ids: tuple[int, ...] = ()) -> list[tuple[list[int], list[float]]]:
    """Every prompt's greedy continuation, one forward per step over the rows still running (right-padded: a
    causal model's real tokens never see the padding after them, and the engine left-aligns rows and numbers
    positions from each row's first token). A row stops after emitting a token of ``stop_ids`` (kept)."""
    seqs = [list(p) for p in prompts]
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
    running = list(range(len(prompts)))
    output_fn = _last_token_choice(engine)
    for _ in range(max_new_tokens):
        if not running:
            break
        width = max(len(seqs[i]) for i in running)
        input_ids = torch.zeros(len(running), width, dtype=torch.int64)
        attention_mask = torch.zeros(len(running), width, dtype=torch.int64)
        for row, i in enumerate(running):
            input_ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
            attention_mask[row, :len(seqs[i])] = 1
        out = engine.forward({"input_ids": input_ids, "attention_mask": attention_mask}, len(running), output_fn)
        still = []
        for row, i in enumerate(running):
            token = int(out["token"][row])
            results[i][0].append(token)
            results[i][1].append(float(out["log_prob"][row]))
            seqs[i].append(token)
            if token not in stop_ids:
                still.append(i)
        running = still
    return results


def _generate_rank(model_dir: str, tp: int, pp: int, prompts: list[list[int]], max_new_tokens: int, ep: int = 1,
                   etp: int | None = None, stop_ids: tuple[int, ...] = ()) -> dict:
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(tp, pp, ep_size=ep, etp_size=etp)
    config = ModelConfig.from_pretrained(model_dir)
    engine = MegatronEngine(config)
    checkpoint = HFCheckpoint(model_dir)
    load_hf_into_model(engine.module, config, checkpoint.get, names=checkpoint.files)
    results = greedy_generate_batch(engine, prompts, max_new_tokens, tuple(stop_ids))
    destroy_megatron()
    return {"output_ids": [ids for ids, _ in results], "logprobs": [lps for _, lps in results]}


def _stop_ids(model_dir: str) -> tuple[int, ...]:
    """Every eos id the model names: generation_config.json's, else config.json's (an int or a list)."""
    from verl.models.hf_io import generation_config

    value = generation_config(model_dir).get("eos_token_id")
    return () if value is None else (value,) if isinstance(value, int) else tuple(value)


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
    parser.add_argument("--input-ids", required=True, action="append", metavar="ID,ID,...",
                        help="a prompt as comma-separated token ids; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos_token_id")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", required=True, help="output path")
    return parser


def main(argv: list[str] | None = None) -> int:
    from verl.errors import InputError
    from verl.launcher.spawn import run_ranks
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.model import check_megatron_block, check_parallel_layout

    args = _parser().parse_args(argv)
    try:
        if args.temperature != 0:
            raise InputError(f"--temperature: expected 0 (the megatron engine is greedy), found {args.temperature}")
        if args.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens: expected a positive integer, found {args.max_new_tokens}")
        prompts = []
        for i, text in enumerate(args.input_ids):
            try:
                prompts.append([int(x) for x in text.split(",") if x.strip()])
            except ValueError:
                raise InputError(f"--input-ids #{i}: expected comma-separated integers, found {text!r}") from None
            if not prompts[-1]:
                raise InputError(f"--input-ids #{i}: expected at least one token id, found an empty prompt")
        config = ModelConfig.from_pretrained(args.model)
        nproc = args.nproc or _default_nproc(args.tp, args.pp, args.ep, args.etp)
        check_megatron_block(config)
        check_parallel_layout(config, args.tp, args.pp, args.ep, args.etp, world_size=nproc)
        if nproc % (args.tp * args.pp):
            raise InputError(f"--nproc: expected a multiple of tp*pp={args.tp * args.pp}, found {nproc}")
        bad = [t for prompt in prompts for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise InputError(f"--input-ids: expected ids in [0, {config.vocab_size}), found {bad}")
        longest = max(len(p) for p in prompts)
        if longest + args.max_new_tokens > config.max_position_embeddings:
            raise InputError(f"prompt length {longest} + --max-new-tokens {args.max_new_tokens} exceeds the model "
                             f"context (max_position_embeddings={config.max_position_embeddings})")
        HFCheckpoint(args.model)
        stop_ids = () if args.ignore_eos else _stop_ids(args.model)
    except InputError as exc:
        print(f"verl generate: {exc}", file=sys.stderr)
        return USAGE_ERROR
    result = run_ranks(_generate_rank, nproc, os.path.abspath(args.model), args.tp, args.pp,
                       prompts, args.max_new_tokens, args.ep, args.etp, list(stop_ids), timeout_s=600)[0]
    staging = args.json + ".tmp"
    with open(staging, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(staging, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
