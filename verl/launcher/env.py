"""Rank discovery: read who this process is from the launcher's environment variables.

Sources, checked in this order (the first launcher that set its variables wins, because an inner
launcher sees the outer one's variables too: torchrun under srun, mpirun inside an sbatch allocation):

1. ``torchrun``  RANK, WORLD_SIZE, LOCAL_RANK[, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT]
                 (also what `verl.launcher.spawn.spawn_local` sets for its ranks)
2. ``openmpi``   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK[, _LOCAL_SIZE]
3. ``slurm``     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE, SLURM_JOB_NODELIST
                 (the SLURM_STEP_* variants win inside an srun step: a step may use part of the job)
4. ``local``     none of the above: one process, rank 0 of 1.

Nothing here touches the network or imports torch; `verl.launcher.bootstrap` turns a `DistEnv` into an
initialised process group.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import zlib
from collections.abc import Mapping

from verl.errors import InputError

PORT_MIN = 20000
PORT_MAX = 60000  # exclusive
LOOPBACK = "127.0.0.1"


class LaunchError(InputError):
    """The launch environment is malformed; the message is one line naming expected vs found."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    ``node_list`` is empty when the launcher does not say (torchrun, Open MPI before the mpi4py
    bootstrap). ``master_addr``/``master_port`` are None only for an Open MPI launch that spans several nodes
    without MASTER_ADDR: the mpi4py bootstrap fills them in (rank 0 broadcasts them).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_list: tuple[str, ...]
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun" | "openmpi" | "slurm" | "local" ("mpi" once bootstrapped over mpi4py)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchError(f"{self.source}: world size must be >= 1, found {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"{self.source}: rank must be in [0, {self.world_size}), found {self.rank}")
        if not 1 <= self.local_world_size <= self.world_size:
            raise LaunchError(f"{self.source}: local world size must be in [1, {self.world_size}],"
                              f" found {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(f"{self.source}: local rank must be in [0, {self.local_world_size}),"
                              f" found {self.local_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(
                f"{self.source}: master port must be in [1, 65535], found {self.master_port}")

    @property
    def is_loopback(self) -> bool:
        """True when every rank runs on this host and talks over 127.0.0.1."""
        return self.master_addr is not None and is_loopback_address(self.master_addr)


def is_loopback_address(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def derive_port(job_id: str, step_id: str = "") -> int:
    """A port in [20000, 60000) that every rank of a job step computes identically.

    The step id takes part so that two concurrent `srun` steps of one job do not collide; crc32
    spreads consecutive job ids across the range.
    """
    if not job_id:
        raise LaunchError("cannot derive a port: expected a non-empty job id, found ''")
    return PORT_MIN + zlib.crc32(f"{job_id}.{step_id}".encode()) % (PORT_MAX - PORT_MIN)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist: ``node[01-03,07],gpu-a[1-2]-ib`` -> node01..node03, node07, ...

    Zero padding follows the width of the lower bound (Slurm's rule); several bracket groups in
    one name expand as a cartesian product (``r[1-2]n[1-2]``).
    """
    hosts: list[str] = []
    for expr in _split_top_level(nodelist.strip(), nodelist):
        hosts.extend(_expand_host(expr, nodelist))
    if not hosts:
        raise LaunchError(f"nodelist: expected at least one host, found {nodelist!r}")
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"nodelist: nested '[' in {whole!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"nodelist: unbalanced ']' in {whole!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"nodelist: unbalanced '[' in {whole!r}")
    parts.append(text[start:])
    if any(not p for p in parts):
        raise LaunchError(f"nodelist: empty host name in {whole!r}")
    return parts


def _expand_host(expr: str, whole: str) -> list[str]:
    open_at = expr.find("[")
    if open_at < 0:
        return [expr]
    close_at = expr.index("]", open_at)
    prefix, body, rest = expr[:open_at], expr[open_at + 1:close_at], expr[close_at + 1:]
    suffixes = _expand_host(rest, whole) if rest else [""]
    names = []
    for item in body.split(","):
        m = _RANGE.match(item)
        if not m:
            raise LaunchError(f"nodelist: expected N or N-M inside [...], found {item!r} in {whole!r}")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LaunchError(f"nodelist: range {item!r} goes down in {whole!r}")
        width = len(lo_text)
        names.extend(f"{prefix}{i:0{width}d}{s}" for i in range(lo, hi + 1) for s in suffixes)
    return names


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (the SLURM_TASKS_PER_NODE format)."""
    counts: list[int] = []
    for item in spec.split(","):
        m = _TASKS.match(item.strip())
        if not m:
            raise LaunchError(
                f"SLURM_TASKS_PER_NODE: expected items like '2' or '2(x3)', found {item!r} in {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# Each launcher's global-rank variable, in the order `discover` trusts the launchers.
RANK_VARIABLES = (("torchrun", "RANK"), ("openmpi", "OMPI_COMM_WORLD_RANK"), ("slurm", "SLURM_PROCID"))


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher names it (torchrun, Open MPI, Slurm: `discover`'s order), 0
    outside any. Never raises: it names logs and traceback files, also when the rest of the environment is
    malformed (`discover` reports that)."""
    env = os.environ if environ is None else environ
    for _, key in RANK_VARIABLES:
        value = env.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Return this process's `DistEnv` from ``environ`` (default: os.environ)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _from_openmpi(env)
    if "SLURM_PROCID" in env:
        return _from_slurm(env)
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_list=("localhost",),
                   master_addr=LOOPBACK, master_port=_int(env, "MASTER_PORT", "local", None),
                   source="local")


_REQUIRED = object()


def _int(env: Mapping[str, str], key: str, source: str, default=_REQUIRED):
    if key not in env:
        if default is _REQUIRED:
            raise LaunchError(f"{source}: expected environment variable {key}, found it unset")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"{source}: expected an integer in {key}, found {env[key]!r}") from None


def _ranks(env: Mapping[str, str], src: str, rank: str, world: str, local_rank: str,
           local_world: str) -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from a launcher's four variables; the local
    world size defaults to the world size (one node)."""
    world_size = _int(env, world, src)
    return _int(env, rank, src), world_size, _int(env, local_rank, src), _int(env, local_world, src, world_size)


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    src = "torchrun"
    rank, world, local_rank, local_world = _ranks(env, src, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT", src, None)
    if world > 1 and (addr is None or port is None):
        raise LaunchError(f"{src}: expected MASTER_ADDR and MASTER_PORT for WORLD_SIZE={world},"
                          f" found MASTER_ADDR={addr!r} MASTER_PORT={env.get('MASTER_PORT')!r}")
    return DistEnv(rank, world, local_rank, local_world, node_list=(),
                   master_addr=addr or LOOPBACK, master_port=port, source=src)


def _from_openmpi(env: Mapping[str, str]) -> DistEnv:
    src = "openmpi"
    rank, world, local_rank, local_world = _ranks(env, src, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    addr = env.get("MASTER_ADDR")
    if addr is None and local_world == world:
        addr = LOOPBACK  # one node: no need to learn an address
    port = _int(env, "MASTER_PORT", src, None)
    if port is None:
        job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
        port = derive_port(job) if job else None
    return DistEnv(rank, world, local_rank, local_world, node_list=(),
                   master_addr=addr, master_port=port, source=src)


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    src = "slurm"
    rank, world = _int(env, "SLURM_PROCID", src), _int(env, "SLURM_NTASKS", src)
    if world > 1 and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        # The batch script itself: it would wait forever for ranks 1..N-1 that nobody started.
        raise LaunchError(f"{src}: SLURM_NTASKS={world} but no SLURM_STEP_ID: this is the batch script, "
                          "not a task; start the ranks with `srun` (e.g. srun --kill-on-bad-exit=1 verl train ...)")
    local_rank = _int(env, "SLURM_LOCALID", src)
    nodelist_key = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    tasks_key = ("SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env
                 else "SLURM_TASKS_PER_NODE")
    for key in (nodelist_key, tasks_key):
        if key not in env:
            raise LaunchError(f"{src}: expected environment variable {key}, found it unset")
    nodes = expand_nodelist(env[nodelist_key])
    tasks = expand_tasks_per_node(env[tasks_key])
    if len(tasks) != len(nodes):
        raise LaunchError(f"{src}: {tasks_key}={env[tasks_key]!r} describes {len(tasks)} nodes but"
                          f" {nodelist_key}={env[nodelist_key]!r} lists {len(nodes)}")
    if sum(tasks) != world:
        raise LaunchError(f"{src}: SLURM_NTASKS={world} but {tasks_key}={env[tasks_key]!r}"
                          f" sums to {sum(tasks)}")
    node_id = _int(env, "SLURM_NODEID", src, None)
    if node_id is None:  # block distribution: ranks fill node 0 first
        node_id = next(i for i, end in enumerate(_cumsum(tasks)) if rank < end) if rank < world else 0
    if not 0 <= node_id < len(nodes):
        raise LaunchError(f"{src}: SLURM_NODEID must be in [0, {len(nodes)}), found {node_id}")
    port = _int(env, "MASTER_PORT", src, None)
    if port is None:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise LaunchError(f"{src}: expected SLURM_JOB_ID (or MASTER_PORT) to pick a port,"
                              " found neither")
        port = derive_port(job_id, env.get("SLURM_STEP_ID", ""))
    # One node: keep every socket on loopback; several: the first node hosts the store.
    addr = env.get("MASTER_ADDR") or (LOOPBACK if len(nodes) == 1 else nodes[0])
    return DistEnv(rank, world, local_rank, tasks[node_id], tuple(nodes), addr, port, src)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What a Slurm job's batch script sees of its allocation, checked before any rank starts."""

    nodes: tuple[str, ...]
    tasks_per_node: int
    master_addr: str  # the rendezvous host: MASTER_ADDR, else the first node


def check_allocation(environ: Mapping[str, str] | None = None) -> Allocation:
    """The batch script's allocation, for a job that runs the same number of ranks on every node (the
    trainer's ``trainer.nnodes * trainer.n_gpus_per_node``): the node list, the task layout and the task
    count must agree. Raises LaunchError (one line) otherwise."""
    env = os.environ if environ is None else environ
    src = "slurm"
    for key in ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE"):
        if key not in env:
            raise LaunchError(f"{src}: expected environment variable {key} (run inside an sbatch/salloc "
                              "allocation), found it unset")
    nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    if len(set(nodes)) != len(nodes):
        raise LaunchError(f"{src}: SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} names a node twice")
    declared = _int(env, "SLURM_JOB_NUM_NODES", src, len(nodes))
    if declared != len(nodes):
        raise LaunchError(f"{src}: SLURM_JOB_NUM_NODES={declared} but SLURM_JOB_NODELIST="
                          f"{env['SLURM_JOB_NODELIST']!r} lists {len(nodes)} nodes")
    tasks = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    if len(tasks) != len(nodes):
        raise LaunchError(f"{src}: SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r} describes {len(tasks)} nodes"
                          f" but SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} lists {len(nodes)}")
    ntasks = _int(env, "SLURM_NTASKS", src, sum(tasks))  # unset when the job asked for no task count
    if sum(tasks) != ntasks:
        raise LaunchError(f"{src}: SLURM_NTASKS={ntasks} but SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r}"
                          f" sums to {sum(tasks)}")
    if len(set(tasks)) != 1:
        raise LaunchError(f"{src}: expected the same number of tasks on each of the {len(nodes)} nodes "
                          f"(trainer.nnodes x trainer.n_gpus_per_node), found {ntasks} tasks laid out as "
                          f"{env['SLURM_TASKS_PER_NODE']} on {env['SLURM_JOB_NODELIST']}; "
                          f"ask for --ntasks-per-node instead of --ntasks")
    return Allocation(tuple(nodes), tasks[0], env.get("MASTER_ADDR") or nodes[0])


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
