"""`verl train` commands for the agent-loop tests (issue 46): the tiny chat model, arithmetic problems as tool_agent
rows, the calculator from verl's tool YAML, a test tool-call format (tests/helpers/forced_tool_calls.py). Shared by
the distributed tier and the SGLang tier (whose runs use .venv-sglang's python: ``python``)."""

import sys

import pyarrow as pa
import pyarrow.parquet as pq

from helpers.chat_models import save_chat_model
from helpers.train_runs import train_cmd


def write_data(path, rows):
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "arithmetic", "agent_name": "tool_agent", "ability": "math",
        "prompt": [{"role": "user", "content": f"What is {a}*{b}? Use the calculator."}],
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"index": i, "tools_kwargs": {"calculator": {"create_kwargs": {"precision": "exact"}}}}}
        for i, (a, b) in enumerate(rows)]), path)


def agent_train_cmd(tmp_path, problems, tool_format, *overrides, python=None, model_changes=None):
    """(output dir, `verl train` command): the tiny chat model (``model_changes`` to its config), `problems` as
    tool_agent rows, the calculator from verl's tool YAML, the test's tool-call ``tool_format``
    (tests/helpers/forced_tool_calls.py), 3 assistant turns; run by ``python`` (default: this interpreter)."""
    model = save_chat_model(str(tmp_path / "model"), seed=3, **(model_changes or {}))
    write_data(tmp_path / "train.parquet", problems)
    write_data(tmp_path / "val.parquet", [(2, 3), (5, 5)])
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n")
    out = tmp_path / "run"
    cmd = train_cmd(
        "grpo_arith_tiny.yaml", out, [f"data.train_files={tmp_path}/train.parquet",
                                      f"data.val_files={tmp_path}/val.parquet", f"data.tokenizer={model}"],
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.external_lib=tests.helpers.forced_tool_calls",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        f"actor_rollout_ref.rollout.multi_turn.format={tool_format}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", *overrides)
    return out, [python or sys.executable, *cmd[1:]]


def async_agent_cmd(tmp_path, mode, *overrides, micro=4, python=None, model_changes=None):
    """(output dir, command) of the asynchronous trainers' agent tests: verl's V1 ``mode`` over 18 problems whose
    turns end on ~1 token in 8 (``test_random_length_calls``: trajectories finish at different times, so a weight
    sync can cut a turn), batches of 4 prompts x 2 responses, ``micro`` responses per micro-batch. Staleness is
    bounded by the policy, not by timing: ``wait`` with a threshold of 2 versions trains no group older than
    G - P + 1 = 2, so a trajectory's worst staleness is at most 1 however slowly its turns run."""
    return agent_train_cmd(
        tmp_path, [(a, b) for a in range(2, 8) for b in range(3, 6)], "test_random_length_calls",
        "trainer.use_v1=true", f"trainer.v1.trainer_mode={mode}", "trainer.val_before_train=false",
        "trainer.v1.sampler.max_off_policy_strategy=wait", "trainer.v1.sampler.max_off_policy_threshold=2",
        "data.max_prompt_length=48", "data.max_response_length=64", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}", *overrides, python=python,
        model_changes=model_changes)
