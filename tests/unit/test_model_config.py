"""ModelConfig: the HF config fields every component reads, validated once at load."""

import json

import pytest
import transformers

from verl.models.config import ModelConfig, ModelConfigError


def _hf(**kw):
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return base


def test_reads_rope_theta_from_transformers5_rope_parameters():
    cfg = transformers.Qwen2Config(**_hf(rope_theta=5e5)).to_dict()
    assert ModelConfig.from_dict(cfg).rope_theta == 5e5


def test_qwen2_always_has_qkv_bias_llama_only_when_configured():
    assert ModelConfig.from_dict(transformers.Qwen2Config(**_hf()).to_dict()).attention_bias
    assert not ModelConfig.from_dict(transformers.LlamaConfig(**_hf()).to_dict()).attention_bias
    assert ModelConfig.from_dict(transformers.LlamaConfig(**_hf(attention_bias=True)).to_dict()).attention_bias


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    hf = {k: v for k, v in _hf().items() if k != "num_key_value_heads"}
    cfg = ModelConfig.from_dict(dict(model_type="llama", **hf))
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 4


@pytest.mark.parametrize("change, fragment", [
    (dict(model_type="gpt2"), "model_type: expected one of"),
    (dict(num_key_value_heads=3), "num_key_value_heads: expected a divisor"),
    (dict(hidden_size=0), "hidden_size: expected a positive integer"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0}), "rope_type: expected one of"),
])
def test_bad_configs_name_the_key(change, fragment):
    cfg = dict(model_type="qwen2", **_hf())
    cfg.update(change)
    with pytest.raises(ModelConfigError, match=fragment):
        ModelConfig.from_dict(cfg)


def test_missing_key_and_missing_file(tmp_path):
    with pytest.raises(ModelConfigError, match="expected the key 'vocab_size', found it missing"):
        ModelConfig.from_dict({k: v for k, v in dict(model_type="qwen2", **_hf()).items() if k != "vocab_size"})
    with pytest.raises(ModelConfigError, match="to exist"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="expected JSON, found invalid JSON"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen2", **_hf())))
    assert ModelConfig.from_pretrained(str(tmp_path)).vocab_size == 100
