"""The distributed data plane (verl.single_controller.data_plane) against the legacy all-gather path.

4 gloo ranks, two worker layouts over the same ranks as the trainer has them: a "rollout" mesh of 2 replicas
x TP 2 (replica 0 = ranks 0,1, collected from rank 0; replica 1 = ranks 2,3, from rank 2) and a "megatron"
mesh whose replicas are (0,2) and (1,3), collected from the second rank (the last pipeline stage). A batch
generated on the rollout mesh (n=2 rows per prompt), reordered as balance_batch reorders it, then consumed
on the megatron mesh must equal the legacy path's DataProto bit for bit, for batch sizes that need padding;
each rank must receive no more than its own replica's share of the fields it consumes.
"""

import pytest

from verl.launcher.spawn import run_ranks

pytestmark = pytest.mark.distributed

N = 2  # responses per prompt
WIDTH = 64  # wide enough rows that the messages' framing is a small part of their bytes


def _job(prompt_counts):
    import numpy as np
    import torch
    import torch.distributed as dist

    from verl.protocol import DataProto
    from verl.single_controller import MeshRank, Worker, WorkerGroup, make_nd_compute_dataproto_dispatch_fn, register
    from verl.single_controller.data_plane import STATS, ShardedBatch
    from verl.trainer.metrics import reduce_metrics

    rank = dist.get_rank()

    class Roles(Worker):
        def dispatch_meshes(self):
            return {"rollout": MeshRank(rank // 2, 2, rank % 2 == 0),
                    "megatron": MeshRank(rank % 2, 2, rank // 2 == 1)}

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"))
        def generate(self, prompts):
            ids = prompts.batch["prompt"].repeat_interleave(N, dim=0)
            responses = ids * 3 + torch.arange(ids.size(0))[:, None] % N
            out = DataProto.from_dict({"responses": responses, "mask": (responses % 2).float()},
                                      {"uid": np.repeat(prompts.non_tensor_batch["uid"], N)},
                                      {"metrics": {"gen/rows": float(len(ids))}})
            return out

        @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("megatron"))
        def log_prob(self, data):
            log_probs = data.batch["responses"].double().sin() * data.batch["mask"].double()
            return DataProto.from_dict({"log_probs": log_probs})

    group = WorkerGroup(Roles)
    out = {}
    for prompts in prompt_counts:
        base = torch.arange(prompts * WIDTH).view(prompts, WIDTH) + 100 * prompts
        gen = DataProto.from_dict({"prompt": base}, {"uid": np.array([f"p{i}" for i in range(prompts)],
                                                                     dtype=object)})
        order = torch.randperm(prompts * N, generator=torch.Generator().manual_seed(prompts))

        legacy = group.generate(gen)
        legacy.reorder(order)
        legacy.union(group.log_prob(legacy))

        # The prompts enter held by rank 0 alone, or replicated as every rank's dataloader reads them.
        start = _sharded_from_rank0(gen, ShardedBatch) if prompts != 3 else \
            ShardedBatch.replicated(gen, first_id=7 << 32)
        STATS.reset()
        sharded = group.generate(start)
        sharded.reorder(order)
        generate = (STATS.bytes_received, STATS.shard_bytes)
        STATS.reset()
        sharded.union(group.log_prob(sharded))
        consume = (STATS.bytes_received, STATS.shard_bytes)
        whole = sharded.to_dataproto()
        # Row ids: a response's is its prompt's id * N + j; a reorder carries them along; rows are found by id.
        ids = sharded.row_ids.copy()
        picked = ids[::3]
        where = sharded.positions(picked)
        by_id = sharded.gather(lambda r, where=where: where, ["log_probs"]).batch["log_probs"]
        try:  # the same rows in another order: refused (a union would pair the wrong rows)
            sharded.union(ShardedBatch(len(sharded), row_ids=ids[::-1]))
            union_refused = False
        except ValueError:
            union_refused = True
        out[prompts] = {
            "legacy": {k: v.clone() for k, v in legacy.batch.items()},
            "legacy_uid": legacy.non_tensor_batch["uid"].tolist(),
            "sharded": {k: v.clone() for k, v in whole.batch.items()},
            "sharded_uid": whole.non_tensor_batch["uid"].tolist(),
            "metrics": reduce_metrics(sharded.meta_info["metrics"]),
            "legacy_metrics": reduce_metrics(legacy.meta_info["metrics"]),
            "generate": generate, "consume": consume, "row_ids": ids.tolist(), "order": order.tolist(),
            "first_id": int(start.row_ids[0]), "by_id": by_id,
            "by_id_expected": whole.batch["log_probs"][::3].clone(), "union_refused": union_refused,
            "responses_holders": sorted(set(sharded.holder("responses").owner.tolist())),
            "log_probs_holders": sorted(set(sharded.holder("log_probs").owner.tolist())),
            "row_bytes": {k: int(v[0].numel() * v.element_size()) for k, v in legacy.batch.items()},
        }
    return out


def _sharded_from_rank0(data, sharded_cls):
    """``data`` held by rank 0 only: its tensors and its per-row objects."""
    import numpy as np
    import torch.distributed as dist

    from verl.single_controller.data_plane import ColumnGroup, FieldSpec

    rank = dist.get_rank()
    values = {**dict(data.batch.items()), **data.non_tensor_batch}
    owner = np.zeros(len(data), dtype=np.int64)
    fields = {k: FieldSpec.of(v) for k, v in values.items()}
    return sharded_cls(len(data), [ColumnGroup(fields, owner, values if rank == 0 else {}, rank)])


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_job, 4, [4, 5, 3], timeout_s=240)


@pytest.mark.parametrize("prompts", [4, 5, 3])
def test_sharded_batch_equals_the_legacy_path(ranks, prompts):
    import torch

    for rank, results in enumerate(ranks):
        r = results[prompts]
        assert r["legacy"].keys() == r["sharded"].keys() == {"responses", "mask", "log_probs"}
        for key in r["legacy"]:
            assert torch.equal(r["legacy"][key], r["sharded"][key]), (rank, key)
        assert r["legacy_uid"] == r["sharded_uid"], rank
        assert r["metrics"] == r["legacy_metrics"], rank
        # Rows stay where they were produced: responses on the rollout collect ranks, log-probs on the
        # megatron collect ranks.
        assert r["responses_holders"] == [0, 2] and r["log_probs_holders"] == [2, 3], rank


@pytest.mark.parametrize("prompts", [4, 5, 3])
def test_row_ids_follow_rows_and_address_them(ranks, prompts):
    import torch

    for rank, results in enumerate(ranks):
        r = results[prompts]
        generated = [(r["first_id"] + p) * N + j for p in range(prompts) for j in range(N)]
        assert r["row_ids"] == [generated[i] for i in r["order"]], rank
        assert torch.equal(r["by_id"], r["by_id_expected"]), rank
        assert r["union_refused"], rank


@pytest.mark.parametrize("prompts", [4, 5, 3])
def test_each_rank_receives_at_most_its_replicas_share(ranks, prompts):
    """The issue's goal: received bytes within 1.2x of what the rank's role consumed (its replica's share, the
    part held elsewhere travelling with its uid objects and the messages' framing)."""
    for rank, results in enumerate(ranks):
        received, shard = results[prompts]["consume"]
        assert 0 < shard and received <= 1.2 * shard, (rank, received, shard)
        received, shard = results[prompts]["generate"]
        assert received <= 1.2 * shard, (rank, received, shard)
        if prompts == 3:  # replicated prompts: every rank reads its share where it is
            assert received == 0, (rank, received)
