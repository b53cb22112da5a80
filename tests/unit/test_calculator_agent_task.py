"""The agentic job's task and config (issue 46 item 6): `verl data calculator-problems` rows for tool_agent, their
answers the calculator's, the SFT demonstrations replayed through the real tool_agent loop token for token (the
warm-up teaches exactly the text the loop feeds and parses), the job's config and tool YAML accepted by `verl
train`'s checks, and the validation's val-aux/{num_turns,tool_call_counts} metrics."""

import json
import os
import re

import pyarrow.parquet as pq
import pytest
from helpers.chat_models import save_chat_model, save_chat_tokenizer

from verl.experimental.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.scripted import ScriptedServerManager
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.calculator import CalculatorTool, evaluate
from verl.trainer.ppo.validation import agent_val_metrics
from verl.utils.dataset import calculator_problems as cp
from verl.utils.dataset.rl_dataset import render_prompt
from verl.utils.reward_score import default_compute_score

pytestmark = pytest.mark.unit
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SmolLM2-135M-Instruct's chat template (.cache/smollm2-135m-instruct/chat_template.jinja): tool turns are ChatML
# turns of role "tool", assistant turns their content only.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def read(path):
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("calc") / "data"
    assert cp.main(["--out", str(out), "--num-train", "40", "--num-test", "8", "--num-sft", "6",
                    "--num-sft-test", "2", "--seed", "3"]) == 0
    return out


def test_rows_are_tool_agent_problems_the_calculator_answers(data):
    train, test = read(data / "train.parquet"), read(data / "test.parquet")
    sft = read(data / "sft_train.parquet")
    assert (len(train), len(test), len(sft)) == (40, 8, 12)
    questions = [r["extra_info"]["question"] for r in train + test]
    assert len(set(questions)) == 48
    for row in train + test:
        assert row["agent_name"] == "tool_agent" and row["data_source"] == cp.DATA_SOURCE
        system, user = row["prompt"]
        assert system == {"role": "system", "content": cp.SYSTEM_PROMPT} and user["role"] == "user"
        assert user["content"].endswith('End with "The answer is N."')
        expression, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
        # the calculator's exact value is the ground truth, and the operands are too big for mental arithmetic
        assert evaluate(expression) == int(truth) and min(int(x) for x in re.findall(r"\d+", expression)) >= 12
        assert all(n in user["content"] for n in re.findall(r"\d+", expression))
        assert default_compute_score(row["data_source"], f"The answer is {truth}.", truth) == 1.0
        assert default_compute_score(row["data_source"], f"The answer is {int(truth) + 1}.", truth) == 0.0
    # demonstrations on other questions; --sft-templates restricts them (here to the one-operation templates)
    demo_questions = {r["prompt"][1]["content"] for r in sft}
    assert not demo_questions & {r["prompt"][1]["content"] for r in train + test}
    one_op = data.parent / "one_op"
    assert cp.main(["--out", str(one_op), "--num-train", "40", "--num-test", "8", "--num-sft", "6",
                    "--num-sft-test", "2", "--seed", "3", "--sft-templates",
                    ",".join(map(str, cp.ONE_OPERATION_TEMPLATES))]) == 0
    assert read(one_op / "train.parquet") == train  # the RL splits do not depend on the demonstrations
    calls = [json.loads(r["response"][len("<tool_call>"):-len("</tool_call>")])
             for r in read(one_op / "sft_train.parquet")[::2]]
    assert all(re.fullmatch(r"\d+ [-+*/] \d+", c["arguments"]["expression"]) for c in calls)
    with pytest.raises(cp.DatasetError, match="--sft-templates: expected comma-separated template indices"):
        cp.main(["--out", str(data), "--sft-templates", "9"])


def test_held_out_problems_are_held_out_by_computation():
    # One-operation templates and many training problems: splits disjoint only by question text shared 6 expressions
    # between the held-out and the training splits here (another name or item, the same numbers and operation).
    splits = cp.generate_problems([300, 6000, 100, 2000], 1, [cp.ONE_OPERATION_TEMPLATES] * 4,
                                  held_out=[True, False, True, False])
    assert [len(s) for s in splits] == [300, 6000, 100, 2000]
    test, train, sft_test, sft = ({expression for _, expression, _ in split} for split in splits)
    assert not (test | sft_test) & (train | sft)
    assert len({q for split in splits for q, _, _ in split}) == 8400  # and no question twice


def test_demonstrations_are_what_the_tool_agent_loop_feeds_and_parses(data, tmp_path):
    tok_dir = save_chat_tokenizer(str(tmp_path / "tok"), SMOLLM2_TEMPLATE)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    sft = read(data / "sft_train.parquet")
    first, second = sft[0], sft[1]
    # the model says exactly the demonstrated turns (and stops with <|im_end|>)
    server = ScriptedServerManager(tok, [first["response"] + "<|im_end|>", second["response"] + "<|im_end|>"])
    config = {"actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 512, "multi_turn": {
        "format": "hermes", "max_assistant_turns": 3, "max_parallel_calls": 1, "max_tool_response_length": 64}}}}
    loop = ToolAgentLoop(trainer_config=DictConfigWrap(config), server_manager=server, tokenizer=tok,
                         processor=None, dataset_cls=None, data_config=DictConfigWrap({}),
                         tools=ToolListWrap([CalculatorTool(config={"type": "native"}, tool_schema=None)]))
    import asyncio
    out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=first["prompt"]))
    # each engine call's prompt is the rendered SFT prompt of that turn: the warm-up trains on the loop's text
    prompts = [tok.decode(ids, skip_special_tokens=False) for _, ids, _ in server.calls]
    assert prompts == [render_prompt(first["prompt"], tok), render_prompt(second["prompt"], tok)]
    # the calculator ran on the demonstrated call and answered what the demonstration's tool turn says
    assert second["prompt"][-1] == {"role": "tool", "content": second["response"][len("The answer is "):-1]}
    assert out.num_turns == 4 and out.extra_fields["tool_call_counts"] == 1
    assert out.extra_fields["tool_call_errors"] == 0
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    truth = second["response"][len("The answer is "):-1]
    assert default_compute_score(cp.DATA_SOURCE, text, truth) == 1.0
    # the model's two turns are trained, the tool's turn is not
    masked = "".join(tok.decode([t]) for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0)
    assert masked == f"\n<|im_start|>tool\n{truth}<|im_end|>\n<|im_start|>assistant\n"


def test_job_config_and_tool_yaml_pass_verl_train_checks(data, tmp_path):
    from verl.trainer.config.ppo import load_config
    model = save_chat_model(str(tmp_path / "model"))
    cfg = load_config(os.path.join(REPO, "configs", "agent_smollm2_calculator.yaml"), [
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=48"])  # the tiny model: 128 positions
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.format == "hermes" and mt.tool_config_path.endswith("configs/tools/calculator.yaml")
    from verl.tools.tool_registry import load_all_tools
    assert [t.name for t in load_all_tools(mt.tool_config_path, None)] == ["calculator"]


def test_validation_logs_verl_turn_and_tool_metrics():
    batches = [(64, {"num_turns/mean": 4.0, "num_turns/min": 2.0, "num_turns/max": 4.0,
                     "tool_call_counts/mean": 1.0, "tool_call_counts/min": 0.0, "tool_call_counts/max": 1.0,
                     "tool_call_errors/mean": 0.0, "tool_call_errors/min": 0.0, "tool_call_errors/max": 0.0}),
               # as a worker group gathers them: one value per DP replica
               (32, {"num_turns/mean": [2.0, 3.0], "num_turns/min": [2.0, 3.0], "num_turns/max": [6.0, 4.0],
                     "tool_call_counts/mean": 0.25, "tool_call_counts/min": 0.0, "tool_call_counts/max": 2.0,
                     "tool_call_errors/mean": 0.5, "tool_call_errors/min": 0.0, "tool_call_errors/max": 1.0})]
    m = agent_val_metrics(batches)
    assert m["val-aux/num_turns/mean"] == pytest.approx(3.5) and m["val-aux/num_turns/max"] == 6.0
    assert m["val-aux/tool_call_counts/mean"] == pytest.approx(0.75) and m["val-aux/tool_call_counts/min"] == 0.0
    assert m["val-aux/tool_call_errors/mean"] == pytest.approx(1 / 6)
    assert agent_val_metrics([(8, {"timing_s/generate_sequences": 1.0})]) == {}  # single-turn rollouts: none
