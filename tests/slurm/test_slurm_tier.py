"""Slurm tier: a real one-node Slurm on localhost (slurm/local/start.sh) runs the sbatch templates.

The jobs run `python -m launch.selftest` (VERL_CMD) until `verl train` exists. Every job gets a
unique name, and every test cancels its jobs when it ends (also on a timeout), because killing an
`sbatch --wait` client leaves the job running.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM_DIR = os.path.join(REPO, "slurm")
SCRIPTS = ["quickstart_cpu.sbatch", "ppo_multinode_gpu.sbatch", "local/start.sh", "local/stop.sh"]
DAEMONS = {"slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged"}
CANNOT_INSTALL = 3  # start.sh: packages missing and apt-get failed


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


@pytest.fixture
def slurm(cluster, tmp_path):
    """Submits jobs with a job environment (venv python first on PATH) and cancels them at the end."""
    names = []

    class Slurm:
        out_dir = tmp_path

        @staticmethod
        def env(**extra):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))
                   and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
            env.update(PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}",
                       PYTHONPATH=REPO, OMPI_MCA_btl="self,vader", **extra)
            return env

        @staticmethod
        def job_name():
            names.append(f"verl-test-{uuid.uuid4().hex[:10]}")
            return names[-1]

    yield Slurm
    for name in names:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=30)


def events(path):
    evs = []
    for line in open(path).read().splitlines():
        if line.startswith("{"):
            evs.append(json.loads(line))
    return evs


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def output_has(path, text):
    return lambda: os.path.exists(path) and text in open(path).read()


def job_state(job_id):
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    return fields


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
    proc = subprocess.run(["shellcheck", *[os.path.join(SLURM_DIR, s) for s in SCRIPTS]],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_local_cluster_listens_on_loopback_only(cluster):
    pids = {pid for name, pid in running_daemons() if name in ("slurmctld", "slurmd")}
    assert len(pids) == 2, running_daemons()
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                listening.append(cols[1])
    assert len(listening) >= 2, listening  # slurmctld 6817, slurmd 6818
    assert all(addr.split(":")[0] == "0100007F" for addr in listening), listening


# ------------------------------------------------------------------------------------- jobs
def test_quickstart_sbatch_wait_exits_0_and_writes_output(slurm):
    out = slurm.out_dir / "quickstart.out"
    proc = subprocess.run(
        ["sbatch", "--wait", f"--job-name={slurm.job_name()}", f"--output={out}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, capture_output=True,
        text=True, timeout=120,
        env=slurm.env(VERL_CMD="python -m launch.selftest", VERL_OUTPUT_DIR=str(slurm.out_dir)))
    assert proc.returncode == 0, proc.stderr + out.read_text()
    hello = sorted((e["rank"], e["world_size"], e["source"], e["sum"])
                   for e in events(out) if e["event"] == "hello")
    assert hello == [(0, 2, "slurm", 3.0), (1, 2, "slurm", 3.0)], out.read_text()


def test_srun_pmix_bootstraps_through_mpi4py(slurm):
    proc = subprocess.run(
        ["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", f"--job-name={slurm.job_name()}",
         "python", "-m", "launch.selftest"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=slurm.env())
    assert proc.returncode == 0, proc.stderr
    hello = sorted((e["rank"], e["source"], e["master_addr"])
                   for e in map(json.loads, proc.stdout.splitlines()) if e["event"] == "hello")
    assert hello == [(0, "mpi", "127.0.0.1"), (1, "mpi", "127.0.0.1")], proc.stdout


def test_killed_rank_fails_the_job_within_60s(slurm):
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


def test_preempted_job_checkpoints_and_resubmission_resumes(slurm):
    ckpt = slurm.out_dir / "ckpt"
    cmd = f"python -m launch.selftest --steps 500 --step-seconds 0.2 --checkpoint-dir {ckpt}"
    out = slurm.out_dir / "preempt.out"
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", f"--job-name={slurm.job_name()}", f"--output={out}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=slurm.env(VERL_CMD=cmd, VERL_OUTPUT_DIR=str(ckpt)))
    try:
        job_id = sbatch.stdout.readline().strip().split(";")[0]
        wait_for(output_has(out, '"event": "step"'), 60, "the job's first step")
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
        _, stderr = sbatch.communicate(timeout=60)
    finally:
        if sbatch.poll() is None:
            sbatch.kill()
    assert sbatch.returncode == 0, stderr + out.read_text()
    preempted = [e for e in events(out) if e["event"] == "preempted"]
    assert len(preempted) == 1, out.read_text()
    saved = json.loads((ckpt / "selftest_state.json").read_text())
    assert saved["step"] == preempted[0]["step"] < 499

    out2 = slurm.out_dir / "resume.out"
    cmd2 = f"python -m launch.selftest --steps {saved['step'] + 3} --step-seconds 0 --checkpoint-dir {ckpt}"
    proc = subprocess.run(
        ["sbatch", "--wait", f"--job-name={slurm.job_name()}", f"--output={out2}",
         os.path.join(SLURM_DIR, "quickstart_cpu.sbatch")], cwd=REPO, capture_output=True,
        text=True, timeout=120, env=slurm.env(VERL_CMD=cmd2, VERL_OUTPUT_DIR=str(ckpt)))
    assert proc.returncode == 0, proc.stderr + out2.read_text()
    evs = events(out2)
    assert {"event": "resumed", "rank": 0, "step": saved["step"]} in evs, out2.read_text()
    assert [e["step"] for e in evs if e["event"] == "step"] == [saved["step"] + 1, saved["step"] + 2]


def test_gpu_template_dry_cpu_run_preempts_requeues_and_resumes(slurm):
    """The GPU script's own logic: USR1 to the batch shell -> forwarded -> checkpoint -> requeue."""
    run_dir = slurm.out_dir / "ppo"
    out = slurm.out_dir / "ppo.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={slurm.job_name()}", f"--output={out}", "--nodes=1",
         "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10",
         os.path.join(SLURM_DIR, "ppo_multinode_gpu.sbatch")], cwd=REPO, capture_output=True,
        text=True, timeout=60,
        env=slurm.env(VERL_DRY_RUN_CPU="1", VERL_RUN_DIR=str(run_dir)))
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    wait_for(output_has(out, '"event": "step"'), 60, "the job's first step")
    # What --signal=B:USR1@120 does before the time limit: signal the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
    wait_for(lambda: job_state(job_id).get("Restarts") == "1", 60, "the job to requeue itself")
    # Slurm delays a requeued job's start by ~2 minutes; start it now.
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)
    wait_for(output_has(out, '"event": "done"'), 90, "the resumed job to finish")
    wait_for(lambda: job_state(job_id).get("JobState") in (None, "COMPLETED"), 30, "job completion")

    text = out.read_text()
    assert "[ppo] step finished with exit code 0" in text and "requeueing job" in text, text
    evs = events(out)
    preempted = [e for e in evs if e["event"] == "preempted"]
    assert len(preempted) == 1 and all(e["source"] == "mpi" for e in evs if e["event"] == "hello")
    assert {"event": "resumed", "rank": 0, "step": preempted[0]["step"]} in evs, text
    done = [e for e in evs if e["event"] == "done"]
    assert done == [{"event": "done", "rank": 0, "steps": 50, "resumed_from": preempted[0]["step"] + 1}]
