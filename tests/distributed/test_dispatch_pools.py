"""Worker groups on separate rank sets (resource pools): a DataProto produced on one pool reaches
every rank's driver and feeds the next group on another pool, over gloo."""

from verl.launcher.spawn import run_ranks


def _pools_job():
    import torch

    from verl.protocol import DataProto
    from verl.single_controller import Dispatch, ResourcePool, Worker, WorkerGroup, register

    class Producer(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def produce(self, data):
            return DataProto.from_dict({"y": data.batch["x"] * 10})

    class Consumer(Worker):
        def __init__(self):
            import torch.distributed as dist

            self.rank = dist.get_rank()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def total(self, data):
            return (self.rank, int(data.batch["y"].sum()))

    producer = WorkerGroup(Producer, pool=ResourcePool((1,)))
    consumer = WorkerGroup(Consumer, pool=ResourcePool((0,)))
    produced = producer.produce(DataProto.from_dict({"x": torch.arange(5)[:, None]}))
    # verl's all_gather_data_proto: every rank ends with all ranks' rows, in rank order, in place.
    import torch.distributed as dist

    from verl.protocol import all_gather_data_proto

    rank = dist.get_rank()
    mine = DataProto.from_dict({"r": torch.full((2, 1), rank)}, {"tag": [f"r{rank}a", f"r{rank}b"]})
    all_gather_data_proto(mine)
    return {"y": produced.batch["y"].flatten().tolist(), "total": consumer.total(produced),
            "has_producer": producer.worker is not None,
            "gathered": (mine.batch["r"].flatten().tolist(), list(mine.non_tensor_batch["tag"]))}


def test_dataproto_moves_between_worker_groups_on_separate_rank_sets():
    results = run_ranks(_pools_job, 2, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["y"] == [0, 10, 20, 30, 40]
        assert [tuple(t) for t in result["total"]] == [(0, 100)]
        assert result["has_producer"] == (rank == 1)
        assert result["gathered"] == ([0, 0, 1, 1], ["r0a", "r0b", "r1a", "r1b"])
