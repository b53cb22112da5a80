"""The model spec owns the architecture: its HF architecture name and its HF config reading (issue 42 item 3)."""

import dataclasses
import json
import os
import re

import pytest

from verl.models.config import ModelConfig, ModelConfigError
from verl.models.hf_export import with_architectures
from verl.models.spec import registry
from verl.models.spec.base import read_decoder
from verl.models.spec.dense import LLAMA
from verl.models.spec.registry import model_spec, model_types, register_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.mark.parametrize("model_type", model_types())
def test_each_family_names_the_transformers_class_of_its_model_type(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert model_spec(model_type).architecture == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def test_export_keeps_the_architectures_config_json_names_whatever_the_family():
    """The old table lookup ran before setdefault looked: a type outside it raised KeyError at the final export."""
    hf = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    assert with_architectures(hf, "mistral")["architectures"] == ["MistralForCausalLM"]
    assert with_architectures({"model_type": "qwen3"}, "qwen3")["architectures"] == ["Qwen3ForCausalLM"]
    config = {"model_type": "qwen3"}
    with_architectures(config, "qwen3")
    assert config == {"model_type": "qwen3"}  # a copy: the caller's config is not changed


def test_the_families_readers_set_what_differs():
    assert ModelConfig.from_dict(dict(model_type="qwen2", attention_bias=False, **TINY)).attention_bias
    llama = ModelConfig.from_dict(dict(model_type="llama", attention_bias=True, **TINY))
    assert (llama.attention_bias, llama.qk_norm) == (True, False)
    assert ModelConfig.from_dict(dict(model_type="qwen3", **TINY)).qk_norm


def test_a_registered_family_is_read_by_its_own_reader_and_exported_with_its_name():
    toy = dataclasses.replace(LLAMA, model_types=("toy_llama",), architecture="ToyLlamaForCausalLM",
                              read_hf_config=lambda cfg: {**read_decoder(cfg), "tie_word_embeddings": True})
    with pytest.raises(ModelConfigError, match="model_type: expected one of .*found 'toy_llama'"):
        ModelConfig.from_dict(dict(model_type="toy_llama", **TINY))
    register_spec(toy)
    try:
        config = ModelConfig.from_dict(dict(model_type="toy_llama", **TINY))
        assert config.tie_word_embeddings and model_spec("toy_llama") is toy
        assert ModelConfig.from_fields(config.to_fields()) == config
        assert with_architectures({}, "toy_llama") == {"architectures": ["ToyLlamaForCausalLM"]}
    finally:
        registry._specs().pop("toy_llama")
    assert "toy_llama" not in model_types()


def test_a_packaged_model_type_cannot_be_registered_again():
    with pytest.raises(ValueError, match=r"found \['llama'\]"):
        register_spec(LLAMA)


def test_no_model_type_branch_outside_the_specs():
    for path in ("verl/models/config.py", "verl/models/hf_export.py", "verl/engine/fsdp/hf_export.py"):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"model_type\s*(==|!=|in\s)", text), path
        for name in ("qwen2", "llama", "qwen3", "mixtral", "ForCausalLM"):
            assert name not in text, (path, name)


def test_rope_settings_are_read_in_one_place():
    """RoPE scaling is added where RoPE is read: the specs' read_rope, nowhere else in verl.models."""
    readers = []
    for root, _, files in os.walk(os.path.join(REPO, "verl", "models")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    if re.search(r"""["'](rope_scaling|rope_parameters)["']""", f.read()):
                        readers.append(os.path.relpath(os.path.join(root, name), REPO))
    assert readers == ["verl/models/spec/base.py"]
    with pytest.raises(ModelConfigError, match=r"rope_type: expected one of \(.*\), found 'longrope'"):
        ModelConfig.from_dict(dict(model_type="llama", rope_scaling={"type": "longrope", "factor": 2.0}, **TINY))


def test_config_json_round_trip_through_from_pretrained(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3", **TINY)))
    assert ModelConfig.from_pretrained(str(tmp_path)).qk_norm
