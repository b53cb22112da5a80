"""Device placement on a CPU-only machine: one rule picks the device, and the native rollout and the
Megatron engine's batches follow it. FakeTensorMode lets a CPU-only torch build tensors on
``cuda:0`` and raises on any op that mixes devices, so a tensor left on the CPU is caught here
before it reaches a GPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from verl.engine.rollout.native.engine import NativeRollout
from verl.models.config import ModelConfig
from verl.utils import device as dev

pytestmark = pytest.mark.unit

TINY = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)


def test_device_rule_is_cpu_without_cuda_and_cuda_with_it(monkeypatch):
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.get_device() == torch.device("cpu") and dev.dist_backend(1) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dev.get_device() == torch.device("cuda", 3) and dev.get_device_name() == "cuda"
    assert dev.dist_backend(4) == "nccl"
    assert dev.dist_backend(8) == "gloo"  # ranks would share GPUs: NCCL refuses duplicates
    monkeypatch.setenv(dev.DEVICE_ENV, "cpu")
    assert dev.get_device() == torch.device("cpu")
    monkeypatch.setenv(dev.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda', found 'tpu'"):
        dev.get_device()


def test_to_device_moves_tensors_and_keeps_other_values():
    batch = {"ids": torch.ones(2, 3), "n": 4}
    moved = dev.to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["n"] == 4


def test_native_rollout_buffers_are_built_on_its_device():
    """Weights, their views and the KV cache on cuda:0 (fake tensors on a CPU-only torch)."""
    config = ModelConfig.from_dict(TINY)
    cuda = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=False):
        engine = NativeRollout(config, device=cuda)
        assert engine.weight_buffer().device == cuda
        assert all(v.device == cuda for v in engine.params.views.values())
        keys, values = engine.kv_cache.reserve(2, 8)
        assert keys.device == cuda and values.device == cuda and engine.model.cos[0].device == cuda


def test_native_rollout_forward_and_sampling_stay_on_its_device():
    """Prefill, one decode step and sampling on the ``meta`` device: ops that mix a CPU tensor into
    meta ones (additions, where, cat, masks) raise, so a tensor created without the engine's device
    is caught. (FakeTensorMode cannot index fake cuda tensors on a CPU-only build.)"""
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.sampler import sample_tokens

    config = ModelConfig.from_dict(TINY)
    meta = torch.device("meta")
    engine = NativeRollout(config, device=meta)
    keys, values = engine.kv_cache.reserve(2, 8)
    engine.model.prepare(8)
    assert engine.model.cos[0].device == meta
    ids = torch.zeros(2, 4, dtype=torch.int64, device=meta)
    positions = torch.arange(4, device=meta).expand(2, 4)
    allowed = torch.ones(2, 1, 4, 4, dtype=torch.bool, device=meta)
    logits = engine.model.forward(ids, positions, keys, values, 0, allowed)
    step = engine.model.forward(ids[:, :1], positions[:, -1:] + 1, keys, values, 4,
                                torch.ones(2, 1, 1, 5, dtype=torch.bool, device=meta))
    assert logits.device == meta and step.device == meta
    tokens, log_probs = sample_tokens(logits, SamplingParams(temperature=0.0), None)
    assert tokens.device == meta and log_probs.device == meta


def test_a_cpu_tensor_mixed_into_a_meta_forward_is_caught():
    """The check above can fail: a RoPE table left on the CPU breaks the meta forward."""
    config = ModelConfig.from_dict(TINY)
    meta = torch.device("meta")
    engine = NativeRollout(config, device=meta)
    keys, values = engine.kv_cache.reserve(2, 8)
    engine.model.prepare(8)
    engine.model.cos[0] = torch.ones(8, engine.model.head_dim)  # what a device-blind prepare() would build
    ids = torch.zeros(2, 4, dtype=torch.int64, device=meta)
    positions = torch.arange(4, device=meta).expand(2, 4)
    allowed = torch.ones(2, 1, 4, 4, dtype=torch.bool, device=meta)
    with pytest.raises(Exception, match="device"):
        engine.model.forward(ids, positions, keys, values, 0, allowed)


def test_one_device_rule_every_other_module_asks_verl_utils_device():
    """``torch.cuda.is_available()`` appears in verl.utils.device alone, so VERL_DEVICE=cpu reaches every engine,
    role and CLI; verl.protocol (a layer below verl.utils) asks torch only whether CUDA tensors can load at all."""
    import pathlib

    root = pathlib.Path(dev.__file__).resolve().parents[1]
    allowed = {"utils/device.py", "protocol.py"}
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             if str(path.relative_to(root)) not in allowed
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "cuda.is_available(" in line]
    assert not found, found
