"""trainer.balance_batch's partitioning: equal counts, near-equal token sums, every mini-batch slice kept."""

import random

import pytest

from verl.utils.seqlen_balancing import balanced_dp_order, equal_size_partitions, seqlen_balance_metrics

pytestmark = pytest.mark.unit


def sums(lengths, order, dp):
    chunk = len(order) // dp
    return [sum(lengths[i] for i in order[r * chunk:(r + 1) * chunk]) for r in range(dp)]


def test_equal_size_partitions_known_cases():
    weights = [8, 7, 6, 5, 4, 3]
    groups = equal_size_partitions(weights, 2)
    assert sorted(len(g) for g in groups) == [3, 3]
    assert sorted(sum(weights[i] for i in g) for g in groups) == [16, 17]  # 33: the best split possible
    assert sorted(map(tuple, equal_size_partitions([5, 1, 1, 5], 4))) == [(0,), (1,), (2,), (3,)]
    groups = equal_size_partitions([9, 9, 1, 1], 2)
    assert sorted(sorted(g) for g in groups) in ([[0, 2], [1, 3]], [[0, 3], [1, 2]])  # a 9 and a 1 each
    with pytest.raises(ValueError, match="dividing the 5 items"):
        equal_size_partitions([1, 2, 3, 4, 5], 2)


@pytest.mark.parametrize("seed", range(40))
def test_balanced_order_is_a_permutation_that_keeps_slices_and_narrows_the_spread(seed):
    rng = random.Random(seed)
    dp, block, slices = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 3, 5]), rng.randint(1, 4)
    n = dp * block * slices
    lengths = [rng.choice([rng.randint(1, 20), rng.randint(1, 1000)]) for _ in range(n)]
    order = balanced_dp_order(lengths, dp, block)
    assert sorted(order) == list(range(n))
    chunk = n // dp
    for q in range(slices):  # the rows at chunk positions [q*block, (q+1)*block), over all chunks
        positions = [r * chunk + q * block + t for r in range(dp) for t in range(block)]
        assert {order[p] for p in positions} == set(positions)
    before, after = sums(lengths, list(range(n)), dp), sums(lengths, order, dp)
    assert max(after) - min(after) <= max(before) - min(before)
    assert max(after) - min(after) <= max(lengths)


def test_balancing_a_skewed_batch_and_verl_metrics():
    # Rank 0's share (rows 0-3) holds every long sequence.
    lengths = [100, 90, 80, 70, 10, 20, 30, 40]
    order = balanced_dp_order(lengths, 2)
    assert sums(lengths, order, 2) == [220, 220]
    metrics = seqlen_balance_metrics(lengths, order, 2)
    assert metrics == {"global_seqlen/min": 100.0, "global_seqlen/max": 340.0, "global_seqlen/minmax_diff": 240.0,
                       "global_seqlen/balanced_min": 220.0, "global_seqlen/balanced_max": 220.0,
                       "global_seqlen/mean": 220.0}
    # Slices of 2 rows: rows {0, 1, 4, 5} and {2, 3, 6, 7} each split 2 and 2.
    order = balanced_dp_order(lengths, 2, block=2)
    assert {order[0], order[1], order[4], order[5]} == {0, 1, 4, 5}
    assert sums(lengths, order, 2) == [220, 220]


def test_an_already_balanced_batch_is_left_alone_and_bad_sizes_are_refused():
    assert balanced_dp_order([5, 5, 5, 5], 2) == [0, 1, 2, 3]
    assert balanced_dp_order([3, 1, 2, 4], 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="batch of 5 rows to split evenly over dp=2"):
        balanced_dp_order([1] * 5, 2)
    with pytest.raises(ValueError, match="block size dividing the 4 rows per rank, found 3"):
        balanced_dp_order([1] * 8, 2, block=3)


def test_large_batches_balance_quickly():
    import time

    rng = random.Random(0)
    lengths = [rng.randint(50, 4096) for _ in range(8192)]
    start = time.perf_counter()
    order = balanced_dp_order(lengths, 16, block=64)
    assert time.perf_counter() - start < 10
    after = sums(lengths, order, 16)
    assert max(after) - min(after) <= 4096
