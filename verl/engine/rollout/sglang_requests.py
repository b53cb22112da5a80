"""What a request to SGLang is made of (our sampling parameters in SGLang's words) and how its refusals are raised;
shared by the trainer's engine (:mod:`verl.engine.rollout.sglang_rollout`) and its agent-loop token server
(:mod:`verl.engine.rollout.sglang_token_server`)."""

from __future__ import annotations

from typing import Any

from verl.engine.rollout.base import SamplingParams


class SGLangRolloutError(RuntimeError):
    """SGLang refused a request (engine start, weight update) or returned something unexpected."""


def sglang_sampling_params(sp: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams -> one SGLang sampling_params dict (``n`` and seeds are set per request)."""
    stop = list(sp.stop_ids)
    return {
        "temperature": 0.0 if sp.greedy else float(sp.temperature),
        "top_p": 1.0 if sp.greedy else float(sp.top_p),
        "top_k": -1 if sp.greedy or sp.top_k <= 0 else int(sp.top_k),
        "max_new_tokens": int(sp.response_length),
        "stop_token_ids": stop or None,
        "ignore_eos": not stop,
        "skip_special_tokens": False,
    }
