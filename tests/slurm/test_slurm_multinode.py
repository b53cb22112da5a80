"""Slurm tier, several hosts: a 2-node cluster on this machine (VERL_SLURM_NODES=2 slurm/local/start.sh), each
node its own network namespace, host name and /dev/shm; client commands run on its login host (login.sh).

One cluster serves the whole module. The real `verl train` (tiny GRPO, a few steps) runs across the two nodes
to completion, through a preemption and its requeue; a checkpoint it wrote resumes on one node at world size
1; the fault cases run it too (a node's processes killed, a link cut mid-collective, a node failure with
--requeue), each with the issue's bound. The launch-only cases (separate hosts, shared memory per node, the
GPU template's dry run) run the cheap `launch.selftest`, as the one-node tier does.

Bounds measured here (2 cores, idle machine): every process of the job on one node killed (its slurmstepd
included) -> the job ends ~26 s later (bound 60 s; the script's 20 s grace for srun); a link cut with a 30 s
collective timeout -> ~40 s (bound 60 s; with 20 s: 25-32 s); the GPU template with node 2's processes frozen
(SIGSTOP) under a 15 s collective timeout and 20 s grace -> ~23 s (bound 60 s); a preemption or a node failure -> the
requeued job resumes ~55-77 s later (Slurm holds it for the local cluster's cred_expire=30 s, then the trainer starts).
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM_DIR = os.path.join(REPO, "slurm")
LOGIN = os.path.join(SLURM_DIR, "local", "login.sh")
MULTINODE = os.path.join(SLURM_DIR, "multinode_cpu.sbatch")
STATE_DIR = "/var/lib/verl-local-slurm"  # slurm/local/cluster.sh's default for N > 1
NODES = {"verl-node1": "10.79.0.11", "verl-node2": "10.79.0.12"}
CANNOT_INSTALL = 3
TRAINER_START_S = 240  # the trainer's start-up on a loaded 2-core machine is ~15-90 s
REQUEUE_S = 240  # cred_expire (30 s) + node return + trainer start-up on a loaded machine
COLLECTIVE_TIMEOUT_S = 30  # actor_rollout_ref.nccl_timeout in the link-cut case (srun and Slurm add ~8-12 s)
NODE_LOSS_BOUND_S = 60
# The tiny GRPO run, shortened as in the one-node tier: small batch, no validation, console log only.
QUICK = ("data.train_batch_size=2 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=2"
         " actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"
         " actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"
         " actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"
         " trainer.val_before_train=false trainer.test_freq=-1 'trainer.logger=[console]'")
ENDED = ("COMPLETING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
WILDCARD_HEX = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and :: in /proc/net/tcp*


def hex_addr(ip):
    """How /proc/net/tcp writes an IPv4 address (little-endian hex)."""
    return socket.inet_aton(ip)[::-1].hex().upper()


def job_env(**extra):
    """This environment for a job, minus launcher variables and the tests' GLOO_SOCKET_IFNAME=lo (across
    hosts the ranks use their node's interface)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    env.update(PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=REPO,
               **extra)
    return env


def login(*args, timeout=60, env=None, check=False):
    """``args`` on the cluster's login host, from the repository root."""
    return subprocess.run([LOGIN, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env or job_env(), check=check)


def job_fields(job_id):
    out = login("scontrol", "show", "job", job_id).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def node_states():
    out = login("sinfo", "-h", "-N", "-o", "%N %T").stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def wait_for(predicate, timeout, what, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    tail = open(log).read()[-3000:] if log is not None and os.path.exists(log) else ""
    queue = login("squeue", "-h", "-o", "%i %j %T %r %N").stdout
    ctld = os.path.join(STATE_DIR, "log", "slurmctld.log")
    ctld_tail = "".join(open(ctld).readlines()[-15:]) if os.path.exists(ctld) else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\nnodes: {node_states()}\nqueue:\n{queue}\n"
                         f"slurmctld.log:\n{ctld_tail}\njob output:\n{tail}")


def raw_metric_steps(run_dir):
    """Every step line of metrics.jsonl in file order (a repeated step shows twice; a line being written is
    skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path).read().split("\n")[:-1] if line]


def job_pids(job_id, node=None):
    """pid -> argv of the processes of ``job_id`` (on ``node`` only: in its network namespace)."""
    net = os.stat(f"/run/netns/{node}").st_ino if node else None
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if net is not None and os.stat(f"/proc/{entry}/ns/net").st_ino != net:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env:
            found[int(entry)] = argv
    return found


def listening(pid):
    """Local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets ``pid`` listens on, read from
    its own network namespace."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
        tables = [open(f"/proc/{pid}/net/{t}").read() for t in ("tcp", "tcp6")]
    except OSError:
        return []
    found = []
    for table in tables:
        for row in table.splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                found.append(cols[1].split(":")[0])
    return found


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("slurm tier: needs root for network namespaces and the Slurm daemons")
    env = {**os.environ, "VERL_SLURM_NODES": "2"}
    start = subprocess.run(["bash", os.path.join(SLURM_DIR, "local", "start.sh")], capture_output=True, text=True,
                           timeout=600, env=env)
    if start.returncode == CANNOT_INSTALL:
        pytest.skip(f"slurm tier: Slurm packages cannot be installed here: {start.stderr.strip()}")
    assert start.returncode == 0, start.stderr
    # Job files live where every node sees them (each node has a private /tmp).
    shared = os.path.join(STATE_DIR, "shared", f"test-{uuid.uuid4().hex[:8]}")
    os.makedirs(shared)
    yield shared
    stop = subprocess.run(["bash", os.path.join(SLURM_DIR, "local", "stop.sh")], capture_output=True, text=True,
                          timeout=180, env=env)
    subprocess.run(["rm", "-rf", shared])
    assert stop.returncode == 0, stop.stderr
    assert not [ns for ns in ("verl-ctl", "verl-login", *NODES) if os.path.exists(f"/run/netns/{ns}")]
    assert subprocess.run(["ip", "link", "show", "verl-slurm0"], capture_output=True).returncode != 0
    assert "# verl-local-slurm" not in open("/etc/hosts").read()
    again = subprocess.run(["bash", os.path.join(SLURM_DIR, "local", "stop.sh")], capture_output=True, text=True,
                           timeout=60, env=env)
    assert again.returncode == 0, again.stderr


class Jobs:
    """Submits jobs under unique names from the login host; `cancel()` ends them all."""

    def __init__(self, root):
        self.root = root
        self.names = []

    def sbatch(self, *options, script=MULTINODE, wait=False, timeout=60, **env):
        name = f"verl-test-{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        args = ["sbatch", "--parsable", f"--job-name={name}", *(["--wait"] if wait else []), *options, script]
        return login(*args, timeout=timeout, env=job_env(**env))

    def cancel(self):
        for name in self.names:
            login("scancel", f"--name={name}", timeout=30)


@pytest.fixture
def jobs(cluster):
    wait_nodes_idle()  # an earlier test's broken node back in service first (resumed if Slurm drained it)
    submitted = Jobs(cluster)
    yield submitted
    submitted.cancel()
    wait_for(lambda: not login("squeue", "-h").stdout.strip(), 120, "the queue to empty")


def wait_nodes_idle(timeout=120):
    def idle():
        states = node_states()
        for node, state in states.items():
            if state.startswith(("down", "drain")):
                login("scontrol", "update", f"nodename={node}", "state=resume")
        return sorted(states) == sorted(NODES) and set(states.values()) == {"idle"}
    wait_for(idle, timeout, "both nodes idle")


def clear_node(job_id, node, timeout=60):
    """After a test broke ``node`` on purpose: wait (bounded) for the job's processes and slurmstepd there to end,
    SIGKILL what is left (as an operator cleaning the node would), then both nodes idle. Without it a step that
    outlives the test can make slurmd give up on it later ("Kill task failed") and drain the node under the next
    test."""
    deadline = time.monotonic() + timeout
    while (job_pids(job_id, node) or stepd_pids(job_id, node)) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in [*job_pids(job_id, node), *stepd_pids(job_id, node)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_nodes_idle()


def grpo_env(run_dir, data_dir, steps, *extra):
    return {"VERL_OUTPUT_DIR": str(run_dir), "VERL_DATA_DIR": str(data_dir),
            "VERL_OVERRIDES": f"trainer.total_training_steps={steps} {QUICK} {' '.join(extra)}"}


def submit_and_wait_for_step(jobs, out, run_dir, step, *options, **env):
    proc = jobs.sbatch(f"--output={out}", *options, **env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]

    def reached():
        if len(raw_metric_steps(run_dir)) >= step:
            return True
        state = job_fields(job_id).get("JobState")
        assert state not in ENDED, f"job {job_id} {state} before step {step}:\n{open(out).read()[-3000:]}"
        return False
    wait_for(reached, TRAINER_START_S, f"step {step}", out)
    return job_id


def stepd_pids(job_id, node):
    """The slurmstepd processes of ``job_id`` on ``node`` (their process title names the job)."""
    net = os.stat(f"/run/netns/{node}").st_ino
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}/ns/net").st_ino == net:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(f"slurmstepd: [{job_id}.".encode()):
                        found.append(int(entry))
        except OSError:
            continue
    return found


def kill_job_on_node(job_id, node, with_stepd=False):
    pids = [*job_pids(job_id, node), *(stepd_pids(job_id, node) if with_stepd else [])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def running(job_id):
    """Whether the job still runs; an scontrol that did not answer says nothing (asked again next poll)."""
    proc = login("scontrol", "show", "job", job_id)
    if proc.returncode != 0:
        return "Invalid job id" not in proc.stderr  # the record is gone (MinJobAge) only after the job ended
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    return fields.get("JobState") in ("RUNNING", "CONFIGURING")


# --------------------------------------------------------------------------------------------- the hosts
def test_nodes_are_separate_hosts_and_daemons_bind_their_own_address(cluster):
    probe = ("echo $(hostname) $(ip -4 -o addr show eth0 | awk '{print $4}') $(stat -c %d /dev/shm) "
             "$(stat -c %d /tmp); touch /dev/shm/verl-probe-$SLURM_PROCID; ls /dev/shm | tr '\\n' ' '; echo")
    proc = login("srun", "-N", "2", "--ntasks-per-node=1", "--mpi=none", "--label", "bash", "-c", probe)
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():
        task, rest = line.split(": ", 1)
        seen.setdefault(int(task), []).append(rest.split())
    (host0, addr0, shm0, tmp0), probes0 = seen[0]
    (host1, addr1, shm1, tmp1), probes1 = seen[1]
    assert {host0: addr0, host1: addr1} == {n: f"{a}/24" for n, a in NODES.items()}, proc.stdout
    assert shm0 != shm1 and tmp0 != tmp1  # each node has its own /dev/shm and /tmp (a checkout under /tmp bound in)
    # Each task's file is in its own node's /dev/shm only.
    assert "verl-probe-0" in probes0 and "verl-probe-1" not in probes0, proc.stdout
    assert "verl-probe-1" in probes1 and "verl-probe-0" not in probes1, proc.stdout
    assert login("hostname").stdout.strip() == "verl-login"
    # slurmctld and each slurmd listen on their own host's address only.
    for pidfile, addr in [("slurmctld.pid", "10.79.0.2")] + [(f"slurmd.{n}.pid", a) for n, a in NODES.items()]:
        pid = int(open(os.path.join(STATE_DIR, pidfile)).read())
        addrs = listening(pid)
        assert addrs and set(addrs) == {hex_addr(addr)}, (pidfile, addrs)


def test_shared_memory_only_inside_a_node_and_megatron_tp_inside_pp_across(cluster):
    # 2 ranks per node (-O: more tasks than the node's one CPU): each node's group may use shared memory, the
    # world group spans both hosts and must stay on gloo. Megatron TP=2 x PP=2 over the 4 ranks: its order puts
    # each TP group on one node and each PP group across both.
    proc = login("srun", "-N", "2", "-n", "4", "-O", "--mpi=none", "--kill-on-bad-exit=1",
                 "python", "-m", "launch.selftest", "--megatron", "2,2", timeout=180)
    assert proc.returncode == 0, proc.stderr
    hello = [e for e in map(json.loads, proc.stdout.splitlines()) if e["event"] == "hello"]
    assert sorted((e["rank"], e["host"]) for e in hello) == [
        (0, "verl-node1"), (1, "verl-node1"), (2, "verl-node2"), (3, "verl-node2")], proc.stdout
    assert all(e["hosts"] == 2 and e["shm_node"] and not e["shm_world"] for e in hello), proc.stdout
    assert all(e["master_addr"] == "verl-node1" and e["source"] == "slurm" for e in hello)
    assert all(e["tp_hosts"] == [e["host"]] and e["pp_hosts"] == sorted(NODES) for e in hello), proc.stdout


# ------------------------------------------------------------------- verl train across the two nodes
@pytest.fixture(scope="module")
def preempted_grpo(cluster):
    """The tiny GRPO run on 2 nodes x 1 rank (Megatron TP=2 across the hosts, so the actor's collectives and
    the reshard cross them), 12 steps, preempted after step 1 the way --signal=B:USR1 does (the batch shell
    gets USR1): the ranks checkpoint, the script requeues the job, and the requeued run resumes and finishes."""
    root = os.path.join(cluster, "grpo")
    jobs = Jobs(root)
    run = {"run_dir": os.path.join(root, "run"), "data_dir": os.path.join(cluster, "data"),
           "out": os.path.join(root, "grpo.out"), "steps": 12}
    os.makedirs(root)
    try:
        # Each generation takes rank 0 0.5 s longer (fault injection): a step of this tiny run is well under a
        # second, so without it the 11 steps after step 1 could all end before USR1 reaches the ranks (seen once
        # under CI's load: "stopped after step 12").
        run["job_id"] = submit_and_wait_for_step(jobs, run["out"], run["run_dir"], 1,
                                                 **grpo_env(run["run_dir"], run["data_dir"], run["steps"],
                                                            "trainer.save_freq=-1"),
                                                 VERL_TEST_SLOW_GENERATION="0:0.5")
        ranks = [pid for pid, argv in job_pids(run["job_id"]).items() if "--config" in argv]
        run["rank_hosts"] = {int(job_environ(pid)["SLURM_PROCID"]): job_node(pid) for pid in ranks}
        run["listening"] = {job_node(pid): listening(pid) for pid in ranks}
        assert login("scancel", "--batch", "--signal=USR1", run["job_id"]).returncode == 0
        t0 = time.monotonic()
        wait_for(lambda: job_fields(run["job_id"]).get("Restarts") == "1", 120, "the job to requeue itself",
                 run["out"])
        wait_for(lambda: "restart 1" in open(run["out"]).read()
                 and "resumed from" in open(run["out"]).read().split("restart 1")[1],
                 REQUEUE_S, "the requeued run to resume", run["out"])
        print(f"measured: the preempted job resumed {time.monotonic() - t0:.1f}s after USR1")
        wait_for(lambda: "[multinode] step finished with exit code" in open(run["out"]).read().split("restart 1")[1],
                 REQUEUE_S, "the requeued run to finish", run["out"])
        run["final_state"] = job_fields(run["job_id"]).get("JobState")
        yield run
    finally:
        jobs.cancel()


def job_environ(pid):
    with open(f"/proc/{pid}/environ") as f:
        return dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)


def job_node(pid):
    return job_environ(pid)["SLURMD_NODENAME"]


def test_grpo_runs_across_two_nodes_to_completion(preempted_grpo):
    run = preempted_grpo
    text = open(run["out"]).read()
    assert run["rank_hosts"] == {0: "verl-node1", 1: "verl-node2"}, run["rank_hosts"]
    assert "launch.slurm_check: 2 nodes x 1 tasks; rendezvous verl-node1 (10.79.0.11)" in text, text[-3000:]
    assert text.split("restart 1")[1].count("[multinode] step finished with exit code 0") == 1, text[-3000:]
    assert run["final_state"] in (None, "COMPLETED", "COMPLETING"), run["final_state"]
    assert f"step {run['steps']}/{run['steps']}" in text, text[-3000:]


def test_grpo_ranks_listen_on_their_node_address_only(preempted_grpo):
    # Rank 0 holds the rendezvous store and both ranks gloo's pair listeners: the node's own address, never
    # every interface (0.0.0.0 / ::).
    listening_by_node = preempted_grpo["listening"]
    assert sorted(listening_by_node) == sorted(NODES)
    for node, addrs in listening_by_node.items():
        assert addrs, f"{node}: the rank listens on nothing"
        assert not set(addrs) & WILDCARD_HEX, (node, addrs)
        assert set(addrs) == {hex_addr(NODES[node])}, (node, addrs)


def test_preemption_checkpoints_requeues_and_resumes_without_losing_a_step(preempted_grpo):
    run = preempted_grpo
    text = open(run["out"]).read()
    first, resumed = text.split("restart 1", 1)
    assert "[multinode] preemption signal" in first and "requeueing job" in first, first[-3000:]
    stopped = int(first.split("preempted: stopped after step ", 1)[1].split()[0])
    assert 1 <= stopped < run["steps"]
    assert f"/global_step_{stopped} at step {stopped}" in resumed, resumed[-3000:]
    assert raw_metric_steps(run["run_dir"]) == list(range(1, run["steps"] + 1)), text[-3000:]


def test_two_node_checkpoint_resumes_on_one_node_at_world_size_4(preempted_grpo, jobs):
    # Written by 2 ranks on 2 nodes (TP=2, DP=1); resumed, optimizer state included, by 4 ranks on one node
    # (-O: more tasks than its CPU; TP=2, DP=2): the distributed optimizer's state reshards over DP on load (a
    # TP change would not: its buckets are laid out per TP rank); each rank's RNG restarts from its seed.
    # The per-rank batch shrinks with DP: the micro-batch sizes follow, the global batch and rollout.n stay.
    run = preempted_grpo
    text = open(run["out"]).read()
    stopped = int(text.split("preempted: stopped after step ", 1)[1].split()[0])
    ckpt = os.path.join(run["run_dir"], "checkpoints", f"global_step_{stopped}")
    run_dir, out = os.path.join(jobs.root, "one-node"), os.path.join(jobs.root, "one-node.out")
    os.makedirs(jobs.root, exist_ok=True)
    proc = jobs.sbatch("-N", "1", "-n", "4", "-O", f"--output={out}", wait=True,
                       timeout=TRAINER_START_S,
                       **grpo_env(run_dir, run["data_dir"], stopped + 1, "trainer.save_freq=-1",
                                  "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                                  "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"))
    one = open(out).read() if os.path.exists(out) else ""
    assert proc.returncode == 0, proc.stderr + one[-3000:]
    assert "1 nodes x 4 tasks" in one and f"/global_step_{stopped} at step {stopped}" in one, one[-3000:]
    assert "written by 2 ranks, resumed by 4" in one, one[-3000:]
    assert raw_metric_steps(run_dir) == [stopped + 1], one[-3000:]


# ------------------------------------------------------------------------------------------- faults
UNREACHED_STEPS = 100_000  # the fault comes within seconds of the step waited for; 500 tiny steps take ~50 s
def test_killing_every_process_of_the_job_on_one_node_ends_it_within_60s(jobs):
    # The rank and its slurmstepd: srun then never hears of the task's exit, and the script's grace period
    # (VERL_FAILURE_GRACE_S, 20 s) ends the step; the line names the node whose processes died.
    run_dir, out = os.path.join(jobs.root, "kill"), os.path.join(jobs.root, "kill.out")
    job_id = submit_and_wait_for_step(jobs, out, run_dir, 1, "--no-requeue",
                                      **grpo_env(run_dir, os.path.join(jobs.root, "data"), UNREACHED_STEPS,
                                                 "trainer.save_freq=-1"))
    killed = kill_job_on_node(job_id, "verl-node2", with_stepd=True)
    t0 = time.monotonic()
    assert len(killed) >= 2, f"expected the rank and its slurmstepd on verl-node2, found {killed}"
    wait_for(lambda: not running(job_id), NODE_LOSS_BOUND_S + 30, "the job to end", out)
    elapsed = time.monotonic() - t0
    print(f"measured: the job ended {elapsed:.1f}s after every process of it on verl-node2 was killed")
    wait_for(lambda: "[multinode] step finished" in open(out).read(), 30, "the batch script's last line", out)
    text = open(out).read()
    assert elapsed < NODE_LOSS_BOUND_S, f"the job took {elapsed:.0f}s to end after verl-node2's processes died"
    failed = [line for line in text.splitlines() if line.startswith("[multinode] failed:")]
    assert len(failed) == 1 and failed[0].startswith("[multinode] failed: node verl-node2 rank 1 "), text[-3000:]
    assert "exit code 0" not in text.split("[multinode] step finished", 1)[1].splitlines()[0]
    clear_node(job_id, "verl-node2")


def test_link_cut_mid_collective_ends_the_job_within_twice_the_collective_timeout(jobs):
    run_dir, out = os.path.join(jobs.root, "cut"), os.path.join(jobs.root, "cut.out")
    job_id = submit_and_wait_for_step(jobs, out, run_dir, 2, "--no-requeue",
                                      **grpo_env(run_dir, os.path.join(jobs.root, "data"), UNREACHED_STEPS,
                                                 "trainer.save_freq=-1",
                                                 f"actor_rollout_ref.nccl_timeout={COLLECTIVE_TIMEOUT_S}"))
    subprocess.run(["ip", "link", "set", "vh-verl-node2", "down"], check=True)
    t0 = time.monotonic()
    try:
        wait_for(lambda: not running(job_id), 4 * COLLECTIVE_TIMEOUT_S, "the job to end", out)
        elapsed = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", "vh-verl-node2", "up"], check=True)
    print(f"measured: the job ended {elapsed:.1f}s after verl-node2's link was cut (collective timeout "
          f"{COLLECTIVE_TIMEOUT_S}s)")
    assert elapsed < 2 * COLLECTIVE_TIMEOUT_S, f"the job took {elapsed:.0f}s to end after the link was cut"
    text = open(out).read()
    assert "Timed out" in text or "Node failure" in text, text[-3000:]
    assert job_fields(job_id).get("JobState") in (None, "FAILED", "NODE_FAIL", "COMPLETING", "CANCELLED")
    clear_node(job_id, "verl-node2")


def test_node_failure_with_requeue_resumes_from_the_last_complete_checkpoint(jobs):
    # A checkpoint every step; verl-node2 fails (declared DOWN, its processes killed) after step 2. Slurm
    # requeues the job (--requeue); the next run resumes from the last complete checkpoint.
    run_dir, out = os.path.join(jobs.root, "fail"), os.path.join(jobs.root, "fail.out")
    steps = 6
    job_id = submit_and_wait_for_step(jobs, out, run_dir, 2, "--requeue",
                                      **grpo_env(run_dir, os.path.join(jobs.root, "data"), steps,
                                                 "trainer.save_freq=1"),
                                      # 1 s more per generation: the node must fail while steps 3-6 are left
                                      VERL_TEST_SLOW_GENERATION="0:1")
    login("scontrol", "update", "nodename=verl-node2", "state=down", "reason=verl-test-node-failure", check=True)
    t0 = time.monotonic()
    kill_job_on_node(job_id, "verl-node2", with_stepd=True)
    before = raw_metric_steps(run_dir)
    wait_for(lambda: job_fields(job_id).get("Restarts") == "1", 120, "Slurm to requeue the job", out)
    wait_nodes_idle()
    wait_for(lambda: "restart 1" in open(out).read() and "resumed from" in open(out).read().split("restart 1")[1],
             REQUEUE_S, "the requeued run to resume", out)
    print(f"measured: the requeued job resumed {time.monotonic() - t0:.1f}s after verl-node2 failed")
    wait_for(lambda: "[multinode] step finished" in open(out).read().split("restart 1")[1], REQUEUE_S,
             "the requeued run to finish", out)
    text = open(out).read()
    resumed = text.split("restart 1", 1)[1]
    assert "[multinode] step finished with exit code 0" in resumed, resumed[-3000:]
    latest = int(resumed.split("/global_step_", 1)[1].split()[0])
    assert latest >= before[-1] >= 2 and f"at step {latest}" in resumed, (before, resumed[-3000:])
    assert raw_metric_steps(run_dir) == list(range(1, steps + 1)), text[-3000:]


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("case", ["layout", "uneven", "unresolvable"])
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(jobs, case):
    run_dir, out = os.path.join(jobs.root, case), os.path.join(jobs.root, f"{case}.out")
    os.makedirs(jobs.root, exist_ok=True)
    env = grpo_env(run_dir, os.path.join(jobs.root, "data"), 2)
    options = []
    if case == "layout":  # a batch of one prompt cannot spread over 2 nodes' ranks: -N 2 is too many
        env["VERL_OVERRIDES"] += " data.train_batch_size=1 actor_rollout_ref.actor.ppo_mini_batch_size=1"
        expected = "launch.slurm_check: data.train_batch_size=1: expected a multiple of the rollout DP size (world 2"
    elif case == "uneven":  # 3 tasks on 2 nodes: the node list does not match the task count
        options = ["-N", "2", "-n", "3", "-O"]
        expected = "launch.slurm_check: slurm: expected the same number of tasks on each of the 2 nodes"
    else:
        env["MASTER_ADDR"] = "no-such-host.invalid"
        expected = "launch.slurm_check: the rendezvous host (MASTER_ADDR, else the job's first node): expected a"
    proc = jobs.sbatch(f"--output={out}", *options, wait=True, timeout=TRAINER_START_S, **env)
    text = open(out).read()
    assert proc.returncode == 2, proc.stderr + text
    lines = [line for line in text.splitlines() if line.startswith("launch.slurm_check")]
    assert len(lines) == 1 and lines[0].startswith(expected), text
    assert "[multinode] step finished" not in text and "srun" not in text.split(lines[0])[1], text


# ------------------------------------------------------------------------------- templates and recipes
def test_gpu_template_dry_run_spans_two_nodes(jobs):
    # ppo_multinode_gpu.sbatch as written, with VERL_DRY_RUN_CPU=1: srun --mpi=pmix over both hosts (mpi4py
    # bootstrap), the trainer command it would run for nnodes=2 printed (its layouts are validated for
    # Qwen2-7B by the one-node tier), the resumable selftest to the end. --time=20 is above the header's
    # --signal=B:USR1@900 lead: under it Slurm signals at once (and again after the requeue).
    run_dir, out = os.path.join(jobs.root, "ppo"), os.path.join(jobs.root, "ppo.out")
    os.makedirs(jobs.root, exist_ok=True)
    proc = jobs.sbatch("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=20",
                       f"--output={out}", script=os.path.join(SLURM_DIR, "ppo_multinode_gpu.sbatch"), wait=True,
                       timeout=180, VERL_DRY_RUN_CPU="1", VERL_RUN_DIR=run_dir, VERL_TP="1", VERL_PP="1",
                       VERL_ROLLOUT_TP="1")
    text = open(out).read()
    assert proc.returncode == 0, proc.stderr + text
    hello = sorted((e["rank"], e["host"], e["source"]) for e in
                   (json.loads(line) for line in text.splitlines() if line.startswith("{")) if e["event"] == "hello")
    assert hello == [(0, "verl-node1", "mpi"), (1, "verl-node2", "mpi")], text
    marker = "[ppo] dry run; on GPUs the tasks would run: "
    train_cmd = shlex.split(next(line for line in text.splitlines() if line.startswith(marker))[len(marker):])
    assert "trainer.nnodes=2" in train_cmd and "trainer.n_gpus_per_node=1" in train_cmd, train_cmd
    assert '"event": "done"' in text and "[ppo] step finished with exit code 0" in text, text


def test_gpu_template_frozen_node_ends_the_job_within_the_timeout_and_the_grace(jobs):
    # A powered-off node as the others see it: every process of the job on verl-node2 (rank and slurmstepd)
    # stopped, not killed, so no connection closes. Rank 0 learns of it only from its collective timeout (the
    # selftest's --timeout-s, standing in for actor_rollout_ref.nccl_timeout) and srun never hears from node 2's
    # slurmstepd; the template's watchdog (slurm/lib/step.sh) ends the step VERL_FAILURE_GRACE_S later.
    # Bound: timeout + grace (+ Slurm's ~10 s); on GPUs nccl_timeout (600 s default) + 20 s.
    timeout_s, grace_s = 15, 20
    run_dir, out = os.path.join(jobs.root, "frozen"), os.path.join(jobs.root, "frozen.out")
    os.makedirs(jobs.root, exist_ok=True)
    cmd = (f"{REPO}/.venv/bin/python -m launch.selftest --steps 100000 --step-seconds 0.2 --timeout-s {timeout_s}"
           f" --checkpoint-dir {run_dir}/checkpoints")
    proc = jobs.sbatch("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=20",
                       "--no-requeue", f"--output={out}", script=os.path.join(SLURM_DIR, "ppo_multinode_gpu.sbatch"),
                       VERL_DRY_RUN_CPU="1", VERL_RUN_DIR=run_dir, VERL_TP="1", VERL_PP="1", VERL_ROLLOUT_TP="1",
                       VERL_CMD=cmd, VERL_MAX_REQUEUES="0", VERL_FAILURE_GRACE_S=str(grace_s))
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    wait_for(lambda: os.path.exists(out) and '"step": 3}' in open(out).read(), TRAINER_START_S, "step 3", out)
    frozen = [*job_pids(job_id, "verl-node2"), *stepd_pids(job_id, "verl-node2")]
    assert len(frozen) >= 2, f"expected the rank and its slurmstepd on verl-node2, found {frozen}"
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: not running(job_id), 3 * (timeout_s + grace_s), "the job to end", out)
        elapsed = time.monotonic() - t0
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    print(f"measured: the job ended {elapsed:.1f}s after verl-node2 froze (collective timeout {timeout_s}s, "
          f"grace {grace_s}s)")
    assert elapsed < timeout_s + grace_s + 25, f"the job took {elapsed:.0f}s to end after verl-node2 froze"
    wait_for(lambda: "[ppo] step finished" in open(out).read(), 30, "the batch script's last line", out)
    text = open(out).read()
    assert "[ppo] failed:" in text and "requeueing" not in text, text[-3000:]
    clear_node(job_id, "verl-node2")


def test_readme_srun_recipe_runs_one_step_across_two_nodes(cluster):
    """slurm/README.md's multi-node debugging recipe, as written there: an allocation, then `srun -N 2` of
    `verl train` for one step (its commands are the lines between the recipe's markers)."""
    readme = open(os.path.join(SLURM_DIR, "README.md")).read()
    recipe = readme.split("<!-- multinode-srun-recipe -->", 2)[1]
    commands = [line.strip() for line in recipe.split("```bash", 1)[1].split("```", 1)[0].splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    salloc, steps = commands[0], commands[1:]
    assert salloc.startswith("salloc -N 2") and [c for c in steps if c.startswith("srun -N 2")], commands
    data = os.path.join(cluster, "data")
    run_dir = os.path.join(cluster, "srun-recipe")
    # The recipe's data and output paths, pointed into the shared test directory.
    script = "\n".join(c.split(" #", 1)[0].replace("data/arithmetic", data).replace("outputs/debug-multinode", run_dir)
                       for c in steps)
    quick = " ".join(QUICK.replace("'", "").split())
    script = script.replace("trainer.total_training_steps=1", f"trainer.total_training_steps=1 {quick}")
    proc = login(*shlex.split(salloc.split(" #", 1)[0]), "bash", "-c", f"set -e\n{script}", timeout=TRAINER_START_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert raw_metric_steps(run_dir) == [1], proc.stdout[-3000:]
    assert "0: " in proc.stdout and "1: " in proc.stdout  # --label: both tasks' lines
