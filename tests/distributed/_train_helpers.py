"""Running `verl train` as a subprocess from the end-to-end tests (test_train_e2e, test_train_fsdp)."""

import os
import signal
import subprocess
import time

import pytest

psutil = pytest.importorskip("psutil")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 240


def train_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, VERL_STRICT_DATA_CHECK="1", OMP_NUM_THREADS="1")
    return env


def read_metrics(output_dir):
    from verl.utils.tracking import read_metrics as read

    return {record["step"]: record for record in read(str(output_dir))}


def kill_tree(pid):
    """SIGKILL the launcher and every rank it started (ranks run in their own sessions)."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_until_step_then_kill(cmd, output_dir, step):
    """Start ``cmd`` (a `verl train` writing to ``output_dir``) and SIGKILL it and all its ranks as soon as
    step ``step`` is logged, so every checkpoint saved before that step is complete and later steps are
    not logged; fails if the run ends first."""
    launcher = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            if (output_dir / "metrics.jsonl").is_file() and step in read_metrics(output_dir):
                break
            time.sleep(0.05)
        assert launcher.poll() is None, f"the run finished before it could be killed after step {step}"
    finally:
        kill_tree(launcher.pid)
