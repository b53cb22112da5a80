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
passed by reference, not serialized. Rollout TP 1 here: vLLM's own TP runs one worker process per rank, which this
build does not feed shard by shard yet (the registry refuses TP > 1 in one line).

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
from verl.models.rollout_shapes import rollout_param_specs
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
    if tp_size != 1:
        raise VLLMConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size}: the vLLM rollout here "
                              "runs TP 1 (vLLM's own TP worker processes are not fed shard by shard yet): use 1, or "
                              "rollout.name=native / sglang for rollout TP > 1")
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
    the first push (the trainer); ``"auto"``: the checkpoint's (``verl generate``)."""

    def __init__(self, config: ModelConfig, model_path: str, dtype: torch.dtype = torch.float32,
                 pad_token_id: int = 0, seed: int = 0, max_rows: int = 64, max_seq_len: int = 512,
                 load_format: str = "dummy", engine_args: Mapping[str, Any] | None = None):
        super().__init__(config, pad_token_id)
        if dtype not in NAME_OF_DTYPE:
            raise VLLMConfigError(f"dtype: expected one of {list(NAME_OF_DTYPE)}, found {dtype}")
        check_vllm_model(config, 1)
        self.dtype = dtype
        self.specs = rollout_param_specs(config, 1, 0)
        self.offsets, self.numel = spec_offsets(self.specs)
        self.vocab_names = vocab_rollout_names(config)
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
        args.update(engine_args or {})
        self.llm = vllm.LLM(**args)

    # The agent loops' token server (the batching one the native engine uses) over this engine: one replica, and
    # no K/V kept by the server itself (vLLM's prefix cache holds each trajectory's prefix between turns).
    tp_size = 1
    prefix_caching = False

    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """verl's token-in/token-out server for agent loops: the turns in flight batched into one
        :meth:`generate_responses` call with per-row budgets, cut between rounds by an interrupt (the asynchronous
        trainers) and resumed (:class:`~verl.engine.rollout.native.token_server.TokenServer`)."""
        from verl.engine.rollout.native.token_server import TokenServer

        return TokenServer(self, base, self.pad_token_id if pad_token_id is None else pad_token_id)

    def _kv_bytes(self, rows: int, seq_len: int) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize * rows * seq_len

    # ---------------------------------------------------------------- weights
    def weight_buffer(self) -> torch.Tensor:
        """This rank's flat rollout buffer for the reshard to write (kept across steps)."""
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
        """Rollout-layout tensors (names of ``rollout_param_specs``) -> vLLM's model, in place (vLLM's reload)."""
        shapes = {s.name: s.shape for s in self.specs}
        vocab = self.config.vocab_size
        tensors, seen = [], set()
        for name, tensor in named_tensors:
            if tuple(tensor.shape) != shapes.get(name, ()):
                raise RolloutInputError(f"vllm load_weights {name}: expected a rollout tensor of shape "
                                        f"{shapes.get(name)}, found {tuple(tensor.shape)}")
            tensors.extend(checkpoint_named(name, tensor[:vocab] if name in self.vocab_names else tensor,
                                            self.stacked))
            seen.add(name)
        missing = sorted(set(shapes) - seen)
        if missing:
            raise RolloutInputError(f"vllm load_weights: expected every rollout tensor, found {missing[:3]} missing")
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
                                  SEGMENT_ROUND_TOKENS)
