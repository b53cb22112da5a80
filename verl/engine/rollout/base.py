"""The rollout interface every engine implements, and the sampling parameters it takes.

An engine turns left-padded prompts into sampled responses. Shapes: ``B`` prompts, ``P`` padded
prompt length, ``n`` samples per prompt, ``R`` = ``response_length``; outputs have ``B*n`` rows,
sample ``j`` of prompt ``i`` at row ``i*n + j`` (verl's interleaved repeat).

Output fields (verl names):
- ``prompts`` [B*n, P], ``responses`` [B*n, R] (padded with ``pad_token_id`` after a stop),
- ``response_mask`` [B*n, R]: 1 up to and including the stop token,
- ``rollout_log_probs`` [B*n, R] float32: log-softmax of ``logits / temperature`` over the whole
  vocabulary (before top-k/top-p truncation), taken at the sampled token -- the quantity the actor
  recomputes as ``old_log_probs``; raw log-softmax when greedy; 0 where ``response_mask`` is 0,
- ``input_ids``/``attention_mask``/``position_ids`` [B*n, P+R]: prompt and response joined.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from verl.errors import InputError
from verl.models.config import ModelConfig


class RolloutInputError(InputError):
    """Prompts or sampling parameters an engine cannot generate from."""


def _ids(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        value = (value,)
    ids = tuple(value)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise RolloutInputError(f"{key}: expected non-negative token ids, found {value!r}")
    return ids


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings under verl's rollout config names.

    Greedy (argmax) when ``do_sample`` is False or ``temperature`` is 0. ``top_k`` -1 or 0 and
    ``top_p`` 1.0 disable truncation. A sequence stops after emitting a token of
    ``stop_token_ids`` or of ``eos_token_id`` (unless ``ignore_eos``); the stop token is kept.
    ``seed`` fixes the sampling generator of one request; None draws a fresh seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: int = 512
    n: int = 1
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", _ids(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "eos_token_id", _ids(self.eos_token_id, "eos_token_id"))
        if not self.temperature >= 0:
            raise RolloutInputError(f"temperature: expected >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RolloutInputError(f"top_p: expected 0 < top_p <= 1, found {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RolloutInputError(f"top_k: expected -1/0 (disabled) or a positive integer, found {self.top_k!r}")
        if not isinstance(self.response_length, int) or self.response_length < 1:
            raise RolloutInputError(
                f"response_length (max_new_tokens): expected a positive integer, found {self.response_length!r}"
            )
        if not isinstance(self.n, int) or self.n < 1:
            raise RolloutInputError(f"n: expected a positive integer, found {self.n!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise RolloutInputError(f"seed: expected an integer or None, found {self.seed!r}")

    @property
    def max_new_tokens(self) -> int:
        return self.response_length

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token id that ends a sequence."""
        eos = () if self.ignore_eos else self.eos_token_id
        return tuple(sorted(set(self.stop_token_ids) | set(eos)))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SamplingParams:
        """From a verl rollout config mapping; accepts ``max_new_tokens`` for ``response_length``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = dict(config)
        if "max_new_tokens" in values:
            alias = values.pop("max_new_tokens")
            if "response_length" in values and values["response_length"] != alias:
                raise RolloutInputError(
                    f"response_length={values['response_length']} and max_new_tokens={alias} disagree: give one"
                )
            values["response_length"] = alias
        unknown = sorted(set(values) - fields)
        if unknown:
            raise RolloutInputError(f"sampling params: expected keys among {sorted(fields)}, found {unknown}")
        return cls(**values)


def replica_seed(seed: int, replica: int) -> int:
    """The sampling seed of rollout replica ``replica`` for a call seeded ``seed``: replicas draw different streams,
    the same ones whether they run colocated or in a standalone pool."""
    return int(seed) * 1009 + replica


def replica_params(params: SamplingParams, seed: int | None, replica: int) -> SamplingParams:
    """``params`` for one replica's share of a call seeded ``seed`` (None: unseeded, unchanged)."""
    return params if seed is None else dataclasses.replace(params, seed=replica_seed(seed, replica))


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int, context: int,
                  response_length: int) -> None:
    """Raise one RolloutInputError if the prompts are not a valid left-padded batch for the model."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise RolloutInputError(
            f"prompts: expected input_ids and attention_mask of one shape [B, P], "
            f"found {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if input_ids.shape[0] == 0:
        raise RolloutInputError("prompts: expected at least one prompt, found an empty batch")
    if input_ids.is_floating_point():
        raise RolloutInputError(f"input_ids: expected integer token ids, found dtype {input_ids.dtype}")
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0])
        raise RolloutInputError(f"prompt {row}: expected at least one token, found an empty prompt")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        row = int((mask[:, 1:] < mask[:, :-1]).any(-1).nonzero()[0])
        raise RolloutInputError(f"prompt {row}: expected left padding (mask 0...0 1...1), found a gap in its mask")
    tokens = input_ids[mask]
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise RolloutInputError(
            f"input_ids: expected token ids in [0, {vocab_size}), found {int(tokens.min())}..{int(tokens.max())}"
        )
    longest = int(lengths.max())
    if longest + response_length > context:
        raise RolloutInputError(
            f"prompt length {longest} + response_length {response_length} exceeds the model context "
            f"(max_position_embeddings={context})"
        )


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded mask [B, P] -> int64 positions: 0 at the first real token, padding clamped to 0."""
    return (attention_mask.to(torch.int64).cumsum(-1) - 1).clamp_(min=0)


def assemble_rollout_batch(prompts: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor,
                           response_mask: torch.Tensor, rollout_log_probs: torch.Tensor,
                           response_attention: torch.Tensor | None = None) -> dict:
    """Join repeated prompts [B*n, P] and responses [B*n, R] into verl's rollout output fields.

    Position ids restart at 0 on the first real prompt token and run on through the response.
    ``response_attention``: the response tokens attended to, when they are more than the trained ones
    (``response_mask`` 0 on an agent's tool / user tokens); by default the response mask.
    """
    mask = attention_mask.to(torch.int64)
    prompt_positions = prompt_position_ids(mask)
    steps = torch.arange(1, responses.shape[1] + 1, dtype=torch.int64)
    response_positions = prompt_positions[:, -1:] + steps
    response_mask = response_mask.to(torch.int64)
    attended = response_mask if response_attention is None else response_attention.to(torch.int64)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": torch.cat([mask, attended], dim=-1),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=-1),
    }


def _repeat_rows(value: Any, n: int) -> Any:
    if n == 1:
        return value
    if isinstance(value, np.ndarray):
        return np.repeat(value, n, axis=0)
    return [item for item in value for _ in range(n)]


class BaseRollout(abc.ABC):
    """A rollout engine on one rollout TP rank: generation, weight loading, memory release.

    ``generate`` is the core (plain tensors in, dict of tensors out); ``generate_sequences`` is the
    DataProto face the trainer calls. ``meta_info`` keys honoured there: ``do_sample`` (False gives
    greedy with n=1, verl's validation mode), ``eos_token_id`` and ``pad_token_id``.
    """

    # An engine driven from one rank of its TP group (SGLang's group engine): the other ranks hold no engine, return
    # None from ``generate_sequences`` and take no part in a segment's stop rule. False: every rank generates.
    owner_generates: bool = False
    # Takes ``swap_weight_buffer``: a standalone pool fills a staging buffer while the engine reads the old one.
    swaps_weight_buffer: bool = False

    def __init__(self, config: ModelConfig, pad_token_id: int = 0):
        self.config = config
        self.pad_token_id = pad_token_id
        # verl's rollout.enable_rollout_routing_replay, for engines declaring routing_recording: ``generate``
        # returns the last call's ``routed_experts`` [B*n, P+R, MoE layers, top k] when set.
        self.record_routing = False
        self.routed_experts: torch.Tensor | None = None

    # ---------------------------------------------------------------- what an engine provides
    @abc.abstractmethod
    def generate_responses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           sampling_params: SamplingParams,
                           pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validated left-padded prompts [B, P] -> (responses, response_mask, rollout_log_probs) [B*n, R]."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy rollout-layout tensors (names of ``rollout_param_specs``) into the engine's weights."""

    def weight_buffer(self) -> torch.Tensor | None:
        """The flat per-rank tensor the hybrid engine writes resharded weights into, in place.

        Laid out as ``rollout_param_specs`` in order. None when the engine keeps its weights out of
        process and has no such buffer (SGLang driven from one process: ``load_weights``).
        """
        return None

    def push_weights(self) -> dict[str, float]:
        """After the hybrid engine wrote ``weight_buffer()``: hand it to the engine; returns timing metrics.
        Nothing to do when that buffer *is* the engine's weights (the native engine); the trainer's SGLang
        rollout (``sglang_group.SGLangGroupRollout``) pushes it to its out-of-process engine."""
        return {}

    def swap_weight_buffer(self, flat: torch.Tensor) -> torch.Tensor:
        """Generate with ``flat`` (laid out as ``weight_buffer()``) from now on; returns the old buffer. Only
        engines declaring ``swaps_weight_buffer``."""
        raise NotImplementedError(f"{type(self).__name__}: no weight buffer swap (swaps_weight_buffer is False)")

    def token_server(self, base: SamplingParams, pad_token_id: int | None = None) -> Any:
        """verl's token-in/token-out server for agent loops over this engine (engines declaring the ``agent_loop``
        capability; see :mod:`verl.engine.rollout.token_server` for what a server provides)."""
        raise NotImplementedError(f"{type(self).__name__}: no agent-loop token server (capability agent_loop)")

    @property
    def is_owner(self) -> bool:
        """Whether this rank returns its group's results (every rank unless ``owner_generates``)."""
        return True

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors the engine holds in this process now (weights, KV cache), for memory metrics."""
        buffer = self.weight_buffer()
        return [] if buffer is None else [buffer]

    def shutdown(self) -> None:  # noqa: B027 - optional: a no-op by default
        """Stop what outlives a step (an engine's own processes, shared-memory names); idempotent. Default:
        nothing (an in-process engine's memory goes with the object)."""

    def __enter__(self) -> BaseRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @abc.abstractmethod
    def release(self) -> None:
        """Free weight and KV-cache memory (weights must be written again before ``resume``d use)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Re-acquire the memory ``release`` freed."""

    # ---------------------------------------------------------------- shared entry points
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling_params: SamplingParams,
                 pad_token_id: int | None = None) -> dict:
        """Left-padded prompts [B, P] -> dict of verl rollout output tensors (see module doc)."""
        check_prompts(input_ids, attention_mask, self.config.vocab_size, self.config.max_position_embeddings,
                      sampling_params.response_length)
        pad = self.pad_token_id if pad_token_id is None else pad_token_id
        responses, response_mask, log_probs = self.generate_responses(input_ids, attention_mask, sampling_params, pad)
        n = sampling_params.n
        out = assemble_rollout_batch(input_ids.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0),
                                     responses, response_mask, log_probs)
        if self.record_routing and self.routed_experts is not None:
            # Recorded over the longest response; the batch's responses are that long too.
            out["routed_experts"] = self.routed_experts[:, :out["input_ids"].shape[1]]
        return out

    def generate_sequences(self, prompts: Any, sampling_params: SamplingParams) -> Any:
        """DataProto-like batch (``.batch`` with input_ids/attention_mask, ``.non_tensor_batch``,
        ``.meta_info``) -> a batch of the same type with the rollout fields, ``n`` rows per prompt.

        Incoming ``position_ids`` are not read: positions follow from the left-padded mask.
        """
        meta = dict(prompts.meta_info or {})
        overrides = {}
        if meta.get("do_sample") is False:
            overrides.update(do_sample=False, n=1)
        if meta.get("eos_token_id") is not None:
            overrides["eos_token_id"] = meta["eos_token_id"]
        if overrides:
            sampling_params = dataclasses.replace(sampling_params, **overrides)
        out = self.generate(prompts.batch["input_ids"], prompts.batch["attention_mask"], sampling_params,
                            pad_token_id=meta.get("pad_token_id"))
        non_tensor = {k: _repeat_rows(v, sampling_params.n) for k, v in (prompts.non_tensor_batch or {}).items()}
        return type(prompts)(batch=out, non_tensor_batch=non_tensor, meta_info=meta)
