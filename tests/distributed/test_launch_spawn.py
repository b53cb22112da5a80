"""Local multi-rank launch: `verl.launcher.spawn` + `launch.selftest` on gloo over loopback.

Every rank carries a unique token in its environment, so the tests can find the job's processes
in /proc (to check their listening sockets, and that none is left behind).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELFTEST = [sys.executable, "-m", "launch.selftest", "--timeout-s", "30"]
TCP_LISTEN = "0A"


@pytest.fixture
def token():
    tok = f"launch-test-{uuid.uuid4().hex}"
    yield tok
    leftovers = pids_with_token(tok)
    for pid in leftovers:  # only processes this test started: they carry its token
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leftovers, f"processes left running after the test: {leftovers}"


def job_env(tok, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(VERL_TEST_TOKEN=tok, PYTHONPATH=REPO, **extra)
    return env


def pids_with_token(tok):
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"VERL_TEST_TOKEN={tok}".encode() in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def spawn(tok, nproc, *args, **popen):
    cmd = [sys.executable, "-m", "verl.launcher.spawn", "--nproc", str(nproc), "--", *SELFTEST, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(tok), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def events(output):
    """JSON lines printed by the ranks (the `[rank N] ` prefix stripped)."""
    out = []
    for line in output.splitlines():
        prefix, _, body = line.partition("] ")
        if prefix.startswith("[rank ") and body.startswith("{"):
            out.append((int(prefix[len("[rank "):]), json.loads(body)))
    return out


def listening_addresses(pids):
    """(ip_hex, port) of every TCP socket in LISTEN state owned by ``pids`` (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == TCP_LISTEN and cols[9] in inodes:
                    ip_hex, port_hex = cols[1].split(":")
                    found.append((ip_hex, int(port_hex, 16)))
    return found


def test_dead_rank_fails_the_job_fast_and_leaves_nothing(token):
    t0 = time.monotonic()
    proc = spawn(token, 2, "--die-rank", "1", "--die-after", "1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert time.monotonic() - t0 < 60
    assert any(ev["event"] == "dying" and rank == 1 for rank, ev in events(out)), out


def test_survivor_exits_nonzero_on_its_own_when_a_peer_dies(token, tmp_path):
    """Without spawn's fail-fast: the collective itself must fail, not hang (bootstrap's job)."""
    port = str(_free_port())
    procs = [subprocess.Popen(SELFTEST + ["--die-rank", "1", "--die-after", "1"], cwd=REPO,
                              env=job_env(token, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    out0, _ = procs[0].communicate(timeout=60)
    procs[1].communicate(timeout=60)
    assert procs[1].returncode == 1
    assert procs[0].returncode == 1, out0
    assert "launch.selftest: rank 0:" in out0


def test_two_ranks_all_reduce_report_and_listen_on_loopback_only(token, tmp_path):
    proc = spawn(token, 2, "--steps", "200", "--step-seconds", "0.05",
                 "--checkpoint-dir", str(tmp_path))
    listening, lines = [], []
    try:
        for line in proc.stdout:  # the ranks are stepping, so their preemption handlers are installed
            lines.append(line)
            if '"event": "step"' in line:
                break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            listening = listening_addresses(pids_with_token(token))
            if len(listening) >= 3:  # the store plus one gloo listener per rank
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGUSR1)  # preempt: every rank stops cleanly
        rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    hello = {rank: ev for rank, ev in events(out) if ev["event"] == "hello"}
    assert sorted(hello) == [0, 1], out
    for rank, ev in hello.items():
        assert (ev["rank"], ev["world_size"], ev["local_rank"]) == (rank, 2, rank)
        assert (ev["source"], ev["backend"], ev["sum"]) == ("torchrun", "gloo", 3.0)
    assert listening, "the running job held no listening socket: nothing was checked"
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert all(ip in loopback for ip, _ in listening), listening


def test_preemption_checkpoints_and_resume_continues(token, tmp_path):
    proc = spawn(token, 2, "--steps", "1000", "--step-seconds", "0.05",
                 "--checkpoint-dir", str(tmp_path))
    lines = []
    for line in proc.stdout:  # signal once the job is really stepping
        lines.append(line)
        if '"event": "step"' in line:
            break
    proc.send_signal(signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    preempted = [ev for _, ev in events(out) if ev["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == signal.SIGUSR1, out
    saved = json.loads((tmp_path / "selftest_state.json").read_text())
    assert saved["step"] == preempted[0]["step"] < 999
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]

    resumed = spawn(token, 2, "--steps", str(saved["step"] + 3), "--step-seconds", "0",
                    "--checkpoint-dir", str(tmp_path))
    out2, _ = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, out2
    evs = [ev for _, ev in events(out2)]
    assert {"event": "resumed", "rank": 0, "step": saved["step"]} in evs
    steps = [ev["step"] for ev in evs if ev["event"] == "step"]
    assert steps == [saved["step"] + 1, saved["step"] + 2], out2


def test_spawn_cli_rejects_bad_usage_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "verl.launcher.spawn", "--nproc", "0", "--", "true"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "--nproc: expected >= 1, found 0" in proc.stderr


def _free_port():
    from verl.launcher.spawn import free_loopback_port
    return free_loopback_port()


def test_selftest_cli_rejects_steps_without_checkpoint_dir_with_exit_2():
    proc = subprocess.run(SELFTEST + ["--steps", "3"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=job_env("unused"))
    assert proc.returncode == 2
    assert "--steps: expected --checkpoint-dir as well" in proc.stderr


def test_preemption_handler_records_signal_and_restores_previous_handler():
    from verl.launcher.preemption import PreemptionHandler

    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler() as preempt:
        assert not preempt.should_stop()  # no process group: this process's own flag
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.requested and preempt.should_stop()
        assert preempt.received_signal == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


def test_run_ranks_ranks_die_with_a_killed_parent():
    """run_ranks (verl sft / convert / generate / bench): SIGKILL its parent, no rank survives it."""
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", "import time\nfrom verl.launcher.spawn import run_ranks\n"
                               "run_ranks(time.sleep, 2, 600, timeout_s=900)"],
                              env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)

    def ranks():
        procs = [p for p in psutil.Process(parent.pid).children(recursive=True)
                 if "verl.launcher.function_rank" in p.cmdline()]
        # Connected to each other (gloo is up): each rank is past its first line, die_with_parent.
        return procs if len(procs) == 2 and all(p.net_connections(kind="tcp") for p in procs) else None

    pids = []
    try:
        deadline = time.monotonic() + 90
        while not pids and time.monotonic() < deadline:
            pids = [p.pid for p in ranks() or []]
            time.sleep(0.2)
        assert pids, "the 2 ranks did not start"
        parent.kill()
        parent.wait(timeout=10)

        from helpers.tiny_models import alive_pids

        def alive():
            return alive_pids(pids)

        deadline = time.monotonic() + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(), f"ranks still running after their parent was killed: {alive()}"
    finally:
        for pid in pids:  # only the ranks this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if parent.poll() is None:
            parent.kill()


def _rank_fn(rank, world_size, mode):
    """run_ranks' test function: each rank's value, or rank 1 failing the way ``mode`` says."""
    import torch
    import torch.distributed as dist

    if rank == 1 and mode == "raise":
        raise ValueError("rank 1 was told to fail")
    if rank == 1 and mode == "exit":
        os._exit(7)
    if mode == "hang":
        time.sleep(600)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"rank": rank, "world": world_size, "sum": total}


def test_run_ranks_returns_each_ranks_value_over_one_gloo_group():
    from verl.launcher.spawn import run_ranks_with_rank

    values = run_ranks_with_rank(_rank_fn, 2, "ok", timeout_s=120)
    assert [v["rank"] for v in values] == [0, 1] and {v["world"] for v in values} == {2}
    assert [v["sum"].item() for v in values] == [3.0, 3.0]


@pytest.mark.parametrize("mode, needle", [("raise", "rank 1 failed:"), ("exit", "rank 1 died with exit code 7")])
def test_run_ranks_names_the_failing_rank_and_ends_the_others(mode, needle):
    from verl.launcher.spawn import RankFailure, run_ranks_with_rank

    tick = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_ranks_with_rank(_rank_fn, 2, mode, timeout_s=300)
    assert needle in str(err.value)
    if mode == "raise":
        assert "ValueError: rank 1 was told to fail" in str(err.value)  # the rank's own traceback
    # Rank 0 is blocked in all_reduce (or sleeping) when rank 1 fails: fail-fast ends it, the 300 s limit does not.
    assert time.monotonic() - tick < 120


def test_run_ranks_time_limit_ends_every_rank():
    from verl.launcher.spawn import RankFailure, run_ranks_with_rank

    tick = time.monotonic()
    # 10 s: past the ranks' start-up (they hang inside the function), and 10 s less waiting than 20 s.
    with pytest.raises(RankFailure, match=r"expected 2 results within 10s, found 0"):
        run_ranks_with_rank(_rank_fn, 2, "hang", timeout_s=10)
    assert time.monotonic() - tick < 10 + 30  # the limit, then SIGTERM and at most the kill grace
