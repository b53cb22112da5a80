"""vLLM rollout tokens/s for `verl bench rollout`: the same model, prompts and counting as the native engine's.

:func:`bench_vllm` measures through :class:`~verl.engine.rollout.vllm.engine.VLLMRollout` (the engine the trainer
uses): every sequence generates exactly ``new_tokens`` tokens (``ignore_eos``, no stop ids), tokens/s = B*K / wall time
of one whole generate call (prefill included), median over ``repeats`` after a warm-up call. vLLM lives in its own
environment (launch/setup_vllm.sh): when ``vllm`` is not importable here, the measurement runs in a subprocess of
that environment's python (``VERL_VLLM_PYTHON``, default ``<repo>/.venv-vllm/bin/python``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from verl.bench.generate_timing import time_generate
from verl.utils.engine_env import ENGINE_ENVS, REPO, importable
from verl.utils.torch_dtypes import DTYPES


class VLLMBenchError(RuntimeError):
    """The vLLM measurement could not run (no vLLM environment, or it failed)."""


def vllm_available() -> bool:
    return importable("vllm") or os.path.exists(ENGINE_ENVS["vllm"].python)


def bench_vllm(model_dir: str, prompts: torch.Tensor, new_tokens: int, dtype: str = "float32",
               temperature: float = 1.0, repeats: int = 3, seed: int = 0) -> dict:
    """vLLM tokens/s generating ``new_tokens`` after each row of ``prompts`` [B, P].

    Returns ``{"tokens_per_s", "median_s", "seconds", "new_tokens", "engine_start_s"}``."""
    request = {"model_dir": model_dir, "prompts": prompts.tolist(), "new_tokens": new_tokens, "dtype": dtype,
               "temperature": temperature, "repeats": repeats, "seed": seed}
    if importable("vllm"):
        return _bench_in_process(**request)
    python = ENGINE_ENVS["vllm"].python
    if not os.path.isfile(python):
        raise VLLMBenchError(f"vllm bench: vllm is not importable here and {python} does not exist; run "
                             "launch/setup_vllm.sh or set VERL_VLLM_PYTHON")
    with tempfile.TemporaryDirectory(prefix="verl-vllm-bench-") as work:
        request_path, result_path = os.path.join(work, "request.json"), os.path.join(work, "result.json")
        with open(request_path, "w", encoding="utf-8") as fh:
            json.dump(request, fh)
        from verl.launcher.spawn import child_preexec

        proc = subprocess.run([python, "-m", "verl.bench.vllm_rollout", request_path, result_path],
                              capture_output=True, text=True, cwd=REPO, preexec_fn=child_preexec())
        if proc.returncode != 0:
            raise VLLMBenchError(f"vllm bench subprocess failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result_path, encoding="utf-8") as fh:
            return json.load(fh)


def _bench_in_process(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, temperature: float,
                      repeats: int, seed: int) -> dict:
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.vllm.engine import VLLMRollout
    from verl.models.config import ModelConfig

    ids = torch.tensor(prompts, dtype=torch.int64)
    params = SamplingParams(temperature=temperature, response_length=new_tokens, seed=seed, ignore_eos=True)
    start = time.perf_counter()
    with VLLMRollout(ModelConfig.from_pretrained(model_dir), model_dir, dtype=DTYPES[dtype], seed=seed,
                     max_rows=len(prompts), max_seq_len=ids.shape[1] + new_tokens, load_format="auto") as rollout:
        return time_generate(rollout, ids, params, repeats, engine_start_s=time.perf_counter() - start)

if __name__ == "__main__":  # the subprocess entry of bench_vllm: REQUEST.json RESULT.json
    with open(sys.argv[1], encoding="utf-8") as fh:
        result = _bench_in_process(**json.load(fh))
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
