"""SGLang as the trainer's rollout: the SPMD ranks of one rollout TP group share one ``sglang.Engine``.

Rank 0 of the group (the *owner*) starts the engine (``tp`` SGLang scheduler processes, SGLang TP rank
``i`` serving the group's rank ``i``) and generates for the group's prompts. Every rank reshards the
actor's weights into its own flat rollout buffer (the 3D-HybridEngine writes it in place), then sends
the owner only a *handle* per bucket: torch's multiprocessing serialization of a view of that buffer,
a shared-memory file name on CPU or a CUDA IPC handle on GPUs (bytes of metadata). SGLang TP rank ``i``
opens rank ``i``'s handles and our custom loader (``sglang_loader``) copies each bucket into its
parameters with ``verl._C`` copy programs. The weights never pass through the owner.

Lifetime: the engine starts once (with ``load_format=dummy``: every generation is preceded by a push),
sleeps after each generation when ``free_cache_engine`` (SGLang's ``release_memory_occupation``; a no-op
on CPU, where SGLang's memory saver is unavailable) and resumes before the next push. :meth:`shutdown`
stops it; so does the interpreter's exit (SGLang registers ``atexit``), and SGLang's scheduler processes
kill themselves when the owner dies (``PR_SET_PDEATHSIG``), so no engine outlives its rank. They ignore the
preemption signals a rank's process group receives (SIGUSR1, SIGTERM, SIGHUP, SIGINT): the trainer finishes the
step with them, checkpoints, and stops them on its way out. On CPU, :meth:`shutdown` also removes the
rank's buffer from /dev/shm (:mod:`verl.utils.shared_buffer`): the killed schedulers never release it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl.engine.rollout.base import BaseRollout, SamplingParams
from verl.engine.rollout.sglang_loader import spec_offsets
from verl.engine.rollout.sglang_rollout import (
    SGLangRollout,
    SGLangRolloutError,
    bucket_elems,
    bucket_ranges,
    cpu_threads_bind,
    kv_pool_tokens,
    reserve_loopback_port,
    serialize_handle,
)
from verl.models.config import ModelConfig
from verl.models.hf_io import read_config
from verl.models.rollout_shapes import rollout_param_specs
from verl.protocol import DataProto
from verl.utils.device import get_device_name
from verl.utils.shared_buffer import shared_name, unlink_if_unmapped

METRIC_PUSH_SECONDS = "timing_s/push_weights"
METRIC_HANDLE_BYTES = "perf/push_handle_bytes"


def engine_model_dir(model_path: str, into: str) -> str:
    """An HF directory SGLang can build the model from: ``model_path`` itself, or (a bare config.json
    file, the trainer's seeded init) a directory in ``into`` holding a copy of it."""
    if os.path.isdir(model_path):
        return model_path
    os.makedirs(into, exist_ok=True)
    config = read_config(model_path)
    with open(os.path.join(into, "config.json"), "w", encoding="utf-8") as dst:
        json.dump(config, dst)
    return into


def free_port_below_ephemeral(low: int = 20000, high: int = 29999, attempts: int = 64) -> int:
    """A free loopback port in ``[low, high]``, drawn from a generator of this process's own: SGLang's own draw
    uses the global ``random``, which the trainer seeds the same on every rank, so two engines started together
    picked the same port. (The engine itself holds its port while it runs: ``reserve_loopback_port``.)"""
    with reserve_loopback_port(low, high, attempts) as sock:
        return sock.getsockname()[1]


def owner_cpus(group_index: int, num_groups: int, cpus: Sequence[int] | None = None) -> list[int]:
    """The cores of engine ``group_index`` among ``num_groups`` engines on this host: contiguous blocks, so
    the engines' OpenMP threads do not fight over cores (sharing round-robin when cores are fewer)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < num_groups:
        return [cpus[group_index % len(cpus)]]
    per = len(cpus) // num_groups
    return cpus[group_index * per:(group_index + 1) * per]


# Signals the launcher (and Slurm's --signal, scancel -s) deliver to a rank's whole process group. They mean
# "checkpoint and stop" to the trainer; SGLang's processes have no handler and would die mid-step, so they
# start with them ignored (dispositions set to ignore survive fork and exec). They still end with the owner:
# SIGKILL from the kernel when it dies, from SGLang's shutdown otherwise.
RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


@contextlib.contextmanager
def signals_ignored_by_children(signals: Sequence[signal.Signals] = RANK_SIGNALS) -> Iterator[None]:
    """Processes started inside this block inherit ``signals`` ignored; this process's handlers come back after."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class SGLangGroupRollout(BaseRollout):
    """This rank's part of a rollout TP group served by one SGLang engine (see the module docstring).

    ``group_ranks``: the global ranks of the group, in rollout TP order; ``group``: a process group over
    them (None when the group is this rank alone); ``group_index``/``num_groups``: which rollout replica
    this is, of how many on this host (CPU core split). ``max_rows``/``max_seq_len`` size SGLang's KV pool
    on CPU. ``engine_kwargs`` go to ``sglang.Engine`` last (verl's ``rollout.engine_kwargs.sglang``).
    """

    owner_generates = True  # the owner drives the group's one engine; its other ranks hold none

    def __init__(self, config: ModelConfig, model_path: str, group_ranks: Sequence[int], group: Any,
                 dtype: torch.dtype, bucket_bytes: int, pad_token_id: int = 0, seed: int = 0,
                 group_index: int = 0, num_groups: int = 1, max_rows: int = 64, max_seq_len: int = 512,
                 mem_fraction_static: float = 0.5, free_cache_engine: bool = True,
                 engine_kwargs: dict[str, Any] | None = None):
        super().__init__(config, pad_token_id)
        self.group_ranks = tuple(group_ranks)
        self.group = group
        self.tp_size = len(self.group_ranks)
        self.tp_rank = self.group_ranks.index(dist.get_rank())
        self.owner = self.group_ranks[0]
        self.dtype = dtype
        self.bucket_bytes = int(bucket_bytes)
        self.free_cache_engine = free_cache_engine
        self.device = get_device_name()
        self.numel = spec_offsets(rollout_param_specs(config, self.tp_size, self.tp_rank))[1]
        self.ranges = bucket_ranges(self.numel, bucket_elems(dtype, self.bucket_bytes))
        self._buffer: torch.Tensor | None = None
        self._buffer_name: str | None = None  # its /dev/shm name on CPU
        self.engine: SGLangRollout | None = None
        self._model_dir: str | None = None
        if self.device == "cpu":
            # Buffers shared by file name: any process can open them from the handle alone (the fd route
            # needs a connection to this process authenticated with its multiprocessing authkey, which
            # SGLang's schedulers, children of another rank, do not hold).
            torch.multiprocessing.set_sharing_strategy("file_system")
        if self.is_owner:
            try:
                self._start_engine(model_path, dtype, pad_token_id, seed, group_index, num_groups, max_rows,
                                   max_seq_len, mem_fraction_static, dict(engine_kwargs or {}))
            except BaseException:
                self.shutdown()  # the temporary model directory of a failed start
                raise

    @property
    def is_owner(self) -> bool:
        return self.tp_rank == 0

    def _start_engine(self, model_path, dtype, pad_token_id, seed, group_index, num_groups, max_rows, max_seq_len,
                      mem_fraction_static, engine_kwargs) -> None:
        model_dir = model_path
        if not os.path.isdir(model_path):  # a bare config.json: SGLang needs a directory
            self._model_dir = tempfile.mkdtemp(prefix="verl_sglang_model_")
            model_dir = engine_model_dir(model_path, self._model_dir)
        # sleep_on_idle: an idle scheduler blocks on its sockets instead of spinning, which took the cores
        # the colocated training phases run on (they ran 3-4x slower beside two spinning engines on 2 cores).
        args: dict[str, Any] = dict(load_format="dummy", sleep_on_idle=True)  # SGLangRollout draws the port
        if self.device == "cpu":
            args["max_total_tokens"] = kv_pool_tokens(max_rows, max_seq_len)
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
                self.tp_size, owner_cpus(group_index, num_groups))
        else:  # the group's ranks sit on consecutive devices of this host, the owner's first
            args["base_gpu_id"] = torch.cuda.current_device()
        args.update(engine_kwargs)
        # SGLang's shutdown kills every child of this process, multiprocessing's resource tracker included, and
        # its start switches multiprocessing to spawn, under which new semaphores register with that tracker.
        # tqdm makes its write lock on first use: made after the start, it was unregistered at exit with a
        # fresh tracker that never saw it (a KeyError traceback per rank). Made now, it is never registered.
        from tqdm import tqdm

        tqdm.get_lock()
        with signals_ignored_by_children():
            self.engine = SGLangRollout(self.config, model_dir, tp_size=self.tp_size, dtype=dtype,
                                        device=self.device, pad_token_id=pad_token_id, seed=seed,
                                        mem_fraction_static=mem_fraction_static, **args)

    # ---------------------------------------------------------------- the hybrid engine's rollout interface
    def weight_buffer(self) -> torch.Tensor:
        """This rank's flat rollout buffer (``rollout_param_specs`` order) for the reshard to write; in
        shared memory on CPU (kept across steps), CUDA memory on GPUs (dropped after each push)."""
        if self._buffer is None:
            flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            if self.device == "cpu":
                flat = flat.share_memory_()
                self._buffer_name = shared_name(flat)
            self._buffer = flat
        return self._buffer

    def push_weights(self) -> dict[str, float]:
        """Hand every bucket of this rank's resharded buffer to SGLang TP rank ``tp_rank`` (collective over
        the group). Returns the push's seconds and the handle bytes the owner gathered (rank-local)."""
        if self._buffer is None:
            raise SGLangRolloutError("push: expected a resharded weight buffer, found none (reshard first)")
        start = time.perf_counter()
        mine = [serialize_handle(self._buffer[a:b]) for a, b in self.ranges]
        if self.group is None:
            gathered = [mine]
        else:
            gathered = [None] * self.tp_size if self.is_owner else None
            dist.gather_object(mine, gathered, dst=self.owner, group=self.group)
        error = None
        if self.is_owner:
            try:
                self.engine.push_serialized(self.ranges, gathered)
            except Exception as err:  # noqa: BLE001 - every rank of the group raises it, none waits forever
                error = f"{type(err).__name__}: {err}"
        if self.group is not None:  # the buffers may be reused only once SGLang has copied them
            status = [error]
            dist.broadcast_object_list(status, src=self.owner, group=self.group)
            error = status[0]
        if error is not None:
            raise SGLangRolloutError(f"weight push to SGLang (rollout group {list(self.group_ranks)}) failed: {error}")
        if self.device != "cpu":
            self._buffer = None  # SGLang holds its own copy now
        handle_bytes = sum(len(p) for ranks in gathered for p in ranks) if self.is_owner else sum(len(p) for p in mine)
        return {METRIC_PUSH_SECONDS: time.perf_counter() - start, METRIC_HANDLE_BYTES: float(handle_bytes)}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """This rank's named rollout-layout tensors -> its buffer, then the group's push (collective: every rank
        of the group calls it with its own shard)."""
        specs = rollout_param_specs(self.config, self.tp_size, self.tp_rank)
        offsets, _ = spec_offsets(specs)
        shapes = {spec.name: spec.shape for spec in specs}
        flat, seen = self.weight_buffer(), set()
        for name, tensor in named_tensors:
            if tuple(tensor.shape) != shapes.get(name, ()):
                raise SGLangRolloutError(f"load_weights {name}: expected a rollout tensor of shape "
                                         f"{shapes.get(name)}, found {tuple(tensor.shape)}")
            flat[offsets[name]:offsets[name] + tensor.numel()].copy_(tensor.reshape(-1))
            seen.add(name)
        missing = sorted(set(shapes) - seen)
        if missing:
            raise SGLangRolloutError(f"load_weights: expected every rollout tensor, found {missing[:3]} missing")
        self.push_weights()

    def resume(self) -> None:
        if self.engine is not None:
            self.engine.resume()

    def release(self) -> None:
        """After generation: SGLang's KV cache and weights are released (``free_cache_engine``)."""
        if self.engine is not None and self.free_cache_engine:
            self.engine.release()

    # ---------------------------------------------------------------- generation
    def generate_sequences(self, prompts: DataProto, sampling_params: SamplingParams) -> DataProto | None:
        """The group's prompts -> verl's rollout fields on the owner; None on the other ranks (the
        rollout mesh collects from rollout TP rank 0)."""
        if self.engine is None:
            return None
        return self.engine.generate_sequences(prompts, sampling_params)

    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """Agent loops (``rollout.multi_turn``): the owner's server over its engine; the group's other ranks get
        one whose :meth:`follow` returns at once (SGLang's own processes are the group's TP ranks)."""
        from verl.engine.rollout.sglang_token_server import SGLangTokenServer

        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        return SGLangTokenServer(self.engine if self.engine is not None else self, base, pad)

    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           sampling_params: SamplingParams, pad_token_id: int, limits: torch.Tensor | None = None,
                           stop: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Partial rollout's segment (:mod:`verl.engine.rollout.partial`) on the owner, which alone decides when
        it stops (the stop rule needs no agreement: the group's other ranks do not generate); the other ranks
        get empty [B, 0] tensors (the rollout mesh collects from rollout TP rank 0)."""
        if self.engine is None:
            rows = input_ids.shape[0] * (1 if limits is not None else sampling_params.n)
            empty = torch.zeros(rows, 0, dtype=torch.int64)
            return empty, empty.clone(), torch.zeros(rows, 0, dtype=torch.float32)
        return self.engine.generate_responses(input_ids, attention_mask, sampling_params, pad_token_id,
                                              limits=limits, stop=stop)

    def shutdown(self) -> None:
        """Stop the engine (its scheduler processes), remove the owner's temporary model directory and this
        rank's weight buffer's /dev/shm name (the killed schedulers never release it); idempotent."""
        engine, self.engine = self.engine, None
        # The buffer is dropped first: closing its mapping messages this process's torch_shm_manager, a
        # child that SGLang's shutdown kills along with the schedulers (a close after that aborts the rank
        # on a broken pipe). The name goes once the schedulers, which never release their mapping, are dead.
        self._buffer = None
        name, self._buffer_name = self._buffer_name, None
        if engine is not None:
            engine.shutdown()
        if name is not None:
            unlink_if_unmapped(name)  # kept while something in this process still holds the buffer
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            self._model_dir = None
