"""Real SGLang 0.5.23 on CPU on Gemma 3 270M (tests/helpers/gemma3_model.py) against transformers (issue 58): greedy on
the checkpoint SGLang loads itself, then again after every parameter was overwritten through our loader (the
project's rollout layout filled from the HF files, pushed in buckets: the trainer's SGLang path), on the short prompt
and on a 520-token prompt of random ids, past the 512-position sliding window. There the window decides the answer:
measured, full attention on every layer (the native engine with its windows off) picks another first token
(237869, not transformers' 237697), so a rollout ignoring the window fails the argmax check."""

import pytest
import torch
from helpers.gemma3_model import NEW_TOKENS, check_rollout_past_the_window, gemma3_dir, window_prompts


@pytest.fixture(scope="module")
def session(run_sglang_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = gemma3_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = window_prompts(tokenizer)
    case = {"model_dir": model_dir, "push_model_dir": model_dir, "tp": 1, "prompts": prompts,
            "new_tokens": NEW_TOKENS, "bucket_bytes": 16 << 20}
    result = run_sglang_session({"gemma3-tp1": case}, tmp_path_factory.mktemp("sglang-gemma3"),
                                timeout_s=600)["gemma3-tp1"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return result, hf, tokenizer, prompts


def test_sglang_greedy_on_gemma3_follows_transformers_past_the_window(session):
    """After the push (the trainer's path) against transformers, token by token; SGLang's own load gave the same."""
    result, hf, tokenizer, prompts = session
    check_rollout_past_the_window(hf, tokenizer, prompts, result["after"], result["before"])
