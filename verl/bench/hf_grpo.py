"""The single-process baseline of ``verl bench train --baseline hf``: GRPO with transformers alone.

    python -m verl.bench.hf_grpo --model CONFIG.json --data DIR --prompts 16 --n 4 --response-length 4 \\
        --steps 20 --metrics PATH

It does per step what a peer trainer built on HF ``generate`` does, with none of verl's distributed
machinery: sample ``n`` responses per prompt with ``generate`` (temperature 1, no top-k/top-p, as verl's
rollout defaults), score them with the same rule, normalise the scores within each prompt's
group (GRPO: (s - mean) / (std + 1e-6)), then one on-policy update -- no old-log-prob forward, since one
epoch over one mini-batch makes the old policy the current one: ratio = exp(logp - logp.detach()), the
clipped surrogate equals -A * ratio there, token-mean over the batch -- clip the gradient norm at 1 and step
AdamW at a constant LR. One process, torch's default thread count (every core), fp32.

Each step appends one JSON line with verl's metric names (``timing_s/{gen,reward,update_actor,step}``,
``critic/score/mean``, ``perf/total_num_tokens``), so ``verl.bench.train.summarize`` reads both runs alike.
``DIR`` is the data directory ``verl bench train`` writes (``train.parquet``, ``tokenizer/``); the rows'
``data_source`` picks verl's built-in scorer (arithmetic exact match, or the word problems' answer check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from verl.errors import InputError


def load_model(model_path: str, seed: int, linears: str = "torch"):
    """A causal LM from an HF model directory (its weights) or a config.json (seeded random init). ``linears``:
    ``torch`` keeps transformers' ``nn.Linear`` (torch's default fp32 GEMM, MKL in PyPI's wheels); ``onednn`` routes
    them through oneDNN as verl-hpc's engines do (``verl.ops.cpu_gemm``), so that a comparison can tell the GEMM
    library from the framework."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.models.hf_io import has_hf_weights
    from verl.ops.cpu_gemm import use_onednn_for_nn_linears

    if has_hf_weights(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    if linears == "onednn" and not use_onednn_for_nn_linears(model):
        raise InputError("--linears onednn: expected a torch with oneDNN and VERL_CPU_GEMM unset or 'onednn', "
                         "found no linear routed")
    return model


def read_prompts(data_dir: str, tokenizer) -> list[tuple[str, str]]:
    """(prompt text, ground truth) of every training row, in file order, rendered as verl train renders them."""
    import pyarrow.parquet as pq

    from verl.utils.dataset.rl_dataset import render_prompt

    rows = pq.read_table(os.path.join(data_dir, "train.parquet")).to_pylist()
    return [(render_prompt(row["prompt"], tokenizer), row["reward_model"]["ground_truth"]) for row in rows]


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first eos of each row, 0 after it (generate pads finished rows)."""
    is_eos = (responses == eos_id).int()
    after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return (~after_eos).float()


def grpo_advantages(scores: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """[B*n] scores grouped n by n (rows of one prompt are adjacent) -> normalised per group."""
    groups = scores.view(-1, n)
    std = groups.std(dim=1, keepdim=True) if n > 1 else torch.ones_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def read_data_source(data_dir: str) -> str:
    """The ``data_source`` of the training rows (one task per bench data directory), which picks the scorer."""
    import pyarrow.parquet as pq

    sources = set(pq.read_table(os.path.join(data_dir, "train.parquet"), columns=["data_source"]).column(0).to_pylist())
    if len(sources) != 1:
        raise InputError(f"{data_dir}/train.parquet: expected one data_source, found {sorted(sources)}")
    return sources.pop()


def response_log_probs(model, sequences: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                       responses: torch.Tensor) -> torch.Tensor:
    """Each response token's log-prob, as the peers compute it: the output layer on the response positions only
    (``logits_to_keep``), and the chosen token's logit minus the log-sum-exp, without a full-vocabulary
    log-softmax (TRL's ``selective_log_softmax``)."""
    keep = responses.shape[1] + 1  # the positions predicting each response token, and the last one (dropped)
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions,
                   logits_to_keep=keep).logits[:, :-1].float()
    chosen = logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def grpo_step(model, optimizer, tokenizer, batch: list[tuple[str, str]], n: int, response_length: int,
              data_source: str = "arithmetic") -> dict:
    """One GRPO step on ``batch`` (prompt, truth) pairs, scored by verl's built-in scorer of ``data_source``;
    returns its metrics (verl's names)."""
    from verl.utils.reward_score import default_compute_score

    start = time.perf_counter()
    prompts = [prompt for prompt, _ in batch for _ in range(n)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        sequences = model.generate(**encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=response_length, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
    gen_done = time.perf_counter()

    prompt_len = encoded["input_ids"].shape[1]
    responses = sequences[:, prompt_len:]
    mask = response_mask(responses, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    truths = [truth for _, truth in batch for _ in range(n)]
    scores = torch.tensor([default_compute_score(data_source, text, truth)
                           for text, truth in zip(texts, truths, strict=True)])
    advantages = grpo_advantages(scores, n)
    reward_done = time.perf_counter()

    model.train()
    attention = torch.cat([encoded["attention_mask"], mask.long()], dim=1)
    positions = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    token_log_probs = response_log_probs(model, sequences, attention, positions, responses)
    ratio = torch.exp(token_log_probs - token_log_probs.detach())
    loss = -(advantages.unsqueeze(1) * ratio * mask).sum() / mask.sum().clamp(min=1)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return {"timing_s/gen": gen_done - start, "timing_s/reward": reward_done - gen_done,
            "timing_s/update_actor": end - reward_done, "timing_s/step": end - start,
            "critic/score/mean": scores.mean().item(), "actor/pg_loss": loss.item(),
            "actor/grad_norm": float(grad_norm),
            "perf/total_num_tokens": int(encoded["attention_mask"].sum() + mask.sum())}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl.bench.hf_grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF config.json (random init) or HF model directory")
    parser.add_argument("--data", required=True, help="directory with train.parquet and tokenizer/")
    parser.add_argument("--prompts", type=int, default=16)
    # --num-generations (TRL's name): what torch.distributed.run passes on (it takes --n for one of its own)
    parser.add_argument("--n", "--num-generations", dest="n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics", required=True, help="JSON-lines file, one record per step")
    parser.add_argument("--linears", choices=("torch", "onednn"), default="torch",
                        help="the model's fp32 linears: torch's default (MKL) or oneDNN's, as verl-hpc's engines")
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = build_parser().parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"), padding_side="left")
    problems = read_prompts(args.data, tokenizer)
    if len(problems) < args.prompts:
        raise InputError(f"--prompts: expected at most {len(problems)} (rows in {args.data}), found {args.prompts}")
    data_source = read_data_source(args.data)
    model = load_model(args.model, args.seed, args.linears)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    torch.manual_seed(args.seed)
    with open(args.metrics, "w", encoding="utf-8") as out:
        for step in range(args.steps):
            first = (step * args.prompts) % (len(problems) - args.prompts + 1)
            record = grpo_step(model, optimizer, tokenizer, problems[first:first + args.prompts], args.n,
                               args.response_length, data_source)
            out.write(json.dumps({"step": step + 1, **record}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
