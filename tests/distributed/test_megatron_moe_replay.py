"""Routing replay in megatron (verl's actor.router_replay.mode=R3): every MoE layer routes each token to the
experts a batch's ``routed_experts`` names, on 4 gloo ranks.

The oracle is transformers' Qwen3-MoE with its routers' top-k forced to the same experts
(helpers.moe_models.hf_logits_with_routing). The replayed routing is random (distinct experts per token, far
from the model's own choice), so logits that matched without replaying it would fail here; each layout
also shows the engine's own routing when it is not asked to replay. Layouts: EP2, TP2 x EP2 with sequence
parallelism (each TP rank's routers see their sequence shard), PP2 x EP2 (each stage its own MoE layers).
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import padded_batch  # noqa: E402
from helpers.moe_models import hf_logits_with_routing, hf_model  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

LAYOUTS = ((1, 1, 2), (2, 1, 2), (1, 2, 2))  # (tp, pp, ep)


def _job(hf_dir, batch):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.padding import restore
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = ModelConfig.from_pretrained(hf_dir)
    out = {}
    for tp, pp, ep in LAYOUTS:
        initialize_megatron(tp, pp, seed=1, ep_size=ep)
        engine = MegatronEngine(config, sequence_parallel=tp > 1)
        load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)

        def output_fn(logits, aligned_ids, shifts, micro_batch, vocab=config.vocab_size):
            return {"logits": restore(gather_from_tensor_model_parallel_region(logits)[..., :vocab], shifts)}

        name = f"tp{tp}pp{pp}ep{ep}"
        out[name + " own"] = engine.forward(batch, 2, output_fn).get("logits")
        engine.replay_routing = True
        out[name + " replayed"] = engine.forward(batch, 2, output_fn).get("logits")
        destroy_megatron()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = hf_model("qwen3_moe", seed=3)
    path = str(tmp_path_factory.mktemp("moe"))
    model.save_pretrained(path)
    batch = padded_batch(seed=4)
    layers, k = len([1 for layer in model.model.layers if hasattr(layer.mlp, "gate")]), 2
    generator = torch.Generator().manual_seed(7)
    batch["routed_experts"] = torch.rand(*batch["input_ids"].shape, layers, 4, generator=generator).argsort(-1)[
        ..., :k].to(torch.int16)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    with torch.no_grad():
        own = model(input_ids=args[0], attention_mask=args[1], position_ids=args[2]).logits.float()
    forced = hf_logits_with_routing(model, *args, batch["routed_experts"])
    return run_ranks(_job, 4, path, batch, timeout_s=300), own, forced, batch["attention_mask"].bool()


@pytest.mark.parametrize("layout", [f"tp{t}pp{p}ep{e}" for t, p, e in LAYOUTS])
def test_replayed_routing_matches_transformers_forced_to_it(results, layout):
    ranks, own, forced, mask = results
    assert (own - forced).abs()[mask].max() > 0.5  # the replayed routing really is another one
    for rank in ranks:
        if rank[layout + " own"] is None:
            continue  # not the last pipeline stage
        # fp32, 4 layers, widest reduction 64 terms, logits of order 10: the dense parity test's 1e-4.
        assert (rank[layout + " own"] - own).abs()[mask].max() <= 1e-4
        assert (rank[layout + " replayed"] - forced).abs()[mask].max() <= 1e-4
