"""The SGLang rollout engine: one ``sglang.Engine`` (all of a rollout TP group's ranks), driven from one process.

The engine runs SGLang's model in its own processes (one per rollout TP rank). Prompts go in as
token ids (no tokenizer: ``skip_tokenizer_init``); responses come back with per-token logprobs and
are returned in verl's fields through :class:`BaseRollout`. Weights arrive as serialized buckets of
each rollout TP rank's flat buffer (``rollout_param_specs`` order, as the hybrid engine's executor
produces it): :meth:`SGLangRollout.push_serialized` sends them in one ``update_weights_from_tensor``
call with our custom loader (``sglang_loader``), which copies each bucket into SGLang's parameters
with ``verl._C`` copy programs. :meth:`SGLangRollout.update_weights` does it for buffers all held by
this process (``verl generate``, the benches); in the trainer every rank holds its own and
``sglang_group.SGLangGroupRollout`` gathers only their handles. On CPU the engine uses SGLang's
torch-native attention and no CUDA graphs (the route in launch/setup_sglang.sh).

Semantics that differ from the native engine (SGLang's own behaviour, kept):
- besides ``stop_ids``, SGLang also stops at the model config's ``eos_token_id`` unless nothing is
  asked to stop a sequence (then every sequence runs ``response_length`` tokens, ``ignore_eos``);
- sampled (non-greedy) logprobs are SGLang's: log-probabilities of the temperature-scaled
  distribution it samples from; greedy logprobs are the raw log-softmax, as in the native engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from verl.engine.rollout.base import BaseRollout, SamplingParams
from verl.engine.rollout.partial import RoundResult, generate_in_rounds
from verl.engine.rollout.sglang_loader import LOADER_PATH, bucket_name, spec_offsets
from verl.engine.rollout.sglang_requests import SGLangRolloutError, sglang_sampling_params
from verl.errors import InputError
from verl.hybrid_engine.planner import DEFAULT_BUCKET_BYTES
from verl.models.config import ModelConfig
from verl.models.rollout_shapes import rollout_param_specs
from verl.utils.device import get_device_name
from verl.utils.torch_dtypes import NAME_OF_DTYPE

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
# Partial rollout with a stop rule: tokens per round between checks of the rule. Each round is one batch through
# SGLang's scheduler (tens of ms on CPU), so a round much shorter than a response only adds that overhead; much
# longer, and a segment overruns the point it should have stopped at by that much.
SEGMENT_ROUND_TOKENS = 16


def bucket_ranges(numel: int, bucket_elems: int) -> list[tuple[int, int]]:
    """``[start, end)`` element ranges of at most ``bucket_elems`` covering ``numel`` elements."""
    return [(start, min(start + bucket_elems, numel)) for start in range(0, numel, bucket_elems)]


class SGLangConfigError(SGLangRolloutError, InputError):
    """SGLang rollout settings the engine cannot run with (a dtype, a bucket size, a TP on CPU): bad input."""


def bucket_elems(dtype: torch.dtype, bucket_bytes: int) -> int:
    """Elements of ``dtype`` in a bucket of at most ``bucket_bytes`` (at least one element)."""
    element = torch.empty((), dtype=dtype).element_size()
    if bucket_bytes < element:
        raise SGLangConfigError(f"bucket_bytes: expected >= one element ({element} bytes), found {bucket_bytes}")
    return bucket_bytes // element


def serialize_handle(tensor: torch.Tensor) -> bytes:
    """What SGLang's ``MultiprocessingSerializer.serialize`` makes of a tensor (a ForkingPickler dump with torch's
    reductions: a shared-memory name or a CUDA IPC handle, never the data), without importing SGLang: a rank
    that owns no engine would otherwise pay SGLang's ~17 s import on 2 cores just to pickle handles."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor and storage reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensor)
    return buf.getvalue()


def check_cpu_tp(config: ModelConfig, tp_size: int) -> None:
    """SGLang's CPU path pads attention heads instead of replicating KV heads (see sglang_loader),
    so a rollout-layout weight push matches it only when tp divides both head counts."""
    if config.num_key_value_heads % tp_size or config.num_attention_heads % tp_size:
        raise SGLangConfigError(
            f"rollout tp={tp_size} on CPU: expected a tp dividing num_key_value_heads="
            f"{config.num_key_value_heads} (SGLang pads heads on CPU, so weight pushes cannot match), "
            f"found tp={tp_size}"
        )


# The block features beyond the Llama/Qwen block (ModelConfig.block_features) that SGLang's own model computes and
# our weight push feeds, each checked against transformers in the SGLang tier (issue 58's real checkpoint, which has
# all of them: a prompt past its sliding window, before and after a push of every parameter). Any other is refused.
SGLANG_BLOCK_FEATURES = ("hidden_act", "norm_weight_offset", "norm_scale_in_float32", "embedding_multiplier",
                         "sliding_rope_theta", "sliding_window", "sliding_layers", "attn_post_norm", "mlp_post_norm")


def check_sglang_model(config: ModelConfig) -> None:
    """Qwen3-MoE through SGLang 0.5.x: every layer sparse runs and matches transformers' greedy ids (tested);
    a dense layer among them (``mlp_only_layers`` / ``decoder_sparse_step`` > 1) does not (measured: greedy ids
    diverge from transformers' at the first token on such a layer), so it is refused. A block feature outside
    :data:`SGLANG_BLOCK_FEATURES` was never checked against transformers on SGLang, so it is refused too."""
    untested = [f for f in config.block_features() if f not in SGLANG_BLOCK_FEATURES]
    if untested:
        raise SGLangConfigError(f"actor_rollout_ref.rollout.name=sglang: model_type {config.model_type} needs the "
                                f"block features {untested}, which the SGLang rollout is not tested for: use native")
    if config.is_moe and len(config.moe_layers) != config.num_hidden_layers:
        dense = sorted(set(range(config.num_hidden_layers)) - set(config.moe_layers))
        raise SGLangConfigError(f"{config.model_type} with dense layers {dense}: expected every layer sparse for the "
                                f"SGLang rollout (SGLang diverges from transformers on Qwen3-MoE's dense layers); use "
                                f"the native engine")


def kv_pool_tokens(rows: int, seq_len: int) -> int:
    """A KV pool for ``rows`` sequences of up to ``seq_len`` tokens (``max_total_tokens``): SGLang
    otherwise sizes it from free host memory on CPU (GBs, seconds to allocate)."""
    return max(16384, 4 * rows * seq_len)


def cpu_threads_bind(tp_size: int, cpus: Sequence[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value giving each TP rank its own block of the usable cores.

    With fewer cores than ranks, ranks share cores round-robin (slow, but it runs).
    """
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < tp_size:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(tp_size))
    per_rank = len(cpus) // tp_size
    groups = [cpus[r * per_rank:(r + 1) * per_rank] for r in range(tp_size)]
    return "|".join(",".join(str(c) for c in g) if g[-1] - g[0] + 1 != len(g)
                    else (f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0])) for g in groups)


def reserve_loopback_port(low: int = 20000, high: int = 29999, attempts: int = 64) -> socket.socket:
    """A socket bound (not listening) to a free 127.0.0.1 port in ``[low, high]``: the port stays this process's
    while the socket is open. Drawn from a generator of this process's own: the trainer seeds the global
    ``random`` the same on every rank, so draws from it gave two engines started together the same port."""
    import random

    rng = random.Random(int.from_bytes(os.urandom(8), "little"))
    for port in rng.sample(range(low, high + 1), attempts):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        return sock
    raise SGLangRolloutError(f"no free loopback port in [{low}, {high}] after {attempts} tries")


# SGLang's rendezvous of its scheduler processes is ``tcp://127.0.0.1:<nccl_port>``, but torch's TCPStore binds
# every interface ([::]) whatever host the address names: an unauthenticated listener that anyone on the network
# could reach (issue 44). A ``file://`` store in a private directory replaces it (SGLang's own override for an
# externally managed store), and gloo among the schedulers (one host) is pinned to loopback.
RENDEZVOUS_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"


def engine_child_env(rendezvous_dir: str, port: int, device: str) -> dict[str, str]:
    """The environment SGLang's processes start with (on top of ours): a file rendezvous, gloo on loopback and,
    on CPU, MASTER_ADDR/MASTER_PORT of this engine alone: SGLang's shared-memory all-reduce names its /dev/shm
    segments from them (it derived them from the tcp:// address before), so two engines on a host must differ."""
    env = {RENDEZVOUS_ENV: f"file://{os.path.join(rendezvous_dir, 'store')}", "GLOO_SOCKET_IFNAME": "lo"}
    if device == "cpu":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` inside the block (for the processes started there), the previous
    values (or their absence) restored after."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class SGLangRollout(BaseRollout):
    """An ``sglang.Engine`` over one rollout TP group (``tp_size`` SGLang worker processes).

    ``model_path`` is an HF directory: SGLang builds the model from its config and loads its
    weights at start; later weights arrive through :meth:`update_weights`. ``device`` None picks
    CUDA when available, else CPU. ``engine_kwargs`` are passed to ``sglang.Engine`` last.
    """

    def __init__(self, config: ModelConfig, model_path: str, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | None = None, pad_token_id: int = 0, seed: int = 0,
                 mem_fraction_static: float = 0.2, **engine_kwargs: Any):
        super().__init__(config, pad_token_id)
        for rank in range(tp_size):  # fail here, with our message, on a tp the layout cannot split
            rollout_param_specs(config, tp_size, rank)
        if dtype not in NAME_OF_DTYPE:
            raise SGLangConfigError(f"dtype: expected one of {list(NAME_OF_DTYPE)}, found {dtype}")
        self.tp_size = tp_size
        self.dtype = dtype
        self.device = device or get_device_name()
        if self.device == "cpu":
            check_cpu_tp(config, tp_size)
            # SGLang picks its CPU code paths at import time from this variable (is_cpu()).
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        import sglang  # only the SGLang environment has it

        args: dict[str, Any] = dict(
            model_path=model_path, tp_size=tp_size, dtype=NAME_OF_DTYPE[dtype], device=self.device,
            random_seed=seed, skip_tokenizer_init=True, skip_server_warmup=True, log_level="error",
            mem_fraction_static=mem_fraction_static, custom_weight_loader=[LOADER_PATH],
        )
        if self.device == "cpu":
            args.update(attention_backend="torch_native", disable_cuda_graph=True)
            if tp_size > 1:  # SGLang binds each CPU rank's OpenMP threads to the cores listed here
                os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp_size))
        args.update(engine_kwargs)
        self._port: socket.socket | None = None
        self._rendezvous_cleanup: weakref.finalize | None = None
        child_env: dict[str, str] = {}
        # A rendezvous the user chose (SGLang's override variable, a multi-node dist_init_addr) is kept as it is.
        if not os.environ.get(RENDEZVOUS_ENV) and not args.get("dist_init_addr"):
            if args.get("nccl_port") is None:
                # Held (bound, never listening) while the engine runs: SGLang no longer binds it, and it names
                # the engine's shared-memory segments, so no other engine on this host may draw it meanwhile.
                self._port = reserve_loopback_port()
                args["nccl_port"] = self._port.getsockname()[1]
            rendezvous_dir = tempfile.mkdtemp(prefix="verl_sglang_rdzv_")  # mode 0700: this user's alone
            # Removed at shutdown, or at exit (a crashed start, an owner that never called shutdown).
            self._rendezvous_cleanup = weakref.finalize(self, shutil.rmtree, rendezvous_dir, True)
            child_env = engine_child_env(rendezvous_dir, args["nccl_port"], self.device)
        try:
            with environment(child_env):
                self.engine = sglang.Engine(**args)
        except BaseException:
            self._release_rendezvous()
            raise
        self._specs = [rollout_param_specs(config, tp_size, rank) for rank in range(tp_size)]
        self._released: set = set()

    def _release_rendezvous(self) -> None:
        port, self._port = self._port, None
        if port is not None:
            port.close()
        if self._rendezvous_cleanup is not None:
            self._rendezvous_cleanup()  # runs once; later calls do nothing

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self._release_rendezvous()

    # ---------------------------------------------------------------- memory
    def release(self, tags: Sequence[str] | None = None) -> None:
        """Free SGLang's memory of ``tags`` (among MEMORY_TAGS; all when None) after generation.

        SGLang frees memory only with ``enable_memory_saver`` (needs CUDA); on CPU it only records
        the release. Weights released this way must be pushed again after :meth:`resume`.
        """
        tags = self._tags(tags)
        self._wait_until_idle()
        self.engine.release_memory_occupation(sorted(tags))
        self._released |= tags

    def _wait_until_idle(self, timeout_s: float = 60.0) -> None:
        """SGLang's scheduler asserts it is idle on a release (and dies otherwise), but with its overlap
        schedule the last batch's results are still being processed for a moment after ``generate`` returns
        (seen once in five CI runs). ``flush_cache`` answers, in the scheduler's order, whether it is idle."""
        deadline = time.monotonic() + timeout_s
        while not getattr(self.engine.flush_cache(), "success", True):
            if time.monotonic() > deadline:
                raise SGLangRolloutError(f"release: expected SGLang idle after generation, found requests still "
                                         f"running after {timeout_s:.0f} s")
            time.sleep(0.01)

    def resume(self, tags: Sequence[str] | None = None) -> None:
        """Re-acquire released memory of ``tags`` (all released when None); nothing released: no-op."""
        tags = self._tags(tags) & self._released  # SGLang rejects resuming what it never released
        if tags:
            self.engine.resume_memory_occupation(sorted(tags))
            self._released -= tags

    def _tags(self, tags: Sequence[str] | None) -> set:
        chosen = set(MEMORY_TAGS if tags is None else tags)
        if not chosen <= set(MEMORY_TAGS):
            raise SGLangConfigError(f"memory tags: expected among {MEMORY_TAGS}, found {sorted(chosen)}")
        return chosen

    # ---------------------------------------------------------------- weights
    def rank_numel(self, tp_rank: int) -> int:
        """Elements in rollout TP rank ``tp_rank``'s flat buffer."""
        return spec_offsets(self._specs[tp_rank])[1]

    def bucket_ranges(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[int, int]]:
        """Element ranges ``[start, end)`` cutting one rank's flat buffer into buckets of at most
        ``bucket_bytes`` (every rank's buffer has the same size, so the ranges are the group's)."""
        return bucket_ranges(self.rank_numel(0), bucket_elems(self.dtype, bucket_bytes))

    def update_weights(self, rank_buffers: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Push every TP rank's flat rollout buffer, all held by this process, into the running engine;
        return the bucket count (the trainer's ranks each hold one buffer: :meth:`push_serialized`).

        ``rank_buffers[r]`` is rank r's buffer (``rollout_param_specs(config, tp, r)`` order, the
        engine's dtype). It is cut into buckets of at most ``bucket_bytes``; SGLang rank r opens only
        rank r's buckets (shared memory on CPU, IPC on GPU).
        """
        if len(rank_buffers) != self.tp_size:
            raise SGLangRolloutError(f"update_weights: expected {self.tp_size} rank buffers, found {len(rank_buffers)}")
        for rank, flat in enumerate(rank_buffers):
            self.check_rank_buffer(rank, flat)
        ranges = self.bucket_ranges(bucket_bytes)
        payloads = [[serialize_handle(flat[start:end]) for start, end in ranges] for flat in rank_buffers]
        self.push_serialized(ranges, payloads)
        return len(ranges)

    def check_rank_buffer(self, rank: int, flat: torch.Tensor) -> None:
        want = self.rank_numel(rank)
        if flat.dim() != 1 or flat.numel() != want or flat.dtype != self.dtype:
            raise SGLangRolloutError(
                f"update_weights: rank {rank} expected a 1-D {self.dtype} buffer of {want} elements, "
                f"found {flat.dtype} of shape {tuple(flat.shape)}"
            )

    def push_serialized(self, ranges: Sequence[tuple[int, int]], payloads: Sequence[Sequence[bytes]]) -> None:
        """Load serialized buckets into the engine: ``payloads[r][k]`` is TP rank r's bucket k (elements
        ``ranges[k]`` of its flat buffer), as :func:`serialize_handle` made it in whichever process holds
        that buffer. One ``update_weights_from_tensor`` call carries every bucket (one
        scheduler round trip per push); SGLang rank r deserializes only ``payloads[r]`` and our loader
        copies each bucket into its parameters."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        if len(payloads) != self.tp_size or any(len(p) != len(ranges) for p in payloads):
            raise SGLangRolloutError(f"push: expected {len(ranges)} bucket handles from each of {self.tp_size} "
                                     f"ranks, found {[len(p) for p in payloads]}")
        named = [(bucket_name(start, end), LocalSerializedTensor(values=[payloads[r][k] for r in range(self.tp_size)]))
                 for k, (start, end) in enumerate(ranges)]
        self._check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            self._check(self.engine.update_weights_from_tensor(named, load_format=LOADER_PATH, flush_cache=True),
                        "update_weights_from_tensor")
        finally:
            self._check(self.engine.end_weight_update(), "end_weight_update")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Named rollout-layout tensors of the (single) TP rank -> the engine (TP 1 only).

        Under rollout TP > 1 every rank holds different tensors: use :meth:`update_weights`.
        """
        if self.tp_size != 1:
            raise SGLangRolloutError(
                f"load_weights: expected rollout tp 1 (one rank's tensors), found tp {self.tp_size}; "
                "push every rank's flat buffer with update_weights()"
            )
        offsets, total = spec_offsets(self._specs[0])
        shapes = {spec.name: spec.shape for spec in self._specs[0]}
        flat = torch.empty(total, dtype=self.dtype)
        seen = set()
        for name, tensor in named_tensors:
            if name not in shapes:
                raise SGLangRolloutError(f"load_weights: expected a name of the rollout layout, found {name!r}")
            if tuple(tensor.shape) != shapes[name]:
                raise SGLangRolloutError(f"load_weights {name}: expected shape {shapes[name]}, "
                                         f"found {tuple(tensor.shape)}")
            n = tensor.numel()
            flat[offsets[name]:offsets[name] + n].copy_(tensor.reshape(-1))
            seen.add(name)
        missing = sorted(set(shapes) - seen)
        if missing:
            raise SGLangRolloutError(f"load_weights: expected every rollout tensor, found {missing[:3]} missing")
        self.update_weights([flat])

    @staticmethod
    def _check(result: Any, what: str) -> None:
        # SGLang answers (success, message) tuples or objects with .success/.message.
        success, message = (result[0], result[1]) if isinstance(result, tuple) else (
            getattr(result, "success", True), getattr(result, "message", ""))
        if not success:
            raise SGLangRolloutError(f"SGLang {what} failed: {message}")

    # ---------------------------------------------------------------- generation
    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """verl's token-in/token-out server over this engine for agent loops
        (:class:`verl.engine.rollout.sglang_token_server.SGLangTokenServer`)."""
        from verl.engine.rollout.sglang_token_server import SGLangTokenServer

        return SGLangTokenServer(self, base, self.pad_token_id if pad_token_id is None else pad_token_id)

    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           sampling_params: SamplingParams, pad_token_id: int, limits: torch.Tensor | None = None,
                           stop: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts [B, P] -> (responses, response_mask, rollout_log_probs) [B*n, R].

        Partial rollout (:mod:`verl.engine.rollout.partial`, n=1): ``limits`` [B] caps each row's new tokens
        (SGLang's per-request ``max_new_tokens``); with a ``stop`` rule (:class:`SegmentStop`) the rows generate
        in rounds of at most :data:`SEGMENT_ROUND_TOKENS` tokens and the rule is checked between rounds (SGLang's
        offline engine returns a batch whole, so a round is the finest point to stop at). A row's next round
        sends its prompt and the tokens it has: SGLang's radix cache holds that prefix, so only the new tokens
        are computed. Widths: ``response_length`` without ``limits``, else the largest limit."""
        sp = sampling_params
        mask = attention_mask.bool()
        prompts = [input_ids[i][mask[i]].tolist() for i in range(input_ids.shape[0])]
        if limits is None:
            prompts = [p for p in prompts for _ in range(sp.n)]  # row i*n + j: sample j of prompt i
            budgets = [int(sp.response_length)] * len(prompts)
        else:
            if sp.n != 1:
                raise SGLangRolloutError(f"generate with per-row limits: expected n=1, found n={sp.n}")
            budgets = [int(b) for b in limits.tolist()]
        width = max(budgets, default=0) if limits is not None else int(sp.response_length)
        base = sglang_sampling_params(sp)

        def run_round(requests):
            per_request = [{**base, "max_new_tokens": r.max_new_tokens,
                            **({} if r.seed is None else {"sampling_seed": r.seed})} for r in requests]
            outputs = self.engine.generate(input_ids=[r.tokens for r in requests], sampling_params=per_request,
                                           return_logprob=True)
            if len(outputs) != len(requests):
                raise SGLangRolloutError(f"generate: expected {len(requests)} outputs, found {len(outputs)}")
            results = []
            for i, (out, request) in enumerate(zip(outputs, requests, strict=True)):
                ids = list(out["output_ids"][:request.max_new_tokens])
                logprobs = out["meta_info"]["output_token_logprobs"][:len(ids)]
                if [t[1] for t in logprobs] != ids:
                    raise SGLangRolloutError(f"generate: request {i} logprob token ids disagree with output_ids")
                finish = (out["meta_info"].get("finish_reason") or {}).get("type", "length")
                if finish == "abort":
                    raise SGLangRolloutError(f"generate: request {i} was aborted by SGLang: {out['meta_info']}")
                results.append(RoundResult(ids, [t[0] for t in logprobs], finish != "length"))
            return results

        return generate_in_rounds(prompts, budgets, sp, run_round, width, pad_token_id, stop, SEGMENT_ROUND_TOKENS)
