"""The native engine keeps each agent trajectory's K/V across its turns (``rollout.enable_prefix_caching``, issue 46
item 4): a turn whose prompt starts with what the trajectory's last engine call fed prefills only from where that
ends. The same greedy trajectories (ids, mask) come out with and without it, with log-probs equal within float32
noise, and the K/V is dropped whenever the weights may have changed."""

import pytest
import torch
from helpers.agent_loop_case import ASSISTANT_TURNS, base_params, rows, run_batch
from helpers.chat_models import save_chat_model

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.native.prefix_cache import PrefixCache

pytestmark = pytest.mark.unit

# float32 log-probs of the same tokens: the kept K/V was computed in an earlier call whose batch had other widths,
# so matmuls block differently (~1e-7 relative); over a ~100-token softmax this stays orders below 1e-4.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engine_and_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    path = save_chat_model(str(tmp_path_factory.mktemp("chat")), seed=3)
    engine = NativeRollout(ModelConfig.from_pretrained(path), pad_token_id=0)
    engine.load_hf_checkpoint(path)
    return engine, AutoTokenizer.from_pretrained(path)


def left_padded(rows_ids):
    width = max(len(r) for r in rows_ids)
    ids = torch.zeros(len(rows_ids), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows_ids):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def test_an_engine_call_with_kept_prefixes_equals_the_full_prefill(engine_and_tok):
    engine, _ = engine_and_tok
    params = SamplingParams(do_sample=False, response_length=6, eos_token_id=(2,), ignore_eos=True)
    first = [[5, 9, 14, 3, 7], [8, 8, 21, 40, 41, 42, 43, 11], [30, 31]]
    ids, mask = left_padded(first)
    responses, _, _ = engine.generate_responses(ids, mask, params, 0, keep_kv=True)
    kept = engine.kept_kv
    # each row's kept K/V covers its prompt and its sampled tokens but the last
    assert [k.shape[2] for k, _ in kept] == [len(r) + 5 for r in first]
    appended = [[60, 61], [62], [63, 64, 65, 66]]  # a tool's answer, a different length per row
    second = [r + responses[i].tolist()[:5] + appended[i] for i, r in enumerate(first)]
    ids2, mask2 = left_padded(second)
    params2 = SamplingParams(do_sample=False, response_length=8, eos_token_id=(2,), ignore_eos=True)
    full = engine.generate_responses(ids2, mask2, params2, 0)
    full_prefill = engine.prefilled_tokens
    reused = engine.generate_responses(ids2, mask2, params2, 0, prefix_kv=kept)
    assert torch.equal(reused[0], full[0]) and torch.equal(reused[1], full[1])
    assert (reused[2] - full[2]).abs().max() <= LOGPROB_ATOL
    # the prefill starts where the row appended to most begins its new tokens: 4 new columns for every row
    assert full_prefill == 3 * ids2.shape[1] and engine.prefilled_tokens == 3 * 4
    # a row without kept K/V (None) is prefilled whole: the prefill starts at its first real token
    partial = engine.generate_responses(ids2, mask2, params2, 0, prefix_kv=[kept[0], None, kept[2]])
    assert torch.equal(partial[0], full[0]) and (partial[2] - full[2]).abs().max() <= LOGPROB_ATOL
    assert engine.prefilled_tokens == 3 * len(second[1])


def test_agent_turns_reuse_the_kept_prefix_and_sample_what_the_full_prefill_samples(engine_and_tok):
    engine, tok = engine_and_tok
    outs = {}
    for caching in (False, True):
        engine.prefix_caching = caching
        server = engine.token_server(base_params(), pad_token_id=0)
        outs[caching] = (run_batch(server, tok), server.prompt_tokens, server.cached_tokens)
    engine.prefix_caching = True
    (plain, plain_prompt, plain_cached), (cached, prompt_tokens, cached_tokens) = outs[False], outs[True]
    assert plain_cached == 0 and prompt_tokens == plain_prompt
    for got, want in zip(cached["trajectories"], plain["trajectories"], strict=True):
        assert got["num_turns"] == 2 * ASSISTANT_TURNS
        assert got["response_ids"] == want["response_ids"] and got["response_mask"] == want["response_mask"]
        diff = max(abs(a - b) for a, b in zip(got["response_logprobs"], want["response_logprobs"], strict=True))
        assert diff <= LOGPROB_ATOL, diff
    # Turns 2 and 3 of every trajectory found their earlier turns kept: at least the first turn's prompt each.
    first_prompts = sum(len(t["prompt_ids"]) for t in cached["trajectories"])
    assert cached_tokens >= (ASSISTANT_TURNS - 1) * first_prompts, (cached_tokens, prompt_tokens)


def test_kept_prefixes_go_when_the_weights_may_change(engine_and_tok):
    engine, tok = engine_and_tok
    server = engine.token_server(base_params(), pad_token_id=0)
    run_batch(server, tok)
    assert len(server.prefix) == len(rows())  # one entry per trajectory, replaced turn by turn
    key = next(iter(server.prefix._entries))
    ids = server.prefix._entries[key][0] + [7]
    request = type("R", (), {"key": key, "prompt_ids": ids})
    assert server._prefix_plan([request]) == (False, [(key, len(ids) - 1)])
    server.interrupt()  # a weight sync may follow: the next call starts from nothing
    assert server._prefix_plan([request]) == (True, [(key, 0)])
    server.resume_turns()
    run_batch(server, tok)
    server.version = 3  # new weights under the asynchronous trainers
    assert server._prefix_plan([request])[0] is True and len(server.prefix) == 0
    run_batch(server, tok)
    server.release({"op": "pause"})
    assert len(server.prefix) == 0 and server.prefix.tokens == 0


def test_the_cache_keeps_the_most_recent_trajectories_within_its_token_budget():
    cache = PrefixCache(max_tokens=10)
    kv = lambda n: (torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))  # noqa: E731
    cache.put("a", [1, 2, 3, 4], *kv(4))
    cache.put("b", [5, 6, 7], *kv(3))
    assert cache.match("a", [1, 2, 3, 4, 9]) == 4 and cache.match("a", [1, 2, 9]) == 0
    cache.get("a", 2)  # used: b is now the least recently used
    cache.put("c", [8, 8, 8, 8], *kv(4))
    assert len(cache) == 2 and cache.match("b", [5, 6, 7]) == 0 and cache.tokens == 8
    cache.put("d", list(range(11)), *kv(11))  # larger than the whole budget: not kept
    assert len(cache) == 0 and cache.tokens == 0
    with pytest.raises(RuntimeError, match="expected K/V of 2 tokens"):
        cache.put("e", [1, 2], *kv(3))
