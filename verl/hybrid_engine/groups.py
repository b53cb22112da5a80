"""Rollout process groups derived from Megatron's training groups, in one place.

Training ranks are numbered as megatron.core.parallel_state numbers them with its default order
``tp-cp-ep-dp-pp`` (cp = ep = 1): tp fastest, then dp, then pp (see :class:`TrainingLayout`).

Rollout TP rank of a training rank: sort all N ranks by (tp rank, dp rank, pp rank) and give the
i-th one rollout rank ``j = i * t_g // N``; rollout TP group ``k`` takes the k-th rank of each j.
When t_g divides t this is exactly HybridFlow's grouping (docs/architecture.md, "The 3D-HybridEngine reshard"):
``j = tp_rank // (t / t_g)``, rollout TP groups ``{(s, j*t/t_g + o) : j}`` per (dp, s, o), micro-DP
groups ``{(s, r) : r in block j, every s}`` per (dp, j), and each rank's training shard is part of
its rollout shard. Otherwise the same rule puts each rollout shard on a rank whose training tp slice
overlaps it (local slices first) and the rest moves by an all-to-all among the holders.

An :class:`FSDPLayout` numbers its ranks as (p, t, d) = (1, shard, replicate), so the same rule
applies, but its shards are row blocks of every HF tensor, not parts of rollout TP shards (SGLang
splits the row-parallel weights on dim 1): only t_g = 1 is an all-gather (inside each replicate's shard
group, whose shards together are the whole model); any t_g > 1 is the general case.
"""

from __future__ import annotations

import dataclasses

from verl.hybrid_engine.layouts import AnyTrainingLayout, LayoutError, describe_training

HYBRIDFLOW = "hybridflow"
GENERAL = "general"


@dataclasses.dataclass(frozen=True)
class ReshardGroups:
    training: AnyTrainingLayout
    rollout_tp: int
    case: str                                     # HYBRIDFLOW or GENERAL
    reason: str
    rollout_tp_rank: tuple[int, ...]              # per global rank
    rollout_tp_groups: tuple[tuple[int, ...], ...]  # each ordered by rollout tp rank
    micro_dp_groups: tuple[tuple[int, ...], ...]    # HYBRIDFLOW only, each sorted

    def rollout_tp_group_of(self, rank: int) -> tuple[int, ...]:
        return self._group_index(self.rollout_tp_groups)[rank]

    def micro_dp_group_of(self, rank: int) -> tuple[int, ...]:
        if not self.micro_dp_groups:
            raise LayoutError(f"micro-DP groups exist only in the {HYBRIDFLOW} case, this is {self.case}")
        return self._group_index(self.micro_dp_groups)[rank]

    @staticmethod
    def _group_index(groups: tuple[tuple[int, ...], ...]) -> dict[int, tuple[int, ...]]:
        return {rank: group for group in groups for rank in group}

    def summary(self) -> str:
        t = self.training
        lines = [
            f"training {describe_training(t)} -> rollout (t_g={self.rollout_tp}, "
            f"d_g={t.world_size // self.rollout_tp}) on {t.world_size} ranks: case {self.case}",
            f"  why: {self.reason}",
            f"  rollout TP groups: {[list(g) for g in self.rollout_tp_groups]}",
        ]
        if self.micro_dp_groups:
            lines.append(f"  micro-DP groups: {[list(g) for g in self.micro_dp_groups]}")
        return "\n".join(lines)


def derive_groups(training: AnyTrainingLayout, rollout_tp: int) -> ReshardGroups:
    """Rollout TP groups (and micro-DP groups when they exist) for a training layout and t_g."""
    n, t = training.world_size, training.tp
    if not isinstance(rollout_tp, int) or rollout_tp <= 0 or n % rollout_tp:
        raise LayoutError(f"rollout tp: expected a positive divisor of the world size {n}, found {rollout_tp}")
    order = sorted(range(n), key=lambda rank: (training.coords(rank)[2], training.coords(rank)[1],
                                               training.coords(rank)[0]))
    replicas = n // rollout_tp
    rollout_tp_rank = [0] * n
    for index, rank in enumerate(order):
        rollout_tp_rank[rank] = index * rollout_tp // n
    rollout_tp_groups = tuple(sorted(
        tuple(order[j * replicas + k] for j in range(rollout_tp)) for k in range(replicas)
    ))
    if training.gathers_in_place(rollout_tp):
        block = t // rollout_tp
        micro = []
        for dp in range(training.dp):
            for j in range(rollout_tp):
                micro.append(tuple(sorted(training.rank(s, dp, r) for s in range(training.pp)
                                          for r in range(j * block, (j + 1) * block))))
        case, groups = HYBRIDFLOW, tuple(micro)
    else:
        case, groups = GENERAL, ()
    reason = training.reshard_reason(rollout_tp)
    return ReshardGroups(training, rollout_tp, case, reason, tuple(rollout_tp_rank), rollout_tp_groups, groups)
