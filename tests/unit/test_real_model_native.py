"""The native rollout engine on a real pretrained chat model (SmolLM2-135M-Instruct, tests/helpers/real_model.py)
against transformers: what the tiny random models cannot show (9 query heads over 3 KV heads, tied embeddings
absent from the checkpoint, rope_theta 1e5, a ChatML template, prompts of 34-48 tokens of different lengths in
one left-padded batch, a vocabulary of 49152)."""

import pytest
import torch
from helpers.real_model import IM_END, chat_prompts, check_against_hf, smollm2_dir
from helpers.tiny_models import left_pad
from helpers.tolerance import log_prob_tolerance

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.native.engine import NativeRollout
from verl.models.config import ModelConfig

NEW_TOKENS = 12
# fp32: another summation order than transformers' over 30 layers whose widest reduction is the MLP's 1536 terms,
# then a log-softmax over 49152 logits (pre-norm: activations of unit RMS, scale 1).
FP32_TOL = log_prob_tolerance(torch.float32, width=1536, num_layers=30, vocab=49152)
# bf16 weights and activations against transformers' fp32: each of the 8*30+2 chained reductions rounds its
# output to bf16 once (relative eps/2 each, to first order additive), the sums themselves accumulate in fp32.
BF16_TOL = (8 * 30 + 2) * torch.finfo(torch.bfloat16).eps / 2


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, tokenizer, hf, chat_prompts(tokenizer)


def _native(model_dir, dtype):
    engine = NativeRollout(ModelConfig.from_pretrained(model_dir), dtype=dtype, pad_token_id=IM_END)
    engine.load_hf_checkpoint(model_dir)
    return engine


@pytest.fixture(scope="module")
def fp32_engine(real):
    return _native(real[0], torch.float32)


def _rows(out):
    lengths = out["response_mask"].sum(-1).tolist()
    return ([r[:n] for r, n in zip(out["responses"].tolist(), lengths, strict=True)],
            [r[:n] for r, n in zip(out["rollout_log_probs"].tolist(), lengths, strict=True)])


def test_checkpoint_is_the_real_chat_model(real):
    model_dir, tokenizer, _, prompts = real
    config = ModelConfig.from_pretrained(model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings,
            config.rope_theta) == (9, 3, True, 1e5)
    assert tokenizer.eos_token_id == IM_END and "<|im_start|>assistant" in tokenizer.decode(prompts[0])
    assert len({len(p) for p in prompts}) == len(prompts) and min(len(p) for p in prompts) > 30


def test_native_fp32_greedy_batch_equals_transformers_generate(real, fp32_engine):
    _, _, hf, prompts = real
    ids, mask = left_pad(prompts, IM_END)
    out = fp32_engine.generate(
        ids, mask, SamplingParams(temperature=0, response_length=NEW_TOKENS, eos_token_id=(IM_END,)))
    responses, log_probs = _rows(out)
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=IM_END, eos_token_id=IM_END)[:, ids.shape[1]:].tolist()
    want = [row[:row.index(IM_END) + 1] if IM_END in row else row for row in want]
    assert responses == want
    assert responses[0][-1] == IM_END  # "17 + 25 = 32.<|im_end|>": stopped at the chat template's eos
    check_against_hf(hf, prompts, responses, log_probs, FP32_TOL)


def test_native_bf16_greedy_follows_transformers(real):
    model_dir, _, hf, prompts = real
    ids, mask = left_pad(prompts, IM_END)
    out = _native(model_dir, torch.bfloat16).generate(
        ids, mask, SamplingParams(temperature=0, response_length=NEW_TOKENS, eos_token_id=(IM_END,)))
    responses, log_probs = _rows(out)
    assert check_against_hf(hf, prompts, responses, log_probs, BF16_TOL) >= len(prompts) * 4


def test_native_sampled_log_probs_are_those_of_the_distribution_sampled(real, fp32_engine):
    """verl's rollout_log_probs: log_softmax(logits / T) at the drawn token, for every row of a batch of chat
    prompts of different lengths with n samples each (rows i*n + j)."""
    _, _, hf, prompts = real
    ids, mask = left_pad(prompts, IM_END)
    n, temperature = 2, 0.7
    out = fp32_engine.generate(
        ids, mask, SamplingParams(temperature=temperature, response_length=NEW_TOKENS, n=n, seed=3,
                                  eos_token_id=(IM_END,)))
    responses, log_probs = _rows(out)
    repeated = [p for p in prompts for _ in range(n)]
    check_against_hf(hf, repeated, responses, log_probs, FP32_TOL / temperature, temperature=temperature)
