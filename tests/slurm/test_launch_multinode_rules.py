"""Multi-node launch rules that need no cluster: the batch script's allocation check, the rendezvous host's
resolution, the interface gloo is pinned to, and the job's collective timeout in every process group.
(The cluster tier, test_slurm_multinode.py, runs them across real hosts.)"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_allocation_check_refuses_a_node_list_that_does_not_match_the_tasks():
    from verl.launcher.env import LaunchError, check_allocation

    base = {"SLURM_JOB_NODELIST": "verl-node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)",
            "SLURM_NTASKS": "2"}
    assert check_allocation(base).nodes == ("verl-node1", "verl-node2")
    assert check_allocation({**base, "MASTER_ADDR": "h"}).master_addr == "h"
    for bad, words in [({"SLURM_TASKS_PER_NODE": "1(x3)", "SLURM_NTASKS": "3"}, "describes 3 nodes"),
                       ({"SLURM_NTASKS": "4"}, "sums to 2"),
                       ({"SLURM_JOB_NUM_NODES": "3"}, "lists 2 nodes"),
                       ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NTASKS": "3"}, "the same number of tasks")]:
        with pytest.raises(LaunchError, match=words):
            check_allocation({**base, **bad})
    assert check_allocation({k: v for k, v in base.items() if k != "SLURM_NTASKS"}).tasks_per_node == 1


def test_rendezvous_host_that_does_not_resolve_is_a_launch_error():
    from verl.launcher.bootstrap import resolve_ipv4
    from verl.launcher.env import LaunchError

    assert resolve_ipv4("localhost", "x") == "127.0.0.1"
    with pytest.raises(LaunchError, match="the rendezvous host: expected a host name that resolves"):
        resolve_ipv4("no-such-host.invalid", "the rendezvous host")


def test_gloo_interface_is_the_one_holding_the_node_address_or_the_named_one():
    from verl.launcher.bootstrap import interface_addresses, node_interface
    from verl.launcher.env import DistEnv, LaunchError

    env = DistEnv(0, 2, 0, 1, ("a", "b"), "a", 29500, "slurm")
    assert interface_addresses()["lo"] == "127.0.0.1"
    assert node_interface(env, {"SLURMD_NODENAME": "localhost"}) == "lo"
    assert node_interface(env, {"GLOO_SOCKET_IFNAME": "lo"}) == "lo"
    with pytest.raises(LaunchError, match="GLOO_SOCKET_IFNAME: expected interfaces"):
        node_interface(env, {"GLOO_SOCKET_IFNAME": "no-such-if0"})
    with pytest.raises(LaunchError, match="this node's name: expected a host name that resolves"):
        node_interface(env, {"SLURMD_NODENAME": "no-such-host.invalid"})


def test_every_process_group_times_out_like_the_job():
    # Megatron asks for 30 minutes and torch's default is 30 minutes too: both become the job's timeout.
    code = """
import datetime, torch, torch.distributed as dist
from verl.launcher.bootstrap import destroy_distributed, init_distributed
init_distributed(timeout_s=7, environ={})
groups = [None, dist.new_group([0]), dist.new_group([0], timeout=datetime.timedelta(minutes=30)),
          dist.new_group([0], timeout=datetime.timedelta(seconds=3))]
print([(g or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups])
destroy_distributed()
import torch.distributed.distributed_c10d as c10d
print(dist.new_group is c10d.new_group and dist.new_group.__module__)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    timeouts, restored = proc.stdout.splitlines()[-2:]
    assert timeouts == "[7.0, 7.0, 7.0, 3.0]", proc.stdout
    assert restored == "torch.distributed.distributed_c10d", proc.stdout  # torch's own again after teardown
