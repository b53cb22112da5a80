"""megatron-core Qwen3 / Qwen3-MoE vs transformers, with expert parallelism, on 4 gloo ranks.

One spawned job, for each tiny config (tests/helpers/moe_models.py: dense Qwen3 with q/k norms; Qwen3-MoE
with a dense layer among MoE ones and renormalised top-k; Qwen3-MoE with HF's raw top-k weights) and each
layout (tp, pp, ep, etp): the per-rank state dict equals the model spec's parameters (names, shapes, order);
logits match HF's (fp32) to 1e-4 (as the dense parity test: a 4-layer model whose widest reduction is 64
terms, logits of order 10); greedy ids equal HF generate's; and the HF tensors gathered back from the shards
(the export path) are bit-equal to the checkpoint's, every expert by name and count.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import padded_batch  # noqa: E402
from helpers.moe_models import CONFIGS, hf_model  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

# (tp, pp, ep, etp) on 4 ranks; etp None is megatron's default (= tp). The mixed Qwen3-MoE at EP2 alone, with TP2
# and with PP2; Mixtral at EP2 and at EP4 over ETP1 (whole experts on TP ranks); the rest where they differ (the
# router, the names), not the layout.
LAYOUTS = {
    "qwen3": ((2, 2, 1, None),),
    "qwen3_moe": ((1, 1, 2, None), (2, 1, 2, None), (1, 2, 2, None)),
    "qwen3_moe_raw": ((1, 1, 2, None),),
    "mixtral": ((1, 1, 2, None), (2, 1, 4, 1)),
}
GREEDY_PROMPT, GREEDY_TOKENS = [5, 17, 42, 99], 6


def _layout_name(tp, pp, ep, etp):
    return f"tp{tp}pp{pp}ep{ep}" + ("" if etp is None else f"etp{etp}")


def _cases():
    return [f"{name} {_layout_name(*layout)}" for name in CONFIGS for layout in LAYOUTS[name]]


def _job(hf_dirs, hf_logits, batch, hf_greedy):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from verl.engine.megatron.engine import MegatronEngine
    from verl.engine.megatron.generate import greedy_generate
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.padding import restore
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import (
        export_spans_data_parallel,
        iter_hf_from_model,
        load_hf_into_model,
        to_mcore_shard,
    )

    mask = batch["attention_mask"].bool()
    report = {}
    for name, hf_dir in hf_dirs.items():
        for tp, pp, ep, etp in LAYOUTS[name]:
            initialize_megatron(tp, pp, seed=1, ep_size=ep, etp_size=etp)
            from verl.models.config import ModelConfig

            config = ModelConfig.from_pretrained(hf_dir)
            engine = MegatronEngine(config)
            ckpt = HFCheckpoint(hf_dir)
            state = [(k, tuple(v.shape)) for k, v in engine.module.state_dict().items()
                     if not k.endswith("_extra_state")]
            expected = to_mcore_shard(
                config, ckpt.get, tp, pp, mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                "lm", ep, mpu.get_expert_model_parallel_rank(), mpu.get_expert_tensor_parallel_world_size(),
                mpu.get_expert_tensor_parallel_rank())
            load_hf_into_model(engine.module, config, ckpt.get)

            def output_fn(logits, aligned_ids, shifts, micro_batch, vocab=config.vocab_size):
                full = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
                return {"logits": restore(full, shifts)}

            logits = engine.forward(batch, micro_batch_size=2, output_fn=output_fn).get("logits")
            greedy_ids, _ = greedy_generate(engine, GREEDY_PROMPT, GREEDY_TOKENS)
            # As export_model_hf calls it: the first DP replica's group, or every rank when experts span DP.
            gather = export_spans_data_parallel() or mpu.get_data_parallel_rank() == 0
            exported = dict(iter_hf_from_model(engine.module, config)) if gather else {}
            case = f"{name} {_layout_name(tp, pp, ep, etp)}"
            report[case] = {
                "specs_match": state == [(k, tuple(v.shape)) for k, v in expected.items()],
                "logits": None if logits is None else (logits - hf_logits[name]).abs()[mask].max().item(),
                "greedy_match": greedy_ids == hf_greedy[name],
                "exported": sorted(exported),
                "export_equal": all(torch.equal(t, ckpt.get(n)) for n, t in exported.items()),
            }
            destroy_megatron()
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    batch = padded_batch()
    hf_dirs, hf_logits, hf_greedy, hf_names = {}, {}, {}, {}
    for i, name in enumerate(CONFIGS):
        model = hf_model(name, seed=i)
        # Alternate single-file and sharded (index) checkpoints.
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path, max_shard_size="40KB" if i % 2 else "1GB")
        hf_dirs[name] = path
        with torch.no_grad():
            hf_logits[name] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    position_ids=batch["position_ids"]).logits.float()
            out = model.generate(torch.tensor([GREEDY_PROMPT]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                 min_new_tokens=GREEDY_TOKENS, pad_token_id=0)
        hf_greedy[name] = out[0, len(GREEDY_PROMPT):].tolist()
        from verl.models.hf_io import HFCheckpoint

        hf_names[name] = sorted(HFCheckpoint(path).files)
    return run_ranks(_job, 4, hf_dirs, hf_logits, batch, hf_greedy, timeout_s=400), hf_names


@pytest.mark.parametrize("case", _cases())
def test_state_dict_matches_the_model_spec(report, case):
    assert all(r[case]["specs_match"] for r in report[0]), f"{case}: state dict names/shapes/order differ"


@pytest.mark.parametrize("case", _cases())
def test_logits_match_transformers(report, case):
    worst = max(r[case]["logits"] for r in report[0] if r[case]["logits"] is not None)
    assert worst <= 1e-4, f"{case}: max |logits - HF logits| = {worst:.3e}"


@pytest.mark.parametrize("case", _cases())
def test_greedy_ids_match_transformers_generate(report, case):
    assert all(r[case]["greedy_match"] for r in report[0]), f"{case}: greedy ids differ from HF generate"


@pytest.mark.parametrize("case", _cases())
def test_export_gathers_every_tensor_bit_exact(report, case):
    ranks, names = report
    name = case.split()[0]
    writer = [r[case] for r in ranks if r[case]["exported"]]
    assert len(writer) == 1, f"{case}: expected one rank to receive the HF tensors, found {len(writer)}"
    assert writer[0]["exported"] == names[name]  # every expert by name and count, nothing extra
    assert writer[0]["export_equal"]
