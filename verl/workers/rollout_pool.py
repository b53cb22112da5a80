"""A standalone rollout pool: the rollout engine on ranks of its own, driven by the training ranks' controller.

Two sides of one protocol over the bridge (:mod:`verl.launcher.pools`), commands from training rank 0:

* :class:`RolloutPoolLink` (every training rank, inside the actor worker): ``sync_weights`` sends each
  rollout rank exactly its shard (:mod:`verl.hybrid_engine.weight_sync`, every training rank sends its
  part); ``generate`` (training rank 0) splits the prompts over the R replicas, sends each replica its
  rows, and gathers the replicas' rollouts;
* :func:`serve_rollout_pool` (every rollout rank): builds the engine (replica k = rollout ranks
  ``[k*t_g, (k+1)*t_g)``), then serves ``sync`` (receive into a staging buffer, swap it in: the engine
  reads the old weights until the swap), ``generate`` and ``stop`` until told to stop.

Commands and rollouts are pickled objects (prompts and rollouts as ``DataProto.to_bytes``); weights move as
raw buckets. The pool never sees the training layout's process groups, only the placement rank 0 sends.
"""

from __future__ import annotations

import dataclasses
import datetime
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.rollout.base import replica_params, replica_seed
from verl.errors import InputError
from verl.hybrid_engine.cross_pool import PoolPlacement, plan_cross_pool
from verl.hybrid_engine.lora_sync import METRIC_ADAPTER_BYTES as METRIC_LORA_BYTES
from verl.hybrid_engine.lora_sync import PoolLoRAReceiver, PoolLoRASender
from verl.hybrid_engine.weight_source import actor_weights
from verl.hybrid_engine.weight_sync import METRIC_BYTES, METRIC_DELTA_FRACTION, PoolReceiver, PoolSender
from verl.launcher.pools import current_bridge
from verl.launcher.spawn import FORWARDED_SIGNALS
from verl.protocol import DataProto
from verl.single_controller.generation_wait import GenerationTimeoutError, injected_delay
from verl.utils.device import get_device_name, is_cuda_available
from verl.utils.logging_utils import get_logger
from verl.utils.torch_dtypes import DTYPES
from verl.workers.agent_batch import AgentBatch
from verl.workers.agent_stream import serve_pool_agents

logger = get_logger(__name__)

# A rollout rank waits for its next command as long as training takes; a dead peer ends the job through the
# launcher (fail-fast), not through this wait.
COMMAND_WAIT = datetime.timedelta(days=30)
# How long training rank 0 waits for a streaming pool's `stopped` answers: a running segment ends at its next
# token once `stop` arrives, so this only runs out when a pool rank is gone (the launcher then ends the job).
STOP_WAIT_S = 120
METRIC_PEAK_EXTRA_MB = "perf/weight_sync_peak_extra_mb"


class RolloutPoolLink:
    """The training side: sends weights to the pool and (rank 0) requests rollouts from it."""

    def __init__(self, engine: Any, model_config: Any, training: Any, rollout_config: Any, bucket_bytes: int):
        self.bridge = current_bridge()
        split = self.bridge.split
        tp = rollout_config.tensor_model_parallel_size
        self.placement = PoolPlacement(training, tp, split.n_rollout // tp)
        self.rank = self.bridge.rank
        self.dtype = DTYPES[rollout_config.dtype]
        self.generation_timeout = float(rollout_config.generation_timeout)
        ce = rollout_config.checkpoint_engine
        plan = plan_cross_pool(model_config, self.placement, self.rank, bucket_bytes, rollout_config.dtype)
        weights = actor_weights(engine, model_config, training)
        # LoRA with lora.merge=false: the base at the first sync, then the adapters alone (lora_sync).
        self.lora = None if weights.lora is None else PoolLoRASender(weights.lora, model_config, self.placement,
                                                                      self.rank, bucket_bytes, self.bridge, ce.verify)
        self._lora_based = False
        if self.rank == 0:  # the pool plans from the same placement, and learns what to check
            for dst in range(self.placement.n_training, self.placement.world_size):
                self.bridge.send_object({"op": "init", "placement": self.placement, "bucket_bytes": bucket_bytes,
                                         "dtype": rollout_config.dtype, "verify": ce.verify,
                                         "delta": ce.delta and self.lora is None,
                                         "lora_placement": None if self.lora is None else self.lora.placement}, dst)
        # The training tensors: one flat buffer the engine bound once, or read by name at every sync (FSDP's
        # shards; Megatron's when the distributed optimizer keeps dense and expert parameters apart).
        self._sources_of = None
        self._plan, self._ce = plan, ce
        self.sender: PoolSender | None = None  # bound at the first sync when sources come by name
        device = self._device = get_device_name()
        if weights.named is not None:
            self._sources_of = lambda: weights.named(self.dtype, device)
        else:
            self.sender = PoolSender(plan, *weights.bound, self.bridge, verify=ce.verify, delta=ce.delta)
        self.summary = plan.summary()

    def _command(self, command: dict) -> None:
        for dst in range(self.placement.n_training, self.placement.world_size):
            self.bridge.send_object(command, dst)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Every training rank: send this rank's part of every rollout shard; returns the pool-wide figures.
        ``version``: the model version the weights are (a streaming pool tags the tokens it generates with it)."""
        if self.lora is not None:
            return self._sync_lora(version)
        if self.rank == 0:
            self._command({"op": "sync", "version": version})
        if self._sources_of is None:
            stats = self.sender.send()
        else:
            sources = self._sources_of()
            if self.sender is None:
                self.sender = PoolSender(self._plan, sources, None, self.bridge, verify=self._ce.verify,
                                         delta=self._ce.delta)
            stats = self.sender.send(sources)
            del sources
        totals = torch.tensor([stats.bytes, stats.dense_bytes], dtype=torch.float64)
        peak = torch.tensor([stats.peak_extra_bytes], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(totals)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {METRIC_BYTES: float(totals[0]), METRIC_DELTA_FRACTION: float(totals[0] / max(totals[1], 1.0)),
                METRIC_PEAK_EXTRA_MB: float(peak[0]) / 2**20}

    def _sync_lora(self, version: int | None) -> dict[str, float]:
        """LoRA (``lora.merge=false``): the base at the first sync, the adapters at every one. The training ranks
        first agree on the checksum every rollout rank's adapter buffer must have, which rank 0 sends with the
        command; each rollout rank proves what it applies against it."""
        sources, info = self.lora.prepare(self._device)  # collective over the training ranks
        base = not self._lora_based
        if self.rank == 0:
            self._command({"op": "sync", "version": version, "lora": {**info, "base": base}})
        sent = dense = 0
        if base:
            base_sources = self._sources_of()
            if self.sender is None:
                self.sender = PoolSender(self._plan, base_sources, None, self.bridge, verify=self._ce.verify)
            stats = self.sender.send(base_sources, dense=True)
            del base_sources
            sent, dense = stats.bytes, stats.dense_bytes
            self._lora_based = True
        stats = self.lora.send(sources)
        totals = torch.tensor([sent + stats.bytes, dense + stats.dense_bytes, stats.bytes], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(totals)
        return {METRIC_BYTES: float(totals[0]), METRIC_DELTA_FRACTION: float(totals[0] / max(totals[1], 1.0)),
                METRIC_LORA_BYTES: float(totals[2])}

    def generate(self, prompts: DataProto, params: Any, seed: int | None) -> DataProto:
        """Training rank 0: the rollouts of ``prompts``, split over the replicas as evenly as the rows allow
        (replica k samples with :func:`~verl.engine.rollout.base.replica_seed`, as a colocated replica does)."""
        p = self.placement
        rows = len(prompts)
        bounds = [rows * k // p.replicas for k in range(p.replicas + 1)]
        busy = [k for k in range(p.replicas) if bounds[k + 1] > bounds[k]]
        for k in busy:
            share = prompts.slice(bounds[k], bounds[k + 1])
            command = {"op": "generate", "prompts": share.to_bytes(), "params": replica_params(params, seed, k)}
            for j in range(p.rollout_tp):
                self.bridge.send_object(command, p.rollout_rank(k, j))
        outputs = [DataProto.from_bytes(self._receive_rollouts(k)) for k in busy]
        per_replica = [(len(out), out.meta_info.pop("metrics", {})) for out in outputs]
        metrics: dict[str, float] = {}
        for key in {key for _, m in per_replica for key in m}:
            seen = [(rows, m[key]) for rows, m in per_replica if key in m]
            if key.endswith("/min"):
                metrics[key] = min(v for _, v in seen)
            elif key.endswith("/mean"):  # over the replicas' rows (an agent loop's num_turns/mean, ...)
                metrics[key] = sum(rows * v for rows, v in seen) / max(sum(rows for rows, _ in seen), 1)
            else:  # times and maxima: the replicas run side by side
                metrics[key] = max(v for _, v in seen)
        merged = DataProto.concat(outputs)
        merged.meta_info["metrics"] = metrics
        return merged

    def _receive_rollouts(self, replica: int) -> bytes:
        """Replica ``replica``'s rollouts, waited for up to the rollout's deadline (not the collective timeout)."""
        leader = self.placement.rollout_rank(replica, 0)
        try:
            return self.bridge.recv_object(leader, timeout=datetime.timedelta(seconds=self.generation_timeout))
        except RuntimeError as err:
            # gloo says "Timed out waiting ..." or "Application timeout caused pair closure"; a dead peer differs.
            message = str(err).lower()
            if "timed out" not in message and "timeout" not in message:
                raise
            raise GenerationTimeoutError(
                f"rollout pool replica {replica} (pool rank {leader}) had not returned its rollouts after "
                f"actor_rollout_ref.rollout.generation_timeout={self.generation_timeout:g} s; raise it for longer "
                "rollouts") from None

    # ------------------------------------------------------------------ streaming (separate_async)
    def start_stream(self, params: Any, groups_per_segment: int, seed: int, version: int) -> None:
        """Training rank 0: switch the pool to streaming generation (verl's separate_async). Each replica keeps
        the prompt groups submitted to it in flight and generates in segments, on the weights of the latest
        sync, until ``groups_per_segment`` of them finished (or a command arrives: a sync interrupts the running
        segment, its partial responses resume on the new weights); finished groups stream back to this rank,
        where one thread per replica queues them (:meth:`poll`). ``version``: the model version of the weights the
        pool holds (synced just before)."""
        import queue
        import threading

        p = self.placement
        self._results: queue.Queue = queue.Queue()
        self._replica_load = [0] * p.replicas
        for k in range(p.replicas):
            command = {"op": "stream", "params": params, "groups_per_segment": groups_per_segment,
                       "seed": replica_seed(seed, k), "version": version}
            for j in range(p.rollout_tp):
                self.bridge.send_object(command, p.rollout_rank(k, j))

        bridge = self.bridge  # close() drops self.bridge while these threads still drain the last messages

        def receive(replica: int) -> None:
            leader = p.rollout_rank(replica, 0)
            while True:
                message = bridge.recv_result(leader, timeout=COMMAND_WAIT)
                self._results.put(message)
                if message.get("op") == "stopped":
                    return

        self._receivers = [threading.Thread(target=receive, args=(k,), name=f"pool-results-{k}", daemon=True)
                           for k in range(p.replicas)]
        for thread in self._receivers:
            thread.start()

    def submit(self, groups: list) -> None:
        """Training rank 0: hand prompt groups to the replicas, each to the one with the fewest in flight."""
        p = self.placement
        shares: dict[int, list] = {}
        for group in groups:
            k = min(range(p.replicas), key=lambda r: self._replica_load[r])
            self._replica_load[k] += 1
            shares.setdefault(k, []).append(group)
        for k, share in shares.items():
            for j in range(p.rollout_tp):
                self.bridge.send_object({"op": "submit", "groups": share}, p.rollout_rank(k, j))

    def poll(self, timeout: float | None) -> list[dict]:
        """Training rank 0: the replicas' messages so far (waiting up to ``timeout`` s for the first one when
        there is none; None waits as long as it takes). Each: ``groups`` (finished), ``replica``, ``metrics``."""
        import queue

        messages = []
        try:
            messages.append(self._results.get(timeout=timeout) if timeout != 0 else self._results.get_nowait())
            while True:
                messages.append(self._results.get_nowait())
        except queue.Empty:
            pass
        for message in messages:
            self._replica_load[message["replica"]] -= len(message.get("groups", ()))
        return messages

    def close(self) -> None:
        """Training rank 0: tell the pool to stop (idempotent). A streaming pool answers with one ``stopped`` per
        replica; this waits for them (bounded), because a pool rank's send returns only once this rank posted the
        receive: leaving earlier fails that send, and with it the job."""
        if self.rank == 0 and self.bridge is not None:
            try:
                self._command({"op": "stop"})
                deadline = time.monotonic() + STOP_WAIT_S
                for thread in getattr(self, "_receivers", ()):
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
                    if thread.is_alive():
                        logger.warning("rollout pool: a replica had not answered `stop` after %d s", STOP_WAIT_S)
                        break
            finally:
                self.bridge = None


def _engine(config: Any, tokenizer: Any, replica: int, tp_group: Any, group_ranks: tuple[int, ...],
            bucket_bytes: int):
    """This rank's engine, built as the colocated worker builds it (the registry's constructor); a replica serves
    at most a whole training or validation batch."""
    from verl.engine.rollout.registry import RolloutSite, rollout_engine
    from verl.models.config import ModelConfig

    arr, data = config.actor_rollout_ref, config.data
    model_config = ModelConfig.from_pretrained(arr.model.path)
    rows = max(data.train_batch_size * arr.rollout.n, (data.val_batch_size or data.train_batch_size)
               * arr.rollout.val_kwargs.n)
    pad_id = tokenizer.pad_token_id if tokenizer is not None else 0
    site = RolloutSite(model_config, arr.model.path, tp_group, tuple(group_ranks), replica, pad_token_id=pad_id,
                       seed=int(config.trainer.seed), bucket_bytes=bucket_bytes, max_rows=rows,
                       max_seq_len=data.max_prompt_length + data.max_response_length, pool=True)
    return model_config, rollout_engine(arr.rollout.name).build(arr.rollout, site)


def serve_rollout_pool(config: Any, tokenizer: Any) -> int:
    """A rollout rank's life: build the engine, then serve the controller's commands until ``stop``."""
    from verl.engine.rollout.registry import rollout_capabilities
    from verl.models.rollout_shapes import rollout_param_specs

    bridge = current_bridge()
    # A preemption signal (Ctrl-C, SIGTERM, SIGUSR1) reaches every rank: the training ranks finish the step and
    # checkpoint, then send `stop`; this rank keeps serving until then instead of dying and failing the job.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, frame: logger.info("rollout pool: signal %d, serving until stop", signum))
    arr = config.actor_rollout_ref
    tp = arr.rollout.tensor_model_parallel_size
    pool_rank, pool_size = dist.get_rank(), dist.get_world_size()
    replica, tp_rank = divmod(pool_rank, tp)
    tp_group, group_ranks = None, (pool_rank,)
    group_backend = rollout_capabilities(arr.rollout.name).group_backend
    for k in range(pool_size // tp):  # every rank creates every group, in order
        ranks = tuple(range(k * tp, (k + 1) * tp))
        group = dist.new_group(list(ranks), backend=group_backend) if tp > 1 else None
        if k == replica:
            tp_group, group_ranks = group, ranks
    init = bridge.recv_object(0, timeout=COMMAND_WAIT)
    model_config, engine = _engine(config, tokenizer, replica, tp_group, group_ranks, init["bucket_bytes"])
    try:
        plan = plan_cross_pool(model_config, init["placement"], bridge.rank, init["bucket_bytes"], init["dtype"])
        specs = [(s.name, s.shape) for s in rollout_param_specs(model_config, tp, tp_rank)]
        receiver = PoolReceiver(plan, specs, bridge, verify=init["verify"])
        engine.resume()
        swap = engine.swaps_weight_buffer
        live = staging = None
        if swap:
            # The staging buffer: one more shard, so the engine can keep reading the old weights meanwhile.
            live = engine.weight_buffer()
            staging = torch.empty_like(live)
            for buffer in (live, staging):
                receiver.zero_padding(buffer)
        elif init["delta"] and is_cuda_available():
            raise InputError("actor_rollout_ref.rollout.checkpoint_engine.delta: expected a rollout whose weights stay "
                             "readable between syncs (native, or SGLang on CPU), found SGLang on a GPU (it drops "
                             "its push buffer after every push)")
        buffers = {"staging": staging, "live": live} if swap else None
        lora = None
        if init.get("lora_placement") is not None:  # LoRA, lora.merge=false: the base once, then adapters only
            lora = PoolLoRAReceiver(model_config, init["lora_placement"], bridge.rank, init["bucket_bytes"], bridge,
                                    verify=init["verify"], device=engine.weight_buffer().device)

        def receive(target: torch.Tensor, live: torch.Tensor | None, command: dict | None) -> None:
            info = (command or {}).get("lora")
            if lora is None:
                receiver.receive(target, live)
                return
            if info is None:
                raise RuntimeError("rollout pool: expected the LoRA sync's checksums with the sync command, found none")
            if info["base"]:
                receiver.receive(target, None)
                lora.capture_base(target)
            lora.receive(target, restore=not info["base"], info=info)

        def sync(command: dict | None = None) -> None:
            if buffers is not None:
                receive(buffers["staging"], buffers["live"], command)
                # The step boundary: the new weights become the engine's.
                buffers["staging"], buffers["live"] = engine.swap_weight_buffer(buffers["staging"]), buffers["staging"]
            else:  # SGLang: its push buffer (kept in shared memory on CPU: the last sync's weights)
                buffer = engine.weight_buffer()
                receiver.zero_padding(buffer)
                receive(buffer, buffer, command)
                engine.push_weights()
                del buffer  # the engine's shutdown unlinks its shared buffer only when nothing here maps it

        # rollout.multi_turn: a generate command runs the agent loops (the sync trainer's rollouts, validation)
        agent_batch = AgentBatch(arr, tokenizer) if arr.rollout.multi_turn.enable else None

        def generate(command: dict) -> None:
            start = time.perf_counter()
            time.sleep(injected_delay(pool_rank, "VERL_TEST_SLOW_POOL_GENERATION"))
            prompts = DataProto.from_bytes(command["prompts"])
            if agent_batch is not None:
                out = agent_batch.generate(engine, prompts, command["params"], tp_rank, arr.rollout.prompt_length)
            else:
                out = engine.generate_sequences(prompts, command["params"])
            if out is not None and tp_rank == 0:  # beside the agent loops' own metrics
                out.meta_info["metrics"] = {**out.meta_info.get("metrics", {}),
                                            "timing_s/generate_sequences": time.perf_counter() - start}
                bridge.send_object(out.to_bytes(), 0)

        while True:
            command = bridge.recv_object(0, timeout=COMMAND_WAIT)
            op = command["op"]
            if op == "sync":
                sync(command)
            elif op == "generate":
                generate(command)
            elif op == "stream" and agent_batch is not None:  # agent loops streaming across weight syncs
                import queue

                commands: queue.Queue = queue.Queue()
                receive_commands(commands)
                return serve_pool_agents(
                    command, engine, commands, lambda message: bridge.send_result(message, 0), sync=sync,
                    generate=generate, replica=replica, tp_rank=tp_rank, config=arr, tokenizer=tokenizer,
                    prompt_length=config.data.max_prompt_length, response_length=config.data.max_response_length)
            elif op == "stream":
                return _serve_stream(command, engine, replica, tp_rank, tp_group, sync, generate)
            elif op == "stop":
                return 0
            else:
                raise RuntimeError(f"rollout pool: expected a command sync/generate/stream/stop, found {op!r}")
    finally:
        engine.shutdown()


class ReplicaCommands:
    """The controller's commands as one rollout replica takes them. Every TP rank of the replica receives the same
    commands in the same order, each on its own thread, so one rank may already hold a command another has not
    seen yet. Where the replica's ranks generate together (the native engine: collectives in every layer), whether
    to take a command or run (or go on with) a segment is agreed over the TP group -- any rank holding one means
    all take it, the laggards blocking until it arrives -- so no rank starts a segment another skips, and no TP
    shard generates with weights a sync already replaced on another. ``group`` None: this rank decides alone (one
    rank, or SGLang, whose owner generates for the group)."""

    def __init__(self, group: Any):
        import queue

        self.queue: queue.Queue = queue.Queue()
        self.group = group
        self._device = None
        if group is not None:
            self._device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def any_waiting(self) -> bool:
        """Whether any rank of the replica holds a command (collective when agreed)."""
        waiting = not self.queue.empty()
        if self.group is None:
            return waiting
        flag = torch.tensor([int(waiting)], dtype=torch.int32, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def next(self, generating: bool) -> dict | None:
        """The next command, or None to run a segment (only while ``generating``)."""
        if generating and not self.any_waiting():
            return None
        return self.queue.get()


def _command_delay(pool_rank: int) -> float:
    """Fault injection for the tests (``VERL_TEST_POOL_COMMAND_DELAY=RANK:SECONDS``): pool rank RANK's command
    thread holds each command that long, so its replica's ranks see commands at different times."""
    import os

    rank, _, seconds = os.environ.get("VERL_TEST_POOL_COMMAND_DELAY", "").partition(":")
    return float(seconds) if rank.strip() and int(rank) == pool_rank else 0.0


def receive_commands(into: Any) -> None:
    """Put the controller's commands into the queue ``into`` as they arrive, on a thread of their own (until
    ``stop``), so that a rollout rank can generate meanwhile."""
    import threading

    bridge = current_bridge()
    delay = _command_delay(dist.get_rank())

    def receive() -> None:
        while True:
            command = bridge.recv_object(0, timeout=COMMAND_WAIT)
            if delay:
                time.sleep(delay)
            into.put(command)
            if command["op"] == "stop":
                return

    threading.Thread(target=receive, name="pool-commands", daemon=True).start()


def _serve_stream(start: dict, engine: Any, replica: int, tp_rank: int, tp_group: Any, sync: Any,
                  generate: Any) -> int:
    """A rollout rank under verl's separate_async: generate in segments over the prompt groups in flight on this
    replica, stream finished groups to training rank 0, and take the controller's commands between segments (a
    thread receives them, so the controller never waits on a running segment; any command waiting ends the
    running segment early: its unfinished responses keep their tokens and continue in the next segment, after a
    sync on the new weights, their prefix prefilled again)."""
    from verl.engine.rollout.partial import run_segment

    bridge = current_bridge()
    # SGLang's group engine generates on its owner alone (is_owner): its ranks need no agreement on segments.
    commands = ReplicaCommands(tp_group if tp_group is not None and not engine.owner_generates else None)
    receive_commands(commands.queue)
    params, per_segment, seed = start["params"], int(start["groups_per_segment"]), int(start["seed"])
    pad = engine.pad_token_id
    in_flight: list = []
    version: int | None = start.get("version")  # None: nothing is generated before the first sync
    segment = 0
    # An SGLang group's other ranks hold no engine: the owner generates for the group; they only take commands
    # (a sync is collective over the group).
    member_only = not engine.is_owner
    while True:
        generating = bool(in_flight) and version is not None and not member_only
        command = commands.next(generating)
        if command is not None:
            op = command["op"]
            if op == "submit":
                if not member_only:
                    in_flight.extend(command["groups"])
            elif op == "sync":
                began = time.time()
                sync(command)
                version = command["version"] if command.get("version") is not None else (version or 0) + 1
                if tp_rank == 0:  # for the run's timeline
                    bridge.send_result({"op": "synced", "replica": replica, "groups": [],
                                        "span": ("update_weights", began, time.time())}, 0)
            elif op == "generate":
                generate(command)
            elif op == "stop":
                if tp_rank == 0:
                    bridge.send_result({"op": "stopped", "replica": replica, "groups": []}, 0)
                return 0
            else:
                raise RuntimeError(f"rollout pool: expected a command submit/sync/generate/stop, found {op!r}")
            continue
        begin, began = time.perf_counter(), time.time()
        time.sleep(injected_delay(dist.get_rank(), "VERL_TEST_SLOW_POOL_GENERATION"))  # fault injection, as in generate
        sampling = dataclasses.replace(params, seed=seed * 100003 + segment)
        rows = run_segment(engine, in_flight, sampling, pad, version, min_groups=min(per_segment, len(in_flight)),
                           abort=lambda: not commands.queue.empty())  # SegmentStop agrees on it over TP
        segment += 1
        finished = [g for g in in_flight if g.finished]
        in_flight = [g for g in in_flight if not g.finished]
        if tp_rank == 0:
            metrics = {"timing_s/generate_segment": time.perf_counter() - begin, "rollout/segment_rows": float(rows)}
            bridge.send_result({"op": "finished", "replica": replica, "groups": finished, "metrics": metrics,
                                "span": ("generate", began, time.time())}, 0)
