"""Real SGLang 0.5.23 on CPU on a real pretrained chat model (SmolLM2-135M-Instruct, tests/helpers/real_model.py)
against transformers: greedy on the checkpoint SGLang loads itself, then again after every parameter was
overwritten through our loader (the project's rollout layout filled from the HF files, pushed in buckets): the
path the trainer's SGLang rollout takes, with what the tiny models lack (9 query heads over 3 KV heads, tied
embeddings absent from the checkpoint, rope_theta 1e5, ChatML prompts of 34-48 tokens in one batch)."""

import pytest
import torch
from helpers.real_model import chat_prompts, check_against_hf, smollm2_dir
from helpers.tolerance import log_prob_tolerance

NEW_TOKENS = 12
# Another fp32 summation order than transformers' over 30 layers whose widest reduction is the MLP's 1536 terms,
# then a log-softmax over 49152 logits (unit-RMS activations: scale 1).
TOL = log_prob_tolerance(torch.float32, width=1536, num_layers=30, vocab=49152)


@pytest.fixture(scope="module")
def real_session(run_sglang_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir))
    work = tmp_path_factory.mktemp("sglang-real")
    # The push rewrites every parameter in 16 MiB buckets, so tensors straddle bucket boundaries.
    case = {"model_dir": model_dir, "push_model_dir": model_dir, "tp": 1, "prompts": prompts,
            "new_tokens": NEW_TOKENS, "bucket_bytes": 16 << 20}
    result = run_sglang_session({"smollm2-tp1": case}, work, timeout_s=600)["smollm2-tp1"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return result, hf, prompts


@pytest.mark.parametrize("phase", ["before", "after"])
def test_sglang_greedy_on_real_chat_model_follows_transformers(real_session, phase):
    result, hf, prompts = real_session
    got = result[phase]
    assert check_against_hf(hf, prompts, got["ids"], got["logprobs"], TOL) == len(prompts) * NEW_TOKENS
    assert got["ids"][0][:12] == [33, 39, 1232, 216, 34, 37, 446, 216, 35, 34, 30, 2]  # "17 + 25 = 32.<|im_end|>"
