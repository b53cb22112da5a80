"""Real SGLang 0.5.23 on CPU against HF transformers: greedy parity, logprobs, in-place weight push.

Each (model, rollout tp) case starts one SGLangRollout session in .venv-sglang (sglang_session.py):
greedy on weights A, then a push of weights B (each rollout rank's flat buffer built from B's HF
checkpoint by the project's rollout-layout code, sent in small buckets so tensors straddle bucket
boundaries), then greedy again without restarting the engine. HF generate is the oracle.
"""

import os

import pytest
import torch
from helpers.listeners import is_loopback
from helpers.tiny_models import save_tiny_model

from verl.hybrid_engine.rollout_layout import rollout_param_specs
from verl.models.config import ModelConfig

NEW_TOKENS = 16
PROMPTS = [[5, 17, 42, 99, 7], [250, 3, 3, 18, 77, 120, 64, 9, 31], list(range(40, 56))]
LOGPROB_ATOL = 1e-4
BUCKET_BYTES = 32 << 10  # small, so pushed tensors straddle bucket boundaries
ROUND_TOKENS = 5  # partial rollout: 16 new tokens in segments of 5, 5, 5, 1

# Llama: untied lm_head and a vocabulary padded in the rollout layout. Qwen2 (tied, qkv bias) is covered at
# TP1 and TP2 against Megatron after every push by test_sglang_trainer.py (and Megatron = HF elsewhere).
CASES = [("llama", 1), ("llama", 2)]
CASE_NAMES = [f"{kind}-tp{tp}" for kind, tp in CASES]


def hf_greedy(model_dir: str):
    """HF generate, one prompt at a time (no padding): greedy ids and their log-softmax logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs = [], []
    for prompt in PROMPTS:
        x = torch.tensor([prompt])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):]
        logp = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1)
        ids.append(tokens.tolist())
        logprobs.append(logp.gather(-1, tokens[:, None])[:, 0].tolist())
    return {"ids": ids, "logprobs": logprobs}


@pytest.fixture(scope="module")
def sessions(run_sglang_session, tmp_path_factory):
    """Every case's SGLang session (one subprocess, engines one after another) and HF oracles."""
    work = tmp_path_factory.mktemp("sglang-sessions")
    cases, oracles = {}, {}
    for kind, tp in CASES:
        name = f"{kind}-tp{tp}"
        model_a, model_b = (str(work / f"{kind}-{w}") for w in "ab")
        if not os.path.isdir(model_a):
            save_tiny_model(kind, model_a, seed=1)
            save_tiny_model(kind, model_b, seed=2)
            oracles[kind] = (hf_greedy(model_a), hf_greedy(model_b), ModelConfig.from_pretrained(model_a))
        cases[name] = {"model_dir": model_a, "push_model_dir": model_b, "tp": tp, "prompts": PROMPTS,
                       "new_tokens": NEW_TOKENS, "bucket_bytes": BUCKET_BYTES, "segment_round_tokens": ROUND_TOKENS}
    results = run_sglang_session(cases, work, timeout_s=600)
    for kind, tp in CASES:
        r = results[f"{kind}-tp{tp}"]
        r["hf_a"], r["hf_b"], r["config"] = oracles[kind]
        r["tp"] = tp
    return results


@pytest.fixture
def session(request, sessions):
    return sessions[request.param]


def _max_logprob_diff(got, want):
    return max(abs(g - w) for row_g, row_w in zip(got, want, strict=False) for g, w in zip(row_g, row_w, strict=False))


@pytest.mark.parametrize("session", CASE_NAMES, indirect=True)
def test_greedy_ids_equal_hf_generate(session):
    assert session["before"]["ids"] == session["hf_a"]["ids"]
    assert all(len(row) == NEW_TOKENS for row in session["before"]["ids"])


@pytest.mark.parametrize("session", CASE_NAMES, indirect=True)
def test_logprobs_within_1e4_of_hf(session):
    assert _max_logprob_diff(session["before"]["logprobs"], session["hf_a"]["logprobs"]) <= LOGPROB_ATOL


@pytest.mark.parametrize("session", CASE_NAMES, indirect=True)
def test_partial_rollout_in_segments_equals_uninterrupted_greedy(session):
    """verl's V1 partial rollout on SGLang: each segment stopped after one round (limits as max_new_tokens, the
    stop rule between rounds), resumed by resubmitting prompt + kept tokens: the same ids as HF greedy, and
    the log-probs of the resumed tokens as those of one uninterrupted generation."""
    segmented = session["segmented"]
    assert segmented["segments"] == -(-NEW_TOKENS // ROUND_TOKENS)
    assert segmented["ids"] == session["hf_a"]["ids"]
    assert _max_logprob_diff(segmented["logprobs"], session["hf_a"]["logprobs"]) <= LOGPROB_ATOL
    assert segmented["versions"] == [[0, segmented["segments"] - 1]] * len(PROMPTS)


@pytest.mark.parametrize("session", CASE_NAMES, indirect=True)
def test_weight_push_makes_greedy_equal_hf_on_new_weights(session):
    # The pushed weights really differ in behaviour, and SGLang now follows them exactly.
    assert session["hf_b"]["ids"] != session["hf_a"]["ids"]
    assert session["after"]["ids"] == session["hf_b"]["ids"]
    assert _max_logprob_diff(session["after"]["logprobs"], session["hf_b"]["logprobs"]) <= LOGPROB_ATOL
    rank_bytes = sum(s.numel for s in rollout_param_specs(session["config"], session["tp"], 0)) * 4
    assert session["buckets"] == -(-rank_bytes // BUCKET_BYTES) > 1  # tensors straddled bucket boundaries


@pytest.mark.parametrize("session", CASE_NAMES, indirect=True)
def test_engine_processes_listen_on_loopback_only(session):
    """Issue 44: SGLang's scheduler rendezvous (torch's TCPStore for tcp://127.0.0.1) listened on [::], every
    interface, unauthenticated. SGLangRollout gives it a private file:// store and pins gloo to loopback."""
    assert session["listening"], "expected the engine's own loopback listeners (gloo, its schedulers) to be seen"
    exposed = [entry for entry in session["listening"] if not is_loopback(entry[0])]
    assert not exposed, f"SGLang engine processes listen beyond loopback: {exposed}"
