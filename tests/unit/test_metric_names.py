"""verl's metric names for what verl-hpc shares with verl: memory (perf/cpu_memory_used_gb,
perf/max_memory_*_gb, max over ranks), critic/vf_explained_var, perf/mfu/{actor,critic}."""

import statistics
import types

import pytest
import torch

from verl.protocol import DataProto
from verl.trainer import metrics as metric_utils
from verl.utils import flops_counter


def test_memory_metrics_are_one_key_each_the_max_over_ranks():
    per_rank = [
        {"perf/cpu_memory_used_gb": 1.5, "perf/max_memory_allocated_gb": 10.0, "perf/max_memory_reserved_gb": 12.0},
        {"perf/cpu_memory_used_gb": 2.5, "perf/max_memory_allocated_gb": 9.0, "perf/max_memory_reserved_gb": 14.0},
    ]
    assert metric_utils.reduce_memory_metrics(per_rank) == {
        "perf/cpu_memory_used_gb": 2.5, "perf/max_memory_allocated_gb": 10.0, "perf/max_memory_reserved_gb": 14.0}


def test_local_memory_on_cpu_is_the_process_resident_set_in_gib(monkeypatch):
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(metric_utils, "is_cuda_available", lambda: False)
    local = metric_utils.local_memory_metrics()
    assert list(local) == ["perf/cpu_memory_used_gb"]  # no device memory keys without a GPU
    rss_gib = psutil.Process().memory_info().rss / 2**30
    assert abs(local["perf/cpu_memory_used_gb"] - rss_gib) < 0.05 * rss_gib


def test_local_memory_on_gpu_reports_allocated_and_reserved(monkeypatch):
    monkeypatch.setattr(metric_utils, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 4 * 2**30)
    local = metric_utils.local_memory_metrics()
    assert (local["perf/max_memory_allocated_gb"], local["perf/max_memory_reserved_gb"]) == (3.0, 4.0)


def _batch(values=True):
    # 3 sequences, prompt length 2 (left padded), responses of length 3 (right padded).
    attention = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    response_mask = attention[:, 2:]
    returns = torch.tensor([[1.0, 0.5, 0.25], [2.0, 3.0, 9.0], [0.0, -1.0, 7.0]])
    tensors = {
        "responses": torch.zeros(3, 3, dtype=torch.long), "attention_mask": attention, "response_mask": response_mask,
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        "advantages": torch.randn(3, 3), "returns": returns,
    }
    tensors["token_level_rewards"] = tensors["token_level_scores"]
    if values:
        tensors["values"] = torch.tensor([[0.5, 0.5, 0.5], [1.0, 2.5, -4.0], [0.5, 8.0, 8.0]])
    return DataProto.from_dict(tensors)


def test_vf_explained_var_matches_a_hand_computation():
    batch = _batch()
    # The response tokens (mask): row 0 all three, row 1 the first two, row 2 the first one.
    returns = [1.0, 0.5, 0.25, 2.0, 3.0, 0.0]
    values = [0.5, 0.5, 0.5, 1.0, 2.5, 0.5]
    residual = [r - v for r, v in zip(returns, values, strict=True)]
    expected = 1.0 - statistics.variance(residual) / (statistics.variance(returns) + 1e-5)  # unbiased, as torch.var
    metrics = metric_utils.compute_data_metrics(batch, use_critic=True)
    assert metrics["critic/vf_explained_var"] == pytest.approx(expected, rel=1e-6)
    assert metrics["critic/values/mean"] == pytest.approx(statistics.mean(values))
    assert "critic/vf_explained_var" not in metric_utils.compute_data_metrics(_batch(values=False), use_critic=False)


def test_vf_explained_var_is_one_for_a_perfect_critic_and_zero_for_a_constant_one():
    returns = torch.tensor([1.0, 2.0, 4.0, 8.0])
    assert metric_utils.explained_variance(returns, returns) == pytest.approx(1.0)
    assert metric_utils.explained_variance(returns, torch.full_like(returns, 3.0)) == pytest.approx(0.0, abs=1e-5)


TINY = types.SimpleNamespace(hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=2, vocab_size=10)


def test_training_flops_is_verls_dense_formula():
    # Per layer: mlp 3*4*8 = 96, attention projections 4*(4 + 2 + 2 + 4) = 48; embedding + head 2*10*4 = 80.
    dense = (96 + 48) * 2 + 80
    seqlens = [3, 5]
    attention = 6 * (9 + 25) * 2 * 2 * 2  # 6 * sum(s^2) * head_dim * heads * layers
    assert flops_counter.training_flops(TINY, seqlens) == 6 * dense * 8 + attention


def test_device_peak_flops_from_a_device_table(monkeypatch):
    assert flops_counter.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops_counter.device_peak_flops("NVIDIA H200") == 989e12
    assert flops_counter.device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops_counter.device_peak_flops("Tesla V100-SXM2-16GB") is None  # not listed: no promised peak
    fake = {"Fake": 1e3, "FakeXL": 2e3}
    assert flops_counter.device_peak_flops("the FakeXL card", table=fake) == 2e3  # the longest match wins
    monkeypatch.setattr(flops_counter, "is_cuda_available", lambda: False)
    assert flops_counter.device_peak_flops() is None  # CPU: no promised peak, so no mfu


def test_mfu_metrics_for_actor_and_critic_on_a_fake_peak():
    batch = _batch()  # valid tokens per sequence (attention mask): 5, 3, 3
    flops = flops_counter.training_flops(TINY, [5, 3, 3])
    timing = {"update_actor": 2.0, "update_critic": 0.5}
    out = metric_utils.compute_mfu_metrics(batch, timing, n_devices=2, peak_flops=1000.0, actor_config=TINY,
                                           actor_epochs=3, critic_config=TINY, critic_epochs=1)
    assert out == {"perf/mfu/actor": pytest.approx(3 * flops / 2.0 / 2000.0),
                   "perf/mfu/critic": pytest.approx(flops / 0.5 / 2000.0)}
    no_critic = metric_utils.compute_mfu_metrics(batch, {"update_actor": 2.0}, 2, 1000.0, TINY, 1)
    assert list(no_critic) == ["perf/mfu/actor"]
    assert metric_utils.compute_mfu_metrics(batch, timing, 2, None, TINY, 1, TINY, 1) == {}  # CPU: omitted
    assert metric_utils.compute_mfu_metrics(batch, {}, 2, 1000.0, TINY, 1) == {}  # dry run: no update
