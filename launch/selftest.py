"""A tiny real distributed job: ``python -m launch.selftest`` under any launcher.

It bootstraps through `verl.launcher.bootstrap`, all-reduces ``rank + 1`` and checks the sum, then prints
one JSON line per rank: ``{"event": "hello", "rank", "world_size", "source", "backend", ...}``.

Options exercise what a trainer needs from its launcher:
- ``--die-rank R --die-after S``: rank R exits with status 1 after S seconds while the others wait
  in a collective; the job must end non-zero instead of hanging.
- ``--steps N --step-seconds X --checkpoint-dir D``: N steps of one all-reduce each, resumable.
  On SIGUSR1/SIGTERM every rank finishes the current step, rank 0 writes D/selftest_state.json
  atomically, and the job exits 0; the next run resumes after the saved step.
- ``--save-every K --save-seconds S``: a periodic checkpoint every K steps that takes S seconds (a
  stand-in for a large model's save); ``--metrics FILE``: rank 0 appends the trainer's
  ``timing_s/step`` and ``timing_s/save_checkpoint`` per step, as the batch scripts' deadline timer reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from verl.launcher.bootstrap import destroy_distributed, init_distributed
from verl.launcher.env import LaunchError
from verl.launcher.preemption import PreemptionHandler, hold_early_preemption

STATE_FILE = "selftest_state.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.selftest", description=__doc__.split("\n")[0])
    p.add_argument("--timeout-s", type=float, default=60.0, help="collective timeout (default 60)")
    p.add_argument("--die-rank", type=int, default=None, help="this rank exits 1 mid-job")
    p.add_argument("--die-after", type=float, default=1.0, help="seconds before --die-rank dies")
    p.add_argument("--steps", type=int, default=0, help="number of resumable steps (default 0)")
    p.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step (default 0.1)")
    p.add_argument("--checkpoint-dir", default=None, help="where the step counter is saved")
    p.add_argument("--save-every", type=int, default=0, help="periodic checkpoint every K steps (0: none)")
    p.add_argument("--save-seconds", type=float, default=0.0, help="time a checkpoint save takes (default 0)")
    p.add_argument("--metrics", default=None, help="rank 0 appends timing_s/step and timing_s/save_checkpoint here")
    p.add_argument("--megatron", metavar="TP,PP", default=None,
                   help="also build Megatron's parallel groups and report the hosts each of this rank's groups spans")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps: expected >= 0, found {args.steps}")
    if args.save_every < 0 or args.save_seconds < 0:
        p.error(f"--save-every/--save-seconds: expected >= 0, found {args.save_every}/{args.save_seconds}")
    if args.steps and args.checkpoint_dir is None:
        p.error("--steps: expected --checkpoint-dir as well (preemption writes a checkpoint there)")
    return args


def emit(**fields) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def load_state(checkpoint_dir: str) -> dict | None:
    path = os.path.join(checkpoint_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def save_state_atomically(checkpoint_dir: str, state: dict) -> str:
    """tmp file + fsync + rename: a reader sees the old checkpoint or the new one, never half."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STATE_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def save_checkpoint(args, state: dict) -> tuple[str, float]:
    """(path, seconds): the state written atomically after --save-seconds of simulated work."""
    t0 = time.monotonic()
    time.sleep(args.save_seconds)
    return save_state_atomically(args.checkpoint_dir, state), time.monotonic() - t0


def append_metrics(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def check_all_reduce(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    if value.item() != expected:
        raise RuntimeError(f"all_reduce: expected sum {expected}, found {value.item()}")
    return value.item()


def shm_use(rank: int, world: int) -> dict:
    """Which groups run their collectives through shared memory: the world group and this rank's node group
    (the ranks that share its host name). Only a group inside one host may; one spanning hosts stays on gloo."""
    import torch
    import torch.distributed as dist

    from verl.ops import shm_collectives

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    node_group = None
    for host in dict.fromkeys(hosts):  # every rank creates every group, in the same order
        group = dist.new_group([r for r in range(world) if hosts[r] == host])
        if host == hosts[rank]:
            node_group = group
    value = torch.ones(4)
    dist.all_reduce(value, group=node_group)
    if value[0].item() != hosts.count(hosts[rank]):
        raise RuntimeError(f"node all_reduce: expected {hosts.count(hosts[rank])}, found {value[0].item()}")
    return {"hosts": len(set(hosts)), "shm_world": shm_collectives.uses_shared_memory(),
            "shm_node": shm_collectives.uses_shared_memory(node_group)}


def megatron_layout(spec: str) -> dict:
    """Megatron's groups for TP,PP over this job: the hosts this rank's TP, PP and DP groups span (its order puts
    consecutive ranks, one node's, in a TP group; PP and DP groups stride across nodes)."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron

    tp, pp = (int(x) for x in spec.split(","))
    initialize_megatron(tp, pp)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    spans = {name: sorted({hosts[r] for r in dist.get_process_group_ranks(group)}) for name, group in (
        ("tp", mpu.get_tensor_model_parallel_group()), ("pp", mpu.get_pipeline_model_parallel_group()),
        ("dp", mpu.get_data_parallel_group()))}
    destroy_megatron()
    return {f"{name}_hosts": value for name, value in spans.items()}


def run_steps(args, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    state = load_state(args.checkpoint_dir)
    start = state["step"] + 1 if state else 0
    if state and rank == 0:
        emit(event="resumed", rank=rank, step=state["step"])
    with PreemptionHandler() as preempt:
        for step in range(start, args.steps):
            t0 = time.monotonic()
            time.sleep(args.step_seconds)
            work = torch.tensor([float(step)])
            dist.all_reduce(work)
            if work.item() != step * world:
                raise RuntimeError(f"step {step}: expected {step * world}, found {work.item()}")
            record = {"step": step, "timing_s/step": time.monotonic() - t0}
            if rank == 0:
                emit(event="step", rank=rank, step=step)
            if preempt.should_stop():
                if rank == 0:
                    path, _ = save_checkpoint(args, {"step": step, "world_size": world})
                    emit(event="preempted", rank=rank, step=step, checkpoint=path,
                         signal=preempt.received_signal)
                    append_metrics(args.metrics, record)
                dist.barrier()  # the job ends only once the checkpoint exists
                return
            if args.save_every and (step + 1) % args.save_every == 0:
                if rank == 0:
                    _, record["timing_s/save_checkpoint"] = save_checkpoint(args, {"step": step, "world_size": world})
                dist.barrier()
            if rank == 0:
                append_metrics(args.metrics, record)
    if rank == 0:
        save_state_atomically(args.checkpoint_dir, {"step": args.steps - 1, "world_size": world})
        emit(event="done", rank=rank, steps=args.steps, resumed_from=start)


def main(argv=None) -> int:
    hold_early_preemption()  # as `verl train`: a preemption signal during start-up is honoured, not fatal
    args = parse_args(argv)
    try:
        env = init_distributed(timeout_s=args.timeout_s)
    except LaunchError as e:
        print(f"launch.selftest: {e}", file=sys.stderr, flush=True)
        return 2
    import torch.distributed as dist

    if args.die_rank is not None and not 0 <= args.die_rank < env.world_size:
        print(f"launch.selftest: --die-rank: expected a rank in [0, {env.world_size}),"
              f" found {args.die_rank}", file=sys.stderr, flush=True)
        destroy_distributed()
        return 2
    try:
        total = check_all_reduce(env.rank, env.world_size)
        emit(event="hello", rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
             local_world_size=env.local_world_size, source=env.source, backend=dist.get_backend(),
             master_addr=env.master_addr, sum=total, host=socket.gethostname(),
             **(shm_use(env.rank, env.world_size) if dist.get_backend() == "gloo" else {}),
             **(megatron_layout(args.megatron) if args.megatron else {}))
        if args.die_rank is not None:
            if env.rank == args.die_rank:
                time.sleep(args.die_after)
                emit(event="dying", rank=env.rank)
                os._exit(1)
            dist.barrier()  # waits for the dying rank: must raise, not hang
            raise RuntimeError(f"rank {args.die_rank} was to die, but the barrier completed")
        if args.steps:
            run_steps(args, env.rank, env.world_size)
    except Exception as e:  # a peer died or timed out: one line, non-zero exit, no teardown hang
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"launch.selftest: rank {env.rank}: {type(e).__name__}: {first_line}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
