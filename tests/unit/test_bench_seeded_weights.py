"""The cross-pool bench's seeded weights (verl.bench.weight_sync.SeededWeights): every rank builds only the rows it
holds, so a slice must equal the same slice of the whole tensor -- across the seed blocks' edges and after the
delta mode's Adam steps -- and the training shards and the rollout's reference built from slices must equal the
ones built from whole tensors (the bench verifies received bytes bit for bit against them)."""

import os

import pytest
import torch

from verl.bench.reshard import build_training_buffer
from verl.bench.reshard_reference import reference_rollout_params, reference_rollout_shard
from verl.bench.weight_sync import SeededWeights, _layout, training_shard
from verl.hybrid_engine.layouts import hf_tensor_shapes
from verl.models.config import ModelConfig
from verl.models.mcore.weights import to_mcore_shard

pytestmark = pytest.mark.unit

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "qwen2_tiny_arith.json")


@pytest.mark.parametrize("steps", [0, 2])
def test_slices_and_shards_equal_those_of_the_whole_tensors(steps):
    config = ModelConfig.from_pretrained(CONFIG)
    shapes = hf_tensor_shapes(config)
    weights = SeededWeights(config, 3, steps, 1e-3, block_elements=1000)  # small blocks: many block edges
    full = {name: weights.full(name, torch.float32) for name in shapes}
    source = weights.source(torch.float32)
    for name, shape in shapes.items():
        rows = full[name].reshape(shape[0], -1)
        for r0, r1 in ((0, shape[0]), (1, shape[0] // 2 + 3), (shape[0] // 3, shape[0] - 1)):
            if len(shape) == 1:
                assert torch.equal(source(name)[r0:r1], rows[r0:r1, 0]), name
            else:
                c1 = rows.shape[1] // 2 + 1
                assert torch.equal(source(name)[r0:r1, 1:c1], rows[r0:r1, 1:c1]), name
    for train in ({"tp": 2}, {"tp": 1, "pp": 2}, {"fsdp": 2}):
        layout = _layout(train)
        for rank in range(layout.world_size):
            got, offsets = training_shard(config, layout, rank, weights, torch.bfloat16)
            want, want_offsets = training_shard(config, layout, rank, full, torch.bfloat16)
            if offsets is None:  # FSDP: per-parameter rows
                assert all(torch.equal(got[k], want[k]) for k in want)
                continue
            assert offsets == want_offsets and torch.equal(got, want)
            stage, _, tp_rank = layout.coords(rank)
            mcore = to_mcore_shard(config, lambda n: full[n].to(torch.bfloat16), layout.tp, layout.pp, tp_rank, stage)
            flat, flat_offsets, _ = build_training_buffer(config, layout, rank, mcore, torch.bfloat16)
            assert flat_offsets == offsets and torch.equal(flat, got), train
            # rebuilt in place (the delta mode's second weights)
            again = SeededWeights(config, 4, steps, 1e-3, block_elements=1000)
            assert training_shard(config, layout, rank, again, torch.bfloat16, out=got)[0] is got
    for tp in (1, 2):
        for j in range(tp):
            ref = reference_rollout_shard(config, full, tp, j, torch.bfloat16)
            lazy = dict(reference_rollout_params(config, weights.source(torch.bfloat16), tp, j, torch.bfloat16))
            assert list(ref) == list(lazy) and all(torch.equal(ref[k], lazy[k]) for k in ref)
