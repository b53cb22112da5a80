"""Peak RSS of the actor's log-prob and entropy paths per rank, model against model at the same tokens per
micro-batch (issue 58 item 4: Gemma 3's 262144-token vocabulary against SmolLM2's 49152).

    python -m launch.bench_logprob_memory --model .cache/gemma-3-270m --model .cache/smollm2-135m-instruct \\
        --rows 8 --prompt-len 176 --response-len 48 --json outputs/logprob_memory.json

Each model runs in a fresh one-rank Megatron process (gloo, fp32, the actor's settings: the output layer on the
response positions only). It measures the rank's resident memory (VmRSS) once the model, its gradient buffers and
Adam's state exist (one warm-up step first; the allocator's cached free memory handed back before each phase), then
the peak (VmHWM, reset through /proc/self/clear_refs before each phase) of

  log_prob  ``compute_log_prob`` with entropy, no grad (the old and reference log-probs);
  update    one ``update_policy`` micro-batch: log-probs and entropy, their backward, the optimizer step.

and reports each phase's peak and its increment over the resident memory before it, with each model's ratio to
the first model's. Prompts and responses are random ids of the model's own vocabulary; ``--rows`` x
(``--prompt-len`` + ``--response-len``) tokens a micro-batch for every model alike.
"""

from __future__ import annotations

import json
import os
import sys

from verl.errors import InputError, OneLineArgumentParser, refuse

GIB = float(1 << 30)


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status: expected a {field} line, found none")


def _trim() -> None:
    """Hand the allocator's freed memory back to the system (glibc's malloc_trim), so the resident memory before a
    phase is what is live, and the phase's increment is what it needs, not what it found cached."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux's clear_refs, value 5: any user may write their own process's)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def _measure(model: str, rows: int, prompt_len: int, response_len: int, seed: int,
             chunk_tokens: int | None = None) -> dict:
    """One rank: the model's resident memory and each phase's peak, in GiB. ``chunk_tokens``: a fixed number of
    tokens per chunk of the log-softmax (the rule before CHUNK_ELEMENTS), for a before/after in one run."""
    import torch

    from verl.engine.megatron import vocab_parallel
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import initialize_megatron
    from verl.engine.roles import Actor
    from verl.models.config import ModelConfig

    config = ModelConfig.from_pretrained(model)
    if chunk_tokens is not None:  # every chunk this many tokens, whatever the vocabulary
        vocab_parallel.chunk_tokens_for = lambda shard: chunk_tokens
    initialize_megatron(1, 1, seed=seed)
    engine = MegatronEngine(config, "lm", OptimConfig(lr=1e-7, weight_decay=0.0, clip_grad=1.0))
    if os.path.isdir(model):
        engine.load_hf_weights(model)
    generator = torch.Generator().manual_seed(seed)
    width = prompt_len + response_len
    input_ids = torch.randint(0, config.vocab_size, (rows, width), generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "position_ids": torch.arange(width).expand(rows, width).clone(),
             "responses": input_ids[:, prompt_len:], "response_mask": torch.ones(rows, response_len)}
    actor = Actor(engine, micro_batch_size=rows)

    def loss_fn(outputs, micro_batch):
        mask = micro_batch["response_mask"]
        loss = -((outputs["log_probs"] + 0.01 * outputs["entropy"]) * mask).sum() / mask.sum()
        return loss, {}

    actor.update_policy(batch, loss_fn)  # warm-up: Adam's state and every lazily built buffer exist after it
    out = {"model": os.path.basename(os.path.normpath(model)), "chunk_tokens": chunk_tokens,
           "vocab_size": config.vocab_size,
           "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
           "parameters": sum(p.numel() for p in engine.module.parameters()),
           "tokens_per_micro_batch": rows * width, "response_tokens": rows * response_len}
    for phase, run in (("log_prob", lambda: actor.compute_log_prob(batch)),
                       ("update", lambda: actor.update_policy(batch, loss_fn))):
        _trim()
        before = _status_kib("VmRSS")
        _reset_peak()
        run()
        peak = _status_kib("VmHWM")
        out[f"{phase}_resident_gib"] = before * 1024 / GIB
        out[f"{phase}_peak_gib"] = peak * 1024 / GIB
        out[f"{phase}_increment_gib"] = (peak - before) * 1024 / GIB
    # what a full-vocabulary logits tensor of the response positions alone weighs in fp32
    out["response_logits_gib"] = rows * response_len * config.vocab_size * 4 / GIB
    return out


def _ratio(value: float | None) -> str:
    return "no ratio: the first model's is 0" if value is None else f"{value:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="bench_logprob_memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True,
                   help="HF model directory or config.json (random init); repeat: the first is the reference")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=176)
    p.add_argument("--response-len", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-chunk-tokens", type=int, metavar="N",
                   help="also run the last model with the log-softmax in fixed chunks of N tokens (the rule before "
                        "chunks were sized by elements: 1024), for a before/after in one run")
    p.add_argument("--json", help="also write the records here")
    args = p.parse_args(argv)
    for name in ("rows", "prompt_len", "response_len", "fixed_chunk_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')}: expected >= 1, found {getattr(args, name)}")
    for model in args.model:
        if not (os.path.isdir(model) or os.path.isfile(model)):
            raise InputError(f"--model: expected an HF model directory or config.json, found {model!r}")
    from verl.launcher.spawn import run_ranks

    records = []
    runs = [(model, None) for model in args.model]
    if args.fixed_chunk_tokens is not None:
        runs.append((args.model[-1], args.fixed_chunk_tokens))
    for model, chunk_tokens in runs:  # one fresh process each: its peak is its own
        (record,) = run_ranks(_measure, 1, model, args.rows, args.prompt_len, args.response_len, args.seed,
                              chunk_tokens, timeout_s=1800, threads_per_rank=2)
        records.append(record)
    ref = records[0]
    for r in records:
        for phase in ("log_prob", "update"):
            r[f"{phase}_peak_ratio"] = r[f"{phase}_peak_gib"] / ref[f"{phase}_peak_gib"]
            # (an increment can be 0: the phase fit in memory the allocator kept from the warm-up)
            base = ref[f"{phase}_increment_gib"]
            r[f"{phase}_increment_ratio"] = r[f"{phase}_increment_gib"] / base if base > 0 else None
        fixed = "" if r["chunk_tokens"] is None else f", log-softmax in fixed chunks of {r['chunk_tokens']} tokens"
        print(f"{r['model']}{fixed}: vocab {r['vocab_size']}, {r['parameters'] / 1e6:.0f}M parameters, "
              f"{r['tokens_per_micro_batch']} tokens a micro-batch ({r['response_tokens']} response tokens, "
              f"whose fp32 logits are {r['response_logits_gib']:.2f} GiB)", flush=True)
        for phase in ("log_prob", "update"):
            print(f"  {phase:8s} resident {r[f'{phase}_resident_gib']:.2f} GiB, peak {r[f'{phase}_peak_gib']:.2f} "
                  f"GiB ({r[f'{phase}_peak_ratio']:.2f}x the first model's), increment "
                  f"{r[f'{phase}_increment_gib']:.2f} GiB ({_ratio(r[f'{phase}_increment_ratio'])})", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": args.rows, "prompt_len": args.prompt_len, "response_len": args.response_len,
                       "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as err:
        sys.exit(refuse("bench_logprob_memory", err))
