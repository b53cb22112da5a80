"""Gemma 3 on the native rollout engine against transformers (issue 58): the block read from the spec's data.

A tiny random Gemma 3 makes every departure from the Llama block visible at once (a window of 3 positions that
prompts of 7-9 tokens and the decode steps cross, two RoPE bases, head_dim 32 independent of hidden 64 / 4 heads,
query_pre_attn_scalar 24 != head_dim, the final logits soft-capped, pre- and post-norms stored as w - 1, GeGLU,
the sqrt(hidden) embedding scale); the real checkpoint (Gemma 3 270M, tests/helpers/gemma3_model.py) then checks
the answer, the logits and a prompt longer than its 512-position window."""

import pytest
import torch
from helpers.gemma3_model import ANSWER, PROMPT, gemma3_dir
from helpers.real_model import check_against_hf
from helpers.tiny_models import left_pad
from helpers.tolerance import forward_tolerance

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.native.engine import NativeRollout
from verl.models.config import ModelConfig


def depth(layers: int) -> int:
    """Chained reductions of a Gemma 3 layer: four RMSNorms around attention and MLP, q and k norms, q/k/v, the
    scores, the weighted sum of values, o_proj, the MLP's two projections (12); then the final norm and the head."""
    return 12 * layers + 2


def tolerances(layers: int, width: int, vocab: int, scale: float) -> tuple[float, float]:
    """(logits, log-probs): another fp32 summation order than transformers' (the log-softmax adds one reduction
    over the vocabulary)."""
    logits = forward_tolerance(torch.float32, width=width, depth=depth(layers), scale=scale)
    return logits, logits + forward_tolerance(torch.float32, width=vocab, depth=1, scale=scale)


TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            final_logit_softcapping=5.0, max_position_embeddings=64,
            initializer_range=0.2, tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def _tiny(tmp_path):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Gemma3TextConfig(**TINY), dtype=torch.float32).eval()
    with torch.no_grad():  # the norms start at w = 0 (scale 1): give them values, or w - 1 vs w would not show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    return str(tmp_path), hf


def _engine(model_dir, dtype=torch.float32):
    engine = NativeRollout(ModelConfig.from_pretrained(model_dir), dtype=dtype, pad_token_id=0)
    engine.load_hf_checkpoint(model_dir)
    return engine


def _rows(out):
    lengths = out["response_mask"].sum(-1).tolist()
    return ([r[:n] for r, n in zip(out["responses"].tolist(), lengths, strict=True)],
            [r[:n] for r, n in zip(out["rollout_log_probs"].tolist(), lengths, strict=True)])


def test_the_config_is_read_into_the_block_fields():
    config = ModelConfig.from_pretrained(gemma3_dir())
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.head_dim) == \
        ("gemma3_text", 18, 640, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 1, 262144)
    assert config.sliding_window == 512 and config.sliding_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert (config.rope_theta, config.sliding_rope_theta, config.layer_rope_theta(5), config.layer_rope_theta(0)) \
        == (1e6, 1e4, (1e6, None), (1e4, None))
    assert config.hidden_act == "gelu_pytorch_tanh" and config.norm_weight_offset == 1.0
    assert config.embedding_multiplier == pytest.approx(640 ** 0.5) and config.tie_word_embeddings
    assert ModelConfig.from_fields(config.to_fields()) == config


def test_tiny_gemma3_greedy_across_the_window_equals_transformers(tmp_path):
    model_dir, hf = _tiny(tmp_path)
    config = ModelConfig.from_pretrained(model_dir)
    assert (config.final_logit_softcapping, config.attention_scale) == (5.0, 24 ** -0.5)
    prompts = [[5, 17, 33, 2, 9, 41, 7, 12, 60], [3, 4, 99, 250, 11, 8, 70], [13]]
    ids, mask = left_pad(prompts, 0)
    new = 8
    out = _engine(model_dir).generate(ids, mask, SamplingParams(temperature=0, response_length=new))
    responses, log_probs = _rows(out)
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[:, ids.shape[1]:].tolist()
    assert responses == want
    _, tol = tolerances(4, 128, 320, scale=5.0)  # final soft-capping bounds the logits by 5
    assert check_against_hf(hf, prompts, responses, log_probs, tol) == 3 * new


def test_tiny_gemma3_window_changes_the_answer(tmp_path):
    """The check above can fail: the same engine with full attention on every layer is another model."""
    model_dir, hf = _tiny(tmp_path)
    prompt = [5, 17, 33, 2, 9, 41, 7, 12, 60, 22, 31]
    engine = _engine(model_dir)
    engine.model.windows = [0] * 4
    out = engine.generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.int64),
                          SamplingParams(temperature=0, response_length=4))
    response = out["responses"][0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt + response.tolist()[:-1]])).logits[0, len(prompt) - 1:].log_softmax(-1)
    assert (want.gather(-1, response[:, None]).squeeze(-1) - out["rollout_log_probs"][0]).abs().max() > 1e-2


def test_tiny_gemma3_prefix_cache_across_the_window_equals_the_full_prefill(tmp_path):
    """The agent turns' prefix reuse: a second call whose rows start with what the first fed, given the first's
    kept K/V, prefills from there on; the window (3) then spans kept and new slots, and the greedy answers and
    log-probs equal a full prefill's."""
    model_dir, _ = _tiny(tmp_path)
    engine = _engine(model_dir)
    params = SamplingParams(do_sample=False, response_length=5)
    first = [[5, 9, 14, 3, 7], [8, 8, 21, 40, 41, 42, 43, 11], [30, 31]]
    ids, mask = left_pad(first, 0)
    responses, _, _ = engine.generate_responses(ids, mask, params, 0, keep_kv=True)
    kept = engine.kept_kv
    second = [r + responses[i].tolist()[:4] + [60 + i] * (i + 1) for i, r in enumerate(first)]
    ids2, mask2 = left_pad(second, 0)
    full = engine.generate_responses(ids2, mask2, params, 0)
    full_prefill = engine.prefilled_tokens
    reused = engine.generate_responses(ids2, mask2, params, 0, prefix_kv=kept)
    assert engine.prefilled_tokens < full_prefill
    assert torch.equal(reused[0], full[0]) and torch.equal(reused[1], full[1])
    _, tol = tolerances(4, 128, 320, scale=5.0)
    assert (reused[2] - full[2]).abs().max().item() <= tol


def test_tiny_gemma3_partial_rollout_across_the_window_equals_one_run(tmp_path):
    """Partial rollout (the async trainers' segments): greedy decoding stopped after every third step and resumed
    by prefilling the prompt and the tokens so far again gives one uninterrupted run's tokens and log-probs,
    though every resume moves the window's edge from decode into prefill."""
    from verl.engine.rollout.partial import PromptGroup, run_segment

    model_dir, _ = _tiny(tmp_path)
    engine = _engine(model_dir)
    params = SamplingParams(do_sample=False, response_length=10)

    def groups():
        prompts = [[5, 17, 33, 2, 9], [3, 4, 99, 250, 11, 8, 70], [13]]
        return [PromptGroup(uid=f"0-{i}", index=i, epoch=0, submit_step=1, prompt=p, fields={}, n=1)
                for i, p in enumerate(prompts)]

    whole, pieces, calls, segments = groups(), groups(), {"count": 0}, 0
    while not all(g.finished for g in whole):
        run_segment(engine, whole, params, 0, version=0, min_groups=len(whole))

    def abort_every_third_step():
        calls["count"] += 1
        return calls["count"] % 3 == 0

    while not all(g.finished for g in pieces):
        run_segment(engine, pieces, params, 0, version=segments, min_groups=len(pieces), abort=abort_every_third_step)
        segments += 1
    assert segments > 2
    _, tol = tolerances(4, 128, 320, scale=5.0)
    for a, b in zip(whole, pieces, strict=True):
        ta, tb = a.trajectories[0], b.trajectories[0]
        assert ta.tokens == tb.tokens and len(ta.tokens) == 10
        assert max(abs(x - y) for x, y in zip(ta.log_probs, tb.log_probs, strict=True)) <= tol


@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = gemma3_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, tokenizer, hf, _engine(model_dir)


def test_real_gemma3_fp32_logits_and_greedy_answer_equal_transformers(real):
    model_dir, tokenizer, hf, engine = real
    prompt = tokenizer(PROMPT).input_ids
    assert prompt[0] == tokenizer.bos_token_id
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = hf(ids).logits[0, -1]
    keys, values = engine.kv_cache.reserve(1, len(prompt))
    engine.model.prepare(len(prompt))
    with torch.inference_mode():
        got = engine.model.forward(ids, torch.arange(len(prompt))[None], keys, values, 0,
                                   torch.ones(len(prompt), len(prompt), dtype=torch.bool).tril()[None, None])[0]
    logits_tol, log_prob_tol = tolerances(18, 2048, 262144, scale=float(want.abs().max()))
    assert (got - want).abs().max().item() <= logits_tol
    out = engine.generate(ids, torch.ones_like(ids), SamplingParams(temperature=0, response_length=8))
    responses, log_probs = _rows(out)
    assert tokenizer.decode(responses[0]) == ANSWER
    check_against_hf(hf, [prompt], responses, log_probs, log_prob_tol)


def test_real_gemma3_prompt_longer_than_the_window(real):
    """A 520-token prompt (the prefill's sliding layers drop its first 8 positions from the last one's view, the
    decode steps more), decoded greedily: transformers teacher-forced on the prompt and response (left padding
    across a window: the tiny model's test)."""
    model_dir, tokenizer, hf, engine = real
    text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(80))
    long = tokenizer(text).input_ids[:520]
    assert len(long) == 520
    ids = torch.tensor([long])
    out = engine.generate(ids, torch.ones_like(ids), SamplingParams(temperature=0, response_length=3))
    responses, log_probs = _rows(out)
    for prompt, response, reported in zip([long], responses, log_probs, strict=True):
        with torch.no_grad():
            # (the logits of the response positions only: 262144 columns for 520 positions would dominate the test)
            logits = hf(torch.tensor([prompt + response[:-1]]), logits_to_keep=len(response)).logits[0]
        _, tol = tolerances(18, 2048, 262144, scale=float(logits.abs().max()))
        want = logits.log_softmax(-1)
        top2 = want.topk(2, dim=-1).values
        for t, token in enumerate(response):
            if float(top2[t, 0] - top2[t, 1]) > 2 * tol:
                assert token == int(want[t].argmax()), (t, token)
            assert abs(float(want[t, token]) - reported[t]) <= tol, (t, float(want[t, token]), reported[t], tol)


def test_real_gemma3_bf16_greedy_follows_transformers(real):
    """bf16 weights and activations against transformers' fp32: each of the 12*18+2 chained reductions rounds its
    output to bf16 once (relative eps/2 each, to first order additive; the sums accumulate in fp32), the bound of
    the SmolLM2 bf16 test (measured: the same answer, max |d log p| 0.054)."""
    model_dir, tokenizer, hf, _ = real
    prompt = tokenizer(PROMPT).input_ids
    ids = torch.tensor([prompt])
    out = _engine(model_dir, torch.bfloat16).generate(ids, torch.ones_like(ids),
                                                      SamplingParams(temperature=0, response_length=8))
    responses, log_probs = _rows(out)
    assert tokenizer.decode(responses[0]) == ANSWER
    assert check_against_hf(hf, [prompt], responses, log_probs, depth(18) * torch.finfo(torch.bfloat16).eps / 2) == 8
