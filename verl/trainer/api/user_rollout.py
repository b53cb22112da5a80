"""A DataFlow's own rollout node (document 000): a plain function ``rollout(prompts) -> texts`` that generates however
it likes (``model.generate`` of a model it loaded itself) stands in for the rollout engine.

Its texts are tokenized with the actor's tokenizer (right-padded to ``data.max_response_length``, cut there, with the
eos token after a text that fits: the response ended) into the rollout fields the PPO step reads (``responses``,
``response_mask``, ``input_ids``, ``attention_mask``, ``position_ids``, verl's names); the step then computes the old
log-probs with the actor, as for every rollout, and trains on them. There are no rollout log-probs (the function
returns text only), so what reads them (``rollout_correction``, its ``bypass_mode``) is refused before training.

Every rank of a launch runs the same controller code (SPMD): rank 0 calls the function and its texts reach the others,
so the ranks train on one batch.
"""

from __future__ import annotations

from typing import Any

from verl.errors import InputError


def prompt_texts(prompts: Any, tokenizer: Any) -> list[str]:
    """Each row's prompt as the user wrote it: the last user message of ``raw_prompt`` (the dataset's chat) when the
    batch has it, else the decoded prompt tokens."""
    raw = prompts.non_tensor_batch.get("raw_prompt") if prompts.non_tensor_batch else None
    texts = []
    for i, row in enumerate(prompts.batch["input_ids"]):
        chat = raw[i] if raw is not None else None
        if isinstance(chat, (list, tuple)) and chat and isinstance(chat[-1], dict) and "content" in chat[-1]:
            texts.append(str(chat[-1]["content"]))
        else:
            mask = prompts.batch["attention_mask"][i].bool()
            texts.append(tokenizer.decode(row[mask].tolist(), skip_special_tokens=True))
    return texts


PROMPTS_SEEN, TEXTS_RETURNED = "dataflow_rollout_prompts", "dataflow_rollout_texts"  # per-row non-tensor fields


class UserRolloutGroup:
    """The trainer's actor worker group with ``generate_sequences`` from a user's function (every other call goes to
    the group: log-probs, updates, checkpoints). ``call``: the node's function over a list of prompt texts, returning
    one text per prompt (the DataFlow's node call, which checks its outputs)."""

    def __init__(self, group: Any, call: Any, tokenizer: Any, n: int, response_length: int, node: str):
        self._group, self._call, self.tokenizer = group, call, tokenizer
        self.n, self.response_length, self.node = n, response_length, node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def update_weights(self) -> dict[str, float]:
        """No weights move: the user's function generates, not the rollout engine."""
        return {}

    def generate_sequences(self, prompts: Any) -> Any:
        import numpy as np
        import torch

        from verl.engine.rollout.base import assemble_rollout_batch
        from verl.protocol import DataProto

        if not isinstance(prompts, DataProto):
            raise InputError(f"dataflow node {self.node!r}: a user rollout expected the prompts in this process "
                             f"(transfer_queue.enable=false), found {type(prompts).__name__}")
        meta = dict(prompts.meta_info or {})
        n = 1 if meta.get("validate") or meta.get("do_sample") is False else self.n
        texts = [t for t in prompt_texts(prompts, self.tokenizer) for _ in range(n)]
        responses = _from_rank_0(lambda: self._call(texts))
        if not isinstance(responses, (list, tuple)) or len(responses) != len(texts) or \
                not all(isinstance(r, str) for r in responses):
            found = type(responses).__name__ if not isinstance(responses, (list, tuple)) else \
                f"{len(responses)} values of {sorted({type(r).__name__ for r in responses})}"
            raise InputError(f"dataflow node {self.node!r}: expected {len(texts)} response texts (one str per prompt "
                             f"it was given), found {found}")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        ids = torch.full((len(texts), self.response_length), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, (prompt, text) in enumerate(zip(texts, responses, strict=True)):
            # model.generate's output decoded whole starts with the prompt: the response is what follows it.
            text = text[len(prompt):] if prompt and text.startswith(prompt) else text
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"][:self.response_length]
            if len(tokens) < self.response_length and eos is not None:
                tokens = [*tokens, eos]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, :len(tokens)] = 1
        prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
        prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
        fields = assemble_rollout_batch(prompt_ids, prompt_mask, ids, mask, rollout_log_probs=None)
        fields.pop("rollout_log_probs")
        non_tensors = {k: np.repeat(v, n, axis=0) if isinstance(v, np.ndarray) else [x for x in v for _ in range(n)]
                       for k, v in (prompts.non_tensor_batch or {}).items()}
        # What the function was given and returned, as it saw them (the dataflow's debug output prints them).
        non_tensors[PROMPTS_SEEN] = np.array(texts, dtype=object)
        non_tensors[TEXTS_RETURNED] = np.array(list(responses), dtype=object)
        meta["metrics"] = {}
        return DataProto.from_dict(fields, non_tensors, meta)


def _from_rank_0(produce: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return produce()
    box = [produce() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
