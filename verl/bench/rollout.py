"""`verl bench rollout`: rollout tokens/s of the native engine, SGLang and vLLM, same model and prompts.

    verl bench rollout --model CONFIG.json|HF_DIR --batch B --prompt-len P --new-tokens K --json PATH

A config.json gets seeded random HF weights (transformers' own initialisation) written to a
temporary checkpoint, so both engines load identical weights. Prompts are B seeded random
sequences of P tokens; every sequence generates exactly K tokens (no stop tokens). tokens/s =
B*K / wall time of one whole generate call (prefill included), median over ``--repeats`` after a
warm-up call. Native runs at rollout TP 1 with ``--threads`` intra-op threads (default 1: a tiny
model is latency-bound and extra OpenMP threads only add synchronisation).

``--device cuda`` puts the engines' weights, KV cache and sampling on the GPU (timed to completion);
``--baseline hf`` also times transformers' ``generate`` on the same weights, prompts and device (sampling at
``--temperature``, exactly K new tokens) and reports ``native_over_hf``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from verl.bench.generate_timing import add_workload_args
from verl.errors import refuse
from verl.utils.device import is_cuda_available
from verl.utils.torch_dtypes import DTYPES


def checkpoint_dir(model: str, workdir: str, seed: int, dtype: str) -> str:
    """An HF directory for ``model``: itself if it holds weights, else random weights for its config."""
    from verl.models.hf_io import has_hf_weights

    if has_hf_weights(model):
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.from_pretrained(model)
    AutoModelForCausalLM.from_config(hf_config, dtype=DTYPES[dtype]).save_pretrained(workdir)
    return workdir


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))


def _summary(seconds: list[float], tokens: int, cpu_seconds: list[float] | None = None) -> dict:
    median = statistics.median(seconds)
    summary = {"tokens_per_s": tokens / median, "median_s": median, "seconds": seconds, "new_tokens": tokens}
    if cpu_seconds:  # CPU time of this process: the figure to trust on a machine shared with others
        summary["tokens_per_cpu_s"] = tokens / statistics.median(cpu_seconds)
    return summary


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_native(model_dir: str, prompts: torch.Tensor, new_tokens: int, dtype: str, temperature: float,
                 repeats: int, seed: int, device: str = "cpu") -> dict:
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    engine = NativeRollout(ModelConfig.from_pretrained(model_dir), dtype=DTYPES[dtype], device=device)
    engine.load_hf_checkpoint(model_dir)
    params = SamplingParams(temperature=temperature, response_length=new_tokens, seed=seed)
    mask = torch.ones_like(prompts)
    engine.generate(prompts, mask, params)  # warm-up: allocates the KV cache and RoPE tables
    seconds, cpu_seconds = [], []
    for _ in range(repeats):
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, mask, params)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        if int(out["response_mask"].sum()) != prompts.shape[0] * new_tokens:
            raise RuntimeError("native bench: expected every sequence to generate all new tokens")
    return _summary(seconds, prompts.shape[0] * new_tokens, cpu_seconds)


def bench_hf(model_dir: str, prompts: torch.Tensor, new_tokens: int, dtype: str, temperature: float,
             repeats: int, seed: int, device: str = "cpu") -> dict:
    """transformers' ``generate`` on the same checkpoint, prompts and device: the baseline a peer trainer built
    on HF generates with (all prompts in one call, KV cache, exactly ``new_tokens`` each)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()
    ids = prompts.to(device)
    sample = temperature > 0
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
              "do_sample": sample, "pad_token_id": 0,
              **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {})}
    torch.manual_seed(seed)
    model.generate(ids, **kwargs)  # warm-up
    seconds, cpu_seconds = [], []
    for _ in range(repeats):
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        out = model.generate(ids, **kwargs)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        if out.shape != (prompts.shape[0], prompts.shape[1] + new_tokens):
            raise RuntimeError(f"hf bench: expected {tuple(prompts.shape)} + {new_tokens} new tokens, found "
                               f"{tuple(out.shape)}")
    return _summary(seconds, prompts.shape[0] * new_tokens, cpu_seconds)


def bench_sglang(model_dir: str, prompts: torch.Tensor, new_tokens: int, dtype: str, temperature: float,
                 repeats: int, seed: int) -> dict:
    """SGLang's engine on the same checkpoint and prompts, through the project's SGLang rollout
    (in the SGLang environment when it is not this one: see verl.bench.sglang_rollout).

    Returns ``{"skipped": reason}`` when no SGLang environment exists on this machine.
    """
    from verl.bench.sglang_rollout import bench_sglang as measure
    from verl.bench.sglang_rollout import sglang_available

    if not sglang_available():
        return {"skipped": "sglang is not installed here (bash launch/setup_sglang.sh installs it on CPU)"}
    result = measure(model_dir, prompts, new_tokens, dtype=dtype, temperature=temperature, repeats=repeats, seed=seed)
    return _summary(result["seconds"], prompts.shape[0] * new_tokens)


def bench_vllm(model_dir: str, prompts: torch.Tensor, new_tokens: int, dtype: str, temperature: float,
               repeats: int, seed: int) -> dict:
    """vLLM on the same checkpoint and prompts through the project's vLLM rollout (in the vLLM environment when it
    is not this one: see verl.bench.vllm_rollout); ``{"skipped": reason}`` when no vLLM environment exists here."""
    from verl.bench.vllm_rollout import bench_vllm as measure
    from verl.bench.vllm_rollout import vllm_available

    if not vllm_available():
        return {"skipped": "vllm is not installed here (bash launch/setup_vllm.sh installs it on CPU)"}
    from verl.engine.rollout.vllm.engine import check_vllm_model
    from verl.errors import InputError
    from verl.models.config import ModelConfig

    try:  # a model this vLLM path cannot run is a skip with the reason, not a failed bench
        check_vllm_model(ModelConfig.from_pretrained(model_dir), 1)
    except InputError as err:
        return {"skipped": str(err)}
    result = measure(model_dir, prompts, new_tokens, dtype=dtype, temperature=temperature, repeats=repeats, seed=seed)
    return {**_summary(result["seconds"], prompts.shape[0] * new_tokens), "engine_start_s": result["engine_start_s"]}


# The engines measured in their own environments' CPU builds (launch/setup_sglang.sh, launch/setup_vllm.sh), each with
# its --skip-<engine> flag.
OWN_ENV_BENCHES = {"sglang": bench_sglang, "vllm": bench_vllm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="verl bench rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF config.json (random weights) or HF checkpoint dir")
    add_workload_args(parser, repeats=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the native engine")
    parser.add_argument("--skip-sglang", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the engines compute (cuda: timed to completion with torch.cuda.synchronize)")
    parser.add_argument("--baseline", choices=("none", "hf"), default="none",
                        help="hf: also time transformers' generate on the same weights and prompts")
    parser.add_argument("--json", metavar="PATH", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not is_cuda_available():
        return refuse("verl bench rollout", "--device cuda: expected a CUDA device, found none")
    for key in ("batch", "prompt_len", "new_tokens", "repeats", "threads"):
        if getattr(args, key) < 1:
            return refuse("verl bench rollout", f"--{key.replace('_', '-')} expected >= 1, found {getattr(args, key)}")
    from verl.models.config import ModelConfig, ModelConfigError

    try:
        config = ModelConfig.from_pretrained(args.model)
    except ModelConfigError as exc:
        return refuse("verl bench rollout", exc)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="verl-bench-rollout-") as workdir:
        model_dir = checkpoint_dir(args.model, workdir, args.seed, args.dtype)
        prompts = random_prompts(config.vocab_size, args.batch, args.prompt_len, args.seed)
        common = (model_dir, prompts, args.new_tokens, args.dtype, args.temperature, args.repeats, args.seed)
        results = {"native": bench_native(*common, device=args.device)}
        if args.baseline == "hf":
            results["hf"] = bench_hf(*common, device=args.device)
        for engine, measure in OWN_ENV_BENCHES.items():
            if getattr(args, f"skip_{engine}"):
                results[engine] = {"skipped": f"--skip-{engine}"}
            elif args.device == "cuda":
                results[engine] = {"skipped": f"--device cuda: the {engine} bench runs its CPU build only"}
            else:
                results[engine] = measure(*common)
    record = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "temperature": args.temperature,
              "threads": args.threads, "tp": 1, "device": args.device, **results}
    if "hf" in results:
        record["native_over_hf"] = results["native"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    for engine, r in results.items():
        if "skipped" in r:
            print(f"{engine:7s} skipped: {r['skipped']}")
        else:
            cpu = f", {r['tokens_per_cpu_s']:.0f} tok per CPU-s" if "tokens_per_cpu_s" in r else ""
            print(f"{engine:7s} {r['tokens_per_s']:9.0f} tok/s  (median {r['median_s'] * 1e3:.1f} ms for "
                  f"{r['new_tokens']} tokens{cpu})")
    if "native_over_hf" in record:
        print(f"native / hf generate: {record['native_over_hf']:.2f}x")
    for engine in OWN_ENV_BENCHES:
        if "tokens_per_s" in results[engine]:
            print(f"native / {engine}: {results['native']['tokens_per_s'] / results[engine]['tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
