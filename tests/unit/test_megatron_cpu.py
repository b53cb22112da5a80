"""Each megatron-core CPU patch is needed (the megatron call fails without it) and works with it."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches apply only without CUDA")

from verl.engine.megatron.cpu_patches import PATCHES, apply_cpu_patches, cpu_patch_reverted  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def patched():
    apply_cpu_patches()


def _tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                  use_cpu_initialization=True, persist_layer_norm=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def test_apply_reports_every_patch_once():
    assert apply_cpu_patches() == list(PATCHES)
    assert apply_cpu_patches() == list(PATCHES)


def test_unknown_patch_name_is_rejected():
    with pytest.raises(KeyError, match="expected one of"):
        apply_cpu_patches(["no_such_patch"])


def test_rng_tracker_seeds_and_forks_on_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    def seed_and_draw():
        torch.manual_seed(7)
        mrandom.model_parallel_cuda_manual_seed(7, tp_rank=1, ep_rank=0, etp_rank=0)
        default_before = torch.get_rng_state()
        with mrandom.get_cuda_rng_tracker().fork():
            forked = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), default_before), "fork must restore the default state"
        return forked

    first, second = seed_and_draw(), seed_and_draw()
    assert torch.equal(first, second)
    # megatron seeds the tensor-parallel state with seed + 2718 + tp_rank
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(7 + 2718 + 1)))
    with cpu_patch_reverted("rng_tracker"):
        with pytest.raises((RuntimeError, AssertionError, AttributeError)):
            seed_and_draw()


def test_current_device_allocates_megatron_buffers_on_cpu():
    from megatron.core.utils import GlobalMemoryBuffer

    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test").device.type == "cpu"
    with cpu_patch_reverted("current_device"):
        with pytest.raises((RuntimeError, AssertionError)):
            GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")


def test_synchronize_is_a_noop():
    torch.cuda.synchronize()
    with cpu_patch_reverted("synchronize"):
        with pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.synchronize()


def test_cuda_literals_become_cpu_in_megatron_modules_only():
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import local_multi_tensor_l2_norm

    assert torch.equal(get_default_causal_mask(3), torch.ones(3, 3).triu(1).bool())
    assert ConstantGradScaler(2.0).scale.device.type == "cpu"
    norm, _ = local_multi_tensor_l2_norm(65536, None, [[torch.full((4,), 2.0)]], False)
    assert float(norm) == pytest.approx(4.0)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")  # torch itself is untouched
    with cpu_patch_reverted("cuda_literals"):
        with pytest.raises((RuntimeError, AssertionError)):
            get_default_causal_mask(3)
        with pytest.raises((RuntimeError, AssertionError)):
            local_multi_tensor_l2_norm(65536, None, [[torch.full((4,), 2.0)]], False)


def test_tensor_cuda_is_identity():
    weight = torch.ones(2)
    assert weight.cuda() is weight
    with cpu_patch_reverted("tensor_cuda"):
        with pytest.raises((RuntimeError, AssertionError)):
            weight.cuda()


def test_optimizer_type_check_accepts_cpu_fp32_grads():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 4.0)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=8.0)
    torch.testing.assert_close(param.grad, torch.full((3,), 0.5), rtol=1e-5, atol=0)
    assert param.type() == "torch.FloatTensor", "callers outside megatron's optimizer see the real type"
    with cpu_patch_reverted("optimizer_type_check"):
        with pytest.raises(AssertionError):
            clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=8.0)


def test_sp_torch_norm_builds_and_tags_params():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert not any(getattr(p, "sequence_parallel", False)
                   for p in WrappedTorchNorm(_tiny_config(), 8).parameters())
    with cpu_patch_reverted("sp_torch_norm"):
        with pytest.raises(AssertionError, match="sequence parallel"):
            WrappedTorchNorm(config, 8)
