"""Rank discovery from fixture environments: one per launcher, plus malformed ones."""

import pytest

from verl.launcher.env import (
    PORT_MAX,
    PORT_MIN,
    DistEnv,
    LaunchError,
    derive_port,
    discover,
    expand_nodelist,
    expand_tasks_per_node,
)

SLURM_2x2 = {
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_ID": "0",  # srun tasks have one; the batch script does not
}


# ------------------------------------------------------------------ nodelist / tasks per node
@pytest.mark.parametrize("nodelist, expected", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("gpu-a[1-2]-ib,login", ["gpu-a1-ib", "gpu-a2-ib", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x1,y[3],z", ["x1", "y3", "z"]),
])
def test_expand_nodelist_matches_slurm_hostlist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["node[01-03", "node]01[", "node[a-b]", "node[3-1]", "a,,b", "",
                                 "n[[1]]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(LaunchError, match="nodelist"):
        expand_nodelist(bad)


def test_expand_tasks_per_node_repeats():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(LaunchError, match=r"expected items like '2' or '2\(x3\)', found '2x3'"):
        expand_tasks_per_node("2x3")


# ------------------------------------------------------------------ ports
def test_port_is_deterministic_in_range_and_spread():
    ports = {derive_port(str(job)) for job in range(1000, 1200)}
    assert all(PORT_MIN <= p < PORT_MAX for p in ports)
    assert len(ports) > 190  # consecutive job ids do not pile up on a few ports
    assert derive_port("77", "0") == derive_port("77", "0") != derive_port("77", "1")


def test_slurm_port_comes_from_job_id_unless_master_port_set():
    env = discover(SLURM_2x2)
    assert env.master_port == derive_port("4242", "0")
    assert discover({**SLURM_2x2, "SLURM_STEP_ID": "3"}).master_port == derive_port("4242", "3")
    assert discover({**SLURM_2x2, "MASTER_PORT": "29555"}).master_port == 29555


# ------------------------------------------------------------------ sources
def test_slurm_multinode():
    env = discover(SLURM_2x2)
    assert env == DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2,
                          node_list=("gpu07", "gpu08"), master_addr="gpu07",
                          master_port=derive_port("4242", "0"), source="slurm")
    assert not env.is_loopback


def test_slurm_single_node_uses_loopback():
    env = discover({"SLURM_JOB_ID": "9", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                    "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"})
    assert (env.rank, env.world_size, env.local_world_size) == (1, 2, 2)
    assert env.master_addr == "127.0.0.1" and env.is_loopback


def test_slurm_batch_script_with_several_tasks_is_not_a_rank():
    batch = {k: v for k, v in SLURM_2x2.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(LaunchError, match="this is the batch script, not a task; start the ranks with `srun`"):
        discover(batch)


def test_slurm_step_variables_win_over_job_variables():
    env = discover({**SLURM_2x2, "SLURM_STEP_NODELIST": "gpu08", "SLURM_STEP_TASKS_PER_NODE": "4",
                    "SLURM_NODEID": "0"})
    assert env.node_list == ("gpu08",) and env.local_world_size == 4


def test_slurm_uneven_tasks_without_nodeid_uses_block_distribution():
    env = discover({**{k: v for k, v in SLURM_2x2.items() if k != "SLURM_NODEID"},
                    "SLURM_NTASKS": "5", "SLURM_PROCID": "4", "SLURM_LOCALID": "1",
                    "SLURM_TASKS_PER_NODE": "3,2"})
    assert env.local_world_size == 2


def test_openmpi():
    env = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                    "PMIX_NAMESPACE": "prterun-vm-1@1"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "openmpi")
    assert env.master_addr == "127.0.0.1" and env.master_port == derive_port("prterun-vm-1@1")


def test_openmpi_multinode_leaves_address_to_mpi_bootstrap():
    env = discover({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    assert env.master_addr is None and env.master_port is None


def test_openmpi_wins_over_enclosing_slurm_allocation():
    env = discover({**SLURM_2x2, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert env.source == "openmpi" and env.world_size == 1


def test_torchrun_wins_over_slurm():
    env = discover({**SLURM_2x2, "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"})
    assert env == DistEnv(6, 8, 2, 4, (), "gpu07", 29500, "torchrun")


def test_local_when_no_launcher():
    env = discover({"HOME": "/root"})
    assert (env.rank, env.world_size, env.source, env.master_addr) == (0, 1, "local", "127.0.0.1")


# ------------------------------------------------------------------ malformed
@pytest.mark.parametrize("environ, message", [
    ({"RANK": "0", "LOCAL_RANK": "0"}, "torchrun: expected environment variable WORLD_SIZE, found it unset"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     r"torchrun: rank must be in \[0, 2\), found 2"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     "torchrun: expected MASTER_ADDR and MASTER_PORT for WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun: expected an integer in RANK, found 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "70000"},
     r"master port must be in \[1, 65535\], found 70000"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
     "openmpi: expected environment variable OMPI_COMM_WORLD_LOCAL_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, r"openmpi: local rank must be in \[0, 2\), found 2"),
    ({**SLURM_2x2, "SLURM_NTASKS": "3"}, r"slurm: SLURM_NTASKS=3 but SLURM_TASKS_PER_NODE='2\(x2\)' sums to 4"),
    ({**SLURM_2x2, "SLURM_JOB_NODELIST": "gpu07"}, "describes 2 nodes but SLURM_JOB_NODELIST='gpu07' lists 1"),
    ({k: v for k, v in SLURM_2x2.items() if k != "SLURM_JOB_NODELIST"},
     "slurm: expected environment variable SLURM_JOB_NODELIST"),
    ({k: v for k, v in SLURM_2x2.items() if k != "SLURM_JOB_ID"}, "expected SLURM_JOB_ID"),
    ({**SLURM_2x2, "SLURM_PROCID": "4"}, r"slurm: rank must be in \[0, 4\), found 4"),
    ({**SLURM_2x2, "SLURM_NODEID": "2"}, r"SLURM_NODEID must be in \[0, 2\), found 2"),
])
def test_malformed_environment_raises_one_clear_line(environ, message):
    with pytest.raises(LaunchError, match=message) as info:
        discover(environ)
    assert "\n" not in str(info.value)


def test_intra_op_threads_split_the_host_between_local_ranks(monkeypatch):
    """No oversubscription: ranks x threads <= the cores this process may use (OMP_NUM_THREADS wins)."""
    import os

    from verl.launcher.spawn import rank_env
    from verl.launcher.threads import intra_op_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert intra_op_threads(2, environ={}) == 8
    assert intra_op_threads(64, environ={}) == 1
    assert intra_op_threads(2, environ={"OMP_NUM_THREADS": "3"}) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # bound by the launcher
    assert intra_op_threads(2, environ={}) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert rank_env(0, 4, 1234, {})["OMP_NUM_THREADS"] == "4"
    assert rank_env(0, 4, 1234, {"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"
