"""SGLang rollout tokens/s on one model and prompt set, for `verl bench rollout` and by hand.

    python -m verl.bench.sglang_rollout --model HF_DIR --batch 8 --prompt-len 128 \\
        --new-tokens 128 [--tp 1] [--dtype float32] [--json PATH]

:func:`bench_sglang` measures through :class:`SGLangRollout` (the engine the trainer uses): every
sequence generates exactly ``new_tokens`` tokens (no stop ids), tokens/s = B*K / wall time of one
whole generate call (prefill included), median over ``repeats`` after a warm-up call. SGLang may
live in another environment than the caller (the CPU route installs it into .venv-sglang): when
``sglang`` is not importable here, the measurement runs in a subprocess of that environment's
python (``VERL_SGLANG_PYTHON``, default ``<repo>/.venv-sglang/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from verl.bench.generate_timing import add_workload_args, time_generate
from verl.engine.rollout.sglang_rollout import kv_pool_tokens
from verl.errors import InputError, refuse
from verl.utils.engine_env import REPO, sglang_importable, sglang_python
from verl.utils.torch_dtypes import DTYPES


class SGLangBenchError(RuntimeError):
    """The SGLang measurement could not run (no SGLang environment, or it failed)."""


def sglang_available() -> bool:
    """SGLang importable here, or an SGLang environment to run the measurement in."""
    return sglang_importable() or os.path.exists(sglang_python())


def bench_sglang(model_dir: str, prompts: torch.Tensor | Sequence[Sequence[int]], new_tokens: int,
                 dtype: str = "float32", temperature: float = 1.0, repeats: int = 3, seed: int = 0,
                 tp_size: int = 1) -> dict:
    """SGLang tokens/s generating ``new_tokens`` after each of ``prompts`` (equal-length rows).

    Returns ``{"tokens_per_s", "median_s", "seconds", "new_tokens", "engine_start_s"}``.
    """
    prompts = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
    if not prompts or len({len(p) for p in prompts}) != 1 or not prompts[0]:
        raise SGLangBenchError("sglang bench: expected a non-empty batch of equal-length, non-empty prompts")
    if dtype not in DTYPES:
        raise SGLangBenchError(f"sglang bench: dtype expected one of {sorted(DTYPES)}, found {dtype!r}")
    if sglang_importable():
        return _bench_in_process(model_dir, prompts, new_tokens, dtype, temperature, repeats, seed, tp_size)
    python = sglang_python()
    if not os.path.isfile(python):
        raise SGLangBenchError(
            f"sglang bench: sglang is not importable here and {python} does not exist; "
            "run launch/setup_sglang.sh or set VERL_SGLANG_PYTHON"
        )
    with tempfile.TemporaryDirectory(prefix="verl-sglang-bench-") as work:
        request = os.path.join(work, "request.json")
        result = os.path.join(work, "result.json")
        with open(request, "w", encoding="utf-8") as fh:
            json.dump({"model_dir": model_dir, "prompts": prompts, "new_tokens": new_tokens, "dtype": dtype,
                       "temperature": temperature, "repeats": repeats, "seed": seed, "tp_size": tp_size}, fh)
        from verl.launcher.spawn import child_preexec

        proc = subprocess.run([python, "-m", "verl.bench.sglang_rollout", "--request", request,
                               "--json", result], capture_output=True, text=True, cwd=REPO,
                              preexec_fn=child_preexec())
        if proc.returncode != 0:
            raise SGLangBenchError(f"sglang bench subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)


def _bench_in_process(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, temperature: float,
                      repeats: int, seed: int, tp_size: int) -> dict:
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.sglang_rollout import SGLangRollout
    from verl.models.config import ModelConfig

    ids = torch.tensor(prompts, dtype=torch.int64)
    params = SamplingParams(temperature=temperature, response_length=new_tokens, seed=seed)
    start = time.perf_counter()
    with SGLangRollout(ModelConfig.from_pretrained(model_dir), model_dir, tp_size=tp_size, dtype=DTYPES[dtype],
                       seed=seed, max_total_tokens=kv_pool_tokens(len(prompts), ids.shape[1] + new_tokens)) as rollout:
        return time_generate(rollout, ids, params, repeats, engine_start_s=time.perf_counter() - start)

def _random_model(config_overrides: dict, path: str, seed: int, dtype: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(config_overrides)
    config = AutoConfig.for_model(overrides.pop("model_type"), **overrides)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).save_pretrained(path)
    return path


TINY_QWEN2 = dict(model_type="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=None, eos_token_id=None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl.bench.sglang_rollout",
                                     description="SGLang rollout tokens/s (see module doc)")
    parser.add_argument("--model", help="HF checkpoint dir; default: random tiny Qwen2 (hidden 64, 2 layers, "
                                        "4 heads / 2 KV heads, vocab 320)")
    add_workload_args(parser, repeats=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--request", help=argparse.SUPPRESS)  # subprocess entry of bench_sglang
    parser.add_argument("--json", metavar="PATH", help="write the result to this JSON file")
    args = parser.parse_args(argv)
    for key in ("batch", "prompt_len", "new_tokens", "tp", "repeats"):
        if getattr(args, key) < 1:
            return refuse("sglang bench", f"--{key.replace('_', '-')} expected >= 1, found {getattr(args, key)}")
    try:
        if args.request:
            with open(args.request, encoding="utf-8") as fh:
                request = json.load(fh)
            result = _bench_in_process(**request)
        else:
            with tempfile.TemporaryDirectory(prefix="verl-sglang-bench-model-") as work:
                model_dir = args.model or _random_model(TINY_QWEN2, work, args.seed, args.dtype)
                from verl.models.config import ModelConfig

                vocab = ModelConfig.from_pretrained(model_dir).vocab_size
                prompts = torch.randint(0, vocab, (args.batch, args.prompt_len),
                                        generator=torch.Generator().manual_seed(args.seed))
                result = bench_sglang(model_dir, prompts, args.new_tokens, args.dtype, args.temperature,
                                      args.repeats, args.seed, args.tp)
                result.update(batch=args.batch, prompt_len=args.prompt_len, tp=args.tp, dtype=args.dtype,
                              model=args.model or "tiny-qwen2(random)")
    except (SGLangBenchError, InputError) as exc:
        return refuse("sglang bench", exc)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    if not args.request:
        print(f"sglang {result['tokens_per_s']:9.0f} tok/s  (median {result['median_s'] * 1e3:.1f} ms for "
              f"{result['new_tokens']} tokens, engine start {result['engine_start_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
