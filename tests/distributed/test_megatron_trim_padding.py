"""The Megatron engine runs each micro-batch only over the columns some row needs (up to its longest valid run
after left alignment; a multiple of the TP size under sequence parallelism), and that changes nothing: the
log-probs, the loss, the gradient norm and the updated weights' log-probs equal a forward over the whole
padded width, at TP1 (x DP2) and TP2 with sequence parallelism; response padding reads 0 either way."""

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.megatron_tiny_models import RESPONSE, SEQ, hf_model, model_config, padded_batch, save_hf  # noqa: E402

from verl.launcher.spawn import run_ranks  # noqa: E402

# (left, right) padding per row: valid runs of 6, 4, 7 and 4 tokens out of SEQ = 12, every row with a response.
PADS = [(3, 3), (6, 2), (2, 3), (5, 3)]


def sft_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _job(hf_dir, batch):
    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.engine.roles import Actor
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = model_config(hf_dir)
    report = {}
    for name, tp, sequence_parallel in (("tp1", 1, False), ("tp2_sp", 2, True)):
        for trim in (True, False):
            initialize_megatron(tp, 1, seed=3)
            engine = MegatronEngine(config, optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                                    sequence_parallel=sequence_parallel)
            load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
            if not trim:
                engine._kept_columns = lambda mask: mask.size(1)
            widths = []
            engine.module.register_forward_pre_hook(lambda _m, args, seen=widths: seen.append(args[0].size(1)))
            actor = Actor(engine, micro_batch_size=2)
            before = engine.forward(batch, 2, engine.token_log_probs(True))
            metrics = actor.update_policy(batch, sft_loss)
            after = engine.forward(batch, 2, engine.token_log_probs(True))
            mask = batch["response_mask"].bool()
            report[f"{name}/{'trim' if trim else 'full'}"] = {
                "widths": widths, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "before": before["log_probs"][mask], "entropy": before["entropy"][mask],
                "after": after["log_probs"][mask], "pad_log_probs": before["log_probs"][~mask],
                "pad_entropy": before["entropy"][~mask]}
            destroy_megatron()
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    hf_dir = save_hf(hf_model("qwen2_gqa_tied", seed=5), str(tmp_path_factory.mktemp("trim")), sharded=False)
    batch = padded_batch(seed=4, batch=len(PADS))
    mask = torch.ones(len(PADS), SEQ, dtype=torch.long)
    for row, (left, right) in enumerate(PADS):
        mask[row, :left] = 0
        mask[row, SEQ - right:] = 0
    batch.update(attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
                 response_mask=mask[:, -RESPONSE:])
    return run_ranks(_job, 2, hf_dir, batch, timeout_s=240)[0]


@pytest.mark.parametrize("name,kept", [("tp1", [6, 7]), ("tp2_sp", [6, 8])])
def test_micro_batches_run_over_the_needed_columns_only(report, name, kept):
    # Two micro-batches of two rows: rows 0-1 need 6 columns, rows 2-3 need 7 (8 under sequence parallelism:
    # a multiple of TP 2); the same for the forward, the training step and the forward after it.
    assert report[f"{name}/trim"]["widths"] == kept * 3
    assert report[f"{name}/full"]["widths"] == [SEQ] * 6


@pytest.mark.parametrize("name", ["tp1", "tp2_sp"])
def test_trimming_changes_no_result(report, name):
    trimmed, full = report[f"{name}/trim"], report[f"{name}/full"]
    for key in ("before", "entropy", "after"):
        torch.testing.assert_close(trimmed[key], full[key], rtol=1e-5, atol=1e-5, msg=key)
    assert trimmed["loss"] == pytest.approx(full["loss"], rel=1e-5)
    assert trimmed["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-4)
    # Response padding reads 0 whatever columns ran (verl's remove-padding convention), so pad positions
    # never depend on which rows shared a micro-batch.
    assert trimmed["pad_log_probs"].numel() > 0
    for key in ("pad_log_probs", "pad_entropy"):
        assert torch.equal(trimmed[key], torch.zeros_like(trimmed[key])), key
        assert torch.equal(full[key], torch.zeros_like(full[key])), key

