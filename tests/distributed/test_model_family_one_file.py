"""A new architecture family is one file: this module's spec (``toy_qwen``, a test-only HF model type: Qwen3's
q/k norm with Qwen2's qkv bias, a combination no packaged family reads, and its own architecture name) joins
with ``register_spec`` and round-trips on 2 gloo ranks (tp=2) through the Megatron HF load, the training ->
rollout reshard and the HF export, each checked against the pure-torch oracle (helpers.reshard_oracle)."""

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from verl.models.spec.base import read_decoder  # noqa: E402
from verl.models.spec.qwen3 import QWEN3  # noqa: E402


def _read_toy(cfg):
    return {**read_decoder(cfg), "qk_norm": True, "attention_bias": True}


TOY = dataclasses.replace(QWEN3, model_types=("toy_qwen",), architecture="ToyQwenForCausalLM",
                          read_hf_config=_read_toy)
HF_CONFIG = dict(model_type="toy_qwen", vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
SEED, TP, ROLLOUT_TP = 5, 2, 1


def _register():
    from verl.models.spec.registry import register_spec

    register_spec(TOY)


@pytest.fixture
def toy_family():
    from verl.models.spec import registry

    _register()
    yield
    registry._specs().pop("toy_qwen")  # the packaged families only, for the tests after this one


def _round_trip_rank(rank, world, hf_dir, out_dir):
    _register()  # a rank imports this module, not the test's fixtures
    import torch.distributed as dist
    from helpers.reshard_oracle import megatron_shard, random_hf_weights, sglang_shard
    from megatron.core import parallel_state as mpu

    from verl.bench.reshard import build_training_buffer
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.hybrid_engine.executor import ReshardExecutor, ReshardProcessGroups
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.hybrid_engine.planner import plan_reshard
    from verl.hybrid_engine.rollout_layout import RolloutLayout, rollout_param_specs
    from verl.models.config import ModelConfig
    from verl.models.hf_export import export_model_hf
    from verl.models.hf_io import HFCheckpoint, read_config
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(TP, 1, seed=1)
    config = ModelConfig.from_pretrained(hf_dir)
    engine = MegatronEngine(config)
    checkpoint = HFCheckpoint(hf_dir)
    load_hf_into_model(engine.module, config, checkpoint.get, names=checkpoint.files)
    hf = random_hf_weights(config, seed=SEED)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    expected = megatron_shard(hf, config, TP, 1, tp_rank, 0)
    loaded = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if not k.endswith("_extra_state")}
    report = {"config": config.to_fields(), "load_names": list(loaded) == list(expected),
              "load_equal": all(torch.equal(loaded[k], expected[k]) for k in expected if k in loaded)}

    training = TrainingLayout(TP, 1, 1)
    flat, offsets, _ = build_training_buffer(config, training, rank, loaded, torch.float32)
    plan = plan_reshard(config, training, RolloutLayout(ROLLOUT_TP), rank, bucket_bytes=4096, dtype="float32")
    j = plan.rollout_tp_rank
    executor = ReshardExecutor(plan, flat, offsets,
                               [(s.name, s.shape) for s in rollout_param_specs(config, ROLLOUT_TP, j)],
                               ReshardProcessGroups(derive_groups(training, ROLLOUT_TP)))
    executor.to_rollout()
    got, reference = executor.rollout_params(), sglang_shard(hf, config, ROLLOUT_TP, j)
    report["reshard_mismatched"] = (sorted(n for n, t in reference.items() if n in got and not torch.equal(got[n], t))
                                    + sorted(set(got) ^ set(reference)))
    executor.release()
    dist.barrier()

    export_model_hf(engine.module, config, out_dir, read_config(hf_dir))
    dist.barrier()
    destroy_megatron()
    return report


def test_a_family_in_one_file_loads_reshards_and_exports(toy_family, tmp_path):
    from helpers.reshard_oracle import random_hf_weights

    from verl.launcher.spawn import run_ranks_with_rank
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint, write_hf_dir

    config = ModelConfig.from_dict(HF_CONFIG)
    assert (config.qk_norm, config.attention_bias) == (True, True)  # the family's reader, not a packaged one's
    hf = random_hf_weights(config, seed=SEED)
    hf_dir, out_dir = str(tmp_path / "hf"), str(tmp_path / "export")
    write_hf_dir(hf_dir, iter(hf.items()), dict(HF_CONFIG))  # config.json without `architectures`

    reports = run_ranks_with_rank(_round_trip_rank, TP, hf_dir, out_dir, timeout_s=300)
    for rank, r in enumerate(reports):
        assert r["config"] == config.to_fields(), rank
        assert r["load_names"] and r["load_equal"], f"rank {rank}: the loaded Megatron shard differs from the oracle"
        assert r["reshard_mismatched"] == [], f"rank {rank}: rollout params differ in {r['reshard_mismatched']}"
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["ToyQwenForCausalLM"]
    exported = HFCheckpoint(out_dir)
    assert sorted(exported.files) == sorted(hf)
    assert all(torch.equal(exported.get(name), tensor) for name, tensor in hf.items())
