"""One rollout engine's generate call timed the way `verl bench rollout` counts tokens/s: a warm-up call, then the
median wall time of ``repeats`` whole calls (prefill included), every sequence generating all its new tokens."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from verl.utils.torch_dtypes import DTYPES


def add_workload_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The rollout workload every rollout bench takes: batch, prompt and new-token lengths, dtype, sampling, timed
    repeats, seed."""
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--seed", type=int, default=0)


def time_generate(rollout: Any, ids: torch.Tensor, params: Any, repeats: int, engine_start_s: float) -> dict:
    """``{"tokens_per_s", "median_s", "seconds", "new_tokens", "engine_start_s"}`` of ``rollout.generate`` on the
    unpadded prompts ``ids`` [B, P] with ``params`` (exactly ``response_length`` new tokens each)."""
    mask = torch.ones_like(ids)
    tokens = ids.shape[0] * params.response_length
    rollout.generate(ids, mask, params)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = rollout.generate(ids, mask, params)
        seconds.append(time.perf_counter() - start)
        if int(out["response_mask"].sum()) != tokens:
            raise RuntimeError(f"{type(rollout).__name__} bench: expected every sequence to generate all new tokens")
    median = statistics.median(seconds)
    return {"tokens_per_s": tokens / median, "median_s": median, "seconds": seconds, "new_tokens": tokens,
            "engine_start_s": engine_start_s}
