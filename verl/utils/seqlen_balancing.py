"""Sequence-length balancing: equal-count partitions with near-equal token sums (``trainer.balance_batch``).

``equal_size_partitions(weights, k)``: the largest-differencing method (Karmarkar-Karp) restricted to
equal counts: the items, heaviest first, are cut into rows of k (one item per group), each row a partial
solution of k groups; the two partial solutions with the largest spread are merged, heaviest group of one
with lightest of the other, until one is left. Every group gets len(weights) / k items.

``balanced_dp_order(lengths, dp, block)``: a permutation of a batch such that, split into ``dp``
contiguous chunks (what the DP dispatch does), the chunks hold near-equal token sums, while every
``block``-row slice of every chunk keeps its set of rows: the rows at chunk positions
[q * block, (q + 1) * block) over all chunks are the same set before and after. Mini-batches that are
unions of such slices (the actor's and critic's, when block divides their per-rank sizes) therefore
hold the same sequences: balancing moves work between ranks, never changes what is optimised. Each
slice is partitioned as above, the slices' partitions are merged the same way (one group of every slice
per rank), then single swaps within a slice between the heaviest and the lightest rank narrow the gap
further; a batch already at least as balanced is left as it is.

``seqlen_balance_metrics``: verl's ``global_seqlen/*`` metrics of a reorder.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence

Groups = list[tuple[float, list[int]]]  # (weight sum, item indices), heaviest first


def _largest_differencing(partials: list[Groups]) -> Groups:
    """Merge partial solutions of k groups each into one: the two with the largest spread first, the
    heaviest group of one joined with the lightest of the other (Karmarkar-Karp's step)."""
    tie = itertools.count()
    heap = [(-(g[0][0] - g[-1][0]), next(tie), g) for g in partials]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)),
                        key=lambda g: -g[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return heap[0][2]


def _rows_of_k(weights: Sequence[float], items: Sequence[int], k: int) -> list[Groups]:
    order = sorted(items, key=lambda i: (-weights[i], i))
    return [sorted(((weights[i], [i]) for i in order[start:start + k]), key=lambda g: -g[0])
            for start in range(0, len(order), k)]


def equal_size_partitions(weights: Sequence[float], k: int) -> list[list[int]]:
    """``k`` lists of item indices, each of ``len(weights) / k`` items, with near-equal weight sums;
    each list ascending."""
    n = len(weights)
    if k < 1 or n % k:
        raise ValueError(f"equal_size_partitions: expected k >= 1 dividing the {n} items, found k={k}")
    return [sorted(indices) for _, indices in _largest_differencing(_rows_of_k(weights, range(n), k))]


def balanced_dp_order(lengths: Sequence[int], dp: int, block: int | None = None) -> list[int]:
    """The permutation ``order`` (new row j = old row order[j]) described in the module docstring.
    ``block``: rows per chunk slice whose set is kept (default: the whole chunk)."""
    n = len(lengths)
    if dp < 1 or n % dp:
        raise ValueError(f"balance_batch: expected the batch of {n} rows to split evenly over dp={dp} ranks, "
                         f"found remainder {n % dp if dp >= 1 else n}")
    chunk = n // dp
    block = chunk if block is None else block
    if block < 1 or chunk % block:
        raise ValueError(f"balance_batch: expected a block size dividing the {chunk} rows per rank, found {block}")
    # One partial solution per slice (dp groups of `block` rows drawn from that slice), then merged across
    # slices: each final group takes exactly one group of every slice.
    slices = []
    for q in range(chunk // block):
        rows = [r * chunk + q * block + t for r in range(dp) for t in range(block)]
        groups = _largest_differencing(_rows_of_k(lengths, rows, dp))
        # Tag each group with its slice so a rank's rows can be laid out slice by slice.
        slices.append([(total, [(q, i) for i in sorted(indices)]) for total, indices in groups])
    # per_rank[r][q]: the rows rank r takes from slice q.
    per_rank = [[[] for _ in range(chunk // block)] for _ in range(dp)]
    for rank, (_, tagged) in enumerate(_largest_differencing(slices)):
        for q, i in tagged:
            per_rank[rank][q].append(i)
    _refine(lengths, per_rank)
    order = [i for rank in per_rank for rows in rank for i in sorted(rows)]
    identity = list(range(n))
    if _spread(lengths, order, dp) >= _spread(lengths, identity, dp):
        return identity  # the batch was already at least as balanced
    return order


def _spread(lengths: Sequence[int], order: Sequence[int], dp: int) -> float:
    chunk = len(order) // dp
    sums = [sum(lengths[i] for i in order[r * chunk:(r + 1) * chunk]) for r in range(dp)]
    return max(sums) - min(sums)


def _refine(lengths: Sequence[int], per_rank: list[list[list[int]]], max_swaps: int = 10000) -> None:
    """Local search after the differencing: swap one row of the heaviest rank with one of the lightest from
    the same slice while that narrows their gap (the best such swap each time)."""
    for _ in range(max_swaps):
        totals = [sum(lengths[i] for rows in rank for i in rows) for rank in per_rank]
        heavy = max(range(len(totals)), key=lambda r: (totals[r], -r))
        light = min(range(len(totals)), key=lambda r: (totals[r], r))
        gap = totals[heavy] - totals[light]
        best = None  # (new gap, slice, position in heavy, position in light)
        for q, (h_rows, l_rows) in enumerate(zip(per_rank[heavy], per_rank[light], strict=True)):
            if not h_rows:
                continue
            by_weight = sorted(range(len(l_rows)), key=lambda j: lengths[l_rows[j]])
            weights = [lengths[l_rows[j]] for j in by_weight]
            for a, i in enumerate(h_rows):
                # Moving delta = w_i - w_j from heavy to light: the new gap is |gap - 2 delta|.
                want = lengths[i] - gap / 2
                pos = bisect.bisect_left(weights, want)
                for b in (pos - 1, pos):
                    if 0 <= b < len(weights):
                        delta = lengths[i] - weights[b]
                        new_gap = abs(gap - 2 * delta)
                        if 0 < delta and new_gap < gap and (best is None or new_gap < best[0]):
                            best = (new_gap, q, a, by_weight[b])
        if best is None:
            return
        _, q, a, b = best
        per_rank[heavy][q][a], per_rank[light][q][b] = per_rank[light][q][b], per_rank[heavy][q][a]


def seqlen_balance_metrics(lengths: Sequence[int], order: Sequence[int], dp: int,
                           prefix: str = "global_seqlen") -> dict[str, float]:
    """verl's balance metrics: token sums of the ``dp`` contiguous chunks before (``min``, ``max``,
    ``minmax_diff``) and after the reorder ``order`` (``balanced_min``, ``balanced_max``), and the mean."""
    chunk = len(lengths) // dp
    before = [sum(lengths[r * chunk:(r + 1) * chunk]) for r in range(dp)]
    after = [sum(lengths[i] for i in order[r * chunk:(r + 1) * chunk]) for r in range(dp)]
    return {f"{prefix}/min": float(min(before)), f"{prefix}/max": float(max(before)),
            f"{prefix}/minmax_diff": float(max(before) - min(before)),
            f"{prefix}/balanced_min": float(min(after)), f"{prefix}/balanced_max": float(max(after)),
            f"{prefix}/mean": sum(lengths) / dp}
