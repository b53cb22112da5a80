"""Slurm tier: a real one-node Slurm on localhost (slurm/local/start.sh) runs the sbatch templates.

- `quickstart_cpu.sbatch` runs the real `verl train` (tiny GRPO, shortened, 2 tasks): it finishes
  with exit 0 and metrics; one trainer rank per Slurm task, loopback only; SIGUSR1 -> checkpoint
  and exit 0; a resubmission resumes from that step and finishes.
- the Python API's pipeline script (tests/helpers/api_pipeline.py) runs unchanged as two `srun` tasks.
- `srun --mpi=pmix`, the rank-death case and the GPU template's dry CPU mode run the launch selftest
  (seconds per job instead of the trainer's ~40 s start-up; each case says why that suffices).

Every job gets a unique name and is cancelled when its test ends (also on a timeout), because
killing an `sbatch --wait` client leaves the job running.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from helpers.api_pipeline import STEPS_OVERRIDE, check_pipeline_run, write_pipeline
from helpers.tiny_models import arithmetic_data_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM_DIR = os.path.join(REPO, "slurm")
SCRIPTS = ["quickstart_cpu.sbatch", "ppo_multinode_gpu.sbatch", "multinode_cpu.sbatch", "lib/step.sh", "local/start.sh",
           "local/stop.sh", "local/login.sh", "local/cluster.sh", "local/multinode.sh"]
DAEMONS = {"slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged"}
CANNOT_INSTALL = 3  # start.sh: packages missing and apt-get failed
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 in /proc/net/tcp*
# Qwen2-7B-Instruct's shape: what configs/ppo_megatron_gpu.yaml's layouts must divide.
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
            "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
# The tiny GRPO run, shortened: small batch, no validation, no periodic checkpoints (a preemption
# still writes one), console log only. Quoted: the job's shell parses VERL_OVERRIDES.
QUICK_OVERRIDES = ("data.train_batch_size=2 actor_rollout_ref.rollout.n=4"
                   " actor_rollout_ref.actor.ppo_mini_batch_size=2"
                   " actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"
                   " actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"
                   " actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"
                   " trainer.save_freq=-1 trainer.val_before_train=false"
                   " trainer.test_freq=-1 'trainer.logger=[console]'")
TRAINER_START_S = 240  # the trainer's start-up on a loaded 2-core machine is ~40-90 s


def running_daemons():
    """(name, pid) of live Slurm/munge processes. Zombies are skipped: a daemon's first fork exits
    when it daemonizes, and a container's pid 1 may never reap it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name in DAEMONS and state != "Z":
            found.append((name, int(entry)))
    return found


def listening_addresses(pids):
    """Hex local addresses of the TCP sockets in LISTEN state that ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                listening.append(cols[1].split(":")[0])
    return listening


def job_processes(job_id, key="SLURM_JOB_ID"):
    """pid -> (argv, environment) of every process that Slurm started for ``job_id`` (or whose ``key`` in its
    environment is ``job_id``: an `srun` job's id is not known to the test, its unique name is)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                raw_env = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in raw_env.split("\0") if "=" in kv)
        if env.get(key) == job_id:
            found[int(entry)] = (argv, env)
    return found


def end_leftovers(processes, within=30.0):
    """Wait up to ``within`` s for ``processes()`` (pid -> (argv, env)) to empty; what is still there is killed (so
    nothing stays behind for the next tests) and returned as pid -> the start of its command line."""
    deadline = time.monotonic() + within
    while processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: " ".join(argv)[:160] for pid, (argv, _) in processes().items()}
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("slurm tier: needs root to install and start munged/slurmctld/slurmd")
    start = subprocess.run([os.path.join(SLURM_DIR, "local", "start.sh")], capture_output=True,
                           text=True, timeout=600)
    if start.returncode == CANNOT_INSTALL:
        pytest.skip(f"slurm tier: Slurm packages cannot be installed here: {start.stderr.strip()}")
    assert start.returncode == 0, start.stderr
    yield
    stop = subprocess.run([os.path.join(SLURM_DIR, "local", "stop.sh")], capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert running_daemons() == [], "daemons left running after stop.sh"


class Slurm:
    """Submits jobs with a job environment (venv python first on PATH); `cancel()` ends them all."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.names = []

    @staticmethod
    def env(**extra):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}",
                   PYTHONPATH=REPO, OMPI_MCA_btl="self,vader", **extra)
        return env

    def job_name(self):
        self.names.append(f"verl-test-{uuid.uuid4().hex[:10]}")
        return self.names[-1]

    def cancel(self):
        for name in self.names:
            subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30)


@pytest.fixture
def slurm(cluster, tmp_path):
    jobs = Slurm(tmp_path)
    yield jobs
    jobs.cancel()


def events(path):
    evs = []
    for line in open(path).read().splitlines():
        if line.startswith("{"):
            evs.append(json.loads(line))
    return evs


def metric_steps(run_dir):
    """Steps logged in ``run_dir/metrics.jsonl`` so far (a line still being written is skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines = open(path).read().split("\n")[:-1]  # everything before the last newline is complete
    return [json.loads(line)["step"] for line in lines if line]


def wait_for(predicate, timeout, what, log=None):
    """Poll ``predicate`` until true; on a timeout the error shows the end of ``log`` (a job's output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = open(log).read()[-3000:] if log is not None and os.path.exists(log) else ""
    queue = subprocess.run(["squeue", "-h", "-o", "%i %j %T %r"], capture_output=True, text=True, timeout=30).stdout
    ctld_log = os.path.join(os.environ.get("VERL_SLURM_DIR", "/tmp/verl-local-slurm"), "log", "slurmctld.log")
    ctld = "".join(open(ctld_log).readlines()[-15:]) if os.path.exists(ctld_log) else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\nqueue:\n{queue}\n"
                         f"slurmctld.log:\n{ctld}\njob output:\n{tail}")


def wait_for_idle_cluster(timeout=120):
    """Cancel what earlier tests' jobs left in the queue (all are named verl-test-*) and wait until
    it is empty: a requeued 2-task job needs both CPUs of the one-node cluster."""
    listing = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30).stdout
    for line in listing.splitlines():
        job_id, name = line.split(maxsplit=1)
        if name.startswith("verl-test-"):
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    wait_for(lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30).stdout.strip(),
             timeout, "the queue to empty")


def output_has(path, text):
    return lambda: os.path.exists(path) and text in open(path).read()


def job_state(job_id):
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    return fields


@pytest.fixture(scope="module")
def qwen2_7b_inputs(tmp_path_factory):
    """Overrides that point configs/ppo_megatron_gpu.yaml at a Qwen2-7B config.json and stand-in data
    files: the validator reads the model's shape and checks that the data files exist."""
    root = tmp_path_factory.mktemp("qwen2_7b")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(QWEN2_7B))
    for name in ("train.parquet", "test.parquet"):
        (root / name).touch()
    return [f"actor_rollout_ref.model.path={root / 'model'}", f"critic.model.path={root / 'model'}",
            f"data.tokenizer={root / 'model'}", f"data.train_files={root / 'train.parquet'}",
            f"data.val_files={root / 'test.parquet'}"]


# ------------------------------------------------------------------------------------- scripts
def test_scripts_pass_bash_n_and_shellcheck():
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", os.path.join(SLURM_DIR, script)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
    if shutil.which("shellcheck") is None:
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq"
                       " --no-install-recommends shellcheck", shell=True, capture_output=True,
                       timeout=300)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed and `apt-get install shellcheck` failed")
    # -x: follow the scripts' `source` of slurm/local/cluster.sh and multinode.sh
    proc = subprocess.run(["shellcheck", "-x", *[os.path.join(SLURM_DIR, s) for s in SCRIPTS]],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("nodes,tp,pp,rollout_tp", [(2, 4, 1, 2), (2, 4, 2, 2), (4, 4, 2, 4), (8, 4, 1, 2)])
def test_gpu_config_validates_for_qwen2_7b_layouts(qwen2_7b_inputs, nodes, tp, pp, rollout_tp):
    from verl.trainer.config import load_config

    config = load_config(os.path.join(REPO, "configs", "ppo_megatron_gpu.yaml"), [
        *qwen2_7b_inputs, f"trainer.nnodes={nodes}", "trainer.n_gpus_per_node=8",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"], launcher_world_size=nodes * 8)
    assert config.algorithm.adv_estimator == "gae" and config.trainer.resume_mode == "auto"


def test_local_cluster_listens_on_loopback_only(cluster):
    pids = {pid for name, pid in running_daemons() if name in ("slurmctld", "slurmd")}
    assert len(pids) == 2, running_daemons()
    listening = listening_addresses(pids)
    assert len(listening) >= 2, listening  # slurmctld 6817, slurmd 6818
    assert set(listening) <= LOOPBACK_HEX, listening


# ------------------------------------------------------------------- the quickstart: verl train
# `sbatch --wait` of the quickstart to its end (exit 0, the data the job generated, metrics for every step) is
# checked on the preempted run and its resubmission below: one trainer job less than a separate 2-step run.
def test_quickstart_sbatch_with_a_rollout_pool_trains_on_three_tasks(slurm):
    """`VERL_ROLLOUT_RANKS=1 sbatch --ntasks=3 --overcommit` (the local node has 2 CPUs): tasks 0-1 train, task 2
    is the standalone rollout pool; one step with the pool's weight sync in its metrics."""
    run_dir, data_dir, out = slurm.out_dir / "run", slurm.out_dir / "data" / "arithmetic", slurm.out_dir / "p.out"
    proc = subprocess.run(
        ["sbatch", "--wait", "--ntasks=3", "--overcommit", f"--job-name={slurm.job_name()}", f"--output={out}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, capture_output=True, text=True,
        timeout=TRAINER_START_S,
        env=slurm.env(VERL_OUTPUT_DIR=str(run_dir), VERL_DATA_DIR=str(data_dir), VERL_ROLLOUT_RANKS="1",
                      VERL_OVERRIDES=f"trainer.total_training_steps=1 {QUICK_OVERRIDES}"))
    text = out.read_text()
    assert proc.returncode == 0, proc.stderr + text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1], text
    assert records[0]["perf/weight_sync_bytes"] > 0, records


PREEMPTED_STEPS = 100_000  # never reached: the signal comes within seconds of step 1


@pytest.fixture(scope="module")
def preempted_quickstart(cluster, tmp_path_factory):
    """`sbatch --wait slurm/quickstart_cpu.sbatch` with its default command (the tiny GRPO config)
    for up to PREEMPTED_STEPS steps, sent SIGUSR1 once step 1 is logged. Yields what the tests check. (At 50 steps
    a fast CI machine, 0.02 s a step, had finished them all before the signal: the run must outlast the probe.)"""
    root = tmp_path_factory.mktemp("quickstart")
    jobs = Slurm(root)
    run = {"run_dir": root / "run", "data_dir": root / "data" / "arithmetic", "out": root / "preempt.out",
           "jobs": jobs}
    env = jobs.env(VERL_OUTPUT_DIR=str(run["run_dir"]), VERL_DATA_DIR=str(run["data_dir"]),
                   VERL_OVERRIDES=f"trainer.total_training_steps={PREEMPTED_STEPS} {QUICK_OVERRIDES}")
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", f"--job-name={jobs.job_name()}", f"--output={run['out']}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        run["job_id"] = sbatch.stdout.readline().strip().split(";")[0]
        wait_for(lambda: metric_steps(run["run_dir"]), TRAINER_START_S, "the trainer's first step", run["out"])
        # While it runs: the trainer ranks (argv has --config) and their listening sockets.
        run["ranks"] = {pid: env for pid, (argv, env) in job_processes(run["job_id"]).items() if "--config" in argv}
        run["listening"] = listening_addresses(run["ranks"])
        subprocess.run(["scancel", "--signal=USR1", run["job_id"]], check=True, timeout=30)
        _, run["stderr"] = sbatch.communicate(timeout=120)
        run["returncode"] = sbatch.returncode
        yield run
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
        jobs.cancel()


def test_quickstart_runs_verl_train_as_one_rank_per_slurm_task_on_loopback(preempted_quickstart):
    ranks, listening = preempted_quickstart["ranks"], preempted_quickstart["listening"]
    # srun's two tasks are the ranks themselves: no `verl train` spawning local ranks (RANK=...).
    assert sorted(env["SLURM_PROCID"] for env in ranks.values()) == ["0", "1"], ranks
    assert not any("RANK" in env for env in ranks.values()), ranks
    assert listening, "rank 0's rendezvous store is not listening"
    assert set(listening) <= LOOPBACK_HEX, listening


def test_quickstart_preempted_by_usr1_checkpoints_and_exits_0(preempted_quickstart):
    run = preempted_quickstart
    text = run["out"].read_text()
    assert run["returncode"] == 0, run["stderr"] + text
    assert (run["data_dir"] / "train.parquet").is_file(), "the job did not generate the arithmetic data"
    steps = metric_steps(run["run_dir"])
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < PREEMPTED_STEPS, steps
    latest = run["run_dir"] / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert latest.read_text().strip() == str(steps[-1]), text
    assert f"preempted: stopped after step {steps[-1]} with a checkpoint; exiting 0" in text, text


def test_no_process_of_the_quickstart_job_outlives_it(preempted_quickstart):
    """Issue 56, fault 12: after the job exited 0, two spawned children of its ranks (dist_checkpointing's
    Manager, started by the Megatron checkpoint save at the preemption) stayed alive, parent pid 1, forever (this
    cluster has no cgroup process tracking, as many do not). Every process that carries the job's id is gone."""
    run = preempted_quickstart
    assert run["returncode"] == 0
    left = end_leftovers(lambda: job_processes(run["job_id"]))
    assert not left, f"processes of job {run['job_id']} outlived it: {left}"


@pytest.mark.parametrize("end", ["finished", "scancel"])
def test_no_child_a_rank_starts_outlives_an_srun_job(slurm, end):
    """Issue 56 build item 7 under `srun` with no batch script around it: each of the 2 tasks is a `verl train`
    rank that starts children of its own: 2 reward workers (a spawned process pool) and a data-loader worker (forked).
    After the job ends, finished (exit 0 after 2 steps) or cancelled with `scancel` after its first step, no process
    carrying the job's name is left within 30 s (this cluster has no cgroup process tracking, as many do not)."""
    data = slurm.out_dir / "arith"
    overrides = arithmetic_data_args(data, num_train=32, num_test=4)
    steps = 2 if end == "finished" else PREEMPTED_STEPS
    name = slurm.job_name()
    run_dir, log = slurm.out_dir / "run", slurm.out_dir / "srun.log"
    cmd = ["srun", "-n", "2", "--mpi=none", "--kill-on-bad-exit=1", f"--job-name={name}", "python", "-m", "verl.cli",
           "train", "--config", "configs/grpo_arith_tiny.yaml", *overrides, f"trainer.output_dir={run_dir}",
           f"trainer.total_training_steps={steps}", "reward.num_workers=2", "data.dataloader_num_workers=1",
           *shlex.split(QUICK_OVERRIDES)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=slurm.env(OMP_NUM_THREADS="1"))
    try:
        if end == "finished":
            assert proc.wait(timeout=TRAINER_START_S) == 0, log.read_text()[-3000:]
            assert metric_steps(run_dir) == [1, 2], log.read_text()[-3000:]
        else:
            wait_for(lambda: metric_steps(run_dir), TRAINER_START_S, "the trainer's first step", log)
            # The ranks and their forked data-loader workers carry the rank's argv; the spawned reward workers
            # multiprocessing's. Both kinds must be running, or the test would not test them.
            running = [" ".join(argv) for argv, _ in job_processes(name, "SLURM_JOB_NAME").values()]
            forked = [a for a in running if "--config" in a]
            spawned = [a for a in running if "multiprocessing" in a]
            assert len(forked) > 2 and spawned, f"expected 2 ranks, their data-loader and reward workers: {running}"
            subprocess.run(["scancel", f"--name={name}"], check=True, timeout=30)
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = end_leftovers(lambda: job_processes(name, "SLURM_JOB_NAME"))
    assert not left, f"processes of srun job {name} outlived it ({end}): {left}"


def test_quickstart_resubmission_resumes_from_the_preemption_checkpoint(preempted_quickstart):
    run = preempted_quickstart
    saved = metric_steps(run["run_dir"])[-1]
    out = run["out"].with_name("resume.out")
    env = run["jobs"].env(VERL_OUTPUT_DIR=str(run["run_dir"]), VERL_DATA_DIR=str(run["data_dir"]),
                          VERL_OVERRIDES=f"trainer.total_training_steps={saved + 2} trainer.resume_mode=auto"
                                         f" {QUICK_OVERRIDES}")
    proc = subprocess.run(
        ["sbatch", "--wait", f"--job-name={run['jobs'].job_name()}", f"--output={out}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, capture_output=True, text=True,
        timeout=TRAINER_START_S, env=env)
    text = out.read_text()
    assert proc.returncode == 0, proc.stderr + text
    assert f"at step {saved}" in text and "resumed from" in text, text
    assert metric_steps(run["run_dir"]) == list(range(1, saved + 3)), text
    # Every step of both jobs, the resubmission's to the end of its run, logged verl's losses and scores.
    records = [json.loads(line) for line in (run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert all("actor/pg_loss" in r and "critic/score/mean" in r for r in records), records


# ------------------------------------------------------------------- launch paths: the selftest
def test_srun_pmix_bootstraps_through_mpi4py(slurm):
    # The quickstart uses --mpi=none; this is the GPU template's path (rank 0 broadcasts the port).
    proc = subprocess.run(
        ["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", f"--job-name={slurm.job_name()}",
         "python", "-m", "launch.selftest"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=slurm.env())
    assert proc.returncode == 0, proc.stderr
    hello = sorted((e["rank"], e["source"], e["master_addr"])
                   for e in map(json.loads, proc.stdout.splitlines()) if e["event"] == "hello")
    assert hello == [(0, "mpi", "127.0.0.1"), (1, "mpi", "127.0.0.1")], proc.stdout


def test_python_api_script_runs_unchanged_as_two_srun_tasks(slurm):
    """Issue 48 item 6: the DataPipeline script that tests/distributed runs under python, torchrun and mpirun, here
    as two Slurm tasks. --mpi=none, as the quickstart: the ranks find each other from SLURM_* alone (mpi4py's
    path is the test above's); two processes that each took themselves for rank 0 would print two results."""
    data = slurm.out_dir / "arith"
    arithmetic_data_args(data, num_train=8, num_test=4)
    write_pipeline(slurm.out_dir, data)
    proc = subprocess.run(
        ["srun", "-n", "2", "--mpi=none", "--kill-on-bad-exit=1", f"--job-name={slurm.job_name()}",
         "python", "pipeline.py", STEPS_OVERRIDE], cwd=slurm.out_dir, capture_output=True, text=True,
        timeout=TRAINER_START_S, env=slurm.env(OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check_pipeline_run(proc.stdout, slurm.out_dir)


def test_killed_rank_fails_the_job_within_60s(slurm):
    # The selftest, not the trainer: what ends the job is srun --kill-on-bad-exit and gloo's dead-peer
    # error in verl.launcher.bootstrap's process group, the same for any command, and a rank that dies at
    # a chosen moment needs no trainer start-up (~40 s) inside the 60 s being measured.
    out = slurm.out_dir / "die.out"
    t0 = time.monotonic()
    proc = subprocess.run(
        ["sbatch", "--wait", f"--job-name={slurm.job_name()}", f"--output={out}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, capture_output=True,
        text=True, timeout=90,
        env=slurm.env(VERL_CMD="python -m launch.selftest --die-rank 1 --die-after 2",
                      VERL_OUTPUT_DIR=str(slurm.out_dir)))
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, out.read_text()
    assert elapsed < 60, f"job took {elapsed:.0f}s to fail"
    assert {"event": "dying", "rank": 1} in events(out), out.read_text()


def test_gpu_template_dry_cpu_run_preempts_requeues_and_resumes(slurm, qwen2_7b_inputs):
    """The GPU script's own logic: USR1 to the batch shell -> forwarded -> checkpoint -> requeue.

    The tasks run the resumable selftest (the trainer needs GPUs for the 7B config); the trainer
    command the script builds is checked against the config validator instead.
    """
    from verl.trainer.config import load_config

    wait_for_idle_cluster()
    run_dir = slurm.out_dir / "ppo"
    out = slurm.out_dir / "ppo.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={slurm.job_name()}", f"--output={out}", "--nodes=1",
         "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=20",
         os.path.join(SLURM_DIR, "ppo_multinode_gpu.sbatch")], cwd=REPO, capture_output=True,
        text=True, timeout=60,
        env=slurm.env(VERL_DRY_RUN_CPU="1", VERL_RUN_DIR=str(run_dir), VERL_TP="2", VERL_PP="1",
                      VERL_ROLLOUT_TP="2"))
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    wait_for(output_has(out, '"event": "step"'), 90, "the job's first step", out)
    # What the header's --signal=B:USR1@900 does before the time limit: signal the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
    wait_for(lambda: job_state(job_id).get("Restarts") == "1", 60, "the job to requeue itself", out)
    # Slurm's own requeue path, unforced: the local cluster's cred_expire=30 holds the requeued job
    # ~31 s (a StartTime=now kick races the old credential's revocation and slurmd kills the job).
    # Then start-up and the remaining steps on a loaded host.
    wait_for(output_has(out, '"event": "done"'), 240, "the resumed job to finish", out)
    wait_for(lambda: job_state(job_id).get("JobState") in (None, "COMPLETED"), 30, "job completion")

    text = out.read_text()
    assert "[ppo] step finished with exit code 0" in text and "requeueing job" in text, text
    evs = events(out)
    preempted = [e for e in evs if e["event"] == "preempted"]
    assert len(preempted) == 1 and all(e["source"] == "mpi" for e in evs if e["event"] == "hello")
    assert {"event": "resumed", "rank": 0, "step": preempted[0]["step"]} in evs, text
    done = [e for e in evs if e["event"] == "done"]
    assert done == [{"event": "done", "rank": 0, "steps": 30, "resumed_from": preempted[0]["step"] + 1}]

    marker = "[ppo] dry run; on GPUs the tasks would run: "
    train_cmd = shlex.split(next(line for line in text.splitlines() if line.startswith(marker))[len(marker):])
    assert train_cmd[0] == os.path.join(REPO, ".venv", "bin", "verl") and train_cmd[1:3] == ["train", "--config"]
    config = load_config(os.path.join(REPO, train_cmd[3]), train_cmd[4:] + qwen2_7b_inputs, launcher_world_size=2)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 2)
    assert config.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert config.trainer.default_local_dir == str(run_dir / "checkpoints")


def submit_gpu_dry_run(slurm, name, *sbatch_args, **env):
    """ppo_multinode_gpu.sbatch in its CPU dry run, 1 node x 2 tasks: the job id and its output file."""
    out = slurm.out_dir / f"{name}.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={slurm.job_name()}", f"--output={out}", "--nodes=1",
         "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", *sbatch_args,
         os.path.join(SLURM_DIR, "ppo_multinode_gpu.sbatch")], cwd=REPO, capture_output=True, text=True,
        timeout=60, env=slurm.env(VERL_DRY_RUN_CPU="1", VERL_RUN_DIR=str(slurm.out_dir / name), VERL_TP="1",
                                  VERL_PP="1", VERL_ROLLOUT_TP="1", **env))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], out


def test_gpu_template_checkpoints_before_the_time_limit_by_the_measured_save_time(slurm):
    """A run whose checkpoint save (8 s, measured by its periodic save) outgrows the header's --signal lead
    (here 2 s) is asked to checkpoint earlier by the deadline timer: lead = 1.5 x (step + 2 saves) + margin,
    from its metrics.jsonl; it checkpoints and exits 0 before Slurm's 1-minute limit (no TIMEOUT)."""
    wait_for_idle_cluster()
    run_dir = slurm.out_dir / "deadline"
    cmd = (f"{REPO}/.venv/bin/python -m launch.selftest --steps 1000 --step-seconds 0.5 --save-every 4"
           f" --save-seconds 8 --checkpoint-dir {run_dir}/checkpoints --metrics {run_dir}/metrics.jsonl")
    job_id, out = submit_gpu_dry_run(slurm, "deadline", "--time=1", "--signal=B:USR1@2", VERL_CMD=cmd,
                                     VERL_MAX_REQUEUES="0", VERL_PREEMPT_MARGIN_S="5", VERL_PREEMPT_POLL_S="1")
    wait_for(lambda: job_state(job_id).get("JobState") in (None, "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"),
             150, "the job to end", out)
    text = out.read_text()
    assert job_state(job_id).get("JobState") in (None, "COMPLETED"), text
    assert "below the measured lead of" in text and "[ppo] step finished with exit code 0" in text, text
    assert "not requeueing: 0 restarts reached VERL_MAX_REQUEUES" in text, text
    preempted = [e for e in events(out) if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == 10, text  # SIGUSR1, from the timer via the shell
    lead = int(text.split("below the measured lead of ", 1)[1].split("s", 1)[0])
    assert lead >= 1.5 * (0.5 + 2 * 8) + 5, text  # the measured save time, not the header's 2 s


def test_gpu_template_sigterm_checkpoints_and_does_not_requeue(slurm):
    """scancel's SIGTERM to the batch shell: forwarded to the tasks as a checkpoint request; the job ends 0
    with the checkpoint written and is not requeued (a cancel means stop)."""
    wait_for_idle_cluster()
    run_dir = slurm.out_dir / "term"
    cmd = (f"{REPO}/.venv/bin/python -m launch.selftest --steps 1000 --step-seconds 0.3"
           f" --checkpoint-dir {run_dir}/checkpoints")
    job_id, out = submit_gpu_dry_run(slurm, "term", "--time=20", VERL_CMD=cmd)  # > the header's 900 s lead
    wait_for(output_has(out, '"event": "step"'), 90, "the job's first step", out)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], check=True, timeout=30)
    wait_for(lambda: job_state(job_id).get("JobState") in (None, "COMPLETED", "FAILED", "CANCELLED"), 60,
             "the job to end", out)
    text = out.read_text()
    assert "[ppo] SIGTERM: asking the tasks to checkpoint" in text and "exit code 0" in text, text
    assert "not requeueing (SIGTERM" in text and job_state(job_id).get("Restarts", "0") == "0", text
    preempted = [e for e in events(out) if e["event"] == "preempted"]
    assert len(preempted) == 1 and os.path.exists(preempted[0]["checkpoint"]), text


def test_both_multinode_templates_run_their_step_through_the_shared_library():
    # The watchdog, traps, deadline timer and requeue live once, in slurm/lib/step.sh.
    for name, tag in (("multinode_cpu.sbatch", "multinode"), ("ppo_multinode_gpu.sbatch", "ppo")):
        text = open(os.path.join(SLURM_DIR, name)).read()
        assert 'source "$submit_dir/slurm/lib/step.sh"' in text and f"verl_run_step {tag} " in text, name
        assert "srun " not in text.split("verl_run_step", 1)[0].split("#SBATCH --output", 1)[1], name
