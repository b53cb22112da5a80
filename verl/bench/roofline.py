"""Each phase of a GRPO step against this machine's own limits (``verl bench train --roofline``).

The limits are measured here, once, with torch on every core the ranks share (``os.cpu_count()`` threads): the
matmul rate (fp32 products of square matrices, best of a few, through torch's BLAS ``mm`` and oneDNN's GEMM, the
faster of the two) and the memory bandwidth (a large tensor copy, bytes read + written). Each phase's lower bound in
seconds comes from the model's weight matmuls only:

* forward FLOPs of a step = 2 x (the weights' matmul parameters) x tokens, the output head counted on the response
  positions only (verl-hpc's actor computes logits there); attention's score products are left out (they are small
  next to the weights' at these sequence lengths);
* ``update_actor`` = 3 forwards (backward = 2), plus one with activation recompute; ``old_log_prob`` and ``ref`` =
  1 forward;
* generation = the prefill FLOPs of each distinct prompt once (a prompt's ``n`` samples share its prefix, as the
  native engine, SGLang and vLLM compute it; the head on its last position only) + one read of the weights per
  decode step per rollout replica (decode is bandwidth-bound: the batch shares each read).

``fraction`` = bound / measured: how much of the machine the phase used (1.0 = at the limit).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch

from verl.ops.cpu_gemm import onednn_available, onednn_linear

MATMUL_N = 1024          # square fp32 matrices: large enough for the BLAS's steady rate, seconds-cheap on 2 cores
COPY_BYTES = 256 << 20   # far beyond every cache level
REPEATS = 5


def machine_limits(threads: int | None = None) -> dict[str, float]:
    """``matmul_gflops`` (fp32: the faster of torch's BLAS ``mm``, ``matmul_gflops_blas``, and oneDNN's GEMM,
    ``matmul_gflops_onednn``, which the engines use on CPU) and ``copy_gb_s`` (read + write) of this machine,
    ``threads`` torch threads."""
    threads = threads or os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
        rates = {}
        gemms = {"blas": lambda: torch.mm(a, b)}
        if onednn_available():
            gemms["onednn"] = lambda: onednn_linear(a, b)
        for name, gemm in gemms.items():
            gemm()  # warm-up: the library's threads, buffers and (oneDNN) primitive
            best = min(_seconds(gemm) for _ in range(REPEATS))
            rates[f"matmul_gflops_{name}"] = 2 * MATMUL_N ** 3 / best / 1e9
        gflops = max(rates.values())  # the machine's limit is the faster library's rate
        src = torch.ones(COPY_BYTES // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_seconds(lambda: dst.copy_(src)) for _ in range(REPEATS))
        copy = 2 * COPY_BYTES / best / 1e9
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "matmul_gflops": gflops, **rates, "copy_gb_s": copy}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_matmul_params(model: str) -> dict[str, int]:
    """The weights' matmul parameters: ``body`` (every weight a token's forward multiplies, the input embedding
    lookup excluded) and ``head`` (the output projection, vocab x hidden)."""
    from verl.hybrid_engine.layouts import hf_tensor_shapes
    from verl.models.config import ModelConfig

    config = ModelConfig.from_pretrained(model)
    total = sum(math.prod(shape) for shape in hf_tensor_shapes(config).values())
    table = config.vocab_size * config.hidden_size
    # untied: the embedding and the head are both in `total`; tied: once, and it is the head's weight
    body = total - table - (0 if config.tie_word_embeddings else table)
    return {"body": body, "head": table}


def phase_bounds(records: list[dict], warmup: int, params: dict[str, int], limits: dict[str, float], *,
                 rows: int, replicas: int, n: int = 1, dtype_bytes: int = 4,
                 recompute: bool = False) -> dict[str, Any]:
    """Per phase over the measured steps: the median ``seconds``, the ``bound_s`` the limits allow, ``fraction``.
    ``rows``: responses per step; ``n``: of them, samples per prompt; ``replicas``: rollout replicas decoding side
    by side."""
    steps = [r for r in records if "timing_s/step" in r]
    measured = steps[warmup:] if len(steps) > warmup else steps
    flops_s = limits["matmul_gflops"] * 1e9
    bandwidth = limits["copy_gb_s"] * 1e9
    weight_bytes = (params["body"] + params["head"]) * dtype_bytes
    out: dict[str, Any] = {}
    for phase, forwards in (("update_actor", 4 if recompute else 3), ("old_log_prob", 1), ("ref", 1), ("gen", None)):
        seconds, bounds = [], []
        for r in measured:
            if f"timing_s/{phase}" not in r or "perf/total_num_tokens" not in r:
                continue
            tokens = r["perf/total_num_tokens"]
            response = r["response_length/mean"] * rows
            if forwards is None:  # each prompt's prefill once + one weight read per decode step per replica
                prefill = (2 * params["body"] * (tokens - response) + 2 * params["head"] * rows) / n
                decode_steps = r["response_length/max"]
                bound = prefill / flops_s + decode_steps * replicas * weight_bytes / bandwidth
            else:
                forward = 2 * params["body"] * tokens + 2 * params["head"] * response
                bound = forwards * forward / flops_s
            seconds.append(r[f"timing_s/{phase}"])
            bounds.append(bound)
        if seconds:
            s, b = statistics.median(seconds), statistics.median(bounds)
            out[phase] = {"seconds": s, "bound_s": b, "fraction": b / s if s else None}
    return out


def table(roofline: dict[str, Any]) -> str:
    """The phases as text, the largest gap (smallest fraction) first."""
    limits = roofline["machine"]
    libraries = ", ".join(f"{k.removeprefix('matmul_gflops_')} {v:.1f}" for k, v in limits.items()
                          if k.startswith("matmul_gflops_"))
    lines = [f"machine: {limits['matmul_gflops']:.1f} GFLOP/s fp32 matmul ({libraries}), "
             f"{limits['copy_gb_s']:.1f} GB/s copy ({limits['threads']} threads)",
             "phase          measured s   bound s   fraction"]
    phases = sorted(roofline["phases"].items(), key=lambda kv: kv[1]["fraction"] or 0.0)
    lines += [f"{name:<14} {p['seconds']:>10.3f} {p['bound_s']:>9.3f} {p['fraction']:>10.1%}" for name, p in phases]
    return "\n".join(lines)
