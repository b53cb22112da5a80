"""The actor's response-only logits (issue 43 item 5): with ``response_fn`` the Megatron engine runs the output layer
on the response positions only and the chunked vocab-parallel log-softmax on them. On 2 gloo ranks at TP 2 (each
rank one half of the vocabulary, the padded vocabulary's extra columns on the last), the log-probs, entropy and
every parameter's gradient of a loss on both equal the full-width path's (every column through the output layer,
the log-softmax of all positions cut to the response afterwards) -- left, right and both-sided padding, rows
whose response ends early."""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, hf_model, model_config, padded_batch, save_hf  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402


def _job(hf_dir, batch, weights):
    from verl.engine.megatron.actor import token_log_probs
    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    initialize_megatron(2, 1, seed=1)
    engine = MegatronEngine(model_config(hf_dir))
    load_hf_into_model(engine.module, engine.config, HFCheckpoint(hf_dir).get)
    fast = token_log_probs(engine, compute_entropy=True, temperature=0.7)
    assert hasattr(fast, "response_fn")

    def full_width(*args):  # the same output function without the response-only entry point
        return fast(*args)

    seen = {}
    engine.module.output_layer.register_forward_hook(
        lambda _m, _a, out: seen.setdefault("columns", []).append(out[0].size(0)))
    results = {}
    for name, output_fn in (("fast", fast), ("full", full_width)):
        kept = {}

        def loss_fn(outputs, micro_batch, kept=kept):
            for key in ("log_probs", "entropy"):
                kept.setdefault(key, []).append(outputs[key].detach())
            mask = micro_batch["attention_mask"][:, -RESPONSE:].float()
            w = micro_batch["w"]
            loss = ((outputs["log_probs"] * w + outputs["entropy"] * w.flip(1)) * mask).sum()
            return loss, {}

        engine.module.zero_grad(set_to_none=True)
        engine._schedule(dict(batch, w=weights), 2, output_fn, loss_fn)
        results[name] = {"log_probs": torch.cat(kept["log_probs"]), "entropy": torch.cat(kept["entropy"]),
                         "grads": {n: p.grad.clone() for n, p in engine.module.named_parameters()
                                   if p.grad is not None}}
    destroy_megatron()
    fast_r, full_r = results["fast"], results["full"]
    return {
        "columns": seen["columns"],
        "log_probs": (fast_r["log_probs"] - full_r["log_probs"]).abs().max().item(),
        "entropy": (fast_r["entropy"] - full_r["entropy"]).abs().max().item(),
        "nonzero": float(full_r["log_probs"].abs().sum()),
        "same_params": sorted(fast_r["grads"]) == sorted(full_r["grads"]) and len(full_r["grads"]) > 0,
        "grad": max(((fast_r["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                    for n, g in full_r["grads"].items()),
    }


def test_response_only_logits_match_the_full_width_path_at_tp2(tmp_path):
    hf_dir = save_hf(hf_model("qwen2_gqa_tied", seed=3), str(tmp_path / "hf"), sharded=False)
    batch = padded_batch()
    weights = torch.randn(batch["input_ids"].size(0), RESPONSE, generator=torch.Generator().manual_seed(0))
    for report in run_ranks(_job, 2, hf_dir, batch, weights, timeout_s=240):
        # fast: 2 micro-batches through the output layer on RESPONSE columns; full: on every kept column
        assert report["columns"][:2] == [RESPONSE, RESPONSE] and min(report["columns"][2:]) > RESPONSE, report
        assert report["nonzero"] > 0 and report["same_params"], report
        assert report["log_probs"] < 1e-5 and report["entropy"] < 1e-5, report
        assert report["grad"] < 1e-5, report
