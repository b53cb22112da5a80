"""slurm/lib/step.sh's one line naming where a failed step started, from the lines srun and the ranks printed.

A node whose every process died (its slurmstepd too) never reports its task's exit; what srun hears of first is
the surviving rank that lost it (exit 1). The line must name the dead node: from gloo's "by peer" address, or from
rank 0's "lost rank(s) [r]" at the rollout barrier (the CI run of stop 62 printed only the latter, and the line
named verl-node1, the survivor)."""

import os
import subprocess

STEP_SH = os.path.join(os.path.dirname(__file__), "..", "..", "slurm", "lib", "step.sh")


def report(tmp_path, lines, tasks_per_node=1, nodes=("verl-node1", "verl-node2")):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"  # `scontrol show hostnames LIST`: one host per line
    scontrol.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    scontrol.chmod(0o755)
    failures = tmp_path / "failures"
    failures.write_text("".join(line + "\n" for line in lines))
    script = f'source "{STEP_SH}"; _verl_tag=multinode; rc=137; _verl_report_failure "{failures}" {tasks_per_node}'
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="verl-node[1-2]")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip()


def test_a_task_failing_on_its_own_is_named_as_srun_reports_it(tmp_path):
    line = report(tmp_path, ["srun: error: verl-node2: task 1: Exited with exit code 2"])
    assert line == "[multinode] failed: node verl-node2 rank 1 (Exited with exit code 2); exit 137"


def test_the_survivor_that_lost_rank_1_points_at_rank_1s_node(tmp_path):
    line = report(tmp_path, [
        "verl train: rank 0: RankLostError: actor_rollout_ref.generate_sequences: lost rank(s) [1] (rollout "
        "replica(s) [1]): their connection closed after 0.4 s, before the 3600 s generation deadline",
        "srun: error: verl-node1: task 0: Exited with exit code 1"])
    assert line.startswith("[multinode] failed: node verl-node2 rank 1 (its ranks went away; rank(s) 0 on "
                           "verl-node1 lost rank 1); exit 137"), line


def test_lost_ranks_map_to_nodes_in_blocks_of_tasks_per_node(tmp_path):
    line = report(tmp_path, ["x: lost rank(s) [3, 2] (rollout replica(s) [1])",
                             "srun: error: verl-node1: tasks 0-1: Exited with exit code 1"], tasks_per_node=2)
    assert line.startswith("[multinode] failed: node verl-node2 rank 2-3 "), line


def test_a_failure_no_task_reported_says_so(tmp_path):
    line = report(tmp_path, [])
    assert line.startswith("[multinode] failed: exit 137 (no task reported the first failure"), line
