"""Real SGLang (CPU) on a Llama with llama3 RoPE scaling against HF transformers: SGLang reads the scaling from
config.json itself; our loader (which reads the config through ModelConfig) must accept it, and a weight push
through the rollout layout must keep the scaled model. Prompts run past original_max_position_embeddings (16)."""

import json
import os

import pytest
import torch
from helpers.tiny_models import save_tiny_model

NEW_TOKENS = 12
PROMPTS = [list(range(3, 25)), [250, 3, 3, 18, 77, 120, 64, 9, 31] * 2]
LOGPROB_ATOL = 1e-4
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _with_rope(path: str, rope: dict) -> str:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = rope
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _hf_greedy(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs = [], []
    for prompt in PROMPTS:
        x = torch.tensor([prompt])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):]
        logp = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1)
        ids.append(tokens.tolist())
        logprobs.append(logp.gather(-1, tokens[:, None])[:, 0].tolist())
    return {"ids": ids, "logprobs": logprobs}


def _max_diff(got, want):
    return max(abs(g - w) for row_g, row_w in zip(got, want, strict=True) for g, w in zip(row_g, row_w, strict=True))


@pytest.fixture(scope="module")
def session(run_sglang_session, tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang-rope")
    model_a = _with_rope(save_tiny_model("llama", str(work / "a"), seed=1), ROPE)
    model_b = _with_rope(save_tiny_model("llama", str(work / "b"), seed=2), ROPE)
    plain = _with_rope(save_tiny_model("llama", str(work / "plain"), seed=1), {"rope_type": "default",
                                                                              "rope_theta": 10000.0})
    cases = {"llama3": {"model_dir": model_a, "push_model_dir": model_b, "tp": 1, "prompts": PROMPTS,
                        "new_tokens": NEW_TOKENS, "bucket_bytes": 32 << 10}}
    result = run_sglang_session(cases, work, timeout_s=600)["llama3"]
    return {**result, "hf_a": _hf_greedy(model_a), "hf_b": _hf_greedy(model_b), "hf_plain": _hf_greedy(plain)}


def test_sglang_greedy_and_logprobs_equal_hf_with_llama3_scaling(session):
    # The scaling matters on these prompts: the same weights with plain RoPE answer otherwise.
    assert _max_diff(session["hf_plain"]["logprobs"], session["hf_a"]["logprobs"]) > 100 * LOGPROB_ATOL \
        or session["hf_plain"]["ids"] != session["hf_a"]["ids"]
    assert session["before"]["ids"] == session["hf_a"]["ids"]
    assert _max_diff(session["before"]["logprobs"], session["hf_a"]["logprobs"]) <= LOGPROB_ATOL


def test_weight_push_through_our_loader_keeps_the_scaled_model(session):
    assert session["after"]["ids"] == session["hf_b"]["ids"]
    assert _max_diff(session["after"]["logprobs"], session["hf_b"]["logprobs"]) <= LOGPROB_ATOL
