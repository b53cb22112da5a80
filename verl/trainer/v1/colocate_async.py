"""verl's V1 ``colocate_async`` trainer: the rollout shares the training ranks, generation runs ahead of training
through a replay buffer, and responses that are still running when a step's batch is ready are interrupted and
resumed after the weight sync (partial rollout).

A step ``G`` (one weight sync, as in verl):

1. one more train batch of prompts is submitted (``num_warmup_batches`` more before step 1, so
   ``num_warmup_batches + 1`` batches are in flight when a batch is sampled);
2. generation segments run on every in-flight trajectory (prompt + kept prefix, on the weights of version
   ``G - 1``) until ``train_batch_size`` groups are finished and trainable under the staleness policy; each
   rollout replica stops its segment once its share of whole groups finished, so the long tail of a batch does
   not hold the step, it carries over;
3. the oldest finished groups are sampled and trained exactly as the sync trainer trains a batch
   (:meth:`PPOTrainer._learn`);
4. the next generation reshards the new weights (version ``G``).

Every rank holds the same replay buffer (the same prompts and the same gathered generations), as every rank
holds the sync trainer's batch. With ``transfer_queue.enable`` the sampled batch enters the data plane
replicated, so the rest of the step keeps each row where it is consumed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from verl.engine.rollout.partial import PromptGroup, groups_to_batch, merge_segment, segment_inputs
from verl.errors import InputError
from verl.protocol import DataProto
from verl.trainer import metrics as metric_utils
from verl.trainer.ppo.trainer import PPOTrainer
from verl.trainer.v1.replay_buffer import PromptStream, ReplayBuffer

PROMPT_FIELDS = ("data_source", "ability", "reward_model", "extra_info", "index")
LEDGER_FILE = "prompt_ledger.jsonl"


def off_policy_metrics(groups: list[PromptGroup], step: int) -> dict[str, float]:
    """verl's ``training/off_policy/*`` over the step's trajectories: spans = max - min + 1 versions that wrote
    a trajectory; staleness = (G - 1) - max, worst = (G - 1) - min (version G - 1 is the live one in step G)."""
    lows = np.array([t.min_version for g in groups for t in g.trajectories], dtype=np.float64)
    highs = np.array([t.max_version for g in groups for t in g.trajectories], dtype=np.float64)
    segments = np.array([t.segments for g in groups for t in g.trajectories], dtype=np.float64)
    values = {"trajectory_spans": highs - lows + 1, "trajectory_staleness": (step - 1) - highs,
              "trajectory_staleness_worst": (step - 1) - lows}
    metrics = {}
    for name, array in values.items():
        metrics.update({f"training/off_policy/{name}/mean": float(array.mean()),
                        f"training/off_policy/{name}/max": float(array.max()),
                        f"training/off_policy/{name}/min": float(array.min())})
    metrics["training/off_policy/partial_fraction"] = float((segments > 1).mean())
    return metrics


class ColocateAsyncTrainer(PPOTrainer):
    """``trainer.v1.trainer_mode=colocate_async`` (see the module doc)."""

    def __init__(self, config: Any, tokenizer: Any, dry_run: bool = False):
        super().__init__(config, tokenizer, dry_run)
        cfg = self.sections
        v1 = cfg.trainer.v1
        self.batch_groups = cfg.data.train_batch_size
        self.n = cfg.actor_rollout_ref.rollout.n
        self.pad = tokenizer.pad_token_id
        self.warmup_batches = self._warmup_batches(v1)
        self.stream = PromptStream(self.sampler)
        self.buffer = ReplayBuffer(v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy,
                                   self._make_group, self.stream)
        rollout = cfg.actor_rollout_ref.rollout
        self.rollout_dp = self.world_size // rollout.tensor_model_parallel_size
        self.ledger_path = os.path.join(cfg.trainer.output_dir, LEDGER_FILE)
        self.stop_ids = self.actor_rollout_wg.worker.train_sampling.stop_ids
        self.off_policy = True

    @staticmethod
    def _warmup_batches(v1: Any) -> int:
        return v1.colocate_async.num_warmup_batches

    def _make_group(self, index: int, epoch: int, step: int) -> PromptGroup:
        item = self.train_dataset[index]
        fields = {k: item[k] for k in PROMPT_FIELDS if k in item}
        return PromptGroup(uid=f"{epoch}-{index}", index=index, epoch=epoch, submit_step=step,
                           prompt=list(item["raw_prompt_ids"]), fields=fields, n=self.n)

    # ------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        state = super()._trainer_state()
        state["sampler"] = self.sampler.state_dict()  # the stream draws exactly what it hands out
        state["replay_buffer"] = self.buffer.state_dict()
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "replay_buffer" not in state:
            raise InputError("checkpoint: expected the replay buffer of an asynchronous run, found a sync run's "
                               "checkpoint (resume it with trainer.v1.trainer_mode=sync)")
        self.buffer.load_state_dict(state["replay_buffer"], self.global_step + 1)
        if self.rank == 0 and os.path.exists(self.ledger_path):  # steps after the checkpoint are redone
            with open(self.ledger_path, encoding="utf-8") as fh:
                kept = [line for line in fh if json.loads(line)["step"] <= self.global_step]
            with open(self.ledger_path + ".tmp", "w", encoding="utf-8") as fh:
                fh.writelines(kept)
            os.replace(self.ledger_path + ".tmp", self.ledger_path)

    # ------------------------------------------------------------------ the loop
    def _start_generation(self) -> None:
        """Before the first step of this process (a standalone pool starts streaming here)."""

    def _submit(self, count: int, step: int) -> None:
        """Draw ``count`` prompts into the buffer, tagged ``step``; the colocated segments pick them up."""
        self.buffer.submit(count, step)

    def _train_loop(self, validate: bool, preempt: Any, progress: Any) -> bool:
        preempted = False
        self._start_generation()
        if self.global_step == 0 and not self.buffer.in_flight and not self.buffer.finished:
            self._submit(self.warmup_batches * self.batch_groups, step=1)  # verl's on_train_begin
        while self.global_step < self.total_training_steps and not preempted:
            step = self.global_step + 1
            metrics = self.async_step(step)
            last, preempted = self._end_step(metrics, step, validate, preempt)
            progress.update(1)
            if last:
                break
        return preempted

    def async_step(self, step: int) -> dict[str, float]:
        with self._step(step) as metrics:
            self._submit(self.batch_groups, step)  # verl's prepare_step: one batch a step
            with self._timer("update_weights"):  # version G - 1 into the rollout (verl syncs at the end of G - 1)
                metrics.update(self.actor_rollout_wg.update_weights())
            with self._timer("gen"):  # the trainer's wait for a batch
                metrics.update(self._generate_until_ready(step))
            groups = self.buffer.sample(self.batch_groups, step)
            metrics.update(off_policy_metrics(groups, step))
            metrics.update(self.buffer.eviction_metrics())
            metrics["training/epoch"] = float(min(g.epoch for g in groups))
            batch = self._groups_batch(groups, step)
            batch = self._learn(batch, metrics, step)
            self._record(step, groups)
            self.buffer.end_step()
        # Off-policy trajectories differ from the actor by design; the weight-sync check needs on-policy ones.
        on_policy = all(t.min_version == step - 1 for g in groups for t in g.trajectories)
        return self._step_end_metrics(batch, metrics, on_policy)

    def _generate_until_ready(self, step: int) -> dict[str, float]:
        """Segments over the in-flight groups until a batch can be sampled (verl's sample-or-wait)."""
        version = step - 1
        rows_run, segments, metrics = 0, 0, {}
        while True:
            self.buffer.evict_stale(step)
            if self.buffer.ready(self.batch_groups, step):
                break
            groups = list(self.buffer.in_flight.values())
            if not groups:
                raise RuntimeError(f"replay buffer: expected groups in flight at step {step}, found none")
            need = max(self.batch_groups - len(self.buffer.finished), 0)
            inputs = segment_inputs(groups, self.sections.data.max_response_length, self.pad,
                                    self.buffer.required_uids(step))
            out = self.actor_rollout_wg.generate_segment(self._segment_rows(inputs, need, len(groups), step,
                                                                            segments))
            segment_metrics = out.meta_info.pop("metrics", {})
            rows = len(inputs["limits"])
            merge_segment(groups, inputs, out.batch["responses"][:rows], out.batch["response_mask"][:rows],
                          out.batch["rollout_log_probs"][:rows], self.stop_ids, version)
            self.buffer.collect_finished()
            rows_run += rows
            segments += 1
            for key, value in metric_utils.reduce_metrics(segment_metrics).items():
                metrics[key] = metrics.get(key, 0.0) + value
        metrics.update({"rollout/segments": float(segments), "rollout/segment_rows": float(rows_run),
                        "rollout/in_flight_groups": float(len(self.buffer.in_flight)),
                        "rollout/finished_groups": float(len(self.buffer.finished))})
        return metrics

    def _segment_rows(self, inputs: dict[str, torch.Tensor], need: int, total: int, step: int,
                      segment: int) -> DataProto:
        """The segment's rows for generate_segment, padded to a multiple of the rollout DP size with rows of
        budget 0 (finished before they start) in a group of their own."""
        rows = len(inputs["limits"])
        pad = -rows % self.rollout_dp
        fields = {k: inputs[k] for k in ("input_ids", "attention_mask", "limits", "group", "required")}
        if pad:
            fields = {k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) for k, v in fields.items()}
            fields["limits"][rows:] = 0
            fields["group"][rows:] = total
            fields["required"][rows:] = False
        data = DataProto.from_dict(fields)
        seed = (self.sections.trainer.seed * 100003 + step) * 131 + segment
        data.meta_info = {"need": need, "total_groups": total, "width": int(inputs["limits"].max()), "seed": seed}
        return data

    def _groups_batch(self, groups: list[PromptGroup], step: int):
        data = self.sections.data
        tensors, fields = groups_to_batch(groups, data.max_prompt_length, data.max_response_length, self.pad)
        batch = DataProto.from_dict(tensors, fields, {"seed": step})
        if not self.sections.transfer_queue.enable:
            return batch
        return self._on_data_plane(batch, step)

    def _record(self, step: int, groups: list[PromptGroup]) -> None:
        """The prompt ledger (rank 0): which prompts step ``step`` trained, and the totals so far."""
        if self.rank != 0:
            return
        ledger = self.buffer.ledger
        record = {"step": step, "trained": [g.uid for g in groups], "evicted": ledger.step_evicted_uids,
                  "drawn": ledger.drawn,
                  "trained_total": ledger.trained, "evicted_total": ledger.evicted, "reissued": ledger.reissued,
                  "in_flight": len(self.buffer.in_flight), "finished": len(self.buffer.finished)}
        os.makedirs(os.path.dirname(self.ledger_path) or ".", exist_ok=True)
        with open(self.ledger_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
