"""The model specs (verl.models.spec): each covers its architecture's HF checkpoint exactly once, and an
unknown model_type is refused in one line."""

import dataclasses

import pytest
import torch
from helpers.moe_models import CONFIGS as MOE_CONFIGS
from helpers.tiny_models import MODELS

from verl.models.config import ModelConfig, ModelConfigError
from verl.models.hf_io import HFCheckpoint
from verl.models.spec.base import TP, Fusion, ModelSpec, ParamSpec
from verl.models.spec.registry import UnknownModelTypeError, model_spec, model_types

# The tiny checkpoints of the other tests, plus Llama with a qkv bias (HF also biases o_proj then) and Qwen2 untied.
CASES = {
    "qwen2-tied": MODELS["qwen2"],
    "qwen2-untied": dict(MODELS["qwen2"], tie_word_embeddings=False),
    "llama-untied": MODELS["llama"],
    "llama-bias-tied": dict(MODELS["llama"], attention_bias=True, tie_word_embeddings=True),
    "qwen3": MOE_CONFIGS["qwen3"],
    "qwen3-tied": dict(MOE_CONFIGS["qwen3"], tie_word_embeddings=True),
    "qwen3_moe-mixed": MOE_CONFIGS["qwen3_moe"],
    "qwen3_moe-sparse-step-2": dict(MOE_CONFIGS["qwen3_moe_raw"], decoder_sparse_step=2),
    "mixtral": MOE_CONFIGS["mixtral"],
}


def hf_tensors(cfg, path):
    """{name: shape} of the HF checkpoint transformers saves for the config dict ``cfg``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    model.save_pretrained(str(path))
    ckpt = HFCheckpoint(str(path))
    return {name: tuple(ckpt.slice(name).get_shape()) for name in ckpt.files}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hf_tensor_of_a_tiny_checkpoint_is_covered_exactly_once(case, tmp_path):
    config = ModelConfig.from_dict(CASES[case])
    spec = model_spec(config.model_type)
    found = hf_tensors(CASES[case], tmp_path)
    unsupported = {n for n in found if n.endswith(spec.unsupported_hf)}
    assert bool(unsupported) == (case == "llama-bias-tied")  # only HF Llama's o_proj bias is outside the spec
    covered = {n: s for n, s in found.items() if n not in unsupported}

    rollout = [(n, s) for p in spec.rollout_params(config) for n, s in zip(p.hf, p.shapes, strict=True)]
    assert sorted(rollout) == sorted(covered.items()) and len(rollout) == len(covered)
    assert spec.hf_shapes(config) == dict(rollout)
    for pp in (1, 2):
        for ep in (1, 2, 4) if config.is_moe else (1,):
            stages = [spec.mcore_params(config, pp, s, ep_size=ep, ep_rank=e) for s in range(pp) for e in range(ep)]
            # Every EP rank holds the dense parameters; each expert lives on exactly one EP rank.
            names = [n for params in stages for p in params for n in p.hf if p.expert is not None]
            names += [n for params in stages[::ep] for p in params for n in p.hf if p.expert is None]
            # With pp > 1 a tied model's last stage holds its own copy of the embedding: the only repeat.
            repeats = ["model.embed_tokens.weight"] if pp > 1 and config.tie_word_embeddings else []
            assert sorted(names) == sorted(list(covered) + repeats)
            assert all(len({p.mcore for p in params}) == len(params) for params in stages)


def test_moe_layers_follow_transformers_rule_and_experts_are_split_by_ep_rank():
    config = ModelConfig.from_dict(dict(MOE_CONFIGS["qwen3_moe"], decoder_sparse_step=1))
    assert config.moe_layers == (0, 2, 3)  # mlp_only_layers=[1]
    assert ModelConfig.from_dict(dict(MOE_CONFIGS["qwen3_moe_raw"], decoder_sparse_step=2)).moe_layers == (1, 3)
    params = model_spec("qwen3_moe").mcore_params(config, 1, 0, ep_size=2, ep_rank=1)
    layer0 = [p for p in params if p.mcore.startswith("decoder.layers.0.mlp.")]
    assert [(p.mcore.removeprefix("decoder.layers.0.mlp."), p.expert) for p in layer0] == [
        ("router.weight", None),
        ("experts.local_experts.0.linear_fc1.weight", 2), ("experts.local_experts.0.linear_fc2.weight", 2),
        ("experts.local_experts.1.linear_fc1.weight", 3), ("experts.local_experts.1.linear_fc2.weight", 3),
    ]
    assert layer0[1].hf == tuple(f"model.layers.0.mlp.experts.2.{x}_proj.weight" for x in ("gate", "up"))
    assert [p.mcore for p in params if p.mcore.startswith("decoder.layers.1.mlp.")] == [
        "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight"]
    rollout = {p.rollout: p for p in model_spec("qwen3_moe").rollout_params(config)}
    w13 = rollout["model.layers.0.mlp.experts.w13_weight"]
    assert w13.fusion is Fusion.STACKED and len(w13.hf) == 2 * config.num_experts
    assert w13.hf[2:4] == tuple(f"model.layers.0.mlp.experts.1.{x}_proj.weight" for x in ("gate", "up"))


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok: expected at most num_experts=4, found 5"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size: expected a positive integer"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step: expected a positive integer, found 0"),
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size: expected 0 for qwen3_moe"),
])
def test_bad_moe_configs_are_refused_in_one_line(change, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        ModelConfig.from_dict(dict(MOE_CONFIGS["qwen3_moe"], **change))


@pytest.mark.parametrize("tp,pp,ep,etp,world,message", [
    (1, 1, 3, None, 4, "ep=3: expected a divisor of num_experts=4"),
    (1, 1, 1, 32, 4, "etp=32: expected a divisor of moe_intermediate_size=16"),
    (2, 1, 4, None, 4, "ep\\*etp=8: expected a divisor of the 4 ranks of a pipeline stage"),
])
def test_bad_expert_layouts_are_refused_in_one_line(tp, pp, ep, etp, world, message):
    from verl.models.mcore.model import ModelLayoutError, check_parallel_layout

    config = ModelConfig.from_dict(MOE_CONFIGS["qwen3_moe"])
    with pytest.raises(ModelLayoutError, match=message):
        check_parallel_layout(config, tp, pp, ep, etp, world_size=world)
    with pytest.raises(ModelLayoutError, match="expected ep=1 and etp=tp for a dense qwen3 model"):
        check_parallel_layout(ModelConfig.from_dict(MOE_CONFIGS["qwen3"]), 1, 1, 2)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_value_and_score_heads_are_the_token_classification_models_tensors(model_type):
    from transformers import AutoConfig, AutoModelForTokenClassification

    cfg = dict(MODELS[model_type])
    config = ModelConfig.from_dict(cfg)
    cfg.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, num_labels=1, token_classification_bias=False, **cfg)
    hf = AutoModelForTokenClassification.from_config(hf_config, dtype=torch.float32)  # as verl.engine.fsdp builds it
    found = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    params = model_spec(model_type).mcore_params(config, 1, 0, head="value")
    assert dict(kv for p in params for kv in zip(p.hf, p.shapes, strict=True)) == found
    assert params[-1].mcore == "output_layer.weight" and params[-1].train_tp is TP.REPLICATED


def test_unknown_model_type_is_refused_in_one_line():
    with pytest.raises(UnknownModelTypeError) as err:
        model_spec("mistral")
    assert str(err.value) == f"model_type: expected one of {model_types()}, found 'mistral'"
    assert model_types() == ("qwen2", "llama", "gemma3_text", "mixtral", "qwen3", "qwen3_moe")
    with pytest.raises(ModelConfigError, match="expected one of \\(.*'qwen3_moe'\\), found 'mistral'"):
        ModelConfig.from_dict(dict(MODELS["llama"], model_type="mistral"))


def test_a_spec_must_order_every_layer_role_and_fuse_as_many_tensors_as_it_says():
    spec = model_spec("qwen2")
    with pytest.raises(ValueError, match="mcore_layer_order"):
        dataclasses.replace(spec, mcore_layer_order=spec.mcore_layer_order[:-1])
    with pytest.raises(ValueError, match="as many HF tensors"):
        ParamSpec("qkv", "x", ("q", "k"), lambda c: ((1,), (1,)), TP.COLUMN, None, TP.COLUMN, Fusion.QKV)
    assert isinstance(spec, ModelSpec) and spec.rollout_name("qkv", 3).endswith(".3.self_attn.qkv_proj.weight")
    with pytest.raises(KeyError, match="score"):
        spec.rollout_name("score")  # the rollout holds no value/score head


@pytest.mark.parametrize("change,message", [
    ("drop", "expected model.layers.2.mlp.experts.3.down_proj.weight (num_experts=4), found it missing"),
    ("extra_expert", "found model.layers.0.mlp.experts.4.down_proj.weight"),
    ("dense_layer", "found model.layers.1.mlp.experts.0.down_proj.weight"),
])
def test_a_checkpoint_with_a_missing_or_extra_expert_is_refused_naming_it(tmp_path, change, message):
    """Expert tensors are checked by name and count against the config before any is loaded (verl #2319: wrong
    expert keys loaded silently); the native loader and the megatron loaders share the check."""
    import shutil

    from helpers.moe_models import save_model
    from safetensors.torch import load_file, save_file

    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.mcore.weights import WeightsError, check_expert_tensors

    save_model("qwen3_moe", tmp_path / "good")  # layer 1 dense, 4 experts
    tensors = load_file(str(tmp_path / "good" / "model.safetensors"))
    down = tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    if change == "drop":
        del tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    elif change == "extra_expert":
        tensors["model.layers.0.mlp.experts.4.down_proj.weight"] = down.clone()
    else:
        tensors["model.layers.1.mlp.experts.0.down_proj.weight"] = down.clone()
    (tmp_path / "bad").mkdir()
    shutil.copy(tmp_path / "good" / "config.json", tmp_path / "bad" / "config.json")
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    config = ModelConfig.from_pretrained(str(tmp_path / "bad"))
    with pytest.raises(WeightsError, match=message.replace("(", "\\(").replace(")", "\\)")):
        check_expert_tensors(config, tensors)
    with pytest.raises(WeightsError, match="HF checkpoint: expected"):
        NativeRollout(config).load_hf_checkpoint(str(tmp_path / "bad"))
