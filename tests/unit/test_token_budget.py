"""verl's dynamic batch size (use_dynamic_bsz): micro-batches cut by a valid-token budget."""

import random

import pytest
import torch

pytest.importorskip("megatron.core")

from verl.engine.megatron.engine import token_budget_groups  # noqa: E402

pytestmark = pytest.mark.unit


def mask(lengths, width=16):
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def test_first_fit_decreasing_example():
    # 12, 9, 10, 9 tokens, budget 22: 12 + 10 fill one micro-batch, the two 9s the next.
    assert token_budget_groups(mask([12, 9, 10, 9]), 22) == [[0, 2], [1, 3]]
    assert token_budget_groups(mask([12, 9, 10, 9]), 12) == [[0], [1], [2], [3]]
    assert token_budget_groups(mask([12, 9, 10, 9]), 40) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match=r"max_token_len: expected at least the longest sequence in the batch "
                                         r"\(12 tokens\), found 11"):
        token_budget_groups(mask([12, 9]), 11)


@pytest.mark.parametrize("seed", range(20))
def test_every_row_once_and_every_micro_batch_within_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(0, 16) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(16, 64)
    groups = token_budget_groups(mask(lengths), budget)
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in group) <= budget for group in groups)
    assert all(group == sorted(group) for group in groups) and groups == sorted(groups)
    # First fit never leaves two micro-batches that would fit into one.
    sums = sorted(sum(lengths[i] for i in group) for group in groups)
    assert len(sums) < 2 or sums[0] + sums[1] > budget
