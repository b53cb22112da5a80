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
   (:meth:`PPOStep.learn <verl.trainer.ppo.step.PPOStep.learn>`): :class:`ReplayBufferSource` is the trainer's batch
   source;
4. the next generation reshards the new weights (version ``G``).

Every rank holds the same replay buffer (the same prompts and the same gathered generations), as every rank
holds the sync trainer's batch. With ``transfer_queue.enable`` the sampled batch enters the data plane
replicated, so the rest of the step keeps each row where it is consumed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from verl.engine.rollout.partial import PromptGroup, groups_to_batch, merge_segment, segment_inputs
from verl.errors import InputError
from verl.protocol import DataProto
from verl.trainer import metrics as metric_utils
from verl.trainer.ppo.batch_source import BatchSource, Generated, SourceContext
from verl.trainer.ppo.trainer import PPOTrainer
from verl.trainer.v1.agent_phases import AGENT_FIELDS, AgentPhases
from verl.trainer.v1.replay_buffer import TRAJECTORY_DIR, PromptStream, ReplayBuffer
from verl.utils.logging_utils import get_logger
from verl.workers.agent_stream import agent_metrics

logger = get_logger(__name__)

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


def truncate_ledger(path: str, step: int) -> None:
    """Keep the ledger's lines of steps <= ``step`` (atomically). A line a kill cut short, or any other line that
    is not a JSON record, is dropped with a warning: the ledger is a record of the run, not state to resume from."""
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= step
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        logger.warning("%s: dropped %d line(s) that are not whole records (a run killed mid-write)", path, dropped)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.writelines(kept)
    os.replace(path + ".tmp", path)


class ReplayBufferSource(BatchSource):
    """The colocated replay buffer as the trainer's batch source (see the module doc): every rank holds the same
    buffer and generates its segments; its state (the sampler, the buffer) is checkpointed."""

    off_policy = True
    # rollout.multi_turn: the trainer's side of the agent loops (a standalone pool runs them on its own: None)
    agent_phases_class: type[AgentPhases] | None = AgentPhases

    def __init__(self, ctx: SourceContext):
        super().__init__(ctx)
        cfg = ctx.sections
        v1 = cfg.trainer.v1
        self.batch_groups = cfg.data.train_batch_size
        self.n = cfg.actor_rollout_ref.rollout.n
        self.pad = ctx.tokenizer.pad_token_id
        self.warmup_batches = self._warmup_batches(v1)
        self.sampler = ctx.data.sampler
        self.stream = PromptStream(self.sampler)
        self.buffer = ReplayBuffer(v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy,
                                   self._make_group, self.stream)
        rollout = cfg.actor_rollout_ref.rollout
        worker = ctx.roles.actor_rollout_wg.worker
        self.rollout_dp = worker.rollout_side.dp_size  # the rollout replicas, as the worker derived them
        self.ledger_path = os.path.join(cfg.trainer.output_dir, LEDGER_FILE)
        self.stop_ids = worker.train_sampling.stop_ids
        # rollout.multi_turn: agent loops that run across steps instead of the segments below
        self.multi_turn = bool(rollout.multi_turn.enable)
        phases = self.agent_phases_class
        self.agents = phases(self) if self.multi_turn and phases is not None else None

    @staticmethod
    def _warmup_batches(v1: Any) -> int:
        return v1.colocate_async.num_warmup_batches

    def _make_group(self, index: int, epoch: int, step: int) -> PromptGroup:
        item = self.ctx.data.dataset[index]
        keys = PROMPT_FIELDS + (AGENT_FIELDS if self.multi_turn else ())
        fields = {k: item[k] for k in keys if k in item}
        return PromptGroup(uid=f"{epoch}-{index}", index=index, epoch=epoch, submit_step=step,
                           prompt=list(item["raw_prompt_ids"]), fields=fields, n=self.n)

    # ------------------------------------------------------------------ checkpoints
    # Every rank holds the same buffer and writes 1/world of its trajectories (a pool source: rank 0 all of them).
    buffer_replicated = True

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(),  # the stream draws exactly what it hands out
                "replay_buffer": self.buffer.state_dict()}

    def save_files(self, staging: str) -> None:
        """The finished groups' trajectories as tensor shards beside the trainer state (collective)."""
        ctx = self.ctx
        if self.buffer_replicated:
            self.buffer.save_trajectories(staging, ctx.rank, ctx.world_size)
        elif ctx.rank == 0:
            self.buffer.save_trajectories(staging, 0, 1)

    def load_files(self, path: str) -> None:
        self._trajectories = ReplayBuffer.load_trajectories(path) if os.path.isdir(
            os.path.join(path, TRAJECTORY_DIR)) else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "replay_buffer" not in state:
            raise InputError("checkpoint: expected the replay buffer of an asynchronous run, found a sync run's "
                               "checkpoint (resume it with trainer.v1.trainer_mode=sync)")
        step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.buffer.load_state_dict(state["replay_buffer"], step + 1, getattr(self, "_trajectories", None))
        if self.ctx.rank == 0 and os.path.exists(self.ledger_path):  # steps after the checkpoint are redone
            truncate_ledger(self.ledger_path, step)

    # ------------------------------------------------------------------ the steps
    def start(self, global_step: int) -> None:
        self._start_generation(global_step)
        if global_step == 0 and not self.buffer.in_flight and not self.buffer.finished:
            self._submit(self.warmup_batches * self.batch_groups, step=1)  # verl's on_train_begin

    def _start_generation(self, global_step: int) -> None:
        """Before step ``global_step + 1``, this process's first (a standalone pool starts streaming here)."""

    def _submit(self, count: int, step: int) -> None:
        """Draw ``count`` prompts into the buffer, tagged ``step``; the colocated segments pick them up."""
        self.buffer.submit(count, step)

    def generate(self, step_input: Any, step: int, metrics: dict[str, float]) -> Iterator[Generated]:
        ctx = self.ctx
        self._submit(self.batch_groups, step)  # verl's prepare_step: one batch a step
        with ctx.timer("update_weights"):  # version G - 1 into the rollout (verl syncs at the end of G - 1)
            metrics.update(ctx.roles.actor_rollout_wg.update_weights())
        with ctx.timer("gen"):  # the trainer's wait for a batch
            metrics.update(self._generate_until_ready(step))
        groups = self.buffer.sample(self.batch_groups, step)
        metrics.update(off_policy_metrics(groups, step))
        if self.multi_turn:
            metrics.update(agent_metrics(groups))
        metrics.update(self.buffer.eviction_metrics())
        metrics["training/epoch"] = float(min(g.epoch for g in groups))
        # Off-policy trajectories differ from the actor by design; the weight-sync check needs on-policy ones.
        on_policy = all(t.min_version == step - 1 for g in groups for t in g.trajectories)
        yield Generated(self._groups_batch(groups, step), metrics, on_policy, info=groups)

    def end_step(self, step: int, metrics: dict[str, float], trained: list) -> tuple[Any, bool]:
        generated, batch = trained[-1]
        self._record(step, generated.info)
        self.buffer.end_step()
        return batch, generated.on_policy

    def _generate_until_ready(self, step: int) -> dict[str, float]:
        """Segments over the in-flight groups until a batch can be sampled (verl's sample-or-wait); agent loops
        run as one phase instead (:mod:`verl.trainer.v1.agent_phases`)."""
        if self.agents is not None:
            return self.agents.run_until_ready(step)
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
            inputs = segment_inputs(groups, self.ctx.sections.data.max_response_length, self.pad,
                                    self.buffer.required_uids(step))
            out = self.ctx.roles.actor_rollout_wg.generate_segment(self._segment_rows(inputs, need, len(groups),
                                                                                      step, segments))
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
        seed = (self.ctx.sections.trainer.seed * 100003 + step) * 131 + segment
        data.meta_info = {"need": need, "total_groups": total, "width": int(inputs["limits"].max()), "seed": seed}
        return data

    def _groups_batch(self, groups: list[PromptGroup], step: int):
        data = self.ctx.sections.data
        tensors, fields = groups_to_batch(groups, data.max_prompt_length, data.max_response_length, self.pad)
        batch = DataProto.from_dict(tensors, fields, {"seed": step})
        if not self.ctx.sections.transfer_queue.enable:
            return batch
        return self.ctx.step.on_data_plane(batch, step)

    def _record(self, step: int, groups: list[PromptGroup]) -> None:
        """The prompt ledger (rank 0): which prompts step ``step`` trained, and the totals so far."""
        if self.ctx.rank != 0:
            return
        ledger = self.buffer.ledger
        record = {"step": step, "trained": [g.uid for g in groups], "evicted": ledger.step_evicted_uids,
                  "drawn": ledger.drawn,
                  "trained_total": ledger.trained, "evicted_total": ledger.evicted, "reissued": ledger.reissued,
                  "in_flight": len(self.buffer.in_flight), "finished": len(self.buffer.finished)}
        os.makedirs(os.path.dirname(self.ledger_path) or ".", exist_ok=True)
        with open(self.ledger_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


class ColocateAsyncTrainer(PPOTrainer):
    """``trainer.v1.trainer_mode=colocate_async`` (see the module doc): the PPO trainer over a replay buffer."""

    batch_source_class = ReplayBufferSource
