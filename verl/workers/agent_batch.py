"""One generation call's agent loops (``rollout.multi_turn.enable``): the sync trainer's rollout, validation, and a
standalone pool's ``generate``.

One agent loop per response (the row's ``agent_name`` or ``rollout.agent.default_agent_loop``) over the rollout
engine's token server, all of the replica's trajectories concurrently, to their end. The result is verl's rollout
fields with ``response_mask`` 0 on tool / user tokens, ``rollout_log_probs`` per sampled token, and verl's
``num_turns/*`` and tool metrics. Under rollout TP the group's rank 0 runs the loops and the tools; the others
follow its engine calls (:meth:`TokenServer.follow`) and return None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from verl.protocol import DataProto

# The batch's non-tensor fields an agent loop reads (the dataset's chat messages and the rest of its row).
ROW_FIELDS = ("raw_prompt", "agent_name", "extra_info", "tools_kwargs", "index", "data_source", "reward_model")


def loop_sampling(params: Any) -> dict[str, Any]:
    """The sampling parameters the agent loops send with each turn (verl's names), from the replica's
    :class:`~verl.engine.rollout.base.SamplingParams`; the log-probs always come back."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "logprobs": True}


class AgentBatch:
    """The agent loops of one rollout replica, for whole batches. ``config``: the ``actor_rollout_ref`` section.
    Tools and custom loops are loaded once, at the first batch."""

    def __init__(self, config: Any, tokenizer: Any):
        self.config, self.tokenizer = config, tokenizer
        self.runner = None

    def generate(self, rollout: Any, prompts: DataProto, params: Any, tp_rank: int,
                 prompt_length: int) -> DataProto | None:
        from verl.experimental.agent_loop import AgentLoopRunner, pad_outputs
        from verl.experimental.agent_loop.runner import reward_columns

        meta = dict(prompts.meta_info or {})
        overrides = {}
        if meta.get("do_sample") is False:  # verl's greedy mode (ReMax baselines): one response
            overrides.update(do_sample=False, n=1)
        if meta.get("eos_token_id") is not None:
            eos = meta["eos_token_id"]
            overrides["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        params = dataclasses.replace(params, **overrides) if overrides else params
        pad = meta.get("pad_token_id")
        pad = rollout.pad_token_id if pad is None else int(pad)
        server = rollout.token_server(params, pad)
        if tp_rank != 0:
            server.follow()
            return None
        try:
            non_tensor = dict(prompts.non_tensor_batch or {})
            if "raw_prompt" not in non_tensor:
                raise RuntimeError("rollout.multi_turn.enable: expected the batch's raw_prompt (the dataset's chat "
                                   "messages), found none")
            n = params.n
            keys = [k for k in ROW_FIELDS if k in non_tensor]
            rows = [{k: non_tensor[k][i] for k in keys} for i in range(len(prompts)) for _ in range(n)]
            if self.runner is None:
                self.runner = AgentLoopRunner({"actor_rollout_ref": self.config}, server, self.tokenizer)
            self.runner.server_manager = server
            result = server.run(self.runner.generate(rows, loop_sampling(params)))  # on the engine's event loop
        finally:
            server.close()
        fields = pad_outputs(result.outputs, prompt_length, params.response_length, pad)
        repeated = {k: np.repeat(v, n, axis=0) if n > 1 else v for k, v in non_tensor.items()}
        repeated.update(reward_columns(result.outputs))  # the tools' rewards, for the reward function
        out = DataProto(batch=fields, non_tensor_batch=repeated, meta_info=meta)
        out.meta_info["metrics"] = {**result.metrics, "agent_loop/engine_calls": float(server.calls),
                                    "agent_loop/turns_per_call": server.requests / max(1, server.calls)}
        if server.prompt_tokens:  # the share of turns' prompt tokens the engine's cache held
            out.meta_info["metrics"]["agent_loop/cached_prompt_fraction"] = server.cached_tokens / server.prompt_tokens
        return out
