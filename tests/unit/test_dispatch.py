"""Dispatch modes on a fake world: what each pool rank receives and what the driver gets back.

``run_on_fake_world`` runs the same dispatch/collect functions the worker group runs across
processes, calling every pool rank's method in turn in this process.
"""

import pytest
import torch

from verl.protocol import DataProto
from verl.single_controller import (
    Dispatch,
    DispatchInfo,
    MeshRank,
    Worker,
    WorkerGroup,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.single_controller.decorator import get_dispatch_spec, registered_methods, run_on_fake_world


def pool_info(n, **meshes):
    return DispatchInfo(tuple(range(n)), {"dp": tuple(MeshRank(i, n, True) for i in range(n)), **meshes})


def megatron_mesh(tp, pp, dp):
    """Megatron rank order tp-dp-pp: rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    out = []
    for rank in range(tp * pp * dp):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        out.append(MeshRank(dp_rank, dp, pp_rank == pp - 1 and tp_rank == 0))
    return tuple(out)


def rows(n, start=0):
    return DataProto.from_dict({"x": torch.arange(start, start + n)[:, None]})


def test_one_to_all_gives_every_rank_the_same_arguments_and_returns_every_output():
    got = run_on_fake_world(pool_info(3), get_dispatch_spec(Dispatch.ONE_TO_ALL),
                            lambda rank, args, kwargs: (rank, args, kwargs), ("a",), {"k": 1})
    assert got == [(0, ("a",), {"k": 1}), (1, ("a",), {"k": 1}), (2, ("a",), {"k": 1})]


def test_all_to_all_hands_element_i_to_pool_rank_i():
    got = run_on_fake_world(pool_info(2), get_dispatch_spec(Dispatch.ALL_TO_ALL),
                            lambda rank, args, kwargs: (args[0], kwargs["y"]), (["a", "b"],), {"y": [1, 2]})
    assert got == [("a", 1), ("b", 2)]


def test_all_to_all_rejects_a_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="list of 3 items"):
        run_on_fake_world(pool_info(3), get_dispatch_spec(Dispatch.ALL_TO_ALL), lambda r, a, k: None, (["a"],))


def test_rank_zero_returns_pool_rank_zero_output_only():
    got = run_on_fake_world(pool_info(4), get_dispatch_spec(Dispatch.RANK_ZERO), lambda rank, a, k: rank * 10)
    assert got == 0


def test_dp_compute_proto_pads_splits_and_concatenates_in_rank_order():
    seen = {}

    def method(rank, args, kwargs):
        seen[rank] = args[0].batch["x"].flatten().tolist()
        return DataProto.from_dict({"y": args[0].batch["x"] * 2})

    out = run_on_fake_world(pool_info(2), get_dispatch_spec(Dispatch.DP_COMPUTE_PROTO), method, (rows(5),))
    assert seen == {0: [0, 1, 2], 1: [3, 4, 0]}  # padded with the first row to a multiple of 2
    assert out.batch["y"].flatten().tolist() == [0, 2, 4, 6, 8]


def test_megatron_compute_proto_sends_one_share_per_dp_replica_and_collects_last_stage_tp0():
    info = pool_info(8, megatron=megatron_mesh(tp=2, pp=2, dp=2))
    seen = {}

    def method(rank, args, kwargs):
        seen[rank] = args[0].batch["x"].flatten().tolist()
        return DataProto.from_dict({"y": args[0].batch["x"] + 100 * rank})

    out = run_on_fake_world(info, get_dispatch_spec(Dispatch.MEGATRON_COMPUTE_PROTO), method, (rows(4),))
    # dp replica 0 = ranks {0, 1, 4, 5}, replica 1 = {2, 3, 6, 7}: every tp/pp rank of a replica sees its share.
    assert {r: seen[r] for r in (0, 1, 4, 5)} == {r: [0, 1] for r in (0, 1, 4, 5)}
    assert {r: seen[r] for r in (2, 3, 6, 7)} == {r: [2, 3] for r in (2, 3, 6, 7)}
    # Collected from the last stage's tp rank 0 of each replica: rank 4 (dp 0) then rank 6 (dp 1).
    assert out.batch["y"].flatten().tolist() == [400, 401, 602, 603]


def test_nd_mesh_dispatch_drops_the_padding_of_methods_that_return_n_rows_per_input():
    rollout = tuple(MeshRank(rank // 2, 2, rank % 2 == 0) for rank in range(4))  # rollout tp 2, 2 replicas
    info = pool_info(4, rollout=rollout)

    def generate(rank, args, kwargs):
        return args[0].repeat(2, interleave=True)

    out = run_on_fake_world(info, make_nd_compute_dataproto_dispatch_fn("rollout"), generate, (rows(3),))
    assert out.batch["x"].flatten().tolist() == [0, 0, 1, 1, 2, 2]


def test_unknown_mesh_names_the_meshes_the_worker_declared():
    with pytest.raises(KeyError, match="rollout"):
        run_on_fake_world(pool_info(2), make_nd_compute_dataproto_dispatch_fn("rollout"), lambda r, a, k: None,
                          (rows(2),))


class EchoWorker(Worker):
    def __init__(self, scale):
        self.scale = scale

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scaled(self, data):
        return DataProto.from_dict({"y": data.batch["x"] * self.scale})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self, prefix):
        return f"{prefix}{self.scale}"

    def not_registered(self):
        return None


def test_register_marks_methods_and_world_size_one_runs_in_process():
    assert set(registered_methods(EchoWorker)) == {"scaled", "describe"}
    group = WorkerGroup(EchoWorker, 3)
    assert group.scaled(rows(3)).batch["y"].flatten().tolist() == [0, 3, 6]
    assert group.describe("scale=") == ["scale=3"]
    assert not hasattr(group, "not_registered")
