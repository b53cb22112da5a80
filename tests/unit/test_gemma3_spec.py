"""Gemma 3 as one spec entry (issue 58): its config read into block fields, bad configs refused in one line, Megatron's
builder taking every field (an MoE model with them refused), and the rollouts that lack some (vLLM here; SGLang past
the fields it was checked on) refusing them at config time, in one line naming the spec fields they lack. No engine
names the family."""

import json
import os

import pytest

from verl.errors import InputError
from verl.models.config import ModelConfig, ModelConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEMMA3 = dict(model_type="gemma3_text", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None, final_logit_softcapping=None,
              rms_norm_eps=1e-6, tie_word_embeddings=True)
FEATURES = ["hidden_act", "norm_weight_offset", "norm_scale_in_float32", "embedding_multiplier", "sliding_rope_theta",
            "sliding_window", "sliding_layers", "attn_post_norm", "mlp_post_norm"]


def _config(**over):
    return ModelConfig.from_dict({**GEMMA3, **over})


def test_the_block_is_config_data():
    c = _config()
    assert (c.sliding_layers, c.sliding_window, c.layer_window(0), c.layer_window(2)) == ((0, 1), 8, 8, 0)
    assert (c.layer_rope_theta(0), c.layer_rope_theta(2)) == ((1e4, None), (1e6, None))
    assert (c.head_dim, c.q_size, c.attention_scale, c.embedding_multiplier) == (32, 128, 32 ** -0.5, 8.0)
    assert list(c.block_features()) == FEATURES
    llama = ModelConfig.from_dict({**GEMMA3, "model_type": "llama"})
    assert llama.block_features() == () and llama.hidden_act == "silu" and llama.sliding_layers == ()
    from verl.models.spec.registry import model_spec

    layer = model_spec("gemma3_text").rollout_layer(c, 0)
    assert layer["attn_post_norm"] == "model.layers.0.post_attention_layernorm.weight"
    assert layer["mlp_norm"] == "model.layers.0.pre_feedforward_layernorm.weight"
    assert layer["mlp_post_norm"] == "model.layers.0.post_feedforward_layernorm.weight"


@pytest.mark.parametrize("over, key", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_activation="relu"), "hidden_act"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters.sliding_attention"),
])
def test_a_config_the_engines_cannot_compute_is_refused_in_one_line(over, key):
    with pytest.raises(ModelConfigError) as err:
        _config(**over)
    assert isinstance(err.value, InputError) and str(err.value).startswith(key) and "\n" not in str(err.value)


def test_every_family_reads_its_activation():
    """A Llama config's hidden_act was ignored (silu computed whatever it said): now it is read, an activation no
    engine computes is refused in one line, and GeGLU on a Llama is a block feature as it is on Gemma 3."""
    llama = {**GEMMA3, "model_type": "llama", "hidden_activation": None}
    assert ModelConfig.from_dict({**llama, "hidden_act": "gelu_pytorch_tanh"}).block_features() == ("hidden_act",)
    with pytest.raises(ModelConfigError, match=r"^hidden_act: expected one of \('silu', 'gelu_pytorch_tanh'\), "
                                               r"found 'relu'$"):
        ModelConfig.from_dict({**llama, "hidden_act": "relu"})


def _moe(**over):
    """A Qwen3-MoE config with Gemma 3's GeGLU: a block feature on an MoE model."""
    return ModelConfig.from_dict({**GEMMA3, "model_type": "qwen3_moe", "hidden_act": "gelu_pytorch_tanh",
                                  "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, **over})


def test_megatron_builds_every_field_and_refuses_them_on_an_moe_model():
    from verl.models.mcore.model import MEGATRON_BLOCK_FEATURES, ModelLayoutError, check_megatron_block

    check_megatron_block(_config())
    check_megatron_block(_config(final_logit_softcapping=30.0, query_pre_attn_scalar=24))
    assert set(_config(final_logit_softcapping=30.0, query_pre_attn_scalar=24).block_features()) == set(
        MEGATRON_BLOCK_FEATURES)
    with pytest.raises(ModelLayoutError) as err:
        check_megatron_block(_moe())
    assert isinstance(err.value, InputError) and str(err.value) == (
        "model_type qwen3_moe: the Megatron builder lacks the block features ['hidden_act'] of its spec on an MoE "
        "model: use strategy fsdp to train it, the native engine to generate")
    check_megatron_block(_moe(hidden_act="silu"))


def test_megatron_config_rules_take_it_and_refuse_an_moe_block_at_config_time():
    from verl.engine.megatron.config_rules import MegatronConfigRules
    from verl.utils.config_checks import ConfigError

    cfg = {"actor_rollout_ref": {"actor": {"megatron": {"tensor_model_parallel_size": 1,
                                                        "pipeline_model_parallel_size": 1,
                                                        "expert_model_parallel_size": 1,
                                                        "expert_tensor_parallel_size": None,
                                                        "sequence_parallel": False}},
                                 "model": {"lora_rank": 0}}}
    MegatronConfigRules().check_layout(cfg, _config(), 1)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.megatron\.model_type qwen3_moe: the "
                                          r"Megatron builder lacks the block features \['hidden_act'\]"):
        MegatronConfigRules().check_layout(cfg, _moe(), 1)
    cfg["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] = 2
    with pytest.raises(ConfigError, match=r"expected a divisor of num_key_value_heads=1"):
        MegatronConfigRules().check_layout(cfg, _config(), 2)


def test_verl_generate_megatron_answers_as_transformers(tmp_path):
    """The real checkpoint through ``verl generate --engine megatron --prompt`` (one rank, Megatron's cache-free
    greedy): transformers' greedy answer (tests/helpers/gemma3_model.py). The plain-text prompt gets the tokenizer's
    BOS, as ``tokenizer(text)`` gives it (without it this base model answers ' France. The The ...')."""
    import subprocess
    import sys

    from helpers.gemma3_model import ANSWER, PROMPT, gemma3_dir

    proc = subprocess.run([sys.executable, "-m", "verl.cli", "generate", "--engine", "megatron", "--model",
                           gemma3_dir(), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == ANSWER.strip()


def test_a_plain_prompt_gets_the_tokenizers_bos_and_a_templated_one_only_the_templates(tmp_path):
    from helpers.gemma3_model import gemma3_dir
    from helpers.real_model import smollm2_dir
    from transformers import AutoTokenizer

    from verl.utils.dataset.arithmetic import write_parquet
    from verl.utils.dataset.rl_dataset import RLHFDataset, encode_prompt, is_templated

    gemma = AutoTokenizer.from_pretrained(gemma3_dir())
    messages = [{"role": "user", "content": "The capital of France is"}]
    assert not is_templated(messages, gemma)
    write_parquet([{"prompt": messages, "data_source": "x", "reward_model": {"ground_truth": "Paris"}}],
                  str(tmp_path / "p.parquet"))
    row = RLHFDataset(str(tmp_path / "p.parquet"), gemma, {"max_prompt_length": 16})[0]
    ids = row["input_ids"][row["attention_mask"].bool()].tolist()
    assert ids == gemma("The capital of France is").input_ids and ids[0] == gemma.bos_token_id
    smol = AutoTokenizer.from_pretrained(smollm2_dir())
    assert is_templated(messages, smol) and not is_templated("text", smol)
    rendered = smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert encode_prompt(rendered, smol, templated=True) == smol(rendered, add_special_tokens=False).input_ids


def test_vllm_takes_the_features_it_was_checked_on_and_refuses_the_others(monkeypatch):
    """tests/vllm checks every block feature on vLLM (a tiny soft-capped Gemma 3 and the real 270M); one outside
    that list is refused in one line."""
    import verl.engine.rollout.vllm.engine as vllm_engine
    from verl.engine.rollout.registry import rollout_engine

    check = rollout_engine("vllm").check_model
    check(_config(), 1)
    check(_config(final_logit_softcapping=30.0, query_pre_attn_scalar=24), 1)
    monkeypatch.setattr(vllm_engine, "VLLM_BLOCK_FEATURES", tuple(f for f in vllm_engine.VLLM_BLOCK_FEATURES
                                                                  if f != "sliding_window"))
    with pytest.raises(InputError) as err:
        check(_config(), 1)
    assert str(err.value) == ("actor_rollout_ref.rollout.name=vllm: model_type gemma3_text needs the block features "
                              "['sliding_window'], which the vLLM rollout is not tested for: use native")


def test_sglang_takes_the_features_it_was_checked_on_and_refuses_the_others():
    """tests/sglang/test_sglang_gemma3.py checks Gemma 3 270M's block on SGLang; a soft-capped or rescaled one
    was never checked there."""
    from verl.engine.rollout.registry import rollout_engine

    check = rollout_engine("sglang").check_model
    check(_config(), 1)
    with pytest.raises(InputError) as err:
        check(_config(final_logit_softcapping=30.0, query_pre_attn_scalar=24), 1)
    assert str(err.value) == ("actor_rollout_ref.rollout.name=sglang: model_type gemma3_text needs the block "
                              "features ['final_logit_softcapping', 'query_pre_attn_scalar'], which the SGLang "
                              "rollout is not tested for: use native")
    from verl.engine.rollout.sglang_rollout import check_cpu_tp

    with pytest.raises(InputError, match=r"rollout tp=2 on CPU: expected a tp dividing num_key_value_heads=1"):
        check_cpu_tp(_config(), 2)  # SGLang pads the one KV head on CPU


def test_no_engine_names_the_family():
    """A new architecture is data in its spec: no file of the engines (training, rollout, Megatron's model
    builder), the hybrid engine or the workers names Gemma."""
    found = []
    for top in ("verl/engine", "verl/hybrid_engine", "verl/models/mcore", "verl/workers"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        if "gemma" in f.read().lower():
                            found.append(os.path.join(root, name))
    assert found == []


def test_real_checkpoint_config_round_trips(tmp_path):
    from helpers.gemma3_model import gemma3_dir

    with open(os.path.join(gemma3_dir(), "config.json")) as f:
        raw = json.load(f)
    config = ModelConfig.from_dict(raw)
    assert config.sliding_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert ModelConfig.from_fields(json.loads(json.dumps(config.to_fields()))) == config
