"""Scaled RoPE (llama3, yarn, linear) through every engine against transformers, on tiny configs whose sequences
run past ``original_max_position_embeddings`` (16) so the scaling changes the logits.

The cases also carry the architecture details real checkpoints have and the other tiny models lack:
``head_dim`` (16) unequal to hidden / heads (8) with untied embeddings (Llama); Qwen3's q/k norms with
tied embeddings; Qwen2's bias with the pre-transformers-5 ``rope_scaling`` spelling in config.json.

* native rollout from the HF directory (this process): greedy ids = HF generate's, log-probs within bound;
* one gloo rank: Megatron (TP1) logits = HF logits; the reshard Megatron -> native rollout, then the rollout's
  greedy ids = HF's; the FSDP engine's logits = HF logits.
"""

import json
import os

import pytest
import torch
from helpers.tiny_models import left_pad
from helpers.tolerance import log_prob_tolerance, logits_tolerance

from verl.launcher.spawn import run_ranks

pytest.importorskip("megatron.core")

VOCAB, LAYERS, WIDTH = 200, 2, 64  # WIDTH: the widest reduction, the MLP's intermediate size
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=LAYERS,
              max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None,
              eos_token_id=None, pad_token_id=0)
ORIGINAL = 16
CASES = {
    "llama3": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL)),
    "yarn": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=ORIGINAL)),
    # Written to config.json the transformers-4 way (top-level theta, ``rope_scaling`` with ``type``) below.
    "linear": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
}
PROMPTS = [list(range(3, 25)), list(range(40, 56)), list(range(100, 122))]  # 22, 16, 22 tokens
NEW_TOKENS = 10  # positions up to 31, twice the original context
BUCKET_BYTES = 16 << 10


def _save(name, path):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(CASES[name])
    config = AutoConfig.for_model(kwargs.pop("model_type"), attn_implementation="eager", **COMMON, **kwargs)
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases and ones the norms: random ones make a misplaced one visible
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    if name == "linear":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        rope = cfg.pop("rope_parameters")
        cfg.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "linear", "factor": rope["factor"]})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _batch():
    ids, mask = left_pad(PROMPTS)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def _hf_greedy(model):
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0)
    responses = out.sequences[:, ids.shape[1]:]
    log_probs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
    return responses, log_probs


def _engines_job(hf_dirs):
    """One rank: per case Megatron logits, the native rollout's greedy output after the reshard, FSDP logits."""
    from verl.engine.fsdp.engine import FSDPEngine
    from verl.engine.fsdp.parallel import fsdp_mesh
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.padding import restore
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.hybrid_engine.hybrid_engine import HybridEngine
    from verl.hybrid_engine.layouts import TrainingLayout
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    batch, out = _batch(), {}
    initialize_megatron(1, 1, seed=1)
    for name, hf_dir in hf_dirs.items():
        config = ModelConfig.from_pretrained(hf_dir)
        # With an optimizer: the reshard binds the DDP-wrapped model's buffers.
        engine = MegatronEngine(config, optim=OptimConfig(lr=0.0, weight_decay=0.0, clip_grad=0.0))
        load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
        logits = engine.forward(batch, 3, lambda lg, ids, sh, mb: {"logits": restore(lg, sh)[..., :VOCAB]})
        rollout = NativeRollout(config, dtype=torch.float32, pad_token_id=0)
        hybrid = HybridEngine(engine, rollout, config, TrainingLayout(tp=1, pp=1, dp=1), 1, BUCKET_BYTES, "float32")
        hybrid.to_rollout()
        generated = rollout.generate(batch["input_ids"], batch["attention_mask"],
                                     SamplingParams(temperature=0.0, response_length=NEW_TOKENS))
        hybrid.to_training()
        out[name] = {"megatron": logits["logits"], "resharded_ids": generated["responses"],
                     "resharded_log_probs": generated["rollout_log_probs"]}
    destroy_megatron()
    mesh = fsdp_mesh(-1)
    for name, hf_dir in hf_dirs.items():
        engine = FSDPEngine(ModelConfig.from_pretrained(hf_dir), hf_dir, mesh, "lm")
        out[name]["fsdp"] = engine.forward(batch, 3, lambda lg, ids, sh, mb: {"logits": restore(lg, sh)})["logits"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per case: the HF dir, HF logits, HF logits of the same weights with plain RoPE, HF greedy output."""
    from transformers import AutoModelForCausalLM

    batch, ref = _batch(), {}
    for name in CASES:
        path = str(tmp_path_factory.mktemp(name))
        model = _save(name, path)
        with torch.no_grad():
            logits = model(**batch).logits.float()
            plain = AutoModelForCausalLM.from_config(
                type(model.config)(**{**model.config.to_dict(), "rope_parameters": {
                    "rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}}),
                attn_implementation="eager")
            plain.load_state_dict(model.state_dict())
            plain_logits = plain.eval()(**batch).logits.float()
        ref[name] = {"dir": path, "logits": logits, "plain_logits": plain_logits, "greedy": _hf_greedy(model)}
    return ref


@pytest.fixture(scope="module")
def engines(reference):
    return run_ranks(_engines_job, 1, {name: r["dir"] for name, r in reference.items()}, timeout_s=240)[0]


def _logits_tol(logits):
    return logits_tolerance(torch.float32, width=WIDTH, num_layers=LAYERS, scale=max(1.0, float(logits.abs().max())))


def _log_prob_tol(log_probs):
    return log_prob_tolerance(torch.float32, width=WIDTH, num_layers=LAYERS, vocab=VOCAB,
                              scale=max(1.0, float(log_probs.abs().max())))


@pytest.mark.parametrize("name", list(CASES))
def test_the_scaling_changes_the_logits(reference, name):
    r, mask = reference[name], _batch()["attention_mask"].bool()
    assert (r["logits"] - r["plain_logits"]).abs()[mask].max() > 100 * _logits_tol(r["logits"])


@pytest.mark.parametrize("name", list(CASES))
def test_native_rollout_from_hf_dir_matches_transformers(reference, name):
    from verl.engine.rollout.base import SamplingParams
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.models.config import ModelConfig

    r = reference[name]
    engine = NativeRollout(ModelConfig.from_pretrained(r["dir"]), dtype=torch.float32, pad_token_id=0)
    engine.load_hf_checkpoint(r["dir"])
    batch = _batch()
    out = engine.generate(batch["input_ids"], batch["attention_mask"],
                          SamplingParams(temperature=0.0, response_length=NEW_TOKENS))
    responses, log_probs = r["greedy"]
    assert torch.equal(out["responses"], responses)
    assert (out["rollout_log_probs"] - log_probs).abs().max() <= _log_prob_tol(log_probs)


@pytest.mark.parametrize("engine", ["megatron", "fsdp"])
@pytest.mark.parametrize("name", list(CASES))
def test_training_engine_logits_match_transformers(reference, engines, name, engine):
    r, mask = reference[name], _batch()["attention_mask"].bool()
    worst = (engines[name][engine] - r["logits"]).abs()[mask].max()
    assert worst <= _logits_tol(r["logits"]), f"{name} {engine}: max |logits - HF| = {worst:.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_rollout_after_reshard_from_megatron_matches_transformers(reference, engines, name):
    responses, log_probs = reference[name]["greedy"]
    assert torch.equal(engines[name]["resharded_ids"], responses)
    assert (engines[name]["resharded_log_probs"] - log_probs).abs().max() <= _log_prob_tol(log_probs)
