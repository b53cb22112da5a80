"""The Python API's surface without a trainer (issue 48): lazy names on ``verl``, ``register`` for dataflow nodes and
worker methods, the dataflow's key checks (one error naming the node and key) and its reward placement."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from verl.errors import InputError


def test_import_verl_stays_light_and_exports_the_api():
    code = ("import sys, verl; light = 'verl.api' not in sys.modules and 'torch' not in sys.modules; "
            "from verl import DataFlow, DataProto, HybridActor, TrainerConfig, register; "
            "import verl.api, verl.protocol; "
            "print(light, DataFlow is verl.api.DataFlow, HybridActor is verl.api.HybridActor, "
            "DataProto is verl.protocol.DataProto)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True"] * 4


def test_aliases_are_the_trainer_and_the_dataset():
    from verl.data.rlhf_dataset import RLHFDataset
    from verl.trainer.ppo import PPOTrainer
    from verl.trainer.ppo.trainer import PPOTrainer as Real
    from verl.trainer.ppo_trainer import PPOTrainer as Alias
    from verl.utils.dataset.rl_dataset import RLHFDataset as RealDataset

    assert PPOTrainer is Real is Alias and RLHFDataset is RealDataset


def test_register_marks_nodes_and_still_decorates_worker_methods():
    from verl import register
    from verl.single_controller.decorator import MAGIC_ATTR, Dispatch, registered_methods

    @register
    def score(responses):
        return [1.0] * len(responses)

    @register(input_keys=["responses"], output_keys=["reward"])
    def keyed(responses):
        return [0.0] * len(responses)

    class W:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def a(self):
            return 1

        @register(Dispatch.RANK_ZERO)
        def b(self):
            return 2

    assert score(["x"]) == [1.0] and not hasattr(score, MAGIC_ATTR)
    specs = registered_methods(W)
    assert specs["a"].dispatch is not None and specs["a"] != specs["b"]
    assert W().a() == 1

    from verl import DataFlow

    flow = DataFlow().add_node(keyed)
    flow.validate()
    assert [n.name for n in flow.nodes] == ["rollout", "keyed"]
    assert flow.nodes[1].input_keys == ("responses",)


def test_a_missing_key_names_the_node_and_key_before_training():
    from verl import DataFlow

    flow = DataFlow().add_node("judge", lambda scores: scores, input_keys=["scores"], output_keys=["reward"])
    with pytest.raises(InputError, match="dataflow node 'judge': input key 'scores'"):
        flow.build_trainer()
    with pytest.raises(InputError, match="expected a node after the rollout whose output .* is the reward, found "
                                         "none"):
        DataFlow().add_node("r", "rollout", output_keys=["responses"]).validate()
    with pytest.raises(InputError, match="dataflow node 'r': output key 'nope'"):
        DataFlow().add_node("r", "rollout", output_keys=["nope"])


def test_wrong_length_or_type_names_the_node_and_key_at_the_first_step():
    from verl import DataFlow

    values = {"responses": ["a", "bb", "ccc"]}
    short = DataFlow().add_node("short", lambda responses: [1.0], input_keys=["responses"], output_keys=["reward"])
    short.validate()
    with pytest.raises(InputError, match="dataflow node 'short': output key 'reward': expected 3 values"):
        short.run(dict(values), 3)
    text = DataFlow().add_node("text", lambda responses: responses, input_keys=["responses"], output_keys=["reward"])
    text.validate()
    with pytest.raises(InputError, match="dataflow node 'text': output key 'reward': expected numbers"):
        text.run(dict(values), 3)
    scalar = DataFlow().add_node("one", lambda responses: 1.0, input_keys=["responses"], output_keys=["reward"])
    scalar.validate()
    with pytest.raises(InputError, match="dataflow node 'one': output key 'reward': expected a list or a tensor"):
        scalar.run(dict(values), 3)


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 1) for i in ids if i > 0)


def test_the_reward_lands_on_each_responses_last_token_and_debug_prints_values(capsys):
    from verl import DataFlow, DataProto
    from verl.trainer.api.dataflow import DataFlowReward

    class Length(torch.nn.Module):
        def forward(self, input_ids):
            return (input_ids > 0).sum(-1, keepdim=True).float()

    flow = (DataFlow().add_node("length", Length(), input_keys=["input_ids"], output_keys=["tokens"])
            .add_node("reward", lambda responses, tokens: np.array([len(r) for r in responses]) + tokens.numpy(),
                      input_keys=["responses", "tokens"], output_keys=["reward"]))
    flow.enable_debug("full")
    flow.validate()
    prompts = torch.tensor([[0, 1], [2, 3]])
    responses = torch.tensor([[4, 5, 0], [6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    batch = DataProto.from_dict({"prompts": prompts, "responses": responses, "attention_mask": mask,
                                 "input_ids": torch.cat([prompts, responses], 1)},
                                {"reward_model": np.array([{"ground_truth": "x"}, {"ground_truth": "y"}],
                                                          dtype=object)})
    out = DataFlowReward(flow, _CharTokenizer())(batch, return_dict=True)
    scores = out["reward_tensor"]
    # "de" (2 chars) + 3 prompt/response tokens; "f" (1 char) + 3 tokens.
    assert scores.tolist() == [[0.0, 5.0, 0.0], [4.0, 0.0, 0.0]]
    assert out["reward_extra_info"]["reward"] == [5.0, 4.0]
    printed = capsys.readouterr().out
    expected = ("[dataflow] reward: inputs {'responses': ['de', 'f'], 'tokens': [3.0, 3.0]} -> outputs "
                "{'reward': [5.0, 4.0]}")
    assert expected in printed
    with pytest.raises(InputError, match="enable_debug"):
        flow.enable_debug("verbose")
