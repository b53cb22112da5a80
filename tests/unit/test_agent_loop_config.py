"""``rollout.multi_turn`` / ``rollout.agent`` (issue 46): verl's keys load, and a tool YAML that does not load, a
tool schema that does not parse, an unknown agent name (the default or a data row's) or tool-call format is one
line and exit 2 before any rank starts; the dataset hands the agent loops verl's ``raw_prompt``, ``agent_name``
and ``tools_kwargs``."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.tiny_models import write_arithmetic_data

from verl.trainer import main_ppo
from verl.trainer.config import load_config

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "configs", "grpo_arith_tiny.yaml")
MT = "actor_rollout_ref.rollout.multi_turn"
CALCULATOR = "tools:\n  - class_name: verl.tools.calculator.CalculatorTool\n    config: {type: native}\n"


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


@pytest.fixture
def no_ranks(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("verl.launcher.spawn.spawn_local", lambda *a, **k: pytest.fail("a rank was spawned"))
    monkeypatch.setattr(main_ppo, "run_rank", lambda *a, **k: pytest.fail("a rank was started"))


def exit_2(capsys, argv, *fragments):
    assert main_ppo.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_keys_load_and_bad_input_is_one_line(tmp_path, data_args, no_ranks, capsys):
    tools = tmp_path / "tools.yaml"
    tools.write_text(CALCULATOR)
    cfg = load_config(GRPO, [*data_args, f"{MT}.enable=true", f"{MT}.tool_config_path={tools}",
                             f"{MT}.max_assistant_turns=4",
                             "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])
    rollout = cfg.actor_rollout_ref.rollout
    mt = rollout.multi_turn
    assert (mt.max_assistant_turns, mt.format, rollout.agent.num_workers) == (4, "hermes", 8)
    from verl.workers.config.rollout import RolloutConfig
    typed = RolloutConfig.from_tree(rollout, "actor_rollout_ref.rollout")
    assert typed.multi_turn.tool_config_path == str(tools) and typed.agent.default_agent_loop == "tool_agent"

    base = ["--config", GRPO, *data_args, f"{MT}.enable=true"]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("tools: [\n")
    exit_2(capsys, [*base, f"{MT}.tool_config_path={bad_yaml}"], "bad.yaml")
    bad_schema = tmp_path / "schema.yaml"
    bad_schema.write_text(CALCULATOR + "    tool_schema: {type: function, function: {description: 3}}\n")
    exit_2(capsys, [*base, f"{MT}.tool_config_path={bad_schema}"], "schema.yaml")
    exit_2(capsys, [*base, "actor_rollout_ref.rollout.agent.default_agent_loop=react"], "'react'",
           "not a registered agent loop")
    exit_2(capsys, [*base, f"{MT}.format=xml"], f"{MT}.format='xml'", "hermes")
    exit_2(capsys, [*base, f"{MT}.tool_response_truncate_side=top"], "tool_response_truncate_side")
    exit_2(capsys, [*base, "actor_rollout_ref.rollout.agent.agent_loop_config_path=/nonexistent/loops.yaml"],
           "agent_loop_config_path")

    # A data row naming an agent loop nobody registered.
    rows = pq.read_table(data_args[0].split("=", 1)[1]).to_pylist()
    rows = [dict(row, agent_name="tool_agent" if i else "my_agent") for i, row in enumerate(rows)]
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    exit_2(capsys, [*base, f"data.train_files={train}"], "'my_agent'", "not a registered agent loop")


def test_dataset_rows_carry_raw_prompt_agent_name_and_tools_kwargs(tmp_path):
    from helpers.chat_models import save_chat_tokenizer
    from transformers import AutoTokenizer

    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    tok = AutoTokenizer.from_pretrained(save_chat_tokenizer(str(tmp_path / "tok")))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "6*7?"}]
    rows = [{"data_source": "arithmetic", "prompt": messages, "agent_name": "tool_agent",
             "reward_model": {"ground_truth": "42"},
             "extra_info": {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"x": 1}}}}},
            {"data_source": "arithmetic", "prompt": messages, "agent_name": None,
             "reward_model": {"ground_truth": "42"}, "extra_info": {"index": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = RLHFDataset(str(tmp_path / "d.parquet"), tok, {"max_prompt_length": 64})
    batch = collate_fn([ds[0], ds[1]])
    assert list(batch["raw_prompt"][0]) == messages
    assert list(batch["agent_name"]) == ["tool_agent", None]
    assert batch["tools_kwargs"][0] == {"calculator": {"create_kwargs": {"x": 1}}} and batch["tools_kwargs"][1] == {}


def test_async_agent_loops_need_an_engine_whose_turns_report_their_weights_version(data_args, no_ranks, capsys):
    """Both built-in engines report each turn's version; an engine registered without ``agent_loop_async`` runs
    agent loops under the sync trainer only, refused in one line under either asynchronous mode."""
    import dataclasses

    from verl.engine.rollout.registry import RolloutEngine, register_rollout, rollout_engine, unregister_rollout

    native = rollout_engine("native")
    caps = dataclasses.replace(native.capabilities, agent_loop_async=False)
    register_rollout(RolloutEngine("turns_unversioned", caps, build=native.build,
                                   open_standalone=native.open_standalone,
                                   lacks={"agent_loop_async": "a test engine"}))
    try:
        base = ["--config", GRPO, *data_args, f"{MT}.enable=true", "actor_rollout_ref.rollout.name=turns_unversioned",
                "trainer.use_v1=true"]
        load_config(GRPO, [*data_args, f"{MT}.enable=true", "actor_rollout_ref.rollout.name=turns_unversioned"])
        exit_2(capsys, [*base, "trainer.v1.trainer_mode=colocate_async"], "agent_loop_async",
               "trainer.v1.trainer_mode=colocate_async", "a test engine")
        exit_2(capsys, [*base, "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1",
                        "actor_rollout_ref.rollout.n_gpus_per_node=1"], "agent_loop_async", "separate_async")
    finally:
        unregister_rollout("turns_unversioned")
    for engine in ("native", "sglang"):
        assert rollout_engine(engine).capabilities.agent_loop_async
