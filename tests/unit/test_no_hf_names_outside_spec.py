"""HF parameter names live in the model specs (verl.models.spec) only: the hybrid engine, the Megatron engine,
the rollout engines and the benches get them from there (the FSDP engine runs transformers' own modules and
may name them)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("verl/hybrid_engine", "verl/engine/megatron", "verl/engine/rollout", "verl/bench")
# Fragments of Qwen2/Llama HF tensor names (and SGLang's fused ones).
FRAGMENTS = ("model.layers", "model.norm", "embed_tokens", "lm_head", "self_attn", "mlp.", "input_layernorm",
             "post_attention_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj",
             "down_proj", "score.weight")
PATTERN = re.compile("|".join(re.escape(f) for f in FRAGMENTS))


def test_no_module_outside_the_specs_names_an_hf_parameter():
    files = sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))
    assert len(files) > 20
    found = [f"{path.relative_to(ROOT)}:{n}: {match.group(0)}"
             for path in files for n, line in enumerate(path.read_text().splitlines(), 1)
             for match in [PATTERN.search(line)]
             if match]
    assert not found, "HF parameter names outside verl/models/spec:\n" + "\n".join(found)
