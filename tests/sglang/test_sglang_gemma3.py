"""Real SGLang 0.5.23 on CPU on Gemma 3 270M (tests/helpers/gemma3_model.py) against transformers (issue 58): greedy on
the checkpoint SGLang loads itself, then again after every parameter was overwritten through our loader (the
project's rollout layout filled from the HF files, pushed in buckets: the trainer's SGLang path), on the short prompt
and on a 520-token prompt of random ids, past the 512-position sliding window. There the window decides the answer:
measured, full attention on every layer (the native engine with its windows off) picks another first token
(237869, not transformers' 237697), so a rollout ignoring the window fails the argmax check."""

import pytest
import torch
from helpers.gemma3_model import ANSWER, PROMPT, gemma3_dir
from helpers.tolerance import forward_tolerance

NEW_TOKENS = 6


def _tolerance(scale: float) -> float:
    """Another fp32 summation order than transformers' through 18 Gemma 3 layers of 12 chained reductions (widest:
    the MLP's 2048 terms), then a log-softmax over 262144 logits of magnitude ``scale``."""
    return (forward_tolerance(torch.float32, width=2048, depth=12 * 18 + 2, scale=scale)
            + forward_tolerance(torch.float32, width=262144, depth=1, scale=scale))


@pytest.fixture(scope="module")
def session(run_sglang_session, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = gemma3_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    long = [tokenizer.bos_token_id] + torch.randint(1000, 200000, (519,), generator=generator).tolist()
    prompts = [long, tokenizer(PROMPT).input_ids]
    case = {"model_dir": model_dir, "push_model_dir": model_dir, "tp": 1, "prompts": prompts,
            "new_tokens": NEW_TOKENS, "bucket_bytes": 16 << 20}
    result = run_sglang_session({"gemma3-tp1": case}, tmp_path_factory.mktemp("sglang-gemma3"),
                                timeout_s=600)["gemma3-tp1"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return result, hf, tokenizer, prompts


def test_sglang_greedy_on_gemma3_follows_transformers_past_the_window(session):
    """After the push (the trainer's path) against transformers, token by token; SGLang's own load gave the same."""
    result, hf, tokenizer, prompts = session
    got = result["after"]
    assert result["before"]["ids"] == got["ids"]
    for prompt, ids, log_probs, own in zip(prompts, got["ids"], got["logprobs"], result["before"]["logprobs"],
                                           strict=True):
        assert len(ids) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids[:-1]]), logits_to_keep=NEW_TOKENS).logits[0].float()
        tol = _tolerance(float(logits.abs().max()))
        want = logits.log_softmax(-1)
        top2 = want.topk(2, dim=-1).values
        for t, token in enumerate(ids):
            if t == 0 or float(top2[t, 0] - top2[t, 1]) > 2 * tol:  # the first token: the window's (see above)
                assert token == int(want[t].argmax()), (len(prompt), t)
            assert abs(float(want[t, token]) - log_probs[t]) <= tol, (len(prompt), t)
            assert abs(own[t] - log_probs[t]) <= tol, (len(prompt), t)
    assert got["ids"][0][0] == 237697
    assert ANSWER.startswith(tokenizer.decode(got["ids"][1]))
