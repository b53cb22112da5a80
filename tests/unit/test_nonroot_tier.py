"""The non-root tier (issue 56, build item 1): the sandbox, agent-loop and reward tests run again as an unprivileged
user (uid/gid 65534 through ``setpriv``, no supplementary groups, no capabilities) in a process holding a rank's
40+ threads (``helpers.rank_threads``). CI runs as root, where per-user limits, namespaces and file permissions do
not bite; a cluster's ranks never do. Run by command B (``bash tests/run_all.sh``) as part of the unit tier.

Not re-run here: the reward-pool tests (spawned processes, nothing privilege-dependent beyond what the in-process
ones cover, ~20 s), the built-in scorers and the tool-call fuzzing (pure parsing)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["tests/unit/test_sandbox.py", "tests/unit/test_agent_loop.py", "tests/unit/test_reward_faults.py"]
DESELECT = "not pool and not worker"  # the reward pool's processes (see the module doc)
NOBODY = 65534


@pytest.fixture
def home():
    """The unprivileged user's HOME, TMPDIR and pytest base dir: under /tmp (pytest's own are root's, mode 700)."""
    path = tempfile.mkdtemp(prefix="verl-nonroot-tier-", dir="/tmp" if os.path.isdir("/tmp") else None)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_sandbox_agent_loop_and_reward_tests_pass_as_an_unprivileged_user_with_a_ranks_threads(home):
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is not installed: cannot run as an unprivileged user")
        prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    else:
        prefix = []  # this run is already unprivileged: the same tests, with the rank's threads
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONDONTWRITEBYTECODE="1", VERL_TEST_RANK_THREADS="40",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([*prefix, sys.executable, "-m", "pytest", *FILES, "-p", "no:cacheprovider",
                           "-p", "helpers.rank_threads", "-q", "-k", DESELECT, f"--basetemp={home / 'pytest'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    uid, threads = map(int, re.search(r"rank_threads: uid (\d+), (\d+) threads", out).groups())
    assert uid == (NOBODY if prefix else os.geteuid()) and uid != 0
    assert threads > 40
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= 25 and "skipped" not in out, out[-3000:]
