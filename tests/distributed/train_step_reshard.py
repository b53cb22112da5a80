"""Helpers (no tests): one optimizer step on a Megatron actor, then the hybrid engine's reshard into a
rollout engine that was created before the step. Used by test_rollout_after_train_step.py (native
engine) and tests/gpu/test_gpu_pipeline.py. (SGLang after every train step: tests/sglang/test_sglang_trainer.py.)

:func:`train_step_job` runs on every local rank (``run_ranks``). Per case it builds the Megatron
actor (with optimizer) from an HF checkpoint, a native rollout engine for the case's rollout TP and
the :class:`HybridEngine` glue joining them, then:
  before: reshard -> native greedy, Megatron greedy (the parity oracle);
  step:   one ``update_policy`` step (negative log-likelihood of random responses, large lr);
  after:  reshard into the *same* rollout buffer -> native greedy, Megatron greedy, and this rank's
          resharded rollout buffer (what an SGLang rollout TP rank receives).
"""

from __future__ import annotations

import torch
from helpers.tiny_models import left_pad

PROMPTS = [[5, 17, 42, 99, 7], [250, 3, 3, 18, 77, 120, 64, 9, 31], list(range(40, 52))]
NEW_TOKENS = 8
BUCKET_BYTES = 16 << 10  # small: the reshard runs several buckets
LR = 2e-2  # one Adam step moves every weight by ~LR: enough to change some greedy choices

def training_batch(vocab_size: int, rows: int = 4, prompt_len: int = 8, response_len: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, prompt_len + response_len), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "responses": input_ids[:, -response_len:], "response_mask": torch.ones(rows, response_len)}


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _native_greedy(rollout):
    from verl.engine.rollout.base import SamplingParams

    ids, mask = left_pad(PROMPTS)
    out = rollout.generate(ids, mask, SamplingParams(temperature=0.0, response_length=NEW_TOKENS))
    return out["responses"].tolist()


def _megatron_greedy(engine):
    from verl.engine.megatron.generate import greedy_generate

    return [greedy_generate(engine, prompt, NEW_TOKENS)[0] for prompt in PROMPTS]


def _rollout_tp_group(groups):
    """This rank's rollout TP group (None at rollout TP 1); every rank creates every group."""
    import torch.distributed as dist

    mine = None
    for ranks in groups.rollout_tp_groups:
        group = dist.new_group(list(ranks)) if groups.rollout_tp > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _run_case(hf_dir: str, training, rollout_tp: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.engine.megatron.engine import MegatronEngine, OptimConfig
    from verl.engine.roles import Actor
    from verl.engine.rollout.native.engine import NativeRollout
    from verl.hybrid_engine.groups import derive_groups
    from verl.hybrid_engine.hybrid_engine import HybridEngine
    from verl.models.config import ModelConfig
    from verl.models.hf_io import HFCheckpoint
    from verl.models.mcore.weights import load_hf_into_model

    config = ModelConfig.from_pretrained(hf_dir)
    engine = MegatronEngine(config, optim=OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0))
    load_hf_into_model(engine.module, config, HFCheckpoint(hf_dir).get)
    groups = derive_groups(training, rollout_tp)
    rollout = NativeRollout(config, tp_group=_rollout_tp_group(groups), dtype=torch.float32)
    hybrid = HybridEngine(engine, rollout, config, training, rollout_tp, BUCKET_BYTES, "float32")
    result = {"rollout_tp_rank": groups.rollout_tp_rank[dist.get_rank()], "case": groups.case}

    hybrid.to_rollout()
    result["native_before"] = _native_greedy(rollout)
    hybrid.to_training()
    result["megatron_before"] = _megatron_greedy(engine)

    batch = training_batch(config.vocab_size)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    share = batch["input_ids"].shape[0] // dp
    metrics = Actor(engine, micro_batch_size=share).update_policy(
        {k: v[dp_rank * share:(dp_rank + 1) * share] for k, v in batch.items()}, nll_loss, calculate_entropy=False)
    result["update_successful"] = metrics["update_successful"]

    buffer_before = rollout.weight_buffer()
    hybrid.to_rollout()
    result["same_rollout_buffer"] = rollout.weight_buffer() is buffer_before
    result["native_after"] = _native_greedy(rollout)
    result["rollout_buffer"] = rollout.weight_buffer().clone()
    hybrid.to_training()
    result["megatron_after"] = _megatron_greedy(engine)
    return result


def train_step_job(cases) -> dict:
    """``cases``: {name: (hf_dir, tp, pp, rollout_tp)}; cases sharing (tp, pp) should be adjacent."""
    import torch.distributed as dist

    from verl.engine.megatron.parallel import destroy_megatron, initialize_megatron
    from verl.hybrid_engine.layouts import TrainingLayout

    results, layout = {}, None
    for name, (hf_dir, tp, pp, rollout_tp) in cases.items():
        if layout != (tp, pp):
            if layout is not None:
                destroy_megatron()
            initialize_megatron(tp, pp, seed=7)
            layout = (tp, pp)
        training = TrainingLayout(tp=tp, pp=pp, dp=dist.get_world_size() // (tp * pp))
        results[name] = _run_case(hf_dir, training, rollout_tp)
    destroy_megatron()
    return results
