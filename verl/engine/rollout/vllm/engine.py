"""vLLM as a rollout engine: vLLM's offline engine (``vllm.LLM``) in this process, over one rollout replica.

Weights: the 3D-HybridEngine reshards the actor into this rank's flat rollout buffer (``weight_buffer``, the rollout
layout of :mod:`verl.models.rollout_shapes`, as for the other engines); ``push_weights`` then hands vLLM that
buffer's tensors by name through vLLM's own in-place reload (the worker's ``reload_weights`` over a weights
iterator, in checkpoint format: vLLM's layerwise reload restores each layer's loading shapes, its model's
``load_weights`` takes the layout's stacked q/k/v and gate/up tensors as fused-on-disk ones, and the layer's
post-load processing, the CPU backend's weight packing included, runs again). A mixture of experts' stacked expert
tensors go as their per-expert HF parts, which vLLM's fused-MoE loader places. The vocab tables go without the
rollout layout's padding rows (vLLM pads its own). Nothing is read from disk after the start (``load_format``
dummy in the trainer).

vLLM runs its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the reload's tensors are
passed by reference, not serialized.

Rollout TP > 1: every rank of the rollout TP group runs its own ``vllm.LLM`` with vLLM's external launcher
(``distributed_executor_backend="external_launcher"``: vLLM's TP group is built over the trainer's torch.distributed
ranks, each rank one TP worker, in this process), and every rank of the group calls ``generate`` with the same
requests, as the native engine's TP ranks do. Its weights: the rank's own rollout-layout shard (fused q/k/v and
gate/up rows of its heads, its rows of the padded vocab, its input columns of the row-parallel projections), which
is vLLM's per-rank parameter layout, so each tensor is copied into the parameter of the same name as it is, inside
vLLM's layerwise reload (:func:`load_rank_shards`); nothing is gathered, and vLLM's weight loaders, which cut a full
checkpoint tensor, are not used.

Log-probs: ``logprobs_mode="processed_logprobs"``, the log-softmax of the logits after temperature (and top-k/top-p
when set): those of the distribution sampled from; greedy requests get the raw log-softmax. With top-k and top-p
off (verl's RL defaults) this is exactly ``log_softmax(logits / temperature)``, what the actor recomputes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from verl.engine.rollout.base import BaseRollout, RolloutInputError, SamplingParams
from verl.engine.rollout.partial import RoundRequest, RoundResult, generate_in_rounds
from verl.engine.rollout.sglang_group import METRIC_PUSH_SECONDS  # the push's seconds, one name for both
from verl.engine.rollout.sglang_loader import spec_offsets
from verl.errors import InputError
from verl.models.config import ModelConfig
from verl.models.rollout_shapes import kv_heads_per_rank, rollout_param_specs
from verl.models.spec.base import TP, Fusion
from verl.models.spec.registry import model_spec
from verl.utils.device import is_cuda_available
from verl.utils.torch_dtypes import NAME_OF_DTYPE

# Partial rollout: new tokens per round between checks of the stop rule (as SGLang's; a round is one batch through
# vLLM's scheduler).
SEGMENT_ROUND_TOKENS = 16
# vLLM 0.32's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The block features beyond the Llama/Qwen block (ModelConfig.block_features) checked against transformers on vLLM:
# vLLM builds its model from the checkpoint's own config and the push fills parameters by their HF names, so none
# needed wiring. tests/vllm: a tiny model with every one of these (a window shorter than the prompts, soft-capped
# logits, a query scale other than head_dim) and a real checkpoint that has them, past its 512-token window.
VLLM_BLOCK_FEATURES = ("hidden_act", "norm_weight_offset", "norm_scale_in_float32", "embedding_multiplier",
                       "final_logit_softcapping", "query_pre_attn_scalar", "sliding_rope_theta", "sliding_window",
                       "sliding_layers", "attn_post_norm", "mlp_post_norm")


class VLLMConfigError(InputError):
    """A rollout setting or model vLLM cannot run here (one line, exit 2)."""


def check_vllm_model(config: ModelConfig, tp_size: int) -> None:
    """The limits of this vLLM path, before anything starts. A block feature outside :data:`VLLM_BLOCK_FEATURES`
    was never checked against transformers on vLLM, so it is refused."""
    if tp_size > 1 and config.is_moe:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: the vLLM rollout of a "
                              f"mixture of experts runs TP 1 (vLLM's per-rank fused-MoE tensors are not the rollout "
                              f"layout's stacked experts): use 1, or rollout.name=native")
    if tp_size > 1 and config.num_attention_heads % tp_size:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: vLLM splits the "
                              f"{config.num_attention_heads} query heads evenly over TP ranks: use a divisor of "
                              f"{config.num_attention_heads}")
    untested = [f for f in config.block_features() if f not in VLLM_BLOCK_FEATURES]
    if untested:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.name=vllm: model_type {config.model_type} needs the block "
                              f"features {untested}, which the vLLM rollout is not tested for: use native")
    if not is_cuda_available() and config.head_dim not in CPU_HEAD_DIMS:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.name=vllm: vLLM's CPU attention takes head_dim in "
                              f"{list(CPU_HEAD_DIMS)}, found head_dim={config.head_dim}: use native")


def vocab_rollout_names(config: ModelConfig) -> set[str]:
    """The rollout names of the vocab tables (embedding, untied head): padded in the rollout layout."""
    return {p.rollout for p in model_spec(config.model_type).rollout_params(config) if p.rollout_tp is TP.VOCAB}


def stacked_expert_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """The rollout layout's stacked expert tensors (TP 1: every expert's parts, expert-major, on dim 0) by rollout
    name: the HF checkpoint tensors each holds, in order, with their rows. vLLM's reload takes experts by these
    per-expert names (its fused-MoE loader places each one) and skips a name it does not know without a word."""
    return {p.rollout: tuple((name, shape[0]) for name, shape in zip(p.hf, p.shapes, strict=True))
            for p in model_spec(config.model_type).rollout_params(config) if p.fusion is Fusion.STACKED}


def checkpoint_named(name: str, tensor: torch.Tensor,
                     stacked: Mapping[str, tuple[tuple[str, int], ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout tensor as vLLM's reload takes it: itself, or a stacked expert tensor's per-expert HF parts
    (views)."""
    if name not in stacked:
        yield name, tensor
        return
    names, rows = zip(*stacked[name], strict=True)
    yield from zip(names, tensor.split(list(rows)), strict=True)


def check_tp_group(tp_group: Any) -> tuple[int, int]:
    """(TP size, this rank's TP rank). vLLM's external launcher builds its TP groups from consecutive global ranks
    ([0, tp), [tp, 2 tp), ...) over the default group; the rollout TP group must be one of them."""
    import torch.distributed as dist

    if tp_group is None:
        return 1, 0
    ranks = dist.get_process_group_ranks(tp_group)
    size = len(ranks)
    if ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={size}: vLLM's TP groups are "
                              f"consecutive ranks [k*{size}, (k+1)*{size}), found the rollout TP group {ranks} (this "
                              f"actor layout interleaves them): use rollout TP 1, or rollout.name=native")
    return size, dist.get_rank(tp_group)


SHM_DIR = "/dev/shm"


def job_shm_ident(tp_group: Any) -> str:
    """A name no other job's vLLM shares, the same on every rank of ``tp_group`` (drawn by its first rank)."""
    import uuid

    import torch.distributed as dist

    box = [f"verl-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(box, group=tp_group, group_src=0)
    return box[0]


@contextlib.contextmanager
def shm_names_of_this_job(ident: str):
    """vLLM's CPU TP all-reduce puts its buffers in shared memory named after the launch's init method; under the
    external launcher that is ``env://`` for every job, so two jobs on one node (or a killed job's leftovers) collide
    ("create shm in SHMManager failed. errno: 17"). Inside this block the names start with ``ident``."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    make = _CPUSHMDistributed.make_group_name

    def job_group_name(communicator):
        # (the launch's ident is "//" under env://: a name with "/" past its start is refused by shm_open)
        return ident + make(communicator).replace("/", "")

    _CPUSHMDistributed.make_group_name = staticmethod(job_group_name)
    try:
        yield
    finally:
        _CPUSHMDistributed.make_group_name = staticmethod(make)


def remove_shm(ident: str) -> None:
    """Unlink this job's vLLM shared-memory buffers (mappings still open stay valid until they close)."""
    if not os.path.isdir(SHM_DIR):
        return
    for name in os.listdir(SHM_DIR):
        if name.startswith(ident):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(SHM_DIR, name))


def load_rank_shards(model: Any, model_config: Any, tensors: Mapping[str, torch.Tensor],
                     vocab_rows: Mapping[str, int]) -> None:
    """This TP rank's rollout-layout tensors -> vLLM's parameters of the same names, in place, through vLLM's
    layerwise reload (each layer restored to its loading shapes, filled, then processed again: the CPU weight
    packing). Each tensor already is the rank's shard in vLLM's per-rank layout, so it is copied as it is (shapes
    checked); ``vocab_rows``: for a vocab table, the real rows of this rank's slice (the padding rows after them are
    zeroed, as vLLM's own loader leaves them)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        make_online_process_loader,
    )

    own = {name for name, _ in model.named_parameters()}
    missing = sorted(own - set(tensors))
    unknown = sorted(set(tensors) - own)
    if missing or unknown:
        # (the rollout layout and vLLM's model disagree: ours to fix, not the user's input)
        raise RuntimeError(f"vllm load_rank_shards: expected the rollout tensors to name vLLM's parameters, found "
                           f"{missing[:3]} without a tensor and {unknown[:3]} without a parameter")

    def shard_loader(real_rows: int | None):
        def copy_shard(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            if tuple(param.shape) != tuple(loaded_weight.shape):
                raise RuntimeError(f"vllm load_rank_shards: expected a shard of shape {tuple(param.shape)}, found "
                                   f"{tuple(loaded_weight.shape)}")
            if real_rows is None or real_rows >= loaded_weight.size(0):
                param.data.copy_(loaded_weight)
                return
            param.data[:real_rows].copy_(loaded_weight[:real_rows])
            param.data[real_rows:].zero_()  # the padding rows (< 64): zeros, whatever the buffer holds there
        return copy_shard

    initialize_layerwise_reload(model)
    for name, tensor in tensors.items():
        module_name, _, param_name = name.rpartition(".")
        layer = model.get_submodule(module_name)
        param = getattr(layer, param_name)
        # the loader the layerwise reload defers to (vLLM's would cut a full tensor)
        param.weight_loader = shard_loader(vocab_rows.get(name))
        param.weight_loader = make_online_process_loader(layer, param_name)
        param.weight_loader(param, tensor)
    finalize_layerwise_reload(model, model_config)


def vllm_sampling_params(sp: SamplingParams, vllm_module: Any) -> Any:
    """verl's sampling settings as vLLM's ``SamplingParams``: our stop rule (stop ids, the stop token kept), the
    sampled token's log-prob, ``n`` samples of each prompt."""
    greedy = sp.greedy
    return vllm_module.SamplingParams(
        n=sp.n, temperature=0.0 if greedy else sp.temperature, top_p=1.0 if greedy else sp.top_p,
        top_k=0 if greedy or sp.top_k in (-1, 0) else sp.top_k, max_tokens=sp.response_length,
        stop_token_ids=list(sp.stop_ids), ignore_eos=True,  # eos is among stop_ids unless ignore_eos
        logprobs=0, seed=sp.seed, detokenize=False)


@contextlib.contextmanager
def default_group_kept():
    """vLLM's in-process engine builds its groups on torch.distributed's default group when one exists (the
    trainer's: every rank starts its engine together, so the groups' collective creation matches) and, at its
    shutdown, destroys the default group too. Inside this block only its own groups go; the trainer keeps its own
    (found as 'Default process group has not been initialized' at the barrier after the last step)."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_own_groups_only(group=None):
        if group is not None:
            destroy(group)

    dist.destroy_process_group = destroy_own_groups_only
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def refresh_tied_head(model: Any) -> None:
    """vLLM's CPU linear layers keep a GEMM handle (oneDNN's, or a packed copy) made from their weight after loading.
    A tied head shares the embedding's weight, which the reload replaced, but is not among the reloaded layers, so
    its handle still computed the old embedding's logits (greedy after a push differed from transformers on tied
    models only). Rebuild it from the weight it shares now."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def refresh_cpu_moe_packing(model: Any) -> None:
    """vLLM's CPU fused-MoE kernel packs the expert weights into its grouped-GEMM layout at the first load only; a
    reload copies the new experts into that storage unpacked (``replace_parameter(..., prefer_copy=True)`` on a
    weight update), which the kernel then reads as packed (measured: log-probs off by 0.59 on a tiny Qwen3-MoE,
    every parameter equal to the checkpoint's). Pack them again from what the reload wrote."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and type(kernel.fused_experts).__name__ == "CPUUnquantizedExperts":
            kernel.fused_experts.process_weights_after_loading(module)


class VLLMRollout(BaseRollout):
    """``vllm.LLM`` over ``model_path`` (an HF directory) on this rank. ``load_format="dummy"``: random weights until
    the first push (the trainer); ``"auto"``: the checkpoint's (``verl generate``). ``tp_group``: this rank's rollout
    TP group, each rank one of vLLM's TP workers (the external launcher). ``worker_tp`` > 1: instead, vLLM's own TP
    worker processes under this one (``verl generate --tp``, the checkpoint's weights; no pushes)."""

    def __init__(self, config: ModelConfig, model_path: str, dtype: torch.dtype = torch.float32,
                 pad_token_id: int = 0, seed: int = 0, max_rows: int = 64, max_seq_len: int = 512,
                 load_format: str = "dummy", engine_args: Mapping[str, Any] | None = None, tp_group: Any = None,
                 worker_tp: int = 1):
        super().__init__(config, pad_token_id)
        if dtype not in NAME_OF_DTYPE:
            raise VLLMConfigError(f"dtype: expected one of {list(NAME_OF_DTYPE)}, found {dtype}")
        self.tp_size, self.tp_rank = check_tp_group(tp_group)
        self.tp_group = tp_group
        if worker_tp > 1 and (tp_group is not None or load_format == "dummy"):
            raise ValueError("worker_tp > 1: expected vLLM's own workers on the checkpoint (no tp_group, no pushes)")
        self.worker_tp = worker_tp
        check_vllm_model(config, max(self.tp_size, worker_tp))
        self.dtype = dtype
        self.specs = rollout_param_specs(config, self.tp_size, self.tp_rank)
        self.offsets, self.numel = spec_offsets(self.specs)
        self.vocab_names = vocab_rollout_names(config)
        # this rank's real rows of each vocab table: its slice of the padded table, less the padding past the vocab
        self.vocab_real_rows = {s.name: max(0, min(s.shape[0], config.vocab_size - self.tp_rank * s.shape[0]))
                                for s in self.specs if s.name in self.vocab_names}
        self.stacked = stacked_expert_parts(config)
        self._buffer: torch.Tensor | None = None
        # The engine core in this process: the reload passes tensors by reference, and no engine process outlives
        # a killed rank.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's CPU backend sizes its KV cache from this (GiB); the default (4) is far more than a rollout needs.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-self._kv_bytes(max_rows, max_seq_len) // 2**30))))
        import vllm

        self._vllm = vllm
        args = dict(model=model_path, skip_tokenizer_init=True, dtype=NAME_OF_DTYPE[dtype], seed=seed,
                    max_model_len=max_seq_len, max_num_seqs=max_rows, enforce_eager=True, load_format=load_format,
                    logprobs_mode="processed_logprobs", disable_log_stats=True)
        self._shm_ident = None
        if self.tp_size > 1:  # one TP worker per rank, in this process, over the trainer's ranks
            args.update(tensor_parallel_size=self.tp_size, distributed_executor_backend="external_launcher")
            self._shm_ident = job_shm_ident(tp_group)
        elif worker_tp > 1:  # vLLM's multiprocessing executor: a worker process per TP rank
            args.update(tensor_parallel_size=worker_tp, distributed_executor_backend="mp")
            if not is_cuda_available():  # vLLM's CPU workers bind one NUMA node each by default; a node has one
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        args.update(engine_args or {})
        with shm_names_of_this_job(self._shm_ident) if self._shm_ident else contextlib.nullcontext():
            self.llm = vllm.LLM(**args)

    # The agent loops' token server (the batching one the native engine uses) over this engine: no K/V kept by the
    # server itself (vLLM's prefix cache holds each trajectory's prefix between turns).
    prefix_caching = False

    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """verl's token-in/token-out server for agent loops: the turns in flight batched into one
        :meth:`generate_responses` call with per-row budgets, cut between rounds by an interrupt (the asynchronous
        trainers) and resumed (:class:`~verl.engine.rollout.native.token_server.TokenServer`)."""
        from verl.engine.rollout.native.token_server import TokenServer

        return TokenServer(self, base, self.pad_token_id if pad_token_id is None else pad_token_id)

    def _kv_bytes(self, rows: int, seq_len: int) -> int:
        c = self.config
        heads = kv_heads_per_rank(c, self.tp_size)  # vLLM replicates a head over TP > heads, as the layout does
        return 2 * c.num_hidden_layers * heads * c.head_dim * self.dtype.itemsize * rows * seq_len

    # ---------------------------------------------------------------- weights
    def weight_buffer(self) -> torch.Tensor:
        """This rank's flat rollout buffer for the reshard to write (kept across steps)."""
        if self.worker_tp > 1:
            raise RuntimeError("vllm weight_buffer: an engine over its own TP workers serves its checkpoint, no pushes")
        if self._buffer is None:
            self._buffer = torch.empty(self.numel, dtype=self.dtype)
        return self._buffer

    def push_weights(self) -> dict[str, float]:
        """The resharded buffer -> vLLM's parameters, by name (:meth:`load_weights`)."""
        if self._buffer is None:
            raise RuntimeError("vllm push: expected a resharded weight buffer, found none (reshard first)")
        start = time.perf_counter()
        flat = self._buffer
        self.load_weights((s.name, flat[self.offsets[s.name]:self.offsets[s.name] + s.numel].view(s.shape))
                          for s in self.specs)
        return {METRIC_PUSH_SECONDS: time.perf_counter() - start}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rollout-layout tensors (names of ``rollout_param_specs``, this TP rank's) -> vLLM's model, in place."""
        shapes = {s.name: s.shape for s in self.specs}
        shards: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if tuple(tensor.shape) != shapes.get(name, ()):
                raise RolloutInputError(f"vllm load_weights {name}: expected a rollout tensor of shape "
                                        f"{shapes.get(name)}, found {tuple(tensor.shape)}")
            shards[name] = tensor
        missing = sorted(set(shapes) - set(shards))
        if missing:
            raise RolloutInputError(f"vllm load_weights: expected every rollout tensor, found {missing[:3]} missing")
        if self.tp_size > 1:
            model_config = self.llm.llm_engine.vllm_config.model_config
            self.llm.apply_model(lambda model: load_rank_shards(model, model_config, shards, self.vocab_real_rows))
        else:
            # vLLM's reload in checkpoint format: the vocab tables without the layout's padding rows (vLLM pads its
            # own), a stacked expert tensor as its per-expert HF parts
            vocab = self.config.vocab_size
            tensors = [named for name, tensor in shards.items()
                       for named in checkpoint_named(name, tensor[:vocab] if name in self.vocab_names else tensor,
                                                     self.stacked)]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors),
                                                              "is_checkpoint_format": True})
        if self.config.tie_word_embeddings:
            self.llm.apply_model(refresh_tied_head)
        if self.stacked:
            self.llm.apply_model(refresh_cpu_moe_packing)
        self.llm.reset_prefix_cache()  # cached K/V belongs to the old weights

    def release(self) -> None:
        """Between phases: cached prefixes go (their K/V is of the old weights). vLLM's CPU backend has no sleep
        mode, so its KV pool stays allocated (sized by VLLM_CPU_KVCACHE_SPACE)."""
        self.llm.reset_prefix_cache()

    def resume(self) -> None:
        """Nothing was released that must come back (see :meth:`release`)."""

    def resident_tensors(self) -> list[torch.Tensor]:
        return [] if self._buffer is None else [self._buffer]

    def shutdown(self) -> None:
        """Drop the engine (its core runs in this process) and the push buffer; idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        self._buffer = None
        if llm is not None:
            with default_group_kept():
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
        if getattr(self, "_shm_ident", None):
            remove_shm(self._shm_ident)

    # ---------------------------------------------------------------- generation
    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           sampling_params: SamplingParams, pad_token_id: int, limits: torch.Tensor | None = None,
                           stop: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts [B, P] -> (responses, response_mask, rollout_log_probs) [B*n, R]. Partial rollout
        (:mod:`verl.engine.rollout.partial`, n=1): ``limits`` [B] caps each row's new tokens; with a ``stop`` rule
        the rows generate in rounds of at most :data:`SEGMENT_ROUND_TOKENS` tokens, the rule checked between rounds
        (vLLM's offline ``generate`` returns a batch whole); a row's next round resubmits its prompt and tokens so
        far, which vLLM's prefix cache holds."""
        from vllm.inputs import TokensPrompt

        if limits is not None:
            return self._generate_limited(input_ids, attention_mask, sampling_params, pad_token_id, limits, stop)
        prompts = [TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
                   for row, mask in zip(input_ids, attention_mask, strict=True)]
        outputs = self.llm.generate(prompts, vllm_sampling_params(sampling_params, self._vllm), use_tqdm=False)
        n, length = sampling_params.n, sampling_params.response_length
        rows = len(prompts) * n
        responses = torch.full((rows, length), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((rows, length), dtype=torch.int64)
        log_probs = torch.zeros((rows, length), dtype=torch.float32)
        for i, request in enumerate(outputs):
            if len(request.outputs) != n:
                raise RuntimeError(f"vllm: expected {n} samples of prompt {i}, found {len(request.outputs)}")
            for j, sample in enumerate(sorted(request.outputs, key=lambda c: c.index)):
                ids = list(sample.token_ids)[:length]
                row = i * n + j
                responses[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
                mask[row, :len(ids)] = 1
                log_probs[row, :len(ids)] = torch.tensor([entry[tok].logprob for tok, entry
                                                          in zip(ids, sample.logprobs, strict=False)])
        return responses, mask, log_probs

    def _generate_limited(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sp: SamplingParams,
                          pad_token_id: int, limits: torch.Tensor,
                          stop: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from vllm.inputs import TokensPrompt

        if sp.n != 1:
            raise RolloutInputError(f"vllm generate with per-row limits: expected n=1, found n={sp.n}")
        prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]
        budgets = [int(b) for b in limits.tolist()]

        def run_round(requests: list[RoundRequest]) -> list[RoundResult]:
            params = [vllm_sampling_params(dataclasses.replace(sp, response_length=r.max_new_tokens, seed=r.seed),
                                           self._vllm) for r in requests]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r.tokens) for r in requests], params,
                                        use_tqdm=False)
            results = []
            for i, request in enumerate(outputs):
                sample = request.outputs[0]
                if sample.finish_reason == "abort":
                    raise RuntimeError(f"vllm: request {i} was aborted by vLLM")
                ids = list(sample.token_ids)
                results.append(RoundResult(ids, [entry[tok].logprob for tok, entry
                                                 in zip(ids, sample.logprobs, strict=False)],
                                           sample.finish_reason == "stop"))
            return results

        return generate_in_rounds(prompts, budgets, sp, run_round, max(budgets, default=0), pad_token_id, stop,
                                  SEGMENT_ROUND_TOKENS, self.tp_group)
