"""megatron-core Qwen2/Llama and Gemma 3's block vs transformers at (tp, pp) in {(1,1),(2,1),(1,2),(2,2)} on 4 gloo
ranks.

One spawned job checks, for every tiny config and layout: the per-rank state dict matches the
reshard planner's training_param_specs, logits match HF (fp32) to 1e-4, and vocab-parallel
log-probs / entropy match a full-vocab reference to 1e-5, and greedy ids match HF generate.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import (  # noqa: E402
    BLOCK_CONFIGS,
    RESPONSE,
    TINY_CONFIGS,
    hf_model,
    model_config,
    padded_batch,
    save_hf,
)

from verl.launcher.spawn import run_ranks  # noqa: E402

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
CONFIGS = {**TINY_CONFIGS, **BLOCK_CONFIGS}
GREEDY_PROMPT, GREEDY_TOKENS = [5, 17, 42, 99], 6


def _full_vocab_outputs(engine):
    """output_fn: gathered full-vocab logits and the vocab-parallel actor outputs from one forward."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl.engine.megatron.actor import token_log_probs
    from verl.engine.padding import restore

    actor_outputs = token_log_probs(engine, compute_entropy=True)

    def output_fn(logits, aligned_ids, shifts, micro_batch):
        full = gather_from_tensor_model_parallel_region(logits)[..., :engine.config.vocab_size]
        return {"logits": restore(full, shifts), **actor_outputs(logits, aligned_ids, shifts, micro_batch)}

    return output_fn


def _parity_job(hf_dirs, hf_logits, batch, hf_greedy):
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.generate import greedy_generate
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.hybrid_engine.layouts import training_param_specs
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    mask = batch["attention_mask"].bool()
    response_mask = mask[:, -RESPONSE:]
    report = {}
    for tp, pp in LAYOUTS:
        initialize_megatron(tp, pp, seed=1)
        tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        for name, hf_dir in hf_dirs.items():
            config = model_config(hf_dir)
            engine = MegatronEngine(config)
            state = [(k, tuple(v.shape)) for k, v in engine.module.state_dict().items()
                     if not k.endswith("_extra_state")]
            specs = [(s.name, tuple(s.shape)) for s in training_param_specs(config, tp, pp, tp_rank, pp_rank)]
            load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
            out = engine.forward(batch, micro_batch_size=2, output_fn=_full_vocab_outputs(engine))
            logits = out["logits"]
            ref_log_probs = torch.log_softmax(logits[:, -RESPONSE - 1:-1], dim=-1)
            ref_lp = ref_log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
            ref_entropy = -(ref_log_probs.exp() * ref_log_probs).sum(-1)
            greedy_ids, _ = greedy_generate(engine, GREEDY_PROMPT, GREEDY_TOKENS)
            report[f"{name} tp{tp}pp{pp}"] = {
                "greedy_match": greedy_ids == hf_greedy[name],
                "specs_match": state == specs,
                "logits": (logits - hf_logits[name]).abs()[mask].max().item(),
                "log_probs": (out["log_probs"] - ref_lp).abs()[response_mask].max().item(),
                "entropy": (out["entropy"] - ref_entropy).abs()[response_mask].max().item(),
                "logits_vs_hf_log_probs": (out["log_probs"] - torch.log_softmax(
                    hf_logits[name][:, -RESPONSE - 1:-1], -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
                ).abs()[response_mask].max().item(),
            }
        destroy_megatron()
    return report


@pytest.fixture(scope="module")
def parity_report(tmp_path_factory):
    batch = padded_batch()
    hf_dirs, hf_logits = {}, {}
    for i, name in enumerate(CONFIGS):
        model = hf_model(name, seed=i)
        # Alternate single-file and sharded (index) checkpoints.
        hf_dirs[name] = save_hf(model, str(tmp_path_factory.mktemp(name)), sharded=i % 2 == 1)
        with torch.no_grad():
            hf_logits[name] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    position_ids=batch["position_ids"]).logits.float()
    hf_greedy = {}
    for i, name in enumerate(CONFIGS):
        model = hf_model(name, seed=i)
        out = model.generate(torch.tensor([GREEDY_PROMPT]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                             min_new_tokens=GREEDY_TOKENS, pad_token_id=0)
        hf_greedy[name] = out[0, len(GREEDY_PROMPT):].tolist()
    reports = run_ranks(_parity_job, 4, hf_dirs, hf_logits, batch, hf_greedy, timeout_s=240)
    return reports


def _cases():
    return [f"{name} tp{tp}pp{pp}" for tp, pp in LAYOUTS for name in CONFIGS]


@pytest.mark.parametrize("case", _cases())
def test_logits_match_transformers(parity_report, case):
    worst = max(r[case]["logits"] for r in parity_report)
    assert worst <= 1e-4, f"{case}: max |logits - HF logits| = {worst:.3e}"


@pytest.mark.parametrize("case", _cases())
def test_vocab_parallel_log_probs_and_entropy_match_full_vocab(parity_report, case):
    for key in ("log_probs", "entropy"):
        worst = max(r[case][key] for r in parity_report)
        assert worst <= 1e-5, f"{case}: max |{key} - full-vocab reference| = {worst:.3e}"
    assert max(r[case]["logits_vs_hf_log_probs"] for r in parity_report) <= 1e-4


@pytest.mark.parametrize("case", _cases())
def test_greedy_ids_match_transformers_generate(parity_report, case):
    assert all(r[case]["greedy_match"] for r in parity_report), f"{case}: greedy ids differ from HF generate"


@pytest.mark.parametrize("case", _cases())
def test_state_dict_matches_training_param_specs(parity_report, case):
    assert all(r[case]["specs_match"] for r in parity_report), f"{case}: state dict names/shapes/order differ"
