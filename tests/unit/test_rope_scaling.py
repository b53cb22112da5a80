"""RoPE scaling read from an HF config (both spellings) and the one shared inverse-frequency function, against
transformers' ROPE_INIT_FUNCTIONS bit for bit; the types no engine can run are refused in one line."""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from verl.models.config import ModelConfig, ModelConfigError
from verl.models.rope import RopeScaling, inv_freq

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
CASES = {
    "linear": dict(rope_type="linear", factor=2.5),
    "llama3": LLAMA3,
    "llama3_head_dim": dict(LLAMA3, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn_betas_untruncated": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                   beta_fast=16.0, beta_slow=2.0, truncate=False),
    "yarn_mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, mscale=0.707,
                        mscale_all_dim=0.707),
    "yarn_attention_factor": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                  attention_factor=1.3),
    "yarn_factor_from_lengths": dict(rope_type="yarn", factor=None, original_max_position_embeddings=16),
}


def _hf_config(rope, **extra):
    cls = transformers.Qwen3Config if "yarn" in rope["rope_type"] else transformers.LlamaConfig
    return cls(**BASE, rope_parameters=dict(rope, rope_theta=5e5), **extra)


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_attention_scaling_equal_transformers(name):
    extra = dict(head_dim=32) if name == "llama3_head_dim" else {}
    hf = _hf_config(dict(CASES[name]), **extra)
    expected, expected_scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.rope is not None and config.rope.rope_type == hf.rope_parameters["rope_type"]
    got, scale = inv_freq(config.head_dim, config.rope_theta, config.rope)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    plain, _ = inv_freq(config.head_dim, config.rope_theta, None)
    assert not torch.equal(got, plain)  # the case scales something


def test_plain_rope_equals_transformers_default():
    hf = transformers.LlamaConfig(**BASE, rope_theta=5e5)
    expected, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.rope is None
    assert torch.equal(inv_freq(config.head_dim, config.rope_theta, None)[0], expected)


def test_transformers4_spelling_reads_like_rope_parameters():
    old = dict(model_type="llama", **BASE, rope_theta=5e5,
               rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16))
    new = _hf_config(LLAMA3).to_dict()
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(new)
    # original_max_position_embeddings absent: transformers takes max_position_embeddings
    yarn = ModelConfig.from_dict(dict(model_type="qwen2", **BASE, rope_scaling=dict(type="yarn", factor=2.0)))
    assert yarn.rope == RopeScaling("yarn", 2.0, 64, attention_factor=yarn.rope.attention_factor)


def test_scaled_config_round_trips_through_json_fields():
    config = ModelConfig.from_dict(_hf_config(CASES["yarn_mscale"]).to_dict())
    fields = json.loads(json.dumps(config.to_fields()))
    assert ModelConfig.from_fields(fields) == config


@pytest.mark.parametrize("change, message", [
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)),
     "rope_type 'dynamic' is not supported: NTK scaling recomputes the frequencies from each forward's"),
    (dict(rope_parameters=dict(rope_type="longrope", factor=2.0)),
     "rope_parameters.rope_type: expected one of ('default', 'linear', 'llama3', 'yarn'), found 'longrope'"),
    (dict(rope_scaling=dict(type="linear")), "rope_parameters.factor: expected a positive number for rope_type "
                                             "'linear', found None"),
    (dict(rope_parameters=dict(rope_type="default", partial_rotary_factor=0.5)),
     "partial_rotary_factor: expected 1.0 (the Llama/Qwen families rotate whole heads), found 0.5"),
    (dict(partial_rotary_factor=0.25), "partial_rotary_factor: expected 1.0"),
    (dict(rope_parameters=dict(LLAMA3, low_freq_factor=4.0)), "high_freq_factor: expected more than low_freq"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=8.0)), "expected the key 'low_freq_factor'"),
])
def test_unsupported_rope_is_one_line_naming_it(change, message):
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_dict(dict(model_type="llama", **BASE, **change))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_generate_cli_refuses_an_unsupported_rope_type_with_exit_2(tmp_path, capsys):
    from verl.trainer.main_generation import main

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", **BASE, rope_scaling=dict(type="dynamic", factor=2.0))))
    assert main(["--model", str(tmp_path), "--input-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rope_type 'dynamic' is not supported" in err, err
