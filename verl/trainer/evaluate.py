"""Greedy held-out accuracy: the one validation metric SFT and RL report (``val/accuracy``).

Each prompt is answered once by greedy decoding; the response text is scored by the rule-based
reward for its ``data_source`` (exact match for the arithmetic task); accuracy is the mean score.

    verl eval --model HF_DIR --data test.parquet [--n N] [--max-new-tokens K] [--batch-size B]

The pieces compose: :func:`greedy_accuracy` takes prompts, ground truths and any
``generate(list of prompt texts) -> list of response texts``; :func:`rollout_generate` makes such
a callable from a rollout engine (native or SGLang) and a tokenizer, which is how the RL trainer
scores its live actor; :func:`evaluate_accuracy` does both for an HF directory on the native engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from verl.errors import InputError, OneLineArgumentParser

USAGE_ERROR = 2
GenerateFn = Callable[[list[str]], list[str]]
ScoreFn = Callable[..., float]  # verl's compute_score(data_source, solution_str, ground_truth, extra_info)


class EvaluationError(InputError):
    """Data or a model the evaluation cannot run on; one line naming what was expected."""


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Prompts (texts, as the rollout sees them) with their ground truths and data sources."""

    prompts: list[str]
    ground_truths: list[str]
    data_sources: list[str]

    def __len__(self) -> int:
        return len(self.prompts)


def load_eval_set(parquet: str | Sequence[str], tokenizer: Any, n: int | None = None,
                  prompt_key: str = "prompt") -> EvalSet:
    """The first ``n`` rows (all when None) of verl-format parquet file(s)."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    if n is not None and n < 1:
        raise EvaluationError(f"n: expected a positive number of prompts, found {n}")
    # RLHFDataset owns the prompt-text rule (chat template or joined message contents).
    dataset = RLHFDataset(parquet, tokenizer, {"prompt_key": prompt_key})
    rows = dataset.rows if n is None else dataset.rows[:n]
    return EvalSet(prompts=[dataset.prompt_text(row) for row in rows],
                   ground_truths=[str(row["reward_model"]["ground_truth"]) for row in rows],
                   data_sources=[row["data_source"] for row in rows])


def greedy_accuracy(prompts: Sequence[str], ground_truths: Sequence[Any], generate: GenerateFn,
                    data_sources: Sequence[str] | None = None, score: ScoreFn | None = None,
                    batch_size: int = 256) -> float:
    """Mean score of ``generate``'s responses, called on batches of at most ``batch_size`` prompts.

    ``score`` defaults to verl's ``default_compute_score`` (dispatch on data source; ``data_sources``
    defaults to "arithmetic" for every prompt).
    """
    from verl.utils.reward_score import default_compute_score

    if len(prompts) != len(ground_truths):
        raise EvaluationError(f"ground_truths: expected one per prompt ({len(prompts)}), found {len(ground_truths)}")
    if not prompts:
        raise EvaluationError("prompts: expected at least one prompt, found none")
    if batch_size < 1:
        raise EvaluationError(f"batch_size: expected a positive integer, found {batch_size}")
    sources = list(data_sources) if data_sources is not None else ["arithmetic"] * len(prompts)
    score = score or default_compute_score
    total = 0.0
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start:start + batch_size])
        responses = generate(batch)
        if len(responses) != len(batch):
            raise EvaluationError(f"generate: expected {len(batch)} responses, found {len(responses)}")
        for i, response in enumerate(responses, start):
            total += float(score(sources[i], response, ground_truths[i]))
    return total / len(prompts)


def rollout_generate(rollout: Any, tokenizer: Any, max_new_tokens: int) -> GenerateFn:
    """A greedy ``generate`` over a rollout engine (``BaseRollout.generate``): left-pads the
    tokenised prompts, stops at the tokenizer's eos, decodes responses without special tokens. The prompts are
    rendered text: a template's own special tokens when the tokenizer has one, else the tokenizer's (a base model's
    BOS), as the RL dataset tokenises them."""
    from verl.engine.rollout.base import SamplingParams
    from verl.utils.dataset.rl_dataset import encode_prompt

    params = SamplingParams(do_sample=False, response_length=max_new_tokens,
                            eos_token_id=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    templated = bool(getattr(tokenizer, "chat_template", None))  # the rendered prompts carry the template's tokens

    def generate(prompts: list[str]) -> list[str]:
        ids = [encode_prompt(p, tokenizer, templated) for p in prompts]
        width = max(len(row) for row in ids)
        input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids], dtype=torch.int64)
        attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids], dtype=torch.int64)
        out = rollout.generate(input_ids, attention_mask, params, pad_token_id=pad)
        lengths = out["response_mask"].sum(-1).tolist()
        return tokenizer.batch_decode([row[:n] for row, n in zip(out["responses"].tolist(), lengths, strict=False)],
                                      skip_special_tokens=True)

    return generate


def evaluate_accuracy(hf_dir: str, test_parquet: str | Sequence[str], n: int | None = None,
                      max_new_tokens: int = 8, batch_size: int = 256, prompt_key: str = "prompt") -> float:
    """Greedy accuracy of the HF checkpoint ``hf_dir`` (with its tokenizer) on ``test_parquet``,
    generated by the native engine in this process (rollout TP 1)."""
    from transformers import AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    config = ModelConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    eval_set = load_eval_set(test_parquet, tokenizer, n, prompt_key)
    rollout = NativeRollout(config, pad_token_id=tokenizer.pad_token_id or 0)
    rollout.load_hf_checkpoint(hf_dir)
    return greedy_accuracy(eval_set.prompts, eval_set.ground_truths,
                           rollout_generate(rollout, tokenizer, max_new_tokens),
                           eval_set.data_sources, batch_size=batch_size)


# ----------------------------------------------------------------------------- `verl eval`
def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="verl eval", description=__doc__.splitlines()[0], error_type=EvaluationError)
    p.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--data", required=True, help="verl-format parquet with reward_model.ground_truth")
    p.add_argument("--n", type=int, default=None, help="evaluate the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--json", metavar="PATH", help="also write {\"val/accuracy\": ..., \"n\": ...} here")
    return p


def main(argv: list[str] | None = None) -> int:
    """``verl eval``: prints ``val/accuracy <value> (n=<prompts>)``; bad input is one line, exit 2."""
    try:
        args = _parser().parse_args(argv)
        for path, what in ((args.model, "--model"), (args.data, "--data")):
            if not os.path.exists(path):
                raise EvaluationError(f"{what}: expected an existing path, found nothing at {path}")
        if not os.path.isfile(os.path.join(args.model, "tokenizer_config.json")):
            raise EvaluationError(f"--model: expected tokenizer files in {args.model} (as `verl sft` exports), "
                                  f"found no tokenizer_config.json")
        accuracy = evaluate_accuracy(args.model, args.data, args.n, args.max_new_tokens, args.batch_size,
                                     args.prompt_key)
    except InputError as err:  # EvaluationError, ModelConfigError, DatasetError, CheckpointError, ...
        print(f"verl eval: {err}", file=sys.stderr)
        return USAGE_ERROR
    count = args.n if args.n is not None else "all"
    print(f"val/accuracy {accuracy:.4f} (n={count}, greedy, {args.data})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"val/accuracy": accuracy, "n": args.n}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
