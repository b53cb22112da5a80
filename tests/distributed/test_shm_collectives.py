"""Shared-memory CPU collectives under torch.distributed (verl._C.ShmCollectives) against gloo itself.

Every case runs the same collective through gloo (torch's own function) and through the shared-memory
path on real spawned ranks: all_reduce, all_gather (and all_gather_object over it), all_gather_into_tensor
and reduce_scatter_tensor with sums, max and min over float and integer dtypes, tensors larger than one
slot (several chunks, both slot sets), async handles, a sub-group of three ranks, and what must stay on
gloo (non-contiguous tensors, PRODUCT). A rank that exits mid-collective ends its peer's wait at once (even
while it is an unreaped zombie), and nothing is left in /dev/shm.
"""

import glob
import os
import time

import pytest
import torch

from verl.launcher.spawn import run_ranks

CASES = [  # (dtype, numel, op)
    (torch.float32, 7, "sum"), (torch.float32, 300_000, "sum"), (torch.float32, 70_000, "max"),
    (torch.bfloat16, 200_001, "sum"), (torch.float16, 513, "min"), (torch.float64, 40_000, "sum"),
    (torch.int64, 100_003, "sum"), (torch.int32, 33, "max"), (torch.uint8, 1000, "max"),
]


def _data(rank: int, dtype: torch.dtype, numel: int, case: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(0, 50, (numel,), generator=gen).to(dtype)


def _compare_with_gloo():
    import torch.distributed as dist

    from verl.ops import shm_collectives

    # run_ranks installs them, as verl train's ranks do
    assert dist.all_reduce is shm_collectives.all_reduce and dist.all_gather is shm_collectives.all_gather
    assert dist.all_gather_into_tensor is shm_collectives.all_gather_into_tensor
    assert dist.reduce_scatter_tensor is shm_collectives.reduce_scatter_tensor
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    mismatches = []
    for case, (dtype, numel, op) in enumerate(CASES):
        fast, slow = _data(rank, dtype, numel, case), _data(rank, dtype, numel, case)
        dist.all_reduce(fast, op=ops[op])
        shm_collectives._TORCH["all_reduce"](slow, op=ops[op])
        # Two ranks: a + b either way, bit-equal to gloo. More: gloo's ring adds in another order (and
        # rounds bf16 after each add; here once), so equal within the dtype's rounding, and the same bits
        # on every rank.
        same = torch.equal(fast, slow) if world == 2 or op != "sum" or not dtype.is_floating_point else \
            torch.allclose(fast.double(), slow.double(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                           atol=5e-2 if dtype == torch.bfloat16 else 1e-5)
        everywhere = [torch.empty_like(fast) for _ in range(world)]
        dist.all_gather(everywhere, fast)
        if not same or not all(torch.equal(t, fast) for t in everywhere):
            mismatches.append(f"{dtype} {numel} {op}: max diff {(fast.double() - slow.double()).abs().max()}")
        # The same data gathered, and reduce-scattered (each rank keeps its 1/world of the reduction).
        gathered = torch.empty(world * numel, dtype=dtype)
        expected = torch.empty(world * numel, dtype=dtype)
        source = _data(rank, dtype, numel, case)
        dist.all_gather_into_tensor(gathered, source)
        shm_collectives._TORCH["all_gather_into_tensor"](expected, source)
        if not torch.equal(gathered, expected):
            mismatches.append(f"all_gather {dtype} {numel}")
        part = numel // world
        if part > 0 and (world == 2 or op != "sum" or not dtype.is_floating_point):
            scattered, expected = torch.empty(part, dtype=dtype), torch.empty(part, dtype=dtype)
            whole = _data(rank, dtype, part * world, case)
            dist.reduce_scatter_tensor(scattered, whole, op=ops[op])
            shm_collectives._TORCH["reduce_scatter_tensor"](expected, whole, op=ops[op])
            if not torch.equal(scattered, expected):
                mismatches.append(f"reduce_scatter {dtype} {part * world} {op}")
    world_comm = shm_collectives._groups.get(dist.group.WORLD)

    # all_gather into a list (equal tensors) and all_gather_object, which runs two of them.
    pieces = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pieces, torch.arange(3) + 10 * rank)
    if [p.tolist() for p in pieces] != [[10 * r, 10 * r + 1, 10 * r + 2] for r in range(world)]:
        mismatches.append(f"all_gather list {[p.tolist() for p in pieces]}")
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * (rank * 1000 + 1)})
    if objects != [{"rank": r, "text": "x" * (r * 1000 + 1)} for r in range(world)]:
        mismatches.append("all_gather_object")

    handle = dist.all_reduce(expected := torch.full((5,), float(rank + 1)), async_op=True)
    handle.wait()
    async_ok = torch.equal(expected, torch.full((5,), float(sum(range(1, world + 1)))))

    # Left to gloo: a strided view and an op the shared-memory path does not do.
    strided = torch.arange(12.0).view(3, 4)[:, 1] + rank
    dist.all_reduce(strided)
    product = torch.tensor([2.0])
    dist.all_reduce(product, op=dist.ReduceOp.PRODUCT)

    sub_ok = None
    sub = dist.new_group([0, 2]) if world >= 3 else None
    if sub is not None and rank in (0, 2):
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=sub)
        sub_ok = torch.equal(x, torch.full((3,), 2.0)) and shm_collectives._groups.get(sub) is not None
    return {"mismatches": mismatches, "fast_path": world_comm is not None, "async_ok": async_ok,
            "strided": strided.tolist(), "product": product.item(), "sub_ok": sub_ok}


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_equals_gloo(world):
    before = set(glob.glob("/dev/shm/verl_shm_*"))
    results = run_ranks(_compare_with_gloo, world, timeout_s=180)
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], (rank, r["mismatches"])
        assert r["fast_path"] and r["async_ok"]
        assert r["strided"] == [sum(range(world)) + world * v for v in (1.0, 5.0, 9.0)]
        assert r["product"] == 2.0 ** world
        assert r["sub_ok"] is (True if world >= 3 and rank in (0, 2) else None)
    assert set(glob.glob("/dev/shm/verl_shm_*")) == before  # names go once every member has the region


def _peer_exits():
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4))  # sets up the region
    if dist.get_rank() == 1:
        os._exit(0)  # gone without a word; its parent has not reaped it yet (a zombie until joined)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as err:
        return {"error": str(err), "waited_s": time.monotonic() - start}
    return {"error": None, "waited_s": time.monotonic() - start}


def _rank_body(rank, init_file, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    from verl.launcher.bootstrap import use_shm_collectives

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        use_shm_collectives(600)
        out.put(_peer_exits())
    except BaseException as err:  # noqa: BLE001 -- reported to the test
        out.put({"error": f"unexpected {err!r}", "waited_s": None})
    out.close()
    out.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)  # no teardown: rank 1 is gone, a destroy_process_group would wait on it


def test_rank_waiting_on_an_exited_peer_raises_at_once():
    """A peer that exits mid-collective ends the wait in milliseconds, not at the 600 s timeout."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank_body, args=(r, os.path.join(tmp, "rdzv"), out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            result = out.get(timeout=120)  # rank 0's; rank 1 never reports
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    assert result["error"] is not None and "rank 1 of the group" in result["error"], result
    assert "exited while rank 0 waited" in result["error"] and result["waited_s"] < 30, result


def _region_too_big():
    import torch.distributed as dist

    from verl.ops import shm_collectives

    shm_collectives.SLOT_BYTES = 1 << 40  # a region no /dev/shm can back: creating it fails on rank 0
    group = dist.new_group([0, 1])
    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(x, group=group)
    return {"sum": x.tolist(), "fast_path": shm_collectives._groups.get(group) is not None}


def test_a_region_that_cannot_be_reserved_falls_back_to_gloo():
    before = set(glob.glob("/dev/shm/verl_shm_*"))
    for result in run_ranks(_region_too_big, 2, timeout_s=120):
        assert result == {"sum": [3.0] * 4, "fast_path": False}
    assert set(glob.glob("/dev/shm/verl_shm_*")) == before

