"""The actor worker's rollout side: where its generation methods run, behind one set of methods.

* :class:`ColocatedRollout`: the rollout engine on the training ranks, fed by the 3D-HybridEngine (weights
  resharded in before a generation, the rollout memory released after it);
* :class:`PoolRollout`: a standalone rollout pool (``rollout.nnodes > 0``), fed by the pool link
  (:mod:`verl.workers.rollout_pool`): every training rank sends its part of the weights, training rank 0
  sends prompts and collects rollouts; the pool keeps its weights between generations.

The worker asks the side to sync weights, generate, continue segments (verl's partial rollout), run agent
phases across steps (colocate_async), stream (separate_async) and close; a side that cannot do one says so in
one line. The rollout's replica coordinates (``dp_rank``, ``dp_size``, ``tp_rank``) are derived here, once.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from verl.hybrid_engine.weight_sync import METRIC_BYTES as METRIC_SYNC_BYTES
from verl.hybrid_engine.weight_sync import METRIC_DELTA_FRACTION
from verl.protocol import DataProto

# What an agent phase reports when this rank ran none (nothing was opened).
IDLE_AGENT_METRICS = {"agent_loop/engine_calls": 0.0, "agent_loop/interrupted_turns": 0.0,
                      "agent_loop/held_turns": 0.0}


class RolloutSide:
    """The contract; ``synced``: the rollout holds the actor's current weights."""

    dp_rank: int
    dp_size: int
    tp_rank: int  # 0 on the rank that returns its replica's rollouts
    where = "rollout"  # how errors name this side

    def __init__(self) -> None:
        self.synced = False

    # ------------------------------------------------------------------ weights
    def sync_weights(self, version: int | None, force: bool = False) -> dict[str, float]:
        """The actor's weights into the rollout; returns the sync's metrics. ``version``: the asynchronous
        trainer's model version of those weights (None when not streaming); ``force``: send even when the
        rollout holds them already."""
        raise NotImplementedError

    def ensure_synced(self, version: int | None) -> dict[str, float]:
        return {} if self.synced else self.sync_weights(version)

    def release(self) -> None:
        """The actor's weights are about to change (or a generation ended): the rollout's copy is stale."""
        self.synced = False

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: DataProto, params: Any, seed: int | None, version: int | None) -> DataProto | None:
        """This replica's rollouts of ``prompts`` (None on ranks that do not return them)."""
        raise NotImplementedError

    def generate_segment(self, rows: DataProto, params: Any, version: int | None) -> DataProto | None:
        raise RuntimeError(f"generate_segment: expected a colocated rollout, found {self.where}")

    def agent_open(self, groups: list[dict], version: int, params: Any) -> dict[str, float]:
        raise RuntimeError(f"agent phases across steps (colocate_async): expected a colocated rollout, found "
                           f"{self.where}")

    def agent_poll(self, wait_s: float) -> list:
        raise RuntimeError(f"agent_poll: expected a colocated rollout, found {self.where}")

    def agent_pause(self) -> dict[str, float]:
        raise RuntimeError(f"agent_pause: expected a colocated rollout, found {self.where}")

    def resident_tensors(self) -> list | None:
        """The rollout engine's tensors held on this rank now (``memory/rollout_gb``); None: no engine here (a
        pool's link)."""
        return None

    @property
    def stream(self) -> Any:
        """The pool link that streams generation across steps (separate_async)."""
        raise RuntimeError(f"streaming generation (separate_async): expected a standalone rollout pool "
                           f"(actor_rollout_ref.rollout.nnodes > 0), found {self.where}")

    def close(self) -> None:
        """Stop what outlives a step (idempotent)."""


class ColocatedRollout(RolloutSide):
    """The rollout engine on the training ranks (:mod:`verl.engine.rollout.registry`), joined to the actor by
    the 3D-HybridEngine. ``engines``: the training engines whose idle state waits in host memory while the
    rollout generates (the config's ``*_offload`` keys)."""

    where = "a colocated rollout"

    def __init__(self, actor_engine: Any, engines: list[Any], model_config: Any, training: Any, arr: Any,
                 tokenizer: Any, *, seed: int, bucket_bytes: int, max_seq_len: int, max_batch_rows: int):
        from verl.engine.rollout import registry as rollout_registry
        from verl.hybrid_engine.groups import derive_groups
        from verl.hybrid_engine.hybrid_engine import HybridEngine, rollout_tp_process_group

        super().__init__()
        self.config = arr
        self.tokenizer = tokenizer
        self.engines = engines
        self._agent_batch = None  # rollout.multi_turn.enable: the agent loops of a generation call, built on first use
        self._agent_stream = None  # ... under colocate_async: the loops that live across steps (agent_open)
        rollout_tp = arr.rollout.tensor_model_parallel_size
        groups = derive_groups(training, rollout_tp)
        rank = dist.get_rank()
        rollout_engine = rollout_registry.rollout_engine(arr.rollout.name)
        self.dp_rank, group_ranks, tp_group = rollout_tp_process_group(
            groups, rank, backend=rollout_engine.capabilities.group_backend)
        self.tp_rank = groups.rollout_tp_rank[rank]
        self.dp_size = len(groups.rollout_tp_groups)
        # Rows one engine generates at once: its replica's share of a training or a validation batch.
        self.engine = rollout_engine.build(arr.rollout, rollout_registry.RolloutSite(
            model_config, arr.model.path, tp_group, tuple(group_ranks), self.dp_rank,
            pad_token_id=tokenizer.pad_token_id if tokenizer is not None else 0, seed=seed, bucket_bytes=bucket_bytes,
            max_rows=-(-max_batch_rows // self.dp_size), max_seq_len=max_seq_len))
        self.hybrid_engine = HybridEngine(actor_engine, self.engine, model_config, training, rollout_tp,
                                          bucket_bytes, arr.rollout.dtype, groups=groups)
        self.hybrid_engine.to_training()  # start with the rollout memory released

    def resident_tensors(self) -> list:
        return list(self.engine.resident_tensors())

    def sync_weights(self, version: int | None, force: bool = False) -> dict[str, float]:
        metrics = self.hybrid_engine.to_rollout()
        self.synced = True
        return metrics

    def release(self) -> None:
        """Free the rollout weights and KV cache; the next generation reshards again."""
        self.hybrid_engine.to_training()
        self.synced = False

    def generate(self, prompts: DataProto, params: Any, seed: int | None, version: int | None) -> DataProto | None:
        metrics = self.ensure_synced(version)
        start = time.perf_counter()
        try:
            offloaded = sum(engine.offload_idle_state() for engine in self.engines)
            if offloaded:
                metrics = {**metrics, "perf/offloaded_mb": offloaded / 2**20}
            if self.config.rollout.multi_turn.enable:
                out = self._generate_agent_loops(prompts, params)
            else:
                out = self.engine.generate_sequences(prompts, params)
        finally:
            for engine in self.engines:
                engine.onload()
            self.release()
        if out is None:  # an SGLang group's other ranks: the owner returns the group's rollout
            return None
        out.meta_info["metrics"] = {**metrics, **out.meta_info.get("metrics", {}),  # the agent loops' own
                                    "timing_s/generate_sequences": time.perf_counter() - start}
        return out

    def _generate_agent_loops(self, prompts: DataProto, params: Any) -> DataProto | None:
        """``rollout.multi_turn.enable``: this replica's agent loops over the batch
        (:mod:`verl.workers.agent_batch`)."""
        from verl.workers.agent_batch import AgentBatch

        if self._agent_batch is None:  # tools and custom loops are loaded once per worker
            self._agent_batch = AgentBatch(self.config, self.tokenizer)
        return self._agent_batch.generate(self.engine, prompts, params, self.tp_rank,
                                          self.config.rollout.prompt_length)

    def generate_segment(self, rows: DataProto, params: Any, version: int | None) -> DataProto | None:
        from verl.engine.rollout.partial import generate_segment

        meta = rows.meta_info
        inputs = {k: rows.batch[k] for k in ("input_ids", "attention_mask", "limits", "group", "required")}
        local_groups = int(inputs["group"].unique().numel())
        min_groups = -(-local_groups * int(meta["need"]) // int(meta["total_groups"]))
        metrics = self.ensure_synced(version)
        pad_token_id = self.engine.pad_token_id
        start = time.perf_counter()
        try:
            responses, mask, log_probs = generate_segment(self.engine, inputs, params, pad_token_id, min_groups)
        finally:
            self.release()
        if self.tp_rank != 0:
            return None
        pad = int(meta["width"]) - responses.shape[1]
        out = DataProto.from_dict({
            "responses": torch.nn.functional.pad(responses, (0, pad), value=pad_token_id),
            "response_mask": torch.nn.functional.pad(mask.to(torch.int64), (0, pad)),
            "rollout_log_probs": torch.nn.functional.pad(log_probs, (0, pad))})
        out.meta_info["metrics"] = {**metrics, "timing_s/generate_sequences": time.perf_counter() - start}
        return out

    def agent_open(self, groups: list[dict], version: int, params: Any) -> dict[str, float]:
        from verl.workers.agent_stream import AgentFollower, AgentStream

        metrics = self.ensure_synced(version)
        if self._agent_stream is None:
            server = self.engine.token_server(params, self.engine.pad_token_id)
            if self.tp_rank != 0:  # rollout TP > 1: the replica's rank 0 runs the loops, this rank follows
                self._agent_stream = AgentFollower(server)
            else:
                self._agent_stream = AgentStream.over(server, self.config, self.tokenizer, params)
        self._agent_stream.open(version, [g for g in groups if g["replica"] == self.dp_rank])
        return metrics

    def agent_poll(self, wait_s: float) -> list:
        return self._agent_stream.poll(wait_s)

    def agent_pause(self) -> dict[str, float]:
        metrics = self._agent_stream.pause() if self._agent_stream is not None else dict(IDLE_AGENT_METRICS)
        self.release()
        return metrics

    def close(self) -> None:
        if self._agent_stream is not None:
            self._agent_stream.close()
            self._agent_stream = None
        self.engine.shutdown()


class PoolRollout(RolloutSide):
    """A standalone rollout pool: this rank sends its part of the weights; training rank 0 also sends the
    prompts and returns the pool's rollouts (it is the one "replica" the worker's dispatch sees)."""

    where = "a standalone rollout pool"

    def __init__(self, actor_engine: Any, model_config: Any, training: Any, arr: Any, bucket_bytes: int):
        from verl.workers.rollout_pool import RolloutPoolLink

        super().__init__()
        self.link = RolloutPoolLink(actor_engine, model_config, training, arr.rollout, bucket_bytes)
        self.dp_rank, self.dp_size = 0, 1
        self.tp_rank = 0 if dist.get_rank() == 0 else 1  # rank 0 collects the pool's rollouts

    def sync_weights(self, version: int | None, force: bool = False) -> dict[str, float]:
        if self.synced and not force:  # the pool kept the current weights since the last sync
            return {METRIC_SYNC_BYTES: 0.0, METRIC_DELTA_FRACTION: 0.0}
        metrics = self.link.sync_weights(version)
        self.synced = True
        return metrics

    def generate(self, prompts: DataProto, params: Any, seed: int | None, version: int | None) -> DataProto | None:
        metrics = self.ensure_synced(version)
        if dist.get_rank() != 0:
            return None
        out = self.link.generate(prompts, params, seed)
        out.meta_info["metrics"] = {**metrics, **out.meta_info["metrics"]}
        return out

    @property
    def stream(self) -> Any:
        return self.link

    def close(self) -> None:
        self.link.close()


def build_rollout_side(actor_engine: Any, engines: list[Any], model_config: Any, training: Any, arr: Any,
                       tokenizer: Any, *, seed: int, bucket_bytes: int, max_seq_len: int,
                       max_batch_rows: int) -> RolloutSide:
    """A standalone pool when ``rollout.nnodes`` names one, else the colocated rollout."""
    if arr.rollout.nnodes:
        return PoolRollout(actor_engine, model_config, training, arr, bucket_bytes)
    return ColocatedRollout(actor_engine, engines, model_config, training, arr, tokenizer, seed=seed,
                            bucket_bytes=bucket_bytes, max_seq_len=max_seq_len, max_batch_rows=max_batch_rows)

