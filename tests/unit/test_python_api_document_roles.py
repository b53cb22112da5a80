"""The documents' Python API without a trainer (issue 59): the reward node found by its role
(``output_keys=["scores"]``, one line when ambiguous), a module's ``forward`` as the reward node, a user's rollout
function turned into the rollout fields the PPO step reads, ``HFActor`` / ``HFCritic`` (a path, a PeftModel) as
DataFlow nodes and DataPipeline models."""

import json
import os

import numpy as np
import pytest
import torch
from helpers.chat_models import IM_END, save_chat_model

from verl.errors import InputError


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return save_chat_model(str(tmp_path_factory.mktemp("chat") / "model"))


def test_the_reward_is_the_output_no_later_node_reads():
    from verl import DataFlow
    from verl.protocol import DataProto
    from verl.trainer.api.dataflow import DataFlowReward

    flow = DataFlow().add_node("reward", lambda responses: [1.0 if len(r) > 2 else 0.5 for r in responses],
                               input_keys=["responses"], output_keys=["scores"])
    flow.validate()
    assert flow.reward_key == "scores"
    batch = DataProto.from_dict({"prompts": torch.tensor([[5], [6]]), "responses": torch.tensor([[7, 8, 9], [7, 0, 0]]),
                                 "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                                 "input_ids": torch.tensor([[5, 7, 8, 9], [6, 7, 0, 0]])})

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids if i)

    out = DataFlowReward(flow, Chars())(batch, return_dict=True)
    assert out["reward_tensor"].tolist() == [[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]
    assert out["reward_extra_info"] == {"scores": [1.0, 0.5]}
    # A value read by a later node is not the reward; two unread values are ambiguous unless one is 'reward'.
    chained = (DataFlow().add_node("length", lambda responses: [len(r) for r in responses], input_keys=["responses"],
                                   output_keys=["size"])
               .add_node("judge", lambda size: [s / 10 for s in size], input_keys=["size"], output_keys=["score"]))
    chained.validate()
    assert chained.reward_key == "score"
    two = (DataFlow().add_node("a", len, input_keys=["responses"], output_keys=["size"])
           .add_node("b", len, input_keys=["prompts"], output_keys=["score"]))
    with pytest.raises(InputError) as err:
        two.validate()
    assert str(err.value) == ("dataflow: expected one reward (a node output no later node reads), found 2: 'size' of "
                              "node 'a', 'score' of node 'b'; name the reward's output 'reward' or read the others "
                              "in a later node")
    text = DataFlow().add_node("text", lambda responses: responses, input_keys=["responses"], output_keys=["scores"])
    text.validate()
    with pytest.raises(InputError, match="dataflow node 'text': output key 'scores': expected numbers"):
        text.run({"responses": ["a", "b"]}, 2)


def test_a_modules_forward_over_input_ids_is_a_reward_node():
    from verl import DataFlow

    class RewardModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def forward(self, input_ids):
            assert not torch.is_grad_enabled()  # scored without building a graph
            return self.head((input_ids > 0).sum(-1, keepdim=True).float())

    reward_model = RewardModel()
    torch.nn.init.ones_(reward_model.head.weight)
    torch.nn.init.zeros_(reward_model.head.bias)
    flow = DataFlow().add_node("reward", reward_model.forward, input_keys=["input_ids"])
    flow.validate()
    assert flow.reward_key == "reward" and flow.nodes[1].output_keys == ("reward",)
    values = flow.run({"input_ids": torch.tensor([[0, 3, 4], [5, 6, 7]])}, 2)
    assert values["reward"].tolist() == [2.0, 3.0]


def _prompts(chat_dir, texts):
    from transformers import AutoTokenizer

    from verl.protocol import DataProto

    tok = AutoTokenizer.from_pretrained(chat_dir)
    rows = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    return tok, DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                     "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                                    {"raw_prompt": raw, "uid": np.array(["u0", "u1"], dtype=object)},
                                    {"seed": 3})


def test_a_user_rollout_function_becomes_the_rollout_fields(chat_dir, capsys):
    from verl import DataFlow, register
    from verl.trainer.api.dataflow import DataFlowReward
    from verl.trainer.api.user_rollout import UserRolloutGroup

    seen = []

    @register
    def rollout(prompts):
        seen.append(list(prompts))
        # as model.generate decoded whole: the prompt, then the continuation
        return [p + ("ab" if i % 2 else "abcdefgh") for i, p in enumerate(prompts)]

    flow = (DataFlow().add_node("rollout", rollout, input_keys=["prompts"], output_keys=["responses"])
            .add_node("reward", lambda responses: [float(len(r)) for r in responses], input_keys=["responses"],
                      output_keys=["scores"]))
    flow.enable_debug("full")
    flow.validate()
    assert flow.user_rollout is flow.nodes[0] and flow.reward_key == "scores"
    assert [n.name for n in flow.nodes] == ["rollout", "reward"]  # no engine rollout added
    tok, prompts = _prompts(chat_dir, ["2+2?", "hi"])
    group = UserRolloutGroup(object(), rollout, tok, n=2, response_length=6, node="rollout")
    out = group.generate_sequences(prompts)
    assert seen == [["2+2?", "2+2?", "hi", "hi"]]  # the prompts as written, n times each
    assert group.update_weights() == {}
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert responses.shape == (4, 6) and "rollout_log_probs" not in out.batch.keys()
    assert [tok.decode(r[m.bool()].tolist()) for r, m in zip(responses, mask, strict=True)] == \
        ["abcdef", "ab<|im_end|>", "abcdef", "ab<|im_end|>"]  # cut at 6 tokens; eos after a text that fits
    assert responses[1, 2] == IM_END and mask.sum(-1).tolist() == [6, 3, 6, 3]
    assert torch.equal(out.batch["input_ids"], torch.cat([prompts.batch["input_ids"].repeat_interleave(2, 0),
                                                          responses], 1))
    assert out.batch["attention_mask"][:, -6:].tolist() == mask.tolist()
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1"] and out.meta_info["metrics"] == {}
    # The reward scores the responses as trained (tokenized); the debug output shows what the function saw.
    scored = DataFlowReward(flow, tok)(out, return_dict=True)
    assert scored["reward_extra_info"]["scores"] == [6.0, 2.0, 6.0, 2.0]
    printed = capsys.readouterr().out
    assert "[dataflow] rollout: inputs {'prompts': ['2+2?', '2+2?', 'hi', 'hi']} -> outputs {'responses': " \
           "['2+2?abcdefgh', '2+2?ab', 'hiabcdefgh', 'hiab']}" in printed
    bad = UserRolloutGroup(object(), lambda texts: ["x"], tok, n=2, response_length=6, node="rollout")
    with pytest.raises(InputError, match=r"^dataflow node 'rollout': expected 4 response texts \(one str per prompt "
                                         r"it was given\), found 1 values of \['str'\]$"):
        bad.generate_sequences(prompts)


def test_hf_actor_and_critic_name_a_model_a_peft_adapter_or_fail_in_one_line(chat_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from verl import DataFlow, DataPipeline, TrainerConfig
    from verl.models import HFActor, HFCritic

    actor, critic = HFActor.from_pretrained(chat_dir), HFCritic.from_pretrained(chat_dir)
    assert (actor.path, actor.tokenizer_path, actor.lora, critic.role) == (chat_dir, chat_dir, None, "critic")
    with pytest.raises(InputError, match=r"^HFActor.from_pretrained: expected an HF model directory \(config.json\) "
                                         r"or a config.json, found nothing at .*nowhere$"):
        HFActor.from_pretrained(str(tmp_path / "nowhere"))
    with pytest.raises(InputError, match="expected a model directory, a PeftModel or a transformers model, found int"):
        HFCritic.from_pretrained(3)

    base = AutoModelForCausalLM.from_pretrained(chat_dir)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(base, lora).save_pretrained(str(tmp_path / "adapter"))
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_dir),
                                                str(tmp_path / "adapter"))
    tuned = HFActor.from_pretrained(peft_model)
    assert tuned.path == chat_dir and tuned.strategy is None  # the engine table picks it when the trainer is built
    assert {k: v for k, v in tuned.lora.items() if k != "lora_adapter_path"} == \
        {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    written = json.load(open(os.path.join(tuned.lora["lora_adapter_path"], "adapter_config.json")))
    assert written["r"] == 4

    # As DataFlow nodes: the trainer's model, LoRA keys and strategy; a critic makes it PPO with GAE.
    flow = (DataFlow().add_node("actor", tuned).add_node("critic", critic)
            .add_node("reward", lambda responses: [1.0] * len(responses), input_keys=["responses"]))
    config = flow.build_trainer(config=TrainerConfig(num_epochs=1, batch_size=4, learning_rate=1e-6)).config
    tree = config.verl_config(world_size=1)
    assert tree["actor_rollout_ref"]["model"]["path"] == chat_dir and tree["data"]["tokenizer"] == chat_dir
    assert tree["actor_rollout_ref"]["model"]["lora_rank"] == 4 and tree["model_engine"] == "dp"
    assert tree["algorithm"]["adv_estimator"] == "gae" and tree["critic"]["model"]["path"] == chat_dir
    on_megatron = HFActor.from_pretrained(peft_model, strategy="megatron")
    with pytest.raises(InputError, match=r"strategy='megatron': expected one of \['fsdp', 'fsdp2'\]"):
        (DataFlow().add_node("actor", on_megatron)
         .add_node("reward", lambda responses: [1.0] * len(responses), input_keys=["responses"])
         .build_trainer(config=TrainerConfig(num_epochs=1, batch_size=4, learning_rate=1e-6)))
    with pytest.raises(InputError, match="dataflow node 'again': expected one HFActor, found a second"):
        flow.add_node("again", actor)
    tuned_critic = HFCritic.from_pretrained(peft_model)  # the critic's adapter: verl's critic.model LoRA keys
    flow = (DataFlow().add_node("critic", tuned_critic)
            .add_node("reward", lambda responses: [1.0] * len(responses), input_keys=["responses"]))
    config = flow.build_trainer(config=TrainerConfig(model=chat_dir, tokenizer=chat_dir)).config
    assert config.critic == chat_dir and config.overrides["critic.model.lora_rank"] == 4
    assert config.overrides["critic.model.lora_adapter_path"] == tuned_critic.lora["lora_adapter_path"]

    # As DataPipeline models, with a module as the reward model and transformers' max_length.
    class LengthReward(torch.nn.Module):
        def forward(self, input_ids):
            return (input_ids > 0).sum(-1).float()

    pipeline = DataPipeline(actors=[tuned], reward_models=[LengthReward()], critics=[critic],
                            rollout_config={"max_length": 96}, train_config={"num_epochs": 2})
    cfg = pipeline.trainer_config
    assert (cfg.model, cfg.critic, cfg.algorithm, cfg.num_epochs, cfg.max_response_length) == \
        (chat_dir, chat_dir, "gae", 2, 96 - 64)
    assert cfg.overrides["actor_rollout_ref.model.lora_rank"] == 4
    assert pipeline.dataflow.nodes[1].input_keys == ("input_ids",)
    assert pipeline.dataflow.run({"input_ids": torch.tensor([[0, 1, 2]])}, 1)["reward"].tolist() == [2.0]
    with pytest.raises(InputError, match=r"^rollout_config: expected max_length \(prompt \+ response\) above "
                                         r"max_prompt_length, without max_response_length, found max_length=32 <= "
                                         r"max_prompt_length=64$"):
        DataPipeline(actors=[actor], rollout_config={"max_length": 32})
