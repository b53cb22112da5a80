"""Reward models with their own tokenizer (issue 47, items 0, 1, 5): the plan read from a checkpoint directory, the
re-encoding of the actor's prompt + response (chat template, text pair, left truncation), transformers' replicated
forward of encoder RMs against transformers' own score, verl 0.9's reward.reward_model keys, and the one-line
refusals of bad RM paths and tokenizers before any rank starts."""

import os
import subprocess
import sys

import pytest
import torch
from helpers.reward_models import ENCODERS, hf_score, save_reward_model, save_rm_tokenizer
from helpers.tiny_models import write_arithmetic_data

from verl.trainer.config import ConfigError, load_config
from verl.workers.reward_model.plan import load_tokenizer, plan_reward_model
from verl.workers.reward_model.replicated import ReplicatedRewardModel
from verl.workers.reward_model.retokenize import Retokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO = os.path.join(REPO, "configs", "ppo_arith_tiny.yaml")
PROMPTS = ["12+3=", "7*8=", "(100-1)/9="]
RESPONSES = ["15", "56", ""]  # the last: an empty response (its row gets no score)
PROMPT_LEN, RESPONSE_LEN = 12, 4


@pytest.fixture(scope="module")
def data_args(tmp_path_factory):
    return write_arithmetic_data(tmp_path_factory.mktemp("arith"), 80, 8)


def actor_batch(tokenizer):
    """The actor's layout: prompts left-padded to PROMPT_LEN, responses (+ eos) right-padded to RESPONSE_LEN."""
    rows = len(PROMPTS)
    ids = torch.full((rows, PROMPT_LEN + RESPONSE_LEN), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(r, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if r else [])
        ids[i, PROMPT_LEN - len(p_ids):PROMPT_LEN] = torch.tensor(p_ids)
        mask[i, PROMPT_LEN - len(p_ids):PROMPT_LEN] = 1
        if r_ids:
            ids[i, PROMPT_LEN:PROMPT_LEN + len(r_ids)] = torch.tensor(r_ids)
            mask[i, PROMPT_LEN:PROMPT_LEN + len(r_ids)] = 1
    return ids, mask


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    return {family: (str(root / family), save_reward_model(str(root / family), family, seed=3))
            for family in ("llama", "deberta-v2", "bert")}


def test_plan_reads_engine_and_template_from_the_checkpoint(models, data_args):
    actor_tok = data_args[-1].split("=", 1)[1]
    llama = plan_reward_model(models["llama"][0], None, actor_tokenizer=actor_tok)
    assert (llama.engine, llama.retokenize, llama.template) == ("training", True, "chat")  # other vocabulary
    for family in ENCODERS:
        plan = plan_reward_model(models[family][0], None)
        assert (plan.engine, plan.retokenize, plan.template) == ("replicated", True, "pair")


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_encoder_rm_scores_equal_transformers_own_forward(models, data_args, family):
    path, model = models[family]
    actor_tok = load_tokenizer(data_args[-1].split("=", 1)[1], "data.tokenizer")
    rm_tok = load_tokenizer(path, "rm")
    ids, mask = actor_batch(actor_tok)
    batch, truncated = Retokenizer(actor_tok, rm_tok, "pair", None).encode(ids, mask, RESPONSE_LEN)
    scores = ReplicatedRewardModel(path, micro_batch_size=2).score(batch)
    expected = [hf_score(model, rm_tok, p, r, family) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert not truncated.any()


def test_left_truncation_cuts_the_prompts_start_and_is_counted(models, data_args):
    actor_tok = load_tokenizer(data_args[-1].split("=", 1)[1], "data.tokenizer")
    ids, mask = actor_batch(actor_tok)
    path, model = models["bert"]
    rm_tok = load_tokenizer(path, "rm")
    batch, truncated = Retokenizer(actor_tok, rm_tok, "pair", 8).encode(ids, mask, RESPONSE_LEN)
    # [CLS] p [SEP] r [SEP]: "12+3=" + "15" = 10 > 8, "7*8=" + "56" = 9 > 8, "(100-1)/9=" + "" = 13 > 8
    assert truncated.tolist() == [True, True, True]
    assert batch["attention_mask"].sum(1).tolist() == [8, 8, 8]
    scores = ReplicatedRewardModel(path).score(batch)
    expected = [hf_score(model, rm_tok, p, r, "bert", max_length=8) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    # Chat template: the sequence keeps its last max_length tokens (the response and the prompt's end).
    llama_tok = load_tokenizer(models["llama"][0], "rm")
    chat, cut = Retokenizer(actor_tok, llama_tok, "chat", 12).encode(ids, mask, RESPONSE_LEN)
    full = [llama_tok(f"<|user|>{p}<|end|><|assistant|>{r}<|end|>", add_special_tokens=False)["input_ids"]
            for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert cut.tolist() == [len(f) > 12 for f in full]
    for row, f in enumerate(full):
        n = int(chat["attention_mask"][row].sum())
        assert chat["input_ids"][row, :n].tolist() == f[-12:]


def test_dataset_chat_messages_are_used_when_the_batch_carries_them(models, data_args):
    actor_tok = load_tokenizer(data_args[-1].split("=", 1)[1], "data.tokenizer")
    rm_tok = load_tokenizer(models["llama"][0], "rm")
    ids, mask = actor_batch(actor_tok)
    raw = [[{"role": "user", "content": "be brief"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": p}] for p in PROMPTS]
    batch, _ = Retokenizer(actor_tok, rm_tok, "chat", None).encode(ids, mask, RESPONSE_LEN, raw_prompts=raw)
    text = rm_tok.decode(batch["input_ids"][0, :int(batch["attention_mask"][0].sum())])
    assert text == "<|user|>be brief<|end|><|assistant|>ok<|end|><|user|>12+3=<|end|><|assistant|>15<|end|>"


def test_verl_09_reward_keys_mean_the_legacy_keys(models, data_args):
    cfg = load_config(PPO, [*data_args, "reward.reward_model.enable=true",
                             f"reward.reward_model.model_path={models['bert'][0]}",
                             "reward_model.micro_batch_size_per_gpu=2"])
    assert cfg.reward_model.enable and cfg.reward_model.model.path == models["bert"][0]
    # The check fills the actor's tokenizer in (verl's switch) for an RM with its own tokenizer.
    assert cfg.reward_model.model.input_tokenizer == cfg.data.tokenizer
    with pytest.raises(ConfigError, match="reward.reward_model.enable: expected the value of reward_model.enable"):
        load_config(None, [*data_args, "reward.reward_model.enable=false", "reward_model.enable=true"],
                    resolve_only=True)
    with pytest.raises(ConfigError, match="reward.sandbox_fusion.url: expected null .* found 'http://x'"):
        load_config(PPO, [*data_args, "reward.sandbox_fusion.url=http://x"])
    with pytest.raises(ConfigError, match="reward.reward_model.enable_resource_pool: expected false"):
        load_config(PPO, [*data_args, "reward.reward_model.enable_resource_pool=true"])
    with pytest.raises(ConfigError, match="reward.sandbox_fusion.nope: unknown key"):
        load_config(None, [*data_args, "reward.sandbox_fusion.nope=1"], resolve_only=True)


def test_verl_09_reward_function_and_manager_keys(data_args, tmp_path):
    from verl.trainer.config.sections import PPOSections
    from verl.workers.reward_manager import reward_manager_cls

    (tmp_path / "score.py").write_text("def my_score(**kw):\n    return 1.0\n")
    (tmp_path / "manager.py").write_text("class Mine:\n    def __init__(self, tokenizer, **kw):\n        pass\n"
                                         "    def __call__(self, data, return_dict=False):\n        return None\n")
    cfg = load_config(PPO, [*data_args, f"reward.custom_reward_function.path={tmp_path / 'score.py'}",
                             "reward.custom_reward_function.name=my_score", "reward.reward_manager.source=importlib",
                             f"reward.reward_manager.module.path={tmp_path / 'manager.py'}",
                             "reward.reward_manager.module.name=Mine"])
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == (str(tmp_path / "score.py"),
                                                                                  "my_score")
    assert reward_manager_cls(PPOSections.from_tree(cfg, "")).__name__ == "Mine"
    with pytest.raises(ConfigError, match="reward.reward_manager.module.name: expected a reward manager class "
                                          "'Other'"):
        load_config(PPO, [*data_args, "reward.reward_manager.source=importlib",
                           f"reward.reward_manager.module.path={tmp_path / 'manager.py'}",
                           "reward.reward_manager.module.name=Other"])
    with pytest.raises(ConfigError, match="reward.custom_reward_function.name: expected the value of "
                                          "custom_reward_function.name"):
        load_config(PPO, [*data_args, "reward.custom_reward_function.name=a", "custom_reward_function.name=b"])


@pytest.fixture(scope="module")
def bad_rms(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_rms")
    save_reward_model(str(root / "two_labels"), "qwen2", num_labels=2)
    save_reward_model(str(root / "no_template"), "llama", chat_template=None)
    from transformers import AutoModelForCausalLM, LlamaConfig

    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        str(root / "causal_lm"))
    save_rm_tokenizer(str(root / "causal_lm"))
    return root


@pytest.mark.parametrize("name, message", [
    ("two_labels", "reward_model.model.path: expected a single-score classifier (num_labels=1), found "
                   "Qwen2ForSequenceClassification with num_labels=2"),
    ("causal_lm", "reward_model.model.path: expected a single-score classifier (*ForSequenceClassification, "
                  "num_labels=1), found LlamaForCausalLM"),
    ("no_template", "reward_model.model.path: expected a chat template in the reward model's tokenizer"),
    ("missing", "reward_model.model.path: expected an HF reward model directory"),
])
def test_bad_reward_model_is_one_line_before_any_rank_starts(bad_rms, data_args, name, message):
    overrides = [*data_args, "reward_model.enable=true", f"reward_model.model.path={bad_rms / name}",
                 "reward_model.micro_batch_size_per_gpu=2"]
    with pytest.raises(ConfigError) as err:
        load_config(PPO, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_bad_reward_model_exits_2_from_verl_train(bad_rms, data_args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "train", "--config", PPO, *data_args,
                           "reward_model.enable=true",
                           f"reward_model.model.path={bad_rms / 'two_labels'}",
                           f"trainer.default_local_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "num_labels=2" in proc.stderr and not (tmp_path / "out").exists()
