"""vLLM on a real pretrained chat model (SmolLM2-135M-Instruct, tests/helpers/real_model.py) against transformers:
greedy on the checkpoint vLLM loads itself, then after every parameter went through the push (the rollout layout
filled from the HF files, reloaded by name): 9 query heads over 3 KV heads, tied embeddings absent from the
checkpoint, rope_theta 1e5, ChatML prompts of 34-48 tokens in one batch. Then the same on Gemma 3 270M
(tests/helpers/gemma3_model.py: sliding windows of 512, sandwich norms, GeGLU, a 262k vocabulary) on a prompt past
its window, where the window decides the first token, as tests/sglang/test_sglang_gemma3.py checks SGLang."""

import pytest
import torch
from helpers.gemma3_model import NEW_TOKENS as GEMMA3_NEW_TOKENS
from helpers.gemma3_model import check_rollout_past_the_window, gemma3_dir, window_prompts
from helpers.real_model import IM_END, chat_prompts, check_against_hf, smollm2_dir
from helpers.tolerance import log_prob_tolerance

NEW_TOKENS = 12
TOL = log_prob_tolerance(torch.float32, width=1536, num_layers=30, vocab=49152)


@pytest.fixture(scope="module")
def real_session(run_vllm_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir))
    work = tmp_path_factory.mktemp("vllm-real")
    case = {"model_dir": model_dir, "push_model_dir": model_dir, "prompts": prompts, "new_tokens": NEW_TOKENS,
            "eos": [IM_END]}
    result = run_vllm_session({"smollm2": case}, work, timeout_s=900)["smollm2"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return result, hf, prompts


@pytest.mark.parametrize("phase", ["before", "after"])
def test_vllm_greedy_on_real_chat_model_follows_transformers(real_session, phase):
    result, hf, prompts = real_session
    got = result[phase]
    assert check_against_hf(hf, prompts, got["ids"], got["logprobs"], TOL) >= len(prompts)
    assert got["ids"][0] == [33, 39, 1232, 216, 34, 37, 446, 216, 35, 34, 30, 2]  # "17 + 25 = 32.<|im_end|>"


@pytest.fixture(scope="module")
def gemma3_session(run_vllm_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = gemma3_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = window_prompts(tokenizer)
    case = {"model_dir": model_dir, "push_model_dir": model_dir, "prompts": prompts, "new_tokens": GEMMA3_NEW_TOKENS}
    result = run_vllm_session({"gemma3": case}, tmp_path_factory.mktemp("vllm-gemma3"), timeout_s=600)["gemma3"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return result, hf, tokenizer, prompts


def test_vllm_greedy_on_gemma3_follows_transformers_past_the_window(gemma3_session):
    """After the push (the trainer's path: every parameter by its rollout name, the tied head refreshed) against
    transformers, token by token; vLLM's own load gave the same; partial rollout in rounds gives the same again."""
    result, hf, tokenizer, prompts = gemma3_session
    check_rollout_past_the_window(hf, tokenizer, prompts, result["after"], result["before"])
    assert result["segmented"]["ids"] == result["after"]["ids"]
