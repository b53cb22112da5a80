"""SFT on the Megatron engine of the engine registry (behind ``verl sft``, see :mod:`verl.trainer.main_sft`).

Loss on the response tokens and the eos after them (the prompt is masked), Adam + warmup/decay on
Megatron (TP x PP x DP), and the final weights written as ``<trainer.output_dir>/hf`` (config.json,
model.safetensors, tokenizer files, generation_config.json with eos), ready to be the RL actor.
Rank 0 shows a progress bar, prints a loss line every ``trainer.log_freq`` steps and writes
``<output_dir>/metrics.jsonl`` (``train/loss``, ``train/lr``, ``train/grad_norm``, ``val/loss``;
``val/accuracy`` -- greedy exact match of the exported model on ``data.val_files`` -- at the last step).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from typing import Any

import torch

from verl.trainer.config.sft import SFTSections, sft_engine_sections, sft_total_steps
from verl.utils.dataset.sft_dataset import SFTData


def total_steps(cfg: dict[str, Any], num_train: int) -> int:
    """The run's optimizer steps for a validated config (``cfg``: ``verl sft``'s composed dict)."""
    return sft_total_steps(SFTSections.from_tree(cfg, ""), num_train)


def sft_loss(outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood over the response tokens (and eos): log_probs [b, R]."""
    mask = micro_batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum().clamp(min=1.0), {}


class SFTTrainer:
    """SFT on this rank's Megatron groups (torch.distributed initialised, megatron not yet)."""

    def __init__(self, cfg: dict[str, Any], train: SFTData, val: SFTData | None):
        """``cfg``: ``verl sft``'s validated config (a plain dict, what the ranks receive); read through its
        typed sections, ``self.sections``. The model is the ``megatron`` strategy's engine from the engine
        registry, its HF weights loaded when ``model.path`` has any (else Megatron's seeded init)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        from verl.engine.base import EngineSpec
        from verl.engine.registry import build_engine
        from verl.engine.roles import Actor
        from verl.models.config import ModelConfig
        from verl.models.hf_io import has_hf_weights

        self.cfg, self.train_data, self.val_data = cfg, train, val
        self.sections = sections = SFTSections.from_tree(cfg, "")
        self.rank = dist.get_rank()
        self.steps = sft_total_steps(sections, len(train))
        self.model_config = ModelConfig.from_pretrained(sections.model.path)
        role, optim = sft_engine_sections(sections, self.steps)
        # The engine sets up Megatron's parallel state from the role's layout (seeded with trainer.seed).
        self.engine = build_engine("megatron", EngineSpec(
            self.model_config, sections.model.path, "lm", role, optim=optim, total_training_steps=self.steps,
            seed=sections.trainer.seed, load_weights=has_hf_weights(sections.model.path)))
        self.dp_size, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.actor = Actor(self.engine, sections.data.micro_batch_size_per_gpu)

    def _global_batches(self):
        """Seeded reshuffle every epoch; the last partial batch of an epoch is dropped."""
        size, n = self.sections.data.train_batch_size, len(self.train_data)
        epoch = 0
        while True:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.sections.trainer.seed + epoch))
            for start in range(0, n - size + 1, size):
                yield order[start:start + size]
            epoch += 1

    def val_loss(self) -> float | None:
        if self.val_data is None:
            return None
        from verl.engine.megatron.actor import token_log_probs

        batch = self.val_data.batch(torch.arange(len(self.val_data)))
        out = self.engine.forward(batch, len(self.val_data), token_log_probs(self.engine, compute_entropy=False))
        return float(sft_loss(out, batch)[0])

    def fit(self, tracker: Any = None) -> dict[str, Any]:
        """Train ``total_training_steps``; returns the last step's metrics (logged by the caller,
        which adds the exported model's ``val/accuracy`` to the same record)."""
        from tqdm import tqdm

        trainer, batch_size = self.sections.trainer, self.sections.data.train_batch_size
        share = batch_size // self.dp_size
        tokens_per_step = int(self.train_data.attention_mask.sum()) * batch_size / len(self.train_data)
        bar = tqdm(total=self.steps, desc="sft", unit="step", dynamic_ncols=True, disable=self.rank != 0)
        batches = self._global_batches()
        metrics: dict[str, Any] = {}
        start = time.perf_counter()
        for step in range(1, self.steps + 1):
            tick = time.perf_counter()
            index = next(batches)[self.dp_rank * share:(self.dp_rank + 1) * share]
            out = self.actor.update_policy(self.train_data.batch(index), sft_loss, calculate_entropy=False)
            elapsed = time.perf_counter() - tick
            metrics = {"train/loss": out["loss"], "train/lr": out["lr"], "train/grad_norm": out["grad_norm"],
                       "timing_s/step": elapsed, "perf/tokens_per_s": tokens_per_step / elapsed}
            last = step == self.steps
            if last or (trainer.test_freq > 0 and step % trainer.test_freq == 0):
                metrics["val/loss"] = self.val_loss()
            if last:
                metrics["timing_s/train"] = time.perf_counter() - start
            if tracker is not None and not last:
                tracker.log({k: v for k, v in metrics.items() if v is not None}, step)
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.4f}")
            if self.rank == 0 and (last or step % trainer.log_freq == 0 or step == 1):
                bar.write(_loss_line(step, self.steps, metrics))
        bar.close()
        return metrics

    def export_hf(self, out_dir: str, tokenizer: Any) -> str | None:
        """Stream the actor (collective over every rank) into ``out_dir``, written by rank 0 atomically:
        config.json with the tokenizer's special token ids, and a greedy generation_config.json."""
        from megatron.core import parallel_state as mpu

        from verl.models.hf_export import export_model_hf
        from verl.models.hf_io import read_config, special_token_ids

        hf_config = read_config(self.sections.model.path)
        special = special_token_ids(tokenizer, {})
        hf_config.update(special)
        written = export_model_hf(self.engine.module, self.model_config, out_dir, hf_config, tokenizer,
                                  {**special, "do_sample": False}, gather=mpu.get_data_parallel_rank() == 0)
        return written if self.rank == 0 else None


def _loss_line(step: int, steps: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{steps}", f"loss {metrics['train/loss']:.4f}"]
    if metrics.get("val/loss") is not None:
        parts.append(f"val_loss {metrics['val/loss']:.4f}")
    parts += [f"lr {metrics['train/lr']:.3g}", f"grad_norm {metrics['train/grad_norm']:.3g}",
              f"{metrics['timing_s/step'] * 1e3:.0f} ms/step"]
    return " | ".join(parts)


def run_rank(cfg: dict[str, Any], train: SFTData, val: SFTData | None) -> dict[str, Any]:
    """One rank's whole job (torch.distributed initialised): train, export ``<output_dir>/hf``, rank 0
    scores it; returns the final metrics (module level, so ``run_ranks`` can pickle it)."""
    import torch.distributed as dist

    from verl.engine.megatron.parallel import destroy_megatron
    from verl.trainer.evaluate import evaluate_accuracy
    from verl.utils.tracking import Tracking

    # megatron's CPU fallbacks (no TE / apex) warn once per module on every rank: not the user's concern.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    sections = SFTSections.from_tree(cfg, "")
    trainer_cfg = sections.trainer
    output_dir = os.path.abspath(trainer_cfg.output_dir)
    tracker = None
    if dist.get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        # A rerun restarts from scratch: drop the previous run's logs (the hf dir is replaced at export).
        if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
            os.remove(os.path.join(output_dir, "metrics.jsonl"))
        shutil.rmtree(os.path.join(output_dir, "tensorboard"), ignore_errors=True)
        backends = [b for b in trainer_cfg.logger if b != "console"]  # the console gets loss lines
        tracker = Tracking(output_dir, backends, trainer_cfg.project_name, trainer_cfg.experiment_name)
        with open(os.path.join(output_dir, "sft_config.json"), "w", encoding="utf-8") as fh:
            json.dump(cfg, fh, indent=2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sections.model.tokenizer_path)
    sft = SFTTrainer(cfg, train, val)
    try:
        metrics = sft.fit(tracker)
        hf_dir = sft.export_hf(os.path.join(output_dir, "hf"), tokenizer)
    finally:
        destroy_megatron()
    if tracker is None:
        return metrics
    if trainer_cfg.val_accuracy and sections.data.val_files:
        tick = time.perf_counter()
        metrics["val/accuracy"] = evaluate_accuracy(hf_dir, sections.data.val_files,
                                                    max_new_tokens=trainer_cfg.val_max_new_tokens)
        metrics["timing_s/val_accuracy"] = time.perf_counter() - tick
    tracker.log({k: v for k, v in metrics.items() if v is not None}, sft.steps)
    tracker.close()
    return {**metrics, "hf_dir": hf_dir}


if __name__ == "__main__":  # `python -m verl.trainer.sft_trainer` stays an alias of `verl sft`: main_sft run as the
    import runpy  # main module (main_sft imports this module; an import back would be a circle)

    runpy.run_module("verl.trainer.main_sft", run_name="__main__", alter_sys=True)
