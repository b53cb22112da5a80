"""The custom SGLang loader's bucket -> parameter copies, without SGLang (plain tensors stand in)."""

import pytest
import torch

from verl.engine.rollout.base import SamplingParams
from verl.engine.rollout.sglang_loader import (
    RolloutBucketError,
    bucket_name,
    check_model_matches_layout,
    copy_bucket,
    parse_bucket_name,
    spec_offsets,
)
from verl.engine.rollout.sglang_rollout import cpu_threads_bind, sglang_sampling_params
from verl.hybrid_engine.rollout_layout import rollout_param_specs
from verl.models.config import ModelConfig

CONFIG = ModelConfig.from_dict(dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1))


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("bucket_elems", [1000, 4096, 10 ** 6])
def test_buckets_fill_every_parameter_exactly(tp_rank, bucket_elems):
    specs = rollout_param_specs(CONFIG, 2, tp_rank)
    _, total = spec_offsets(specs)
    flat = torch.randn(total)
    params = {s.name: torch.full(s.shape, float("nan")) for s in specs}
    copied = sum(copy_bucket(flat[a:a + bucket_elems], a, specs, params) for a in range(0, total, bucket_elems))
    assert copied == total
    assert torch.equal(torch.cat([params[s.name].reshape(-1) for s in specs]), flat)


def test_bucket_past_the_rank_buffer_is_rejected():
    specs = rollout_param_specs(CONFIG, 1, 0)
    _, total = spec_offsets(specs)
    params = {s.name: torch.zeros(s.shape) for s in specs}
    with pytest.raises(RolloutBucketError, match="expected to end within"):
        copy_bucket(torch.zeros(10), total - 5, specs, params)


def test_dtype_mismatch_is_one_clear_error():
    specs = rollout_param_specs(CONFIG, 1, 0)
    params = {s.name: torch.zeros(s.shape, dtype=torch.bfloat16) for s in specs}
    with pytest.raises(RolloutBucketError, match="push weights in the engine's dtype"):
        copy_bucket(torch.zeros(10), 0, specs, params)


def test_model_layout_mismatch_names_the_parameter():
    specs = rollout_param_specs(CONFIG, 1, 0)
    params = {s.name: torch.zeros(s.shape) for s in specs}
    params["model.embed_tokens.weight"] = torch.zeros(300, 64)  # unpadded vocab
    with pytest.raises(RolloutBucketError, match=r"embed_tokens.weight: rollout layout expects shape \(320, 64\)"):
        check_model_matches_layout(params, specs)
    params = {s.name: torch.zeros(s.shape) for s in specs}
    params["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(RolloutBucketError, match="not in the layout.*o_proj.bias"):
        check_model_matches_layout(params, specs)


def test_bucket_names_round_trip_and_bad_names_fail():
    assert parse_bucket_name(bucket_name(4096, 8192)) == (4096, 8192)
    for bad in ("model.embed_tokens.weight", "verl.rollout_bucket[9:3]", "verl.rollout_bucket[1:x]"):
        with pytest.raises(RolloutBucketError, match="expected a name like"):
            parse_bucket_name(bad)


def test_cpu_threads_bind_gives_each_rank_its_cores():
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [0, 1, 2, 3]) == "0-1|2-3"
    assert cpu_threads_bind(2, [0, 2, 4, 6]) == "0,2|4,6"
    assert cpu_threads_bind(4, [0, 1]) == "0|1|0|1"


def test_sampling_params_map_to_sglang_names():
    greedy = sglang_sampling_params(SamplingParams(temperature=0.7, do_sample=False, response_length=9))
    got = (greedy["temperature"], greedy["top_k"], greedy["max_new_tokens"], greedy["ignore_eos"])
    assert got == (0.0, -1, 9, True)
    sampled = sglang_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, eos_token_id=2,
                                                    stop_token_ids=(7,)))
    assert sampled["stop_token_ids"] == [2, 7] and sampled["ignore_eos"] is False
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 5)


def test_sglang_cpu_head_padding_is_rejected_by_the_loader():
    from types import SimpleNamespace

    from verl.engine.rollout.sglang_loader import check_no_head_padding

    # What SGLang 0.5.23 leaves in model.config on CPU for 4 heads / 1 KV head at tp 2.
    padded = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, original_num_attention_heads=4,
                             original_total_num_kv_heads=1)
    with pytest.raises(RolloutBucketError, match=r"padded attention heads for tp=2 on CPU \(4 -> 8 query, 1 -> 2 KV"):
        check_no_head_padding(padded, 2)
    check_no_head_padding(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 2)


def test_sglang_rollout_refuses_cpu_tp_above_kv_heads_before_starting():
    from verl.engine.rollout.sglang_rollout import SGLangRollout, SGLangRolloutError

    with pytest.raises(SGLangRolloutError, match="tp=2 on CPU: expected a tp dividing num_key_value_heads=1"):
        SGLangRollout(CONFIG, "/nonexistent", tp_size=2, device="cpu")
