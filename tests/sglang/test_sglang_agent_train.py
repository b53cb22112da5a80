"""`verl train` with ``rollout.multi_turn.enable`` on SGLang under verl's V1 asynchronous modes (issue 46 item 4):
tool_agent trajectories living across the weight syncs on a real SGLang engine (.venv-sglang, CPU), colocated
(``colocate_async``, 1 rank) and in a standalone pool (``separate_async``, 1 training rank + 1 pool rank). The
agent stream runs SGLang's event loop on its own thread while the loops generate only; in between, the synchronous
SGLang calls (the weight push, the memory release, validation's agent loops) run it. Each turn segment reports the
version of the weights that sampled it. Turns end on ~1 token in 8 (tests/helpers/forced_tool_calls.py),
so a phase's end may cut some; the deterministic cut is tests/sglang/test_sglang_agent_loop.py's."""

import subprocess

import pytest
from helpers.agent_runs import async_agent_cmd
from helpers.train_runs import REPO, check_accounting, ledger, read_metrics, train_env
from test_sglang_trainer import assert_no_sglang_left, sglang_processes

RUN_TIMEOUT_S = 420
STEPS = 3


MODES = {
    "colocate_async": ["actor_rollout_ref.actor.ppo_mini_batch_size=4"],
    # 2 mini-batch updates of 2 groups per weight sync; the pool's replica streams finished groups back
    "separate_async": ["actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "trainer.v1.separate_async.parameter_sync_step=2", "actor_rollout_ref.rollout.nnodes=1",
                       "actor_rollout_ref.rollout.n_gpus_per_node=1"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sglang_agent_loops_stream_across_weight_syncs(sglang_python, tmp_path, mode):
    before = sglang_processes()
    out, cmd = async_agent_cmd(
        tmp_path, mode, "actor_rollout_ref.rollout.name=sglang", *MODES[mode], "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.save_freq=-1",
        f"trainer.test_freq={STEPS}", f"trainer.total_training_steps={STEPS}", python=sglang_python)
    proc = subprocess.run(cmd, cwd=REPO, env={**train_env(), "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_no_sglang_left(before)
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        assert 2 <= record["num_turns/min"] and record["num_turns/max"] <= 6, (step, record)
        assert record["tool_call_errors/max"] == 0 and record["response_length/max"] <= 64
        assert record["training/off_policy/trajectory_staleness_worst/max"] <= 1
    # Step 1 trains trajectories SGLang sampled on version 0 only (separate_async: its first mini-batch): their
    # log-probs are the actor's on the sampled tokens (the weight-sync check, the tool tokens masked out).
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-3
    # every trained trajectory came back from the agent loops (a step counts those it received while it waited)
    assert sum(r.get("agent_loop/finished_trajectories", 0) for r in metrics.values()) >= STEPS * 4 * 2
    # Validation ran tool_agent loops on the same engine between phases.
    assert metrics[STEPS]["val-aux/num_turns/max"] >= 2
    check_accounting(ledger(out), STEPS, batch=4)
